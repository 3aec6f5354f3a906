"""The simulator: time a schedule under given costs (pure Python, milliseconds).

Event-driven over the lowered program (:mod:`.program`; arXiv 2401.10241 section 3's cost model): a send
leaves when the compute making its value ends, its receive has the value T_comm later, and a rank's head
compute starts once the rank is free, what it needs from its own rank has ended and what it needs from
others has been received; the optimizer's instructions (:class:`~zbpp_lite.schedules.program.Optimize`)
are instants once the rank is free and its optimizer messages received (their sends at the sender's
instant; T_comm is the activations'). An overlapped pair F&B starts once
both inputs are there, lasts T_F&B and hands both outputs on at its end (arXiv 2412.19437 section 3.2.1);
on the timeline it is two back-to-back events splitting T_F&B in proportion to its parts' times.
"""

from __future__ import annotations

import math
from operator import attrgetter

from .costs import Costs, CostTable
from .ir import Entry, Key, Overlap, Schedule, parts, produces
from .program import (Optimize, OptimizerMessage, Program, Recv, Send, consumer_stage, destination, lower,
    routes)
from .timeline import Event, Timeline
from .validate import ScheduleError, checked_order, checked_program, describe, execution_order, step_keys


def simulate(
    schedule: Schedule | Program,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    check: bool = True,
    lockstep: bool = False,
    overlap: bool = False,
) -> Timeline:
    """Simulate ``schedule`` (lowered, :func:`~zbpp_lite.schedules.program.lower`) or a lowered
    :class:`~zbpp_lite.schedules.program.Program` under ``costs``; return its :class:`Timeline` (the
    costs' time unit).

    Args:
        costs: default T_F = T_B = T_W = 1, T_comm = 0, M_B = 1.
        memory_limit: recorded for figures, not enforced.
        check: run :func:`validate` first; with ``check=False`` only deadlock is detected.
        lockstep: time it as a compiled SPMD program runs it, in :func:`lockstep_ticks` ticks lasting
            their slowest action plus T_comm when a transfer crosses ranks after it (a program: its
            compute entries).
        overlap: with ``lockstep``, each tick sends what the tick before it made while its own actions
            run, so a tick lasts the longer of its slowest action and those transfers, over
            ``lockstep_ticks(..., overlap=True)``'s ticks (a value crossing ranks is read two ticks
            after it is made). ValueError without ``lockstep``.

    Raises:
        ScheduleError: an invalid or deadlocking schedule.
        ValueError: costs with the wrong number of per-stage values, times overflowing to infinity, or
            ``overlap`` without ``lockstep``.
    """
    if overlap and not lockstep:
        raise ValueError("overlap=True times the transfers of a lockstep (SPMD) program beside the next "
                         "tick's compute; pass lockstep=True too (event-driven timing already sends "
                         "as soon as a value is made)")
    costs = costs or Costs()
    table = costs.table(schedule.num_stages)
    if lockstep:
        compute = schedule.schedule() if isinstance(schedule, Program) else schedule
        events = _lockstep_events(compute, table, checked_order(compute) if check else None, overlap)
    else:
        events = _timed_events(table, *(checked_program(schedule) if check else _walk_program(schedule)))
    if not all(map(math.isfinite, map(attrgetter("end"), events))):
        raise table.overflow()
    return Timeline.from_events(events, schedule.num_ranks, table, schedule.num_stages, memory_limit,
        "simulated")


def lockstep_ticks(schedule: Schedule, walk: tuple | None = None, overlap: bool = False
                   ) -> list[list[int | None]]:
    """``table[tick][rank]``: the index of the action the rank runs in a lockstep (SPMD) run, or None.

    Each action takes the earliest tick after its rank's previous one and after all it needs (results
    cross ranks at a tick's end); ``walk``: its (execution order, step keys) if known
    (:func:`~zbpp_lite.schedules.validate.checked_order`). ``overlap``: a tick sends what the tick
    before it made while its own actions run, so a value crossing ranks is read two ticks after it is
    made, not one (a one-tick link; its own rank's values still one). Raises ScheduleError: a
    deadlocking schedule."""
    tick_of: dict[Key, tuple[int, int]] = {}  # a value's tick and rank
    next_free = [0] * schedule.num_ranks
    table: list[list[int | None]] = []
    order, (needs, made) = _walk(schedule, walk)
    link = 1 if overlap else 0
    for rank, step in order:
        tick = max([next_free[rank]] + [t + 1 + (link if r != rank else 0)
                                        for t, r in map(tick_of.__getitem__, needs[rank][step])])
        while len(table) <= tick:
            table.append([None] * schedule.num_ranks)
        table[tick][rank] = step
        next_free[rank] = tick + 1
        for key in made[rank][step]:
            tick_of[key] = (tick, rank)
    return table


def _events_of(rank: int, entry: Entry, start: float, end: float, table: CostTable) -> list[Event]:
    """One event per action; a pair's two back to back over [start, end], split by their own times."""
    if not isinstance(entry, Overlap):
        return [Event(rank, entry, start, end)]
    f, b = entry.parts
    tf, tb = table.time(f.kind, f.stage), table.time(b.kind, b.stage)
    cut = start + (end - start) * (tf / (tf + tb) if tf + tb > 0 else 0.0)
    return [Event(rank, f, start, cut), Event(rank, b, cut, end)]


def _sends_across(schedule: Schedule, a) -> bool:
    """Does this action's result go to another rank (:func:`~zbpp_lite.schedules.program.destination`)?"""
    return any(destination(key, schedule.placement) is not None for key in produces(a))


def _walk(schedule: Schedule, walk: tuple | None) -> tuple:
    """(execution order, step keys): ``walk`` if given, else found (deadlock raises ScheduleError)."""
    if walk is not None:
        return walk
    keys = step_keys(schedule)
    return execution_order(schedule, keys), keys


def _walk_program(lists: Schedule | Program) -> tuple[Program, list[tuple[int, int]]]:
    """(program, its :func:`execution_order`) unchecked: deadlock raises ScheduleError."""
    program = lists if isinstance(lists, Program) else lower(lists)
    return program, execution_order(program)


def _lockstep_events(schedule: Schedule, table: CostTable, walk=None, overlap: bool = False) -> list[Event]:
    """Lockstep ticks timed: a tick lasts its slowest action, then its transfers; or, with ``overlap``,
    the longer of its slowest action and the previous tick's transfers."""
    events, now, sending = [], 0.0, 0.0
    for row in lockstep_ticks(schedule, walk, overlap):
        actions = [(r, schedule.actions[r][i]) for r, i in enumerate(row) if i is not None]
        length = max((table.duration(a) for _, a in actions), default=0.0)
        for r, a in actions:
            events += _events_of(r, a, now, now + table.duration(a), table)
        sends = max((table.comm[x.stage] for r, a in actions for x in parts(a) if _sends_across(schedule, x)),
                    default=0.0)
        now += max(length, sending) if overlap else length + sends
        sending = sends
    return events


def _timed_events(table: CostTable, program: Program, order: list[tuple[int, int]]) -> list[Event]:
    """Events of ``program``'s compute, timed in ``order``
    (:func:`~zbpp_lite.schedules.validate.execution_order`): a send leaves at its value's end, its receive
    has it T_comm later; a compute starts once its rank is free and its inputs are there. Raises
    ScheduleError: an input not there (unchecked: a misordered rank or a value never received).

    Times are kept per (kind, stage) in a dict by microbatch, and each (kind, stage)'s route names those
    dicts once (:func:`_timing_links`): an instruction looks its inputs up by microbatch alone, with no key
    tuple made or hashed (planning at p = 256, m = 512 times about two million instructions)."""
    links, ends = _timing_links(table, program.placement)
    free = [0.0] * program.num_ranks
    events = []
    rows = program.instructions
    sent: dict = {}  # (optimizer message, receiving rank) -> when sent
    for rank, step in order:
        x = rows[rank][step]
        what = type(x)
        if what is Recv:
            if type(x.key) is OptimizerMessage:  # blocks; a previous step's message is there (0.0)
                free[rank] = max(free[rank], 0.0 if x.earlier else sent[x.key, rank])
                continue
            kind, stage, j = x.key
            finish, arrive, delay = ends[kind, stage]
            arrive[j] = finish[j] + delay
        elif what is Send:
            if type(x.key) is OptimizerMessage:
                sent[x.key, x.peer] = free[rank]
        elif what is Optimize:  # no cost in the cost model: an instant on the rank's timeline
            events.append(Event(rank, x, free[rank], free[rank]))
        elif what is Overlap:
            found = [(a.microbatch, links[a.kind, a.stage]) for a in x.parts]
            start = max(_ready(rank, step, x, j, needs, free[rank]) for j, (needs, _, _) in found)
            end = start + table.duration(x)
            events += _events_of(rank, x, start, end, table)
            free[rank] = end
            for j, (_, makes, _) in found:
                for made in makes:
                    made[j] = end
        else:  # an action: no list of parts (planning at p = 256 times 786,432)
            j = x.microbatch
            needs, makes, duration = links[x.kind, x.stage]
            start = _ready(rank, step, x, j, needs, free[rank])
            end = start + duration
            events.append(Event(rank, x, start, end))
            free[rank] = end
            for made in makes:
                made[j] = end
    return events


def _ready(rank: int, step: int, x, j: int, needs: tuple, start: float) -> float:
    """When the rank's step ``x`` on microbatch ``j`` may start: not before ``start`` (the rank free) nor
    the end or arrival of what it ``needs`` (:func:`_timing_links`). Raises ScheduleError: one not there."""
    for got, kind, stage in needs:
        end = got.get(j)
        if end is None:
            raise ScheduleError(f"rank {rank}, step {step}: {describe(x)} needs {kind} of stage {stage}, "
                f"microbatch {j}, which is not there before it; rule: what an action needs runs (or is "
                "received) before it")
        if end > start:  # max(start, end) without a call per dependency
            start = end
    return start


def _timing_links(table: CostTable, placement: tuple[int, ...]) -> tuple[dict, dict]:
    """(links, ends) for :func:`_timed_events`: ``ends[kind, stage]`` is (finish, arrive, T_comm of a send:
    :meth:`CostTable.transfer`), finish and arrive dicts by microbatch of when the value is made on its own
    rank and when the rank taking it has it; ``links[kind, stage]`` is (what it needs: (dict, kind, stage)
    each, in ``deps``' order; the finish dicts it fills; its time)."""
    route_of = routes(placement)
    ends = {key: ({}, {}, table.transfer(key[1], consumer_stage(*key))) for key in route_of}
    links = {(kind, stage): (tuple((ends[k, s][0 if local else 1], k, s) for k, s, local in route.needs),
                             tuple(ends[k, s][0] for k, s in route.makes), table.time(kind, stage))
             for (kind, stage), route in route_of.items()}
    return links, ends
