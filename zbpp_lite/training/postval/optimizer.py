"""The optimizer step inside the executor's rank threads, so what a schedule loses to synchronisation is
measured: AdamW per stage, plain, synchronous clip, or post-validated (Qi et al., arXiv 2401.10241, sec. 4).

- ``"plain"``: each rank steps its stages right after its last action;
- ``"synchronous"``: ranks exchange squared gradient norms and NaN flags, then skip (NaN/Inf anywhere)
  or clip by the global norm (Optax ``clip_by_global_norm``) and step; every rank waits for the slowest
  (ZB-H2's parallelogram becomes a trapezoid, :attr:`~zbpp_lite.schedules.timeline.Timeline.sync_bubble`);
- ``"post-validation"``: rank r adds its share to rank r-1's partial reduction, passes it on and steps
  at once (unclipped); the last rank sends the full reduction back. A rank validates during its next
  warm-up (``speculative=True``, as the paper: F's run on speculative parameters until at most its first
  backward) or before its next first action; if clipping or a NaN was missed it rolls back in place
  (:func:`~zbpp_lite.training.postval.rollback.adamw_rollback`, algorithm 1) and redoes the step (and
  speculative F's).

Each is a set of instructions of the lowered program
(:func:`~zbpp_lite.schedules.program.optimizer_instructions`), whose messages the executor carries:
:class:`StageOptimizer`'s ``norm``, ``step``, ``validate`` and ``rollback`` are what they call.

:func:`synchronous_step` is the host-side reference over all stages at once (norms in float32 per
leaf, summed in float64): "synchronous" equals it to float32 rounding, "post-validation" within the
rollback's bound (:func:`~zbpp_lite.training.postval.rollback.rollback_error_bound`): with
k = norm / max_norm the parameters are off by about lr * 2 u32 k^2 (u32 = 2^-24); measured
(tests/test_optimizer.py, lr 1e-2), k ~ 3: within 1e-5 of the synchronous run's (relative to each
tensor's largest entry), k ~ 33: within 1e-4.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...runtime.split import sum_dtype
from ...schedules.program import OptimizerMessage
from ..reference import adamw_step
from .rollback import AdamWConfig, adamw_rollback

POLICIES = ("plain", "synchronous", "post-validation")


@dataclass
class StepReport:
    """One guarded optimizer step: ``global_norm`` (nan if any entry is), ``finite`` (False: skipped),
    ``clipped``; post-validation only: ``rolled_back`` ranks and each rank's ``partial_norms``."""

    global_norm: float
    finite: bool
    clipped: bool
    rolled_back: list[int] = field(default_factory=list)
    partial_norms: list[float] = field(default_factory=list)


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
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    if not len(stage_params) == len(opt_states) == len(stage_grads):
        raise ValueError(f"one entry per stage expected: {len(stage_params)} parameter sets, "
                         f"{len(opt_states)} optimizer states, {len(stage_grads)} gradient sets")
    leaves = jax.tree_util.tree_leaves(list(stage_grads))
    norm = math.sqrt(sum(float(jnp.sum(jnp.square(x.astype(jnp.float32)))) for x in leaves))
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)
    report = StepReport(norm, finite, finite and norm >= max_norm)
    if not finite:
        return list(stage_params), list(opt_states), report
    stepped = [adamw_step(p, st, _clip(g, norm, max_norm), config)
               for p, st, g in zip(stage_params, opt_states, stage_grads)]
    return [p for p, _ in stepped], [st for _, st in stepped], report


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


class StageOptimizer:
    """AdamW on every stage, stepped inside the rank threads (a
    :class:`~zbpp_lite.runtime.executor.RankUpdate` for ``PipelineExecutor.run_steps``).

    Args:
        executor: the :class:`~zbpp_lite.runtime.executor.PipelineExecutor` that will run the steps.
        params: one parameter pytree per model module (``StagedModel.params``), the start.
        config: :class:`~zbpp_lite.training.postval.rollback.AdamWConfig`.
        policy: "plain", "synchronous" or "post-validation" (module docstring).
        max_norm: global norm clipped to (float > 0); required by the guarded policies, refused by "plain".
        gradient_filter: optional ``fn(step, stage, grads) -> grads`` applied first (e.g. a test's fault).
        speculative: post-validation: validate during the next warm-up (True) or before its first action.

    Attributes:
        reports: one :class:`StepReport` per step of the latest
            ``run_steps`` (guarded policies). Parameters and states carry over between calls.

    Raises:
        ValueError: an unknown policy, a missing, non-numeric or non-positive ``max_norm``,
            ``max_norm`` with "plain", an executor that is not a PipelineExecutor, or params
            without one pytree per model module (and AdamWConfig's own checks).
    """

    def __init__(
        self,
        executor,
        params,
        config: AdamWConfig = AdamWConfig(),
        policy: str = "plain",
        max_norm: float | None = None,
        gradient_filter: Callable[[int, int, tuple], tuple] | None = None,
        speculative: bool = True,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if policy == "plain" and max_norm is not None:
            raise ValueError("max_norm needs a guarded policy: 'synchronous' or 'post-validation'")
        if policy != "plain":
            try:
                max_norm = float(max_norm)
            except (TypeError, ValueError):
                raise ValueError(f"the {policy!r} policy clips by the global norm: give max_norm, "
                                 f"a number > 0, got {max_norm!r}") from None
            if not max_norm > 0:
                raise ValueError(f"the {policy!r} policy clips by the global norm: give max_norm > 0, "
                                 f"got {max_norm}")
        if policy == "post-validation":  # its rollback divides by 1 - lr * weight_decay
            config.check_invertible()
        if not hasattr(executor, "schedule") or not hasattr(executor, "local_stages"):
            raise ValueError("executor must be a zbpp_lite.runtime.executor.PipelineExecutor, "
                             f"got {type(executor).__name__}")
        if len(params) != executor.model.num_parts:
            raise ValueError(f"params must hold one pytree per model module ({executor.model.num_parts}), "
                             f"got {len(params)}")
        self.executor, self.config, self.policy, self.max_norm = executor, config, policy, max_norm
        self.gradient_filter = gradient_filter
        # post-validation: the next step's warm-up runs on the unvalidated parameters (RankUpdate)
        self.speculative = bool(speculative) and policy == "post-validation"
        model, schedule = executor.model, executor.schedule
        self.num_ranks = schedule.num_ranks
        opt = config.optimizer()
        self._params: dict[int, tuple] = {}
        self._states: dict[int, Any] = {}
        for s in executor.local_stages:
            leaves = tuple(jax.tree_util.tree_leaves(model.stage_params(params, s)))
            self._params[s] = jax.device_put(leaves, executor.stage_devices[s])
            self._states[s] = jax.device_put(opt.init(self._params[s]), executor.stage_devices[s])
        # tied weights (StagedModel.ties): every copy holds the whole gradient; the norm counts the first
        self._repeats = {s: {i for copies in model.tied_leaves() for t, i in copies[1:] if t == s}
                         for s in executor.local_stages}
        self._pending: dict[int, dict] = {}  # rank -> what validate() needs from its last step
        self._lock = threading.Lock()
        self.reports: list[StepReport] = []
        self._rollback_fn = jax.jit(lambda p, st, g: adamw_rollback(p, st, g, config))
        self._norm_fn = jax.jit(lambda g: (jnp.stack([jnp.sum(jnp.square(x.astype(jnp.float32))) for x in g]),
                                           jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in g]))))
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile every function a rank may call, on zeros, so nothing compiles inside a timed step."""
        for s in self._params:
            zeros = tuple(jnp.zeros_like(p, sum_dtype(p.dtype)) for p in self._params[s])  # the sums' dtypes
            outs = [adamw_step(self._params[s], self._states[s], zeros, self.config)]
            outs.append(adamw_step(*outs[0], zeros, self.config))  # later steps: the outputs' own layout
            if self.policy != "plain":
                outs.append(self._norm_fn(zeros))
                outs.append(_clip(zeros, self.max_norm, self.max_norm))
            if self.policy == "post-validation":
                outs.append(self._rollback_fn(*outs[0], zeros))
            jax.block_until_ready(outs)

    def begin(self, num_steps: int) -> None:
        """Called by ``run_steps`` before its threads start: fresh reports for its steps."""
        self.reports = [StepReport(float("nan"), True, False, partial_norms=[float("nan")] * self.num_ranks)
                        for _ in range(num_steps if self.policy != "plain" else 0)]
        self._pending.clear()

    # ------------------------------------------------------------------ RankUpdate

    def stage_params(self, stage: int) -> tuple:
        return self._params[stage]

    def params(self) -> dict:
        """Current parameters of the local stages: ``{stage: tuple of leaves}`` (on their devices)."""
        return dict(self._params)

    def norm(self, rank: int, k: int, grads: dict, got: dict) -> dict:
        """``NORM``: the squared norm and NaN flag of ``rank``'s gradients of step ``k``, as the messages it
        sends: synchronous ``NORM``; post-validated, added to rank r-1's ``PARTIAL`` (in ``got``) with
        whether rank 0 stepped (if it did not, a NaN there, no rank did: nothing speculative to redo),
        as ``PARTIAL`` (``FULL`` on the last rank)."""
        if self.gradient_filter is not None:
            grads = {s: tuple(self.gradient_filter(k, s, g)) for s, g in grads.items()}
        sq, finite = self._local_norm(grads)
        self._pending[rank] = {"grads": grads, "k": k}
        if self.policy == "synchronous":
            return {OptimizerMessage("NORM", rank): (sq, finite)}
        if rank > 0:
            before, before_finite, first_stepped = got[OptimizerMessage("PARTIAL", rank - 1)]
            sq, finite = before + sq, before_finite and finite
        else:
            first_stepped = finite
        self._pending[rank].update(stepped=finite, partial=math.sqrt(sq))
        tag = "PARTIAL" if rank < self.num_ranks - 1 else "FULL"
        return {OptimizerMessage(tag, rank): (sq, finite, first_stepped)}

    def step(self, rank: int, k: int, grads: dict, got: dict) -> None:
        """``STEP``: plain, ``grads``; synchronous, clipped by the global norm of every rank's ``NORM`` in
        ``got`` (skipped on NaN); post-validated, speculatively, as if no clipping were needed."""
        if self.policy == "plain":
            if self.gradient_filter is not None:
                grads = {s: tuple(self.gradient_filter(k, s, g)) for s, g in grads.items()}
            for s, g in grads.items():
                self._apply(s, g, None)
            return
        pending = self._pending[rank]
        if self.policy == "synchronous":
            shares = [got[OptimizerMessage("NORM", q)] for q in range(self.num_ranks)]
            total, all_finite = sum(sq for sq, _ in shares), all(ok for _, ok in shares)
            norm = math.sqrt(total)
            if all_finite:
                for s, g in pending["grads"].items():
                    self._apply(s, g, norm)
            self._report(k, rank, norm, all_finite, partial=None, rolled_back=False)
            return
        if pending["stepped"]:
            for s, g in pending["grads"].items():
                self._apply(s, g, None)

    def validate(self, rank: int, got: dict) -> None:
        """``VALIDATE``: check ``rank``'s speculative step against the full reduction (``FULL`` in ``got``)
        and report it; :meth:`rollback` acts on the verdict."""
        pending = self._pending[rank]
        sq, finite, first_stepped = got[OptimizerMessage("FULL", self.num_ranks - 1)]
        norm = math.sqrt(sq)
        needed = not finite or norm >= self.max_norm  # clip, or skip: what no rank assumed
        pending.update(norm=norm, finite=finite, wrong=pending["stepped"] and needed,
                       redo=first_stepped and needed)
        self._report(pending["k"], rank, norm, finite, partial=pending["partial"],
                     rolled_back=pending["wrong"])

    def rollback(self, rank: int) -> bool:
        """``ROLLBACK``: undo ``rank``'s validated step if it was wrong and redo it clipped (or not at all:
        a NaN); returns whether any rank's was (then every rank redoes its speculative work since)."""
        pending = self._pending.pop(rank)
        if pending["wrong"]:
            for s, g in pending["grads"].items():
                self._params[s], self._states[s] = self._rollback_fn(self._params[s], self._states[s], g)
                if pending["finite"]:
                    self._apply(s, g, pending["norm"])
        return pending["redo"]

    # ------------------------------------------------------------------ pieces

    def _local_norm(self, grads: dict) -> tuple[float, bool]:
        sq, finite = 0.0, True
        for s in sorted(grads):
            sums, ok = jax.device_get(self._norm_fn(grads[s]))
            sums = [v for i, v in enumerate(np.asarray(sums, np.float64)) if i not in self._repeats[s]]
            sq += float(np.sum(sums))
            finite = finite and bool(ok)
        return sq, finite

    def _apply(self, stage: int, grads: tuple, norm: float | None) -> None:
        if norm is not None:
            grads = _clip(grads, norm, self.max_norm)
        p, st = self._params[stage], self._states[stage]
        self._params[stage], self._states[stage] = adamw_step(p, st, grads, self.config)

    def _report(self, k: int, rank: int, norm: float, finite: bool, partial: float | None,
                rolled_back: bool) -> None:
        with self._lock:
            report = self.reports[k]
            report.global_norm, report.finite = norm, finite
            report.clipped = finite and norm >= self.max_norm
            if partial is not None:
                report.partial_norms[rank] = partial
            if rolled_back:
                report.rolled_back = sorted({*report.rolled_back, rank})


def guarded_run(executor, params, batches: Sequence[tuple[Any, Any]], policy: str,
                max_norm: float | None = None, config: AdamWConfig = AdamWConfig(), gradient_filter=None,
                speculative: bool = True):
    """Train ``len(batches)`` steps with the optimizer inside the rank threads; returns the per-step
    :class:`~zbpp_lite.runtime.executor.StepResult` list and the :class:`StageOptimizer`. Raises as
    :class:`StageOptimizer` and ``PipelineExecutor.run_steps``."""
    optimizer = StageOptimizer(executor, params, config, policy, max_norm, gradient_filter, speculative)
    return executor.run_steps(params, batches, optimizer), optimizer
