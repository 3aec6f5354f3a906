"""Build -> simulate with whatever options a schedule takes (pure Python, no figures).

Options are read from the builder's signature (:func:`zbpp_lite.schedules.builders.options_of`), so newly
registered schedules need no change here.
"""

from __future__ import annotations

from typing import Any

from ..schedules.builders import build_schedule, options_of
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from ..schedules.timeline import Timeline


def applicable_options(
    name: str,
    stages_per_rank: int | None = None,
    costs: Costs | None = None,
    memory_limit: float | None = None,
) -> dict[str, Any]:
    """The non-None subset of {stages_per_rank, costs, memory_limit} that builder ``name`` accepts. Raises
    ValueError: an unknown schedule name (the message lists the valid ones)."""
    accepted = options_of(name)
    given = {"stages_per_rank": stages_per_rank, "costs": costs, "memory_limit": memory_limit}
    return {k: v for k, v in given.items() if k in accepted and v is not None}


def plan_timeline(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    *,
    stages_per_rank: int | None = None,
    costs: Costs | None = None,
    memory_limit: float | None = None,
) -> Timeline:
    """Build schedule ``name`` (``zbpp_lite.SCHEDULES``) for p ranks and m microbatches, validate and
    simulate it: the Timeline, in the costs' time unit. ``stages_per_rank`` (v) and ``memory_limit`` (per
    rank, units of M_B; recorded on the timeline) go to builders that take them, ``costs`` to those and
    always to the simulator (default unit costs).

    Raises:
        ValueError: an unknown name, or sizes/options the builder refuses; ScheduleError (a ValueError) if
            the built schedule is invalid.
    """
    options = applicable_options(name, stages_per_rank, costs, memory_limit)
    schedule = build_schedule(name, num_ranks, num_microbatches, **options)
    return simulate(schedule, costs, memory_limit=memory_limit)


def plan_or_refusal(
    name: str, num_ranks: int, num_microbatches: int, **options: Any
) -> Timeline | ValueError:
    """:func:`plan_timeline`, returning (not raising) the schedule's ValueError, for sweeps and sliders."""
    try:
        return plan_timeline(name, num_ranks, num_microbatches, **options)
    except ValueError as exc:
        return exc
