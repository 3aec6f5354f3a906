"""Bubble detection on simulated timelines with injected, known causes: a slow stage, a large
T_comm, 1F1B's warm-up and cool-down, a rank with no W left; and the cost profile read back from a
timeline. Pure Python, no JAX."""

from __future__ import annotations

import math
import random

import pytest

import zbpp_lite as zb
from zbpp_lite.analysis.attribute import CAUSES, attribute
from zbpp_lite.schedules.builders import options_of
from zbpp_lite.analysis.profiling.timelines import critical_path, profile, transfers
from zbpp_lite.schedules.fuse import split_fused
from zbpp_lite.schedules.ir import Schedule
from zbpp_lite.schedules.timeline import Timeline


def by_cause(schedule: Schedule, costs: zb.Costs, **kw) -> dict[str, float]:
    return attribute(zb.simulate(schedule, costs), schedule, **kw).by_cause()


def split_1f1b(p: int, m: int, defer_w: bool) -> Schedule:
    """1F1B with every BW split into B then W: right after its B, or all W deferred to the end."""
    split = split_fused(zb.build_schedule("1f1b", p, m))
    if defer_w:
        split = Schedule([[a for a in row if a.kind != "W"] + [a for a in row if a.kind == "W"]
                          for row in split.actions], split.placement, m, split.name)
    return zb.validate(split)


# ---------------------------------------------------------------------------- warm-up, cool-down


@pytest.mark.parametrize("p", [2, 3, 4])
def test_1f1b_with_equal_stages_idles_only_in_warm_up_and_cool_down(p):
    """1F1B, T_F = T_B = T_W = 1: every rank idles (p-1)(T_F+T_B+T_W) over the step (paper section 2,
    the 1F1B bubble), half of it filling the pipeline and half draining it (the schedule is
    symmetric in time)."""
    m = 8
    schedule = zb.build_schedule("1f1b", p, m)
    result = attribute(zb.simulate(schedule, zb.Costs()), schedule)
    totals = result.by_cause()
    assert {c for c, v in totals.items() if v > 0} == {"warm-up", "cool-down"}
    for rank_total in result.by_rank():
        assert sum(rank_total.values()) == pytest.approx(3 * (p - 1))
    assert totals["warm-up"] == pytest.approx(3 * p * (p - 1) / 2)
    assert totals["cool-down"] == pytest.approx(3 * p * (p - 1) / 2)
    assert result.slow_stages == ()


# ---------------------------------------------------------------------------- imbalance


def test_a_stage_twice_as_slow_is_found_and_named():
    """1F1B, p = 2, m = 8, stage 1 costs 2 per action, stage 0 costs 1. By hand: rank 0 runs
    F0 F1 BW0 F2 BW1 ... F7 BW6 BW7; before BW1 .. BW5 it still has F to run and waits 6 - 3 = 3
    for rank 1 each time (one slow F + BW against one fast F + BW): 5 x 3 = 15 of imbalance, all
    blamed on stage 1. With equal stages the same schedule has none."""
    schedule = zb.build_schedule("1f1b", 2, 8)
    slow = zb.Costs(f=[1, 2], b=[1, 2], w=[1, 2])
    result = attribute(zb.simulate(schedule, slow), schedule)
    assert result.slow_stages == (1,)
    assert result.by_cause()["imbalance"] == pytest.approx(15.0)
    blamed = {g.stage for g in result.gaps if g.cause == "imbalance"}
    assert blamed == {1}
    assert all(g.rank == 0 for g in result.gaps if g.cause == "imbalance")
    assert result.by_stage()[1]["imbalance"] == pytest.approx(15.0)
    assert by_cause(schedule, zb.Costs())["imbalance"] == 0.0


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2"])
def test_a_slow_middle_stage_is_blamed_through_the_chain_of_waits(name):
    """p = 4, stage 2 twice as slow: ranks 0 and 1 wait on stage 1, which itself waits on stage 2
    (rank 3 waits on stage 2 directly); the blame goes to stage 2 (the busy rank at the end of the
    chain), never to the fast ones."""
    schedule = zb.build_schedule(name, 4, 8)
    costs = zb.Costs(f=[1, 1, 2, 1], b=[1, 1, 2, 1], w=[1, 1, 2, 1])
    result = attribute(zb.simulate(schedule, costs), schedule)
    assert result.slow_stages == (2,)
    imbalance = [g for g in result.gaps if g.cause == "imbalance"]
    assert imbalance and {g.stage for g in imbalance} == {2}
    assert 2 not in {g.rank for g in imbalance}  # the slow rank itself never waits on itself
    if name == "1f1b":  # no W to fill with: both upstream ranks wait on it
        assert {g.rank for g in imbalance} >= {0, 1}
    assert by_cause(schedule, zb.Costs())["imbalance"] == 0.0


def test_the_margin_decides_what_counts_as_slow():
    schedule = zb.build_schedule("1f1b", 2, 8)
    costs = zb.Costs(f=[1, 1.2], b=[1, 1.2], w=[1, 1.2])  # stage 1 is 9% above the mean
    assert attribute(zb.simulate(schedule, costs), schedule, margin=0.05).slow_stages == (1,)
    assert attribute(zb.simulate(schedule, costs), schedule, margin=0.2).slow_stages == ()
    with pytest.raises(ValueError, match="margin"):
        attribute(zb.simulate(schedule, costs), schedule, margin=-0.1)


# ---------------------------------------------------------------------------- communication


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_a_large_t_comm_shows_as_communication_of_exactly_t_comm(name):
    """With T_comm = 0.5 every wait on another rank ends with the transfer: a communication
    stretch of exactly T_comm (the rest of the wait is the producer's own time); with T_comm = 0
    there is none. The profile reads T_comm back from the slack."""
    schedule = zb.build_schedule(name, 4, 8)
    timeline = zb.simulate(schedule, zb.Costs(comm=0.5))
    result = attribute(timeline, schedule)
    comm = [g for g in result.gaps if g.cause == "communication"]
    assert comm and all(g.duration == pytest.approx(0.5) for g in comm)
    assert all(g.stage is not None and schedule.placement[g.stage] != g.rank for g in comm)
    assert by_cause(schedule, zb.Costs())["communication"] == 0.0
    assert profile(timeline).comm == pytest.approx(0.5)
    assert profile(zb.simulate(schedule, zb.Costs())).comm == 0.0


# ---------------------------------------------------------------------------- W to fill


def test_no_w_to_fill_against_w_held_back():
    """The same 1F1B order with B and W split, stage 2 a little slower (not counted as slow with
    margin 0.5): with every W right after its B, the steady-state waits find no W pending ("no W
    to fill"); with every W deferred to the end, W is pending in those waits and the schedule
    holds it back ("W held back")."""
    costs = zb.Costs(f=[1, 1, 1.2, 1], b=[1, 1, 1.2, 1], w=[1, 1, 1.2, 1])
    right_after = by_cause(split_1f1b(4, 8, defer_w=False), costs, margin=0.5)
    deferred = by_cause(split_1f1b(4, 8, defer_w=True), costs, margin=0.5)
    assert right_after["no W to fill"] > 0 and right_after["W held back"] == 0
    assert deferred["W held back"] > 0 and deferred["no W to fill"] == 0
    assert right_after["imbalance"] == deferred["imbalance"] == 0


# ---------------------------------------------------------------------------- invariants


def _registered(p: int, m: int, costs: zb.Costs) -> list[Schedule]:
    schedules = []
    for name in zb.SCHEDULES:
        options = {}
        for key, default in options_of(name).items():
            if key == "costs":
                options[key] = costs
            elif key == "memory_limit":
                options[key] = 2.0 * p
            elif key == "stages_per_rank":
                options[key] = 2
        try:
            schedules.append(zb.build_schedule(name, p, m, **options))
        except ValueError:
            continue  # sizes the builder refuses (tested in the builders' own tests)
    return schedules


@pytest.mark.parametrize("seed", range(4))
def test_every_idle_stretch_is_attributed_once_for_every_schedule(seed):
    """For every registered schedule under random per-stage costs: the stretches inside a rank's
    span add up to the timeline's bubble time for that rank, all stretches together to
    p x global span - total busy, they never overlap, and each has a known cause."""
    rng = random.Random(seed)
    p, m = rng.choice([(2, 4), (3, 6), (4, 8)])
    for schedule in _registered(p, m, zb.Costs(comm=rng.choice([0.0, 0.3]))):
        S = schedule.num_stages
        costs = zb.Costs(
            f=[rng.uniform(0.5, 2) for _ in range(S)], b=[rng.uniform(0.5, 2) for _ in range(S)],
            w=[rng.uniform(0.2, 2) for _ in range(S)], comm=rng.choice([0.0, 0.3]),
        )
        timeline = zb.simulate(schedule, costs)
        result = attribute(timeline, schedule, costs)
        assert all(g.cause in CAUSES and g.duration > 0 for g in result.gaps)
        for r in range(p):
            inside = sum(g.duration for g in result.gaps if g.rank == r and not g.edge)
            assert inside == pytest.approx(timeline.idle_time[r], abs=1e-9), (schedule.name, r)
            stretches = sorted((g.start, g.end) for g in result.gaps if g.rank == r)
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(stretches, stretches[1:]))
        expected = p * timeline.global_span - sum(timeline.busy)
        assert result.total() == pytest.approx(expected, abs=1e-9), schedule.name


def test_the_report_and_the_figure_carry_the_numbers():
    from zbpp_lite.viz.attribution import attribution_figure

    schedule = zb.build_schedule("1f1b", 2, 8)
    timeline = zb.simulate(schedule, zb.Costs(f=[1, 2], b=[1, 2], w=[1, 2]))
    result = attribute(timeline, schedule)
    text = result.table()
    assert "imbalance" in text and "stage 1" in text and "slow stages: 1" in text
    assert "15.000" in text  # the imbalance total by hand (see the test above)
    data = result.to_json()
    assert data["by_cause"]["imbalance"] == pytest.approx(15.0) and data["slow_stages"] == [1]
    fig = attribution_figure(result, timeline)
    idle = [t for t in fig.data if t.name in CAUSES and t.base is not None and len(t.y) and isinstance(t.y[0], int)]
    assert sum(sum(t.x) for t in idle) == pytest.approx(result.total())
    stacked = fig.data[-len(CAUSES):]
    assert sum(sum(t.x) for t in stacked) == pytest.approx(result.total())


# ---------------------------------------------------------------------------- the cost profile


def test_profile_reads_back_the_simulated_costs_and_pools_timelines():
    schedule = zb.build_schedule("zb-h1", 3, 6)
    costs = zb.Costs(f=[1.0, 1.5, 2.0], b=[1.1, 1.6, 2.1], w=[0.5, 0.7, 0.9], comm=0.25)
    prof = profile(zb.simulate(schedule, costs))
    assert prof.f == pytest.approx((1.0, 1.5, 2.0)) and prof.w == pytest.approx((0.5, 0.7, 0.9))
    assert prof.b == pytest.approx((1.1, 1.6, 2.1)) and prof.comm == pytest.approx(0.25)
    assert all(s == pytest.approx(0.0, abs=1e-12) for s in (*prof.f_std, *prof.b_std, *prof.w_std))
    assert prof.counts == ((6, 6, 6),) * 3 and prof.fused == (False,) * 3
    two = profile([zb.simulate(schedule, costs), zb.simulate(schedule, zb.Costs(f=3.0, b=1.1, w=0.5, comm=0.25))])
    assert two.f[0] == pytest.approx(2.0) and two.f_std[0] == pytest.approx(1.0)
    assert two.num_timelines == 2 and two.counts[0][0] == 12
    assert "T_comm" in prof.table() and prof.costs().comm == pytest.approx(0.25)


def test_fused_backward_is_profiled_as_t_b_plus_t_w():
    schedule = zb.build_schedule("1f1b", 2, 4)
    prof = profile(zb.simulate(schedule, zb.Costs(f=1, b=2, w=3)))
    assert prof.fused == (True, True) and prof.b == pytest.approx((5.0, 5.0)) and prof.w == (0.0, 0.0)
    assert prof.stage_time == pytest.approx((6.0, 6.0))


def test_partial_or_mismatched_timelines_are_refused_with_the_stage_named():
    schedule = zb.build_schedule("zb-h1", 2, 4)
    timeline = zb.simulate(schedule)
    without_w = [e for e in timeline.events if not (e.action.kind == "W" and e.action.stage == 1)]
    partial = Timeline.from_events(without_w, 2, num_stages=2)
    with pytest.raises(ValueError, match="stage 1"):
        profile(partial)
    with pytest.raises(ValueError, match="rank 1"):
        attribute(partial, schedule)
    no_forward = Timeline.from_events([e for e in timeline.events if e.action.stage == 0 or e.action.kind != "F"], 2, num_stages=2)
    with pytest.raises(ValueError, match="F event of stage 1|no event producing F"):
        profile(no_forward)
    with pytest.raises(ValueError, match="ranks"):
        attribute(zb.simulate(zb.build_schedule("zb-h1", 3, 4)), schedule)
    with pytest.raises(ValueError, match="at least one timeline"):
        profile([])


def test_transfers_are_the_waits_on_another_rank():
    schedule = zb.build_schedule("1f1b", 2, 4)
    timeline = zb.simulate(schedule, zb.Costs(comm=0.5))
    found = transfers(timeline)
    assert found and all(x.producer.rank != x.consumer.rank for x in found)
    assert all(math.isclose(x.slack, 0.5) for x in found)


# ---------------------------------------------------------------------------- the critical chain


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b"])
@pytest.mark.parametrize("comm", [0.0, 0.25])
def test_the_critical_path_runs_from_the_start_to_the_end_without_slack(name, comm):
    p, m = 4, 8
    costs = zb.Costs(f=1.0, b=1.2, w=0.7, comm=comm)
    t = zb.simulate(zb.build_schedule(name, p, m), costs)
    chain = critical_path(t, comm)
    assert chain[0].start == 0.0 and chain[-1].end == max(e.end for e in t.events)
    for a, b in zip(chain, chain[1:]):   # each waited exactly for the one before it: its rank, or a transfer
        assert b.start == pytest.approx(a.end + (comm if a.rank != b.rank else 0.0), abs=1e-9), (a, b)


def test_1f1b_critical_chain_climbs_every_rank_through_the_last_backwards():
    p, m = 4, 8
    chain = critical_path(zb.simulate(zb.build_schedule("1f1b", p, m)))
    last = [(e.rank, str(e.action)) for e in chain if e.action.microbatch == m - 1]
    # the last microbatch's F goes down the ranks and its BW comes back up: 2p actions, no W to skip
    assert last == [(r, f"{r}F{m - 1}") for r in range(p)] + [(r, f"{r}B{m - 1}") for r in reversed(range(p))]
    assert critical_path(Timeline.from_events([], 2)) == []


def test_a_critical_path_that_comes_back_to_an_event_is_refused_instead_of_looping():
    # an action twice on a rank (equal events) made the walk step from the second to the first forever
    f = zb.Action("F", 0, 0)
    with pytest.raises(ValueError, match=r"^critical_path: the chain of waits comes back to 0F0 on rank 0 "
                       r"\(0.0 to 1.0\); a timeline holds each action once"):
        critical_path(Timeline.from_events([zb.Event(0, f, 0.0, 1.0), zb.Event(0, f, 0.0, 1.0)], 1))
