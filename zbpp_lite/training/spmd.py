"""Training with the SPMD executor (:class:`zbpp_lite.runtime.spmd.SpmdExecutor`): one compiled program
a step, then AdamW on every process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np

from ..runtime.spmd import SpmdExecutor
from ..runtime.stages import Params, StagedModel
from ..schedules.costs import Costs
from ..schedules.ir import Schedule
from ..schedules.simulate import simulate
from .model import RunConfig
from .train import StageAdamW, check_step, train_step


@dataclass
class SpmdTrainResult:
    """A :func:`train_spmd` run; fields as :class:`zbpp_lite.training.train.TrainResult`'s, plus
    ``lockstep``: :func:`zbpp_lite.simulate` with ``lockstep=True`` and unit costs (the program's ticks,
    in units of T_F); ``params`` as NumPy."""

    losses: list
    step_seconds: list
    grad_max_rel_error: float
    loss_error: float
    lockstep: Any
    params: Params

    def to_json(self, schedule: Schedule) -> dict:
        steps = [{"loss": loss, "seconds": s} for loss, s in zip(self.losses, self.step_seconds)]
        return {"executor": "spmd", "schedule": schedule.name or "custom", "ranks": schedule.num_ranks,
                "microbatches": schedule.num_microbatches, "steps": steps,
                "grad_max_rel_error": self.grad_max_rel_error, "loss_error": self.loss_error,
                "lockstep_ticks": self.lockstep.makespan}


def train_spmd(schedule: Schedule, model: StagedModel, params: Params, batches: Sequence[tuple[Any, Any]],
               lr: float, weight_decay: float = 0.01, devices: Sequence[Any] | None = None,
               on_step=None, overlap: bool = False) -> SpmdTrainResult:
    """Train any staged model with the SPMD executor: one program run a step, then
    :func:`zbpp_lite.training.train.train_step`'s AdamW on the replicated gradients on every process.
    ``devices`` may span processes (all call this alike); ``on_step(k, loss, seconds)``; ``overlap``:
    each tick sends what the tick before made beside its own switch (:class:`SpmdExecutor`'s).

    Raises:
        ValueError: as :class:`SpmdExecutor` (an unsupported placement, too few devices) and its
            ``run`` (stages passing on activations of different structures, a batch that does not
            divide into microbatches).
    """
    executor = SpmdExecutor(model, schedule, devices, overlap=overlap)
    home = jax.local_devices()[0]
    params = jax.device_put(params, home)
    adamw = StageAdamW(params, RunConfig(lr=lr, weight_decay=weight_decay))
    adamw.place(model, {s: home for s in range(model.num_stages)}).warm_up()
    losses, seconds = [], []
    grad_error = loss_error = float("nan")
    for k, (x, y) in enumerate(batches):
        result, sec, _ = train_step(executor, adamw, x, y)
        seconds.append(sec)
        if k == 0:
            grad_error, loss_error = check_step(model, params, x, y, result, home)
        losses.append(result.loss)
        if on_step is not None:
            on_step(k, result.loss, seconds[-1])
    lockstep = simulate(schedule, Costs(), lockstep=True, overlap=overlap)
    return SpmdTrainResult(losses, seconds, grad_error, loss_error, lockstep,
                           jax.tree_util.tree_map(np.asarray, adamw.params))
