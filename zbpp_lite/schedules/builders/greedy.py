"""The greedy, time-driven list scheduler shared by zb-auto, zb-v, v-half and v-min (pure Python).

Source: arXiv 2401.10241 section 3.1 (the automatic scheduler's heuristic) and arXiv 2405.15362 section 4
(greedy V-shape schedules under a memory limit).

Every rank walks through time. When free it looks at the F and B whose inputs have arrived (producer's end,
plus T_comm across ranks) and runs the first in its :class:`Rules` priority order; an F runs only if memory
stays within the limit and *safe*, after running pending W if needed ("W when memory demands it"). When
nothing has arrived a pending W fills the gap if it fits, or if leaving the gap would raise the largest
accumulated bubble (``Rules.fill_partial``: always; ``Rules.keep_gaps``: never). ``Rules.fit_f`` makes a
warm-up chunk-0 F a filler too; ``Rules.warmup_cap`` bounds the warm-up. Leftover W run last. Plans equal
what :func:`zbpp_lite.simulate` computes for their action lists.

*Safe*: after the F, every in-flight microbatch could still finish in microbatch order within the limit, so
the scheduler never deadlocks for any limit >= :func:`smallest_feasible_limit`.
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


class HeavyW(ValueError):
    """A planner refused costs whose M_W exceeds M_B (``jax.checkpoint``: B recomputes W's operands and
    holds them until W); ``what``: the planner and the stages, without the advice after it."""

    def __init__(self, what: str, advice: str):
        super().__init__(f"{what}: {advice}")
        self.what = what
_INF = float("inf")
_PRIORITY = itemgetter(0, 1)  # a candidate's (priority, arrival): the first smallest runs


@dataclass(frozen=True)
class Rules:
    """The choices of one greedy run: the priority order and the paper's binary hyperparameters.

    Attributes:
        order: priority of the F/B classes as ``(kind, chunk)`` pairs; chunk is the stage's position among the
            rank's stages (V placement: chunk 0 is stage r, chunk 1 is stage 2p-1-r). Unlisted classes last.
        fill_partial: run a W in a gap shorter than T_W even when the largest bubble would not grow.
        fit_f: in a rank's warm-up, a chunk-0 F starts only if nothing of higher priority arrives
            before it ends.
        warmup_cap: per rank, the most chunk-0 F before its first B (None: only memory limits the warm-up).
        feed: an F whose consumer on the next rank has run out of input goes first.
        keep_gaps: never run a W in a gap shorter than T_W.
    """

    order: tuple[tuple[str, int], ...] = (("B", 0), ("F", 0))
    fill_partial: bool = False
    fit_f: bool = False
    warmup_cap: tuple[int, ...] | None = None
    feed: bool = False
    keep_gaps: bool = False


@dataclass(frozen=True)
class Plan:
    """What a greedy run produced.

    Attributes:
        actions: ``actions[rank]``, the rank's actions in start order.
        makespan: longest per-rank span (first F start to last end), the costs' time unit.
        peak_memory: per-rank peak activation memory (units of mem_b).
        rules: the :class:`Rules` that produced it (None: not a greedy run, e.g. zb-v's ``paper_v``).
    """

    actions: tuple[tuple[Action, ...], ...]
    makespan: float
    peak_memory: tuple[float, ...]
    rules: Rules | None

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
    """The smallest per-rank memory limit any schedule meets: one microbatch on all the rank's stages
    (arXiv 2401.10241 section 3; units of mem_b)."""
    return max(rank_stage_memory(placement, table), default=0.0)


def per_rank_limits(
    name: str, memory_limit: float | Sequence[float], placement: Sequence[int], table: CostTable
) -> list[float]:
    """Resolve ``memory_limit`` (a scalar or one value per rank) and check it is feasible. Raises
    ValueError: a NaN, infinite, negative or wrongly sized limit, one below
    :func:`smallest_feasible_limit` (the message names it), or a stage whose M_W exceeds its M_B."""
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
    heavy = [s for s, (b, w) in enumerate(zip(table.mem_b, table.mem_w)) if w > b]
    if heavy:  # B would allocate (jax.checkpoint: W's operands recomputed by B wait for W)
        raise HeavyW(
            f"{name}: M_W exceeds M_B on stage(s) {heavy} (M_B {[table.mem_b[s] for s in heavy]}, M_W "
            f"{[table.mem_w[s] for s in heavy]})",
            "the planner has B free memory; give mem_b = max(M_B, M_W) to plan as if F held M_W already (the "
            "limit then holds), or a schedule without a W apart (1f1b)"
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
        limits: per-rank activation-memory limits (units of mem_b), from :func:`per_rank_limits`.
        rules: the priority order and binary choices.

    Returns:
        A :class:`Plan` whose times equal what :func:`zbpp_lite.simulate` computes.
    """
    return _Greedy(placement, num_microbatches, table, limits, rules).run()


@dataclass(frozen=True)
class Cutoff:
    """When a greedy run may stop: its (makespan, peak memory) cannot win (branch and bound, not in paper).

    Stops once the makespan is certain to exceed ``above``, or to be >= ``floor`` with peak memory >=
    ``peak``. "Certain" uses growing lower bounds: per rank, span so far plus work left (rounding allowed);
    once the last microbatch has entered, :meth:`_Greedy.last_chain`; for the peak, :meth:`Runs.peak_floor`
    (what any plan no longer than ``above`` peaks at), so a run that cannot win may stop at its first action.
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
        """Stop where (makespan, peak) cannot sort before the pair (an equal pair loses if ``ties_lose``)."""
        return cls(makespan, makespan, peak if ties_lose else math.nextafter(peak, _INF))

    @classmethod
    def capped(cls, cutoff: "Cutoff | None", longest: float) -> "Cutoff | None":
        """``cutoff`` (None: none) that also stops where the makespan is certain to exceed ``longest``."""
        if longest == _INF:
            return cutoff
        if cutoff is None:
            return cls(longest, longest, _INF)
        return cls(min(cutoff.above, longest), cutoff.floor, cutoff.peak)


class _Abandoned(Exception):
    """Raised inside a greedy run when its :class:`Cutoff` is met."""


class _Rejoined(Exception):
    """Raised inside a greedy run whose state at the end of the warm-up equals an earlier run's."""

    def __init__(self, record: "_Record"):
        self.record = record


@dataclass(frozen=True)
class _Record:
    """One greedy run: its plan (None: abandoned), the largest-yes/smallest-no warm-up cap asked per rank,
    its lower bound and peak memory at the end, and whether ``Rules.fill_partial`` changed any answer."""

    rules: Rules
    plan: Plan | None
    cap_yes: tuple[int, ...]
    cap_no: tuple[float, ...]
    bound: float
    peak: float
    fill_matters: bool
    warm_end: tuple | None = None  # the run's whole state when its last rank left the warm-up


class Runs:
    """Greedy runs of one planning problem (placement, m, costs, limits), remembered; plans equal
    :func:`plan`'s.

    Exact savings: a run whose caps answer every cap question of an earlier run alike, and whose
    ``fill_partial`` differs only where that run's never changed an answer, *is* that run; a run whose
    state at the end of the warm-up equals an earlier run's (rules equal outside the warm-up) ends with its
    plan, and is remembered as a run of its own; with a :class:`Cutoff` a run stops (returns None) once it
    cannot win, and once it is certain to be longer than :attr:`longest` (a caller's own plan's makespan:
    nothing longer is wanted; default infinity).

    ``effort``: once the runs have simulated this many actions in all (abandoned runs count what they
    simulated), no new run starts: :meth:`run` returns None for it (default infinity; the first run always
    starts, and runs in full unless a cutoff stops it). A cap on planning time, not an exact saving.
    """

    def __init__(self, placement: Sequence[int], num_microbatches: int, table: CostTable,
            limits: Sequence[float], longest: float = _INF, effort: float = _INF):
        self.args = (list(placement), num_microbatches, table, list(limits))
        self.records: list[_Record] = []
        self.greedy_runs = 0  # runs simulated, in full or in part (for benchmarks and tests)
        self.rejoined = 0  # of those, runs that ended where they met an earlier run's state
        self.floors: dict[float, float] = {}  # peak_floor's answers
        self.longest = longest  # every run stops once certain to be longer than this
        self.effort = effort
        self.simulated = 0  # actions committed by every run so far
        self.skipped = 0  # runs not started because the effort was spent

    def run(self, rules: Rules, cutoff: Cutoff | None = None) -> Plan | None:
        """The plan of ``rules``, or None when ``cutoff`` shows it cannot win, it is longer than
        :attr:`longest`, or :attr:`effort` is spent."""
        cutoff = Cutoff.capped(cutoff, self.longest)
        for rec in self.records:
            if _same_run(rec, rules):
                if rec.plan is not None:
                    return replace(rec.plan, rules=rules)
                if cutoff is not None and self._meets(cutoff, rec.bound, rec.peak):
                    return None
        if self.greedy_runs and self.simulated >= self.effort:
            self.skipped += 1
            return None
        engine = _Greedy(*self.args, rules)
        engine.stop = cutoff
        engine.slack = self._slack(cutoff) if cutoff is not None else 0.0
        engine.peak_floor = self.peak_floor(cutoff.above + engine.slack) if cutoff is not None else 0.0
        engine.at_warm_end = lambda state: self._rejoin(rules, state, cutoff)
        self.greedy_runs += 1
        try:
            result = engine.run()
        except _Abandoned:
            result = None
        except _Rejoined as same:
            self.rejoined += 1
            rec = same.record  # this run from here on: its own warm-up answers, then rec's
            self.records.append(replace(rec, rules=rules, cap_yes=tuple(engine.cap_yes),
                cap_no=tuple(engine.cap_no), fill_matters=rec.fill_matters or engine.fill_matters))
            if rec.plan is not None:
                return replace(rec.plan, rules=rules)
            return None  # the earlier run was abandoned under a cutoff this one meets too (_rejoin)
        finally:
            self.simulated += engine.total - engine.left  # in full, abandoned or rejoined
        self.records.append(
            _Record(rules, result, tuple(engine.cap_yes), tuple(engine.cap_no),
                    max(engine.bound, engine.chain), engine.max_peak, engine.fill_matters, engine.warm_state)
        )
        return result

    def _rejoin(self, rules: Rules, state: tuple, cutoff: Cutoff | None) -> None:
        """At the end of the warm-up: raise :class:`_Rejoined` if an earlier run with equal rules outside the
        warm-up reached this state (and, if abandoned, this run's cutoff would stop it there too); as in
        :func:`_same_run`, ``fill_partial`` counts only where it changed an answer of the earlier run."""
        for rec in self.records:
            fill = rec.rules.fill_partial if not rec.fill_matters else rules.fill_partial
            plain = replace(rules, fit_f=False, warmup_cap=None, fill_partial=fill)
            if rec.warm_end is None or replace(rec.rules, fit_f=False, warmup_cap=None) != plain:
                continue
            if rec.warm_end == state and (
                rec.plan is not None or cutoff is not None
                and self._meets(cutoff, rec.bound, rec.peak)
            ):
                raise _Rejoined(rec)

    def best(self, candidates: Iterable[Rules], best: Plan | None = None) -> Plan | None:
        """The plan of the shortest makespan over ``candidates`` (ties: lower peak memory, then ``best``, then
        the earlier candidate): the paper's search over its binary choices (arXiv 2401.10241 section 3.1).
        None where every run is longer than :attr:`longest`."""
        tried = best is not None
        for rules in candidates:
            tried = True
            result = self.run(rules, None if best is None else Cutoff.not_better(best))
            if result is not None and (best is None or _better(result, best)):
                best = result
        if not tried:
            raise ValueError("Runs.best needs at least one Rules candidate")
        return best

    def _meets(self, cutoff: Cutoff, bound: float, peak: float) -> bool:
        """:meth:`_Greedy.meets` for a run that reached ``bound`` and ``peak``, with :meth:`peak_floor`."""
        slack = self._slack(cutoff)
        return _Greedy.meets(cutoff, bound, max(peak, self.peak_floor(cutoff.above + slack)), slack)

    def peak_floor(self, makespan: float) -> float:
        """A lower bound on the peak memory of any plan of this problem whose makespan is at most
        ``makespan`` (not in the papers; branch and bound, :class:`Cutoff`).

        Rank r starts with F of its first stage s0 and runs no B before microbatch j's F has gone from s0
        down to the last stage and its B back to the rank's last stage: a chain of at least ``L`` after the
        rank's first start, during which the rank runs only F (no W without a B). Its span is at most
        ``makespan`` and holds its whole work, so it idles at most ``makespan - work`` in all: its F before
        the first B last at least ``L - (makespan - work)``, so there are at least that over the rank's
        longest F of them, each holding at least the rank's smallest M_B, all held at the first B (summed
        from 0.0 in order, as the run sums them: float addition is monotone). Where times are not whole
        numbers, ``L`` is taken :meth:`_slack` shorter. Remembered per ``makespan``."""
        known = self.floors.get(makespan)
        if known is not None:
            return known
        placement, m, t, _ = self.args
        S = len(placement)
        slack = self._slack(Cutoff(makespan, makespan, 0.0))
        most = 0.0
        for r in range(1 + max(placement, default=-1)):
            stages = [s for s in range(S) if placement[s] == r]
            if not stages:
                continue
            s0, s1 = stages[0], stages[-1]
            chain = 0.0  # F from s0 to the last stage, then B from the last stage to s1's successor
            for s in range(s0, S):
                chain += t.f[s] + (t.comm[s - 1] if s > s0 and placement[s - 1] != placement[s] else 0.0)
            for s in range(S - 2, s1 - 1, -1):
                chain += t.b[s + 1] + (t.comm[s + 1] if placement[s + 1] != placement[s] else 0.0)
            work = m * sum(t.f[s] + t.b[s] + t.w[s] for s in stages)
            busy = chain - slack - (makespan - work)
            longest = max(t.f[s] for s in stages)
            if busy <= 0 or longest <= 0:
                continue
            quotient = busy / longest
            count = min(math.ceil(quotient - 1e-9 * max(1.0, quotient)), m * len(stages))
            held, least = 0.0, min(t.mem_b[s] for s in stages)
            for _ in range(count):
                held += least
            most = max(most, held)
        self.floors[makespan] = most
        return most

    def _slack(self, cutoff: Cutoff) -> float:
        """Rounding allowance of the lower bound: 0 for integer times (< 2**50), else 8 ulps per action."""
        _, m, t, _ = self.args
        times = (*t.f, *t.b, *t.w, *t.comm)
        actions = 3 * len(t.f) * m
        if all(float(x).is_integer() for x in times) and actions * max(times, default=0.0) < 2.0**50:
            return 0.0
        scale = max(1.0, abs(cutoff.above), abs(cutoff.floor))
        return 8.0 * actions * scale * 2.0**-52


def _same_run(rec: _Record, rules: Rules) -> bool:
    """Would ``rules`` make the same decisions as ``rec`` did (up to where ``rec`` ended)?"""
    fill = rec.rules.fill_partial if not rec.fill_matters else rules.fill_partial
    if replace(rules, warmup_cap=rec.rules.warmup_cap, fill_partial=fill) != rec.rules:
        return False
    caps = rules.warmup_cap or (_INF,) * len(rec.cap_yes)
    return all(yes < cap <= no for yes, cap, no in zip(rec.cap_yes, caps, rec.cap_no, strict=True))


class _Greedy:
    """One run: per-rank clocks, next F/B per stage, memory held, pending W, and a heap of decision times."""

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
        self.partial = [0] * p  # per rank: in-flight microbatches whose need is > 0 (safe_f's binding ones)
        self.warm = [True] * p  # before the rank's first B: the warm-up phase
        self.warm_left = p  # ranks still in the warm-up
        self.at_warm_end = None  # called with the state when the last rank leaves the warm-up (Runs)
        self.warm_state: tuple | None = None
        self.hold: list[tuple[str, int, int, float] | None] = [None] * p
        self.due = [0.0] * p  # next decision time
        self.rows: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]  # (kind, stage, microbatch)
        self.dur = {"F": table.f, "B": table.b, "W": table.w}
        self.comm = table.comm
        # transfer time added to an input's arrival: from stage s-1 (F) or s+1 (B) when on another rank
        self.f_delay = [table.comm[s - 1] if s and placement[s - 1] != placement[s] else 0.0
            for s in range(S)]
        self.b_delay = [table.comm[s + 1] if s + 1 < S and placement[s + 1] != placement[s] else 0.0
            for s in range(S)]
        self.most_projected = max(self.work, default=0.0)  # max over ranks of work + bubble so far
        self.left = self.total = 3 * S * m
        self.heap: list[tuple[float, int]] = []  # (time, rank): ties go to the lower rank
        # branch and bound (Runs): stop once the cutoff is met; bound = largest per-rank lower bound
        # on the span (span so far + work left), never below a rank's whole work
        self.stop: Cutoff | None = None
        self.slack = 0.0
        self.done = [0.0] * p
        self.bound = max(self.work, default=0.0)
        self.chain = 0.0  # last_chain's largest, once the last microbatch has entered
        self.max_peak = 0.0
        self.peak_floor = 0.0  # Runs.peak_floor at the cutoff: the peak any run that could win reaches
        # warm-up cap questions (Runs): per rank, the largest count answered yes and smallest answered no
        self.cap_yes = [-1] * p
        self.cap_no = [_INF] * p
        self.fill_matters = False  # did fill_partial change a keep_filler answer (Runs)
        self.safe: list[dict[int, bool]] = [{} for _ in range(p)]  # stage -> safe_f of its next F, per rank
        self.links = [self._links_of(r) for r in range(p)]  # what candidates reads, per rank and stage
        self.pair = [self._pair_of(r) for r in range(p)]  # (s0, mb0, need0) where _safe_pair applies
        self.pair_sums = [[0.0] for _ in range(p)]  # per rank: _sum_of's running sums of mb0

    def _pair_of(self, r: int) -> tuple[int, float, float] | None:
        """(s0, M_B(s0), need after F on s0) where rank r has two stages s0 < s1 and a microbatch past F on
        both needs nothing more (as _hold computes it): :meth:`_safe_pair`'s case; else None."""
        if len(self.stages[r]) != 2:
            return None
        s0, s1 = self.stages[r]
        mb0, mb1 = self.t.mem_b[s0], self.t.mem_b[s1]
        need0 = self.rank_total_mem[r] - mb0
        return (s0, mb0, need0) if need0 - mb1 <= 0 and mb0 >= 0 and mb1 >= 0 else None

    # ------------------------------------------------------------------ bookkeeping

    def wake(self, r: int, time: float) -> None:
        if time < self.due[r] - _EPS:
            self.due[r] = time
            heapq.heappush(self.heap, (time, r))

    def set_due(self, r: int, time: float) -> None:
        self.due[r] = time
        if time < _INF:
            heapq.heappush(self.heap, (time, r))

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
            self._hold(r, j, mb)
            if s + 1 < self.S and self.placement[s + 1] != r:
                arrive = end + self.comm[s]
                self.wake(self.placement[s + 1], self.now if self.now > arrive else arrive)
        elif kind == "B":
            self.end_b[s][j] = end
            self.nb[s] += 1
            if self.warm[r]:
                self.warm[r] = False
                self.warm_left -= 1
            mb = t.mem_b[s]
            self.mem[r] -= mb - t.mem_w[s]
            self.pending_w[r].append((s, j))
            self._release(r, j, mb)
            if s > 0 and self.placement[s - 1] != r:
                arrive = end + self.comm[s]
                self.wake(self.placement[s - 1], self.now if self.now > arrive else arrive)
        else:
            self.mem[r] -= t.mem_w[s]
        done = self.done[r] = self.done[r] + dur
        bound = (end - self.first[r]) + (self.work[r] - done)
        if bound > self.bound:
            self.bound = bound
            grew = True
        stop = self.stop
        if stop is not None:
            if self.nf[0] == self.m and self.left % self.S == 0:
                chain = self.last_chain()  # once every stage's worth of actions, kept out of state()
                if chain > self.chain:
                    self.chain = chain
                    grew = True
            # the cutoff only grows more certain as bound and peak grow: checked when they do (and at first)
            if (grew or self.left == self.total - 1) and self.meets(
                    stop, max(self.bound, self.chain), max(self.max_peak, self.peak_floor), self.slack):
                raise _Abandoned
        if kind == "B" and self.warm_left == 0 and self.warm_state is None and self.at_warm_end is not None:
            self.warm_state = self.state(r)
            self.at_warm_end(self.warm_state)
        return end

    def _hold(self, r: int, j: int, mb: float) -> None:
        """Rank r's F of microbatch j holds ``mb`` more: its in-flight entry ``[held, still to come, stages
        left]`` and the count of microbatches still needing memory (``partial``, what ``safe_f`` walks)."""
        self.held[r] += mb
        entry = self.inflight[r].get(j)
        if entry is None:
            entry = self.inflight[r][j] = [0.0, self.rank_total_mem[r], len(self.stages[r])]
        elif entry[1] > 0:
            self.partial[r] -= 1
        entry[0] += mb
        entry[1] -= mb
        if entry[1] > 0:
            self.partial[r] += 1

    def _release(self, r: int, j: int, mb: float) -> None:
        """Rank r's B of microbatch j frees ``mb``; after its last B there only the W's share remains."""
        self.held[r] -= mb
        inflight = self.inflight[r]
        entry = inflight[j]
        entry[0] -= mb
        entry[2] -= 1
        if entry[2] == 0:  # its last B on this rank: only the W's share remains, always freeable
            del inflight[j]
            if entry[1] > 0:
                self.partial[r] -= 1

    def last_chain(self) -> float:
        """A lower bound on the makespan from the last microbatch alone: its F and B down and up the stages
        as early as their inputs and ranks (``free``) allow, then each rank's W after its B."""
        j, t, free, placement = self.m - 1, self.t, self.free, self.placement
        ends_f = []
        ready = 0.0
        for s in range(self.S):
            if self.nf[s] > j:
                end = self.end_f[s][j]
            else:
                if s:
                    ready += self.f_delay[s]
                end = max(free[placement[s]], ready) + t.f[s]
            ends_f.append(end)
            ready = end
        most = 0.0
        ready = ends_f[-1]
        for s in range(self.S - 1, -1, -1):
            r = placement[s]
            if self.nb[s] > j:
                end = self.end_b[s][j]
            else:
                if s < self.S - 1:
                    ready += self.b_delay[s]
                end = max(free[r], ready, ends_f[s]) + t.b[s]
            ready = end
            if self.first[r] >= 0:
                most = max(most, end + t.w[s] - self.first[r])
        return most

    def state(self, r: int) -> tuple:
        """Everything the rest of the run depends on, mid-decision of rank r at ``now``. The heap is not in
        it: its entries that still fire are (``due[q]``, q), popped in (time, rank) order whatever the order
        they were pushed in, and the others (a time no longer ``due``) are skipped when popped."""
        inflight = [tuple((k, tuple(v)) for k, v in d.items()) for d in self.inflight]
        return (
            r, self.now, self.left, tuple(self.free), tuple(self.first), tuple(self.bubble), tuple(self.mem),
            tuple(self.held), tuple(self.peak), tuple(tuple(w) for w in self.pending_w), tuple(inflight),
            tuple(self.hold), tuple(self.due), tuple(self.nf), tuple(self.nb),
            tuple(map(tuple, self.end_f)), tuple(map(tuple, self.end_b)), self.most_projected,
            tuple(self.done),
            self.bound, self.max_peak, tuple(map(tuple, self.rows)),
        )

    @staticmethod
    def meets(cutoff: Cutoff, bound: float, peak: float, slack: float) -> bool:
        """Is ``cutoff`` met with makespan >= ``bound`` (up to ``slack``) and peak memory >= ``peak``?"""
        return bound > cutoff.above + slack or (bound >= cutoff.floor + slack and peak >= cutoff.peak)

    # ------------------------------------------------------------------ candidates

    def candidates(self, r: int) -> list[tuple[int, float, str, int, int]]:
        """(priority, arrival, kind, stage, microbatch) of the rank's next ready F and B (F only if safe)."""
        out = []
        nf, nb, m = self.nf, self.nb, self.m
        safe, warm, feed = self.safe[r], self.warm[r], self.rules.feed
        for s, before, f_delay, prio_f, chunk, feeds, own, after, b_delay, prio_b in self.links[r]:
            j = nf[s]
            if j < m:
                if before is None:  # the first stage: its input is there from the start
                    arr = 0.0
                else:
                    e = before[j]
                    arr = -1.0 if e < 0 else e + f_delay
                ok = arr >= 0 and safe.get(s)
                if ok is None:
                    ok = safe[s] = self.safe_f(r, s, j)
                if ok and (not warm or chunk or self.within_cap(r, s)):  # within_cap's own test first
                    starving = feed and feeds and nf[s + 1] >= j
                    out.append((-1 if starving else prio_f, arr, "F", s, j))
            j = nb[s]
            if j < nf[s]:
                if after is None:  # the last stage: B follows its own F
                    arr = own[j]
                else:
                    e = after[j]
                    if e < 0:
                        continue
                    e += b_delay
                    arr = own[j]
                    if e > arr:
                        arr = e
                out.append((prio_b, arr, "B", s, j))
        return out

    def _links_of(self, r: int) -> list[tuple]:
        """Per stage s of rank r, what :meth:`candidates` reads: (s, end_f of s - 1 or None, its transfer
        delay, F's priority, chunk, whether s + 1 is on another rank, end_f of s, end_b of s + 1 or None,
        its transfer delay, B's priority); the end lists are the run's own, filled as it goes."""
        S, placement = self.S, self.placement
        return [(s, self.end_f[s - 1] if s else None, self.f_delay[s], self.prio[0][s], self.chunk[s],
                 s + 1 < S and placement[s + 1] != r, self.end_f[s], self.end_b[s + 1] if s + 1 < S else None,
                 self.b_delay[s], self.prio[1][s]) for s in self.stages[r]]

    def within_cap(self, r: int, s: int) -> bool:
        if not self.warm[r] or self.chunk[s] != 0:
            return True
        n, cap = self.nf[s], self.rules.warmup_cap
        if cap is None or n < cap[r]:
            if n > self.cap_yes[r]:
                self.cap_yes[r] = n
            return True
        if n < self.cap_no[r]:
            self.cap_no[r] = n
        return False

    def safe_f(self, r: int, s: int, j: int) -> bool:
        """Would F(s, j) leave rank r safe (every in-flight microbatch k, with those after it, still fits)?

        Microbatch k fits if the memory held by k and every later one, plus what k still needs, is within
        the limit. Where k needs nothing more, that holds if all memory held does (every k's suffix is at
        most the whole), so only the microbatches still needing memory (``partial``, newest first) are
        walked, then the total: the same answer as walking them all. On a rank of two stages the walk is
        not needed (:meth:`_safe_pair`)."""
        mb = self.t.mem_b[s]
        limit = self.limits[r] + _EPS
        if self.held[r] + mb + self.rank_total_mem[r] <= limit:
            return True  # even the whole rank's need on top of everything held fits
        if self.pair[r] is not None:
            return self._safe_pair(r, s, mb, limit)
        inflight = self.inflight[r]
        if j in inflight:
            suffix = 0.0
        else:  # a new microbatch: the latest in flight
            suffix = mb
            if suffix + self.rank_total_mem[r] - mb > limit:
                return False
        left = self.partial[r]
        for k, (held, need, _) in reversed(inflight.items()):  # newest first: made in microbatch order
            if left == 0:
                return self.held[r] + mb <= limit  # the rest need nothing more: the total decides
            if need > 0:
                left -= 1
            if k == j:
                held, need = held + mb, need - mb
            suffix += held
            if suffix + need > limit:
                return False
        return True

    def _safe_pair(self, r: int, s: int, mb: float, limit: float) -> bool:
        """:meth:`safe_f`'s walk, in O(1), on a rank of two stages s0 < s1 (the V's, or one stage per rank's
        neighbours in a loop), where the microbatches still needing memory are those past F on s0 and not
        yet on s1: each holds M_B(s0) and needs the same, so the walk's running sum (the same additions in
        the same order, :meth:`_sum_of`) is largest, and the test hardest, at the oldest of them; the
        answer is the walk's to the last bit (``pair``: where the need left after s1 is not above 0)."""
        s0, mb0, need0 = self.pair[r]
        c, n = self.partial[r], len(self.inflight[r])
        if s == s0:  # a new microbatch, the newest: the walk starts at its M_B, then c of mb0
            if mb + self.rank_total_mem[r] - mb > limit:
                return False
            if c and self._sum_of(r, c + 1) + need0 > limit:
                return False
        elif c:  # s1: j is the oldest still needing memory, after c - 1 newer ones
            before = self._sum_of(r, c - 1)
            if c > 1 and before + need0 > limit:
                return False
            if before + (mb0 + mb) + (need0 - mb) > limit:
                return False
        return n == c or self.held[r] + mb <= limit  # older ones need nothing more: the total decides

    def _sum_of(self, r: int, count: int) -> float:
        """``count`` times the rank's mb0, added one at a time from 0.0 (as the walk adds), remembered."""
        sums = self.pair_sums[r]
        while len(sums) <= count:
            sums.append(sums[-1] + self.pair[r][1])
        return sums[count]

    # ------------------------------------------------------------------ decisions

    def run_f(self, r: int, s: int, j: int, arrival: float) -> None:
        """Commit F, first running pending W if the rank's memory needs them (paper 3.1)."""
        t = self.t
        while self.mem[r] + t.mem_b[s] > self.limits[r] + _EPS and self.pending_w[r]:
            ws, wj = self.pending_w[r].popleft()
            self.commit(r, "W", ws, wj, self.free[r])
        free = self.free[r]
        self.commit(r, "F", s, j, arrival if arrival > free else free)

    def run(self) -> Plan:
        self.now = 0.0
        for r in range(self.p):
            self.set_due(r, 0.0)
        heap, due, pop, decide = self.heap, self.due, heapq.heappop, self.decide
        while self.left:
            if not heap:
                if not all(map(math.isfinite, self.free)):
                    raise self.t.overflow()  # a time past the largest float never comes due
                raise AssertionError("greedy scheduler bug: no rank can move (memory safety prevents this)")
            time, r = pop(heap)
            if time != due[r]:
                continue
            self.now = time
            due[r] = _INF
            decide(r, time)
        spans = [max((self.free[r] - self.first[r]), 0.0) for r in range(self.p)]
        if not all(map(math.isfinite, spans)):
            raise self.t.overflow()
        make = Action.unchecked  # the rows' kinds, stages and microbatches are the run's own
        actions = tuple(tuple(make(*x) for x in row) for row in self.rows)
        return Plan(actions, max(spans), tuple(self.peak), self.rules)

    def decide(self, r: int, now: float) -> None:
        """Rank r is free at ``now``: run what has arrived, hold a filler, or wait for the next arrival."""
        t, free, soon = self.t, self.free, now + _EPS
        while True:
            if free[r] > soon:
                self.set_due(r, free[r])
                return
            cands = self.candidates(r)
            warm = self.warm[r]
            fit = warm and self.rules.fit_f
            best = None  # the first firm arrived candidate of smallest (priority, arrival), as min() picks
            for c in cands:
                if c[1] <= soon and not (fit and c[2] == "F" and self.fit_stage[c[3]]) and (
                        best is None or c[0] < best[0] or c[0] == best[0] and c[1] < best[1]):
                    best = c
            hold = self.hold[r]
            if best is not None:
                if hold is not None:
                    self.hold[r] = None
                    kind, s, j, start = hold
                    dur = t.f[s] if kind == "F" else t.w[s]
                    if soon >= start + dur or self.keep_filler(r, kind, now - start):
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
                    self.commit(r, "B", s, j, arr if arr > free[r] else free[r])
                continue
            if hold is None:
                hold = self.hold[r] = self.filler(r, [c for c in cands if c[1] <= soon], warm)
                if hold is None:
                    self.set_due(r, self.next_arrival(cands, now))
                    return
            kind, s, j, start = hold  # held on (the candidates are unchanged by holding it)
            dur = t.f[s] if kind == "F" else t.w[s]
            if soon >= start + dur:  # it fits: nothing came before it would end
                self.hold[r] = None
                if kind == "W":
                    self.pending_w[r].remove((s, j))
                    self.commit(r, "W", s, j, start)
                else:
                    self.run_f(r, s, j, start)
                continue
            self.set_due(r, min(start + dur, self.next_arrival(cands, now)))
            return

    def filler(self, r: int, ready: list, warm: bool) -> tuple[str, int, int, float] | None:
        """What rank r holds while nothing firm has arrived: in the warm-up the first ready F (``fit_f``),
        else its oldest pending W, started when the rank is free; None: nothing to hold."""
        fillers = [c for c in ready if c[2] == "F"] if warm else []
        if fillers:
            _, arr, _, s, j = min(fillers, key=_PRIORITY)
            return ("F", s, j, max(self.free[r], arr))
        if self.pending_w[r]:
            s, j = self.pending_w[r][0]
            return ("W", s, j, self.free[r])
        return None

    @staticmethod
    def next_arrival(cands, now: float) -> float:
        later = [c[1] for c in cands if c[1] > now + _EPS]
        return min(later) if later else _INF

    def keep_filler(self, r: int, kind: str, gap: float) -> bool:
        """A filler started at ``start`` would delay what just arrived after ``gap``: keep it?"""
        if kind == "F":
            return False  # fit_f: the warm-up F waits for what arrived
        grows = self.work[r] + self.bubble[r] + gap > self.most_projected + _EPS
        if self.rules.keep_gaps or not grows:
            self.fill_matters = True  # fill_partial's True differs from the answer without it
        return self.rules.fill_partial or (not self.rules.keep_gaps and grows)


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
    """Polish a plan by local search (not in the paper).

    Moves an action up to four places earlier on its rank (never past an action it needs or one of the
    same kind and stage) and keeps moves that shrink the simulated makespan within the memory limit, until
    a local optimum or ``budget`` simulations (default :func:`search_budget`).

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
    """Default simulations for a local search over ``rows``: :func:`budget_of` their actions."""
    return budget_of(sum(len(row) for row in rows))


def budget_of(actions: int) -> int:
    """Default simulations for a local search over ``actions`` actions in all: min(200, 20000 // actions)."""
    return min(200, 20000 // max(actions, 1))


def evaluator(rows: list, placement: Sequence[int], num_microbatches: int, table: CostTable,
        limits: Sequence[float]):
    """A function simulating ``rows`` as they are when called: (makespan, per-rank peak memory), or
    (inf, ()) for a deadlock or a memory-limit overrun."""
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
    """Fuse B and W back into one BW where the split does not pay (not in the paper, whose T_BW = T_B + T_W).

    Where ``Costs.bw`` < b + w, each B(s, j) in rank order becomes BW(s, j) (its W removed), kept if the
    simulated makespan does not grow within the memory limits. At most ``budget`` simulations (default
    :func:`search_budget`).

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
    """The reverse of :func:`fuse_backward`: split BW(s, j) into B in place and W later on its rank, last
    microbatches first, keeping splits that shorten the simulated makespan within the memory limits. At most
    ``budget`` simulations (default :func:`search_budget`). Not in the paper.

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
