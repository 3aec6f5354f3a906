"""The multi-device executor: run any valid Schedule for real, one thread per rank.

Each rank is a Python thread that walks its own action list in order (as on real hardware: no
global clock, no central scheduler). An action waits only for what it needs from other ranks,
found with :func:`zbpp_lite.schedule.deps`: F(s, j) the activation of stage s-1, B(s, j) / BW(s, j)
the input gradient of stage s+1; what a rank needs from itself (F's residuals for B, B's output
gradients for W) is there by the schedule's own order, which :func:`zbpp_lite.validate` checked.
Work goes through a kind -> handler table, and every stage's F, B, W, BW are the jitted pure
functions of :class:`zbpp_lite.split.StageSplit`, run on the rank's device. Outputs move to the
consumer's device with ``jax.device_put`` (asynchronous, like a send on real hardware) and wait in
the consumer rank's inbox. Gradients are summed over microbatches on each stage's device and
divided by m at the end, so with a per-microbatch mean loss the result is the gradient of the
global-batch mean loss (Qi et al., arXiv 2401.10241, section 2; PyTorch pipelining's convention).

Measurement: around each action, ``time.perf_counter()`` before the dispatch (after its inputs
have arrived) and after ``jax.block_until_ready`` of the action's outputs; the events form a
:class:`~zbpp_lite.timeline.Timeline` (source "measured", seconds since the step began) of the
type :func:`zbpp_lite.simulate` returns. What measuring costs: the two clock reads (well under a
microsecond) and the block, which stops a rank from dispatching its next action while the current
one runs, so the dispatch of every action is no longer hidden behind the previous one's compute:
on the 2-core CPU machine of ``benchmarks/bench_executor.py`` about 70-90 microseconds per action,
beside 5-35 microseconds of the executor's own bookkeeping (threads, inbox, events), for actions
of 5-20 milliseconds in that benchmark's pipeline. Nothing else is synchronised:
ranks never wait for each other except for their inputs. Compilation happens before the first
timed step (:meth:`PipelineExecutor.run`). Ranks are Python threads: XLA releases the GIL while
it computes, so ranks compute in parallel and only their dispatches take turns.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .costs import Costs
from .data import microbatch_size
from .devices import too_few_devices_message
from .model import Params, StagedModel
from .schedule import Action, Key, Schedule, deps, produces
from .timeline import Event, Timeline
from .validate import validate


@functools.lru_cache(maxsize=None)
def _zeros_on(device: Any) -> Callable:
    """Jitted ``tree -> zeros like tree`` whose outputs are committed to ``device`` (so every
    call of a stage's W sees the same placement and its executable is reused)."""
    fn = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)  # noqa: E731
    return jax.jit(fn, out_shardings=jax.sharding.SingleDeviceSharding(device))


_divide = jax.jit(lambda tree, m: jax.tree_util.tree_map(lambda g: g / m, tree))


@dataclass(frozen=True)
class StepResult:
    """One executed training step (before the optimizer).

    Attributes:
        loss: the global-batch mean loss, float (mean of the microbatch losses).
        microbatch_losses: the last stage's loss for each microbatch, floats.
        grads: gradient of ``loss`` for every parameter, one pytree per model module (as
            ``StagedModel.params``), float32, each on its stage's device.
        timeline: the measured :class:`~zbpp_lite.timeline.Timeline` (seconds, source "measured").
    """

    loss: float
    microbatch_losses: tuple[float, ...]
    grads: Params
    timeline: Timeline


class _Aborted(Exception):
    """Another rank failed; this one stops waiting."""


class _Inbox:
    """What other ranks sent to one rank, keyed like ``deps``: ("F", s, j) activation, ("B", s, j)
    input gradient."""

    def __init__(self, rank: int, abort: threading.Event):
        self.rank, self.abort = rank, abort
        self.items: dict[Key, Any] = {}
        self.cond = threading.Condition()

    def put(self, key: Key, value: Any) -> None:
        with self.cond:
            self.items[key] = value
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def take(self, key: Key, timeout: float, action: Action) -> Any:
        deadline = time.perf_counter() + timeout
        with self.cond:
            while key not in self.items:
                if self.abort.is_set():
                    raise _Aborted()
                left = deadline - time.perf_counter()
                if left <= 0:
                    kind, stage, j = key
                    raise TimeoutError(
                        f"rank {self.rank} waited {timeout:g} s before {action}: {kind} of stage {stage}, "
                        f"microbatch {j} never arrived"
                    )
                self.cond.wait(min(left, 0.5))
            return self.items.pop(key)


@dataclass
class _Step:
    """State of one step in flight, shared by the rank threads."""

    params: list  # per stage, on its device
    acc: list  # per stage gradient sums, on its device
    inputs: list  # per microbatch, on stage 0's device
    labels: list  # per microbatch, on the last stage's device
    seed: Any  # d loss / d loss = 1, on the last stage's device
    splits: list  # per stage StageSplit
    inboxes: list
    t0: float
    store: dict  # (stage, microbatch) -> what F / B kept
    losses: dict
    events: list


class PipelineExecutor:
    """Runs a schedule on a staged model, one thread per rank, one device per rank.

    Args:
        model: the :class:`~zbpp_lite.model.StagedModel`; its number of stages must be the
            schedule's.
        schedule: any valid schedule (validated here, before anything is computed).
        devices: one device per rank; default ``jax.devices()[:num_ranks]``.
        timeout: seconds a rank may wait for one input before the step fails (an error in any
            rank stops the others at once; the caller gets it).

    Raises:
        ScheduleError: an invalid schedule.
        ValueError: a model with a different number of stages, or fewer devices than ranks (the
            message says how to get simulated CPU devices).
    """

    def __init__(self, model: StagedModel, schedule: Schedule, devices: Sequence[Any] | None = None, timeout: float = 120.0):
        validate(schedule)
        if model.num_stages != schedule.num_stages:
            raise ValueError(
                f"the schedule has {schedule.num_stages} stages but the model is cut into {model.num_stages}; "
                f"build StagedModel(parts, num_stages={schedule.num_stages})"
            )
        if devices is None:
            devices = jax.devices()
            if len(devices) < schedule.num_ranks:
                raise ValueError(too_few_devices_message(schedule.num_ranks, len(devices)))
            devices = devices[: schedule.num_ranks]
        elif len(devices) != schedule.num_ranks:
            raise ValueError(f"give one device per rank: the schedule has {schedule.num_ranks} ranks, got {len(devices)} devices")
        self.model, self.schedule, self.timeout = model, schedule, timeout
        self.devices = list(devices)
        self.stage_devices = [self.devices[r] for r in schedule.placement]
        self._handlers: dict[str, Callable] = {
            "F": self._forward,
            "B": self._backward_input,
            "W": self._backward_weight,
            "BW": self._backward_fused,
        }
        self._prepared: dict = {}

    # ------------------------------------------------------------------ checks and set-up

    def microbatch_size(self, x: Any, labels: Any) -> int:
        """Samples per microbatch for a batch ``x`` (b, ...) with ``labels`` (b,).

        Raises:
            ValueError: inputs and labels of different lengths, or a batch that does not divide
                into the schedule's microbatches.
        """
        b = np.shape(x)[0]
        if np.shape(labels)[0] != b:
            raise ValueError(f"the batch has {b} inputs but {np.shape(labels)[0]} labels")
        return microbatch_size(b, self.schedule.num_microbatches)

    def _prepare(self, params: list, x_mb: Any, y_mb: Any) -> list:
        """Every stage's :class:`~zbpp_lite.split.StageSplit` for this microbatch shape. The first
        time a shape is seen, each stage's F, B, W, BW runs once, untimed, in dependency order, so
        the jitted functions are compiled for their devices before anything is timed."""
        signature = (np.shape(x_mb), str(x_mb.dtype), np.shape(y_mb), str(y_mb.dtype))
        if signature in self._prepared:
            return self._prepared[signature]
        S = self.model.num_stages
        shapes = self.model.stage_inputs(x_mb)
        splits = [self.model.split_stage(s, shapes[s], y_mb) for s in range(S)]
        kinds = {a.kind for _, a in self.schedule}
        x, res, kept = x_mb, [], []
        for s in range(S):
            out, r, k = splits[s].forward(params[s], x, y_mb if s == S - 1 else None)
            res.append(r)
            kept.append(k)
            x = jax.device_put(out, self.stage_devices[s + 1]) if s < S - 1 else None
        dy = jnp.ones((), jnp.float32)
        for s in reversed(range(S)):
            dy = jax.device_put(dy, self.stage_devices[s])
            acc = _zeros_on(self.stage_devices[s])(params[s])
            if "BW" in kinds:
                dx, _ = splits[s].backward_fused(params[s], res[s], kept[s], dy, acc)
            if "B" in kinds or "W" in kinds:
                dx, grads_out = splits[s].backward_input(res[s], dy)
                jax.block_until_ready(splits[s].backward_weight(params[s], kept[s], grads_out, acc))
            dy = dx
        jax.block_until_ready(dy)
        self._prepared[signature] = splits
        return splits

    # ------------------------------------------------------------------ the step

    def run(self, params: Params, x: Any, labels: Any) -> StepResult:
        """Run one step of the schedule: forward and backward of every microbatch, gradients
        accumulated; no optimizer update. The first step with a new batch shape first runs every
        stage function once, untimed (compilation).

        Args:
            params: one parameter pytree per model module (as ``StagedModel.params``); moved
                to the stages' devices (no copy when already there).
            x: the global batch (b, ...) float32; labels (b,) integers.

        Raises:
            ValueError: a batch that does not divide into microbatches (before any compute).
            TimeoutError: a rank waited longer than ``timeout`` for an input.
            RuntimeError: an action failed on some rank; the message names rank and action and
                the original error is chained.
        """
        S, m = self.model.num_stages, self.schedule.num_microbatches
        mb = self.microbatch_size(x, labels)
        x, labels = np.asarray(x), np.asarray(labels)
        stage_params = [jax.device_put(self.model.stage_params(params, s), self.stage_devices[s]) for s in range(S)]
        inputs = jax.device_put([x[j * mb : (j + 1) * mb] for j in range(m)], self.stage_devices[0])
        ys = jax.device_put([labels[j * mb : (j + 1) * mb] for j in range(m)], self.stage_devices[-1])
        splits = self._prepare(stage_params, inputs[0], ys[0])
        acc = [_zeros_on(self.stage_devices[s])(p) for s, p in enumerate(stage_params)]
        jax.block_until_ready((acc, inputs, ys))
        abort = threading.Event()
        step = _Step(
            params=stage_params, acc=acc, inputs=inputs, labels=ys, splits=splits,
            seed=jax.device_put(jnp.ones((), jnp.float32), self.stage_devices[-1]),
            inboxes=[_Inbox(r, abort) for r in range(self.schedule.num_ranks)],
            t0=0.0, store={}, losses={}, events=[],
        )
        errors: list[tuple[int, Action | None, BaseException]] = []
        threads = [
            threading.Thread(target=self._rank_loop, args=(r, step, abort, errors), name=f"zbpp-rank-{r}", daemon=True)
            for r in range(self.schedule.num_ranks)
        ]
        step.t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:  # every wait has its own timeout, so a stuck rank ends by itself
            t.join()
        self._raise_first(errors)
        losses = tuple(float(v) for v in jax.device_get([step.losses[j] for j in range(m)]))
        grads = [_divide(step.acc[s], np.float32(m)) for s in range(S)]
        timeline = Timeline.from_events(step.events, self.schedule.num_ranks, num_stages=S, source="measured")
        return StepResult(float(np.mean(np.asarray(losses, np.float64))), losses, self.model.join_stage_params(grads), timeline)

    @staticmethod
    def _raise_first(errors) -> None:
        failures = [e for e in errors if not isinstance(e[2], (_Aborted, TimeoutError))]
        if failures:
            rank, action, exc = failures[0]
            where = f"rank {rank}" + (f" at {action}" if action is not None else "")
            raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}") from exc
        timeouts = sorted((e for e in errors if isinstance(e[2], TimeoutError)), key=lambda e: e[0])
        if timeouts:
            raise TimeoutError("; ".join(str(e[2]) for e in timeouts)) from timeouts[0][2]

    def _rank_loop(self, rank: int, step: _Step, abort: threading.Event, errors: list) -> None:
        S = self.model.num_stages
        action = None
        try:
            for action in self.schedule.actions[rank]:
                received = [step.inboxes[rank].take(k, self.timeout, action) for k in deps(action, S) if k[1] != action.stage]
                start = time.perf_counter()
                ready, message = self._handlers[action.kind](step, action, *received)
                jax.block_until_ready(ready)
                end = time.perf_counter()
                step.events.append(Event(rank, action, start - step.t0, end - step.t0))
                if message is not None:
                    self._send(step, action, message)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, never swallowed
            errors.append((rank, action, exc))
            if not isinstance(exc, TimeoutError):  # a stuck rank lets the others report their own wait
                abort.set()
                for inbox in step.inboxes:
                    inbox.wake()

    def _send(self, step: _Step, action: Action, value: Any) -> None:
        """An F's activation goes to stage s+1, a B's (or BW's) input gradient to stage s-1."""
        consumer = action.stage + 1 if action.kind == "F" else action.stage - 1
        rank = self.schedule.placement[consumer]
        step.inboxes[rank].put(produces(action)[0], jax.device_put(value, self.stage_devices[consumer]))

    # ------------------------------------------------------------------ handlers: kind -> work
    # Each returns (what to wait for before the action counts as done, what to send or None).

    def _forward(self, step: _Step, a: Action, x: Any = None):
        s, j = a.stage, a.microbatch
        last = s == self.model.num_stages - 1
        y, res, kept = step.splits[s].forward(step.params[s], step.inputs[j] if s == 0 else x, step.labels[j] if last else None)
        step.store[s, j] = (res, kept)
        if last:
            step.losses[j] = y
        return (y, res, kept), None if last else y

    def _output_grad(self, step: _Step, a: Action, dy: Any) -> Any:
        return step.seed if a.stage == self.model.num_stages - 1 else dy

    def _backward_input(self, step: _Step, a: Action, dy: Any = None):
        s, j = a.stage, a.microbatch
        res, kept = step.store[s, j]
        dx, grads_out = step.splits[s].backward_input(res, self._output_grad(step, a, dy))
        step.store[s, j] = (kept, grads_out)
        return (dx, grads_out), dx

    def _backward_weight(self, step: _Step, a: Action):
        s = a.stage
        kept, grads_out = step.store.pop((s, a.microbatch))
        step.acc[s] = step.splits[s].backward_weight(step.params[s], kept, grads_out, step.acc[s])
        return step.acc[s], None

    def _backward_fused(self, step: _Step, a: Action, dy: Any = None):
        s = a.stage
        res, kept = step.store.pop((s, a.microbatch))
        dx, step.acc[s] = step.splits[s].backward_fused(step.params[s], res, kept, self._output_grad(step, a, dy), step.acc[s])
        return (dx, step.acc[s]), dx


def run_schedule(
    schedule: Schedule,
    model: StagedModel,
    x: Any,
    labels: Any,
    params: Params | None = None,
    devices: Sequence[Any] | None = None,
    timeout: float = 120.0,
) -> StepResult:
    """Run one step of ``schedule`` on ``model`` (one :meth:`PipelineExecutor.run`).

    ``params`` defaults to the model's own. See :class:`PipelineExecutor` for errors; for many
    steps keep one executor (its functions compile once).
    """
    executor = PipelineExecutor(model, schedule, devices, timeout)
    return executor.run(model.params if params is None else params, x, labels)


def measured_costs(timeline: Timeline, num_stages: int) -> Costs:
    """Mean measured action times per stage as :class:`~zbpp_lite.costs.Costs` (seconds).

    T_F, T_B, T_W are the mean durations of that stage's F, B, W events; where a stage ran only
    fused BW, T_B is the mean BW time and T_W = 0 (a BW costs T_B + T_W). T_comm = 0: transfers
    are asynchronous and not timed separately.

    Raises:
        ValueError: a stage with no F event, or none of B / BW.
    """
    durations: dict[tuple[str, int], list[float]] = {}
    for e in timeline.events:
        durations.setdefault((e.action.kind, e.action.stage), []).append(e.duration)

    def mean(kind: str, s: int) -> float | None:
        values = durations.get((kind, s))
        return float(np.mean(values)) if values else None

    f, b, w = [], [], []
    for s in range(num_stages):
        tf, tb, tw, tbw = mean("F", s), mean("B", s), mean("W", s), mean("BW", s)
        if tf is None or (tb is None and tbw is None):
            raise ValueError(f"the timeline has no F or no backward of stage {s}; cannot derive its costs")
        f.append(tf)
        if tb is not None:
            b.append(tb)
            w.append(tw if tw is not None else 0.0)
        else:
            b.append(tbw)
            w.append(0.0)
    return Costs(f=f, b=b, w=w)
