"""zb-auto, zb-1p, zb-2p: automatic zero-bubble schedules planned from costs under a memory limit.

Source: arXiv 2401.10241 section 3.1 (heuristic) and section 5 (ZB-1p / ZB-2p: limits p * M_B, as 1F1B, and
2p * M_B). Rank r holds stage r. The heuristic runs on :mod:`~zbpp_lite.schedules.builders.greedy` over the
paper's three binary choices (eight runs; shortest makespan wins), honouring per-stage costs and T_comm.
Ours: feed / keep-gaps variants of the two best runs, a short local search (:func:`polish`), and B and W
fused again where a measured cheaper ``Costs.bw`` makes the split not pay. Against the MILP optimum
(p <= 4, m <= 8): within 0.2% on the paper's costs, within 2.2% on 161 random per-stage instances.

Measured (paper Table 5, p = 8, m = 24, M_W = 7/16 M_B): 1.5B zb-1p 0.1585 (paper 0.1585), zb-2p 0.04331
(paper 0.0433); 6.2B zb-2p 0.0029 (paper 0.0029). p = 32, m = 96 plans in about 1 s.

Memory limits are per rank, in units of ``Costs.mem_b`` (default 1: the unit is M_B).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..costs import Costs, CostTable
from ..ir import Schedule, looped_placement
from ..memory import MemoryPlan
from ._common import check_sizes
from .greedy import (
    Cutoff,
    Plan,
    Runs,
    Rules,
    cheaper_fused,
    evaluator,
    fuse_backward,
    improve,
    per_rank_limits,
    rank_stage_memory,
    split_backward,
)
from .one_f_one_b import one_f_one_b

ONE_STAGE_RULES = tuple(
    Rules(order=order, fill_partial=fill_partial, fit_f=fit_f)
    for order in ((("B", 0), ("F", 0)), (("F", 0), ("B", 0)))
    for fill_partial in (False, True)
    for fit_f in (False, True)
)
"""The paper's 2^3 binary choices: B or F first, W into every partial gap, one more warm-up F."""


@dataclass(frozen=True)
class AutoPlan:
    """A zb-auto result with what it was planned for.

    Attributes:
        schedule: what ``build_schedule("zb-auto", ...)`` returns; its ``memory_plan`` holds the M_B, M_W
            and the limit it was planned with.
        memory_limit: per-rank memory limit used (units of Costs.mem_b).
        makespan: under the costs (their time unit).
        bubble_rate: (makespan - busiest rank's busy time) / makespan.
        peak_memory: per-rank peak activation memory (units of Costs.mem_b).
        rules: the winning binary choices.
    """

    schedule: Schedule
    memory_limit: tuple[float, ...]
    makespan: float
    bubble_rate: float
    peak_memory: tuple[float, ...]
    rules: Rules


def search_one_stage(placement: Sequence[int], m: int, table: CostTable, limits: Sequence[float]) -> Plan:
    """The paper's eight runs, the feed / keep-gaps variants of the two best (at most 14 runs), then
    :func:`polish`. Where ``Costs.bw`` < b + w, also that plan after
    :func:`~zbpp_lite.schedules.builders.greedy.fuse_backward` and 1F1B after
    :func:`~zbpp_lite.schedules.builders.greedy.split_backward`; the shortest is kept."""
    # With no budget to polish, only the best run matters (and the two best of the first eight):
    # runs stop once they cannot be among those (:class:`~zbpp_lite.schedules.builders.greedy.Runs`).
    prune = polish_budget(placement, m) <= 0
    search = Runs(placement, m, table, limits)
    runs: list[Plan] = []
    for rules in ONE_STAGE_RULES:
        runs.sort(key=lambda x: (x.makespan, max(x.peak_memory)))
        bar = runs[1] if prune and len(runs) >= 2 else None
        _add(runs, search.run(rules, bar
            and Cutoff.not_before(bar.makespan, max(bar.peak_memory), ties_lose=True)))
    runs.sort(key=lambda x: (x.makespan, max(x.peak_memory)))
    for rules in [
        replace(done.rules, feed=feed, keep_gaps=keep_gaps)
        for done in runs[:2]
        for feed, keep_gaps in ((True, False), (False, True), (True, True))
        if not (keep_gaps and done.rules.fill_partial)
    ]:
        bar = min(runs, key=lambda x: (x.makespan, max(x.peak_memory))) if prune else None
        _add(runs, search.run(rules, bar
            and Cutoff.not_before(bar.makespan, max(bar.peak_memory), ties_lose=True)))
    best = polish(runs, placement, m, table, limits)
    if not any(cheaper_fused(table)):
        return best
    fused = fuse_backward(best, placement, m, table, limits)[0]
    rows = [list(row) for row in one_f_one_b(len(placement), m).actions]
    span, peak = evaluator(rows, placement, m, table, limits)()
    if span == float("inf"):  # 1F1B itself is over the memory limit
        return fused
    split = split_backward(Plan(tuple(map(tuple, rows)), span, peak, best.rules), placement, m, table,
        limits)[0]
    return min((fused, split), key=lambda x: (x.makespan, max(x.peak_memory)))


def _add(runs: list[Plan], result: Plan | None) -> None:
    if result is not None:
        runs.append(result)


def polish_budget(placement: Sequence[int], m: int) -> int:
    """The simulations :func:`polish` may spend: min(200, 20000 // actions)."""
    return min(200, 20000 // (3 * len(placement) * m))


def polish(runs: list[Plan], placement: Sequence[int], m: int, table: CostTable,
        limits: Sequence[float]) -> Plan:
    """Local search on the best distinct plans of ``runs`` in turn within one :func:`polish_budget`;
    the best result wins."""
    runs = sorted(runs, key=lambda x: (x.makespan, max(x.peak_memory)))
    left = polish_budget(placement, m)
    best, seen = runs[0], []
    for run in runs:
        if left <= 0 or len(seen) == 3:
            break
        if any(run.actions == s.actions for s in seen):
            continue
        seen.append(run)
        polished, spent = improve(run, placement, m, table, limits, budget=left)
        left -= spent
        if (polished.makespan, max(polished.peak_memory)) < (best.makespan, max(best.peak_memory)):
            best = polished
    return best


def auto_plan(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | Sequence[float] | None = None,
    name: str = "zb-auto",
) -> AutoPlan:
    """Plan zb-auto and report the memory limit used, the makespan and the winning choices.

    Args:
        num_ranks: p >= 1 (rank r holds stage r).
        num_microbatches: m >= 1.
        costs: per-stage T_F, T_B, T_W, T_comm, M_B, M_W (default all 1, T_comm = 0).
        memory_limit: per-rank activation-memory limit (units of Costs.mem_b), one number or one per rank.
            Default: p times the rank's mem_b, 1F1B's peak (as zb-1p).
        name: the schedule's name.

    Raises:
        ValueError: sizes below 1, costs with the wrong number of per-stage values, or a memory limit
            below the smallest feasible one (the message names it).
    """
    check_sizes(name, num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    placement = looped_placement(p, p)
    costs = costs or Costs()
    table = costs.table(p)
    if memory_limit is None:
        memory_limit = [p * x for x in rank_stage_memory(placement, table)]
    limits = per_rank_limits(name, memory_limit, placement, table)
    plan = search_one_stage(placement, m, table, limits)
    schedule = replace(plan.schedule(placement, m, name), memory_plan=MemoryPlan.of(costs, p, limits))
    busy = max(sum(table.time(a.kind, a.stage) for a in row) for row in schedule.actions)
    rate = (plan.makespan - busy) / plan.makespan if plan.makespan > 0 else 0.0
    return AutoPlan(schedule, tuple(limits), plan.makespan, max(rate, 0.0), plan.peak_memory, plan.rules)


def zb_auto(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """The automatic zero-bubble schedule under a per-rank ``memory_limit`` (paper section 3.1; default
    p * M_B). :func:`auto_plan` also returns the limit, makespan and rules; raises ValueError as it does."""
    return auto_plan(num_ranks, num_microbatches, costs, memory_limit, "zb-auto").schedule


def zb_1p(num_ranks: int, num_microbatches: int, *, costs: Costs | None = None) -> Schedule:
    """ZB-1p: zb-auto with 1F1B's memory, p * M_B per rank (paper section 5). Raises ValueError: sizes
    below 1 or costs with the wrong number of per-stage values."""
    return _with_factor("zb-1p", 1, num_ranks, num_microbatches, costs)


def zb_2p(num_ranks: int, num_microbatches: int, *, costs: Costs | None = None) -> Schedule:
    """ZB-2p: zb-auto with twice 1F1B's memory, 2p * M_B per rank (paper section 5). Raises ValueError:
    sizes below 1 or costs with the wrong number of per-stage values."""
    return _with_factor("zb-2p", 2, num_ranks, num_microbatches, costs)


def _with_factor(name: str, factor: int, p: int, m: int, costs: Costs | None) -> Schedule:
    check_sizes(name, p, m)
    table = (costs or Costs()).table(p)
    limit = [factor * p * x for x in rank_stage_memory(looped_placement(p, p), table)]
    return auto_plan(p, m, costs, limit, name).schedule
