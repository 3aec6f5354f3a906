"""Shared pieces of the schedule builders: argument checks, the per-stage counter, assembly."""

from __future__ import annotations

import numbers
from collections import defaultdict

from ..ir import Action, Schedule


def as_size(name: str, label: str, value) -> int:
    """``value`` as an ``int`` if it is an integer >= 1: any ``numbers.Integral`` (Python's int,
    NumPy's int64, ...), but not a bool. Raises ValueError naming ``label`` otherwise."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: {label} must be an integer >= 1, got {value!r}")
    return int(value)


def check_sizes(name: str, num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError unless num_ranks, num_microbatches >= 1 (integers, see :func:`as_size`)."""
    as_size(name, "num_ranks", num_ranks)
    as_size(name, "num_microbatches", num_microbatches)


class Next:
    """Hands out the next microbatch per (kind, stage), so builders read like their phases:
    ``nxt.f(s)`` returns ``Action("F", s, j)`` for the next unused j of stage s."""

    def __init__(self, num_microbatches: int):
        self.m = num_microbatches
        self._count: dict[tuple[str, int], int] = defaultdict(int)

    def _take(self, kind: str, stage: int) -> Action:
        j = self._count[kind, stage]
        if j >= self.m:
            raise AssertionError(f"builder bug: no {kind} left for stage {stage}")
        self._count[kind, stage] += 1
        return Action(kind, stage, j)

    def left(self, kind: str, stage: int) -> int:
        """How many ``kind`` actions of ``stage`` are not handed out yet."""
        return self.m - self._count[kind, stage]

    def f(self, stage: int) -> Action:
        return self._take("F", stage)

    def b(self, stage: int) -> Action:
        return self._take("B", stage)

    def w(self, stage: int) -> Action:
        return self._take("W", stage)

    def bw(self, stage: int) -> Action:
        return self._take("BW", stage)


def assemble(name: str, rows: list[list[Action]], placement: tuple[int, ...],
        num_microbatches: int) -> Schedule:
    return Schedule(tuple(tuple(r) for r in rows), placement, num_microbatches, name)
