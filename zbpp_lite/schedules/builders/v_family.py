"""v-half and v-min: V-shaped schedules with about 1/2 and 1/3 of 1F1B's activation memory.

Source: Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024 (arXiv 2405.15362),
sections 3-4: a schedule repeats a building block; the block's lifespan on a rank sets the rank's
peak activation memory. V-Min, V-Half and V-ZB keep (p+4)//3, (p+2)//2 and p microbatches' worth of
a rank's layers, against p for 1F1B; with T_F = T_B = T_W the paper puts their bubble rates at about
2p/(3m), p/(2m) and 0 (1F1B: about p/m).

Units: "whole-rank" M_B is one microbatch's activations on both of a rank's stages (the sum of the
two stages' ``Costs.mem_b``); 1F1B with one stage per rank peaks at p of them on rank 0.

- v-half: the greedy V scheduler of zb-v under a limit of (p+2)//2 whole-rank units per rank.
  Guaranteed peak: at most (p+2)//2 whole-rank units, i.e. (p+2)//2 / p of 1F1B's (9/16 for p = 16).
- v-min: the same under (p+4)//3 whole-rank units, together with the tight V building block (below);
  the shorter of the two that fits the limit wins. Guaranteed peak: at most (p+4)//3 whole-rank
  units, (p+4)//3 / p of 1F1B's (6/16 for p = 16).

The tight V building block: the forward runs down and back up the V with no gap, the backward
follows straight back, and each stage's W takes the first free slot after its B; every action is
kept at its offset modulo the period (a rank's work for one microbatch), moved later only where two
of a rank's actions would overlap. Microbatch j repeats the block j periods later; each rank runs
its actions in that order. A chunk-0 activation on rank r lives 4p - 2r action times and a chunk-1
activation 2r + 2, so with T_F = T_B = T_W the rank holds ceil((4p-2r)/6) + ceil((2r+2)/6) stage
activations, at most 2 * ((p+4)//3): V-Min's memory.
"""

from __future__ import annotations

from ..costs import Costs, CostTable
from ..ir import Action, Schedule, v_placement
from ..simulate import simulate
from ._common import check_sizes
from .zb_v import search_v, v_limits


def v_half(num_ranks: int, num_microbatches: int, *, costs: Costs | None = None) -> Schedule:
    """V-Half: peak activation memory at most (p+2)//2 whole-rank M_B per rank (about half of 1F1B's).

    Measured with T_F = T_B = T_W, T_comm = 0 and the default M_W (7/16 of M_B): bubble rate 0.150
    for p = 16, m = 48 and 0.148 for p = 8, m = 24 (the paper's estimate p/(2m): 0.167); with
    M_W = 0, a W that holds nothing, 0.077 and 0.059.

    Raises:
        ValueError: sizes below 1 or costs with the wrong number of per-stage values.
    """
    check_sizes("v-half", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    limits, table = v_limits("v-half", (p + 2) // 2, p, costs, None)
    placement = v_placement(p)
    return search_v(placement, m, table, limits).schedule(placement, m, "v-half")


def v_min(num_ranks: int, num_microbatches: int, *, costs: Costs | None = None) -> Schedule:
    """V-Min: peak activation memory at most (p+4)//3 whole-rank M_B per rank (about a third of 1F1B's).

    Measured with T_F = T_B = T_W, T_comm = 0: bubble rate 0.170 for p = 16, m = 48, with the
    default M_W as with M_W = 0 (the paper's
    estimate 2p/(3m): 0.222). With other costs the tight block may not fit the limit; the greedy
    plan under the limit is used then.

    Raises:
        ValueError: sizes below 1 or costs with the wrong number of per-stage values.
    """
    check_sizes("v-min", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    costs = costs or Costs()
    limits, table = v_limits("v-min", (p + 4) // 3, p, costs, None)
    placement = v_placement(p)
    plan = search_v(placement, m, table, limits)  # its makespan is the simulated one (greedy.plan)
    block = Schedule(tight_v_block(p, m, table), placement, m, "v-min")
    best, best_span = plan.schedule(placement, m, "v-min"), plan.makespan
    timeline = simulate(block, costs)
    fits = all(peak <= limit + 1e-9 for peak, limit in zip(timeline.peak_memory, limits))
    if fits and timeline.makespan < best_span - 1e-9 * max(1.0, best_span):
        best = block
    return best


def tight_v_block(num_ranks: int, num_microbatches: int, table: CostTable) -> list[list[Action]]:
    """Per-rank action lists of the tight V building block repeated m times (module docstring).

    Args:
        num_ranks: p >= 1; stages 0 .. 2p-1 in the V placement.
        num_microbatches: m >= 1.
        table: resolved costs of the 2p stages.

    Returns:
        ``rows[rank]``: the rank's actions ordered by their planned start.
    """
    p, m = num_ranks, num_microbatches
    placement = v_placement(p)
    S = len(placement)
    period = max(sum(table.f[s] + table.b[s] + table.w[s] for s in range(S) if placement[s] == r)
        for r in range(p))
    busy: list[list[tuple[float, float]]] = [[] for _ in range(p)]

    def hop(a: int, b: int) -> float:
        return table.transfer(a, b) if placement[a] != placement[b] else 0.0

    def place(rank: int, ready: float, duration: float) -> float:
        start = _first_free(busy[rank], ready, duration, period)
        busy[rank].append((start % period if period > 0 else 0.0, duration))
        return start

    start: dict[tuple[str, int], float] = {}
    ready = 0.0
    for s in range(S):  # forward: down the V and back up, no gap
        start["F", s] = place(placement[s], ready, table.f[s])
        ready = start["F", s] + table.f[s] + (hop(s, s + 1) if s + 1 < S else 0.0)
    for s in range(S - 1, -1, -1):  # backward: straight back
        start["B", s] = place(placement[s], ready, table.b[s])
        ready = start["B", s] + table.b[s] + (hop(s, s - 1) if s > 0 else 0.0)
    for s in sorted(range(S), key=lambda x: start["B", x]):  # W: first free slot after its B
        start["W", s] = place(placement[s], start["B", s] + table.b[s], table.w[s])
    rows: list[list[tuple[float, int, Action]]] = [[] for _ in range(p)]
    for (kind, s), t0 in start.items():
        for j in range(m):
            rows[placement[s]].append((t0 + j * period, "FBW".index(kind), Action(kind, s, j)))
    return [[a for *_, a in sorted(row, key=lambda x: (x[0], x[1]))] for row in rows]


def _first_free(busy: list[tuple[float, float]], ready: float, duration: float, period: float) -> float:
    """Earliest start >= ready whose interval, taken modulo ``period``, overlaps none in ``busy``
    (or ``ready`` itself when no such slot exists)."""
    if period <= 0 or duration <= 0:
        return ready
    start = ready
    for _ in range(4 * len(busy) + 4):
        offset = start % period
        push = None
        for x, dx in busy:
            for shift in (-period, 0.0, period):
                lo, hi = x + shift, x + shift + dx
                if offset < hi - 1e-9 and lo < offset + duration - 1e-9:
                    push = max(push or 0.0, hi - offset)
        if push is None:
            return start
        start += push
        if start - ready >= period:
            break
    return ready
