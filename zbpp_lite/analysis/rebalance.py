"""Rebalance: the layer-to-stage partition that evens the per-stage costs (pure Python).

A model is a list of parts ``[embedding, *blocks, head]``; stage s holds a contiguous run, the first
part on stage 0 and the last on the last stage (:func:`zbpp_lite.runtime.stages.stage_parts`). A rank is
busy m * (T_F + T_B + T_W) of its stage per step, so the longest stage sets the pace (Qi et al., arXiv
2401.10241, section 3). :func:`best_partition` minimises the largest stage from per-part costs timed
(:func:`zbpp_lite.analysis.profiling.parts.profile_parts`) or derived from a run (:func:`calibrate`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from ..schedules.costs import Costs

Parts = tuple[tuple[int, ...], ...]
"""``parts[s]``: the part indices of stage s, in order."""


@dataclass(frozen=True)
class PartCosts:
    """T_F, T_B, T_W of every model part on one microbatch (seconds when timed), in model order.

    Raises:
        ValueError: fields of different lengths, no part, or a negative value.
    """

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("f", "b", "w"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if not self.f or not len(self.f) == len(self.b) == len(self.w):
            raise ValueError(f"PartCosts needs one f, b and w per part, got {len(self.f)}, {len(self.b)}, "
                             f"{len(self.w)} values")
        if any(v < 0 or math.isnan(v) for v in (*self.f, *self.b, *self.w)):
            raise ValueError("PartCosts values must be >= 0")

    @classmethod
    def from_totals(cls, totals: Sequence[float]) -> "PartCosts":
        """Parts known only by their total T_F + T_B + T_W (split 1 : 1 : 1)."""
        third = tuple(t / 3 for t in totals)
        return cls(third, third, third)

    @property
    def num_parts(self) -> int:
        return len(self.f)

    @property
    def totals(self) -> tuple[float, ...]:
        """Per part T_F + T_B + T_W."""
        return tuple(f + b + w for f, b, w in zip(self.f, self.b, self.w))

    def stage_costs(self, parts: Sequence[Sequence[int]], comm: float = 0.0) -> Costs:
        """Per-stage costs of a partition: each stage's parts summed (T_comm as given)."""
        parts = check_parts(parts, self.num_parts)
        f, b, w = ([sum(getattr(self, k)[i] for i in p) for p in parts] for k in "fbw")
        return Costs(f=f, b=b, w=w, comm=comm)

    def to_json(self) -> dict:
        return {"f": list(self.f), "b": list(self.b), "w": list(self.w)}


def check_parts(parts: Sequence[Sequence[int]], num_parts: int, num_stages: int | None = None) -> Parts:
    """The partition as a tuple of tuples: every part 0 .. num_parts-1 once, in order, no empty stage.

    Raises:
        ValueError: a wrong stage count, an empty stage, or parts missing, repeated or out of order.
    """
    result = tuple(tuple(int(i) for i in p) for p in parts)
    if num_stages is not None and len(result) != num_stages:
        raise ValueError(f"the partition has {len(result)} stages, expected {num_stages}")
    if any(not p for p in result):
        raise ValueError(f"every stage needs at least one part; got {[list(p) for p in result]}")
    flat = [i for p in result for i in p]
    if flat != list(range(num_parts)):
        raise ValueError(f"a partition must hold the parts 0 .. {num_parts - 1} in order, each once, in "
                         f"contiguous stages; got {[list(p) for p in result]}")
    return result


def partition_cost(totals: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """The largest per-stage sum of ``totals`` (the per-part costs) under ``parts``."""
    return max(sum(totals[i] for i in p) for p in parts)


def best_partition(costs: PartCosts | Sequence[float], num_stages: int, min_blocks: int = 1) -> Parts:
    """The contiguous partition into ``num_stages`` stages with the smallest largest T_F + T_B + T_W,
    exact by dynamic programming, O(S * N^2); ties go to the earliest cuts. ``costs``: :class:`PartCosts`
    or per-part totals; every stage holds at least ``min_blocks`` blocks.

    Raises:
        ValueError: S < 1, fewer than two parts when S > 1, or too few blocks for ``min_blocks``
            per stage.
    """
    totals = list(costs.totals if isinstance(costs, PartCosts) else (float(t) for t in costs))
    n, S = len(totals), num_stages
    if not isinstance(S, int) or S < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {S!r}")
    if S == 1:
        return (tuple(range(n)),)
    blocks = n - 2
    if blocks < S * min_blocks:
        raise ValueError(f"{blocks} blocks cannot give {S} stages at least {min_blocks} block(s) each; "
                         "use fewer stages or more blocks")
    prefix = [0.0, *itertools.accumulate(totals)]

    # best[s][j]: the smallest largest cost of the first s stages holding parts 0 .. j-1, where
    # stage s-1 ends after part j-1; stage 0 starts with part 0 and the last stage ends with part n-1.
    INF = math.inf
    best = [[INF] * (n + 1) for _ in range(S + 1)]
    cut = [[-1] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for j in range(1, n + 1):
            for i in range(j):
                if best[s - 1][i] == INF:
                    continue
                held = j - i - (i == 0) - (j == n)  # blocks in parts i .. j-1
                if held < min_blocks:
                    continue
                value = max(best[s - 1][i], prefix[j] - prefix[i])  # parts i .. j-1
                if value < best[s][j] - 1e-15:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [n], n
    for s in range(S, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.reverse()
    return tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(S))


def calibrate(costs: PartCosts, parts: Sequence[Sequence[int]], measured: Costs,
              per_stage: bool = False) -> PartCosts:
    """Scale per-part costs (timed alone: right ratios, not what a run adds) to a run's per-stage
    ``measured`` costs with partition ``parts`` (right totals, no split). Per kind (F, B, W):
    ``per_stage=False`` one factor for all parts, keeping the ratios; ``per_stage=True`` one per stage,
    so each stage's parts add up to its measured cost (with equal ``costs``: per-part costs from a run).

    Raises:
        ValueError: a partition that does not fit ``costs``, or costs for another stage count.
    """
    parts = check_parts(parts, costs.num_parts)
    table = measured.table(len(parts))
    groups = parts if per_stage else (tuple(range(costs.num_parts)),)
    scaled = {}
    for kind in "fbw":
        values, target = list(getattr(costs, kind)), getattr(table, kind)
        for group, goal in zip(groups, target if per_stage else (sum(target),)):
            have = sum(values[i] for i in group)
            for i in group:
                values[i] = values[i] * goal / have if have > 0 else goal / len(group)
        scaled[kind] = values
    return PartCosts(**scaled)


def moved_costs(costs: PartCosts, old: Sequence[Sequence[int]], new: Sequence[Sequence[int]],
                measured: Costs) -> Costs:
    """Per-stage costs predicted for partition ``new`` from a run measured with ``old``: each stage's
    measured costs minus the parts that leave, plus those that arrive (per-part ``costs``), floored
    at 0; a stage's overhead beyond its parts stays with it; T_comm is the measured one.

    Raises:
        ValueError: partitions that do not fit ``costs`` or differ in stage count, or measured
            costs for another stage count.
    """
    old = check_parts(old, costs.num_parts)
    new = check_parts(new, costs.num_parts, len(old))
    table = measured.table(len(old))
    where_old = {i: s for s, p in enumerate(old) for i in p}
    fields = {}
    for kind in ("f", "b", "w"):
        values = list(getattr(table, kind))
        per_part = getattr(costs, kind)
        for s, stage in enumerate(new):
            for i in stage:
                if where_old[i] != s:
                    values[where_old[i]] -= per_part[i]
                    values[s] += per_part[i]
        fields[kind] = [max(v, 0.0) for v in values]
    return Costs(**fields, comm=table.comm, mem_b=table.mem_b, mem_w=table.mem_w)


def imbalanced_parts(num_blocks: int, num_stages: int, factor: float) -> Parts:
    """An uneven partition (a slow last stage): of N blocks, each of the first S-1 stages holds
    max(1, round(N / (S-1+factor))), the last the rest; ``factor`` 1 gives the even split.

    Raises:
        ValueError: factor < 1, S < 2 with factor > 1, or too few blocks for at least one block per
            stage and a last stage with more blocks than the others.
    """
    if not factor >= 1:
        raise ValueError(f"the imbalance factor must be >= 1 (1 = even stages), got {factor}")
    S, N = num_stages, num_blocks
    if S < 1 or N < S:
        raise ValueError(f"{N} blocks cannot fill {S} stages: every stage needs at least one block")
    if S == 1 and factor != 1:
        raise ValueError("an imbalance needs at least 2 stages")
    if factor == 1:
        cuts = [round(i * N / S) for i in range(S + 1)]  # block b is part b + 1
    else:
        k = max(1, round(N / (S - 1 + factor)))
        last = N - k * (S - 1)
        if last <= k:
            raise ValueError(f"{N} blocks over {S} stages leave the last stage {last} block(s), not more "
                             f"than the others' {k}; use at least {S - 1 + max(2, math.ceil(factor))} blocks "
                             f"for an imbalance of {factor}")
        cuts = [k * s for s in range(S)] + [N]
    cuts[0], cuts[-1] = -1, N + 1  # the embedding on the first stage, the head on the last
    return tuple(tuple(range(cuts[s] + 1, cuts[s + 1] + 1)) for s in range(S))
