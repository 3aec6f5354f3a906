"""The optimizer step inside the rank threads: the :class:`RankUpdate` protocol the executor calls, the
:class:`Channel` its messages go through, and post-validation's speculative warm-up (:class:`Speculation`;
Qi et al., arXiv 2401.10241, section 4). Used by :mod:`zbpp_lite.runtime.executor`.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from .step import Step
from .transport import OptimizerMessage
from ..schedules.ir import parts
from ..schedules.program import consumer_stage


class Restart(Exception):
    """The previous step's optimizer step was rolled back: redo this step's instructions so far."""


class Channel:
    """An optimizer step's exchange with other ranks: ``send(to, key, value)``, ``take(key)`` (keys
    :class:`~zbpp_lite.runtime.transport.OptimizerMessage`, values host floats)."""

    def __init__(self, executor: Any, step: Step, rank: int):  # executor: the PipelineExecutor
        self._executor, self._step, self.rank = executor, step, rank

    def send(self, to: int, key: OptimizerMessage, value: Any) -> None:
        self._executor.transport.send(self._step.index, to, key, value)

    def take(self, key: OptimizerMessage, what: str = "the optimizer step") -> Any:
        return self._executor.wait_for(self._step, self.rank, key, what)


class RankUpdate(Protocol):
    """The optimizer step inside the rank threads (:meth:`PipelineExecutor.run_steps`).

    The executor calls, in rank ``rank``'s thread:

    - ``stage_params(stage)`` before the rank's first action of every step (and of a redone warm-up):
      the stage's parameters, a tuple of leaves on its device;
    - ``step(rank, k, grads, channel)`` after its last action of step ``k``: ``grads`` maps each stage to
      its gradient sums (tuple of leaves on its device, float32 for float32 and bfloat16 parameters:
      :func:`~zbpp_lite.runtime.split.sum_dtype`) of the global-batch mean loss, each tied copy
      holding its tie's whole gradient (:class:`TieSum`);
    - ``validate(rank, k, channel) -> bool`` once per step and after the last (paper section 4). Without
      ``verdict_key`` it runs before step ``k + 1``. With it (the deciding message's key) step ``k + 1``'s
      warm-up runs speculatively and ``validate`` runs when that message arrives, at the latest before
      the first backward; True (a rollback) makes every rank redo its share so far;
    - ``begin(num_steps)``, if it has one, once before the threads start. ``channel``: a :class:`Channel`.
    """

    def stage_params(self, stage: int) -> tuple: ...

    def step(self, rank: int, k: int, grads: dict, channel: Channel) -> None: ...

    def validate(self, rank: int, k: int, channel: Channel) -> bool: ...


class Speculation:
    """Post-validation's speculative warm-up (arXiv 2401.10241, section 4): rank ``rank`` runs step k + 1
    on step k's speculative parameters until ``update.verdict_key`` arrives or its first backward is due,
    then validates step k (:meth:`validate`); a rollback raises :class:`Restart`."""

    def __init__(self, executor: Any, rank: int, update: RankUpdate, k: int,
                 previous: Step):
        self.executor, self.rank, self.update, self.k, self.previous = executor, rank, update, k, previous

    def arrived(self) -> bool:
        return self.executor.transport.arrived(self.previous.index, self.rank, self.update.verdict_key)

    def due(self, entry) -> bool:
        return any(a.kind != "F" for a in parts(entry)) or self.arrived()

    def validate(self, step: Step) -> None:
        del step.speculating[self.rank]
        if self.update.validate(self.rank, self.k, Channel(self.executor, self.previous, self.rank)):
            raise Restart()


def redo(step: Step, rank: int, stages: list, update: RankUpdate) -> None:
    """Reset ``rank``'s share of ``step`` for a redo (events kept as ``discarded``)."""
    step.attempts[rank] = step.attempts.get(rank, 0) + 1
    step.out.update((k, v) for k, v in step.given.items() if consumer_stage(k.kind, k.stage) in stages)
    for key in [key for key in step.store if key[1] in stages]:
        step.release(rank, key)
    step.memory.settle(rank, time.perf_counter() - step.t0)
    with step.lock:
        step.discarded += [e for e in step.events if e.rank == rank]
        step.events[:] = [e for e in step.events if e.rank != rank]
    for s in stages:
        step.params[s] = update.stage_params(s)
