"""Measured activation memory: the bytes each rank held over a step, beside the plan (pure Python).

The plan's model is :mod:`.costs`'s (arXiv 2401.10241 section 2.1). The executor
(:mod:`zbpp_lite.runtime.memory`) counts from array shapes and dtypes what a rank keeps:

- held: what its own actions keep, from the end of the action that made it to the end of the one that
  released it (F's residuals: M_B; B's output gradients with W's operands: M_W); compared with the plan
  to the byte.
- received: what other ranks sent, from arrival to the end of the consuming action (not in the plan).

On GPU/TPU ``memory_stats()["peak_bytes_in_use"]`` is recorded too (the allocator's peak since the process
began, parameters, optimizer state and temporaries included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .costs import Costs

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
        """``base`` (default :class:`Costs`) with the measured per-stage bytes as mem_b and mem_w.
        Raises ValueError: a stage whose measured M_W exceeds its M_B."""
        bad = [s for s, (b, w) in enumerate(zip(self.mem_b, self.mem_w)) if w > b]
        if bad:
            raise ValueError(
                f"measured M_W exceeds M_B on stage(s) {bad} (M_B {list(self.mem_b)}, M_W {list(self.mem_w)} "
                "bytes): B keeps more than it frees, which the plan's memory model "
                "(F +M_B, B -(M_B-M_W), W -M_W) cannot hold"
            )
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
