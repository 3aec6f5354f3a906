"""Per-action costs and the activation-memory model (pure Python).

Source: arXiv 2401.10241 section 2.1 and table 1: T_F, T_B, T_W are one stage's F, B, W times on one
microbatch, T_comm the transfer time between ranks; F allocates M_B, B frees M_B - M_W, W frees M_W. Under
activation checkpointing M_W may exceed M_B (B recomputes W's operands and keeps them, with the output
gradients, until W): B then allocates M_W - M_B, which the simulator counts; the planners refuse it.
M_W defaults to the paper's share of M_B (:data:`MEM_W_RATIO`), never 0: a plan made with M_W = 0 puts
every W at the end and hides memory that grows with m. A fused BW costs T_B + T_W and frees M_B unless a
measured T_BW is given: on a device the split has a price (B writes the gradients W reads; two launches).
An overlapped pair F&B (:class:`~zbpp_lite.schedules.ir.Overlap`, arXiv 2412.19437 section 3.2.1) costs
T_F&B: by default its parts' times added (no overlap).
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass, replace
from typing import Sequence, Union

from .ir import Entry, Overlap

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]

MEM_W_RATIO = 7 / 16
"""The default M_W / M_B, 7/16 = 0.4375: the paper's ratio, rounded up to sixteenths. Qi et al.,
arXiv 2401.10241, section 2.3, table 1 gives per transformer layer M_B = sb(34h + 5as) and
M_W = 32sbh (s sequence length, b microbatch size, h hidden size, a attention heads), so
M_W / M_B = 32h / (34h + 5as): 16/37 = 0.432 at s = 1024 and h/a = 128, the setting of three of the
paper's four models (table 3: 6.2B, 14.6B, 28.3B). Rounded up (more memory held, never less) to
7/16, which binary floating point holds exactly, so peaks in the default units are exact sums
(p M_B compares equal to p). The ratio falls as s grows (1.5B, h/a = 96: 0.37) and tends to 32/34
without stored attention scores (the 5as term, e.g. with flash attention); give measured values
(:func:`zbpp_lite.analysis.profiling.device.stage_memory_bytes`) where they are known."""


def _per_stage(value: PerStage, num_stages: int, name: str) -> tuple[float, ...]:
    if isinstance(value, numbers.Real):
        return (float(value),) * num_stages
    values = tuple(float(v) for v in value)
    if len(values) != num_stages:
        raise ValueError(
            f"Costs.{name} has {len(values)} per-stage values but the schedule has {num_stages} "
            "stages; give one value per stage or a single scalar"
        )
    return values


@dataclass(frozen=True)
class Costs:
    """Action times (any consistent unit; the executor uses seconds) and memory per stage; each field is a
    scalar or one value per stage.

    Attributes:
        f: T_F, forward time of one stage on one microbatch.
        b: T_B, input-gradient backward time.
        w: T_W, weight-gradient backward time.
        bw: T_BW, the fused backward's time; None: b + w (the paper's model). Measured below b + w, the
            automatic scheduler fuses where it pays
            (:func:`~zbpp_lite.schedules.builders.greedy.fuse_backward`).
        fb: T_F&B of an overlapped pair, per stage of its forward; None: T_F plus the backward's time (no
            overlap). DualPipe's bubble (PP/2 - 1)(F&B + B - 3W) uses it (arXiv 2412.19437).
        comm: T_comm, time to send a stage's output onward (or its input gradient back) to another rank.
        mem_b: M_B, activation memory F allocates (e.g. bytes; default 1.0, one stage-microbatch).
        mem_w: M_W, what a microbatch holds from B until W, unit of mem_b. None: :data:`MEM_W_RATIO` (7/16)
            times mem_b (section 2.3, table 1); 0 is the idealised W; above mem_b under
            ``jax.checkpoint`` (module docstring). Resolved at construction, so
            ``dataclasses.replace(c, mem_b=...)`` keeps the old mem_w.

    Raises:
        ValueError: a negative, NaN or infinite value.
    """

    f: PerStage = 1.0
    b: PerStage = 1.0
    w: PerStage = 1.0
    comm: PerStage = 0.0
    mem_b: PerStage = 1.0
    mem_w: PerStage | None = None
    bw: PerStage | None = None
    fb: PerStage | None = None

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "comm", "mem_b", "mem_w", "bw", "fb"):
            value = getattr(self, name)
            if value is None and name in ("mem_w", "bw", "fb"):
                continue
            values = [value] if isinstance(value, numbers.Real) else list(value)
            if any(not (math.isfinite(v) and v >= 0) for v in values):
                raise ValueError(f"Costs.{name} must be finite numbers >= 0, got {value}")
            if isinstance(value, numbers.Real):
                object.__setattr__(self, name, float(value))
            else:
                object.__setattr__(self, name, tuple(float(v) for v in values))
        if self.mem_w is None:  # the paper's ratio of M_B (MEM_W_RATIO), stage by stage
            b = self.mem_b
            share = b * MEM_W_RATIO if isinstance(b, float) else tuple(x * MEM_W_RATIO for x in b)
            object.__setattr__(self, "mem_w", share)

    def table(self, num_stages: int) -> "CostTable":
        """Resolve scalars to per-stage tuples for a schedule with ``num_stages`` stages. Raises
        ValueError: a per-stage field whose length is not ``num_stages``."""
        fields = {k: _per_stage(getattr(self, k), num_stages, k)
            for k in ("f", "b", "w", "comm", "mem_b", "mem_w")}
        if self.bw is None:
            bw = tuple(b + w for b, w in zip(fields["b"], fields["w"]))
        else:
            bw = _per_stage(self.bw, num_stages, "bw")
        fb = () if self.fb is None else _per_stage(self.fb, num_stages, "fb")
        return CostTable(**fields, bw=bw, fb=fb)

    def with_split_price(self, price: float) -> "Costs":
        """These costs with T_B and T_W scaled alike, stage by stage, so that (T_B + T_W) / T_BW is
        ``price`` (T_F, T_BW and every other field kept): what a split schedule would take were the
        split that much dearer or cheaper than the fused backward (the break-even question of lesson 4).

        Raises:
            ValueError: ``bw`` not given, ``price`` not a finite number > 0, per-stage fields of
                different lengths, or a stage with T_B + T_W = 0.
        """
        if self.bw is None:
            raise ValueError("with_split_price needs the fused backward's time: give Costs(bw=...)")
        if not (isinstance(price, numbers.Real) and math.isfinite(price) and price > 0):
            raise ValueError(f"price must be a finite number > 0, got {price!r}")
        fields = [self.b, self.w, self.bw]
        lengths = {len(v) for v in fields if isinstance(v, tuple)}
        if len(lengths) > 1:
            raise ValueError(f"b, w and bw have different numbers of stages: {sorted(lengths)}")
        n = max(lengths, default=1)
        b, w, bw = ([v] * n if isinstance(v, float) else list(v) for v in fields)
        if any(x + y == 0 for x, y in zip(b, w)):
            raise ValueError("a stage with T_B + T_W = 0 has no split to price")
        scale = [price * z / (x + y) for x, y, z in zip(b, w, bw)]
        new_b, new_w = ([v * k for v, k in zip(vs, scale)] for vs in (b, w))
        if not lengths:
            return replace(self, b=new_b[0], w=new_w[0])
        return replace(self, b=tuple(new_b), w=tuple(new_w))

    @classmethod
    def uniform(cls, value: float = 1.0) -> "Costs":
        """T_F = T_B = T_W = value, no communication: the paper's idealised setting."""
        return cls(f=value, b=value, w=value)


@dataclass(frozen=True)
class CostTable:
    """Costs resolved to one value per stage; the only place action costs are looked up."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: tuple[float, ...]
    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    bw: tuple[float, ...] = ()  # T_BW per stage (b + w unless measured)
    fb: tuple[float, ...] = ()  # T_F&B per stage of the pair's forward; () for the parts' sum (no overlap)

    def __post_init__(self) -> None:
        if not self.bw:
            object.__setattr__(self, "bw", tuple(b + w for b, w in zip(self.b, self.w)))

    def costs(self) -> "Costs":
        """These per-stage values as :class:`Costs` again."""
        return Costs(f=self.f, b=self.b, w=self.w, comm=self.comm, mem_b=self.mem_b, mem_w=self.mem_w,
            bw=self.bw, fb=self.fb or None)

    def time(self, kind: str, stage: int) -> float:
        """Duration of one action; BW costs T_BW (T_B + T_W unless measured)."""
        if kind == "F":
            return self.f[stage]
        if kind == "B":
            return self.b[stage]
        if kind == "W":
            return self.w[stage]
        if kind == "BW":
            return self.bw[stage]
        raise ValueError(f"unknown action kind {kind!r}")

    def duration(self, entry: Entry) -> float:
        """Duration of a rank's list entry: an Action's :meth:`time`, or a pair's T_F&B (its forward stage's
        ``fb``; else both parts' times)."""
        if isinstance(entry, Overlap):
            f, b = entry.forward, entry.backward
            return self.fb[f.stage] if self.fb else self.time("F", f.stage) + self.time(b.kind, b.stage)
        return self.time(entry.kind, entry.stage)

    def memory_delta(self, kind: str, stage: int) -> float:
        """Change of activation memory an action causes: F +M_B, B -(M_B-M_W) (an allocation where M_W > M_B),
        W -M_W, BW -M_B."""
        if kind == "F":
            return self.mem_b[stage]
        if kind == "B":
            return -(self.mem_b[stage] - self.mem_w[stage])
        if kind == "W":
            return -self.mem_w[stage]
        if kind == "BW":
            return -self.mem_b[stage]
        raise ValueError(f"unknown action kind {kind!r}")

    def peak_memory(self, actions: Sequence) -> float:
        """The peak of the activation memory held while ``actions`` run in order from none (each changing
        it by :meth:`memory_delta`, looked up once per kind and stage; an optimizer instruction, stage -1,
        holds none). Raises ValueError: as :meth:`memory_delta`."""
        delta: dict[tuple[str, int], float] = {}
        held = peak = 0.0
        for a in actions:
            key = (a.kind, a.stage)
            d = delta.get(key)
            if d is None:
                d = delta[key] = self.memory_delta(*key) if a.stage >= 0 else 0.0
            held += d
            if held > peak:
                peak = held
        return peak

    def overflow(self) -> ValueError:
        """The error for times that add up beyond the largest float (simulator and planners alike)."""
        big = max((*self.f, *self.b, *self.w, *self.comm))
        return ValueError(
            f"the simulated times overflow to infinity: costs up to {big:g} add up beyond the largest float "
            f"({sys.float_info.max:.3g}); give the costs in a larger time unit (e.g. seconds instead of "
            "microseconds)")

    def transfer(self, producer_stage: int, consumer_stage: int) -> float:
        """T_comm for a dependency from one stage to another (the sending side's value)."""
        return self.comm[producer_stage]
