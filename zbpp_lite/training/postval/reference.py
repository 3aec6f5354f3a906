"""Optimizer post-validation: gradient clipping and NaN checks without a global barrier.

Qi et al., arXiv 2401.10241, section 4; the algorithm is described in
:mod:`~zbpp_lite.training.postval.optimizer`, here as reference functions over all stages at once.
The result equals :func:`synchronous_step` (Optax ``clip_by_global_norm`` plus skip-on-NaN) within the
rollback's float32 bound (:func:`~zbpp_lite.training.postval.rollback.rollback_error_bound`): with
k = norm / max_norm the second moment is off by about 4 u32 k^2 relative, the parameters by
lr * 2 u32 k^2 (u32 = 2^-24); measured (tests/test_postval.py, lr 1e-2), k ~ 3: within 1e-5 of the
synchronous run's (relative to each tensor's largest entry), k ~ 33: within 1e-4.
Parameters and states are lists, one entry per stage; ``placement[stage]`` is its rank.
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
    """One guarded optimizer step: ``global_norm`` (nan if any entry is), ``finite`` (False: skipped),
    ``clipped``; post-validation only: ``rolled_back`` ranks and each rank's ``partial_norms``."""

    global_norm: float
    finite: bool
    clipped: bool
    rolled_back: list[int] = field(default_factory=list)
    partial_norms: list[float] = field(default_factory=list)


def _sumsq(tree: Any) -> float:
    """One stage's share of the squared global norm, as a host float."""
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
    """The synchronous baseline: global norm and NaN flag over every stage, skip on NaN/Inf, else clip
    (Optax ``clip_by_global_norm``) and step every stage.

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
    """Post-validation: speculative per-rank steps on partial reductions (ranks 0 .. p-1), validated
    against the full reduction, wrong steps rolled back and redone; returns as :func:`synchronous_step`.

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

    ``optimizer_seconds[r]``: rank r's optimizer step (the timeline's unit). Synchronous: every rank
    waits for the last action plus ``reduce_seconds``; post-validation: each steps after its own last
    action. Spans count from each rank's first F.

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
