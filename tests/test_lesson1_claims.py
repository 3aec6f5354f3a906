"""Lesson 1's claims over many cases (the lesson shows and asserts p = 4, m = 8): GPipe's and 1F1B's bubble
rate (p-1)/(m+p-1), 1F1B's memory p - r and warm-up min(p - r, m). Source: arXiv 2401.10241 section 2."""

from __future__ import annotations

import itertools

import pytest

import zbpp_lite as zb

COST_SETS = (zb.Costs(f=1.0, b=1.0, w=1.0), zb.Costs(f=1.2, b=1.5, w=0.8), zb.Costs(f=1.0, b=1.0, w=1.0, bw=1.6))
"""Equal costs, unequal ones, and a fused T_BW = 1.6 below T_B + T_W."""


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_bubble_rate_is_p_minus_1_over_m_plus_p_minus_1_and_every_rank_is_equally_busy(name):
    for p, m, costs in itertools.product(range(1, 7), range(1, 17), COST_SETS):
        t = zb.simulate(zb.build_schedule(name, p, m), costs)
        assert abs(t.bubble_rate - (p - 1) / (m + p - 1)) < 1e-9, (name, p, m, costs)
        assert max(t.busy) - min(t.busy) < 1e-9, (name, p, m, costs)
        assert t.makespan == t.global_span, (name, p, m, costs)   # the makespan is the step's wall time


def test_one_f_one_b_holds_at_most_p_minus_r_and_warms_up_with_min_p_minus_r_m_forwards():
    for p, m in itertools.product((2, 3, 4, 6), range(1, 17)):
        built = zb.build_schedule("1f1b", p, m)
        peaks = zb.simulate(built, COST_SETS[0]).peak_memory
        assert all(peaks[r] <= p - r for r in range(p)), (p, m, peaks)
        warm = [next(k for k, a in enumerate(row) if a.kind == "BW") for row in built.actions]
        assert warm == [min(p - r, m) for r in range(p)], (p, m, warm)


def test_more_microbatches_shrink_one_f_one_b_s_bubble_and_gpipe_holds_m():
    rates = [zb.simulate(zb.build_schedule("1f1b", 4, m), COST_SETS[0]).bubble_rate for m in (4, 8, 16, 32, 64)]
    assert all(a > b for a, b in zip(rates, rates[1:]))
    for p, m in itertools.product((2, 4, 6), (1, 3, 8)):
        assert max(zb.simulate(zb.build_schedule("gpipe", p, m), COST_SETS[0]).peak_memory) == m
