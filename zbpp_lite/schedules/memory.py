"""Measured activation memory: the bytes each rank held over a step, beside the plan (pure Python).

The plan's model is :mod:`.costs`'s (arXiv 2401.10241 section 2.1). The executor
(:mod:`zbpp_lite.runtime.memory`) counts from array shapes and dtypes what a rank keeps:

- held: what its own actions keep, from the end of the action that made it to the end of the one that
  released it (F's residuals: M_B; B's output gradients with W's operands: M_W); compared with the plan
  to the byte.
- received: what other ranks sent, from arrival to the end of the consuming action (not in the plan).

On GPU/TPU ``memory_stats()["peak_bytes_in_use"]`` is recorded too (the allocator's peak since the process
began, parameters, optimizer state and temporaries included).

A memory-limited planner's schedule carries the M_B, M_W it was planned with and the peak it promised
(:class:`MemoryPlan`): a model whose M_W / M_B is larger moves every postponed W's share up, so the same
order can hold far more than promised (zb-2p at p = 4, m = 16: 15 M_B at M_W = M_B against 8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .costs import Costs
from .ir import Schedule

Curve = tuple[tuple[float, int], ...]
"""A step curve: (time in seconds, bytes from then on), in time order, from (0.0, 0)."""


def curve_peak(curve: Curve) -> int:
    """Largest value of a step curve, bytes (0 for an empty curve)."""
    return max((b for _, b in curve), default=0)


def add_curves(a: Curve, b: Curve) -> Curve:
    """The step curve of a + b (both as :data:`Curve`), one point per distinct time."""
    points: list[tuple[float, int]] = []
    i = j = va = vb = 0
    while i < len(a) or j < len(b):
        t = min(a[i][0] if i < len(a) else float("inf"), b[j][0] if j < len(b) else float("inf"))
        while i < len(a) and a[i][0] == t:
            va = a[i][1]
            i += 1
        while j < len(b) and b[j][0] == t:
            vb = b[j][1]
            j += 1
        points.append((t, va + vb))
    return tuple(points)


@dataclass(frozen=True)
class MeasuredMemory:
    """Activation bytes each rank held during one measured step.

    Attributes:
        held: per rank, the :data:`Curve` of bytes its own actions keep (seconds on the timeline's clock).
        received: per rank, the :data:`Curve` of bytes received and not yet consumed.
        mem_b: per stage, measured M_B in bytes (int; 0 for a stage this process did not run).
        mem_w: per stage, measured M_W in bytes (int; 0 as ``mem_b``).
        device_peak: per rank, the device's ``peak_bytes_in_use`` after the step, or None (CPU, or run
            elsewhere).
    """

    held: tuple[Curve, ...]
    received: tuple[Curve, ...]
    mem_b: tuple[int, ...]
    mem_w: tuple[int, ...]
    device_peak: tuple[int | None, ...] = ()

    @property
    def peak_bytes(self) -> tuple[int, ...]:
        """Per rank, the peak of ``held``, bytes: what the plan's peak memory predicts."""
        return tuple(curve_peak(c) for c in self.held)

    @property
    def peak_received_bytes(self) -> tuple[int, ...]:
        """Per rank, the peak of ``received``, bytes."""
        return tuple(curve_peak(c) for c in self.received)

    @property
    def peak_total_bytes(self) -> tuple[int, ...]:
        """Per rank, the peak of held + received (at one instant), bytes."""
        return tuple(curve_peak(add_curves(h, r)) for h, r in zip(self.held, self.received))

    def peak_units(self, unit_stages: Sequence[int]) -> tuple[float, ...]:
        """Per rank r, the measured peak over the measured M_B of stage ``unit_stages[r]`` (nan if 0)."""
        return tuple(b / self.mem_b[s] if self.mem_b[s] else float("nan")
            for b, s in zip(self.peak_bytes, unit_stages))

    def costs(self, base: Costs | None = None) -> Costs:
        """``base`` (default :class:`Costs`) with the measured per-stage bytes as mem_b and mem_w (M_W above
        M_B under ``jax.checkpoint``: the planners refuse such costs, the simulator counts them)."""
        base = base or Costs()
        return Costs(f=base.f, b=base.b, w=base.w, comm=base.comm, bw=base.bw, mem_b=self.mem_b,
            mem_w=self.mem_w)

    def to_json(self) -> dict:
        """A JSON-ready dict: per-rank peaks, per-stage M_B and M_W (bytes), device peaks (or null), and the
        curves as [time s, bytes] pairs."""
        return {
            "peak_bytes": list(self.peak_bytes),
            "peak_received_bytes": list(self.peak_received_bytes),
            "peak_total_bytes": list(self.peak_total_bytes),
            "mem_b_bytes": list(self.mem_b),
            "mem_w_bytes": list(self.mem_w),
            "device_peak_bytes": list(self.device_peak),
            "held": [[list(p) for p in c] for c in self.held],
            "received": [[list(p) for p in c] for c in self.received],
        }


@dataclass(frozen=True)
class MemoryPlan:
    """What a memory-limited planner planned a schedule with (arXiv 2401.10241 section 3.1: the limit binds
    the peak, which M_W moves: every W waiting holds its M_W).

    Attributes:
        mem_b: per stage, the M_B planned with (the unit of the planner's ``Costs.mem_b``).
        mem_w: per stage, the M_W planned with (same unit).
        limit: per rank, the memory limit planned under (same unit), or None: the schedule's peak under
            these M_B, M_W is what the plan promised.
    """

    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    limit: tuple[float, ...] | None = None

    @classmethod
    def of(cls, costs: Costs, num_stages: int, limit: Sequence[float] | None = None) -> "MemoryPlan":
        """The plan of a schedule of ``num_stages`` stages built with ``costs`` under ``limit`` per rank
        (None: its peak under these M_B, M_W). Raises ValueError: as :meth:`Costs.table`."""
        table = costs.table(num_stages)
        return cls(table.mem_b, table.mem_w, None if limit is None else tuple(float(x) for x in limit))

    def assumed(self) -> str:
        """The M_W planned with, in words: ``"M_W = 0.4375 M_B"`` (one ratio) or the per-stage ratios."""
        ratios = [w / b if b else 0.0 for b, w in zip(self.mem_b, self.mem_w)]
        if len(set(ratios)) == 1:
            return f"M_W = {ratios[0]:.4g} M_B"
        return "M_W / M_B per stage " + ", ".join(f"{r:.3g}" for r in ratios)

    def limit_units(self, schedule: Schedule) -> tuple[float, ...]:
        """Per rank, the promised peak in units of the rank's M_B (its stages' planned M_B summed)."""
        limit = self.limit or order_peaks(schedule, Costs(mem_b=self.mem_b, mem_w=self.mem_w))
        return tuple(x / _rank_sum(schedule, self.mem_b, r) for r, x in enumerate(limit))

    def overrun(self, schedule: Schedule, costs: Costs) -> str | None:
        """One line when ``schedule`` under ``costs``' M_B, M_W (a model's, e.g. bytes) peaks above the plan
        on some rank, each side in units of the rank's M_B; None when it keeps the promise. Raises
        ValueError: as :meth:`Costs.table`."""
        table = costs.table(schedule.num_stages)
        units = [x / _rank_sum(schedule, table.mem_b, r) for r, x in enumerate(order_peaks(schedule, costs))]
        promised = self.limit_units(schedule)
        over = [r for r, (u, lim) in enumerate(zip(units, promised)) if u > lim * (1 + 1e-9)]
        if not over:
            return None
        r = max(over, key=lambda k: units[k] / promised[k])
        model = MemoryPlan(table.mem_b, table.mem_w).assumed()
        return (f"{schedule.name or 'the schedule'} was planned with {self.assumed()} to hold at most "
                f"{promised[r]:.4g} M_B on rank {r}, but with the model's {model} it holds "
                f"{units[r]:.4g} M_B there: plan it with the model's memory (costs=Costs(mem_b=..., "
                "mem_w=...), e.g. zbpp_lite.training.train.job_costs, or pass its name to train)")


def _rank_sum(schedule: Schedule, values: Sequence[float], rank: int) -> float:
    return sum(values[s] for s in schedule.stages_of(rank)) or 1.0


def order_peaks(schedule: Schedule, costs: Costs) -> tuple[float, ...]:
    """Per rank, the peak of its memory over its own order (F adds M_B, B and W change it as
    :meth:`~zbpp_lite.schedules.costs.CostTable.memory_delta` says), units of ``costs``' M_B: the
    simulator's ``Timeline.peak_memory``, which no timing moves (a rank runs one entry at a time; a pair's
    F allocates before its backward frees), without simulating. Raises ValueError: as
    :meth:`Costs.table`."""
    table = costs.table(schedule.num_stages)
    return tuple(table.peak_memory(schedule.rank_actions(r)) for r in range(schedule.num_ranks))
