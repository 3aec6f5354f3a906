"""Lesson 4's claims over many cases (notebooks/04_automatic_scheduling.md shows one case of each with
its assert): zb-auto's rate against the memory limit and where its floor starts, its peak within the
limit for any m, and the polishing budget's closed form (Qi et al., ICLR 2024, section 3)."""

from __future__ import annotations

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules.builders.auto import auto_plan
from zbpp_lite.schedules.builders.greedy import search_budget

PAPER = zb.Costs(f=18.522, b=18.086, w=9.337, comm=0.601)


def falls_then_stays(rates):
    """Falls at every step of the limit into the band within 1% of the lowest rate, then stays in it."""
    band = next(i for i, r in enumerate(rates) if r <= 1.01 * min(rates))
    return (all(a > b for a, b in zip(rates[:band], rates[1:band + 1]))
            and all(r <= 1.01 * min(rates) for r in rates[band:]))


@pytest.mark.parametrize("p, m, costs", [(8, 24, PAPER), (4, 8, zb.Costs(f=1.2, b=1.5, w=0.8, comm=0.1)),
                                         (3, 9, zb.Costs(f=1.0, b=2.0, w=0.5))])
def test_the_rate_falls_with_the_limit_into_a_floor_above_zero(p, m, costs):
    plans = [auto_plan(p, m, costs, lim) for lim in range(p, 3 * p + 1)]
    assert all(max(pl.peak_memory) <= lim for lim, pl in zip(range(p, 3 * p + 1), plans))
    rates = [pl.bubble_rate for pl in plans]
    assert falls_then_stays(rates) and min(rates) > 0, rates


def test_with_equal_costs_and_free_transfers_the_floor_is_zero():
    assert min(auto_plan(4, 8, zb.Costs(), lim).bubble_rate for lim in range(4, 13)) == 0.0


@pytest.mark.parametrize("p, f, b", [(p, 1.0, float(k)) for p in range(2, 5) for k in (1, 2, 3)]
                         + [(3, 0.5, 1.5), (3, 2.0, 2.0)])
def test_the_floor_starts_where_forwards_fill_rank_0s_wait_for_its_first_gradient(p, f, b):
    """Lesson 4: with T_W = T_F and T_comm = 0 (m = 4p), zb-auto's rate reaches its floor at p + (p - 1)
    T_B / T_F M_B and not one M_B below (ZB-H2's 2p - 1 at T_B = T_F)."""
    costs = zb.Costs(f=f, b=b, w=f)
    rates = {lim: auto_plan(p, 4 * p, costs, float(lim)).bubble_rate for lim in range(p, 4 * p + 3)}
    start = min(lim for lim, r in rates.items() if r <= min(rates.values()) + 1e-12)
    assert start == p + (p - 1) * round(b / f), rates


def test_the_peak_stays_within_the_limit_whatever_m():
    p = 8
    for m in [*range(1, 17), 24, 48, 96]:
        for lim in (p, p + 4, 2 * p):
            peak = max(auto_plan(p, m, PAPER, lim).peak_memory)
            assert peak <= lim and (peak == p if lim == p and m >= p else True), (m, lim, peak)


def test_the_polishing_budget_is_min_200_and_20000_over_the_actions():
    for p, m in ((2, 4), (3, 6), (4, 12), (8, 24), (16, 48), (32, 96)):
        rows = zb.build_schedule("zb-h1", p, m).actions
        assert search_budget(rows) == min(200, 20000 // sum(map(len, rows))), (p, m)


def test_the_paper_layers_m_w_share_is_16_37_and_costs_rounds_it_up_to_7_16():
    """Lesson 4 derives M_W / M_B = 32h / (34h + 5as) = 16/37 at s = 1024, h/a = 128 (paper Table 1) and
    says zb.Costs rounds it up to sixteenths: its default M_W."""
    from fractions import Fraction
    for h, a in ((4096, 32), (2048, 16), (8192, 64)):
        share = Fraction(32 * h, 34 * h + 5 * a * 1024)
        assert share == Fraction(16, 37) and Fraction(6, 16) < share <= Fraction(7, 16) == zb.Costs().mem_w


def test_the_walkthroughs_w3_in_a_short_gap_comes_from_the_greedy_rule_not_the_polish():
    """Lesson 4's worked plan (p = 3, m = 6, limit 4 M_B): rank 0's W3 fills a gap shorter than T_W with
    fill_partial off, and the greedy run under the winning rules, before the polish, already has rank 0's
    order: the projected-span rule put W3 there."""
    from zbpp_lite.course.walkthrough import narrate
    from zbpp_lite.schedules.builders.greedy import per_rank_limits, plan
    from zbpp_lite.schedules.ir import looped_placement

    small = zb.Costs(f=1.0, b=1.3, w=0.6, comm=0.1)
    walk = auto_plan(3, 6, small, 4)
    placement, table = looped_placement(3, 3), small.table(3)
    greedy = plan(placement, 6, table, per_rank_limits("zb-auto", 4, placement, table), walk.rules)
    assert not walk.rules.fill_partial
    assert greedy.schedule(placement, 6, "greedy").actions[0] == walk.schedule.actions[0]
    assert any("W3" in x and "a gap under T_W" in x for x in narrate(walk.schedule, small, 0, 4))
