"""zb-v: the V-shaped zero-bubble schedule, planned from costs under a memory limit.

Source: arXiv 2401.10241 section 6 (ZB-V) and arXiv 2405.15362 sections 3-4. Two stages per rank in the V
placement (:func:`zbpp_lite.v_placement`), so rank 0 holds the first and last stage. The plan is the shared
:mod:`~zbpp_lite.schedules.builders.greedy` engine with a staged search: warm-up caps, then the binary
choices for the two best caps, plus four uncapped ``Rules.feed`` runs (48 runs, shortest wins; fewer above
:data:`NARROW_ABOVE` actions, and above :data:`HUGE_ABOVE` as many as that many actions allow), polished by
:func:`~zbpp_lite.schedules.builders.greedy.improve`; where that leaves a bubble, the paper's own V
heuristic (:func:`paper_v`: fixed warm-up, then one B and one F per rank a round, W where memory, a gap
or the rank's bubble budget asks) is planned too and taken if shorter.

Memory unit: a whole rank's M_B (sum of its two stages' ``Costs.mem_b``); default limit p of them (1F1B's
peak); W holds ``Costs.mem_w`` (default 7/16 M_B) until it runs. Results: unit costs, m >= 2p - 1: zero
bubble, peak exactly p (paper section 6), for either M_W; any m >= 1 is valid, below 2p - 1 with a bubble
(p = 8: 0.127 at m = 8, 0.040 at m = 12, 0 from 15); the paper's profiled settings (table 8: p = 16, 24,
32, three m each, limit p), with the default M_W: at or below the authors' ZB-V rates on all nine, e.g.
0.0697 at p = 16, m = 48 (T_F 14.407, T_B 14.380, T_W 9.676, T_comm 1.610; the greedy search alone:
0.116), and 0.0479 against 0.0483 at p = 24, m = 96 (``tests/test_v_family.py`` holds the rows).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Iterable, Sequence

from ..costs import Costs, CostTable
from ..ir import Action, Schedule, v_placement
from ..memory import MemoryPlan
from ._common import check_sizes
from .greedy import (_EPS, Cutoff, Plan, Rules, Runs, _better, budget_of, improve, per_rank_limits,
    rank_stage_memory)

V_ORDERS = ((("B", 1), ("B", 0), ("F", 1), ("F", 0)), (("B", 0), ("B", 1), ("F", 1), ("F", 0)))
"""Priority orders tried: backward first (the chunk nearer the loss, or the other), then chunk-1 F."""

CAP_SHAPES = (None,) + tuple((a, slope) for a in (0.5, 0.625, 0.75, 0.875, 1.0) for slope in (0.0, 0.5, 1.0))
"""Warm-up caps tried: none, or round(a * (L - 1) - slope * r) chunk-0 F on rank r, where L is the
rank's memory limit in units of its chunk-0 stage's mem_b."""


NARROW_ABOVE = 20_000
"""Above this many actions (3 x stages x m) the search keeps one cap and tries flat caps only (slope 0), to
plan p = 64, m = 128 in under 2 s; at p = 16 and 32 (unit and the paper's costs) it picks the same plans."""

HUGE_ABOVE = 300_000
"""Above this many actions the search starts no run once its runs have simulated this many actions in all
(:class:`~.greedy.Runs`' ``effort``; the first run always starts): a cap on planning time, not an exact
saving. At p = 256, m = 512 (786,432 actions, about 8 s a run in CPython) v-half and zb-v run their first
probe only, and pick what the whole search picked at unit costs (makespans 3843 and 3072); v-min's runs
stop as before, each longer than the tight block, which it keeps (4091)."""


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
        keep: int = 2, longest: float | None = None) -> Plan | None:
    """The staged search: caps (with and without the warm-up fit), then the binary choices and second
    priority order for the ``keep`` best caps (above :data:`NARROW_ABOVE` actions: flat caps, the best one).
    Picks what that search would; runs stop once they cannot change the pick (:class:`Runs`), tried most
    promising first (:func:`_try_order`); above :data:`HUGE_ABOVE` actions no run starts once the runs
    have simulated that many actions (the pick is then the best found).

    ``longest``: the makespan of a plan the caller has already, which wins over any longer one. Above
    :data:`NARROW_ABOVE` actions (one cap kept, nothing polished) runs stop once certain to be longer
    (:attr:`Runs.longest`): the pick is the same wherever a cap's run is within ``longest``; where none is,
    no cap is refined, and None is returned where no run is within it."""
    actions = 3 * len(placement) * m
    narrow = actions > NARROW_ABOVE
    keep = 1 if narrow else keep
    capped = longest is not None and narrow and budget_of(actions) == 0
    runs = Runs(placement, m, table, limits, longest=longest if capped else float("inf"),
        effort=HUGE_ABOVE if actions > HUGE_ABOVE else float("inf"))
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
    best = runs.best([*refine, *feed], best=ranked[0][3] if ranked else None)
    return None if best is None else improve(best, placement, m, table, limits)[0]


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


class _Stuck(Exception):
    """A run of :class:`_PaperV` met a step its fixed order cannot take (memory, an input not yet planned)."""


class _PaperV:
    """One run of the paper's ZB-V heuristic (the idea of the scheduler released with arXiv 2401.10241
    section 6; our own code): rounds of one backward then one forward per rank after a fixed warm-up, W
    only where memory demands it, where it fits before the next input arrives, or where waiting would
    leave the rank more idle than its bubble budget.

    Legs per rank r: 0 F down the V (stage r), 1 F up (stage 2p-1-r), 2 B of stage 2p-1-r (first in the
    backward), 3 B of stage r. Budget: the largest bubble so far on any rank, or ``allowed`` (a previous
    run's per-rank bubbles: a rank that idled less there may idle more now, keeping its W for later),
    less the rank's own bubble.
    """

    def __init__(self, p: int, m: int, table: CostTable, limits: Sequence[float],
            fill_f: bool, fill_b: bool, allowed: Sequence[float] | None):
        self.p, self.m, self.t, self.limits = p, m, table, list(limits)
        self.fill_f, self.fill_b = fill_f, fill_b
        self.stage = [(r, 2 * p - 1 - r, 2 * p - 1 - r, r) for r in range(p)]
        self.done = [[0] * 4 for _ in range(p)]
        self.ends = [[[-1.0] * m for _ in range(p)] for _ in range(4)]  # ends[leg][rank][microbatch]
        self.free, self.first = [0.0] * p, [-1.0] * p
        self.mem, self.peak, self.bubble, self.most = [0.0] * p, [0.0] * p, [0.0] * p, 0.0
        self.pending: list[deque] = [deque() for _ in range(p)]
        self.rows: list[list[Action]] = [[] for _ in range(p)]
        self.allowed = allowed
        self.most_allowed = max(allowed) if allowed else 0.0

    def arrival(self, leg: int, r: int, j: int) -> float | None:
        """When (leg, r, j)'s input from another rank arrives (None: no such input; _Stuck: not planned)."""
        if j >= self.m or (leg and self.ends[leg - 1][r][j] < 0):
            raise _Stuck  # the same stage's or the V's previous action on this rank comes first
        q = r - 1 if leg in (0, 2) else r + 1
        if not 0 <= q < self.p:
            return None
        end = self.ends[leg][q][j]
        if end < 0:
            raise _Stuck
        return end + self.t.comm[self.stage[q][leg]]

    def put(self, leg: int, r: int) -> None:
        j = self.done[r][leg]
        arrives = self.arrival(leg, r, j)
        s, t = self.stage[r][leg], self.t
        start = self.free[r] if arrives is None else max(self.free[r], arrives)
        if self.first[r] < 0:
            self.first[r] = start
        else:
            self.bubble[r] += start - self.free[r]
            self.most = max(self.most, self.bubble[r])
        self.free[r] = self.ends[leg][r][j] = start + (t.f[s] if leg < 2 else t.b[s])
        self.done[r][leg] += 1
        if leg < 2:
            self.rows[r].append(Action("F", s, j))
            self.mem[r] += t.mem_b[s]
            if self.mem[r] > self.limits[r] + _EPS:
                raise _Stuck
            self.peak[r] = max(self.peak[r], self.mem[r])
        else:
            self.rows[r].append(Action("B", s, j))
            self.mem[r] -= t.mem_b[s] - t.mem_w[s]
            self.pending[r].append((s, j))

    def put_w(self, r: int) -> None:
        s, j = self.pending[r].popleft()
        self.free[r] += self.t.w[s]
        self.mem[r] -= self.t.mem_w[s]
        self.rows[r].append(Action("W", s, j))

    def before(self, leg: int, r: int, fill: bool) -> None:
        """Pending W ahead of (leg, r): memory first (F), then those that fit before its input arrives, then
        one more if ``fill`` and the wait exceeds the rank's bubble budget."""
        pending, t = self.pending[r], self.t
        if leg < 2:
            while self.mem[r] + t.mem_b[self.stage[r][leg]] > self.limits[r] + _EPS:
                if not pending:
                    raise _Stuck
                self.put_w(r)
        arrives = self.arrival(leg, r, self.done[r][leg])
        if arrives is None:
            return
        while pending and arrives >= self.free[r] + t.w[pending[0][0]]:
            self.put_w(r)
        allowed = 0.0 if self.allowed is None else self.most_allowed - self.allowed[r]
        if pending and fill and arrives - self.free[r] > max(self.most, allowed) - self.bubble[r]:
            self.put_w(r)

    def warm_up(self) -> None:
        """One chunk-0 F per rank; then from the last rank back, chunk-0 F on ranks 0..r while rank r's
        memory leaves room and its chunk-1 input is not yet due, and its first chunk-1 F; then each rank
        catches up with the one before it, alternating chunks, from the last rank down."""
        p, m, t = self.p, self.m, self.t
        for r in range(p):
            self.put(0, r)
        for r in range(p - 1, -1, -1):
            if r < p - 1:
                due = self.ends[1][r + 1][0] + t.comm[self.stage[r + 1][1]]
                room = t.mem_b[r] * (2 + 2 * r)
                while (self.mem[r] + room <= self.limits[r] + _EPS and self.free[r] + t.f[r] <= due
                       and self.done[r][0] < m):
                    for q in range(r + 1):
                        self.put(0, q)
            self.put(1, r)
        leg, steps = 0, 0
        for r in range(1, p):
            mine, prev = self.done[r], self.done[r - 1]
            while mine[0] + mine[1] < prev[0] + prev[1] or mine[1] <= prev[1] < m:
                steps += 1
                if steps > 4 * m * p:
                    raise _Stuck
                for q in range(p - 1, r - 1, -1):
                    if self.done[q][leg] < m:
                        self.put(leg, q)
                leg = 1 - leg

    def rounds(self) -> None:
        """2m rounds: a backward on every rank (second-leg ranks last to first, then first-leg ranks), then
        a forward (chunk 1 once its input has arrived, else chunk 0); leftover W last."""
        p, m, done, ends = self.p, self.m, self.done, self.ends
        for _ in range(2 * m):
            first, second = [], []
            for r in range(p):
                c = done[r]
                up = c[3] < c[2] and (r == p - 1 or ends[3][r + 1][c[3]] >= 0 or c[2] >= m)
                (second if up else first).append(r)
            for leg, r in [(3, r) for r in reversed(second)] + [(2, r) for r in first]:
                if done[r][leg] < m:
                    self.before(leg, r, leg == 3 or self.fill_b)
                    self.put(leg, r)
            for r in range(p):
                c = done[r]
                if c[1] >= m:
                    continue
                if c[1] < c[0] and (r == p - 1 or ends[1][r + 1][c[1]] >= 0):
                    leg = 1
                elif c[1] >= c[0] or c[0] < m and (r == 0 or ends[0][r - 1][c[0]] >= 0):
                    leg = 0
                else:
                    continue
                self.before(leg, r, self.fill_f)
                self.put(leg, r)
        for r in range(p):
            while self.pending[r]:
                self.put_w(r)
        if any(c != [m] * 4 for c in done):
            raise _Stuck


def paper_v(p: int, m: int, table: CostTable, limits: Sequence[float]) -> Plan | None:
    """The shortest plan of the paper's ZB-V heuristic (:class:`_PaperV`) over its two binary choices (a W
    in a partial gap before a forward, before a first-leg backward), each run again with the last run's
    per-rank bubbles as budgets while that shortens the largest; None where no run completes (a limit too
    tight for its fixed order). Its times equal what :func:`zbpp_lite.simulate` computes."""
    best = None
    for fill_b in (True, False):
        for fill_f in (True, False):
            allowed = None
            for _ in range(16):
                try:
                    run = _PaperV(p, m, table, limits, fill_f, fill_b, allowed)
                    run.warm_up()
                    run.rounds()
                except _Stuck:
                    break
                span = max(end - first for end, first in zip(run.free, run.first))
                plan = Plan(tuple(map(tuple, run.rows)), span, tuple(run.peak), None)
                if best is None or _better(plan, best):
                    best = plan
                if allowed is not None and run.most >= max(allowed) - _EPS:
                    break
                allowed = run.bubble
    return best


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
        num_microbatches: m >= 1 (zero bubble at unit costs needs m >= 2p - 1; see the module docstring).
        costs: per-stage costs, one per stage of the 2p (or scalars); a stage is half a rank's layers.
        memory_limit: per-rank limit in units of Costs.mem_b (a number or one per rank); default p
            whole-rank M_B, 1F1B's peak.

    Raises:
        ValueError: sizes below 1, costs with the wrong number of per-stage values, or a limit below one
            microbatch on both of a rank's stages (the message names the smallest feasible one).
    """
    check_sizes("zb-v", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    limits, table = v_limits("zb-v", p, p, costs, memory_limit)
    placement = v_placement(p)
    best = search_v(placement, m, table, limits)
    work = max(m * sum(table.f[s] + table.b[s] + table.w[s] for s in (r, 2 * p - 1 - r)) for r in range(p))
    if best.makespan > work * (1 + 1e-9):  # a bubble left: the paper's heuristic may do better
        other = paper_v(p, m, table, limits)
        if other is not None:
            other = improve(other, placement, m, table, limits)[0]
            if other.makespan < best.makespan - 1e-9 * max(1.0, best.makespan):
                best = other
    schedule = best.schedule(placement, m, "zb-v")
    return replace(schedule, memory_plan=MemoryPlan.of(costs or Costs(), 2 * p, limits))  # the limit promised
