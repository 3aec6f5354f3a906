"""The single-device baseline: the unpartitioned model's step, with or without microbatches, and
the same losses as the pipeline's training from the same start."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from zbpp_lite.training.data import load_digits
from zbpp_lite.training.model import ModelConfig, build_parts
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.training.reference import make_step, max_relative_error, one_rank_schedule, step_stats, train_baseline
from zbpp_lite.training.train import RunConfig, TrainOptions, train

DEVICES = jax.devices()


def _model() -> StagedModel:
    return StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=2)), 1)


def _reference_step(model, optimizer, params, state, x, y):
    """value_and_grad and the optax update, written out (nothing shared with make_step)."""
    loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, x, y)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, float(loss)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_one_step_is_value_and_grad_then_the_update(microbatches):
    """With SGD at learning rate 1 the step moves the parameters by exactly minus the gradient, so
    the (accumulated) gradient is checked leaf by leaf; AdamW (whose first step is about
    lr * sign(g)) is checked on the whole batch."""
    model = _model()
    x, y = load_digits(0.0, 0).batch(0, 16)
    # AdamW with lr 1e-1 and eps 1e-3, not PyTorch's 1e-3 and 1e-8: the delta new - old is checked
    # relative to its size, and each program rounds p - step to one ulp of |p| <= 1, which is 1.2e-4
    # of a 1e-3 step (1.49e-5 measured, over 1e-4 for one flipped bit) but 1.2e-6 of a 1e-1 step
    # (1.23e-6 measured); eps 1e-3 keeps the rounding of a near-zero gradient (the attention key
    # bias's, exactly 0) from becoming a +-lr step where the two programs round it differently
    for optimizer in (optax.sgd(1.0), optax.adamw(1e-1, b1=0.9, b2=0.999, eps=1e-3, weight_decay=0.01)):
        ref_params, _, ref_loss = _reference_step(model, optimizer, model.params, optimizer.init(model.params), x, y)
        params = jax.tree_util.tree_map(lambda a: a.copy(), model.params)  # the step consumes what it is given
        new_params, _, loss = make_step(model, optimizer, microbatches)(params, optimizer.init(params), x, y)
        # 1e-5 of the loss, as the executor's checks, not 1e-6: 4 microbatch means averaged against one
        # mean of 16, each sample's cross-entropy in another program, ~10 roundings of u apart at worst
        # (1.9e-7 measured, 5x under 1e-6); a wrong microbatch or a sum for a mean is O(1) away
        assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
        delta = jax.tree_util.tree_map(lambda a, b: a - b, new_params, model.params)
        ref_delta = jax.tree_util.tree_map(lambda a, b: a - b, ref_params, model.params)
        assert max_relative_error(delta, ref_delta) < 1e-4
        if microbatches > 1:
            break  # Adam's sign-like first step turns rounding of near-zero gradients into +-lr


def test_the_baseline_trains_like_the_pipeline_from_the_same_start():
    data = load_digits(0.2, 0)
    base = train_baseline(3, model=ModelConfig(d=16, heads=2, blocks=2), run=RunConfig(batch=8), device=DEVICES[0], data=data)
    piped = train("zb-h1", 2, 4, 3, model=ModelConfig(d=16, heads=2, blocks=2), run=RunConfig(batch=8, check_grads=False),
                  options=TrainOptions(devices=DEVICES[:2], data=data))
    np.testing.assert_allclose(base.losses, piped.losses, rtol=1e-5)
    assert base.losses[-1] < base.losses[0]
    assert len(base.step_seconds) == 3 and all(s > 0 for s in base.step_seconds)
    assert abs(base.test_loss - piped.test_loss) < 1e-4


def test_bad_sizes_are_refused_before_any_compute():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        train_baseline(0)
    with pytest.raises(ValueError, match="does not divide into 3 microbatches"):
        train_baseline(1, run=RunConfig(batch=8), microbatches=3)
    with pytest.raises(ValueError, match="no timed steps"):
        step_stats([0.1, 0.2], warmup=2)
    assert step_stats([9.0, 0.002, 0.001, 0.004], warmup=1) == {"median_ms": 2.0, "min_ms": 1.0, "step_ms": [2.0, 1.0, 4.0]}


def test_the_one_rank_schedule_is_gpipe_on_rank_0_among_idle_ranks():
    """compare's executor reference: the whole model as one stage on rank 0 (GPipe's order), the
    other ranks without an action, so it can take its turns among p-rank pipelines."""
    import zbpp_lite as zb

    s = one_rank_schedule(3, 4)
    zb.validate(s)
    assert s.num_ranks == 3 and s.num_stages == 1 and s.name == "one-rank reference"
    assert [str(a) for a in s.actions[0]] == [str(a) for a in zb.build_schedule("gpipe", 1, 4).actions[0]]
    assert s.actions[1] == () and s.actions[2] == ()
