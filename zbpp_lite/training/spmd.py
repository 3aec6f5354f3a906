"""Training with the SPMD executor: one compiled program a step, then AdamW on every process.

Layer: training (the loop over :class:`zbpp_lite.runtime.spmd.SpmdExecutor`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np

from ..runtime.spmd import SpmdExecutor
from ..runtime.stages import Params, StagedModel
from ..schedules.costs import Costs
from ..schedules.ir import Schedule
from ..schedules.simulate import simulate
from .reference import jitted_adamw, max_relative_error, reference_grads


@dataclass
class SpmdTrainResult:
    """A training run of the compiled SPMD executor (:func:`train_spmd`).

    Attributes:
        losses: global-batch mean loss of every step (before its update), floats.
        step_seconds: wall time of every step, the update included (the first compiles).
        grad_max_rel_error, loss_error: the first step against ``jax.value_and_grad`` of the
            unpartitioned model (as :class:`zbpp_lite.training.train.TrainResult`'s).
        lockstep: :func:`zbpp_lite.simulate` with ``lockstep=True`` for the schedule with unit
            costs: the tick structure the program runs (what lockstep costs, in units of T_F).
        params: the trained parameters (one pytree per model module, NumPy).
    """

    losses: list
    step_seconds: list
    grad_max_rel_error: float
    loss_error: float
    lockstep: Any
    params: Params

    def to_json(self, schedule: Schedule) -> dict:
        return {"executor": "spmd", "schedule": schedule.name or "custom", "ranks": schedule.num_ranks,
                "microbatches": schedule.num_microbatches, "steps": [{"loss": l, "seconds": s} for l, s in zip(self.losses, self.step_seconds)],
                "grad_max_rel_error": self.grad_max_rel_error, "loss_error": self.loss_error,
                "lockstep_ticks": self.lockstep.makespan}


def train_spmd(schedule: Schedule, model: StagedModel, params: Params, batches: Sequence[tuple[Any, Any]], lr: float,
               weight_decay: float = 0.01, devices: Sequence[Any] | None = None, on_step=None) -> SpmdTrainResult:
    """Train any staged model the thread executor trains (its own stages, integer tokens
    included: :class:`zbpp_lite.runtime.spmd.SpmdExecutor`) with the compiled SPMD executor: each
    step one run of the program, then AdamW (PyTorch's defaults,
    :func:`zbpp_lite.training.reference.jitted_adamw`) on the replicated gradients, the same update
    on every process. ``devices`` may span processes (a multi-process mesh); every
    process must call this with the same arguments. ``on_step(k, loss, seconds)`` after every step.

    Raises:
        ValueError: as :class:`SpmdExecutor` (an unsupported placement, too few devices) and its
            ``run`` (stages passing on activations of different structures, a batch that does not
            divide into microbatches).
    """
    executor = SpmdExecutor(model, schedule, devices)
    opt, update = jitted_adamw(lr, weight_decay)
    home = jax.local_devices()[0]
    params = jax.device_put(params, home)
    state = opt.init(params)
    zeros = jax.device_put(jax.tree_util.tree_map(np.zeros_like, params), home)
    once = update(zeros, state, params)  # compile the update for the first step's inputs and the later steps' (its own outputs)
    jax.block_until_ready(update(zeros, once[1], once[0]))
    losses, seconds = [], []
    grad_error = loss_error = float("nan")
    for k, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        result = executor.run(params, x, y)
        new_params, state = update(jax.device_put(result.grads, home), state, params)
        jax.block_until_ready(new_params)
        seconds.append(time.perf_counter() - t0)
        if k == 0:
            ref_loss, ref_grads = reference_grads(model, params, x, y, home)
            grad_error = max_relative_error(result.grads, ref_grads)
            loss_error = abs(result.loss - ref_loss)
        params = new_params
        losses.append(result.loss)
        if on_step is not None:
            on_step(k, result.loss, seconds[-1])
    return SpmdTrainResult(losses, seconds, grad_error, loss_error, simulate(schedule, Costs(), lockstep=True),
                           jax.tree_util.tree_map(np.asarray, params))
