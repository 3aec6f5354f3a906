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
  leaving the gap would raise the largest accumulated bubble of any rank (paper 3.1), or always
  when ``Rules.fill_partial`` is set; otherwise the rank leaves the gap;
- with ``Rules.fit_f`` an F is a filler too: it runs only if no B arrives before it would end (the
  paper's binary choice about one more warm-up F before the first B);
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
from typing import Sequence

from ..costs import CostTable
from ..schedule import Action, Schedule

_EPS = 1e-9
_INF = float("inf")


@dataclass(frozen=True)
class Rules:
    """The choices of one greedy run (the paper's binary hyperparameters, and the priority order).

    Attributes:
        order: priority of the F/B classes a rank runs when several have arrived, as
            ``(kind, chunk)`` pairs; chunk is the stage's position among the rank's stages in
            increasing stage order (0 for the one stage of a one-stage-per-rank placement; in the V
            placement, chunk 0 is stage r and chunk 1 is stage 2p-1-r). Classes not listed come last.
        fill_partial: run a W in a gap shorter than T_W even when leaving the gap would not raise the
            largest accumulated bubble (the paper's ``no_bubble_greedy``).
        fit_f: F of the chunks in ``fit_f_chunks`` are fillers: such an F starts only if no B
            arrives before it would end; otherwise the rank waits for the B.
        fit_f_chunks: which chunks ``fit_f`` applies to.
    """

    order: tuple[tuple[str, int], ...] = (("B", 0), ("F", 0))
    fill_partial: bool = False
    fit_f: bool = False
    fit_f_chunks: tuple[int, ...] = (0,)
    fit_steady: float | None = None
    alternate: bool = False
    warmup_cap: tuple[int, ...] | None = None


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
    if isinstance(memory_limit, (int, float)) and not isinstance(memory_limit, bool):
        limits = [float(memory_limit)] * p
    else:
        limits = [float(x) for x in memory_limit]
        if len(limits) != p:
            raise ValueError(
                f"{name}: memory_limit has {len(limits)} per-rank values but there are {p} ranks; "
                "give one value per rank or a single number"
            )
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
        self.fit_stage = [rules.fit_f and self.chunk[s] in rules.fit_f_chunks for s in range(S)]
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
        self.peak = [0.0] * p
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.inflight: list[dict[int, list[float]]] = [{} for _ in range(p)]  # mb -> [held, need]
        self.last_fb = [""] * p  # kind of the rank's last F or B
        self.release = [False] * p  # the alternation gate is lifted for one action (deadlock breaker)
        self.left_f = [m * len(self.stages[r]) for r in range(p)]
        self.left_b = [m * len(self.stages[r]) for r in range(p)]
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
        if kind != "W":
            self.last_fb[r] = kind
            self.release[r] = False
            if kind == "F":
                self.left_f[r] -= 1
            else:
                self.left_b[r] -= 1
        if kind == "F":
            if self.first[r] < 0:
                self.first[r] = start
            self.end_f[s][j] = end
            self.nf[s] += 1
            self.mem[r] += t.mem_b[s]
            self.peak[r] = max(self.peak[r], self.mem[r])
            entry = self.inflight[r].setdefault(j, [0.0, self.rank_total_mem[r]])
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
            entry = self.inflight[r][j]
            entry[0] -= t.mem_b[s]
            if entry[0] <= _EPS and entry[1] <= _EPS:
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
                    out.append((self.prio[0][s], arr, "F", s, j))
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
        state = {k: (held, need) for k, (held, need) in self.inflight[r].items()}
        held, need = state.get(j, (0.0, self.rank_total_mem[r]))
        state[j] = (held + mb, need - mb)
        limit = self.limits[r] + _EPS
        suffix = 0.0
        for k in sorted(state, reverse=True):
            held, need = state[k]
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
                self.break_deadlock()
            time, _, r = heapq.heappop(self.heap)
            if time != self.due[r]:
                continue
            self.now = time
            self.due[r] = _INF
            self.decide(r, time)
        spans = [max((self.free[r] - self.first[r]), 0.0) for r in range(self.p)]
        return Plan(tuple(tuple(row) for row in self.rows), max(spans), tuple(self.peak), self.rules)

    def decide(self, r: int, now: float) -> None:
        t = self.t
        while True:
            if self.free[r] > now + _EPS:
                self.set_due(r, self.free[r])
                return
            cands = self.gate(r, self.candidates(r))
            ready = [c for c in cands if c[1] <= now + _EPS]
            warm = self.warm[r] or self.rules.fit_steady is not None
            firm = [c for c in ready if not (c[2] == "F" and warm and self.fit_stage[c[3]])]
            hold = self.hold[r]
            if firm:
                best = min(firm, key=lambda c: (c[0], c[1]))
                if hold is not None:
                    self.hold[r] = None
                    kind, s, j, start = hold
                    if self.keep_filler(r, kind, s, now - start):
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

    def gate(self, r: int, cands: list) -> list:
        """Strict alternation after the warm-up (``Rules.alternate``): after an F only a B, after a B
        only an F, while the rank has both left."""
        if not self.rules.alternate or self.warm[r] or self.release[r]:
            return cands
        want = "B" if self.last_fb[r] == "F" else "F"
        if (self.left_b[r] if want == "B" else self.left_f[r]) == 0:
            return cands
        return [c for c in cands if c[2] == want]

    def break_deadlock(self) -> None:
        """No rank can move: lift the alternation gate of the rank whose other-kind action arrives first."""
        best = None
        for r in range(self.p):
            for c in self.candidates(r):
                if best is None or c[1] < best[0]:
                    best = (c[1], r)
        if best is None:
            raise AssertionError("greedy scheduler bug: no rank can move (memory safety should prevent this)")
        arrival, r = best
        self.release[r] = True
        self.set_due(r, max(arrival, self.free[r]))

    @staticmethod
    def next_arrival(cands, now: float) -> float:
        later = [c[1] for c in cands if c[1] > now + _EPS]
        return min(later) if later else _INF

    def keep_filler(self, r: int, kind: str, s: int, gap: float) -> bool:
        """A filler started at ``start`` would delay what just arrived after ``gap``: keep it?"""
        if kind == "F":
            if self.warm[r] or self.rules.fit_steady is None:
                return False  # fit_f: the F waits for the B
            return gap >= self.rules.fit_steady * self.t.f[s]
        if self.rules.fill_partial:
            return True
        projected = [self.work[q] + self.bubble[q] for q in range(self.p)]
        return projected[r] + gap > max(projected) + _EPS
