"""Train the digits Transformer with any schedule on several devices, and measure it.

:func:`train` is what ``python -m zbpp_lite train`` and the notebooks call: it builds the
schedule, cuts the model into its stages, runs every step with the executor (gradients
accumulated over microbatches, then AdamW per stage on that stage's device, as PyTorch's
pipelining does), checks the first step's loss and gradients against the unpartitioned model, and
compares the measured timeline with the simulator's for the measured mean action costs.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .builders import build_schedule
from .costs import Costs
from .data import Digits, load_digits, microbatch_size
from .schedule import Schedule
from .simulate import simulate
from .timeline import Timeline
from .validate import validate


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
        costs: mean action times of that step (seconds), :func:`zbpp_lite.measure.measured_costs`.
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
        ``bubble_rate``), trace (the measured events), plus costs and config."""
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
            "costs": {"f": list(self.costs.f), "b": list(self.costs.b), "w": list(self.costs.w)},
            "trace": [
                {"rank": e.rank, "action": str(e.action), "kind": e.action.kind, "stage": e.action.stage,
                 "microbatch": e.action.microbatch, "start": e.start, "end": e.end}
                for e in self.measured.events
            ],
            "config": self.config,
        }


def max_relative_error(grads: Sequence[Any], reference: Sequence[Any]) -> float:
    """Largest over leaves of max|g - r| / max|r| (max|g - r| where r is all zero)."""
    import jax

    worst = 0.0
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        scale = np.abs(r).max()
        worst = max(worst, float(np.abs(g - r).max() / (scale if scale > 0 else 1.0)))
    return worst


@functools.lru_cache(maxsize=8)
def jitted_adamw(lr: float, weight_decay: float):
    """AdamW with PyTorch's defaults (:func:`zbpp_lite.baseline.adamw`) and its jitted update
    ``update(grads, state, params) -> (params, state)``; shared by train, adapt and distributed."""
    import jax
    import optax

    from .baseline import adamw

    opt = adamw(lr, weight_decay)

    @jax.jit
    def update(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return opt, update


def _pick_measured(timelines: list[Timeline]) -> Timeline:
    timed = timelines[1:] or timelines
    return sorted(timed, key=lambda t: t.makespan)[len(timed) // 2]


def train(
    schedule: str | Schedule = "zb-h1",
    ranks: int = 2,
    microbatches: int = 4,
    steps: int = 20,
    *,
    d: int = 32,
    heads: int = 4,
    blocks: int = 4,
    batch: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    seed: int = 0,
    holdout: float = 0.2,
    init: str | os.PathLike | None = None,
    schedule_options: dict | None = None,
    devices: Sequence[Any] | None = None,
    check_grads: bool = True,
    progress: bool = False,
    on_step: Callable[[int, float, Timeline], None] | None = None,
    data: Digits | None = None,
    max_grad_norm: float | None = None,
    post_validation: bool = False,
) -> TrainResult:
    """Train the digits Transformer with one schedule and measure it.

    Args:
        schedule: a registered name (``zb.SCHEDULES``) or a :class:`~zbpp_lite.schedule.Schedule`
            (e.g. read from CSV; its ranks and microbatches then override ``ranks`` and
            ``microbatches``).
        ranks, microbatches: p and m.
        steps: training steps (optimizer updates).
        d, heads, blocks: model width, attention heads, Transformer blocks (>= stages).
        batch: global batch; must be a multiple of ``microbatches``.
        lr, weight_decay: AdamW (PyTorch's defaults otherwise).
        seed: seed of the init and the batch order.
        holdout: fraction of the digits held out for the test accuracy (0: the PyTorch job's
            batches, tested on all samples); see :mod:`zbpp_lite.data`.
        init: a ``torch_pp_bench.py --save-init`` .npz to start from (``d``, ``blocks`` must match).
        schedule_options: keyword options for the builder (e.g. ``stages_per_rank``).
        devices: one device per rank; default :func:`zbpp_lite.devices.ensure_devices` (real
            accelerators if enough, else simulated CPU devices).
        check_grads: compare the first step with the unpartitioned model.
        progress: show a tqdm progress bar.
        on_step: called after every step with (step index, loss, measured timeline).
        data: the digits split to use (default ``load_digits(holdout, seed)``).
        max_grad_norm: clip the gradients to this global norm and skip a step whose gradients
            hold a NaN/Inf (Optax ``clip_by_global_norm`` semantics). The optimizer step then
            runs inside the rank threads and the steps run back to back
            (:class:`zbpp_lite.optimizer.StageOptimizer`): synchronously (every rank waits for
            every rank's norm) or, with ``post_validation``, speculatively and validated (paper
            section 4). ``on_step`` then reports once the steps are done (no progress bar);
            ``step_seconds`` are the periods between step starts (the last step: its span;
            compilation comes before the first). ``TrainResult.config``
            gets the per-step ``guard_reports`` (global norm, clipped, skipped, rolled back).
        post_validation: see ``max_grad_norm`` (requires it).

    Raises:
        ValueError: an unknown or invalid schedule, fewer blocks than stages, a batch that does
            not divide into microbatches, bad sizes; all before any compute.
        RuntimeError: too few devices (the message says how to get simulated ones), or a rank's
            action failed.
    """
    # Everything that can be wrong with the request is checked before JAX computes anything.
    if isinstance(schedule, Schedule):
        sched = schedule
    else:
        sched = build_schedule(schedule, ranks, microbatches, **(schedule_options or {}))
    validate(sched)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    if post_validation and max_grad_norm is None:
        raise ValueError("post_validation validates a clipped step: give max_grad_norm too")
    microbatch_size(batch, sched.num_microbatches)
    from .model import ModelConfig, stage_parts

    config = ModelConfig(d=d, heads=heads, blocks=blocks, seed=seed)
    stage_parts(blocks, sched.num_stages)  # raises for fewer blocks than stages
    if devices is None:
        from .devices import ensure_devices

        devices = ensure_devices(sched.num_ranks)

    import jax

    from .executor import PipelineExecutor
    from .measure import measured_costs
    from .model import StagedModel, build_parts, load_torch_init

    data = data if data is not None else load_digits(holdout, seed)
    model = StagedModel(build_parts(config), sched.num_stages)
    params = load_torch_init(init, config) if init is not None else model.params
    executor = PipelineExecutor(model, sched, devices)
    opt, update = jitted_adamw(lr, weight_decay)
    S = sched.num_stages
    stage_params = [jax.device_put(model.stage_params(params, s), executor.stage_devices[s]) for s in range(S)]

    losses, timelines, seconds = [], [], []
    grad_error = loss_error = None
    extra: dict = {}
    if max_grad_norm is not None:
        from .optimizer import StageOptimizer
        from .rollback import AdamWConfig

        guard = StageOptimizer(executor, params, AdamWConfig(learning_rate=lr, weight_decay=weight_decay),
                               "post-validation" if post_validation else "synchronous", max_grad_norm)
        batches = [data.batch(k, batch) for k in range(steps)]
        results = executor.run_steps(params, batches, guard)
        starts = [r.start for r in results]
        starts.append(starts[-1] + results[-1].timeline.global_span)  # the last step: its own span
        for k, r in enumerate(results):
            losses.append(r.loss)
            timelines.append(r.timeline)
            seconds.append(starts[k + 1] - starts[k])
            if on_step is not None:
                on_step(k, r.loss, r.timeline)
        if check_grads:
            ref_loss, ref_grads = _reference(model, params, *batches[0], devices[0])
            grad_error = max_relative_error(results[0].grads, ref_grads)
            loss_error = abs(results[0].loss - ref_loss)
        current = guard.params()
        for s in range(S):
            stage_params[s] = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(stage_params[s]), list(current[s]))
        extra = {"max_grad_norm": max_grad_norm, "post_validation": post_validation,
                 "guard_reports": [{"global_norm": r.global_norm, "clipped": r.clipped, "skipped": not r.finite,
                                    "rolled_back": r.rolled_back} for r in guard.reports]}
    else:  # one executor step at a time, AdamW per stage after it
        opt_state = [jax.device_put(opt.init(p), executor.stage_devices[s]) for s, p in enumerate(stage_params)]
        steps_iter: Any = range(steps)
        if progress:
            from tqdm.auto import tqdm

            desc = f"{sched.name or 'schedule'} p={sched.num_ranks} m={sched.num_microbatches}"
            steps_iter = tqdm(steps_iter, desc=desc, leave=False)
        for k in steps_iter:
            x, y = data.batch(k, batch)
            t0 = time.perf_counter()
            current = model.join_stage_params(stage_params)
            result = executor.run(current, x, y)
            grads = [model.stage_params(result.grads, s) for s in range(S)]
            for s in range(S):
                stage_params[s], opt_state[s] = update(grads[s], opt_state[s], stage_params[s])
            jax.block_until_ready(stage_params)
            seconds.append(time.perf_counter() - t0)
            if k == 0 and check_grads:
                ref_loss, ref_grads = _reference(model, current, x, y, devices[0])
                grad_error = max_relative_error(result.grads, ref_grads)
                loss_error = abs(result.loss - ref_loss)
            losses.append(result.loss)
            timelines.append(result.timeline)
            if progress:
                steps_iter.set_postfix(loss=f"{result.loss:.4f}")
            if on_step is not None:
                on_step(k, result.loss, result.timeline)

    final = model.join_stage_params(stage_params)
    test_loss, test_accuracy = evaluate(model, final, data.test_x, data.test_y, devices[0])
    measured = _pick_measured(timelines)
    costs = measured_costs(measured, S)
    return TrainResult(
        schedule=sched,
        losses=losses,
        test_accuracy=test_accuracy,
        test_loss=test_loss,
        grad_max_rel_error=grad_error,
        loss_error=loss_error,
        measured=measured,
        costs=costs,
        simulated=simulate(sched, costs),
        timelines=timelines,
        step_seconds=seconds,
        params=final,
        config={"d": d, "heads": heads, "blocks": blocks, "batch": batch, "lr": lr, "weight_decay": weight_decay,
                "seed": seed, "holdout": holdout, "init": None if init is None else str(init),
                "devices": [str(dev) for dev in devices], **extra},
    )


def _reference(model, params, x, y, device) -> tuple[float, Any]:
    """Loss and gradients of the unpartitioned model on the whole batch (one device)."""
    import jax

    params = jax.device_put(params, device)
    loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, x, y)
    return float(loss), grads


def evaluate(model, params, x: np.ndarray, y: np.ndarray, device=None) -> tuple[float, float]:
    """Mean loss and accuracy of the whole (unpartitioned) model on ``x``, ``y``."""
    import jax
    import jax.numpy as jnp

    params = jax.device_put(params, device) if device is not None else params

    @jax.jit
    def run(params, x, y):
        logits = model.logits(params, x)
        return model.loss_fn(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

    loss, acc = run(params, x, y)
    return float(loss), float(acc)
