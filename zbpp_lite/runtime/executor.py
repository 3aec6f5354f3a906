"""The multi-device executor: run any valid Schedule for real, one thread per rank.

The schedule is lowered to its program (:func:`zbpp_lite.schedules.program.lower`): per rank, its compute
entries with the sends and receives written out. Each rank is a thread interpreting its instructions in
order (no global clock), the rank loop :meth:`PipelineExecutor._walk`: a compute entry runs the jitted F, B,
W or BW of :class:`zbpp_lite.runtime.split.StageSplit` on the rank's device and records the event and
memory; a ``Send`` hands a value to the :mod:`~zbpp_lite.runtime.transport`; a ``Recv`` waits for one. An
F&B pair (DualPipeV) runs its parts back to back, each its own event. With an optimizer
(:class:`~zbpp_lite.runtime.step.RankUpdate`) the program holds its instructions too
(:func:`~zbpp_lite.schedules.program.optimizer_instructions`), each calling the optimizer: post-validation's
rollback hands back the instructions to run again (arXiv 2401.10241 section 4). The last stage's backward
starts from d loss / d loss_j = 1/m, so the summed W's are the gradient of the global-batch mean loss
(Qi et al., arXiv 2401.10241, section 2).

Timing: ``time.perf_counter()`` around each action, after its inputs arrived and after
``jax.block_until_ready``, gives a measured :class:`~zbpp_lite.schedules.timeline.Timeline` (seconds since
the step began) with ``measured_memory`` (:mod:`zbpp_lite.runtime.memory`); compilation happens before.
Simulated CPU devices share XLA's thread pool; for one core per rank run one process per rank
(``ranks=[r], transport=...``: :func:`zbpp_lite.runtime.processes.connect`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from .devices import too_few_devices_message
from .memory import MemoryRecorder, NoMemoryRecorder, device_peak_bytes
from .memory import PlanMemoryWarning as PlanMemoryWarning  # run warns it (Compute.prepare): importable here
from .spmd import SpmdExecutor
from .stages import Params, StagedModel, batch_microbatch_size
from .step import Compute, RankUpdate, Step, StepResult, bind, placed, redo, waiters
from .transport import Aborted, Threads, Transfer, Transport
from ..schedules.ir import KINDS, Action, Key, Overlap, Schedule, parts
from ..schedules.program import (Optimize, OptimizerMessage, Recv, Send, consumer_stage, lower,
    validation_slice)
from ..schedules.timeline import Event
from ..schedules.validate import validate


class _Failed(Exception):
    """An instruction of a rank's program failed: ``args[0]`` the instruction, ``__cause__`` why."""


class PipelineExecutor:
    """Runs a schedule on a staged model, one thread per rank, one device per rank: each rank interprets
    its instructions of the schedule's lowered program (:func:`zbpp_lite.schedules.program.lower`).

    Args:
        model: the :class:`~zbpp_lite.runtime.stages.StagedModel`, cut into the schedule's stages.
        schedule: any valid schedule (validated here, before anything is computed).
        devices: one per rank in ``ranks`` (or per schedule rank); default ``jax.devices()[:len(ranks)]``.
        timeout: seconds a rank may wait for one input before the step fails.
        ranks: the ranks run here (default all); with some only, ``transport`` reaches the others.
        transport: the :class:`~zbpp_lite.runtime.transport.Transport` carrying values between ranks
            (default :class:`~zbpp_lite.runtime.transport.Threads`: every rank here); one per executor.
        record_memory: fill each step's ``timeline.measured_memory`` (else None).

    Attributes:
        ranks: the ranks run here; ``local_stages``: theirs; ``stage_devices[s]``: device or None;
        ``program``: the lowered program.

    Raises:
        ScheduleError: an invalid schedule.
        ValueError: a model with another stage count, fewer devices than ranks, an unknown rank, or some
            ranks without a transport.
    """

    def __init__(self, model: StagedModel, schedule: Schedule, devices: Sequence[Any] | None = None,
                 timeout: float = 120.0, *, ranks: Sequence[int] | None = None,
                 transport: Transport | None = None, record_memory: bool = True):
        validate(schedule)
        if model.num_stages != schedule.num_stages:
            raise ValueError(f"the schedule has {schedule.num_stages} stages but the model is cut into "
                             f"{model.num_stages}; build StagedModel(parts, "
                             f"num_stages={schedule.num_stages})")
        ranks = tuple(range(schedule.num_ranks)) if ranks is None else tuple(ranks)
        if not ranks or not set(ranks) <= set(range(schedule.num_ranks)) or len(set(ranks)) < len(ranks):
            raise ValueError(f"ranks must be distinct ranks of the schedule (0..{schedule.num_ranks - 1}), "
                             f"got {list(ranks)}")
        if len(ranks) < schedule.num_ranks and transport is None:
            raise ValueError(f"running ranks {list(ranks)} of {schedule.num_ranks} needs transport= to reach "
                             "the others (e.g. processes.connect's)")
        self.devices = None if devices is None else list(devices)  # as given
        if devices is not None and len(devices) == schedule.num_ranks > len(ranks):  # every rank's: ours
            devices = [devices[r] for r in ranks]
        if devices is None:
            devices = jax.devices()
            if len(devices) < len(ranks):
                raise ValueError(too_few_devices_message(len(ranks), len(devices)))
            devices = self.devices = devices[: len(ranks)]
        elif len(devices) != len(ranks):
            raise ValueError(f"give one device per rank: {len(ranks)} ranks to run, got {len(devices)} "
                             "devices")
        self.model, self.schedule, self.timeout = model, schedule, timeout
        self.compute = Compute(model, schedule.placement)  # the compute handlers and their spares
        self.ranks, self.program = ranks, lower(schedule, ties=self.compute.tie_ranks)
        self.transport: Transport = Threads() if transport is None else transport
        self.record_memory = record_memory
        self._on = on = dict(zip(ranks, devices))
        self.stage_devices = [on.get(r) for r in schedule.placement]  # None: a stage run elsewhere
        self.local_stages = [s for s, r in enumerate(schedule.placement) if r in on]
        self._steps_begun = 0  # steps numbered so far: the transport's step numbers
        self._bindings = {(kind, s): bind(kind, s, schedule.placement)
                          for kind in KINDS for s in range(schedule.num_stages)}
        self._run = {Action: self._entry, Overlap: self._entry, Send: self._send, Recv: self._recv,
                     Optimize: self._optimize}
        self._lowered = {None: self.program}  # (policy, speculative) -> the program with its instructions
        self._waiters = waiters(self.program)  # Recv -> the entry that waits for it, named in timeouts

    @property
    def input_shapes(self) -> list:
        """Per stage, its input's shapes and dtypes (what B sends back too), once a shape was compiled."""
        return self.compute.input_shapes

    def run(self, params: Params, x: Any, labels: Any, keys: Any = None,
            update: "RankUpdate | None" = None) -> StepResult:
        """One step: forward and backward of every microbatch, gradients summed; ``update`` (a
        :class:`RankUpdate`, or None: no update) steps the optimizer in the rank threads.

        Args:
            params: one pytree per model module (as ``StagedModel.params``); moved to the stages' devices.
            x: the global batch (b, ...) float32; labels (b,) integers.
            keys: the step's :func:`~zbpp_lite.runtime.stages.dropout_keys` (m, 2) for a model with dropout.

        Raises:
            ValueError: a batch that does not divide into microbatches, a model with dropout given no keys
                (:meth:`~zbpp_lite.runtime.stages.StagedModel.step_keys`); before any compute.
            TimeoutError: a rank waited longer than ``timeout`` for an input.
            RuntimeError: an action failed (names rank and action; the error is chained).
        """
        return self.run_steps(params, [(x, labels)], update, None if keys is None else [keys])[0]

    def run_steps(self, params: Params, batches: Sequence[tuple[Any, Any]],
                  update: "RankUpdate | None" = None, keys: Sequence[Any] | None = None) -> list[StepResult]:
        """Several steps back to back, no barrier between them (each rank goes on when its share is done).

        Args:
            params: as :meth:`run`'s (only the shapes with ``update``).
            batches: one ``(x, labels)`` per step, as :meth:`run`'s, all of one shape; every process of
                a multi-process run passes the same.
            update: a :class:`RankUpdate` (e.g. :class:`zbpp_lite.training.postval.optimizer.StageOptimizer`)
                stepping the optimizer in the rank threads through its instructions in the program, or
                None (every step uses ``params``).
            keys: one :func:`~zbpp_lite.runtime.stages.dropout_keys` per batch, for a model with dropout;
                every process of a multi-process run passes the same (each process puts its own stages').

        Returns:
            One :class:`StepResult` per step.

        Raises:
            ValueError: no batches or batches of different shapes. Otherwise as :meth:`run`.
        """
        if not batches:
            raise ValueError("run_steps needs at least one (x, labels) batch")
        shapes = {(np.shape(x), np.shape(y)) for x, y in batches}
        if len(shapes) > 1:
            raise ValueError(f"every batch of run_steps must have one shape, got {sorted(shapes)}")
        S, m = self.model.num_stages, self.schedule.num_microbatches
        x0, y0 = batches[0]
        mb = batch_microbatch_size(x0, y0, m)
        local = self.local_stages
        stage_params = [placed(self.model.stage_params(params, s), self.stage_devices[s])
                        if s in local else None for s in range(S)]
        leaves = [None if p is None else tuple(jax.tree_util.tree_leaves(p)) for p in stage_params]
        first, last = self.stage_devices[0], self.stage_devices[-1]
        keys = self.model.step_keys(keys, len(batches), m)
        splits = self.compute.prepare(self.schedule, self.stage_devices, leaves, np.asarray(x0)[:mb],
                                      np.asarray(y0)[:mb], None if keys[0] is None else keys[0][0])
        self.compute.fit_spares((np.shape(x0), np.shape(y0)))
        seed = jax.device_put(np.float32(1.0 / m), last) if last else None
        base, steps = self._steps_begun, []
        remote = len(self.ranks) < self.schedule.num_ranks
        hint = " (every process must call run_steps with the same number of batches)" if remote else ""
        self._steps_begun += len(batches)
        record = MemoryRecorder if self.record_memory else lambda p, S: NoMemoryRecorder()
        program = self._program_for(update)
        for k, ((x, labels), step_keys) in enumerate(zip(batches, keys)):
            x, labels = np.asarray(x), np.asarray(labels)
            out = {}  # stage 0's inputs as what stage -1 sent, the last stage's seed as what stage S sent
            if first:
                out.update((Key("F", -1, j), a) for j, a in enumerate(
                    jax.device_put([x[j * mb : (j + 1) * mb] for j in range(m)], first)))
            if last:
                out.update((Key("B", S, j), seed) for j in range(m))
            ys = jax.device_put([labels[j * mb : (j + 1) * mb] for j in range(m)], last) if last else None
            steps.append(Step(
                params=list(leaves), acc=[None] * S, splits=splits, out=out, given=dict(out), store={},
                losses={}, events=[], transport=self.transport, timeout=self.timeout,
                labels=ys,
                index=base + k, memory=record(self.schedule.num_ranks, S),
                where=(f" of step {k} (number {base + k} of this executor){hint}" if remote
                       else f" of step {k}" if len(batches) > 1 else ""),
                keys={} if step_keys is None else {s: jax.device_put(list(step_keys), self.stage_devices[s])
                                                   for s in local},
                program=program, update=update, number=k, previous=steps[-1] if steps else None,
            ))
        jax.block_until_ready((leaves, [(st.out, st.labels) for st in steps]))
        if update is not None and hasattr(update, "begin"):
            update.begin(len(steps))
        self._run_ranks(steps)
        peaks = tuple(device_peak_bytes(self._on[r]) if r in self._on else None
                      for r in range(self.schedule.num_ranks))
        return self.transport.finish([st.result(self.model, self.schedule.num_ranks, stage_params, peaks)
                                      for st in steps])

    def _program_for(self, update: "RankUpdate | None") -> Any:
        """The lowered program with ``update``'s optimizer instructions (lowered once per policy)."""
        how = None if update is None else (update.policy, update.speculative)
        if how not in self._lowered:
            self._lowered[how] = lower(self.schedule, *how, ties=self.compute.tie_ranks)
            self._waiters.update(waiters(self._lowered[how]))
        return self._lowered[how]

    def _run_ranks(self, steps: list) -> None:
        """One thread per local rank over ``steps``; raises the first error."""
        errors: list[tuple[int, Any, BaseException]] = []
        threads = [threading.Thread(target=self._rank_steps, args=(r, steps, errors),
                                    name=f"zbpp-rank-{r}", daemon=True) for r in self.ranks]
        movers = self.transport.start([st.index for st in steps])
        t0 = time.perf_counter()
        for st in steps:
            st.t0 = t0
        try:
            for t in threads + movers:
                t.start()
            for t in threads:  # every wait has its own timeout, so a stuck rank ends by itself
                t.join()
            deadline = time.perf_counter() + self.timeout
            for t in movers:
                t.join(max(0.0, deadline - time.perf_counter()))
        except BaseException:  # Ctrl-C or a signal here: every rank stops at its next wait, then it goes on
            self.transport.abort()
            deadline = time.perf_counter() + self.timeout
            for t in threads + movers:
                if t.ident is not None:  # started before the signal came
                    t.join(max(0.0, deadline - time.perf_counter()))
            raise
        stuck = [t.name for t in movers if t.is_alive()]
        if stuck and not errors:
            errors.append((self.ranks[0], None, TimeoutError(
                f"transfers {', '.join(stuck)} did not finish within {self.timeout:g} s")))
        if errors:
            self.compute.drop_spares()
        try:
            self._raise_first(errors)
        except (RuntimeError, TimeoutError) as e:
            if not self.transport.where:
                raise
            raise type(e)(f"{self.transport.where}{e}") from e

    @staticmethod
    def _raise_first(errors) -> None:
        failures = [e for e in errors if not isinstance(e[2], (Aborted, TimeoutError))]
        if failures:
            rank, instruction, exc = failures[0]
            where = f"rank {rank}" + (f" at {instruction.text}" if instruction is not None else "")
            raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}") from exc
        timeouts = sorted((e for e in errors if isinstance(e[2], TimeoutError)), key=lambda e: e[0])
        if timeouts:
            raise TimeoutError("; ".join(str(e[2]) for e in timeouts)) from timeouts[0][2]

    def _rank_steps(self, rank: int, steps: list, errors: list) -> None:
        """Rank ``rank``'s thread: :meth:`_walk` each step's instructions (the first step validating none
        before it; the last step validated after it)."""
        stages = list(self.schedule.stages_of(rank))
        try:
            for step in steps:
                for s in stages if step.update is not None else ():
                    step.params[s] = step.update.stage_params(s)
                row = step.program.instructions[rank]
                head = validation_slice(row)  # none before the first step: what it checks ran in no step
                self._walk(rank, step, row if step.previous else row[:head.start] + row[head.stop:])
                if head.stop and step is steps[-1]:  # its own check: its full norm came in it, no redo
                    closing = [dataclasses.replace(x, earlier=0) if type(x) is Recv else x for x in row[head]]
                    self._walk(rank, dataclasses.replace(step, previous=None), closing)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, never swallowed
            failed = isinstance(exc, _Failed)
            errors.append((rank, exc.args[0] if failed else None, exc.__cause__ if failed else exc))
            if not isinstance(errors[-1][2], TimeoutError):  # a stuck rank lets the others report their wait
                self.transport.abort()

    def _walk(self, rank: int, step: Step, row: Sequence) -> None:
        """The rank loop: each instruction of ``row``, in order, runs its handler (a compute entry
        :meth:`_entry`, a send :meth:`_send`, a receive :meth:`_recv`, an optimizer's :meth:`_optimize`);
        a handler may hand back instructions to run next (a rollback's redo)."""
        todo = list(reversed(row))
        while todo:
            instruction = todo.pop()
            try:
                again = self._run[type(instruction)](step, rank, instruction)
            except BaseException as exc:
                raise _Failed(instruction) from exc
            todo += reversed(again or ())

    def _entry(self, step: Step, rank: int, entry: Action | Overlap) -> None:
        """A compute entry: each part's handler on the inputs it takes, timed, its output kept for a send
        or for the next stage here."""
        for a in parts(entry):
            takes, makes, here = self._bindings[a.kind, a.stage]
            handler = self.compute.handler(a.kind)
            start = time.perf_counter()
            if takes is None:
                ready, out = handler(step, a)
            else:
                key = Key(takes.kind, takes.stage, a.microbatch)
                step.memory.free(rank, key)  # consumed by this action
                ready, out = handler(step, a, step.out.pop(key))
            jax.block_until_ready(ready)
            end = time.perf_counter()
            step.memory.settle(rank, end - step.t0)
            with step.lock:
                step.events.append(Event(rank, a, start - step.t0, end - step.t0))
            if makes is not None:
                made = Key(makes, a.stage, a.microbatch)
                step.out[made] = out
                if here:  # the next stage is this rank's: counted as received, as a transfer would be
                    step.memory.receive(rank, made, out, end - step.t0)

    def _optimize(self, step: Step, rank: int, x: Optimize) -> Sequence | None:
        """An optimizer instruction: the update's method of its name, on the messages the rank made or
        received in this step (VALIDATE: and in the previous one); a ROLLBACK that makes every rank redo
        hands back the rank's instructions before the validation, run again on the rolled-back
        parameters."""
        update, got = step.update, step.messages.setdefault(rank, {})
        if x.op == "TIE":
            got.update(self.compute.tie_shares(step, rank))
        elif x.op == "TIE_TOTAL":
            self.compute.tie_totals(step, rank, got)
        elif x.op in ("NORM", "STEP"):
            grads = {s: step.acc[s] for s in self.schedule.stages_of(rank)}
            if x.op == "NORM":
                got.update(update.norm(rank, step.number, grads, got))
            else:
                update.step(rank, step.number, grads, got)
        elif x.op == "VALIDATE":
            update.validate(rank, {**(step.previous.messages.get(rank, {}) if step.previous else {}), **got})
        elif update.rollback(rank) and step.previous is not None:
            redo(step, rank, list(self.schedule.stages_of(rank)))
            row = step.program.instructions[rank]
            return row[:validation_slice(row).start]
        return None

    def _send(self, step: Step, rank: int, send: Send) -> None:
        """Hand the value to the transport: onto the receiver's device if it is a rank here (counted as
        received), as its leaves (a pytree) if not; an optimizer's message as it is."""
        if type(send.key) is OptimizerMessage:
            self.transport.send(step.index, send.peer, send.key, step.messages[rank][send.key])
            return
        value = step.out.pop(send.key)
        device = self._on.get(send.peer)
        if device is None:
            value = value if isinstance(value, jax.Array) else list(jax.tree_util.tree_leaves(value))
        else:
            value = jax.device_put(value, device)
            step.memory.receive(send.peer, send.key, value, time.perf_counter() - step.t0)
        self.transport.send(step.index, send.peer, Transfer(*send.key, step.attempts.get(rank, 0)), value)

    def _recv(self, step: Step, rank: int, recv: Recv) -> None:
        """Wait for the value, for the entry after; from another process, onto this rank's device. An
        optimizer's message (maybe the previous step's) joins the rank's messages of this step."""
        if type(recv.key) is OptimizerMessage:
            value = step.wait_for(rank, recv.key, self._waiters.get(recv, "VALIDATE"), recv.earlier)
            step.messages.setdefault(rank, {})[recv.key] = value
            return
        key = Transfer(*recv.key, step.attempts.get(rank, 0))
        value = step.wait_for(rank, key, self._waiters[recv])
        if recv.peer not in self._on:
            stage = consumer_stage(*recv.key[:2])
            if isinstance(value, list):  # a pytree's leaves: B's gradient has its stage's input's shape
                tree = self.compute.input_shapes[stage if recv.key.kind == "F" else recv.key.stage]
                value = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), value)
            value = placed(value, self.stage_devices[stage])
            step.memory.receive(rank, recv.key, value, time.perf_counter() - step.t0)
        step.out[recv.key] = value


def run_schedule(schedule: Schedule, model: StagedModel, x: Any, labels: Any, params: Params | None = None,
                 devices: Sequence[Any] | None = None, timeout: float = 120.0, executor: str = "threads"):
    """One step of ``schedule`` on ``model`` (``params`` default: the model's): ``executor="threads"``
    gives a :class:`StepResult`, ``"spmd"`` an :class:`~zbpp_lite.runtime.spmd.SpmdResult`. For many steps
    keep one executor (it compiles once); a model with dropout runs through the executors' ``run(...,
    keys)`` (ValueError here, naming them).

    Raises:
        ValueError: another ``executor``; otherwise as the executor's."""
    params = model.params if params is None else params
    if executor == "spmd":
        return SpmdExecutor(model, schedule, devices).run(params, x, labels)
    if executor != "threads":
        raise ValueError(f"executor must be 'threads' or 'spmd', got {executor!r}")
    return PipelineExecutor(model, schedule, devices, timeout).run(params, x, labels)
