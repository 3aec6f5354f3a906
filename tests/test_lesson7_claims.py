"""Lesson 7's claims over many cases (the lesson shows ZB-H1, p = 4, m = 8, stage 0 twice as slow, and
asserts that case beside it): the causes sum to all idle time, a slow stage at either end is blamed, and
the global span against the makespan. Source: arXiv 2401.10241 sections 2-3."""

from __future__ import annotations

import pytest

import zbpp_lite as zb
from zbpp_lite.analysis.attribute import attribute

P, M = 4, 8
SLOW_FIRST = zb.Costs(f=[2, 1, 1, 1], b=[2, 1, 1, 1], w=[2, 1, 1, 1])
SLOW_LAST = zb.Costs(f=[1, 1, 1, 2], b=[1, 1, 1, 2], w=[1, 1, 1, 2])


@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
@pytest.mark.parametrize("costs", [SLOW_FIRST, SLOW_LAST, zb.Costs(), zb.Costs(comm=0.1),
                                   zb.Costs(f=[1, 2, 1, 1], b=1.5, w=0.5)],
                         ids=["slow-first", "slow-last", "equal", "comm", "uneven"])
def test_the_causes_sum_to_all_idle_time_with_and_without_the_edges(name, costs):
    plan = zb.build_schedule(name, P, M)
    t = zb.simulate(plan, costs)
    causes = attribute(t, plan, costs)
    assert abs(causes.total() - (P * t.global_span - sum(t.busy))) <= 1e-9
    assert abs(causes.total(edges=False) - sum(t.idle_time)) <= 1e-9


@pytest.mark.parametrize("costs, slow", [(SLOW_FIRST, 0), (SLOW_LAST, 3)])
def test_a_slow_stage_at_either_end_takes_the_imbalance(costs, slow):
    plan = zb.build_schedule("zb-h1", P, M)
    found = attribute(zb.simulate(plan, costs), plan, costs)
    imbalance = {s: c["imbalance"] for s, c in found.by_stage().items()}
    assert found.slow_stages == (slow,) and max(imbalance, key=imbalance.get) == slow and imbalance[slow] > 0
    even = attribute(zb.simulate(plan, zb.Costs()), plan, zb.Costs())
    assert even.by_cause()["imbalance"] == 0.0


def test_every_imbalance_gap_waited_on_a_chain_from_the_slow_stage():
    """The lesson's gap by hand, for every imbalance gap of the planted case: the binding input ended
    when the gap ended, and the gap is blamed on stage 0."""
    plan = zb.build_schedule("zb-h1", P, M)
    t = zb.simulate(plan, SLOW_FIRST)
    made = {k: e for e in t.events for k in zb.schedules.ir.produces(e.action)}
    gaps = [g for g in attribute(t, plan, SLOW_FIRST).gaps if g.cause == "imbalance"]
    assert gaps and all(g.stage == 0 for g in gaps)
    for g in gaps:
        assert max(made[k].end for k in zb.deps(g.before, P)) == g.end, g


def test_the_worked_chain_runs_from_3f4_back_to_0f4_which_ran_as_soon_as_rank_0_was_free():
    """Lesson 7's diagram: rank 3 idles 13 .. 16 before 3F4, which waited for 2F4, 1F4 and 0F4 in turn;
    0F4 started when rank 0's previous action ended (the origin), so the gap is imbalance on stage 0."""
    plan = zb.build_schedule("zb-h1", P, M)
    t = zb.simulate(plan, SLOW_FIRST)
    made = {k: e for e in t.events for k in zb.schedules.ir.produces(e.action)}
    event, chain = made["F", 3, 4], [made["F", 3, 4]]
    while event.start > max((e.end for e in t.rank_events(event.rank) if e.end <= event.start), default=0):
        event = max((made[k] for k in zb.deps(event.action, P)), key=lambda e: e.end)   # its binding input
        chain.append(event)
    assert [(e.action.stage, e.start, e.end) for e in chain] == [(3, 16, 17), (2, 15, 16), (1, 14, 15), (0, 12, 14)]
    gap = next(g for g in attribute(t, plan, SLOW_FIRST).gaps if g.before == zb.Action("F", 3, 4))
    assert (gap.rank, gap.start, gap.end, gap.cause, gap.stage) == (3, 13, 16, "imbalance", 0)


def test_the_global_span_can_exceed_the_makespan():
    """Slow last stage: the last rank starts later and ends later than rank 0, so the global span (first
    start to last end over all ranks) is 51 against the longest single rank's span, 48."""
    plan = zb.build_schedule("zb-h1", P, M)
    t = zb.simulate(plan, SLOW_LAST)
    assert (t.global_span, t.makespan) == (51, 48)
    starts = [min(e.start for e in t.rank_events(r)) for r in (0, P - 1)]
    ends = [max(e.end for e in t.rank_events(r)) for r in (0, P - 1)]
    assert starts[1] > starts[0] and ends[1] > ends[0] and t.global_span == ends[1] - starts[0]
    assert t.idle_time == (23, 22, 21, 0)
