"""zb-v: the V-shaped zero-bubble schedule, planned from costs under a memory limit.

Source: arXiv 2401.10241 section 6 (ZB-V) and arXiv 2405.15362 sections 3-4. Two stages per rank in the V
placement (:func:`zbpp_lite.v_placement`), so rank 0 holds the first and last stage. The plan is the shared
:mod:`~zbpp_lite.schedules.builders.greedy` engine with a staged search: warm-up caps, then the binary
choices for the two best caps, plus four uncapped ``Rules.feed`` runs (48 runs, shortest wins; fewer above
:data:`NARROW_ABOVE` actions), polished by
:func:`~zbpp_lite.schedules.builders.greedy.improve`.

Memory unit: a whole rank's M_B (sum of its two stages' ``Costs.mem_b``); default limit p of them (1F1B's
peak); W holds ``Costs.mem_w`` (default 7/16 M_B) until it runs. Results: unit costs, m >= 2p: zero bubble,
peak exactly p (paper section 6), for either M_W; any m >= 1 is valid, below 2p with a bubble (p = 8: 0.127
at m = 8, 0.040 at m = 12, 0 from 16); the paper's profiled setting (T_F 14.407, T_B 14.380, T_W 9.676,
T_comm 1.610, p = 16, m = 48): 0.116 with the default M_W (paper 0.0697; 0.0453 with M_W = 0).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..costs import Costs, CostTable
from ..ir import Schedule, v_placement
from ._common import check_sizes
from .greedy import Cutoff, Plan, Rules, Runs, improve, per_rank_limits, rank_stage_memory

V_ORDERS = ((("B", 1), ("B", 0), ("F", 1), ("F", 0)), (("B", 0), ("B", 1), ("F", 1), ("F", 0)))
"""Priority orders tried: backward first (the chunk nearer the loss, or the other), then chunk-1 F."""

CAP_SHAPES = (None,) + tuple((a, slope) for a in (0.5, 0.625, 0.75, 0.875, 1.0) for slope in (0.0, 0.5, 1.0))
"""Warm-up caps tried: none, or round(a * (L - 1) - slope * r) chunk-0 F on rank r, where L is the
rank's memory limit in units of its chunk-0 stage's mem_b."""


NARROW_ABOVE = 20_000
"""Above this many actions (3 x stages x m) the search keeps one cap and tries flat caps only (slope 0), to
plan p = 64, m = 128 in under 2 s; at p = 16 and 32 (unit and the paper's costs) it picks the same plans."""


def warmup_caps(shape, placement: Sequence[int], table: CostTable, limits: Sequence[float]):
    """The per-rank warm-up caps of one :data:`CAP_SHAPES` entry (None: no cap)."""
    if shape is None:
        return None
    a, slope = shape
    p = 1 + max(placement)
    caps = []
    for r in range(p):
        first = min(s for s in range(len(placement)) if placement[s] == r)
        unit = table.mem_b[first]
        room = limits[r] / unit if unit > 0 else 2.0 * len(placement)
        caps.append(max(1, round(a * (room - 1) - slope * r)))
    return tuple(caps)


def search_v(placement: Sequence[int], m: int, table: CostTable, limits: Sequence[float],
        keep: int = 2) -> Plan:
    """The staged search: caps (with and without the warm-up fit), then the binary choices and second
    priority order for the ``keep`` best caps (above :data:`NARROW_ABOVE` actions: flat caps, the best one).
    Picks what that search would; runs stop once they cannot change the pick (:class:`Runs`), tried most
    promising first (:func:`_try_order`)."""
    runs = Runs(placement, m, table, limits)
    narrow = 3 * len(placement) * m > NARROW_ABOVE
    keep = 1 if narrow else keep
    shapes = [shape for shape in CAP_SHAPES if not narrow or shape is None or shape[1] == 0.0]
    tries = [(shape, fit_f) for shape in shapes for fit_f in (False, True)]
    scored: dict[int, tuple] = {}  # try index -> (makespan, peak, index, plan, caps)
    p = 1 + max(placement)
    roomy = all(x + 1e-9 >= p * y for x, y in zip(limits, rank_stage_memory(placement, table)))
    for i in _try_order(tries, scored, roomy):
        shape, fit_f = tries[i]
        caps = warmup_caps(shape, placement, table, limits)
        bar = _bar(scored.values(), caps, keep)
        cutoff = None if bar is None else Cutoff.not_before(bar[0], bar[1], ties_lose=i > bar[2])
        result = runs.run(Rules(order=V_ORDERS[0], fit_f=fit_f, warmup_cap=caps), cutoff)
        if result is not None:
            scored[i] = (result.makespan, max(result.peak_memory), i, result, caps)
    ranked = sorted(scored.values(), key=lambda x: x[:3])
    best_caps: list = []
    for *_, caps in ranked:
        if caps not in best_caps:
            best_caps.append(caps)
        if len(best_caps) == keep:
            break
    refine = [
        Rules(order=order, fill_partial=fill_partial, fit_f=fit_f, warmup_cap=caps)
        for caps in best_caps
        for order in V_ORDERS
        for fill_partial in (False, True)
        for fit_f in (False, True)
        if order != V_ORDERS[0] or fill_partial
    ]
    feed = [Rules(order=order, fit_f=fit_f, feed=True) for order in V_ORDERS for fit_f in (False, True)]
    best = runs.best([*refine, *feed], best=ranked[0][3])
    return improve(best, placement, m, table, limits)[0]


def _try_order(tries: list, scored: dict, roomy: bool):
    """Indices of ``tries`` (shape, fit_f) in run order: two probes, the smallest cap and a larger one (no cap
    where the limit is ``roomy``: p whole-rank M_B, zb-v's default; else flat a = 0.625, and no cap next,
    which where it loses then has a bar to stop at), then slope by slope from the better end as ``scored``
    fills. Changes only how soon runs stop, not the plan."""
    larger = (None, False) if roomy else ((0.625, 0.0), False)
    first = [tries.index(larger), tries.index((CAP_SHAPES[1], False))]
    yield from first
    done = [scored[i][:2] for i in first if i in scored]
    larger_better = len(done) < 2 or done[0] <= done[1]
    if not roomy:
        first.append(tries.index((None, False)))
        yield first[2]
    rest = [i for i in range(len(tries)) if i not in first]
    sign = -1.0 if larger_better else 1.0
    yield from sorted(rest, key=lambda i: (tries[i][0] is not None, (tries[i][0] or (0.0, 0.0))[1],
                                           sign * (tries[i][0] or (0.0, 0.0))[0], tries[i][1]))


def _bar(scored: Iterable[tuple], caps, keep: int) -> tuple | None:
    """The (makespan, peak, index) a run with ``caps`` must sort before to matter (None: no bar yet)."""
    best_of: dict = {}
    for entry in sorted(scored, key=lambda x: x[:3]):
        best_of.setdefault(entry[4], entry[:3])
    ranked = sorted(best_of.values())
    bars = [b for b in (best_of.get(caps), ranked[keep - 1] if len(ranked) >= keep else None)
        if b is not None]
    return min(bars) if bars else None


def v_limits(
    name: str, factor: int, num_ranks: int, costs: Costs | None, memory_limit
) -> tuple[list[float], CostTable]:
    """Resolve a V schedule's per-rank limit: ``memory_limit`` if given, else ``factor`` whole-rank units."""
    placement = v_placement(num_ranks)
    table = (costs or Costs()).table(len(placement))
    if memory_limit is None:
        memory_limit = [factor * x for x in rank_stage_memory(placement, table)]
    return per_rank_limits(name, memory_limit, placement, table), table


def zb_v(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Costs | None = None,
    memory_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """ZB-V: two stages per rank in the V placement, zero bubble where the memory allows.

    Args:
        num_ranks: p >= 1; the schedule has 2p stages.
        num_microbatches: m >= 1 (zero bubble needs m >= 2p; see the module docstring).
        costs: per-stage costs, one per stage of the 2p (or scalars); a stage is half a rank's layers.
        memory_limit: per-rank limit in units of Costs.mem_b (a number or one per rank); default p
            whole-rank M_B, 1F1B's peak.

    Raises:
        ValueError: sizes below 1, costs with the wrong number of per-stage values, or a limit below one
            microbatch on both of a rank's stages (the message names the smallest feasible one).
    """
    check_sizes("zb-v", num_ranks, num_microbatches)
    limits, table = v_limits("zb-v", num_ranks, num_ranks, costs, memory_limit)
    placement = v_placement(num_ranks)
    return search_v(placement, num_microbatches, table, limits).schedule(placement, num_microbatches, "zb-v")
