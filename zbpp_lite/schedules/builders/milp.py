"""The exact optimum for small instances: the paper's ILP solved with SciPy's HiGHS (pure Python + SciPy).

Source: arXiv 2401.10241 section 3.2 and appendix ("ILP formulation"): an end time per action, an ordering
binary per dependency-free pair on one rank, memory checked at every F, objective the longest per-rank
span. The heuristic's plan caps the objective and sets the big-M; a time limit returns the best found
with its proven gap.

So that the objective is exactly :func:`zbpp_lite.simulate`'s makespan: every stage runs F, B and W in
microbatch order (as the paper assumes), and a rank's span starts at its first F, whose start is a
constant for one-stage-per-rank, looped and V placements (the MILP fixes it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from ..costs import Costs, CostTable
from ..ir import Action, Schedule, looped_placement
from ..simulate import simulate
from ..validate import ScheduleError, validate
from ._common import check_sizes
from .auto import search_one_stage
from .greedy import per_rank_limits, rank_stage_memory
from .zero_bubble_v import search_v

_KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class MilpResult:
    """The outcome of :func:`solve_optimal`.

    Attributes:
        schedule: the best schedule found (the heuristic's when nothing better was found).
        makespan: its simulated makespan (the costs' time unit).
        lower_bound: a proven lower bound on the optimal makespan.
        gap: (makespan - lower_bound) / makespan; 0 when proven optimal (up to HiGHS's tolerance).
        status: "optimal" (gap below 1e-6), "time_limit" (stopped, better than the heuristic) or
            "heuristic" (stopped before beating the heuristic, whose schedule is returned).
        heuristic_makespan: the makespan of the heuristic schedule that bounded the search.
        seconds: wall-clock time of the solve.
        memory_limit: the per-rank limit used (units of Costs.mem_b).
    """

    schedule: Schedule
    makespan: float
    lower_bound: float
    gap: float
    status: str
    heuristic_makespan: float
    seconds: float
    memory_limit: tuple[float, ...]


def solve_optimal(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | Sequence[float] | None = None,
    time_limit: float = 60.0,
    *,
    placement: Sequence[int] | None = None,
) -> MilpResult:
    """The makespan-optimal schedule under a per-rank memory limit, by MILP (paper appendix).

    Args:
        num_ranks: p >= 1.
        num_microbatches: m >= 1; 3 * stages * m end times and ~1.5 m^2 binaries per stage (p <= 4, m <= 8:
            seconds).
        costs: per-stage times and memory (default unit costs).
        memory_limit: per-rank limit in units of Costs.mem_b (a number or one per rank); default p times a
            rank's stages' mem_b (1F1B's peak, as zb-1p).
        time_limit: seconds HiGHS may search before returning the best found.
        placement: stage -> rank; default one stage per rank; V and looped placements are exact.

    Returns:
        A :class:`MilpResult`: the optimum, or the best found and its proven gap.

    Raises:
        ValueError: bad sizes, costs with the wrong number of per-stage values, or a memory limit below the
            smallest feasible one (the message names it).
    """
    check_sizes("solve_optimal", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    placement = tuple(looped_placement(p, p) if placement is None else placement)
    if 1 + max(placement) != p or sorted(set(placement)) != list(range(p)):
        raise ValueError(f"solve_optimal: placement {placement} must use every rank 0 .. {p - 1}")
    costs = costs or Costs()
    table = costs.table(len(placement))
    if memory_limit is None:
        memory_limit = [p * x for x in rank_stage_memory(placement, table)]
    limits = per_rank_limits("solve_optimal", memory_limit, placement, table)
    t0 = time.perf_counter()
    heuristic = _heuristic(placement, m, table, limits)
    h_span = simulate(heuristic, costs, check=False).makespan
    model = _Model(placement, m, table, limits, h_span)
    res = milp(
        model.objective,
        integrality=model.integrality,
        bounds=Bounds(model.lower, model.upper),
        constraints=LinearConstraint(model.matrix, model.row_lower, model.row_upper),
        options={"time_limit": float(time_limit), "disp": False, "mip_rel_gap": 1e-7},
    )
    seconds = time.perf_counter() - t0
    best, best_span = heuristic, h_span
    if res.x is not None:
        candidate = model.schedule(res.x)
        if candidate is not None:
            timeline = simulate(candidate, costs, check=False)
            if timeline.makespan < best_span - 1e-9 * max(1.0, best_span) and all(
                peak <= lim + 1e-6 for peak, lim in zip(timeline.peak_memory, limits)
            ):
                best, best_span = candidate, timeline.makespan
    lower = model.lower[model.n + model.p]  # busy time and the warm-up bound: proven without search
    bound = res.fun if res.status == 0 else getattr(res, "mip_dual_bound", None)
    if bound is not None and np.isfinite(bound):
        lower = max(lower, float(bound))
    lower = min(lower, best_span)
    gap = max(0.0, (best_span - lower) / best_span) if best_span > 0 else 0.0
    if gap <= 1e-6:
        status = "optimal"
    elif res.x is not None and best is not heuristic:
        status = "time_limit"
    else:
        status = "heuristic"
    return MilpResult(best, best_span, lower, gap, status, h_span, seconds, tuple(limits))


def _heuristic(placement: tuple[int, ...], m: int, table: CostTable, limits: list[float]) -> Schedule:
    """The greedy schedule that bounds the MILP: zb-auto's search, or zb-v's for two stages per rank."""
    p = 1 + max(placement)
    if len(placement) == p:
        plan = search_one_stage(placement, m, table, limits)
    else:
        plan = search_v(placement, m, table, limits)
    return plan.schedule(placement, m, "zb-milp")


class _Rows:
    """Sparse constraint rows ``low <= sum(v * x[c]) <= high``, built one at a time."""

    def __init__(self):
        self.rows, self.cols, self.vals, self.lo, self.hi = [], [], [], [], []

    def add(self, entries, low: float, high: float = np.inf) -> None:
        for c, v in entries:
            self.rows.append(len(self.lo))
            self.cols.append(c)
            self.vals.append(v)
        self.lo.append(low)
        self.hi.append(high)


class _Model:
    """The ILP of the paper's appendix as sparse arrays for ``scipy.optimize.milp``: end times E (n), span
    origins O (p), objective z, then an ordering binary y per unordered same-rank pair (y = 1: a first)."""

    def __init__(self, placement, m, table: CostTable, limits, upper_bound: float):
        self.placement, self.m, self.table, self.limits = placement, m, table, limits
        self.S = len(placement)
        self.p = p = 1 + max(placement)
        self.nodes = [(k, s, j) for k in _KINDS for s in range(self.S) for j in range(m)]
        self.index = {node: i for i, node in enumerate(self.nodes)}
        self.n = n = len(self.nodes)
        self.cost = np.array([table.time(k, s) for k, s, _ in self.nodes])
        self.rank = [placement[s] for _, s, _ in self.nodes]
        self.by_rank = [[i for i in range(n) if self.rank[i] == r] for r in range(p)]
        self.busy = [sum(self.cost[i] for i in self.by_rank[r]) for r in range(p)]
        self._graph()
        # the span origin of each rank: the start of its first F, a constant when reached by first actions
        self.first_stage = first = [min(s for s in range(self.S) if placement[s] == r) for r in range(p)]
        self.fixed = [all(first[placement[k]] == k for k in range(first[r] + 1)) for r in range(p)]
        self.origin = [self.earliest[self.index["F", first[r], 0]] - table.f[first[r]] for r in range(p)]
        self.pairs = [
            (a, b)
            for ids in self.by_rank
            for x, a in enumerate(ids)
            for b in ids[x + 1 :]
            if not (self.reach[a] >> b) & 1 and not (self.reach[b] >> a) & 1
        ]
        self.nz = n + p
        nvar = n + p + 1 + len(self.pairs)
        rows = _Rows()
        self._order_rows(rows, upper_bound + float(self.cost.max()))
        self._span_rows(rows)
        self._memory_rows(rows)
        self.matrix = coo_matrix((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lo), nvar)).tocsr()
        self.row_lower, self.row_upper = np.array(rows.lo), np.array(rows.hi)
        self.objective = np.zeros(nvar)
        self.objective[self.nz] = 1.0
        self.integrality = np.zeros(nvar)
        self.integrality[self.nz + 1 :] = 1
        self._bounds(nvar, upper_bound)
        self.topo_rank = {i: x for x, i in enumerate(self.order)}

    def _graph(self) -> None:
        """Dependencies (pred, succ, lag) incl. per-stage microbatch order; topological order, earliest ends,
        descendant bitsets."""
        index, table, placement, n = self.index, self.table, self.placement, self.n

        def lag(a: int, b: int) -> float:
            return table.transfer(a, b) if placement[a] != placement[b] else 0.0

        edges = []
        for s in range(self.S):
            for j in range(self.m):
                f, b, w = index["F", s, j], index["B", s, j], index["W", s, j]
                if s > 0:
                    edges.append((index["F", s - 1, j], f, lag(s - 1, s)))
                if s < self.S - 1:
                    edges.append((index["B", s + 1, j], b, lag(s + 1, s)))
                edges += [(f, b, 0.0), (b, w, 0.0)]
                if j > 0:
                    edges += [(index[k, s, j - 1], index[k, s, j], 0.0) for k in _KINDS]
        preds, succs = [[] for _ in range(n)], [[] for _ in range(n)]
        for a, b, l in edges:
            preds[b].append((a, l))
            succs[a].append(b)
        self.edges, self.order = edges, _topological(n, preds, succs)
        self.earliest = [0.0] * n
        for i in self.order:
            self.earliest[i] = max((self.earliest[a] + l for a, l in preds[i]), default=0.0) + self.cost[i]
        self.reach = [0] * n
        for i in reversed(self.order):
            bits = 0
            for b in succs[i]:
                bits |= self.reach[b] | (1 << b)
            self.reach[i] = bits

    def _order_rows(self, rows: _Rows, big: float) -> None:
        """Dependencies, the big-M ordering of unordered pairs, and z >= each rank's last W - O_r."""
        cost, nz, n = self.cost, self.nz, self.n
        for a, b, l in self.edges:  # E_b - E_a >= lag + c_b
            rows.add([(b, 1.0), (a, -1.0)], l + cost[b])
        for q, (a, b) in enumerate(self.pairs):  # y = 1: a before b; y = 0: b before a
            y = nz + 1 + q
            rows.add([(b, 1.0), (a, -1.0), (y, -big)], cost[b] - big)
            rows.add([(a, 1.0), (b, -1.0), (y, big)], cost[a])
        for r in range(self.p):
            f0 = self.index["F", self.first_stage[r], 0]
            rows.add([(f0, 1.0), (n + r, -1.0)], self.table.f[self.first_stage[r]])  # O_r <= first F's start
            for s in range(self.S):
                if self.placement[s] == r:  # z >= E[W(s, m-1)] - O_r (the rank's last action ends its span)
                    rows.add([(nz, 1.0), (self.index["W", s, self.m - 1], -1.0), (n + r, 1.0)], 0.0)

    def _span_rows(self, rows: _Rows) -> None:
        """The paper's strengthening: the span covers each action's end plus the work after it on its rank."""
        cost, nz, n = self.cost, self.nz, self.n
        after: dict[int, list[tuple[int, float]]] = {i: [] for i in range(n)}
        after_constant = [0.0] * n
        for q, (a, b) in enumerate(self.pairs):
            y = nz + 1 + q
            after[a].append((y, -cost[b]))  # b follows a  <=>  y == 1
            after[b].append((y, cost[a]))  # a follows b  <=>  y == 0
            after_constant[b] += cost[a]
        for i in range(n):
            r = self.rank[i]
            following = sum(cost[x] for x in self.by_rank[r] if x != i and (self.reach[i] >> x) & 1)
            rows.add([(nz, 1.0), (i, -1.0), (n + r, 1.0), *after[i]], following + after_constant[i])

    def _memory_rows(self, rows: _Rows) -> None:
        """Memory, checked after every F: what the rank holds then, by the order the binaries choose."""
        delta = [self.table.memory_delta(k, s) for k, s, _ in self.nodes]
        partner: dict[int, list[tuple[int, int, bool]]] = {i: [] for i in range(self.n)}
        for q, (a, b) in enumerate(self.pairs):
            partner[a].append((b, self.nz + 1 + q, False))  # b before a  <=>  y == 0
            partner[b].append((a, self.nz + 1 + q, True))  # a before b  <=>  y == 1
        for i, (k, _, _) in enumerate(self.nodes):
            if k != "F":
                continue
            r = self.rank[i]
            before = [x for x in self.by_rank[r] if x != i and (self.reach[x] >> i) & 1]
            constant = delta[i] + sum(delta[x] for x in before)
            entries = []
            for other, y, before_if_one in partner[i]:
                if delta[other] == 0.0:
                    continue
                if not before_if_one:
                    constant += delta[other]
                entries.append((y, delta[other] if before_if_one else -delta[other]))
            rows.add(entries, -np.inf, self.limits[r] - constant + 1e-9)

    def _bounds(self, nvar: int, upper_bound: float) -> None:
        """Variable bounds: E from earliest end times, fixed origins, z from busy time and warm-up."""
        n, p, nz = self.n, self.p, self.nz
        lower, upper = np.zeros(nvar), np.full(nvar, np.inf)
        lower[:n] = self.earliest
        z_upper = upper_bound * (1 + 1e-6) + 1e-6  # slack for HiGHS's presolve tolerances
        for i in range(n):
            if self.fixed[self.rank[i]]:
                upper[i] = self.origin[self.rank[i]] + z_upper
        for r in range(p):
            if self.fixed[r]:
                lower[n + r] = upper[n + r] = self.origin[r]
            else:
                lower[n + r] = -np.inf
        lower[nz] = max([*self.busy, *(self._warmup_bound(r) for r in range(p) if self.fixed[r])])
        upper[nz] = z_upper
        upper[nz + 1 :] = 1.0
        self.lower, self.upper = lower, upper

    def schedule(self, x: np.ndarray) -> Schedule | None:
        """Per-rank action lists ordered by the solution's start times; None if they do not validate."""
        rows: list[list[tuple[float, int, Action]]] = [[] for _ in range(self.p)]
        for i, (k, s, j) in enumerate(self.nodes):
            start = float(x[i]) - self.table.time(k, s)
            rows[self.placement[s]].append((round(start, 6), self.topo_rank[i], Action(k, s, j)))
        actions = [[a for _, _, a in sorted(row)] for row in rows]
        schedule = Schedule(actions, self.placement, self.m, "zb-milp")
        try:
            validate(schedule)
        except ScheduleError:
            return None
        return schedule

    def _warmup_bound(self, r: int) -> float:
        """Lower bound on rank r's span: only F that fit in memory run before its first B."""
        table = self.table
        stages = [s for s in range(self.S) if self.placement[s] == r]
        first_b = min(self.earliest[self.index["B", s, 0]] - table.b[s] for s in stages)
        window = first_b - self.origin[r]
        # the most F time that fits in memory: a fractional knapsack over the rank's stages (an upper bound)
        room, fill = self.limits[r], 0.0
        density = [-(table.f[x] / table.mem_b[x]) if table.mem_b[x] > 0 else -np.inf for x in range(self.S)]
        for s in sorted(stages, key=density.__getitem__):
            if table.mem_b[s] <= 0:
                fill += self.m * table.f[s]
                continue
            count = min(self.m, room / table.mem_b[s])
            fill += count * table.f[s]
            room -= count * table.mem_b[s]
        return self.busy[r] + max(0.0, window - min(window, fill))


def _topological(n: int, preds, succs) -> list[int]:
    indegree = [len(pr) for pr in preds]
    ready = [i for i in range(n) if indegree[i] == 0]
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for b in succs[i]:
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    return order
