"""The simulator: time a schedule under given costs (pure Python, milliseconds).

Event-driven with a cursor per rank, in the manner of the zero-bubble scheduler's timing pass: a
rank's head action starts once the rank is free and everything it needs has ended, plus T_comm
for what comes from another rank. Actions on one rank never overlap. Source: Qi et al.,
arXiv 2401.10241, section 3 (the cost model of the automatic scheduler).

An overlapped pair F&B (:class:`~zbpp_lite.schedules.ir.Overlap`) starts once both parts' inputs
are there, lasts T_F&B (``Costs.fb``) and hands both parts' outputs on at its end, as DualPipe
sends them (arXiv 2412.19437, section 3.2.1). On the timeline it is two events, its forward then
its backward, back to back, splitting T_F&B in proportion to T_F and the backward's time, so each
event is one action, as the executor measures them.
"""

from __future__ import annotations

import math
import sys

from .costs import Costs, CostTable
from .ir import Entry, Key, Overlap, Schedule, deps, parts, produces
from .timeline import Event, Timeline
from .validate import execution_order, validate


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    check: bool = True,
    lockstep: bool = False,
) -> Timeline:
    """Simulate ``schedule`` under ``costs`` and return its :class:`Timeline`.

    Args:
        schedule: any schedule; validated first when ``check`` is true.
        costs: per-action times and memory; default T_F = T_B = T_W = 1, T_comm = 0, M_B = 1.
        memory_limit: recorded on the timeline for figures (the simulator does not enforce it).
        check: run the full :func:`validate` first (structure and order). With ``check=False``
            only deadlock is detected.
        lockstep: time the schedule as a compiled SPMD program runs it: in ticks (see
            :func:`lockstep_ticks`), every rank doing at most one action per tick, a tick lasting
            as long as its slowest action plus T_comm when any transfer crosses ranks after it.

    Returns:
        A Timeline in the costs' time unit.

    Raises:
        ScheduleError: an invalid or deadlocking schedule.
        ValueError: costs with the wrong number of per-stage values, or costs so large that the
            times overflow to infinity (each finite, their sums not: ``Costs(f=1e308, comm=1e308)``).
    """
    costs = costs or Costs()
    table = costs.table(schedule.num_stages)
    if check:
        validate(schedule)
    events = _lockstep_events(schedule, table) if lockstep else _timed_events(schedule, table)
    if not all(math.isfinite(e.end) for e in events):
        big = max((*table.f, *table.b, *table.w, *table.comm))
        raise ValueError(
            f"the simulated times overflow to infinity: costs up to {big:g} add up beyond the largest float "
            f"({sys.float_info.max:.3g}); give the costs in a larger time unit (e.g. seconds instead of "
            "microseconds)"
        )
    return Timeline.from_events(events, schedule.num_ranks, table, schedule.num_stages, memory_limit,
        "simulated")


def lockstep_ticks(schedule: Schedule) -> list[list[int | None]]:
    """The per-tick action table of a lockstep (SPMD) run: ``table[tick][rank]`` is the index of
    the action that rank runs in that tick, or None when it idles.

    Each action takes the earliest tick after its rank's previous action and after every action
    it needs (results cross ranks at the end of a tick), so the table keeps every rank's order.

    Raises:
        ScheduleError: a deadlocking schedule.
    """
    S = schedule.num_stages
    tick_of: dict[Key, int] = {}
    next_free = [0] * schedule.num_ranks
    table: list[list[int | None]] = []
    for rank, step in execution_order(schedule):
        a = schedule.actions[rank][step]
        tick = max([next_free[rank]] + [tick_of[k] + 1 for k in deps(a, S)])
        while len(table) <= tick:
            table.append([None] * schedule.num_ranks)
        table[tick][rank] = step
        next_free[rank] = tick + 1
        for key in produces(a):
            tick_of[key] = tick
    return table


def _events_of(rank: int, entry: Entry, start: float, end: float, table: CostTable) -> list[Event]:
    """One event for an action; a pair's forward and backward back to back over [start, end],
    split in proportion to their own times."""
    if not isinstance(entry, Overlap):
        return [Event(rank, entry, start, end)]
    f, b = entry.parts
    tf, tb = table.time(f.kind, f.stage), table.time(b.kind, b.stage)
    cut = start + (end - start) * (tf / (tf + tb) if tf + tb > 0 else 0.0)
    return [Event(rank, f, start, cut), Event(rank, b, cut, end)]


def _sends_across(schedule: Schedule, rank: int, a) -> bool:
    """Does this action's result go to another rank (F onward, B / BW backward)?"""
    if a.kind == "F":
        return a.stage + 1 < schedule.num_stages and schedule.placement[a.stage + 1] != rank
    if a.kind in ("B", "BW"):
        return a.stage > 0 and schedule.placement[a.stage - 1] != rank
    return False


def _lockstep_events(schedule: Schedule, table: CostTable) -> list[Event]:
    events, now = [], 0.0
    for row in lockstep_ticks(schedule):
        actions = [(r, schedule.actions[r][i]) for r, i in enumerate(row) if i is not None]
        length = max(table.duration(a) for _, a in actions)
        for r, a in actions:
            events += _events_of(r, a, now, now + table.duration(a), table)
        sends = [table.comm[x.stage] for r, a in actions for x in parts(a) if _sends_across(schedule, r, x)]
        now += length + max(sends, default=0.0)
    return events


def _timed_events(schedule: Schedule, table: CostTable) -> list[Event]:
    S, placement = schedule.num_stages, schedule.placement
    finish: dict[Key, tuple[float, int]] = {}  # key -> (end time, stage that produced it)
    free = [0.0] * schedule.num_ranks
    events = []
    for rank, step in execution_order(schedule):
        a = schedule.actions[rank][step]
        start = free[rank]
        for key in deps(a, S):
            end, src_stage = finish[key]
            if placement[src_stage] != rank:
                end += table.transfer(src_stage, src_stage + 1 if key[0] == "F" else src_stage - 1)
            start = max(start, end)
        end = start + table.duration(a)
        free[rank] = end
        for part in parts(a):
            for key in produces(part):
                finish[key] = (end, part.stage)
        events += _events_of(rank, a, start, end, table)
    return events
