"""The simulator: time a schedule under given costs (pure Python, milliseconds).

Event-driven with a cursor per rank, in the manner of the zero-bubble scheduler's timing pass: a
rank's head action starts once the rank is free and everything it needs has ended, plus T_comm
for what comes from another rank. Actions on one rank never overlap. Source: Qi et al.,
arXiv 2401.10241, section 3 (the cost model of the automatic scheduler).
"""

from __future__ import annotations

from .costs import Costs, CostTable
from .schedule import Key, Schedule, deps, produces
from .timeline import Event, Timeline
from .validate import execution_order, validate


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    check: bool = True,
) -> Timeline:
    """Simulate ``schedule`` under ``costs`` and return its :class:`Timeline`.

    Args:
        schedule: any schedule; validated first when ``check`` is true.
        costs: per-action times and memory; default T_F = T_B = T_W = 1, T_comm = 0, M_B = 1.
        memory_limit: recorded on the timeline for figures (the simulator does not enforce it).
        check: run the full :func:`validate` first (structure and order). With ``check=False``
            only deadlock is detected.

    Returns:
        A Timeline in the costs' time unit.

    Raises:
        ScheduleError: an invalid or deadlocking schedule.
        ValueError: costs with the wrong number of per-stage values.
    """
    costs = costs or Costs()
    table = costs.table(schedule.num_stages)
    if check:
        validate(schedule)
    return Timeline.from_events(
        _timed_events(schedule, table), schedule.num_ranks, table, schedule.num_stages, memory_limit, "simulated"
    )


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
                end += table.transfer(src_stage, a.stage)
            start = max(start, end)
        end = start + table.time(a.kind, a.stage)
        free[rank] = end
        for key in produces(a):
            finish[key] = (end, a.stage)
        events.append(Event(rank, a, start, end))
    return events
