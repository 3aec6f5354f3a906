"""zb-auto's heuristic step by step: the paper's eight binary-choice runs, and one rank's plan read back
action by action with why each ran when it did (pure Python; arXiv 2401.10241 section 3.1; engine
:mod:`zbpp_lite.schedules.builders.greedy`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..analysis.profiling.timelines import producers
from ..schedules.builders.auto import ONE_STAGE_RULES
from ..schedules.builders.greedy import per_rank_limits, plan
from ..schedules.costs import Costs
from ..schedules.ir import Schedule, deps, looped_placement
from ..schedules.simulate import simulate

_EPS = 1e-9


@dataclass(frozen=True)
class ChoiceRun:
    """One of the eight greedy runs.

    Attributes:
        prefer: "B" or "F": which kind runs when both have arrived.
        fill_partial: a W goes into every gap, even one shorter than T_W (delaying the F or B that arrives
            meanwhile); without it, into such a gap only where idling would raise the largest projected
            span (a rank's whole work plus its idle time so far) of any rank.
        fit_f: one more warm-up F only where it ends before the first B arrives.
        makespan: the costs' time unit.
        peak_memory: largest per-rank peak (units of M_B).
    """

    prefer: str
    fill_partial: bool
    fit_f: bool
    makespan: float
    peak_memory: float


def eight_choices(num_ranks: int, num_microbatches: int, costs: Costs,
        memory_limit: float) -> list[ChoiceRun]:
    """The greedy scheduler once per combination of the three binary choices (rank r holds stage r),
    shortest first. Raises ValueError: a memory limit below what any schedule needs
    (:func:`zbpp_lite.schedules.builders.greedy.per_rank_limits`)."""
    placement = looped_placement(num_ranks, num_ranks)
    table = costs.table(num_ranks)
    limits = per_rank_limits("zb-auto", memory_limit, placement, table)
    runs = []
    for rules in ONE_STAGE_RULES:
        done = plan(placement, num_microbatches, table, limits, rules)
        runs.append(ChoiceRun(rules.order[0][0], rules.fill_partial, rules.fit_f, done.makespan,
                              max(done.peak_memory)))
    return sorted(runs, key=lambda r: (r.makespan, r.peak_memory))


def narrate(schedule: Schedule, costs: Costs, rank: int, memory_limit: float | None = None) -> list[str]:
    """One line per action of ``rank`` (``schedule`` simulated with ``costs``): start, end, action, memory
    after it (beside ``memory_limit`` in M_B if given) and why it ran then (warm-up under the limit, input
    arrived, a W freeing memory for the next F, filling idle time or delaying, a W left for the end)."""
    table = costs.table(schedule.num_stages)
    timeline = simulate(schedule, costs)
    made = producers(timeline)

    def ready(action) -> float:  # its inputs' ends, plus the transfer when made on another rank
        return max((made[k].end + (table.transfer(k[1], action.stage) if made[k].rank != rank else 0.0)
                    for k in deps(action, schedule.num_stages)), default=0.0)

    events = timeline.rank_events(rank)
    first_b = next((i for i, e in enumerate(events) if e.action.kind in ("B", "BW")), len(events))
    held, lines = 0.0, []
    cap = f" of {memory_limit:g}" if memory_limit is not None else ""
    for i, e in enumerate(events):
        a = e.action
        held += table.memory_delta(a.kind, a.stage)
        if a.kind == "F" and i < first_b:
            why = "warm-up F: memory allows it"
        elif a.kind in ("F", "B", "BW"):
            waited = e.start - ready(a)
            why = f"input ready at {ready(a):.3g}" + (f"; started {waited:.3g} later (the rank was busy, or "
                                                      "memory was at the limit)" if waited > _EPS else "")
        else:
            nxt = next((x.action for x in events[i + 1:] if x.action.kind != "W"), None)
            over = memory_limit is not None and nxt is not None and nxt.kind == "F" and (
                held - table.memory_delta(a.kind, a.stage) + table.memory_delta("F", nxt.stage)
                > memory_limit + _EPS)
            if nxt is None:
                why = "W left for the end"
            elif over:
                why = f"W frees memory: the next {nxt.label} would pass the limit without it"
            elif ready(nxt) >= e.end - _EPS:
                why = f"W fills idle time: the next {nxt.label} is ready only at {ready(nxt):.3g}"
            else:
                why = f"W delays the next {nxt.label} (ready at {ready(nxt):.3g}): a gap under T_W filled"
        lines.append(f"{e.start:7.3g} - {e.end:<7.3g} {a.label:>4}  memory {held:g}{cap}  {why}")
    return lines
