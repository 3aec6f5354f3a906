"""One pipeline step in flight and what it gives: the state the rank threads share (:class:`Step`), what
a compute handler returns (:class:`Done`), the measured :class:`StepResult` with its :class:`TieSum`
records, and :class:`PlanMemoryWarning`. Used by :mod:`zbpp_lite.runtime.executor`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import jax

from .memory import NoMemoryRecorder
from .stages import Params
from ..schedules.ir import Key
from ..schedules.program import Program, Recv, Send, consumer_stage, producer_stage
from ..schedules.timeline import Timeline


@dataclass(frozen=True)
class StepResult:
    """One executed training step (before the optimizer).

    Attributes:
        loss: the global-batch mean loss, float (mean of the microbatch losses).
        microbatch_losses: the last stage's loss for each microbatch, floats.
        grads: gradient of ``loss``, one pytree per model module (as ``StagedModel.params``), each on its
            stage's device, summed over the microbatches in float32 (float64 for float64 parameters:
            :func:`~zbpp_lite.runtime.split.sum_dtype`), bfloat16 parameters too.
        timeline: the measured :class:`~zbpp_lite.schedules.timeline.Timeline` (s from the first action).
        start: seconds from the first step of the :meth:`PipelineExecutor.run_steps` call (0.0 for ``run``).
        discarded: events of speculative actions redone after a rollback (:class:`RankUpdate`).
        started_at: ``time.perf_counter()`` at the first action (CLOCK_MONOTONIC: aligns processes of one
            machine); 0.0 across hosts.
        tie_sums: one :class:`TieSum` per rank and tie of a model with tied weights (``StagedModel.ties``):
            the exchange that sums the copies' gradients, timed like the timeline's events.
    """

    loss: float
    microbatch_losses: tuple[float, ...]
    grads: Params
    timeline: Timeline
    start: float = 0.0
    discarded: tuple = ()
    started_at: float = 0.0
    tie_sums: tuple = ()


@dataclass(frozen=True)
class TieSum:
    """One rank's share of summing a tied parameter's gradient copies after its last action (section 2's
    W sums, then one exchange, as Megatron-LM's embedding all-reduce): ``tie`` indexes ``StagedModel.ties``;
    ``ranks`` hold copies (this one sends its partial sum to each other one and adds theirs, in rank order,
    so every copy gets the same sum); ``nbytes`` sent to each; ``start``, ``end`` in seconds (the wait for
    the others' sums included), measured as the timeline's events."""

    rank: int
    tie: int
    ranks: tuple[int, ...]
    nbytes: int
    start: float
    end: float


class PlanMemoryWarning(UserWarning):
    """A schedule run on a model whose M_W / M_B moves its peak above what its planner promised
    (:meth:`zbpp_lite.schedules.memory.MemoryPlan.overrun`)."""


class Done(NamedTuple):
    """What a compute handler returns: ``ready``, the arrays to wait for before the action counts as done,
    and ``out``, the value another stage takes (F's activation, B's or BW's input gradient; None for W,
    the last stage's F and the first stage's B)."""

    ready: Any
    out: Any = None


@dataclass
class Step:
    """State of one step in flight, shared by the rank threads."""

    params: list  # per stage, its parameters as a tuple of leaves (FlatStage's p), on its device
    acc: list  # per stage gradient sums (tuples of leaves, None before its first W), on its device
    labels: list  # per microbatch, on the last stage's device
    splits: list  # per stage StageSplit
    out: dict  # Key -> a value made or received here for a compute of this rank (inputs and seed too)
    given: dict  # the inputs and seed in ``out`` (Key("F", -1, j), Key("B", S, j)): put back for a redo
    store: dict  # (what, stage, microbatch) -> what F / B kept: "res", "kept" or "grads" (runtime.memory)
    losses: dict
    events: list
    index: int = 0  # the step's number over the executor's life (the transport's step)
    where: str = ""  # the step in errors, e.g. " of step 3"
    t0: float = 0.0
    attempts: dict = field(default_factory=dict)  # rank -> its attempt (1 once its warm-up was redone)
    speculating: dict = field(default_factory=dict)  # rank -> its _Speculation until validated
    discarded: list = field(default_factory=list)  # events of actions redone after a rollback
    tie_sums: list = field(default_factory=list)  # TieSum per rank and tie (guarded by lock)
    memory: Any = field(default_factory=NoMemoryRecorder)  # MemoryRecorder: the bytes each rank keeps
    keys: dict = field(default_factory=dict)  # local stage -> per microbatch its dropout key ({}: no dropout)
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards events, discarded and tie_sums

    def hold(self, rank: int, key: tuple, value: Any) -> None:
        """Keep ``value`` under ``key`` in the store, counted as rank ``rank``'s memory."""
        self.store[key] = value
        self.memory.keep(rank, key, value)

    def release(self, rank: int, key: tuple) -> Any:
        """Take what ``key`` holds out of the store and out of rank ``rank``'s memory."""
        self.memory.free(rank, key)
        return self.store.pop(key)


def placed(tree: Any, device) -> Any:
    """``tree`` on ``device``, without a ``device_put`` when every leaf is already there."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    if all(isinstance(a, jax.Array) and a.committed and a.sharding == sharding
           for a in jax.tree_util.tree_leaves(tree)):
        return tree
    return jax.device_put(tree, device)


class Route(NamedTuple):
    """A (kind, stage)'s handler, the key of what it takes from another stage (microbatch 0) or None, the
    kind of key it makes for another stage or None, and whether that stage is on its own rank."""

    handler: Callable
    takes: Key | None
    makes: str | None
    here: bool


def route(handler: Callable, kind: str, stage: int, placement: Sequence[int]) -> Route:
    """What an action of ``kind`` on ``stage`` takes from another stage: F the activation of stage s-1,
    B and BW the input gradient of stage s+1 (stage -1 and S: the batch and the seed), W nothing; and
    what it makes for one (:func:`~zbpp_lite.schedules.program.producer_stage`,
    :func:`~zbpp_lite.schedules.program.consumer_stage`)."""
    if kind == "W":
        return Route(handler, None, None, False)
    makes = "F" if kind == "F" else "B"
    takes = Key(makes, producer_stage(makes, stage), 0)
    consumer = consumer_stage(makes, stage)
    if not 0 <= consumer < len(placement):
        return Route(handler, takes, None, False)
    return Route(handler, takes, makes, placement[consumer] == placement[stage])


def waiters(program: Program) -> dict:
    """Each :class:`Recv` of ``program`` -> the compute entry after it, which takes its value."""
    found, waiting = {}, []
    for row in program.instructions:
        for x in row:
            if type(x) is Recv:
                waiting.append(x)
            elif type(x) is not Send:
                found.update((r, x) for r in waiting)
                waiting = []
    return found
