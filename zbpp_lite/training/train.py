"""Train the digits Transformer with any schedule on several devices, and measure it.

:func:`train` (``python -m zbpp_lite train``): build the schedule, cut the model into stages, run every
step with the executor (gradients accumulated over microbatches, then AdamW per stage on its device),
check the first step against the unpartitioned model, compare the measured timeline with the simulated.
:func:`train_step` is the one step every loop takes (threads, turns' processes, adapt, ``launch``, SPMD);
they differ only in what carries values between ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from ..analysis.profiling.device import stage_memory_bytes
from ..analysis.profiling.timelines import measured_costs, timed_steps
from ..runtime.devices import ensure_devices
from ..runtime.executor import PipelineExecutor
from ..runtime.split import sum_dtype
from ..runtime.stages import StagedModel, microbatch_size, stage_parts
from ..schedules.builders import build_schedule, options_of
from ..schedules.costs import Costs
from ..schedules.ir import Schedule
from ..schedules.simulate import simulate
from ..schedules.timeline import Timeline
from ..schedules.validate import validate
from .data import ByteText, Digits, data_json, load_data, sample_shapes
from .model import ModelConfig, RunConfig, abstract_parts, build_parts, load_torch_init, settings_json
from .postval import rollback
from .postval.optimizer import StageOptimizer
from .reference import evaluate, jitted_update, max_relative_error, reference_grads, step_dropout_keys


@dataclass
class TrainResult:
    """What one training run did and measured.

    ``losses``: every step's global-batch mean loss before its update; ``grad_max_rel_error``: first
    step, max over parameters of max|g - g_ref| / max|g_ref| vs the unpartitioned model, and
    ``loss_error`` |loss - loss_ref| (None: check off); ``measured``: the median-makespan step after the
    first, ``costs`` its mean action times (seconds), ``simulated`` :func:`zbpp_lite.simulate` with them;
    ``step_seconds``: wall times (the first compiles); ``params``: one pytree per model module;
    ``validation``: ``(steps done, held-out loss)`` pairs, at the start, every ``RunConfig.eval_every``
    steps and at the end (``test_loss``); empty with ``eval_every`` 0.
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
    validation: list = field(default_factory=list)

    def to_json(self) -> dict:
        """A JSON-ready dict (``makespan`` in seconds)."""
        s, m, sim = self.schedule, self.measured, self.simulated
        steps = zip(self.losses, self.timelines, self.step_seconds)
        return {
            "schedule": s.name or "custom", "ranks": s.num_ranks, "stages": s.num_stages,
            "microbatches": s.num_microbatches,
            "steps": [{"loss": loss, "makespan": t.makespan, "bubble_rate": t.bubble_rate, "seconds": sec}
                      for loss, t, sec in steps],
            "test_accuracy": self.test_accuracy, "test_loss": self.test_loss,
            "grad_max_rel_error": self.grad_max_rel_error, "loss_error": self.loss_error,
            "measured": {"makespan": m.makespan, "bubble_rate": m.bubble_rate},
            "simulated": {"makespan": sim.makespan, "bubble_rate": sim.bubble_rate},
            "memory": self._memory_json(),
            "costs": {"f": list(self.costs.f), "b": list(self.costs.b), "w": list(self.costs.w)},
            "trace": [{"rank": e.rank, "action": str(e.action), "kind": e.action.kind,
                       "stage": e.action.stage, "microbatch": e.action.microbatch, "start": e.start,
                       "end": e.end} for e in m.events],
            "config": self.config,
            "validation": [{"step": k, "loss": loss} for k, loss in self.validation],
        }

    @classmethod
    def of(cls, schedule: Schedule, steps: tuple[list, list, list], params: Any, errors: tuple, tested: tuple,
           config: dict) -> "TrainResult":
        """From the ``steps`` (per step: loss, measured Timeline, seconds), the check's ``errors`` and
        ``tested`` (test loss, accuracy)."""
        losses, timelines, seconds = steps
        measured = pick_measured(timelines)
        costs = measured_costs(measured, schedule.num_stages)
        return cls(schedule, losses, tested[1], tested[0], errors[0], errors[1], measured, costs,
                   simulate(schedule, costs), timelines, seconds, params, config)

    def _memory_json(self) -> dict | None:
        """Measured activation memory and planned peak per rank (bytes), measured peak in units of the
        rank's first stage's M_B; None when nothing was measured (SPMD)."""
        memory = self.measured.measured_memory
        if memory is None:
            return None
        first = [self.schedule.stages_of(r)[0] for r in range(self.schedule.num_ranks)]
        return {**memory.to_json(), "planned_peak_bytes": list(self.measured.planned_peak_bytes),
                "peak_units": list(memory.peak_units(first))}


def eval_due(run: RunConfig, done: int, steps: int) -> bool:
    """Whether a run of ``steps`` steps takes the held-out loss after ``done`` of them (every
    ``run.eval_every`` from 0; the end's is the test loss, taken anyway)."""
    return run.eval_every > 0 and done % run.eval_every == 0 and done < steps


def pick_measured(timelines: list[Timeline]) -> Timeline:
    """The timed step (after the first) with the median makespan."""
    timed = timed_steps(timelines)
    return sorted(timed, key=lambda t: t.makespan)[len(timed) // 2]


@dataclass(frozen=True)
class TrainOptions:
    """Where and how :func:`train` runs: ``schedule_options`` for the builder (a memory-planning builder
    without ``costs`` gets :func:`job_costs`); ``devices``, one per rank (default
    :func:`zbpp_lite.runtime.devices.ensure_devices`); ``data`` (default the model's,
    :func:`~zbpp_lite.training.data.load_data`); ``on_step(step, loss, timeline)``."""

    schedule_options: dict | None = None
    devices: Sequence[Any] | None = None
    data: Digits | ByteText | None = None
    on_step: Callable[[int, float, Timeline], None] | None = None


def train(schedule: str | Schedule = "zb-h1", ranks: int = 2, microbatches: int = 4, steps: int = 20, *,
          model: ModelConfig | None = None, run: RunConfig | None = None, options: TrainOptions | None = None
          ) -> TrainResult:
    """Train the job's model (the digits Transformer, or the GPT for a ``GPTConfig``) with one schedule
    and measure it.

    Args:
        schedule: a name in ``zb.SCHEDULES`` or a :class:`~zbpp_lite.schedules.ir.Schedule` (its ranks
            and microbatches then override ``ranks``, ``microbatches``).
        steps: optimizer updates. model: :class:`~zbpp_lite.training.model.ModelConfig` (blocks >= stages).
        run: :class:`RunConfig`. options: :class:`TrainOptions`.

    Raises:
        ValueError: an unknown or invalid schedule, ``memory_limit`` without ``costs``, fewer blocks
            than stages, a batch that does not divide, bad sizes, a planned ``Schedule`` whose memory
            promise this model's M_W breaks (:func:`checked_schedule`); all before any compute.
        RuntimeError: too few devices, or a rank's action failed.
    """
    o = options or TrainOptions()
    config, run = model or ModelConfig(), run or RunConfig()
    sched = checked_schedule(schedule, ranks, microbatches, steps, config, run, o.schedule_options)
    devices = o.devices if o.devices is not None else ensure_devices(sched.num_ranks)
    executor = PipelineExecutor(StagedModel(build_parts(config), sched.num_stages), sched, devices)
    return train_steps(executor, steps, config, run, data=o.data, on_step=o.on_step)


class StageAdamW:
    """AdamW (:meth:`~zbpp_lite.training.postval.rollback.AdamWConfig.optimizer`) on this process's
    stages: state per module on its stage's device, one jitted update per stage; :meth:`place` moves
    them (state kept). ``params``: one pytree per model module (other ranks' stay as given).
    ``rank_update`` None: :func:`train_step` runs the step, then :meth:`step`."""

    rank_update = None

    def __init__(self, params: list, run: RunConfig):
        self.config = rollback.AdamWConfig(learning_rate=run.lr, weight_decay=run.weight_decay)
        self.params, self.state = list(params), {}
        self.model: StagedModel | None = None
        self.homes: dict = {}

    def place(self, model: StagedModel, homes: dict) -> "StageAdamW":
        """Update ``model``'s stages ``homes`` (``{stage: device}``) from now on."""
        opt = self.config.optimizer()
        self.model, self.homes = model, dict(homes)
        for s, d in self.homes.items():
            for i in model.parts[s]:
                self.params[i] = jax.device_put(self.params[i], d)
                state = self.state[i] if i in self.state else opt.init(self.params[i])
                self.state[i] = jax.device_put(state, d)
        return self

    def stage_params(self) -> dict[int, list]:
        """``{stage: [module pytree]}`` of the stages this process updates."""
        return {s: [self.params[i] for i in self.model.parts[s]] for s in self.homes}

    def step(self, grads: list) -> None:
        """One update from ``grads`` (one pytree per model module), wherever the executor left them."""
        update = jitted_update(self.config)
        for s, d in self.homes.items():
            idx = self.model.parts[s]
            new, states = update([jax.device_put(grads[i], d) for i in idx], [self.state[i] for i in idx],
                                 [self.params[i] for i in idx])
            for i, p, st in zip(idx, new, states):
                self.params[i], self.state[i] = p, st
        jax.block_until_ready(self.params)

    def warm_up(self) -> None:
        """Compile the update for the first step's inputs and for its own outputs, changing nothing."""
        update = jitted_update(self.config)
        for idx in (self.model.parts[s] for s in self.homes):
            p, st = [self.params[i] for i in idx], [self.state[i] for i in idx]
            zeros = jax.tree_util.tree_map(lambda a: jax.numpy.zeros_like(a, sum_dtype(a.dtype)), p)
            once = update(zeros, st, p)
            jax.block_until_ready(update(zeros, once[1], once[0]))


class ClippedAdamW:
    """AdamW clipped to the global gradient norm ``run.max_grad_norm`` (Optax ``clip_by_global_norm``),
    a step with NaN/Inf skipped, stepped in the rank threads: :func:`train_step` hands :attr:`rank_update`
    (a :class:`~zbpp_lite.training.postval.optimizer.StageOptimizer`) to the executor's run, whose ranks
    exchange the norm through its transport, so threads and processes clip alike. Synchronous, or with
    ``run.post_validation`` post-validated (Qi et al., arXiv 2401.10241, section 4): each rank steps on its
    partial norm and validates at the step's end, rolling a wrong step back and redoing it.

    Attributes:
        params: one pytree per model module, every stage updated after every step (those of other
            processes through ``gather``).
        reports: per step, ``{"global_norm", "clipped", "skipped", "rolled_back"}`` (rolled back: the
            ranks that did, of every process).
    """

    def __init__(self, executor, params: list, run: RunConfig, gather: Callable[[Any], list] | None = None):
        config = rollback.AdamWConfig(learning_rate=run.lr, weight_decay=run.weight_decay)
        policy = "post-validation" if run.post_validation else "synchronous"
        self.rank_update = StageOptimizer(executor, params, config, policy, run.max_grad_norm)
        self.model, self.params, self.reports = executor.model, list(params), []
        self.gather = gather

    def stage_params(self) -> dict[int, list]:
        """``{stage: [module pytree]}`` of the stages this process updates."""
        return {s: self.model.stage_params(self.params, s) for s in self.rank_update.params()}

    def warm_up(self) -> None:
        """Nothing: compiled when made (as :class:`StageAdamW`'s, before the first timed step)."""

    def step(self, grads: list) -> None:
        """After the run (``grads`` unused: the rank threads stepped): its reports and parameters kept; with
        ``gather`` (:meth:`~zbpp_lite.runtime.distributed._CrossProcess.gather`), every process's stages and
        rolled-back ranks."""
        reports, stages = self.rank_update.reports, self.rank_update.params()
        rolled = [list(r.rolled_back) for r in reports]
        if self.gather is not None:
            mine = [[s, [np.asarray(x) for x in leaves]] for s, leaves in stages.items()]
            shares = self.gather({"stages": mine, "rolled_back": rolled})
            stages = {int(s): list(leaves) for share in shares for s, leaves in share["stages"]}
            rolled = [sorted({q for share in shares for q in share["rolled_back"][i]})
                      for i in range(len(rolled))]
        self.reports += [{"global_norm": r.global_norm, "clipped": r.clipped, "skipped": not r.finite,
                          "rolled_back": back} for r, back in zip(reports, rolled, strict=True)]
        self.params = with_stage_leaves(self.model, self.params, stages)


def stage_optimizer(executor, params: list, run: RunConfig, homes: dict) -> "StageAdamW | ClippedAdamW":
    """The run's optimizer on ``executor``'s stages from ``params`` (one pytree per module):
    :class:`ClippedAdamW` with ``run.max_grad_norm`` (an executor of one process of several: gathering
    the other processes' stages after each step, its transport's ``gather``), else :class:`StageAdamW` on
    ``homes``."""
    if run.max_grad_norm is not None:
        return ClippedAdamW(executor, params, run, getattr(executor.transport, "gather", None))
    return StageAdamW(params, run).place(executor.model, homes)


def guard_json(run: RunConfig, reports: list) -> dict:
    """A clipped run's ``max_grad_norm``, ``post_validation`` and ``guard_reports`` (one per step)."""
    return {} if run.max_grad_norm is None else {
        "max_grad_norm": run.max_grad_norm, "post_validation": run.post_validation, "guard_reports": reports}


def train_step(executor, adamw: "StageAdamW | ClippedAdamW", x, y, keys=None) -> tuple[Any, float, float]:
    """The one training step of every loop: ``executor``'s run on ``adamw``'s parameters (``keys``: the
    step's dropout keys, as the executor's ``run``), then ``adamw``'s step: :class:`StageAdamW` updates
    after the run, :class:`ClippedAdamW` in the rank threads (the run's ``update``). Returns (result,
    seconds to the update's end, seconds of the run)."""
    t0 = time.perf_counter()
    result = executor.run(adamw.params, x, y, keys, update=adamw.rank_update)
    ran = time.perf_counter() - t0
    adamw.step(result.grads)
    return result, time.perf_counter() - t0, ran


def check_step(model, params: list, x, y, result, device, keys=None) -> tuple[float, float]:
    """(max relative gradient error, |loss - loss_ref|) vs the unpartitioned model from ``params``, with
    the step's dropout ``keys``."""
    ref_loss, ref_grads = reference_grads(model, params, x, y, device, keys)
    return max_relative_error(result.grads, ref_grads), abs(result.loss - ref_loss)


def train_steps(executor, steps: int, config: ModelConfig, run: RunConfig, *, home: Any = None,
                data: Digits | ByteText | None = None,
                on_step: Callable[[int, float, Timeline], None] | None = None
                ) -> TrainResult:
    """``steps`` steps of :func:`train_step` from ``config``'s initial parameters (or ``run.init``) on
    batches 0, 1, ... with :func:`stage_optimizer`'s optimizer (a model with dropout: step k's keys
    ``dropout_keys(run.seed, k, m)``), then checked, evaluated (without dropout), simulated; with
    ``run.eval_every`` also evaluated before the first step and between steps. ``home``: one device for
    all stages' state (default: each stage's own; a clipped run keeps it on each stage's device)."""
    staged, sched = executor.model, executor.schedule
    data = data if data is not None else load_data(config, run)
    params = load_torch_init(run.init, config) if run.init is not None else staged.params
    homes = [home] * sched.num_stages if home is not None else list(executor.stage_devices)
    batches = [data.batch(k, run.batch) for k in range(steps)]
    keys = [step_dropout_keys(staged, run.seed, k, sched.num_microbatches) for k in range(steps)]
    losses, timelines, seconds = [], [], []
    held_out = lambda p: evaluate(staged, p, data.test_x, data.test_y, homes[0])[0]  # noqa: E731
    curve = [(0, held_out(params))] if eval_due(run, 0, steps) else []
    optimizer = stage_optimizer(executor, params, run, dict(enumerate(homes)))
    desc = f"{sched.name or 'schedule'} p={sched.num_ranks} m={sched.num_microbatches}"
    bar = tqdm(range(steps), desc=desc, leave=False, disable=not run.progress)
    for k in bar:
        result, sec, _ = train_step(executor, optimizer, *batches[k], keys[k])
        if k == 0:
            first = result
        losses.append(result.loss)
        timelines.append(result.timeline)
        seconds.append(sec)
        bar.set_postfix(loss=f"{result.loss:.4f}")
        if on_step is not None:
            on_step(k, result.loss, result.timeline)
        if eval_due(run, k + 1, steps):
            curve.append((k + 1, held_out(optimizer.params)))
    final = optimizer.params
    errors = (check_step(staged, params, *batches[0], first, homes[0], keys[0]) if run.check_grads
              else (None, None))
    tested = evaluate(staged, final, data.test_x, data.test_y, homes[0])
    devices = [str(dev) for dev in executor.devices]
    settings = {**settings_json(config, run), **data_json(data), "devices": devices,
                **guard_json(run, getattr(optimizer, "reports", []))}
    result = TrainResult.of(sched, (losses, timelines, seconds), final, errors, tested, settings)
    result.validation = curve + [(steps, result.test_loss)] if curve else []
    return result


def job_microbatch(num_stages: int, microbatches: int, config: ModelConfig, run: RunConfig,
                   shapes_only: bool = False) -> tuple:
    """``(model, x, y)``: the job's model cut into ``num_stages`` stages and batch 0's first microbatch;
    ``shapes_only``: parameters, ``x`` and ``y`` as ``jax.ShapeDtypeStruct`` (nothing allocated or read)."""
    mb = microbatch_size(run.batch, microbatches)
    if shapes_only:
        x, y = (jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in sample_shapes(config, mb))
        return StagedModel(abstract_parts(config), num_stages), x, y
    x, y = load_data(config, run).batch(0, run.batch)
    return StagedModel(build_parts(config), num_stages), x[:mb], y[:mb]


def job_costs(num_stages: int, microbatches: int, config: ModelConfig, run: RunConfig) -> Costs:
    """``Costs(mem_b, mem_w)``: M_B, M_W per stage in bytes for one microbatch, from shapes
    (:func:`~zbpp_lite.analysis.profiling.device.stage_memory_bytes`), for memory-limited planners."""
    job = job_microbatch(num_stages, microbatches, config, run, shapes_only=True)
    mem_b, mem_w = stage_memory_bytes(*job)
    return Costs(mem_b=mem_b, mem_w=mem_w)


def job_plan(name: str, ranks: int, microbatches: int, options: dict, config: ModelConfig, run: RunConfig
             ) -> tuple[Schedule, Costs | None]:
    """The named schedule built with ``options`` and validated: a planner that takes ``costs``
    (zb-auto, zb-v, ...) and was given none plans with this job's M_B, M_W in bytes
    (:func:`job_costs`, returned beside it; else None). The one copy the library and the command line use.

    Raises:
        ValueError: ``memory_limit`` without ``costs`` (the limit counts units of ``Costs.mem_b``, which
            this job measures in bytes: a limit in other units would promise memory the run does not
            see); an unknown schedule, bad sizes, fewer blocks than stages.
    """
    options = dict(options)
    with_job_memory = "costs" in options_of(name) and "costs" not in options
    if with_job_memory and "memory_limit" in options:
        raise ValueError(f"{name}'s memory_limit counts units of Costs.mem_b: give "
                         "costs=Costs(mem_b=..., mem_w=...) with it (from Python), or leave memory_limit "
                         "out to plan with the job's M_B, M_W in bytes (the command line's only way)")
    sched = _fits_job(validate(build_schedule(name, ranks, microbatches, **options)), config, run)
    if not with_job_memory:
        return sched, None
    costs = job_costs(sched.num_stages, microbatches, config, run)
    return validate(build_schedule(name, ranks, microbatches, **options, costs=costs)), costs


def checked_schedule(schedule, ranks: int, microbatches: int, steps: int, config: ModelConfig, run: RunConfig,
                     schedule_options: dict | None) -> Schedule:
    """The schedule to run, the request checked before any compute (a name: :func:`job_plan`). Raises
    ValueError: as :func:`job_plan`, or a schedule whose ``memory_plan`` (a memory-limited planner's, e.g.
    built with default costs) peaks above its promise at this job's M_B, M_W
    (:meth:`~zbpp_lite.schedules.memory.MemoryPlan.overrun`)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if isinstance(schedule, Schedule):
        sched = _fits_job(validate(schedule), config, run)
        plan = sched.memory_plan
        if plan is not None:  # planned elsewhere: its promise must hold at this job's M_B, M_W
            message = plan.overrun(sched, job_costs(sched.num_stages, sched.num_microbatches, config, run))
            if message:
                raise ValueError(message)
        return sched
    return job_plan(schedule, ranks, microbatches, schedule_options or {}, config, run)[0]


def _fits_job(sched: Schedule, config: ModelConfig, run: RunConfig) -> Schedule:
    """``sched``, once the batch divides into its microbatches and every stage gets a block (ValueError)."""
    microbatch_size(run.batch, sched.num_microbatches)
    stage_parts(config.blocks, sched.num_stages)  # raises for fewer blocks than stages
    return sched


def with_stage_leaves(model: StagedModel, params: list, per_stage: dict) -> list:
    """``params`` (one pytree per module) with each stage ``s`` of ``per_stage`` set from its leaves."""
    out = list(params)
    for s, leaves in per_stage.items():
        like = jax.tree_util.tree_structure(model.stage_params(params, s))
        for i, part in zip(model.parts[s], jax.tree_util.tree_unflatten(like, list(leaves))):
            out[i] = part
    return out
