"""Optimizer post-validation: gradient clipping and NaN checks without a global barrier.

Qi et al., arXiv 2401.10241, section 4. Clipping by the global gradient norm and skipping a step
on NaN/Inf need a reduction over every stage before any stage steps: every rank waits for the
last (ZB-H2's parallelogram becomes a trapezoid again,
:attr:`~zbpp_lite.schedules.timeline.Timeline.sync_bubble`). Post-validation removes the wait:

1. rank r adds its stages' squared norm and NaN flag to the partial reduction from rank r-1,
   passes it on and steps at once, speculatively (unclipped; skipped on a partial NaN);
2. the full reduction comes back from the last rank (during the next iteration's warm-up);
3. a rank whose speculative step was wrong (clipping needed, or a NaN on a later rank) rolls its
   parameters and AdamW state back in place (:mod:`~zbpp_lite.training.postval.rollback`) and
   redoes the step before the next iteration's first F uses them.

The result equals the synchronous step (:func:`synchronous_step`: Optax ``clip_by_global_norm``
plus skip-on-NaN) within the rollback's float32 bound, a few ulps of the *speculative* moments
(:func:`~zbpp_lite.training.postval.rollback.rollback_error_bound`); the redo's gradients are
scaled by 1/k, k = norm / max_norm, so the recovered second moment is off by about 4 u32 k^2
relative and the parameters by lr * 2 u32 k^2 (u32 = 2^-24). Measured (tests/test_postval.py,
lr 1e-2): k ~ 3 leaves the parameters within 1e-5 of the synchronous run's (relative to each
tensor's largest entry), k ~ 33 within 1e-4.

Parameters and optimizer states are lists, one entry per stage; ``placement[stage]`` is its rank;
ranks are visited 0 .. p-1 (the order the partial reduction travels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..reference import adamw_step
from .rollback import AdamWConfig, adamw_rollback


@dataclass
class StepReport:
    """What one guarded optimizer step found and did.

    Attributes:
        global_norm: the global gradient norm over every stage (float; nan if any entry is).
        finite: False when some gradient entry was NaN or Inf (the step was skipped).
        clipped: whether the gradients were scaled to ``max_norm``.
        rolled_back: ranks whose speculative step was undone and redone (post-validation only).
        partial_norms: per rank, the partially reduced norm it stepped on (post-validation only).
    """

    global_norm: float
    finite: bool
    clipped: bool
    rolled_back: list[int] = field(default_factory=list)
    partial_norms: list[float] = field(default_factory=list)


def _sumsq(tree: Any) -> float:
    """One stage's share of the squared global norm, as a host float (what a rank sends on: the
    stages live on different devices)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return float(sum(float(jnp.sum(jnp.square(x.astype(jnp.float32)))) for x in leaves))


def _finite(tree: Any) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


@jax.jit
def _scale(tree: Any, norm: Any, max_norm: Any) -> Any:
    return jax.tree_util.tree_map(lambda t: (t / norm) * max_norm, tree)


def _clip(tree: Any, norm: float, max_norm: float) -> Any:
    """optax.clip_by_global_norm's rule with a norm reduced elsewhere: t / norm * max_norm (float32)."""
    return tree if norm < max_norm else _scale(tree, np.float32(norm), np.float32(max_norm))


def synchronous_step(
    stage_params: Sequence[Any],
    opt_states: Sequence[Any],
    stage_grads: Sequence[Any],
    config: AdamWConfig,
    max_norm: float,
) -> tuple[list, list, StepReport]:
    """The synchronous baseline: reduce the global norm and NaN flag over every stage, skip the
    step on NaN/Inf, else clip (Optax ``clip_by_global_norm`` semantics) and step every stage.

    Raises:
        ValueError: ``max_norm`` not positive, or lists of different lengths.
    """
    _check(stage_params, opt_states, stage_grads, max_norm)
    norm = math.sqrt(sum(_sumsq(g) for g in stage_grads))
    finite = all(_finite(g) for g in stage_grads)
    report = StepReport(norm, finite, finite and norm >= max_norm)
    if not finite:
        return list(stage_params), list(opt_states), report
    new_params, new_states = [], []
    for p, s, g in zip(stage_params, opt_states, stage_grads):
        p, s = adamw_step(p, s, _clip(g, norm, max_norm), config)
        new_params.append(p)
        new_states.append(s)
    return new_params, new_states, report


def post_validated_step(
    stage_params: Sequence[Any],
    opt_states: Sequence[Any],
    stage_grads: Sequence[Any],
    config: AdamWConfig,
    max_norm: float,
    placement: Sequence[int],
) -> tuple[list, list, StepReport]:
    """Post-validation (module docstring): speculative per-rank steps on partial reductions,
    then validation against the full reduction, rolling back and redoing wrong steps in place.

    Returns the same as :func:`synchronous_step`, equal to it within the rollback bound of
    :func:`zbpp_lite.training.postval.rollback.rollback_error_bound`.

    Raises:
        ValueError: ``max_norm`` not positive, lists of different lengths, or a placement that
            does not name a rank for every stage.
    """
    _check(stage_params, opt_states, stage_grads, max_norm)
    if len(placement) != len(stage_params):
        raise ValueError(f"placement has {len(placement)} stages but there are {len(stage_params)} "
                         "stage parameter sets")
    params, states = list(stage_params), list(opt_states)
    ranks = sorted(set(placement))
    stepped: dict[int, bool] = {}
    partial_sq, partial_finite, partials = 0.0, True, []
    # 1. the partial reduction travels rank 0 -> p-1; each rank steps on what it has
    for r in ranks:
        stages = [s for s, owner in enumerate(placement) if owner == r]
        partial_sq += sum(_sumsq(stage_grads[s]) for s in stages)
        partial_finite = partial_finite and all(_finite(stage_grads[s]) for s in stages)
        partials.append(math.sqrt(partial_sq))
        stepped[r] = partial_finite
        if partial_finite:  # speculative: assume no clipping is needed
            for s in stages:
                params[s], states[s] = adamw_step(params[s], states[s], stage_grads[s], config)
    # 2. the full reduction comes back from the last rank
    norm = math.sqrt(partial_sq)
    finite = partial_finite
    clipped = finite and norm >= max_norm
    report = StepReport(norm, finite, clipped, partial_norms=partials)
    # 3. validate: undo and redo where the speculative step was wrong
    for r in ranks:
        if not stepped[r] or not (clipped or not finite):
            continue
        report.rolled_back.append(r)
        for s in (s for s, owner in enumerate(placement) if owner == r):
            params[s], states[s] = adamw_rollback(params[s], states[s], stage_grads[s], config)
            if finite:  # redo, clipped by the global norm
                clipped_grads = _clip(stage_grads[s], norm, max_norm)
                params[s], states[s] = adamw_step(params[s], states[s], clipped_grads, config)
    return params, states, report


def _check(stage_params, opt_states, stage_grads, max_norm) -> None:
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    if not len(stage_params) == len(opt_states) == len(stage_grads):
        raise ValueError(
            f"one entry per stage expected: {len(stage_params)} parameter sets, {len(opt_states)} optimizer "
            f"states, {len(stage_grads)} gradient sets"
        )


def step_makespans(timeline, optimizer_seconds: Sequence[float],
                   reduce_seconds: float = 0.0) -> dict[str, float]:
    """Makespan of one training step with the optimizer step included, both ways.

    ``timeline`` is one step's (measured or simulated) timeline; ``optimizer_seconds[r]`` the
    time rank r's optimizer step takes (same unit). Synchronous: every rank waits for the last
    rank's last action plus the global reduction (``reduce_seconds``) before it steps.
    Post-validation: each rank steps as soon as its own last action ends (the partial reduction
    rides along with the pipeline's own traffic). Spans count from each rank's first F, as the
    makespan does.

    Returns:
        {"synchronous": ..., "post_validation": ...}.
    """
    if len(optimizer_seconds) != timeline.num_ranks:
        raise ValueError(f"need one optimizer time per rank ({timeline.num_ranks}), "
                         f"got {len(optimizer_seconds)}")
    global_end = max(e.end for e in timeline.events)
    sync, pv = [], []
    for r in range(timeline.num_ranks):
        events = timeline.rank_events(r)
        first = min((e.start for e in events if e.action.kind == "F"), default=events[0].start)
        own_end = max(e.end for e in events)
        sync.append(global_end + reduce_seconds + optimizer_seconds[r] - first)
        pv.append(own_end + optimizer_seconds[r] - first)
    return {"synchronous": max(sync), "post_validation": max(pv)}
