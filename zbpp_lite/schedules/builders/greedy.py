"""The greedy, time-driven list scheduler shared by zb-auto, zb-v, v-half and v-min (pure Python).

Source: Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv 2401.10241), section 3.1
(the heuristic of the automatic scheduler) and Qi et al., "Pipeline Parallelism with Controllable
Memory", NeurIPS 2024 (arXiv 2405.15362), section 4 (greedy V-shape schedules under a memory limit).

How it works. Every rank walks through time. When a rank is free it looks at the F and B it could
run -- the next microbatch of each of its stages whose inputs have been computed -- and at the time
each input arrives (its producer's end, plus T_comm when it comes from another rank):

- an F or B that has arrived runs at once, the first one in the rank's priority order (a
  :class:`Rules` field); an F runs only if the rank's memory stays within the limit and stays
  *safe* (see below), after the rank runs pending W to free memory if it must ("W when memory
  demands it", paper 3.1);
- when nothing has arrived, a pending W fills the gap. A W that fits before the next F or B arrives
  runs ("W into gaps of at least T_W"); when the next arrival comes sooner, the W still runs if
  leaving the gap would raise the largest accumulated bubble (paper 3.1; with per-stage costs the
  comparison is of each rank's work plus its idle time so far), or always when
  ``Rules.fill_partial`` is set, or never when ``Rules.keep_gaps`` is; otherwise the rank leaves
  the gap;
- with ``Rules.fit_f``, during a rank's warm-up a chunk-0 F is a filler too: it runs only if nothing
  of higher priority arrives before it would end (the paper's binary choice about one more warm-up
  F before the first B); ``Rules.warmup_cap`` bounds how many the warm-up may run;
- W left at the end run last.

A rank decides only at a time when everything that could arrive earlier is already known, so the
plan it returns is exactly what :func:`zbpp_lite.simulate` computes for its action lists.

Memory is kept safe, not just within the limit: an F is allowed only if, after it, every
microbatch in flight on the rank could still finish in microbatch order -- for each in-flight
microbatch k, the activations held by microbatches k and later plus what k still needs for the
rank's remaining stages fit the limit. Finishing is then always possible (B and W only free
memory), so the scheduler never deadlocks for any limit of at least one whole microbatch of the
rank's stages (:func:`smallest_feasible_limit`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..costs import CostTable
from ..ir import Action, Schedule, deps, produces

_EPS = 1e-9
_INF = float("inf")


@dataclass(frozen=True)
class Rules:
    """The choices of one greedy run: the priority order and the paper's binary hyperparameters.

    Attributes:
        order: priority of the F/B classes a rank runs when several have arrived, as
            ``(kind, chunk)`` pairs; chunk is the stage's position among the rank's stages in
            increasing stage order (0 for the one stage of a one-stage-per-rank placement; in the V
            placement chunk 0 is stage r and chunk 1 is stage 2p-1-r). Classes not listed come last.
        fill_partial: run a W in a gap shorter than T_W even when leaving the gap would not raise the
            largest accumulated bubble (the paper's third binary choice).
        fit_f: during a rank's warm-up (before its first B), an F of chunk 0 starts only if nothing
            of higher priority arrives before it would end; otherwise the rank waits for that (the
            paper's choice about one more warm-up F before the first B).
        warmup_cap: per rank, the most chunk-0 F the rank runs before its first B (None: only memory
            limits the warm-up). Capping the warm-up keeps the V placement from flooding every rank
            with new microbatches when T_comm makes the round trip long.
        feed: an F whose consumer on the next rank has run out of input goes before everything else
            (the paper keeps stage i at least one F ahead of stage i+1).
        keep_gaps: never run a W in a gap shorter than T_W (the opposite extreme of fill_partial).
    """

    order: tuple[tuple[str, int], ...] = (("B", 0), ("F", 0))
    fill_partial: bool = False
    fit_f: bool = False
    warmup_cap: tuple[int, ...] | None = None
    feed: bool = False
    keep_gaps: bool = False


@dataclass(frozen=True)
class Plan:
    """What a greedy run produced: the per-rank action lists and their timing.

    Attributes:
        actions: ``actions[rank]``, the rank's actions in start order.
        makespan: longest per-rank span (first F start to last end), the costs' time unit.
        peak_memory: per-rank peak activation memory (units of the costs' mem_b).
        rules: the :class:`Rules` that produced it.
    """

    actions: tuple[tuple[Action, ...], ...]
    makespan: float
    peak_memory: tuple[float, ...]
    rules: Rules

    def schedule(self, placement: Sequence[int], num_microbatches: int, name: str) -> Schedule:
        """The plan as a :class:`~zbpp_lite.schedules.ir.Schedule` (placement and m as planned)."""
        return Schedule(self.actions, tuple(placement), num_microbatches, name)


# ---------------------------------------------------------------------------- memory limits


def rank_stage_memory(placement: Sequence[int], table: CostTable) -> list[float]:
    """Per rank: the activation memory of one microbatch on all of the rank's stages (sum of mem_b)."""
    totals = [0.0] * (1 + max(placement, default=-1))
    for stage, rank in enumerate(placement):
        totals[rank] += table.mem_b[stage]
    return totals


def smallest_feasible_limit(placement: Sequence[int], table: CostTable) -> float:
    """The smallest per-rank memory limit any schedule can meet: the first microbatch must reach the
    last stage before any backward frees memory, so every rank holds one microbatch's activations
    of all its stages at once (arXiv 2401.10241, section 3; units of mem_b)."""
    return max(rank_stage_memory(placement, table), default=0.0)


def per_rank_limits(
    name: str, memory_limit: float | Sequence[float], placement: Sequence[int], table: CostTable
) -> list[float]:
    """Resolve ``memory_limit`` (a scalar or one value per rank) and check it is feasible.

    Raises:
        ValueError: a negative or wrongly sized limit, or one below what the ranks need for the first
            microbatch to reach the last stage; the message names the smallest feasible limit.
    """
    p = 1 + max(placement, default=-1)
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float, list, tuple)):
        raise ValueError(f"{name}: memory_limit must be a number or one number per rank, got {memory_limit!r}")
    if isinstance(memory_limit, (int, float)):
        limits = [float(memory_limit)] * p
    else:
        limits = [float(x) for x in memory_limit]
        if len(limits) != p:
            raise ValueError(
                f"{name}: memory_limit has {len(limits)} per-rank values but there are {p} ranks; "
                "give one value per rank or a single number"
            )
    if any(x < 0 for x in limits):
        raise ValueError(f"{name}: memory_limit must be >= 0, got {memory_limit!r}")
    need = rank_stage_memory(placement, table)
    short = [r for r in range(p) if limits[r] + _EPS < need[r]]
    if short:
        r = short[0]
        raise ValueError(
            f"{name}: memory_limit {limits[r]:g} on rank {r} is below what any schedule needs: the first "
            f"microbatch must reach the last stage before any backward frees memory, so rank {r} holds "
            f"{need[r]:g} (one microbatch on each of its stages); the smallest feasible limit is "
            f"{smallest_feasible_limit(placement, table):g} (units of Costs.mem_b)"
        )
    return limits


# ---------------------------------------------------------------------------- the engine


def plan(
    placement: Sequence[int],
    num_microbatches: int,
    table: CostTable,
    limits: Sequence[float],
    rules: Rules,
) -> Plan:
    """Run the greedy scheduler once.

    Args:
        placement: stage -> rank.
        num_microbatches: m >= 1.
        table: resolved per-stage costs (``Costs.table(num_stages)``).
        limits: per-rank activation-memory limit, units of mem_b; each at least
            :func:`smallest_feasible_limit` (checked by :func:`per_rank_limits`).
        rules: the priority order and binary choices.

    Returns:
        A :class:`Plan` whose times equal what :func:`zbpp_lite.simulate` computes.
    """
    return _Greedy(placement, num_microbatches, table, limits, rules).run()


class _Greedy:
    """One run: per-rank clocks, counters of the next F and B of every stage, the memory held, the
    pending W, and a heap of the times at which each rank decides next."""

    def __init__(self, placement, m, table: CostTable, limits, rules: Rules):
        self.placement = list(placement)
        self.S = S = len(placement)
        self.p = p = 1 + max(placement)
        self.m = m
        self.t = table
        self.limits = list(limits)
        self.rules = rules
        self.stages = [[s for s in range(S) if placement[s] == r] for r in range(p)]
        self.chunk = [0] * S
        for r in range(p):
            for c, s in enumerate(self.stages[r]):
                self.chunk[s] = c
        rank_of_class = {cls: i for i, cls in enumerate(rules.order)}
        self.prio = [[rank_of_class.get((k, self.chunk[s]), len(rules.order)) for s in range(S)] for k in "FB"]
        self.fit_stage = [rules.fit_f and self.chunk[s] == 0 for s in range(S)]
        self.end_f = [[-1.0] * m for _ in range(S)]
        self.end_b = [[-1.0] * m for _ in range(S)]
        self.nf = [0] * S
        self.nb = [0] * S
        self.rank_total_mem = rank_stage_memory(placement, table)
        self.work = [m * sum(table.f[s] + table.b[s] + table.w[s] for s in self.stages[r]) for r in range(p)]
        self.free = [0.0] * p  # time the rank becomes free
        self.first = [-1.0] * p  # start of the rank's first F (span origin)
        self.bubble = [0.0] * p
        self.mem = [0.0] * p
        self.held = [0.0] * p  # activations of F whose B has not run (mem_b), per rank
        self.peak = [0.0] * p
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.inflight: list[dict[int, list]] = [{} for _ in range(p)]  # mb -> [held, need, B left]
        self.warm = [True] * p  # before the rank's first B: the warm-up phase
        self.hold: list[tuple[str, int, int, float] | None] = [None] * p
        self.due = [0.0] * p  # next decision time
        self.rows: list[list[Action]] = [[] for _ in range(p)]
        self.left = 3 * S * m
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0

    # ------------------------------------------------------------------ bookkeeping

    def wake(self, r: int, time: float) -> None:
        if time < self.due[r] - _EPS:
            self.due[r] = time
            self.seq += 1
            heapq.heappush(self.heap, (time, self.seq, r))

    def set_due(self, r: int, time: float) -> None:
        self.due[r] = time
        if time < _INF:
            self.seq += 1
            heapq.heappush(self.heap, (time, self.seq, r))

    def commit(self, r: int, kind: str, s: int, j: int, start: float) -> float:
        t = self.t
        if self.first[r] >= 0 and start > self.free[r] + _EPS:
            self.bubble[r] += start - self.free[r]
        dur = t.f[s] if kind == "F" else t.b[s] if kind == "B" else t.w[s]
        end = start + dur
        self.free[r] = end
        self.rows[r].append(Action(kind, s, j))
        self.left -= 1
        if kind == "F":
            if self.first[r] < 0:
                self.first[r] = start
            self.end_f[s][j] = end
            self.nf[s] += 1
            self.mem[r] += t.mem_b[s]
            self.peak[r] = max(self.peak[r], self.mem[r])
            self.held[r] += t.mem_b[s]
            entry = self.inflight[r].setdefault(j, [0.0, self.rank_total_mem[r], len(self.stages[r])])
            entry[0] += t.mem_b[s]
            entry[1] -= t.mem_b[s]
            if s + 1 < self.S:
                self.notify(self.placement[s + 1], r, s, end)
        elif kind == "B":
            self.end_b[s][j] = end
            self.nb[s] += 1
            self.warm[r] = False
            self.mem[r] -= t.mem_b[s] - t.mem_w[s]
            self.pending_w[r].append((s, j))
            self.held[r] -= t.mem_b[s]
            entry = self.inflight[r][j]
            entry[0] -= t.mem_b[s]
            entry[2] -= 1
            if entry[2] == 0:  # its last B on this rank: only the W's share remains, always freeable
                del self.inflight[r][j]
            if s > 0:
                self.notify(self.placement[s - 1], r, s, end)
        else:
            self.mem[r] -= t.mem_w[s]
        return end

    def notify(self, consumer: int, producer: int, stage: int, end: float) -> None:
        arrival = end + (self.t.transfer(stage, stage) if consumer != producer else 0.0)
        if consumer != producer:
            self.wake(consumer, max(arrival, self.now))

    # ------------------------------------------------------------------ candidates

    def candidates(self, r: int) -> list[tuple[int, float, str, int, int]]:
        """(priority, arrival, kind, stage, microbatch) of the next F and B of each of the rank's stages
        whose inputs are computed (F only if memory allows it safely)."""
        out = []
        S, placement, t = self.S, self.placement, self.t
        for s in self.stages[r]:
            j = self.nf[s]
            if j < self.m:
                if s == 0:
                    arr = 0.0
                else:
                    e = self.end_f[s - 1][j]
                    arr = -1.0 if e < 0 else e + (t.transfer(s - 1, s) if placement[s - 1] != r else 0.0)
                if arr >= 0 and self.safe_f(r, s, j) and self.within_cap(r, s):
                    starving = self.rules.feed and s + 1 < S and placement[s + 1] != r and self.nf[s + 1] >= j
                    out.append((-1 if starving else self.prio[0][s], arr, "F", s, j))
            j = self.nb[s]
            if j < self.nf[s]:
                if s == S - 1:
                    arr = self.end_f[s][j]
                else:
                    e = self.end_b[s + 1][j]
                    arr = -1.0 if e < 0 else max(
                        self.end_f[s][j], e + (t.transfer(s + 1, s) if placement[s + 1] != r else 0.0)
                    )
                if arr >= 0:
                    out.append((self.prio[1][s], arr, "B", s, j))
        return out

    def within_cap(self, r: int, s: int) -> bool:
        cap = self.rules.warmup_cap
        if cap is None or not self.warm[r] or self.chunk[s] != 0:
            return True
        return self.nf[s] < cap[r]

    def safe_f(self, r: int, s: int, j: int) -> bool:
        """Would F(s, j) leave rank r safe? For every microbatch k in flight (in increasing order), the
        memory held by k and later microbatches plus what k still needs must fit the limit."""
        mb = self.t.mem_b[s]
        limit = self.limits[r] + _EPS
        if self.held[r] + mb + self.rank_total_mem[r] <= limit:
            return True  # even the whole rank's need on top of everything held fits
        inflight = self.inflight[r]
        if j in inflight:
            suffix = 0.0
        else:  # a new microbatch: the latest in flight
            suffix = mb
            if suffix + self.rank_total_mem[r] - mb > limit:
                return False
        for k in sorted(inflight, reverse=True):
            held, need, _ = inflight[k]
            if k == j:
                held, need = held + mb, need - mb
            suffix += held
            if suffix + need > limit:
                return False
        return True

    # ------------------------------------------------------------------ decisions

    def run_f(self, r: int, s: int, j: int, arrival: float) -> None:
        """Commit F, first running pending W if the rank's memory needs them (paper 3.1)."""
        t = self.t
        while self.mem[r] + t.mem_b[s] > self.limits[r] + _EPS and self.pending_w[r]:
            ws, wj = self.pending_w[r].pop(0)
            self.commit(r, "W", ws, wj, self.free[r])
        self.commit(r, "F", s, j, max(self.free[r], arrival))

    def run(self) -> Plan:
        self.now = 0.0
        for r in range(self.p):
            self.set_due(r, 0.0)
        while self.left:
            if not self.heap:
                raise AssertionError("greedy scheduler bug: no rank can move (memory safety should prevent this)")
            time, _, r = heapq.heappop(self.heap)
            if time != self.due[r]:
                continue
            self.now = time
            self.due[r] = _INF
            self.decide(r, time)
        spans = [max((self.free[r] - self.first[r]), 0.0) for r in range(self.p)]
        return Plan(tuple(tuple(row) for row in self.rows), max(spans), tuple(self.peak), self.rules)

    def decide(self, r: int, now: float) -> None:
        """Rank r is free at ``now``: run what has arrived, hold a filler, or wait for the next arrival."""
        t = self.t
        while True:
            if self.free[r] > now + _EPS:
                self.set_due(r, self.free[r])
                return
            cands = self.candidates(r)
            ready = [c for c in cands if c[1] <= now + _EPS]
            warm = self.warm[r]
            firm = [c for c in ready if not (c[2] == "F" and warm and self.fit_stage[c[3]])]
            hold = self.hold[r]
            if firm:
                best = min(firm, key=lambda c: (c[0], c[1]))
                if hold is not None:
                    self.hold[r] = None
                    kind, s, j, start = hold
                    dur = t.f[s] if kind == "F" else t.w[s]
                    if now + _EPS >= start + dur or self.keep_filler(r, kind, now - start):
                        if kind == "W":
                            self.pending_w[r].remove((s, j))
                            self.commit(r, "W", s, j, start)
                        else:
                            self.run_f(r, s, j, start)
                        continue
                _, arr, kind, s, j = best
                if kind == "F":
                    self.run_f(r, s, j, arr)
                else:
                    self.commit(r, "B", s, j, max(self.free[r], arr))
                continue
            if hold is not None:
                kind, s, j, start = hold
                dur = t.f[s] if kind == "F" else t.w[s]
                if now + _EPS >= start + dur:  # it fits: nothing came before it would end
                    self.hold[r] = None
                    if kind == "W":
                        self.pending_w[r].remove((s, j))
                        self.commit(r, "W", s, j, start)
                    else:
                        self.run_f(r, s, j, start)
                    continue
                self.set_due(r, min(start + dur, self.next_arrival(cands, now)))
                return
            fillers = [c for c in ready if c[2] == "F"] if warm else []
            if fillers:
                _, arr, _, s, j = min(fillers, key=lambda c: (c[0], c[1]))
                self.hold[r] = ("F", s, j, max(self.free[r], arr))
                continue
            if self.pending_w[r]:
                s, j = self.pending_w[r][0]
                self.hold[r] = ("W", s, j, self.free[r])
                continue
            self.set_due(r, self.next_arrival(cands, now))
            return

    @staticmethod
    def next_arrival(cands, now: float) -> float:
        later = [c[1] for c in cands if c[1] > now + _EPS]
        return min(later) if later else _INF

    def keep_filler(self, r: int, kind: str, gap: float) -> bool:
        """A filler started at ``start`` would delay what just arrived after ``gap``: keep it?"""
        if kind == "F":
            return False  # fit_f: the warm-up F waits for what arrived
        if self.rules.fill_partial:
            return True
        if self.rules.keep_gaps:
            return False
        projected = [self.work[q] + self.bubble[q] for q in range(self.p)]
        return projected[r] + gap > max(projected) + _EPS


def best_plan(
    placement: Sequence[int],
    num_microbatches: int,
    table: CostTable,
    limits: Sequence[float],
    candidates: Iterable[Rules],
) -> Plan:
    """Run :func:`plan` for every :class:`Rules` in ``candidates`` and keep the shortest makespan
    (ties: the lower peak memory, then the earlier candidate) -- the paper's search over its binary
    choices (arXiv 2401.10241, section 3.1)."""
    best: Plan | None = None
    for rules in candidates:
        result = plan(placement, num_microbatches, table, limits, rules)
        if best is None or _better(result, best):
            best = result
    if best is None:
        raise ValueError("best_plan needs at least one Rules candidate")
    return best


def _better(a: Plan, b: Plan) -> bool:
    tol = 1e-9 * max(1.0, b.makespan)
    if a.makespan < b.makespan - tol:
        return True
    return a.makespan <= b.makespan + tol and max(a.peak_memory) < max(b.peak_memory) - 1e-9


# ---------------------------------------------------------------------------- local improvement


def improve(
    result: Plan,
    placement: Sequence[int],
    num_microbatches: int,
    table: CostTable,
    limits: Sequence[float],
    budget: int | None = None,
) -> tuple[Plan, int]:
    """Polish a plan by local search: move an action up to four places earlier on its rank (past
    actions it does not need, never past one of the same kind and stage, so each stage keeps its
    microbatch order) and keep the move when the simulated makespan shrinks within the memory limit;
    stop at a local optimum or when ``budget`` simulations are spent.

    ``budget`` defaults to min(200, 20000 // actions): a few hundred simulations for small
    pipelines, a handful for p = 32, m = 96. Not in the paper.

    Returns:
        (the polished plan, or ``result`` itself if nothing improved; the simulations used).
    """
    rows = [list(row) for row in result.actions]
    budget = search_budget(rows) if budget is None else budget
    if budget <= 0:
        return result, 0
    S = len(placement)
    evaluate = evaluator(rows, placement, num_microbatches, table, limits)

    best, peak = result.makespan, result.peak_memory
    spent, improved = 0, True
    while improved and spent < budget:
        improved = False
        for row in rows:
            for i in range(1, len(row)):
                if spent >= budget:
                    break
                x = row[i]
                needs = set(deps(x, S))
                for k in range(1, 5):
                    y = row[i - k] if i - k >= 0 else None
                    if y is None or (y.kind, y.stage) == (x.kind, x.stage) or needs & set(produces(y)):
                        break
                    row[i - k : i + 1] = [x, *row[i - k : i]]
                    span, peaks = evaluate()
                    spent += 1
                    if span < best - 1e-9 * max(1.0, best):
                        best, peak, improved = span, peaks, True
                        break
                    row[i - k : i + 1] = [*row[i - k + 1 : i + 1], x]
                    if spent >= budget:
                        break
    if best >= result.makespan:
        return result, spent
    return Plan(tuple(tuple(row) for row in rows), best, tuple(peak), result.rules), spent


# ---------------------------------------------------------------------------- fusing B and W again


def search_budget(rows) -> int:
    """The default number of simulations for a local search over the per-rank action lists
    ``rows``: min(200, 20000 // actions), a few hundred for small pipelines, a handful for
    p = 32, m = 96 (:func:`improve`, :func:`fuse_backward`, :func:`split_backward`)."""
    return min(200, 20000 // max(sum(len(row) for row in rows), 1))


def evaluator(rows: list, placement: Sequence[int], num_microbatches: int, table: CostTable, limits: Sequence[float]):
    """A function that simulates ``rows`` (as they are when called) and returns (makespan, peak
    memory per rank), or (inf, ()) for a deadlocking order or one over the memory limits."""
    from ..simulate import simulate  # the simulator sits above the builders; imported where used
    from ..validate import ScheduleError

    costs = table.costs()

    def evaluate() -> tuple[float, tuple[float, ...]]:
        try:
            timeline = simulate(Schedule(rows, tuple(placement), num_microbatches), costs, check=False)
        except ScheduleError:
            return _INF, ()
        if any(peak > limit + _EPS for peak, limit in zip(timeline.peak_memory, limits)):
            return _INF, ()
        return timeline.makespan, timeline.peak_memory

    return evaluate


def cheaper_fused(table: CostTable) -> list[bool]:
    """Per stage: whether a fused BW costs less than B and W apart."""
    return [bw < b + w - _EPS * max(1.0, b + w) for b, w, bw in zip(table.b, table.w, table.bw)]


def fuse_backward(
    result: Plan,
    placement: Sequence[int],
    num_microbatches: int,
    table: CostTable,
    limits: Sequence[float],
    budget: int | None = None,
) -> tuple[Plan, int]:
    """Fuse B and W back into one BW where the split does not pay.

    Splitting the backward has a price on real hardware: a fused BW often costs less than B and
    W apart (``Costs.bw`` below ``b + w``), so the split pays only where a W fills a bubble.
    Each B(s, j) in turn, rank by rank in order, becomes BW(s, j) with its W(s, j) removed from
    later in the rank's list, and the change is kept when the simulated makespan does not grow
    and memory stays within the limits (a fused BW holds M_B until it ends and delays the input
    gradient it sends by T_BW - T_B). At most ``budget`` simulations (default as
    :func:`improve`'s). Nothing happens where T_BW >= T_B + T_W. Not in the paper (whose costs
    have T_BW = T_B + T_W).

    Returns:
        (the plan, ``result`` itself if nothing was fused; the simulations used).
    """
    rows = [list(row) for row in result.actions]
    budget = search_budget(rows) if budget is None else budget
    cheaper = cheaper_fused(table)
    if not any(cheaper) or budget < 2:
        return result, 0
    evaluate = evaluator(rows, placement, num_microbatches, table, limits)
    best, peak = evaluate()
    spent, fused = 1, 0
    for row in rows:
        for x in [a for a in row if a.kind == "B" and cheaper[a.stage]]:
            if spent >= budget:
                break
            before = list(row)
            w = Action("W", x.stage, x.microbatch)
            row.remove(w)
            row[row.index(x)] = Action("BW", x.stage, x.microbatch)
            span, peaks = evaluate()
            spent += 1
            if span <= best + 1e-9 * max(1.0, best):
                best, peak, fused = span, peaks, fused + 1
            else:
                row[:] = before
    if not fused:
        return result, spent
    return Plan(tuple(tuple(row) for row in rows), best, tuple(peak), result.rules), spent


def split_backward(
    result: Plan,
    placement: Sequence[int],
    num_microbatches: int,
    table: CostTable,
    limits: Sequence[float],
    budget: int | None = None,
) -> tuple[Plan, int]:
    """The other way round from :func:`fuse_backward`: start from fused backwards (e.g. 1F1B)
    and split a BW(s, j) into B(s, j) in its place and W(s, j) later on its rank (right after
    the next action, or at the rank's end), last microbatches first, keeping each split that
    shortens the simulated makespan within the memory limits. This finds the few splits that pay
    when a fused BW is much cheaper than B and W apart. At most ``budget`` simulations (default
    as :func:`improve`'s). Not in the paper.

    Returns:
        (the plan, ``result`` itself if nothing was split; the simulations used).
    """
    rows = [list(row) for row in result.actions]
    budget = search_budget(rows) if budget is None else budget
    if budget < 2:
        return result, 0
    evaluate = evaluator(rows, placement, num_microbatches, table, limits)
    best, peak = evaluate()
    spent, split = 1, 0
    for row in rows:
        for x in reversed([a for a in row if a.kind == "BW"]):
            kept = None
            for offset in (2, None):  # W after the next action, or at the rank's end
                if spent >= budget:
                    break
                before = list(row)
                i = row.index(x)
                row[i] = Action("B", x.stage, x.microbatch)
                row.insert(len(row) if offset is None else min(i + offset, len(row)), Action("W", x.stage, x.microbatch))
                span, peaks = evaluate()
                spent += 1
                if span < best - 1e-9 * max(1.0, best) and (kept is None or span < kept[0]):
                    kept = (span, peaks, list(row))
                row[:] = before
            if kept is not None:
                best, peak, row[:] = kept[0], kept[1], kept[2]
                split += 1
    if not split:
        return result, spent
    return Plan(tuple(tuple(row) for row in rows), best, tuple(peak), result.rules), spent
