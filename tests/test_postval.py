"""Post-validation (paper section 4): speculative per-rank optimizer steps on partial reductions,
validated and rolled back, give the synchronous step's parameters (within the rollback bound)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite.training.data import load_digits
from zbpp_lite.runtime.executor import PipelineExecutor
from zbpp_lite.training.model import ModelConfig, build_parts
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.training.postval.reference import post_validated_step, step_makespans, synchronous_step
from zbpp_lite.training.postval.rollback import AdamWConfig


def _max_rel(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(y)).max(), 1e-30))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))


# spike 100: 1e-3, not 2e-4. The rollback's error grows as k^2 (k = norm / max_norm, ~3.3 and ~33),
# so (100 / 10)^2 times spike 10's 1e-5; measured 1.07e-4 (spike 10: 1.04e-6), a rounding draw
# amplified per entry, which another CPU's rounding may double. Steps left unclipped end 0.88 of
# the parameters' scale away (measured); a missed redo is a step of ~lr = 1e-2.
@pytest.mark.parametrize("name, spike, tolerance", [("zb-h2", 10.0, 1e-5), ("zb-v", 10.0, 1e-5), ("zb-h2", 100.0, 1e-3)])
def test_post_validation_equals_the_synchronous_step_with_clipping_and_a_nan(name, spike, tolerance):
    schedule = zb.build_schedule(name, 2, 4)
    model = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=4)), schedule.num_stages)
    executor = PipelineExecutor(model, schedule, jax.devices()[:2])
    data = load_digits(0.2, 0)
    cfg = AdamWConfig(learning_rate=1e-2)
    S = schedule.num_stages
    init = [model.stage_params(model.params, s) for s in range(S)]
    runs = {"sync": [list(init), [cfg.optimizer().init(p) for p in init]],
            "postval": [list(init), [cfg.optimizer().init(p) for p in init]]}
    reports = {"sync": [], "postval": []}
    max_norm = None
    for k in range(5):
        x, y = data.batch(k, 32)
        grads = [model.stage_params(executor.run(model.join_stage_params(runs["sync"][0]), x, y).grads, s) for s in range(S)]
        grads = [jax.device_put(g, jax.devices()[0]) for g in grads]
        if max_norm is None:  # three times the first step's norm: ordinary steps are not clipped
            max_norm = 3.0 * float(jnp.sqrt(sum(jnp.sum(jnp.square(v)) for g in grads for v in jax.tree_util.tree_leaves(g))))
        if k == 1:  # a gradient spike: clipping must trigger
            grads = jax.tree_util.tree_map(lambda g: spike * g, grads)
        if k == 3:  # a NaN on the last rank's first stage: the step must be skipped everywhere
            bad = schedule.stages_of(1)[0]
            grads[bad] = jax.tree_util.tree_map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads[bad])
        runs["sync"][0], runs["sync"][1], rs = synchronous_step(*runs["sync"], grads, cfg, max_norm)
        runs["postval"][0], runs["postval"][1], rp = post_validated_step(*runs["postval"], grads, cfg, max_norm, schedule.placement)
        reports["sync"].append(rs)
        reports["postval"].append(rp)
    assert [r.clipped for r in reports["sync"]] == [False, True, False, False, False]
    assert [r.finite for r in reports["sync"]] == [True, True, True, False, True]
    rolled = [r.rolled_back for r in reports["postval"]]
    assert rolled[0] == [] and rolled[2] == [] and rolled[4] == []
    assert rolled[1] == [0, 1]  # both ranks stepped unclipped and were wrong
    assert rolled[3] == [0]  # rank 0 stepped before the NaN on rank 1 was known
    # the rollback's float32 error (zbpp_lite.training.postval.reference docstring) grows with (spike norm / max_norm)^2
    assert _max_rel(runs["postval"][0], runs["sync"][0]) < tolerance
    assert [int(s[0].count) for s in runs["postval"][1]] == [int(s[0].count) for s in runs["sync"][1]] == [4] * S


def test_bad_arguments_are_refused():
    p = [{"w": jnp.ones(2)}]
    s = [AdamWConfig().optimizer().init(p[0])]
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        synchronous_step(p, s, p, AdamWConfig(), 0.0)
    with pytest.raises(ValueError, match="one entry per stage"):
        post_validated_step(p, s, p + p, AdamWConfig(), 1.0, (0,))


def test_post_validation_removes_zb_h2s_synchronisation_bubble_in_the_simulator():
    p = 4
    t = zb.simulate(zb.build_schedule("zb-h2", p, 12))
    spans = step_makespans(t, [0.5] * p, reduce_seconds=0.25)
    assert spans["post_validation"] == pytest.approx(t.makespan + 0.5)
    assert spans["synchronous"] == pytest.approx(t.global_span + 0.25 + 0.5)
    assert spans["synchronous"] - spans["post_validation"] == pytest.approx((p - 1) * 1.0 + 0.25)
