"""Timeline: what happened (or would happen) on every rank, simulated or measured alike (pure Python).

Definitions (arXiv 2401.10241 section 3, DESIGN.md): a rank's span runs from its first F's start to its last
action's end; the makespan is the longest span; bubble rate = (makespan - busy) / makespan, busy being the
busiest rank's compute time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, groupby
from operator import attrgetter
from typing import NamedTuple, Sequence

from .costs import Costs, CostTable
from .ir import Action, Schedule, deps, produces
from .memory import MeasuredMemory


class Event(NamedTuple):
    """``rank`` ran ``action`` from ``start`` to ``end`` (unit of the costs; seconds when measured); in a
    simulated program's timeline also an optimizer instruction
    (:class:`~zbpp_lite.schedules.program.Optimize`: stage -1, no memory). A named tuple: planning at
    p = 256, m = 512 makes 786,432 of them, each in 0.4 of a frozen dataclass's time."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Per-rank events and the figures derived from them.

    Attributes:
        events: every :class:`Event`, sorted by (rank, start).
        num_ranks: p.
        makespan: longest per-rank span.
        bubble_rate: (makespan - busy) / makespan.
        busy: per-rank total compute time.
        peak_memory: per-rank peak activation memory (units of mem_b / mem_w).
        idle_gaps: per rank, the (start, end) intervals inside its span where it ran nothing.
        memory_limit: the per-rank limit planned for, if any (for figures).
        source: "simulated" or "measured".
        measured_memory: measured bytes per rank (:class:`~zbpp_lite.schedules.memory.MeasuredMemory`), or
            None.
        memory_costs: the per-stage M_B, M_W ``peak_memory`` used (:meth:`memory_curve`'s default); not
            compared.
    """

    events: tuple[Event, ...]
    num_ranks: int
    makespan: float
    bubble_rate: float
    busy: tuple[float, ...]
    peak_memory: tuple[float, ...]
    idle_gaps: tuple[tuple[tuple[float, float], ...], ...]
    memory_limit: float | None = None
    source: str = "simulated"
    measured_memory: MeasuredMemory | None = None
    memory_costs: CostTable | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_events(
        cls,
        events: Sequence[Event],
        num_ranks: int,
        costs: Costs | CostTable | None = None,
        num_stages: int | None = None,
        memory_limit: float | None = None,
        source: str = "simulated",
        gap_tolerance: float = 1e-9,
    ) -> "Timeline":
        """Derive makespan, bubble rate, peak memory and idle gaps from raw events.

        Memory follows each rank's own action order (model of :mod:`.costs`; default ``Costs()``: M_B = 1,
        M_W = 7/16). Gaps shorter than ``gap_tolerance`` are ignored (float noise).
        """
        events = list(events)  # any iterable, read more than once below
        ranks = list(map(attrgetter("rank"), events))
        if ranks and not 0 <= min(ranks) <= max(ranks) < num_ranks:
            raise ValueError(f"Timeline.from_events: event ranks run from {min(ranks)} to {max(ranks)}; with "
                             f"num_ranks = {num_ranks} they must be 0 to {num_ranks - 1}")
        per_rank: list[list[Event]] = [[] for _ in range(num_ranks)]
        for e in events:
            per_rank[e.rank].append(e)
        in_time = attrgetter("start", "end")
        for row in per_rank:
            row.sort(key=in_time)  # stable; a simulated rank's events come in time order already
        events = tuple(chain.from_iterable(per_rank))
        if num_stages is None:
            num_stages = 1 + max((e.action.stage for e in events), default=0)
        table = costs.table(num_stages) if isinstance(costs, Costs) else costs
        if table is None:
            table = Costs().table(num_stages)
        spans, busy, peaks, gaps = [], [], [], []
        for row in per_rank:
            busy.append(sum([e.end - e.start for e in row]))  # e.duration, without a call per event
            first = next((e.start for e in row if e.action.kind == "F"), row[0].start if row else 0.0)
            spans.append(max(map(attrgetter("end"), row)) - first if row else 0.0)
            peaks.append(table.peak_memory([e.action for e in row]))
            gaps.append(tuple((prev.end, e.start) for prev, e in zip(row, row[1:])
                              if e.start - prev.end > gap_tolerance))
        makespan = max(spans, default=0.0)
        work = max(busy, default=0.0)
        rate = (makespan - work) / makespan if makespan > 0 else 0.0
        timeline = cls(
            events, num_ranks, makespan, max(rate, 0.0), tuple(busy), tuple(peaks), tuple(gaps),
            memory_limit, source,
            memory_costs=table,
        )
        timeline.__dict__["_by_rank"] = tuple(map(tuple, per_rank))  # rank_events' rows, found here already
        return timeline

    @property
    def global_span(self) -> float:
        """First start to last end over all ranks: the step time with a synchronous optimizer step (paper
        section 4); above the makespan when ranks start and end apart (ZB-H2), which post-validation recovers.
        """
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    @property
    def sync_bubble(self) -> float:
        """Idle time a synchronous optimizer step adds per step: global_span - makespan."""
        return self.global_span - self.makespan

    def rank_events(self, rank: int) -> tuple[Event, ...]:
        """Events of one rank in time order."""
        if 0 <= rank < len(self._by_rank):
            return self._by_rank[rank]
        return tuple(e for e in self.events if e.rank == rank)

    @cached_property
    def _by_rank(self) -> tuple[tuple[Event, ...], ...]:
        """``events`` split by rank once (order kept): asking for every rank is linear, not p times; a run
        of one rank's events (all of them, sorted by rank) is added at once."""
        rows: list[list[Event]] = [[] for _ in range(self.num_ranks)]
        for rank, run in groupby(self.events, attrgetter("rank")):
            if 0 <= rank < self.num_ranks:
                rows[rank].extend(run)
        return tuple(map(tuple, rows))

    @cached_property
    def action_rows(self) -> tuple[tuple[Event, ...], ...]:
        """Each rank's events in time order, actions only: a lowered program's optimizer instructions
        (``Optimize``, instants that take no time) left out."""
        return tuple(tuple(e for e in row if type(e.action) is Action) for row in self._by_rank)

    @property
    def several_stages(self) -> bool:
        """Does a rank hold actions of more than one stage (an interleaved or V placement)? Optimizer
        instants do not count (:attr:`action_rows`)."""
        return any(len({e.action.stage for e in row}) > 1 for row in self.action_rows)

    @property
    def idle_time(self) -> tuple[float, ...]:
        """Per rank: its idle time, the gaps inside its own span (:attr:`idle_gaps`) summed, in the events'
        time unit. Not the bubble (makespan minus the busiest rank's busy time,
        :func:`~zbpp_lite.schedules.formulas.bubble_time`'s closed form): it differs from rank to rank."""
        return tuple(sum(b - a for a, b in g) for g in self.idle_gaps)

    def memory_changes(
        self, rank: int, costs: Costs | CostTable | None = None
    ) -> list[tuple[float, float, int]]:
        """(time, change of activation memory, stage) for one rank in time order (frees first on a tie):
        rising at an F's start, falling at a backward's end; ``costs`` defaults to ``memory_costs`` (else
        ``Costs()``)."""
        stages = 1 + max((e.action.stage for e in self.events), default=0)
        costs = costs or self.memory_costs or Costs()
        table = costs.table(stages) if isinstance(costs, Costs) else costs
        changes = []
        for e in self.rank_events(rank):
            if e.action.stage < 0:  # an optimizer instruction: no activation memory
                continue
            delta = table.memory_delta(e.action.kind, e.action.stage)
            changes.append((e.start if delta > 0 else e.end, delta, e.action.stage))
        changes.sort(key=lambda c: (c[0], c[1]))
        return changes

    def memory_curve(self, rank: int, costs: Costs | CostTable | None = None) -> list[tuple[float, float]]:
        """(time, activation memory) steps for one rank (:meth:`memory_changes` summed)."""
        mem, curve = 0.0, [(0.0, 0.0)]
        for t, d, _ in self.memory_changes(rank, costs):
            mem += d
            curve.append((t, mem))
        return curve

    @property
    def peak_memory_bytes(self) -> tuple[int, ...] | None:
        """Per rank, ``measured_memory.peak_bytes``, or None without a measurement."""
        return None if self.measured_memory is None else self.measured_memory.peak_bytes

    @property
    def planned_peak_bytes(self) -> tuple[float, ...] | None:
        """Per rank, the plan's peak in bytes: the plan's memory model over this timeline's action
        order with the measured per-stage M_B, M_W (:meth:`MeasuredMemory.costs`); None without a
        measurement."""
        if self.measured_memory is None:
            return None
        table = self.measured_memory.costs().table(len(self.measured_memory.mem_b))
        return Timeline.from_events(self.events, self.num_ranks, table, len(table.f)).peak_memory

    def summary(self) -> str:
        """One line: makespan, bubble rate, peak memory."""
        peaks = ", ".join(f"{p:g}" for p in self.peak_memory)
        return (f"makespan {self.makespan:.6g}  bubble rate {self.bubble_rate:.4f}  "
                f"peak memory per rank [{peaks}]")


def with_schedule_order(timeline: Timeline, schedule: Schedule) -> bool:
    """Does the timeline's per-rank event order match the schedule's lists (pairs as forward, backward)?"""
    return all(
        tuple(e.action for e in timeline.rank_events(r)) == schedule.rank_actions(r)
        for r in range(schedule.num_ranks)
    )


def early_starts(timeline: Timeline, num_stages: int, tol: float = 1e-9) -> list[Event]:
    """The events that started before one of their inputs (:func:`~zbpp_lite.schedules.ir.deps`) had ended,
    in the timeline's order: empty for a timeline that respects the schedule's dependencies, as every
    simulated and measured one must (arXiv 2401.10241 section 2, figure 1). ``tol``: an input may end up to
    ``tol`` after the start (the timeline's unit). An input no event produced counts as never ended."""
    ends = {key: e.end for e in timeline.events for key in produces(e.action)}
    return [e for e in timeline.events
            if any(ends.get(key, math.inf) > e.start + tol for key in deps(e.action, num_stages))]
