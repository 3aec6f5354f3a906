"""Lesson 1's claims over many cases (the lesson shows and asserts p = 4, m = 8): GPipe's and 1F1B's bubble
rate (p-1)/(m+p-1), 1F1B's memory p - r and warm-up min(p - r, m); GPipe's idle time is not the bubble (its
last rank never idles, rank 0 idles the whole bubble); a jitted call returns before its result is ready;
exercise 1.3's bound is attained. Source: arXiv 2401.10241 section 2."""

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



def test_gpipe_s_last_rank_never_idles_and_rank_0_idles_the_whole_bubble():
    for p, m, costs in itertools.product(range(2, 7), (1, 4, 8, 16), COST_SETS):
        t = zb.simulate(zb.build_schedule("gpipe", p, m), costs)
        bubble = t.makespan - max(t.busy)
        assert t.idle_time[p - 1] == 0 and abs(t.idle_time[0] - bubble) < 1e-9, (p, m, costs)
        assert len(t.idle_gaps[0]) == 1, (p, m, costs)              # in one gap


def test_a_jitted_call_returns_before_its_result_is_ready():
    import jax

    square, big = jax.jit(lambda a: a @ a), jax.numpy.ones((1500, 1500))
    square(big).block_until_ready()                   # compile once, outside the check
    out = square(big)
    assert not out.is_ready()                         # dispatched: the work is only queued
    out.block_until_ready()


def _in_order_rows(r: int, m: int = 4, limit: int = 2) -> list[tuple[zb.Action, ...]]:
    """Rank r's lists of F's and fused BW's, each kind in microbatch order, never holding more than limit."""
    rows = []
    for f_at in itertools.combinations(range(2 * m), m):
        kinds = ["F" if i in f_at else "BW" for i in range(2 * m)]
        held = list(itertools.accumulate(1 if k == "F" else -1 for k in kinds))
        if min(held) >= 0 and max(held) <= limit:
            count = {"F": itertools.count(), "BW": itertools.count()}
            rows.append(tuple(zb.Action(k, r, next(count[k])) for k in kinds))
    return rows


def test_exercise_1_3_s_bound_is_attained_and_1f1b_with_shorter_warm_ups_misses_it():
    from zbpp_lite.course.lesson1 import _lean_reference   # a bound no schedule beats (its docstring)
    spans = {}
    for rows in itertools.product(*(_in_order_rows(r) for r in range(3))):
        try:
            spans[rows] = zb.simulate(zb.Schedule(rows, (0, 1, 2), 4, "lean"), zb.Costs()).makespan
        except zb.ScheduleError:          # a deadlock: some rank waits for what its own order holds back
            continue
    assert min(spans.values()) == _lean_reference() == 21.0
    warm_2 = "F0 F1 BW0 F2 BW1 F3 BW2 BW3"             # 1F1B's order with the warm-up cut to 2 forwards
    short = tuple(tuple(zb.Action.from_text(f"{r}{a}") for a in row.split())
                  for r, row in enumerate((warm_2, warm_2, "F0 BW0 F1 BW1 F2 BW2 F3 BW3")))
    assert spans[short] == 24.0


@pytest.mark.parametrize("p", [2, 3, 4, 6, 9])
def test_1f1b_with_one_stage_twice_as_slow_takes_6m_plus_p_minus_1_plus_2s(p):
    """Exercise 1.1's closed form: T_F = 1, T_BW = 2, stage s at twice both: the slow rank's 6m, s before it
    starts, p - 1 - s waiting in its warm-up, 2s after its last BW (T_comm = 0, m >= p)."""
    for s in range(p):
        slow = [2.0 if i == s else 1.0 for i in range(p)]
        for m in (p, p + 1, 2 * p, 3 * p + 1):
            span = zb.simulate(zb.build_schedule("1f1b", p, m), zb.Costs(f=slow, b=slow, w=slow)).makespan
            assert span == 6 * m + p - 1 + 2 * s, (p, m, s)
