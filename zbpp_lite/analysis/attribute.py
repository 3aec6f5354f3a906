"""Where the bubbles come from: every idle gap of a timeline, attributed to a cause (pure Python).

A rank idles while its next action waits for an input (:func:`zbpp_lite.schedules.ir.deps`). Causes,
checked in this order (Qi et al., arXiv 2401.10241, sections 2-3):

- ``warm-up``: in the rank's warm-up phase, before its first action or its first backward (the pipeline
  filling); the cause is the phase, named as the schedules name it;
- ``cool-down``: in its cool-down phase, no F left, waiting for the last backwards, or done while others
  work;
- ``imbalance``: steady state, waiting on a chain whose origin (followed back to an action that ran as
  soon as its rank was free) is a stage slower than the mean by more than a margin;
- ``communication``: the input was computed, its transfer took the time;
- ``no W to fill``: steady state, no W pending on the rank (1F1B-like order, no split W, T_W = 0);
- ``W held back``: steady state, a W pending that the schedule chose not to run;
- ``overhead``: the input was there (a measured run's dispatch latency).

Gaps inside each rank's span are :attr:`Timeline.idle_gaps` (summing to :attr:`Timeline.idle_time`);
``edge`` gaps lie before a rank's first and after its last action, up to the step's first start and
last end.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..schedules.costs import Costs
from ..schedules.ir import Action, Schedule, deps
from ..schedules.timeline import Event, Timeline
from .profiling.timelines import producers, profile

CAUSES = ("warm-up", "cool-down", "imbalance", "communication", "no W to fill", "W held back", "overhead")
"""Every cause an idle gap can be given, in the order they are checked (see the module docstring)."""


@dataclass(frozen=True)
class IdleGap:
    """One idle stretch ``start`` .. ``end`` of ``rank`` with its ``cause`` (one of :data:`CAUSES`).
    ``stage``: the stage blamed (the chain's origin, the sender, or the stage ending the step last; None
    for ``overhead``); ``before``: the action ending the stretch (or None); ``edge``: outside the span."""

    rank: int
    start: float
    end: float
    cause: str
    stage: int | None
    before: Action | None
    edge: bool = False

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Attribution:
    """Every idle stretch of a timeline with its cause (``gaps`` by rank then time), and the totals.
    ``stage_time``: the T_F + T_B + T_W that found ``slow_stages``; ``comm``: T_comm telling a transfer
    from overhead; ``idle_time``: per rank, inside its span; ``source``: "measured" or "simulated";
    ``edges=False`` below counts only stretches inside the spans."""

    gaps: tuple[IdleGap, ...]
    num_ranks: int
    num_stages: int
    stage_time: tuple[float, ...]
    slow_stages: tuple[int, ...]
    comm: float
    idle_time: tuple[float, ...]
    makespan: float
    global_span: float
    source: str

    def _sum(self, key, edges: bool) -> dict:
        rows: dict = {}
        for g in self.gaps:
            if edges or not g.edge:
                rows.setdefault(key(g), dict.fromkeys(CAUSES, 0.0))[g.cause] += g.duration
        return rows

    def by_cause(self, edges: bool = True) -> dict[str, float]:
        """Total idle time per cause over all ranks (every cause present, 0 where none)."""
        return self._sum(lambda g: 0, edges).get(0, dict.fromkeys(CAUSES, 0.0))

    def by_rank(self, edges: bool = True) -> list[dict[str, float]]:
        """Per rank, idle time per cause."""
        rows = self._sum(lambda g: g.rank, edges)
        return [rows.get(r, dict.fromkeys(CAUSES, 0.0)) for r in range(self.num_ranks)]

    def by_stage(self, edges: bool = True) -> dict[int | None, dict[str, float]]:
        """Idle time per stage blamed (None: nothing blamed) and cause."""
        rows = self._sum(lambda g: g.stage, edges)
        return dict(sorted(rows.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))

    def total(self, edges: bool = True) -> float:
        return sum(self.by_cause(edges).values())

    def table(self, scale: float | None = None, unit: str | None = None) -> str:
        """A text report: idle time per rank and per stage blamed, by cause, and the slow stages (times
        * ``scale``, labelled ``unit``; default ms when measured)."""
        if scale is None:
            scale, unit = (1e3, "ms") if self.source == "measured" else (1.0, unit or "time units")
        unit = unit or ""
        used = [c for c in CAUSES if any(g.cause == c for g in self.gaps)] or ["warm-up"]
        width = max(9, *(len(c) for c in used)) + 2

        def row(label: str, values: dict[str, float]) -> str:
            cells = "".join(f"{scale * values[c]:>{width}.3f}" for c in used)
            return f"{label:<18}{cells}{scale * sum(values.values()):>{width}.3f}"

        lines = [f"idle time by cause ({unit}); the {self.source} makespan is {scale * self.makespan:.3f} "
                 f"{unit}",
                 f"{'':<18}" + "".join(f"{c:>{width}}" for c in used) + f"{'total':>{width}}",
                 *(row(f"rank {r}", values) for r, values in enumerate(self.by_rank())),
                 row("all ranks", self.by_cause()), row("  inside spans", self.by_cause(edges=False)),
                 "by the stage it is blamed on:",
                 *(row("  (none)" if s is None else f"  stage {s}", v) for s, v in self.by_stage().items())]
        times = ", ".join(f"{scale * t:.3f}" for t in self.stage_time)
        slow = ", ".join(map(str, self.slow_stages)) or "none"
        lines.append(f"per-stage T_F+T_B+T_W ({unit}): [{times}]; slow stages: {slow}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """JSON-ready dict: totals by cause, rank and stage, the slow stages, and every gap."""
        return {
            "by_cause": self.by_cause(), "by_cause_inside_spans": self.by_cause(edges=False),
            "by_rank": self.by_rank(),
            "by_stage": {("none" if s is None else str(s)): v for s, v in self.by_stage().items()},
            "slow_stages": list(self.slow_stages), "stage_time": list(self.stage_time), "comm": self.comm,
            "gaps": [{"rank": g.rank, "start": g.start, "end": g.end, "cause": g.cause, "stage": g.stage,
                      "before": None if g.before is None else str(g.before), "edge": g.edge}
                     for g in self.gaps],
        }


def _check_matches(timeline: Timeline, schedule: Schedule) -> None:
    if timeline.num_ranks != schedule.num_ranks:
        raise ValueError(f"the timeline has {timeline.num_ranks} ranks but the schedule has "
                         f"{schedule.num_ranks}")
    for r in range(schedule.num_ranks):
        ran, planned = Counter(e.action for e in timeline.rank_events(r)), Counter(schedule.rank_actions(r))
        if ran != planned:
            missing, extra = ([a.text for a in sorted(x)[:6]] for x in (planned - ran, ran - planned))
            raise ValueError(f"the timeline does not match the schedule on rank {r}: missing {missing}, "
                             f"unexpected {extra}; attribute a whole step's timeline with the schedule that "
                             "produced it")


class _Waits:
    """Who waited on whom in ``timeline``: each event's binding input and the origin of its chain."""

    def __init__(self, timeline: Timeline, num_stages: int, tolerance: float):
        self.made, self.S, self.tol = producers(timeline), num_stages, tolerance
        self.limit = len(timeline.events)
        self.rows = [timeline.rank_events(r) for r in range(timeline.num_ranks)]
        self.index = {id(e): i for row in self.rows for i, e in enumerate(row)}

    def prev_end(self, e: Event) -> float:
        i = self.index[id(e)]
        return self.rows[e.rank][i - 1].end if i > 0 else -math.inf

    def binding(self, e: Event) -> Event | None:
        """The input of ``e`` produced last (None: ``e`` needs none)."""
        inputs = [self.made[k] for k in deps(e.action, self.S)]
        return max(inputs, key=lambda p: p.end) if inputs else None

    def origin(self, e: Event) -> Event:
        """Follow the waits back to an action that ran as soon as its rank was free."""
        for _ in range(self.limit):
            before = self.prev_end(e)
            q = self.binding(e) if e.start - before > self.tol else None
            if q is None or q.end <= before + self.tol:
                return e
            e = q
        return e


def _rank_gaps(r: int, timeline: Timeline, waits: _Waits, slow: tuple[int, ...],
               comm_of: list[float]) -> list[IdleGap]:
    """The attributed idle stretches of rank ``r``, edges included."""
    row, tol = waits.rows[r], waits.tol
    kinds = [e.action.kind for e in row]
    first_backward = next((i for i, k in enumerate(kinds) if k in ("B", "BW")), len(row))
    last_forward = max((i for i, k in enumerate(kinds) if k == "F"), default=-1)
    w_time = {(e.action.stage, e.action.microbatch): e.duration for e in row if e.action.kind == "W"}
    pending_w = [0.0]  # the work of the W pending before event i (B done, W not yet)
    for e in row:
        t = w_time.get((e.action.stage, e.action.microbatch), 0.0)
        pending_w.append(pending_w[-1] + {"B": t, "W": -t}.get(e.action.kind, 0.0))

    def phase(i: int, culprit: int) -> str:
        if i <= first_backward:
            return "warm-up"
        if i > last_forward:
            return "cool-down"
        if culprit in slow:
            return "imbalance"
        return "no W to fill" if pending_w[i] <= tol else "W held back"

    T0, gaps = min(e.start for e in timeline.events), []
    if row[0].start - T0 > tol:
        q = waits.binding(row[0])
        stage = waits.origin(q).action.stage if q is not None else None
        gaps.append(IdleGap(r, T0, row[0].start, "warm-up", stage, row[0].action, edge=True))
    starts: dict[float, int] = {}  # a gap ends where an event starts (the first of zero-length ones)
    for i, e in enumerate(row):
        starts.setdefault(e.start, i)
    for a, b in timeline.idle_gaps[r]:
        i = starts.get(b)
        if i is None:
            raise ValueError(f"rank {r}: no event starts at the end of the idle gap ({a}, {b}); the timeline "
                             "is inconsistent")
        e, q = row[i], waits.binding(row[i])
        if q is not None and q.end > a + tol:  # waited on the producer, then its transfer
            cut, culprit = min(q.end, b), waits.origin(q).action.stage
            gaps.append(IdleGap(r, a, cut, phase(i, culprit), culprit, e.action))
            if b - cut > tol:
                far = q.rank != r
                cause, stage = ("communication", q.action.stage) if far else ("overhead", None)
                gaps.append(IdleGap(r, cut, b, cause, stage, e.action))
        elif q is not None and q.rank != r and a - q.end < comm_of[q.action.stage] - tol:
            gaps.append(IdleGap(r, a, b, "communication", q.action.stage, e.action))  # still in flight
        else:
            gaps.append(IdleGap(r, a, b, "overhead", None, e.action))
    last = max(timeline.events, key=lambda e: e.end)
    if last.end - row[-1].end > tol:
        gaps.append(IdleGap(r, row[-1].end, last.end, "cool-down", last.action.stage, None, edge=True))
    return gaps


def attribute(timeline: Timeline, schedule: Schedule, costs: Costs | None = None, margin: float = 0.1,
              tolerance: float = 1e-9) -> Attribution:
    """Attribute every idle stretch of ``timeline`` (one step of ``schedule``) to a cause (module docstring).
    ``costs``: default profiled from the timeline; a stage is slow above the mean T_F + T_B + T_W by
    ``margin`` (0.1: 10%); times closer than ``tolerance`` count as equal.

    Raises:
        ValueError: a timeline that does not hold exactly the schedule's actions on each rank, or
            whose events lack what a stage needs to be profiled; a negative margin.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if not timeline.events:
        raise ValueError("the timeline has no events; attribute a whole step's timeline")
    _check_matches(timeline, schedule)
    S = schedule.num_stages
    if costs is None:
        prof = profile(timeline, S)
        stage_time, comm_of = prof.stage_time, [prof.comm] * S
    else:
        table = costs.table(S)
        stage_time, comm_of = tuple(table.f[s] + table.b[s] + table.w[s] for s in range(S)), list(table.comm)
    mean = sum(stage_time) / S
    slow = tuple(s for s in range(S) if stage_time[s] > (1 + margin) * mean + tolerance)
    waits = _Waits(timeline, S, tolerance)
    gaps = [g for r in range(timeline.num_ranks) if waits.rows[r]
            for g in _rank_gaps(r, timeline, waits, slow, comm_of)]
    return Attribution(tuple(gaps), timeline.num_ranks, S, tuple(stage_time), slow, max(comm_of, default=0.0),
                       timeline.idle_time, timeline.makespan, timeline.global_span, timeline.source)
