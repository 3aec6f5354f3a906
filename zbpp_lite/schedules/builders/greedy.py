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
import math
import numbers
from collections import deque
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Iterable, Sequence

from ..costs import CostTable
from ..ir import Action, Schedule, deps, produces
from ..simulate import simulate
from ..validate import ScheduleError

_EPS = 1e-9
_INF = float("inf")
_PRIORITY = itemgetter(0, 1)  # a candidate's (priority, arrival): the first smallest runs


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
        ValueError: a NaN, infinite, negative or wrongly sized limit, or one below what the ranks need
            for the first microbatch to reach the last stage; the message names the smallest feasible limit.
    """
    p = 1 + max(placement, default=-1)
    is_number = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)  # noqa: E731
    if not (is_number(memory_limit) or isinstance(memory_limit, (list, tuple))
            and all(map(is_number, memory_limit))):
        raise ValueError(
            f"{name}: memory_limit must be a number or one number per rank, got {memory_limit!r}")
    if is_number(memory_limit):
        limits = [float(memory_limit)] * p
    else:
        limits = [float(x) for x in memory_limit]
        if len(limits) != p:
            raise ValueError(
                f"{name}: memory_limit has {len(limits)} per-rank values but there are {p} ranks; "
                "give one value per rank or a single number"
            )
    if not all(math.isfinite(x) for x in limits):
        raise ValueError(
            f"{name}: memory_limit must be finite (units of Costs.mem_b), got {memory_limit!r}; "
            "leave it out for the schedule's default"
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


@dataclass(frozen=True)
class Cutoff:
    """When a greedy run may stop: as soon as it is certain that its plan (makespan, peak memory)
    cannot win a comparison with a plan already made (branch and bound; not in the paper).

    The run stops once its makespan is certain to exceed ``above``, or to be at least ``floor``
    while its peak memory has reached ``peak``. "Certain" rests on a lower bound of the makespan
    that only grows: per rank, the span so far plus the rank's work not yet done (rounding
    allowed for; exact where every time is an integer). Peak memory only grows too.
    """

    above: float
    floor: float
    peak: float

    @classmethod
    def not_better(cls, best: Plan) -> "Cutoff":
        """Stop where the run cannot be :func:`_better` than ``best`` (as :meth:`Runs.best` compares)."""
        tol = 1e-9 * max(1.0, best.makespan)
        return cls(best.makespan + tol, best.makespan - tol, max(best.peak_memory) - 1e-9)

    @classmethod
    def not_before(cls, makespan: float, peak: float, ties_lose: bool) -> "Cutoff":
        """Stop where (makespan, peak) cannot sort before the given pair (exact comparison; on an
        equal pair the run loses when ``ties_lose``, e.g. because it comes later in a stable sort)."""
        return cls(makespan, makespan, peak if ties_lose else math.nextafter(peak, _INF))


class _Abandoned(Exception):
    """Raised inside a greedy run when its :class:`Cutoff` is met."""


class _Rejoined(Exception):
    """Raised inside a greedy run whose state at the end of the warm-up equals an earlier run's."""

    def __init__(self, record: "_Record"):
        self.record = record


@dataclass(frozen=True)
class _Record:
    """What one greedy run showed: its plan (None: abandoned), the warm-up counts at which its caps
    were asked (the largest answered yes and the smallest answered no, per rank), and its lower
    bound and peak memory when it ended."""

    rules: Rules
    plan: Plan | None
    cap_yes: tuple[int, ...]
    cap_no: tuple[float, ...]
    bound: float
    peak: float
    warm_end: tuple | None = None  # the run's whole state when its last rank left the warm-up


class Runs:
    """Greedy runs of one planning problem (placement, m, costs, limits), remembered.

    Three savings, all exact (the plans returned are the ones :func:`plan` computes):

    - a run whose rules differ from an earlier run's only in ``warmup_cap``, where the new caps
      answer every cap question of the earlier run the same way, *is* that run (same actions);
    - ``fit_f`` and ``warmup_cap`` act only in the warm-up (before a rank's first B): a run whose
      whole state when its last rank leaves the warm-up equals that of an earlier run with
      otherwise equal rules continues as that run did, so it ends there with that run's plan;
    - with a :class:`Cutoff`, a run stops once it cannot win (it returns None).
    """

    def __init__(self, placement: Sequence[int], num_microbatches: int, table: CostTable,
            limits: Sequence[float]):
        self.args = (list(placement), num_microbatches, table, list(limits))
        self.records: list[_Record] = []
        self.greedy_runs = 0  # runs simulated, in full or in part (for benchmarks and tests)
        self.rejoined = 0  # of those, runs that ended where they met an earlier run's state

    def run(self, rules: Rules, cutoff: Cutoff | None = None) -> Plan | None:
        """The plan of ``rules``, or None when ``cutoff`` shows it cannot win."""
        for rec in self.records:
            if _same_run(rec, rules):
                if rec.plan is not None:
                    return replace(rec.plan, rules=rules)
                if cutoff is not None and _Greedy.meets(cutoff, rec.bound, rec.peak, self._slack(cutoff)):
                    return None
        engine = _Greedy(*self.args, rules)
        engine.stop = cutoff
        engine.slack = self._slack(cutoff) if cutoff is not None else 0.0
        engine.at_warm_end = lambda state: self._rejoin(rules, state, cutoff)
        self.greedy_runs += 1
        try:
            result = engine.run()
        except _Abandoned:
            result = None
        except _Rejoined as same:
            self.rejoined += 1
            if same.record.plan is not None:
                return replace(same.record.plan, rules=rules)
            return None  # the earlier run was abandoned under a cutoff this one meets too (_rejoin)
        self.records.append(
            _Record(rules, result, tuple(engine.cap_yes), tuple(engine.cap_no), engine.bound, engine.max_peak,
                    engine.warm_state)
        )
        return result

    def _rejoin(self, rules: Rules, state: tuple, cutoff: Cutoff | None) -> None:
        """At the end of a run's warm-up: raise :class:`_Rejoined` if an earlier run with the same
        rules outside the warm-up reached this very state (and, if it was abandoned, this run's
        cutoff would stop it at the same point)."""
        plain = replace(rules, fit_f=False, warmup_cap=None)
        for rec in self.records:
            if rec.warm_end is None or replace(rec.rules, fit_f=False, warmup_cap=None) != plain:
                continue
            if rec.warm_end == state and (
                rec.plan is not None or cutoff is not None
                and _Greedy.meets(cutoff, rec.bound, rec.peak, self._slack(cutoff))
            ):
                raise _Rejoined(rec)

    def best(self, candidates: Iterable[Rules], best: Plan | None = None) -> Plan:
        """The plan of the shortest makespan over ``candidates`` (ties: the lower peak memory, then
        ``best`` if given, then the earlier candidate): the paper's search over its binary choices
        (arXiv 2401.10241, section 3.1)."""
        for rules in candidates:
            result = self.run(rules, None if best is None else Cutoff.not_better(best))
            if result is not None and (best is None or _better(result, best)):
                best = result
        if best is None:
            raise ValueError("Runs.best needs at least one Rules candidate")
        return best

    def _slack(self, cutoff: Cutoff) -> float:
        """How far the lower bound may be off by rounding: nothing where every time is an integer
        (below 2**50 in all), else 8 ulps per action of the magnitudes compared."""
        _, m, t, _ = self.args
        times = (*t.f, *t.b, *t.w, *t.comm)
        actions = 3 * len(t.f) * m
        if all(float(x).is_integer() for x in times) and actions * max(times, default=0.0) < 2.0**50:
            return 0.0
        scale = max(1.0, abs(cutoff.above), abs(cutoff.floor))
        return 8.0 * actions * scale * 2.0**-52


def _same_run(rec: _Record, rules: Rules) -> bool:
    """Would ``rules`` make the same decisions as ``rec`` did (up to where ``rec`` ended)?"""
    if replace(rules, warmup_cap=rec.rules.warmup_cap) != rec.rules:
        return False
    caps = rules.warmup_cap or (_INF,) * len(rec.cap_yes)
    return all(yes < cap <= no for yes, cap, no in zip(rec.cap_yes, caps, rec.cap_no, strict=True))


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
        self.prio = [[rank_of_class.get((k, self.chunk[s]), len(rules.order)) for s in range(S)]
            for k in "FB"]
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
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        self.inflight: list[dict[int, list]] = [{} for _ in range(p)]  # mb -> [held, need, B left]
        self.warm = [True] * p  # before the rank's first B: the warm-up phase
        self.warm_left = p  # ranks still in the warm-up
        self.at_warm_end = None  # called with the state when the last rank leaves the warm-up (Runs)
        self.warm_state: tuple | None = None
        self.hold: list[tuple[str, int, int, float] | None] = [None] * p
        self.due = [0.0] * p  # next decision time
        self.rows: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]  # (kind, stage, microbatch)
        self.dur = {"F": table.f, "B": table.b, "W": table.w}
        self.comm = table.comm
        self.most_projected = max(self.work, default=0.0)  # max over ranks of work + bubble so far
        self.left = 3 * S * m
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0
        # branch and bound (Runs): stop once the cutoff is met; bound = largest per-rank lower bound
        # on the span (span so far + work left), never below a rank's whole work
        self.stop: Cutoff | None = None
        self.slack = 0.0
        self.done = [0.0] * p
        self.bound = max(self.work, default=0.0)
        self.max_peak = 0.0
        # warm-up cap questions (Runs): per rank, the largest count answered yes and smallest answered no
        self.cap_yes = [-1] * p
        self.cap_no = [_INF] * p
        self.safe: list[dict[int, bool]] = [{} for _ in range(p)]  # stage -> safe_f of its next F, per rank

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
        free = self.free[r]
        if self.first[r] >= 0 and start > free + _EPS:
            self.bubble[r] += start - free
            projected = self.work[r] + self.bubble[r]
            if projected > self.most_projected:
                self.most_projected = projected
        dur = self.dur[kind][s]
        end = start + dur
        grew = False
        self.free[r] = end
        self.rows[r].append((kind, s, j))
        self.left -= 1
        if kind != "W":
            self.safe[r].clear()  # the rank's in-flight memory changed
        if kind == "F":
            if self.first[r] < 0:
                self.first[r] = start
            self.end_f[s][j] = end
            self.nf[s] += 1
            mb = t.mem_b[s]
            mem = self.mem[r] = self.mem[r] + mb
            if mem > self.peak[r]:
                self.peak[r] = mem
                if mem > self.max_peak:
                    self.max_peak = mem
                    grew = True
            self.held[r] += mb
            entry = self.inflight[r].setdefault(j, [0.0, self.rank_total_mem[r], len(self.stages[r])])
            entry[0] += mb
            entry[1] -= mb
            if s + 1 < self.S and self.placement[s + 1] != r:
                self.wake(self.placement[s + 1], max(end + self.comm[s], self.now))
        elif kind == "B":
            self.end_b[s][j] = end
            self.nb[s] += 1
            if self.warm[r]:
                self.warm[r] = False
                self.warm_left -= 1
            mb = t.mem_b[s]
            self.mem[r] -= mb - t.mem_w[s]
            self.pending_w[r].append((s, j))
            self.held[r] -= mb
            inflight = self.inflight[r]
            entry = inflight[j]
            entry[0] -= mb
            entry[2] -= 1
            if entry[2] == 0:  # its last B on this rank: only the W's share remains, always freeable
                del inflight[j]
            if s > 0 and self.placement[s - 1] != r:
                self.wake(self.placement[s - 1], max(end + self.comm[s], self.now))
        else:
            self.mem[r] -= t.mem_w[s]
        self.done[r] += dur
        bound = (end - self.first[r]) + (self.work[r] - self.done[r])
        if bound > self.bound:
            self.bound = bound
            grew = True
        # the cutoff only grows more certain as bound and peak grow: checked when they do (and at first)
        if (grew or self.left == 3 * self.S * self.m - 1) and self.stop is not None and self.meets(
                self.stop, self.bound, self.max_peak, self.slack):
            raise _Abandoned
        if kind == "B" and self.warm_left == 0 and self.warm_state is None and self.at_warm_end is not None:
            self.warm_state = self.state(r)
            self.at_warm_end(self.warm_state)
        return end

    def state(self, r: int) -> tuple:
        """Everything the rest of the run depends on, in the middle of rank r's decision at ``now``
        (the heap as its entries' (time, rank) in pop order: later pushes sort after all of them)."""
        heap = [(t, q) for t, _, q in sorted(self.heap)]
        inflight = [tuple((k, tuple(v)) for k, v in d.items()) for d in self.inflight]
        return (
            r, self.now, self.left, tuple(self.free), tuple(self.first), tuple(self.bubble), tuple(self.mem),
            tuple(self.held), tuple(self.peak), tuple(tuple(w) for w in self.pending_w), tuple(inflight),
            tuple(self.hold), tuple(self.due), tuple(heap), tuple(self.nf), tuple(self.nb),
            tuple(map(tuple, self.end_f)), tuple(map(tuple, self.end_b)), self.most_projected,
            tuple(self.done),
            self.bound, self.max_peak, tuple(map(tuple, self.rows)),
        )

    @staticmethod
    def meets(cutoff: Cutoff, bound: float, peak: float, slack: float) -> bool:
        """Is ``cutoff`` met by a run whose makespan is at least ``bound`` (up to ``slack``) and whose
        peak memory is at least ``peak``?"""
        return bound > cutoff.above + slack or (bound >= cutoff.floor + slack and peak >= cutoff.peak)

    # ------------------------------------------------------------------ candidates

    def candidates(self, r: int) -> list[tuple[int, float, str, int, int]]:
        """(priority, arrival, kind, stage, microbatch) of the next F and B of each of the rank's stages
        whose inputs are computed (F only if memory allows it safely)."""
        out = []
        S, placement, comm, nf, end_f = self.S, self.placement, self.comm, self.nf, self.end_f
        safe = self.safe[r]
        for s in self.stages[r]:
            j = nf[s]
            if j < self.m:
                if s == 0:
                    arr = 0.0
                else:
                    e = end_f[s - 1][j]
                    arr = -1.0 if e < 0 else e + comm[s - 1] if placement[s - 1] != r else e
                ok = arr >= 0 and safe.get(s)
                if ok is None:
                    ok = safe[s] = self.safe_f(r, s, j)
                if ok and (not self.warm[r] or self.within_cap(r, s)):
                    starving = self.rules.feed and s + 1 < S and placement[s + 1] != r and nf[s + 1] >= j
                    out.append((-1 if starving else self.prio[0][s], arr, "F", s, j))
            j = self.nb[s]
            if j < nf[s]:
                if s == S - 1:
                    arr = end_f[s][j]
                else:
                    e = self.end_b[s + 1][j]
                    if e < 0:
                        continue
                    if placement[s + 1] != r:
                        e += comm[s + 1]
                    arr = end_f[s][j]
                    if e > arr:
                        arr = e
                out.append((self.prio[1][s], arr, "B", s, j))
        return out

    def within_cap(self, r: int, s: int) -> bool:
        if not self.warm[r] or self.chunk[s] != 0:
            return True
        n, cap = self.nf[s], self.rules.warmup_cap
        if cap is None or n < cap[r]:
            self.cap_yes[r] = max(self.cap_yes[r], n)
            return True
        self.cap_no[r] = min(self.cap_no[r], n)
        return False

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
        for k in reversed(inflight):  # newest first: entries are made in increasing microbatch order
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
            ws, wj = self.pending_w[r].popleft()
            self.commit(r, "W", ws, wj, self.free[r])
        self.commit(r, "F", s, j, max(self.free[r], arrival))

    def run(self) -> Plan:
        self.now = 0.0
        for r in range(self.p):
            self.set_due(r, 0.0)
        while self.left:
            if not self.heap:
                raise AssertionError("greedy scheduler bug: no rank can move (memory safety prevents this)")
            time, _, r = heapq.heappop(self.heap)
            if time != self.due[r]:
                continue
            self.now = time
            self.due[r] = _INF
            self.decide(r, time)
        spans = [max((self.free[r] - self.first[r]), 0.0) for r in range(self.p)]
        actions = tuple(tuple(Action(*x) for x in row) for row in self.rows)
        return Plan(actions, max(spans), tuple(self.peak), self.rules)

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
            fit = warm and self.rules.fit_f
            firm = [c for c in ready if not (c[2] == "F" and self.fit_stage[c[3]])] if fit else ready
            hold = self.hold[r]
            if firm:
                best = firm[0] if len(firm) == 1 else min(firm, key=_PRIORITY)
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
                _, arr, _, s, j = min(fillers, key=_PRIORITY)
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
        return self.work[r] + self.bubble[r] + gap > self.most_projected + _EPS


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


def evaluator(rows: list, placement: Sequence[int], num_microbatches: int, table: CostTable,
        limits: Sequence[float]):
    """A function that simulates ``rows`` (as they are when called) and returns (makespan, peak
    memory per rank), or (inf, ()) for a deadlocking order or one over the memory limits."""
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
                row.insert(len(row) if offset is None else min(i + offset, len(row)),
                    Action("W", x.stage, x.microbatch))
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
