"""The executor's memory recorder: the activation bytes each rank keeps alive, as they change; and the
check of a schedule's memory plan against a model's M_B, M_W (:func:`check_memory_plan`).

One recorder per step: ``keep(rank, key, arrays)`` / ``free(rank, key)`` from an action, ``key`` = (what,
stage, microbatch) with what "res" (F's residuals), "kept" (W's operands) or "grads" (B's output
gradients), applied at the action's end (:meth:`MemoryRecorder.settle`); ``receive(rank, key, value, t)``
when an activation ("F", s, j) or input gradient ("B", s, j) arrives, freed by its consumer. Bytes are
``size * itemsize`` per leaf, counted when kept (so later donation does not matter). The result is a
:class:`~zbpp_lite.schedules.memory.MeasuredMemory` (cost: ``benchmarks/bench_memory.py``).
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any

import jax
import numpy as np

from ..schedules.costs import Costs
from ..schedules.ir import Schedule
from ..schedules.memory import MeasuredMemory


def nbytes(tree: Any) -> int:
    """Bytes of every array leaf of ``tree`` (jax, NumPy, avals): sum of ``prod(shape) * itemsize``."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree))


def stage_bytes(own: Any, kept: Any, grads_out: Any) -> tuple[int, int]:
    """``(M_B, M_W)`` of one stage and microbatch, bytes: what F keeps for B (``own``, ``kept``), and what
    waits from B until W (``kept``, B's ``grads_out``), as :class:`MemoryRecorder` counts them (Qi et al.,
    arXiv 2401.10241, section 2.3)."""
    return nbytes((own, kept)), nbytes((kept, grads_out))


class PlanMemoryWarning(UserWarning):
    """A schedule run on a model whose M_W / M_B moves its peak above what its planner promised
    (:meth:`zbpp_lite.schedules.memory.MemoryPlan.overrun`)."""


def check_memory_plan(schedule: Schedule, sizes: dict) -> None:
    """Warn (:class:`PlanMemoryWarning`) when the schedule's memory plan does not hold at this model's
    M_B, M_W (``sizes[stage]``, bytes: :func:`stage_bytes`; checked when every stage runs here)."""
    plan = schedule.memory_plan
    if plan is None or len(sizes) < schedule.num_stages:
        return
    mem_b, mem_w = zip(*(sizes[s] for s in range(schedule.num_stages)))
    message = plan.overrun(schedule, Costs(mem_b=mem_b, mem_w=mem_w))
    if message:
        warnings.warn(message, PlanMemoryWarning, stacklevel=4)


class MemoryRecorder:
    """Per-rank activation bytes over one step (see the module docstring).

    Args:
        num_ranks: p.
        num_stages: S, for the per-stage M_B and M_W.
    """

    def __init__(self, num_ranks: int, num_stages: int):
        self._lock = threading.Lock()  # receive() runs in the sender's thread
        self._live: list[dict] = [{} for _ in range(num_ranks)]  # key -> (bytes, received?)
        self._pending: list[list] = [[] for _ in range(num_ranks)]  # (key, bytes) or (key, None) to free
        self._held = [0] * num_ranks
        self._recv = [0] * num_ranks
        self._held_curve: list[list] = [[(0.0, 0)] for _ in range(num_ranks)]
        self._recv_curve: list[list] = [[(0.0, 0)] for _ in range(num_ranks)]
        self._stage: dict = {}  # (what, stage) -> bytes of one microbatch
        self.num_stages = num_stages

    def keep(self, rank: int, key: tuple, arrays: Any) -> None:
        """Rank ``rank``'s running action keeps ``arrays`` under ``key`` (applied at settle)."""
        size = nbytes(arrays)
        self._pending[rank].append((key, size))
        self._stage[key[0], key[1]] = max(size, self._stage.get((key[0], key[1]), 0))

    def free(self, rank: int, key: tuple) -> None:
        """Rank ``rank``'s running action releases what ``key`` holds (applied at settle)."""
        self._pending[rank].append((key, None))

    def receive(self, rank: int, key: tuple, value: Any, t: float) -> None:
        """``value`` arrived in ``rank``'s inbox under ``key`` at ``t`` s (a redone step's replaces it)."""
        size = nbytes(value)
        with self._lock:
            old = self._live[rank].pop(key, (0, True))[0]
            self._live[rank][key] = (size, True)
            self._recv[rank] += size - old
            self._recv_curve[rank].append((max(t, 0.0), self._recv[rank]))

    def settle(self, rank: int, t: float) -> None:
        """Apply rank ``rank``'s pending keeps and frees at ``t`` seconds (its action's end)."""
        if not self._pending[rank]:
            return
        with self._lock:
            live, received = self._live[rank], False
            for key, size in self._pending[rank]:
                if size is None:
                    size_was, was_received = live.pop(key, (0, False))
                    if was_received:
                        self._recv[rank] -= size_was
                        received = True
                    else:
                        self._held[rank] -= size_was
                else:
                    live[key] = (size, False)
                    self._held[rank] += size
            self._pending[rank].clear()
            self._held_curve[rank].append((t, self._held[rank]))
            if received:
                self._recv_curve[rank].append((t, self._recv[rank]))

    def result(self, shift: float = 0.0, device_peak: tuple = ()) -> MeasuredMemory:
        """The :class:`MeasuredMemory` so far, times minus ``shift`` seconds (clipped at 0)."""

        def curve(points: list) -> tuple:
            moved = sorted(((max(t - shift, 0.0), b) for t, b in points[1:]), key=lambda p: p[0])
            return ((0.0, 0), *moved)

        S = self.num_stages
        with self._lock:
            held = tuple(curve(c) for c in self._held_curve)
            recv = tuple(curve(c) for c in self._recv_curve)
            got = self._stage.get
            mem_b = tuple(got(("res", s), 0) + got(("kept", s), 0) for s in range(S))
            mem_w = tuple(got(("kept", s), 0) + got(("grads", s), 0) for s in range(S))
        return MeasuredMemory(held, recv, mem_b, mem_w, tuple(device_peak))


class NoMemoryRecorder:
    """A recorder that records nothing (``PipelineExecutor(record_memory=False)``)."""

    def _nothing(self, *args: Any) -> None:
        return None

    keep = free = receive = settle = result = _nothing


def device_peak_bytes(device: Any) -> int | None:
    """The allocator's peak bytes since the process began (GPU, TPU); None where there is none (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without the call has no count
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])
