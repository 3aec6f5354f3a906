"""v-half and v-min: V-shaped schedules with about 1/2 and 1/3 of 1F1B's activation memory.

Source: arXiv 2405.15362 sections 3-4: a repeated building block whose lifespan sets a rank's peak memory.
V-Min, V-Half, V-ZB keep (p+4)//3, (p+2)//2 and p whole-rank M_B (one microbatch on both of a rank's stages;
1F1B: p); with T_F = T_B = T_W their bubble rates are about 2p/(3m), p/(2m) and 0 (1F1B: p/m).
v-half is zb-v's greedy scheduler under (p+2)//2 units; v-min the shorter of that under (p+4)//3 units and
the tight V block, whichever fits (the search looking only for plans shorter than the block above
``zero_bubble_v.NARROW_ABOVE`` actions: ``search_v``'s ``longest``).

Tight V block: the forward runs down and up the V with no gap, the backward straight back, each W in the
first free slot after its B; offsets are kept modulo the period (a rank's work per microbatch), moved later
only on overlaps; microbatch j runs j periods later. Chunk-0 activations on rank r live 4p - 2r action times,
chunk-1 2r + 2: at most 2 * ((p+4)//3) stage activations, V-Min's memory.
"""

from __future__ import annotations

from dataclasses import replace

from ..costs import Costs, CostTable
from ..ir import Action, Schedule, v_placement
from ..memory import MemoryPlan, order_peaks
from ..simulate import simulate
from ._common import check_sizes
from .zero_bubble_v import search_v, v_limits


def v_half(num_ranks: int, num_microbatches: int, *, costs: Costs | None = None) -> Schedule:
    """V-Half: peak activation memory at most (p+2)//2 whole-rank M_B per rank (about half of 1F1B's).

    Measured (T_F = T_B = T_W, T_comm = 0, default M_W): bubble rate 0.150 at p = 16, m = 48 and 0.148 at
    p = 8, m = 24 (paper's p/(2m): 0.167); with M_W = 0, 0.077 and 0.059. Raises ValueError: sizes below 1
    or costs with the wrong number of per-stage values."""
    check_sizes("v-half", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    limits, table = v_limits("v-half", (p + 2) // 2, p, costs, None)
    placement = v_placement(p)
    schedule = search_v(placement, m, table, limits).schedule(placement, m, "v-half")
    return replace(schedule, memory_plan=MemoryPlan.of(costs or Costs(), 2 * p, limits))


def v_min(num_ranks: int, num_microbatches: int, *, costs: Costs | None = None) -> Schedule:
    """V-Min: peak activation memory at most (p+4)//3 whole-rank M_B per rank (about a third of 1F1B's).

    Measured (T_F = T_B = T_W, T_comm = 0, either M_W): bubble rate 0.170 at p = 16, m = 48 (paper's
    2p/(3m): 0.222). Where the tight block does not fit the limit, the greedy plan is used. Where it fits,
    the search is handed a bound on its makespan from its planned times
    (:func:`~.zero_bubble_v.search_v`'s ``longest``): above :data:`~.zero_bubble_v.NARROW_ABOVE` actions
    runs longer stop, and a block that wins is not simulated here. Raises ValueError: sizes below 1 or
    costs with the wrong number of per-stage values."""
    check_sizes("v-min", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    costs = costs or Costs()
    limits, table = v_limits("v-min", (p + 4) // 3, p, costs, None)
    placement = v_placement(p)
    rows, longest = _tight_v(p, m, table)
    block = Schedule(rows, placement, m, "v-min")
    fits = all(peak <= limit + 1e-9 for peak, limit in zip(order_peaks(block, costs), limits))  # as simulated
    # the block wins over any plan longer than its makespan + 2e-9 max(1, makespan): none longer is sought
    longest = longest + 2e-9 * max(1.0, longest) if fits and longest is not None else None
    plan = search_v(placement, m, table, limits, longest=longest)
    if plan is None:
        return replace(block, memory_plan=MemoryPlan.of(costs, 2 * p, limits))
    best = plan.schedule(placement, m, "v-min")  # its makespan is the simulated one (greedy.plan)
    if fits:
        span = simulate(block, costs, check=False).makespan  # complete by construction; deadlock raises
        if span < plan.makespan - 1e-9 * max(1.0, plan.makespan):
            best = block
    return replace(best, memory_plan=MemoryPlan.of(costs, 2 * p, limits))


def tight_v_block(num_ranks: int, num_microbatches: int, table: CostTable) -> list[list[Action]]:
    """``rows[rank]``: the tight V block (module docstring) repeated m times on p ranks (2p stages, V
    placement, ``table`` their resolved costs), each rank's actions in planned start order."""
    return _tight_v(num_ranks, num_microbatches, table)[0]


def _tight_v(p: int, m: int, table: CostTable) -> tuple[list[list[Action]], float | None]:
    """(:func:`tight_v_block`'s rows, at least their simulated makespan, or None where some action found no
    slot free of overlap modulo the period)."""
    placement = v_placement(p)
    S = len(placement)
    period = max(sum(table.f[s] + table.b[s] + table.w[s] for s in range(S) if placement[s] == r)
        for r in range(p))
    busy: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    clear = [True]  # every action placed free of overlap

    def hop(a: int, b: int) -> float:
        return table.transfer(a, b) if placement[a] != placement[b] else 0.0

    def place(rank: int, ready: float, duration: float) -> float:
        start = _first_free(busy[rank], ready, duration, period)
        if start is None:
            clear[0], start = False, ready
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
    ordered = [[a for *_, a in sorted(row, key=lambda x: (x[0], x[1]))] for row in rows]
    return ordered, _longest_span(start, period, m, table) if clear[0] else None


def _longest_span(start: dict[tuple[str, int], float], period: float, m: int, table: CostTable) -> float:
    """At least the simulated makespan of the tight block whose microbatch-0 starts are ``start`` (every
    action free of overlap modulo ``period``): those planned times keep every dependency and each rank's
    order, so no action ends later simulated than planned; rank r's first F (stage r) starts no earlier than
    the forward chain with no wait. Plus a rounding allowance, per action 1e-9 (the overlap test's) and
    8 ulps."""
    p = len(table.f) // 2
    placement = v_placement(p)
    times = {"F": table.f, "B": table.b, "W": table.w}
    ends = [0.0] * p
    for (kind, s), t0 in start.items():
        ends[placement[s]] = max(ends[placement[s]], t0 + (m - 1) * period + times[kind][s])
    first, chain = [0.0] * p, 0.0
    for s in range(p):  # stage s < p is rank s's first: its F starts once the chain before it has run
        first[s] = chain
        chain = chain + table.f[s] + table.transfer(s, s + 1)
    most = max(end - begin for end, begin in zip(ends, first))
    return most + 3 * len(table.f) * m * (1e-9 + 8 * 2.0**-52 * max(1.0, max(ends)))


def _first_free(busy: list[tuple[float, float]], ready: float, duration: float,
        period: float) -> float | None:
    """Earliest start >= ready whose interval modulo ``period`` overlaps none in ``busy`` (None: none found
    within a period)."""
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
    return None
