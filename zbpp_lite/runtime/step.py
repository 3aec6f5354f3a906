"""One pipeline step in flight and what it gives: the state the rank threads share (:class:`Step`), the
compute handlers (:class:`Compute`: each stage compiled for a shape, and the tied weights' gradient sums)
and what one returns (:class:`Done`), the optimizer the rank threads step (:class:`RankUpdate`), the
measured :class:`StepResult` with its :class:`TieSum` records. Used by :mod:`zbpp_lite.runtime.executor`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from .memory import NoMemoryRecorder, check_memory_plan, stage_bytes
from .split import sum_dtype
from .stages import Params
from .transport import Transfer
from ..schedules.ir import Action, Key
from ..schedules.program import (OptimizerMessage, Program, Recv, Send, consumer_stage, producer_stage,
    tie_message)
from ..schedules.timeline import Event, Timeline


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
    transport: Any = None  # the Transport carrying its values between ranks (:meth:`wait_for`)
    timeout: float = 0.0  # seconds a rank waits for one value (the executor's timeout)
    t0: float = 0.0
    attempts: dict = field(default_factory=dict)  # rank -> its attempt (1 once its warm-up was redone)
    program: Any = None  # the Program the ranks run (with the optimizer's instructions, if any)
    update: Any = None  # the RankUpdate its optimizer instructions call, or None
    number: int = 0  # the step's number in its run_steps call (the optimizer's k)
    previous: "Step | None" = None  # the step before it in the call: its optimizer messages validated here
    messages: dict = field(default_factory=dict)  # rank -> {OptimizerMessage: value} made or received
    discarded: list = field(default_factory=list)  # events of actions redone after a rollback
    tie_sums: list = field(default_factory=list)  # TieSum per rank and tie (guarded by lock)
    tie_started: dict = field(default_factory=dict)  # rank -> when its TIE began (its TieSums' start)
    memory: Any = field(default_factory=NoMemoryRecorder)  # MemoryRecorder: the bytes each rank keeps
    keys: dict = field(default_factory=dict)  # local stage -> per microbatch its dropout key ({}: no dropout)
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards events, discarded and tie_sums

    def result(self, model: Any, num_ranks: int, stage_params: list, peaks: tuple) -> StepResult:
        """The step's :class:`StepResult`: ``model`` its :class:`~zbpp_lite.runtime.stages.StagedModel`,
        ``stage_params`` per stage its parameters here (None: a stage run elsewhere, no gradient here),
        ``peaks`` per rank its device's peak bytes or None; times from the step's first action."""
        S, tree = model.num_stages, jax.tree_util
        losses = tuple(float(v) for v in jax.device_get([self.losses[j] for j in sorted(self.losses)]))
        grads = [[None] * len(model.parts[s]) if p is None else tree.tree_unflatten(tree.tree_structure(p), g)
                 for s, (p, g) in enumerate(zip(stage_params, self.acc))]
        begin = min((e.start for e in self.events + self.discarded), default=0.0)
        events = [Event(e.rank, e.action, e.start - begin, e.end - begin) for e in self.events]
        timeline = Timeline.from_events(events, num_ranks, num_stages=S, source="measured")
        timeline = dataclasses.replace(timeline, measured_memory=self.memory.result(begin, peaks))
        loss = float(np.mean(np.asarray(losses, np.float64))) if losses else float("nan")
        discarded = tuple(Event(e.rank, e.action, e.start - begin, e.end - begin) for e in self.discarded)
        tie_sums = tuple(dataclasses.replace(t, start=t.start - begin, end=t.end - begin)
                         for t in self.tie_sums)
        return StepResult(loss, losses, model.join_stage_params(grads), timeline, begin, discarded,
                          self.t0 + begin, tie_sums)

    def hold(self, rank: int, key: tuple, value: Any) -> None:
        """Keep ``value`` under ``key`` in the store, counted as rank ``rank``'s memory."""
        self.store[key] = value
        self.memory.keep(rank, key, value)

    def release(self, rank: int, key: tuple) -> Any:
        """Take what ``key`` holds out of the store and out of rank ``rank``'s memory."""
        self.memory.free(rank, key)
        return self.store.pop(key)

    def wait_for(self, rank: int, key: Transfer | OptimizerMessage, waiter: Any, earlier: int = 0) -> Any:
        """What the transport has for ``rank`` under ``key`` (sent ``earlier`` steps before this one).
        Raises TimeoutError naming the rank, ``waiter`` and the value."""
        try:
            return self.transport.recv(self.index - earlier, rank, key, self.timeout)
        except TimeoutError:
            what = (f"{key.tag} from rank {key.sender}" if isinstance(key, OptimizerMessage)
                    else f"{key.kind} of stage {key.stage}, microbatch {key.microbatch}")
            waiter = getattr(waiter, "text", waiter)
            raise TimeoutError(f"rank {rank} waited {self.timeout:g} s before {waiter}{self.where}: "
                               f"{what} never arrived") from None


_HANDLERS = {"F": "forward", "B": "backward_input", "W": "backward_weight", "BW": "backward_fused"}


class Compute:
    """The compute handlers on a :class:`Step`, kind -> work (:meth:`handler`): each takes the value its
    action takes from another stage (F: x, B and BW: dy; stage 0's input and the last stage's seed 1/m
    among them) and returns :class:`Done`. Dead outputs (B's residuals once B or BW has run, B's output
    gradients once W has) are kept as ``spares``: the stage's next F / B writes into their memory
    (FlatStage's ``spare``). A stage belongs to one rank thread, so its spares need no lock. Before a
    step, :meth:`prepare` compiles the stages for its microbatches' shape. The program's ``TIE`` and
    ``TIE_TOTAL`` (:func:`~zbpp_lite.schedules.program.tie_instructions`) call :meth:`tie_shares` and
    :meth:`tie_totals`: the tied weights' gradient copies summed across ranks.

    Args:
        model: the :class:`~zbpp_lite.runtime.stages.StagedModel` (its ``stage_aux``, stage count).
        placement: ``placement[stage]``, the rank holding it.
    """

    def __init__(self, model: Any, placement: Sequence[int]):
        self.model, self.placement = model, placement
        # per tie (StagedModel.tied_leaves), the ranks holding its copies: lower's ties
        self.tie_ranks = tuple(tuple(sorted({placement[s] for s, _ in c})) for c in model.tied_leaves())
        self.spares: dict = {}  # ("res" | "grads", stage) -> dead outputs whose memory F / B reuse
        self.spares_for: Any = None  # the microbatch shape the spares have
        self._prepared: dict = {}  # prepare's: (x, y shapes and dtypes, no key?) -> (splits, input shapes)
        self.input_shapes: list = []  # per stage: its input's shapes and dtypes (set by prepare)

    def fit_spares(self, shape: Any) -> None:
        """Drop the spares unless they were made for microbatches of ``shape`` (then made for it)."""
        if self.spares_for != shape:
            self.spares, self.spares_for = {}, shape

    def drop_spares(self) -> None:
        """Drop every spare (after a failed step, which may have left some half donated)."""
        self.spares = {}

    def handler(self, kind: str) -> Callable:
        """F: :meth:`forward`, B: :meth:`backward_input`, W: :meth:`backward_weight`, BW:
        :meth:`backward_fused`."""
        return getattr(self, _HANDLERS[kind])

    def _spare(self, kind: str, stage: int) -> Any:
        spares = self.spares.get((kind, stage))
        return spares.pop() if spares else None

    def _keep_spare(self, kind: str, stage: int, arrays: tuple) -> None:
        self.spares.setdefault((kind, stage), []).append(arrays)

    def forward(self, step: Step, a: Action, x: Any) -> Done:
        s, j, rank = a.stage, a.microbatch, self.placement[a.stage]
        last = s == self.model.num_stages - 1
        key = step.keys[s][j] if step.keys else None
        aux = self.model.stage_aux(s, step.labels[j] if last else None, key)
        y, res, kept = step.splits[s].flat.forward(step.params[s], x, aux, self._spare("res", s))
        step.hold(rank, ("res", s, j), res)
        step.hold(rank, ("kept", s, j), kept)
        if last:
            step.losses[j] = y
        return Done((y, res, kept), None if last else y)

    def backward_input(self, step: Step, a: Action, dy: Any) -> Done:
        s, j, rank = a.stage, a.microbatch, self.placement[a.stage]
        res = step.release(rank, ("res", s, j))
        dx, grads_out = step.splits[s].flat.backward_input(step.params[s], res, dy, self._spare("grads", s))
        step.hold(rank, ("grads", s, j), grads_out)
        self._keep_spare("res", s, res)
        return Done((dx, grads_out), dx if s else None)

    def prepare(self, schedule: Any, devices: Sequence[Any], params: list, x_mb: Any, y_mb: Any,
                key: Any = None) -> list:
        """Each stage's StageSplit compiled for a new shape (with a dropout ``key`` row or without; None where
        ``devices[stage]`` is None: run elsewhere), then the ``schedule``'s memory plan checked."""
        signature = (np.shape(x_mb), str(x_mb.dtype), np.shape(y_mb), str(y_mb.dtype), key is None)
        if signature in self._prepared:
            splits, self.input_shapes = self._prepared[signature]
            return splits
        S = self.model.num_stages
        # what stage s takes (and what its B sends back): one array, or a pytree (tuple, dict)
        shapes = self.input_shapes = self.model.stage_inputs(x_mb)
        splits: list = [None] * S
        sizes: dict = {}  # stage -> (M_B, M_W) bytes, for the schedule's memory plan
        local = [s for s, device in enumerate(devices) if device is not None]
        kinds = {a.kind for r in {self.placement[s] for s in local} for a in schedule.rank_actions(r)}
        for s in local:
            device, last = devices[s], s == S - 1
            splits[s] = self.model.split_stage(s, shapes[s], y_mb, key)
            x = jax.device_put(jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), shapes[s]),
                               device)
            aux = jax.device_put(self.model.stage_aux(s, y_mb if last else None, key), device)
            sizes[s] = self.warm(splits[s].flat, params[s], x, aux, kinds, device)
        sizes = {s: size for s, size in sizes.items() if size is not None}
        self._warm_ties(params, devices)
        self._prepared[signature] = splits, shapes
        check_memory_plan(schedule, sizes)
        return splits

    def warm(self, flat: Any, params: tuple, x: Any, aux: Any, kinds: set, device: Any) -> tuple | None:
        """Compile a stage's jitted F and the backwards in ``kinds`` as the handlers call them (``flat``:
        its FlatStage; ``x``, ``aux``: one microbatch's, on its ``device``): each twice, new memory then a
        spare's, ``spare=None`` passed as the handlers pass it (jit keys its cache on the call's
        arguments: an omitted default compiles anew). Returns its (M_B, M_W) bytes
        (:func:`~zbpp_lite.runtime.memory.stage_bytes`) if it runs B or W, else None."""
        _, res, _ = flat.forward(params, x, aux, None)
        out, res, kept = flat.forward(params, x, aux, res)
        dy = jax.device_put(jax.tree_util.tree_map(lambda a: np.ones(np.shape(a), a.dtype), out), device)
        if "BW" in kinds:  # twice, as W: a stage's first (no sum yet), then the rest
            acc = flat.backward_fused(params, res, kept, dy, None)[1]
            jax.block_until_ready(flat.backward_fused(params, res, kept, dy, acc))
        if "B" not in kinds and "W" not in kinds:
            return None
        _, grads_out = flat.backward_input(params, res, dy, None)
        _, grads_out = flat.backward_input(params, res, dy, grads_out)
        acc = flat.backward_weight(params, kept, grads_out, None)
        jax.block_until_ready(flat.backward_weight(params, kept, grads_out, acc))
        return stage_bytes(res, kept, grads_out)

    def backward_weight(self, step: Step, a: Action) -> Done:
        s, j, rank = a.stage, a.microbatch, self.placement[a.stage]
        kept, grads_out = (step.release(rank, (what, s, j)) for what in ("kept", "grads"))
        step.acc[s] = step.splits[s].flat.backward_weight(step.params[s], kept, grads_out, step.acc[s])
        self._keep_spare("grads", s, grads_out)
        return Done(step.acc[s])

    def backward_fused(self, step: Step, a: Action, dy: Any) -> Done:
        s, j, rank = a.stage, a.microbatch, self.placement[a.stage]
        res, kept = (step.release(rank, (what, s, j)) for what in ("res", "kept"))
        dx, step.acc[s] = step.splits[s].flat.backward_fused(step.params[s], res, kept, dy, step.acc[s])
        self._keep_spare("res", s, res)
        return Done((dx, step.acc[s]), dx if s else None)

    def _warm_ties(self, params: list, devices: Sequence[Any]) -> None:
        """Compile :meth:`tie_totals`' addition for each copy on a stage run here, so no step compiles it."""
        for s, i in (c for copies in self.model.tied_leaves() for c in copies if devices[c[0]] is not None):
            leaf = params[s][i]
            zeros = jax.device_put(np.zeros(leaf.shape, sum_dtype(leaf.dtype)), devices[s])
            jax.block_until_ready(zeros + zeros)

    def _mine(self, rank: int) -> list:
        """(tie, its copies (stage, leaf) on ``rank``) for each tie with a copy here."""
        here = [(t, [(s, i) for s, i in copies if self.placement[s] == rank])
                for t, copies in enumerate(self.model.tied_leaves())]
        return [(t, mine) for t, mine in here if mine]

    def tie_shares(self, step: Step, rank: int) -> dict:
        """``TIE``: per tie with a copy on ``rank``, the sum of its copies here, as the rank's
        :func:`~zbpp_lite.schedules.program.tie_message` (what it sends to the tie's other ranks)."""
        step.tie_started[rank] = time.perf_counter()
        return {tie_message(t, rank): functools.reduce(operator.add, [step.acc[s][i] for s, i in mine])
                for t, mine in self._mine(rank)}

    def tie_totals(self, step: Step, rank: int, got: dict) -> None:
        """``TIE_TOTAL``: per tie with a copy on ``rank``, every holding rank's share (``got``: the rank's
        own and those received) added in rank order, the same sum on every rank, put into each copy here;
        one :class:`TieSum` per tie, from the rank's ``TIE``."""
        for t, mine in self._mine(rank):
            own, ranks = got[tie_message(t, rank)], self.tie_ranks[t]
            device = own.sharding  # the rank's one device, which holds every copy here
            total = functools.reduce(operator.add, [own if q == rank else jax.device_put(
                got[tie_message(t, q)], device) for q in ranks])
            for s, i in mine:
                step.acc[s] = (*step.acc[s][:i], total, *step.acc[s][i + 1:])
            jax.block_until_ready(total)
            with step.lock:
                step.tie_sums.append(TieSum(rank, t, ranks, own.nbytes, step.tie_started[rank] - step.t0,
                                            time.perf_counter() - step.t0))

def placed(tree: Any, device) -> Any:
    """``tree`` on ``device``, without a ``device_put`` when every leaf is already there."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    if all(isinstance(a, jax.Array) and a.committed and a.sharding == sharding
           for a in jax.tree_util.tree_leaves(tree)):
        return tree
    return jax.device_put(tree, device)


class Binding(NamedTuple):
    """What a (kind, stage)'s compute handler (:meth:`Compute.handler`) takes and makes: the key of what it
    takes from another stage (microbatch 0) or None, the kind of key it makes for another stage or None,
    and whether that stage is on its own rank (lowering's :class:`~zbpp_lite.schedules.program.Route`
    seen from the handler, with the batch and the seed as what stages -1 and S make)."""

    takes: Key | None
    makes: str | None
    here: bool


def bind(kind: str, stage: int, placement: Sequence[int]) -> Binding:
    """What an action of ``kind`` on ``stage`` takes from another stage: F the activation of stage s-1,
    B and BW the input gradient of stage s+1 (stage -1 and S: the batch and the seed), W nothing; and
    what it makes for one (:func:`~zbpp_lite.schedules.program.producer_stage`,
    :func:`~zbpp_lite.schedules.program.consumer_stage`)."""
    if kind == "W":
        return Binding(None, None, False)
    makes = "F" if kind == "F" else "B"
    takes = Key(makes, producer_stage(makes, stage), 0)
    consumer = consumer_stage(makes, stage)
    if not 0 <= consumer < len(placement):
        return Binding(takes, None, False)
    return Binding(takes, makes, placement[consumer] == placement[stage])


class RankUpdate(Protocol):
    """The optimizer the rank threads step (:meth:`PipelineExecutor.run_steps`), through the optimizer's
    instructions of the lowered program (:func:`~zbpp_lite.schedules.program.optimizer_instructions`;
    Qi et al., arXiv 2401.10241, section 4). In rank ``rank``'s thread, for step ``k`` of the call:

    - ``stage_params(stage)`` before the rank's first instruction of every step (and of a redone
      warm-up): the stage's parameters, a tuple of leaves on its device;
    - ``norm(rank, k, grads, got) -> {OptimizerMessage: value}`` at ``NORM``: what the rank's sends of
      the norm carry (``got``: the messages the rank made or received in this step so far);
    - ``step(rank, k, grads, got)`` at ``STEP``;
    - ``validate(rank, got)`` at ``VALIDATE`` (``got`` holds the full norm) and ``rollback(rank) ->
      bool`` at ``ROLLBACK``: True makes every rank redo its work since the step began.

    ``grads`` maps each of the rank's stages to its gradient sums (tuple of leaves on its device, float32
    for float32 and bfloat16 parameters: :func:`~zbpp_lite.runtime.split.sum_dtype`) of the global-batch
    mean loss, each tied copy holding its tie's whole gradient (:class:`TieSum`). ``policy`` (one of
    :data:`~zbpp_lite.schedules.program.POLICIES`) and ``speculative`` choose the instructions;
    ``begin(num_steps)``, if it has one, runs once before the threads start.
    """

    policy: str
    speculative: bool

    def stage_params(self, stage: int) -> tuple: ...

    def norm(self, rank: int, k: int, grads: dict, got: dict) -> dict: ...

    def step(self, rank: int, k: int, grads: dict, got: dict) -> None: ...

    def validate(self, rank: int, got: dict) -> None: ...

    def rollback(self, rank: int) -> bool: ...


def redo(step: Step, rank: int, stages: list) -> None:
    """Reset ``rank``'s share of ``step`` for a redo after a rollback (its events kept as ``discarded``,
    its later sends made as a new attempt, its stages' parameters the rolled-back ones)."""
    step.attempts[rank] = step.attempts.get(rank, 0) + 1
    step.out.update((k, v) for k, v in step.given.items() if consumer_stage(k.kind, k.stage) in stages)
    for key in [key for key in step.store if key[1] in stages]:
        step.release(rank, key)
    step.memory.settle(rank, time.perf_counter() - step.t0)
    with step.lock:
        step.discarded += [e for e in step.events if e.rank == rank]
        step.events[:] = [e for e in step.events if e.rank != rank]
    for s in stages:
        step.params[s] = step.update.stage_params(s)


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
