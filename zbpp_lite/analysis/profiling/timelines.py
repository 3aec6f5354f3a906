"""Per-stage action costs profiled from one or several timelines, measured or simulated (pure Python).

T_F, T_B, T_W per stage (mean and spread) and T_comm (Qi et al., arXiv 2401.10241, section 2.1, table
1). Transfers are no events (sends are asynchronous), so T_comm is read off the slack: where a rank
idled until another rank's output arrived, producer end to consumer start (plus dispatch latency when
measured; exactly T_comm when simulated). Feeds :mod:`zbpp_lite.analysis.replan` and
:mod:`zbpp_lite.analysis.attribute`; :func:`measured_costs` gives planner
:class:`~zbpp_lite.schedules.costs.Costs` with T_BW. Does not import JAX.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence, TypeVar

from ...schedules.costs import Costs
from ...schedules.ir import Key, deps, produces
from ...schedules.timeline import Event, Timeline


T = TypeVar("T")

COMPILE_STEPS = 1
"""Steps of a run that compile and are never timed: the first (XLA compiles on first call)."""


def timed_steps(steps: Sequence[T], skip: int = COMPILE_STEPS) -> list[T]:
    """The one rule for timed steps: those after the first ``skip`` (which compile), or all when no
    other is left. ``steps``: any per-step sequence."""
    steps = list(steps)
    return steps[skip:] or steps


def timed_median(values: Sequence[float], skip: int = COMPILE_STEPS) -> float:
    """Median of the timed steps' ``values`` (:func:`timed_steps`)."""
    return statistics.median(timed_steps(values, skip))


@dataclass(frozen=True)
class Transfer:
    """One observed wait of ``consumer`` on ``producer``'s output (on another rank); ``slack``:
    consumer start - producer end, in the timeline's unit (seconds when measured)."""

    producer: Event
    consumer: Event
    slack: float


@dataclass(frozen=True)
class CostProfile:
    """Per-stage action costs of ``num_timelines`` pooled timelines, with their spread.

    ``f``, ``b``, ``w``: mean T_F, T_B, T_W per stage (seconds when measured; a ``fused`` stage: ``b``
    the BW time, ``w`` 0); ``*_std``: standard deviations; ``counts``: (F, B or BW, W) events per stage;
    ``comm``: mean slack of :func:`transfers` over ``comm_count`` waits (0 when none).
    """

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    f_std: tuple[float, ...]
    b_std: tuple[float, ...]
    w_std: tuple[float, ...]
    counts: tuple[tuple[int, int, int], ...]
    fused: tuple[bool, ...]
    comm: float
    comm_std: float
    comm_count: int
    num_timelines: int

    @property
    def num_stages(self) -> int:
        return len(self.f)

    @property
    def stage_time(self) -> tuple[float, ...]:
        """Per stage T_F + T_B + T_W: one microbatch's work on that stage."""
        return tuple(f + b + w for f, b, w in zip(self.f, self.b, self.w))

    def costs(self, comm: bool = True) -> Costs:
        """The means as :class:`~zbpp_lite.schedules.costs.Costs` (default memory fields; ``comm=False``:
        T_comm 0)."""
        return Costs(f=self.f, b=self.b, w=self.w, comm=self.comm if comm else 0.0)

    def table(self, unit: str = "ms", scale: float = 1e3) -> str:
        """A text table: mean +- std per stage and T_comm (times * ``scale``, labelled ``unit``)."""
        head = f"{'stage':>5}  {'T_F':>17}  {'T_B':>17}  {'T_W':>17}  {'F+B+W':>9}"
        lines = [f"costs in {unit} (mean +- std over {self.num_timelines} timeline(s))", head]
        for s in range(self.num_stages):
            pairs = ((self.f[s], self.f_std[s]), (self.b[s], self.b_std[s]), (self.w[s], self.w_std[s]))
            cells = [f"{scale * m:8.3f} +- {scale * d:5.3f}" for m, d in pairs]
            note = "  (fused BW: T_B holds B+W)" if self.fused[s] else ""
            lines.append(f"{s:>5}  {'  '.join(cells)}  {scale * self.stage_time[s]:9.3f}{note}")
        lines.append(f"T_comm {scale * self.comm:.3f} +- {scale * self.comm_std:.3f} {unit} "
                     f"(from {self.comm_count} wait(s) on another rank's output)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """JSON-ready dict of every field but ``counts`` (lists for tuples)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items() if k != "counts"}


def _durations(timelines: Sequence[Timeline]) -> dict[tuple[str, int], list[float]]:
    """(kind, stage) -> the durations of every such event of ``timelines``, pooled."""
    durations: dict[tuple[str, int], list[float]] = {}
    for t in timelines:
        for e in t.events:
            durations.setdefault((e.action.kind, e.action.stage), []).append(e.duration)
    return durations


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values)


def producers(timeline: Timeline) -> dict[Key, Event]:
    """Key -> the event that produced it (an F produces ("F", s, j); B and BW produce ("B", s, j))."""
    made: dict[Key, Event] = {}
    for e in timeline.events:
        for key in produces(e.action):
            made[key] = e
    return made


def critical_path(timeline: Timeline, comm: float = 0.0) -> list[Event]:
    """The chain of events that sets the end of ``timeline``, first to last: from the event that ends
    last, step back to what it waited for, again and again, until an event waited for nothing.

    What an event waited for: of its rank's previous event and the events producing its inputs
    (:func:`~zbpp_lite.schedules.ir.deps`), the one with the least slack (its start minus that event's
    end, minus ``comm`` for another rank's output: the transfer time T_comm in the timeline's unit); a
    tie goes to another rank's output, so the chain follows the data. In a 1F1B or zero-bubble timeline
    the chain runs down the ranks through F's and back up through B's (or BW's): a W is on it only where
    a rank had nothing else to do (arXiv 2401.10241 section 2: B is on the critical path, W is not).
    Empty for an empty timeline. Raises ValueError: an event that waits, through others, on itself (an
    action twice on a rank, or a cycle).
    """
    if not timeline.events:
        return []
    S = 1 + max(e.action.stage for e in timeline.events)
    made = producers(timeline)
    before = {}
    for r in range(timeline.num_ranks):
        row = timeline.rank_events(r)
        before.update(zip(row[1:], row[:-1]))
    e = max(timeline.events, key=lambda x: (x.end, -x.rank))
    chain, seen = [e], {id(e)}
    while True:
        waited = [(e.start - p.end - comm, 0, p) for p in (made.get(k) for k in deps(e.action, S))
                  if p is not None and p.rank != e.rank]
        if e in before:
            waited.append((e.start - before[e].end, 1, before[e]))
        if not waited:
            return chain[::-1]
        e = min(waited, key=lambda x: (x[0], x[1]))[2]
        if id(e) in seen:  # a rank's event twice, or events waiting on each other: no chain ends
            raise ValueError(f"critical_path: the chain of waits comes back to {e.action} on rank {e.rank} "
                             f"({e.start} to {e.end}); a timeline holds each action once, in an order "
                             "its dependencies allow")
        seen.add(id(e))
        chain.append(e)


def transfers(timeline: Timeline, num_stages: int | None = None, tolerance: float = 1e-9) -> list[Transfer]:
    """Every wait on another rank's output: an event whose rank idled when its last-produced input's
    producer ended and that started more than ``tolerance`` later. ``num_stages``: default the largest
    seen + 1.

    Raises:
        ValueError: an event whose input has no producing event in the timeline.
    """
    S = num_stages if num_stages is not None else 1 + max((e.action.stage for e in timeline.events),
                                                          default=0)
    made = producers(timeline)
    found = []
    for r in range(timeline.num_ranks):
        prev_end = -math.inf
        for e in timeline.rank_events(r):
            needed = []
            for key in deps(e.action, S):
                if key not in made:
                    raise ValueError(f"the timeline has no event producing {key[0]} of stage {key[1]}, "
                                     f"microbatch {key[2]}, which {e.action.text} on rank {r} needs; give "
                                     "the whole step's timeline")
                needed.append(made[key])
            if needed:
                last = max(needed, key=lambda p: p.end)
                if last.rank != r and last.end >= prev_end - tolerance and e.start > last.end + tolerance:
                    found.append(Transfer(last, e, e.start - last.end))
            prev_end = e.end
    return found


def profile(timelines: Timeline | Sequence[Timeline], num_stages: int | None = None) -> CostProfile:
    """A :class:`CostProfile` of the pooled durations of one or several timelines (one pipeline's).
    ``num_stages``: default the largest seen + 1.

    Raises:
        ValueError: no timeline or event, a stage without F, without B or BW, or with B but no W (the
            message names the stage and the kind).
    """
    timelines = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    if not timelines or not any(t.events for t in timelines):
        raise ValueError("profile needs at least one timeline with events")
    S = num_stages if num_stages is not None else 1 + max(e.action.stage for t in timelines for e in t.events)
    for t in timelines:
        for e in t.events:
            if e.action.stage >= S:
                raise ValueError(f"event {e.action.text} names stage {e.action.stage}, but num_stages is {S}")
    durations = _durations(timelines)
    slacks = [x.slack for t in timelines for x in transfers(t, S)]
    stats: dict[str, list[tuple[float, float]]] = {"f": [], "b": [], "w": []}
    counts, fused = [], []
    for s in range(S):
        f, b, w, bw = (durations.get((k, s), []) for k in ("F", "B", "W", "BW"))
        if not f:
            raise ValueError(f"the timeline has no F event of stage {s}; every stage needs F and B (or BW) "
                             "events to profile its costs")
        if not b and not bw:
            raise ValueError(f"the timeline has no B or BW event of stage {s}; every stage needs a backward "
                             "to profile its costs")
        if b and not w:
            raise ValueError(f"the timeline has B but no W events of stage {s}; "
                             "give the whole step's timeline")
        stats["f"].append(_mean_std(f))
        stats["b"].append(_mean_std(b or bw))  # fused backward only: T_B holds B + W
        stats["w"].append(_mean_std(w) if b else (0.0, 0.0))
        counts.append((len(f), len(b) or len(bw), len(w)))
        fused.append(not b)
    comm, comm_std = _mean_std(slacks) if slacks else (0.0, 0.0)
    return CostProfile(
        **{k: tuple(m for m, _ in stats[k]) for k in "fbw"},
        **{f"{k}_std": tuple(d for _, d in stats[k]) for k in "fbw"},
        counts=tuple(counts), fused=tuple(fused), comm=comm, comm_std=comm_std, comm_count=len(slacks),
        num_timelines=len(timelines),
    )


def measured_costs(timeline: "Timeline | Sequence[Timeline]", num_stages: int) -> Costs:
    """Mean measured action times per stage as :class:`~zbpp_lite.schedules.costs.Costs` (seconds).

    ``timeline``: one or several, pooled (e.g. a zero-bubble and a 1F1B run). Only BW: T_B = T_BW,
    T_W = 0; no BW: T_BW = T_B + T_W. T_comm: mean wait of :func:`transfers` (0 when none).

    Raises:
        ValueError: no timeline, ``num_stages`` < 1, stages other than 0..num_stages-1, a stage with no F,
            or none of B / BW.
    """
    timelines = [timeline] if isinstance(timeline, Timeline) else list(timeline)
    if not timelines or not all(isinstance(t, Timeline) for t in timelines):
        raise ValueError("measured_costs needs a measured Timeline or a non-empty list of them")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    for i, t in enumerate(timelines):
        stages = 1 + max((e.action.stage for e in t.events), default=-1)
        if stages != num_stages:
            raise ValueError(f"timeline {i} has stages 0..{stages - 1}, not the {num_stages} stages asked "
                             "for; pool only timelines of one cut of the model")
    durations = _durations(timelines)

    f, b, w, bw = [], [], [], []
    for s in range(num_stages):
        tf, tb, tw, tbw = (_mean_std(durations[k, s])[0] if (k, s) in durations else None
                           for k in ("F", "B", "W", "BW"))
        if tf is None or (tb is None and tbw is None):
            raise ValueError(f"the timeline has no F or no backward of stage {s}; cannot derive its costs")
        f.append(tf)
        b.append(tbw if tb is None else tb)
        w.append(0.0 if tb is None or tw is None else tw)
        bw.append(tbw if tbw is not None else b[-1] + w[-1])
    slacks = []
    for t in timelines:
        try:
            slacks += [x.slack for x in transfers(t, num_stages)]
        except ValueError:  # a producer not in this timeline (e.g. one process's ranks only): no wait to read
            pass
    return Costs(f=f, b=b, w=w, bw=bw, comm=_mean_std(slacks)[0] if slacks else 0.0)
