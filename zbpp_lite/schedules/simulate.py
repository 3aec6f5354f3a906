"""The simulator: time a schedule under given costs (pure Python, milliseconds).

Event-driven, a cursor per rank (arXiv 2401.10241 section 3's cost model): a rank's head action starts once
the rank is free and all it needs has ended (plus T_comm across ranks). An overlapped pair F&B starts once
both inputs are there, lasts T_F&B and hands both outputs on at its end (arXiv 2412.19437 section 3.2.1);
on the timeline it is two back-to-back events splitting T_F&B in proportion to its parts' times.
"""

from __future__ import annotations

import math
import sys

from .costs import Costs, CostTable
from .ir import Entry, Key, Overlap, Schedule, parts
from .timeline import Event, Timeline
from .validate import checked_order, execution_order, step_keys


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    check: bool = True,
    lockstep: bool = False,
) -> Timeline:
    """Simulate ``schedule`` under ``costs`` and return its :class:`Timeline` (the costs' time unit).

    Args:
        costs: default T_F = T_B = T_W = 1, T_comm = 0, M_B = 1.
        memory_limit: recorded for figures, not enforced.
        check: run :func:`validate` first; with ``check=False`` only deadlock is detected.
        lockstep: time it as a compiled SPMD program runs it, in :func:`lockstep_ticks` ticks lasting
            their slowest action plus T_comm when a transfer crosses ranks after it.

    Raises:
        ScheduleError: an invalid or deadlocking schedule.
        ValueError: costs with the wrong number of per-stage values, or times overflowing to infinity.
    """
    costs = costs or Costs()
    table = costs.table(schedule.num_stages)
    walk = checked_order(schedule) if check else None
    events = _lockstep_events(schedule, table, walk) if lockstep else _timed_events(schedule, table, walk)
    if not all(math.isfinite(e.end) for e in events):
        big = max((*table.f, *table.b, *table.w, *table.comm))
        raise ValueError(
            f"the simulated times overflow to infinity: costs up to {big:g} add up beyond the largest float "
            f"({sys.float_info.max:.3g}); give the costs in a larger time unit (e.g. seconds instead of "
            "microseconds)"
        )
    return Timeline.from_events(events, schedule.num_ranks, table, schedule.num_stages, memory_limit,
        "simulated")


def lockstep_ticks(schedule: Schedule, walk: tuple | None = None) -> list[list[int | None]]:
    """``table[tick][rank]``: the index of the action the rank runs in a lockstep (SPMD) run, or None.

    Each action takes the earliest tick after its rank's previous one and after all it needs (results
    cross ranks at a tick's end); ``walk``: its (execution order, step keys) if known
    (:func:`~zbpp_lite.schedules.validate.checked_order`). Raises ScheduleError: a deadlocking schedule."""
    tick_of: dict[Key, int] = {}
    next_free = [0] * schedule.num_ranks
    table: list[list[int | None]] = []
    order, (needs, made) = _walk(schedule, walk)
    for rank, step in order:
        tick = max([next_free[rank]] + [tick_of[k] + 1 for k in needs[rank][step]])
        while len(table) <= tick:
            table.append([None] * schedule.num_ranks)
        table[tick][rank] = step
        next_free[rank] = tick + 1
        for key in made[rank][step]:
            tick_of[key] = tick
    return table


def _events_of(rank: int, entry: Entry, start: float, end: float, table: CostTable) -> list[Event]:
    """One event per action; a pair's two back to back over [start, end], split by their own times."""
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


def _walk(schedule: Schedule, walk: tuple | None) -> tuple:
    """(execution order, step keys): ``walk`` if given, else found (deadlock raises ScheduleError)."""
    if walk is not None:
        return walk
    keys = step_keys(schedule)
    return execution_order(schedule, keys), keys


def _lockstep_events(schedule: Schedule, table: CostTable, walk=None) -> list[Event]:
    events, now = [], 0.0
    for row in lockstep_ticks(schedule, walk):
        actions = [(r, schedule.actions[r][i]) for r, i in enumerate(row) if i is not None]
        length = max(table.duration(a) for _, a in actions)
        for r, a in actions:
            events += _events_of(r, a, now, now + table.duration(a), table)
        sends = [table.comm[x.stage] for r, a in actions for x in parts(a) if _sends_across(schedule, r, x)]
        now += length + max(sends, default=0.0)
    return events


def _timed_events(schedule: Schedule, table: CostTable, walk=None) -> list[Event]:
    placement = schedule.placement
    finish: dict[Key, tuple[float, int]] = {}  # key -> (end time, stage that produced it)
    free = [0.0] * schedule.num_ranks
    events = []
    order, (needs, made) = _walk(schedule, walk)
    rows = schedule.actions
    for rank, step in order:
        a = rows[rank][step]
        start = free[rank]
        for key in needs[rank][step]:
            end, src_stage = finish[key]
            if placement[src_stage] != rank:
                end += table.transfer(src_stage, src_stage + 1 if key[0] == "F" else src_stage - 1)
            if end > start:  # max(start, end) without a call per dependency
                start = end
        end = start + table.duration(a)
        free[rank] = end
        for key in made[rank][step]:  # each key's stage is the stage of the part that made it
            finish[key] = (end, key[1])
        events += _events_of(rank, a, start, end, table)
    return events
