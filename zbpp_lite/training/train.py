"""Train the digits Transformer with any schedule on several devices, and measure it.

:func:`train` is what ``python -m zbpp_lite train`` and the notebooks call: it builds the
schedule, cuts the model into its stages, runs every step with the executor (gradients
accumulated over microbatches, then AdamW per stage on that stage's device, as PyTorch's
pipelining does), checks the first step's loss and gradients against the unpartitioned model, and
compares the measured timeline with the simulator's for the measured mean action costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
from tqdm.auto import tqdm

from ..analysis.profiling.timelines import measured_costs, timed_steps
from ..runtime.devices import ensure_devices
from ..runtime.executor import PipelineExecutor
from ..runtime.stages import StagedModel, microbatch_size, stage_parts
from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.ir import Schedule
from ..schedules.simulate import simulate
from ..schedules.timeline import Timeline
from ..schedules.validate import validate
from .data import Digits, load_digits
from .model import ModelConfig, RunConfig, build_parts, load_torch_init
from .postval.optimizer import StageOptimizer
from .postval import rollback
from .reference import evaluate, jitted_adamw, max_relative_error, reference_grads


@dataclass
class TrainResult:
    """What one training run did and measured.

    Attributes:
        schedule: the schedule that ran.
        losses: global-batch mean training loss of every step, computed in that step (before
            its update), floats.
        test_accuracy, test_loss: the trained model on the test samples.
        grad_max_rel_error: first step, the largest over parameters of
            max|g - g_ref| / max|g_ref|, g_ref from ``jax.value_and_grad`` of the unpartitioned
            model on the whole batch (``None`` when the check was off).
        loss_error: first step, |loss - loss_ref| (``None`` when the check was off).
        measured: the measured timeline of the step with the median makespan (steps after the
            first when there are several).
        costs: mean action times of that step (seconds), :func:`zbpp_lite.analysis.profiling.timelines.measured_costs`.
        simulated: :func:`zbpp_lite.simulate` of the schedule with those costs.
        timelines: every step's measured timeline.
        step_seconds: wall time of every step (the first includes compilation).
        params: the trained parameters (one pytree per model module).
        config: the settings of the run (model sizes, batch, learning rate, ...).
    """

    schedule: Schedule
    losses: list[float]
    test_accuracy: float
    test_loss: float
    grad_max_rel_error: float | None
    loss_error: float | None
    measured: Timeline
    costs: Costs
    simulated: Timeline
    timelines: list[Timeline] = field(repr=False)
    step_seconds: list[float] = field(repr=False)
    params: Any = field(repr=False)
    config: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """A JSON-ready dict: schedule, ranks, microbatches, steps (each with ``loss``),
        test_accuracy, grad_max_rel_error, measured and simulated (``makespan`` in seconds,
        ``bubble_rate``), memory (the measured step's activation bytes per rank beside the
        plan's, see :meth:`_memory_json`), trace (the measured events), plus costs and config."""
        s = self.schedule
        return {
            "schedule": s.name or "custom",
            "ranks": s.num_ranks,
            "stages": s.num_stages,
            "microbatches": s.num_microbatches,
            "steps": [{"loss": loss, "makespan": t.makespan, "bubble_rate": t.bubble_rate, "seconds": sec}
                      for loss, t, sec in zip(self.losses, self.timelines, self.step_seconds)],
            "test_accuracy": self.test_accuracy,
            "test_loss": self.test_loss,
            "grad_max_rel_error": self.grad_max_rel_error,
            "loss_error": self.loss_error,
            "measured": {"makespan": self.measured.makespan, "bubble_rate": self.measured.bubble_rate},
            "simulated": {"makespan": self.simulated.makespan, "bubble_rate": self.simulated.bubble_rate},
            "memory": self._memory_json(),
            "costs": {"f": list(self.costs.f), "b": list(self.costs.b), "w": list(self.costs.w)},
            "trace": [
                {"rank": e.rank, "action": str(e.action), "kind": e.action.kind, "stage": e.action.stage,
                 "microbatch": e.action.microbatch, "start": e.start, "end": e.end}
                for e in self.measured.events
            ],
            "config": self.config,
        }


    def _memory_json(self) -> dict | None:
        """The measured step's activation memory (:meth:`MeasuredMemory.to_json`, bytes) with
        the plan's peak per rank in bytes (its model with the measured M_B and M_W) and the
        measured peak in units of one stage-microbatch's activations (M_B of the rank's first
        stage), or None when the run measured none (SPMD)."""
        memory = self.measured.measured_memory
        if memory is None:
            return None
        first = [self.schedule.stages_of(r)[0] for r in range(self.schedule.num_ranks)]
        return {**memory.to_json(), "planned_peak_bytes": list(self.measured.planned_peak_bytes),
                "peak_units": list(memory.peak_units(first))}


def _pick_measured(timelines: list[Timeline]) -> Timeline:
    timed = timed_steps(timelines)
    return sorted(timed, key=lambda t: t.makespan)[len(timed) // 2]


@dataclass
class _Run:
    """What the step loops fill in."""

    losses: list = field(default_factory=list)
    timelines: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    grad_error: float | None = None
    loss_error: float | None = None
    extra: dict = field(default_factory=dict)


def train(
    schedule: str | Schedule = "zb-h1",
    ranks: int = 2,
    microbatches: int = 4,
    steps: int = 20,
    *,
    model: ModelConfig | None = None,
    run: RunConfig | None = None,
    schedule_options: dict | None = None,
    devices: Sequence[Any] | None = None,
    data: Digits | None = None,
    on_step: Callable[[int, float, Timeline], None] | None = None,
) -> TrainResult:
    """Train the digits Transformer with one schedule and measure it.

    Args:
        schedule: a registered name (``zb.SCHEDULES``) or a :class:`~zbpp_lite.schedules.ir.Schedule`
            (e.g. read from CSV; its ranks and microbatches then override ``ranks`` and
            ``microbatches``).
        ranks, microbatches: p and m.
        steps: training steps (optimizer updates).
        model: the model's sizes and init seed (:class:`~zbpp_lite.training.model.ModelConfig`;
            ``blocks`` >= stages).
        run: batch, optimizer, data split, gradient check, clipping (:class:`RunConfig`).
        schedule_options: keyword options for the builder (e.g. ``stages_per_rank``).
        devices: one device per rank; default :func:`zbpp_lite.runtime.devices.ensure_devices` (real
            accelerators if enough, else simulated CPU devices).
        data: the digits split to use (default ``load_digits(run.holdout, run.seed)``).
        on_step: called after every step with (step index, loss, measured timeline).

    Raises:
        ValueError: an unknown or invalid schedule, fewer blocks than stages, a batch that does
            not divide into microbatches, bad sizes; all before any compute.
        RuntimeError: too few devices (the message says how to get simulated ones), or a rank's
            action failed.
    """
    config, run = model or ModelConfig(), run or RunConfig()
    sched = _checked_schedule(schedule, ranks, microbatches, steps, config, run, schedule_options)
    devices = devices if devices is not None else ensure_devices(sched.num_ranks)
    executor = PipelineExecutor(StagedModel(build_parts(config), sched.num_stages), sched, devices)
    return train_steps(executor, steps, config, run, data=data, on_step=on_step)


def train_steps(executor, steps: int, config: ModelConfig, run: RunConfig, *, home: Any = None,
                data: Digits | None = None, on_step: Callable[[int, float, Timeline], None] | None = None) -> TrainResult:
    """The step loop every pipeline run of this process goes through, whatever carries the
    values between its ranks (``executor``: the thread executor, or
    :func:`~zbpp_lite.runtime.distributed.process_executor` over JAX's distributed
    runtime): ``steps`` executor steps from ``config``'s initial parameters (or ``run.init``) on
    batches 0, 1, ..., AdamW per stage (or, with ``run.max_grad_norm``, inside the rank threads),
    then the first step checked against the one reference, the trained model evaluated, the
    median step's measured costs simulated. ``home``: one device holding every stage's parameters
    and optimizer state (default: each stage's own device). Returns :class:`TrainResult`.
    """
    staged, sched = executor.model, executor.schedule
    data = data if data is not None else load_digits(run.holdout, run.seed)
    params = load_torch_init(run.init, config) if run.init is not None else staged.params
    homes = [home] * sched.num_stages if home is not None else list(executor.stage_devices)
    batches = [data.batch(k, run.batch) for k in range(steps)]
    if run.max_grad_norm is not None:
        out, stage_params = _guarded_steps(executor, params, batches, run, on_step)
    else:
        out, stage_params = _plain_steps(executor, params, batches, run, on_step, homes)
    first_grads = out.extra.pop("first_grads", None)
    if run.check_grads:  # the first step against the unpartitioned model on the whole batch
        ref_loss, ref_grads = reference_grads(staged, params, *batches[0], homes[0])
        out.grad_error = max_relative_error(first_grads, ref_grads)
        out.loss_error = abs(out.losses[0] - ref_loss)
    final = staged.join_stage_params(stage_params)
    test_loss, test_accuracy = evaluate(staged, final, data.test_x, data.test_y, homes[0])
    measured = _pick_measured(out.timelines)
    costs = measured_costs(measured, sched.num_stages)
    return TrainResult(
        schedule=sched, losses=out.losses, test_accuracy=test_accuracy, test_loss=test_loss,
        grad_max_rel_error=out.grad_error, loss_error=out.loss_error, measured=measured, costs=costs,
        simulated=simulate(sched, costs), timelines=out.timelines, step_seconds=out.seconds, params=final,
        config={**settings_json(config, run), "devices": [str(dev) for dev in executor.devices], **out.extra},
    )


def settings_json(config: ModelConfig, run: RunConfig) -> dict:
    """The model's and the run's settings as ``TrainResult.config`` records them (JSON-ready)."""
    return {"d": config.d, "heads": config.heads, "blocks": config.blocks, "batch": run.batch, "lr": run.lr,
            "weight_decay": run.weight_decay, "seed": run.seed, "holdout": run.holdout,
            "init": None if run.init is None else str(run.init)}


def _checked_schedule(schedule, ranks, microbatches, steps, config: ModelConfig, run: RunConfig,
                      schedule_options: dict | None) -> Schedule:
    """The schedule to run, once everything that can be wrong with the request has been checked
    (before JAX computes anything)."""
    sched = schedule if isinstance(schedule, Schedule) else build_schedule(schedule, ranks, microbatches, **(schedule_options or {}))
    validate(sched)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    microbatch_size(run.batch, sched.num_microbatches)
    stage_parts(config.blocks, sched.num_stages)  # raises for fewer blocks than stages
    return sched


class StageAdamW:
    """AdamW per stage, each stage's parameters and state on its own device: the update after
    every step of every loop (``train``'s, and each rank process's in ``train_in_turns``).

    ``homes``: ``{stage: device}`` for the stages this process updates.
    """

    def __init__(self, model: StagedModel, params: list, homes: dict, run: RunConfig):
        opt, self._update = jitted_adamw(run.lr, run.weight_decay)
        self.model, self.homes = model, dict(homes)
        self.params = {s: jax.device_put(model.stage_params(params, s), d) for s, d in self.homes.items()}
        self.state = {s: jax.device_put(opt.init(p), d) for (s, d), p in zip(self.homes.items(), self.params.values())}

    def step(self, grads: list) -> None:
        """One update from ``grads`` (one pytree per model module), wherever the executor left them."""
        for s, d in self.homes.items():
            g = jax.device_put(self.model.stage_params(grads, s), d)
            self.params[s], self.state[s] = self._update(g, self.state[s], self.params[s])
        jax.block_until_ready(self.params)

    def warm_up(self) -> None:
        """Compile the update for the first step's inputs and for its own outputs, changing nothing."""
        for s, p in self.params.items():
            zeros = jax.tree_util.tree_map(jax.numpy.zeros_like, p)
            once = self._update(zeros, self.state[s], p)
            jax.block_until_ready(self._update(zeros, once[1], once[0]))


def _plain_steps(executor, params, batches, run: RunConfig, on_step, homes: list) -> tuple[_Run, list]:
    """One executor step at a time, then AdamW per stage on ``homes[stage]``."""
    model, sched = executor.model, executor.schedule
    adamw = StageAdamW(model, params, dict(enumerate(homes)), run)
    out = _Run()
    steps_iter: Any = range(len(batches))
    if run.progress:
        steps_iter = tqdm(steps_iter, desc=f"{sched.name or 'schedule'} p={sched.num_ranks} m={sched.num_microbatches}", leave=False)
    for k in steps_iter:
        t0 = time.perf_counter()
        result = executor.run(model.join_stage_params(list(adamw.params.values())), *batches[k])
        adamw.step(result.grads)
        out.seconds.append(time.perf_counter() - t0)
        if k == 0:
            out.extra["first_grads"] = result.grads
        out.losses.append(result.loss)
        out.timelines.append(result.timeline)
        if run.progress:
            steps_iter.set_postfix(loss=f"{result.loss:.4f}")
        if on_step is not None:
            on_step(k, result.loss, result.timeline)
    return out, list(adamw.params.values())


def _guarded_steps(executor, params, batches, run: RunConfig, on_step) -> tuple[_Run, list]:
    """The steps back to back with the clipped AdamW inside the rank threads (synchronous or
    post-validated, :class:`~zbpp_lite.training.postval.optimizer.StageOptimizer`)."""
    model = executor.model
    guard = StageOptimizer(executor, params, rollback.AdamWConfig(learning_rate=run.lr, weight_decay=run.weight_decay),
                           "post-validation" if run.post_validation else "synchronous", run.max_grad_norm)
    results = executor.run_steps(params, batches, guard)
    out = _Run()
    starts = [r.start for r in results]
    starts.append(starts[-1] + results[-1].timeline.global_span)  # the last step: its own span
    for k, r in enumerate(results):
        out.losses.append(r.loss)
        out.timelines.append(r.timeline)
        out.seconds.append(starts[k + 1] - starts[k])
        if on_step is not None:
            on_step(k, r.loss, r.timeline)
    out.extra = {"first_grads": results[0].grads, "max_grad_norm": run.max_grad_norm, "post_validation": run.post_validation,
                 "guard_reports": [{"global_norm": r.global_norm, "clipped": r.clipped, "skipped": not r.finite,
                                    "rolled_back": r.rolled_back} for r in guard.reports]}
    current = guard.params()
    stage_params = []
    for s in range(executor.schedule.num_stages):
        like = model.stage_params(params, s)
        stage_params.append(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), list(current[s])))
    return out, stage_params
