"""Where the bubbles come from: every idle gap of a timeline, attributed to a cause (pure Python).

A rank idles because the next action in its list waits for an input (:func:`zbpp_lite.schedules.ir.deps`).
For each idle stretch this module asks what the rank was waiting for, and why that came late:

- ``warm-up``: before the rank's first action, or while it has not yet run a backward (the
  pipeline is filling: paper section 2, figure 2, the bubbles before the first B);
- ``cool-down``: the rank has no F left and waits for the backward of the last microbatches,
  or has finished while other ranks still work (the bubbles after the last F);
- ``imbalance``: in the steady state, waiting on a chain of dependencies whose origin is a stage
  slower than the mean by more than a margin (that stage is named);
- ``communication``: the input had been computed, but its transfer from another rank took the time;
- ``no W to fill``: in the steady state, waiting, with no W work pending on the rank that could
  fill the gap (1F1B-like order: W ran right after its B, there is no split W at all, or T_W = 0);
- ``W held back``: in the steady state, waiting while a W was pending: the schedule chose not to
  fill the gap (e.g. to keep memory, or because filling would delay the critical path);
- ``overhead``: the input was there and nothing was awaited (a measured run's dispatch latency).

"Origin" follows the chain of waits: the awaited action may itself have waited on another, and so
on; the chain ends at an action that ran as soon as its rank was free. That rank was the busy one,
so its stage is the stage blamed (``IdleGap.stage``). Causes are checked in the order listed, the
structural ones (warm-up, cool-down) first: a pipeline with equal stages has those too.

Source of the bubble picture: Qi et al., arXiv 2401.10241, sections 2-3 (F, B, W, warm-up and
cool-down bubbles, filling bubbles with W).

The gaps inside each rank's span are exactly :attr:`Timeline.idle_gaps` (so per rank they add up
to :attr:`Timeline.bubble_time`); ``edge`` gaps are the stretches before a rank's first action and
after its last one, up to the first start and last end over all ranks.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..schedules.costs import Costs
from .profiling.timelines import producers, profile
from ..schedules.ir import Action, Schedule, deps
from ..schedules.timeline import Event, Timeline

CAUSES = ("warm-up", "cool-down", "imbalance", "communication", "no W to fill", "W held back", "overhead")
"""Every cause an idle gap can be given, in the order they are checked (see the module docstring)."""


@dataclass(frozen=True)
class IdleGap:
    """One idle stretch of one rank, with its cause.

    Attributes:
        rank: the idle rank.
        start, end: the stretch (the timeline's unit).
        cause: one of :data:`CAUSES`.
        stage: the stage blamed: the origin of the chain of waits (``imbalance``, ``warm-up``,
            ``cool-down``, ``no W to fill``, ``W held back``), the sending stage
            (``communication``), the stage that ends the step last (a rank's final idle
            stretch); None for ``overhead``.
        before: the action the rank ran at the end of the stretch (None after its last action).
        edge: True for the stretches before a rank's first action and after its last one (outside
            the rank's span, so not part of its bubble rate).
    """

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
    """Every idle stretch of a timeline with its cause, and the totals.

    Attributes:
        gaps: the :class:`IdleGap` of every rank, by rank then time.
        num_ranks, num_stages: p and S.
        stage_time: per stage T_F + T_B + T_W used to find slow stages.
        slow_stages: stages whose ``stage_time`` exceeds the mean by more than the margin.
        comm: T_comm used to tell a transfer from dispatch overhead.
        bubble_time: per rank, the timeline's idle time inside the rank's span.
        makespan, global_span: of the timeline.
        source: "measured" or "simulated".
    """

    gaps: tuple[IdleGap, ...]
    num_ranks: int
    num_stages: int
    stage_time: tuple[float, ...]
    slow_stages: tuple[int, ...]
    comm: float
    bubble_time: tuple[float, ...]
    makespan: float
    global_span: float
    source: str

    def by_cause(self, edges: bool = True) -> dict[str, float]:
        """Total idle time per cause over all ranks (every cause present, 0 where none);
        ``edges=False`` counts only the stretches inside the ranks' spans."""
        total = {c: 0.0 for c in CAUSES}
        for g in self.gaps:
            if edges or not g.edge:
                total[g.cause] += g.duration
        return total

    def by_rank(self, edges: bool = True) -> list[dict[str, float]]:
        """Per rank, idle time per cause."""
        rows = [{c: 0.0 for c in CAUSES} for _ in range(self.num_ranks)]
        for g in self.gaps:
            if edges or not g.edge:
                rows[g.rank][g.cause] += g.duration
        return rows

    def by_stage(self, edges: bool = True) -> dict[int | None, dict[str, float]]:
        """Idle time per stage blamed (None: nothing blamed) and cause: which stage causes how
        much idle time."""
        rows: dict[int | None, dict[str, float]] = {}
        for g in self.gaps:
            if edges or not g.edge:
                row = rows.setdefault(g.stage, {c: 0.0 for c in CAUSES})
                row[g.cause] += g.duration
        return dict(sorted(rows.items(), key=lambda kv: (kv[0] is None, kv[0] if kv[0] is not None else 0)))

    def total(self, edges: bool = True) -> float:
        return sum(self.by_cause(edges).values())

    def table(self, scale: float | None = None, unit: str | None = None) -> str:
        """A text report: idle time per rank and per stage blamed, by cause, and the slow stages.

        Times are multiplied by ``scale`` and labelled ``unit`` (default: ms for measured
        timelines, the costs' unit for simulated ones)."""
        if scale is None:
            scale, unit = (1e3, "ms") if self.source == "measured" else (1.0, unit or "time units")
        unit = unit or ""
        used = [c for c in CAUSES if any(g.cause == c for g in self.gaps)] or ["warm-up"]
        width = max(9, *(len(c) for c in used))

        def row(label: str, values: dict[str, float]) -> str:
            cells = "".join(f"{scale * values[c]:>{width + 2}.3f}" for c in used)
            return f"{label:<18}{cells}{scale * sum(values.values()):>{width + 2}.3f}"

        header = f"{'':<18}" + "".join(f"{c:>{width + 2}}" for c in used) + f"{'total':>{width + 2}}"
        lines = [f"idle time by cause ({unit}); the {self.source} makespan is {scale * self.makespan:.3f} {unit}", header]
        for r, values in enumerate(self.by_rank()):
            lines.append(row(f"rank {r}", values))
        lines.append(row("all ranks", self.by_cause()))
        lines.append(row("  inside spans", self.by_cause(edges=False)))
        lines.append("by the stage it is blamed on:")
        for stage, values in self.by_stage().items():
            lines.append(row("  (none)" if stage is None else f"  stage {stage}", values))
        times = ", ".join(f"{scale * t:.3f}" for t in self.stage_time)
        slow = ", ".join(map(str, self.slow_stages)) or "none"
        lines.append(f"per-stage T_F+T_B+T_W ({unit}): [{times}]; slow stages: {slow}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """JSON-ready dict: totals by cause, rank and stage, the slow stages, and every gap."""
        return {
            "by_cause": self.by_cause(),
            "by_cause_inside_spans": self.by_cause(edges=False),
            "by_rank": self.by_rank(),
            "by_stage": {("none" if s is None else str(s)): v for s, v in self.by_stage().items()},
            "slow_stages": list(self.slow_stages),
            "stage_time": list(self.stage_time),
            "comm": self.comm,
            "gaps": [
                {"rank": g.rank, "start": g.start, "end": g.end, "cause": g.cause, "stage": g.stage,
                 "before": None if g.before is None else str(g.before), "edge": g.edge}
                for g in self.gaps
            ],
        }


def _check_matches(timeline: Timeline, schedule: Schedule) -> None:
    if timeline.num_ranks != schedule.num_ranks:
        raise ValueError(f"the timeline has {timeline.num_ranks} ranks but the schedule has {schedule.num_ranks}")
    for r in range(schedule.num_ranks):
        ran = Counter(e.action for e in timeline.rank_events(r))
        planned = Counter(schedule.rank_actions(r))
        if ran != planned:
            missing = sorted(planned - ran)
            extra = sorted(ran - planned)
            raise ValueError(
                f"the timeline does not match the schedule on rank {r}: "
                f"missing {[str(a) for a in missing[:6]]}, unexpected {[str(a) for a in extra[:6]]}; "
                "attribute a whole step's timeline with the schedule that produced it"
            )


def attribute(
    timeline: Timeline,
    schedule: Schedule,
    costs: Costs | None = None,
    margin: float = 0.1,
    tolerance: float = 1e-9,
) -> Attribution:
    """Attribute every idle stretch of ``timeline`` (a run of ``schedule``) to a cause.

    Args:
        timeline: a whole step, measured or simulated.
        schedule: the schedule that ran (its dependencies and per-rank order).
        costs: the costs to judge stages by (per-stage T_F + T_B + T_W, and T_comm). Default:
            profiled from the timeline itself (:func:`zbpp_lite.analysis.profiling.timelines.profile`).
        margin: a stage is slow when its T_F + T_B + T_W exceeds the mean over stages by more than
            this fraction (0.1: 10%).
        tolerance: times closer than this count as equal (the timeline's unit); the gaps
            themselves are the timeline's ``idle_gaps``.

    Returns:
        An :class:`Attribution`; see the module docstring for the causes.

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
        stage_time = tuple(table.f[s] + table.b[s] + table.w[s] for s in range(S))
        comm_of = list(table.comm)
    mean = sum(stage_time) / S
    slow = tuple(s for s in range(S) if stage_time[s] > (1 + margin) * mean + tolerance)

    made = producers(timeline)
    per_rank = [timeline.rank_events(r) for r in range(timeline.num_ranks)]
    index = {id(e): i for row in per_rank for i, e in enumerate(row)}

    def prev_end(e: Event) -> float:
        i = index[id(e)]
        return per_rank[e.rank][i - 1].end if i > 0 else -math.inf

    def binding(e: Event) -> Event | None:
        inputs = [made[k] for k in deps(e.action, S)]
        return max(inputs, key=lambda p: p.end) if inputs else None

    def origin(e: Event) -> Event:
        """Follow the waits back to an action that ran as soon as its rank was free."""
        for _ in range(len(timeline.events)):
            before = prev_end(e)
            if e.start - before <= tolerance:
                return e
            q = binding(e)
            if q is None or q.end <= before + tolerance:
                return e
            e = q
        return e

    T0 = min(e.start for e in timeline.events)
    T1 = max(e.end for e in timeline.events)
    last_event = max(timeline.events, key=lambda e: e.end)
    gaps: list[IdleGap] = []
    for r, row in enumerate(per_rank):
        if not row:
            continue
        kinds = [e.action.kind for e in row]
        first_backward = next((i for i, k in enumerate(kinds) if k in ("B", "BW")), len(row))
        last_forward = max((i for i, k in enumerate(kinds) if k == "F"), default=-1)
        w_time = {(e.action.stage, e.action.microbatch): e.duration for e in row if e.action.kind == "W"}
        pending_w = [0.0]  # the work of the W pending before event i (B done, W not yet)
        for e in row:
            key = (e.action.stage, e.action.microbatch)
            change = {"B": w_time.get(key, 0.0), "W": -w_time.get(key, 0.0)}.get(e.action.kind, 0.0)
            pending_w.append(pending_w[-1] + change)

        def phase(i: int, culprit: int) -> str:
            if i <= first_backward:
                return "warm-up"
            if i > last_forward:
                return "cool-down"
            if culprit in slow:
                return "imbalance"
            return "no W to fill" if pending_w[i] <= tolerance else "W held back"

        if row[0].start - T0 > tolerance:
            q = binding(row[0])
            stage = origin(q).action.stage if q is not None else None
            gaps.append(IdleGap(r, T0, row[0].start, "warm-up", stage, row[0].action, edge=True))
        starts: dict[float, int] = {}  # a gap ends exactly where an event starts (the first, if
        for i, e in enumerate(row):  # zero-length events start at the same time)
            starts.setdefault(e.start, i)
        for a, b in timeline.idle_gaps[r]:
            i = starts.get(b)
            if i is None:
                raise ValueError(f"rank {r}: no event starts at the end of the idle gap ({a}, {b}); the timeline is inconsistent")
            e = row[i]
            q = binding(e)
            if q is not None and q.end > a + tolerance:  # waited on the producer, then its transfer
                cut = min(q.end, b)
                culprit = origin(q).action.stage
                gaps.append(IdleGap(r, a, cut, phase(i, culprit), culprit, e.action))
                if b - cut > tolerance:
                    cause = "communication" if q.rank != r else "overhead"
                    gaps.append(IdleGap(r, cut, b, cause, q.action.stage if q.rank != r else None, e.action))
            elif q is not None and q.rank != r and a - q.end < comm_of[q.action.stage] - tolerance:
                gaps.append(IdleGap(r, a, b, "communication", q.action.stage, e.action))  # still in flight
            else:
                gaps.append(IdleGap(r, a, b, "overhead", None, e.action))
        if T1 - row[-1].end > tolerance:
            gaps.append(IdleGap(r, row[-1].end, T1, "cool-down", last_event.action.stage, None, edge=True))
    return Attribution(
        gaps=tuple(gaps),
        num_ranks=timeline.num_ranks,
        num_stages=S,
        stage_time=tuple(stage_time),
        slow_stages=slow,
        comm=max(comm_of, default=0.0),
        bubble_time=timeline.bubble_time,
        makespan=timeline.makespan,
        global_span=timeline.global_span,
        source=timeline.source,
    )
