"""Dropout through the pipeline: each microbatch of each step draws its own mask from one seed
(``dropout_keys``), F's key is an input of F, and B and W use F's masks, kept by F or recomputed in B
inside a checkpoint. The pipeline's loss and gradients equal ``jax.grad`` of the same masked
unpartitioned model (Qi et al., arXiv 2401.10241, section 2: the split changes when gradients are
computed, never what they are), under every executor that runs stages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zbpp_lite as zb
from zbpp_lite.runtime.executor import PipelineExecutor
from zbpp_lite.runtime.spmd import SpmdExecutor
from zbpp_lite.runtime.stages import StagedModel, dropout_keys
from test_byo_model import run_one_process_per_rank

DEVICES = jax.devices()
D, CLASSES, MB, M, RATE = 8, 3, 2, 4, 0.5  # tiny: every schedule compiles fast


def embed(params, x, key):
    """A function part with dropout: ``key`` None without."""
    h = jnp.tanh(x @ params["w"])
    if key is None:
        return h
    keep = jax.random.bernoulli(key, 1 - RATE, h.shape)
    return jnp.where(keep, h / (1 - RATE), 0.0)


class Block(nnx.Module):
    """Linear, tanh, nnx.Dropout; under ``nnx.remat`` with ``remat`` (B recomputes the mask)."""

    def __init__(self, rngs: nnx.Rngs, remat: bool = False):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.dropout = nnx.Dropout(RATE, rngs=rngs)
        self.remat = remat

    def inner(self, x):
        return self.dropout(jnp.tanh(self.linear(x)))

    def __call__(self, x):
        return nnx.remat(type(self).inner)(self, x) if self.remat else self.inner(x)


class Head(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, classes: int = CLASSES):
        self.out = nnx.Linear(D, classes, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def dropout_parts() -> list:
    rngs = nnx.Rngs(0)
    w = jax.random.normal(jax.random.key(1), (D, D)) / np.sqrt(D)
    return [(embed, {"w": w}), Block(rngs), Block(rngs, remat=True), Block(rngs), Block(rngs, remat=True),
            Head(rngs)]


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(MB * M, D)).astype(np.float32), rng.integers(0, CLASSES, MB * M).astype(np.int32)


def _assert_close(got, want, tol=1e-5):
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True):
        g, r = np.asarray(g), np.asarray(r)
        assert np.abs(g - r).max() <= tol * max(np.abs(r).max(), 1e-6), jax.tree_util.keystr(path)


@pytest.mark.newest_jax
def test_each_microbatch_and_each_step_draws_its_own_mask_and_a_seed_repeats_them():
    model = StagedModel(dropout_parts(), 2, loss_fn)
    x = jnp.ones((MB, D))

    def masks(seed, step, part):
        return [np.asarray(model.apply_part(part, model.params[part], x, key) == 0)
                for key in dropout_keys(seed, step, M)]

    for part in (0, 1):  # the function's key, the NNX module's Dropout
        drawn = masks(0, 0, part) + masks(0, 1, part)
        assert all(0 < m.mean() < 1 for m in drawn)
        assert len({m.tobytes() for m in drawn}) == 2 * M  # 4 microbatches x 2 steps: 8 masks
        assert all(np.array_equal(a, b) for a, b in zip(masks(0, 1, part), masks(0, 1, part)))
    assert not np.array_equal(masks(0, 0, 1)[0], masks(0, 0, 2)[0])  # parts draw apart
    assert not np.array_equal(masks(0, 0, 1)[0], masks(1, 0, 1)[0])  # another seed, other masks
    # without a key (evaluation) nothing is dropped
    assert not np.any(np.asarray(model.apply_part(1, model.params[1], x, None)) == 0)


@pytest.mark.parametrize("executor, name", [("threads", "1f1b"), pytest.param("threads", "zb-h1", marks=pytest.mark.newest_jax),
                                            ("threads", "zb-v"), pytest.param("spmd", "zb-h1", marks=pytest.mark.newest_jax)])
def test_pipeline_gradients_equal_jax_grad_of_the_same_masked_model(executor, name):
    """BW (1f1b), B then W (zb-h1), two stages a rank (zb-v), the compiled SPMD program; blocks under
    nnx.remat recompute their masks in B from the key F kept."""
    schedule = zb.build_schedule(name, 2, M)
    model = StagedModel(dropout_parts(), schedule.num_stages, loss_fn)
    x, y = _data()
    keys = dropout_keys(7, 3, M)
    make = {"threads": PipelineExecutor, "spmd": SpmdExecutor}[executor]
    result = make(model, schedule, DEVICES[:2]).run(model.params, x, y, keys)
    ref_loss, ref_grads = jax.value_and_grad(model.loss)(model.params, x, y, keys)
    assert result.loss == pytest.approx(float(ref_loss), rel=1e-5)
    _assert_close(result.grads, ref_grads)
    # the masks are on: without them the loss is another
    assert abs(float(model.loss(model.params, x, y)) - float(ref_loss)) > 1e-3


@pytest.mark.newest_jax
def test_f_keeps_a_mask_for_b_or_a_key_that_b_recomputes_it_from():
    """Outside a checkpoint F keeps the mask (a bool array) for B; under one it keeps the key (uint32
    data, not the typed key) and B draws the same mask again."""
    x = jax.ShapeDtypeStruct((MB, D), jnp.float32)
    key = dropout_keys(0, 0, M)[0]
    for remat in (False, True):
        model = StagedModel([Block(nnx.Rngs(0), remat), Block(nnx.Rngs(1)), Head(nnx.Rngs(2))], 2, loss_fn,
                            parts=[[0], [1, 2]])
        p = tuple(jax.tree_util.tree_leaves(model.params[0]))
        _, own, _ = jax.eval_shape(model.split_stage(0, x, None, key).flat.forward, p, x, model.stage_aux(0, None, key))
        dtypes = {str(a.dtype) for a in own}
        assert ("bool" in dtypes) != remat and ("uint32" in dtypes) == remat, dtypes


def test_two_runs_under_one_seed_repeat_and_training_steps_differ():
    """run_steps over two steps, twice on fresh executors: identical losses and gradients; the
    steps' masks differ, so do their losses on one batch."""
    schedule = zb.build_schedule("zb-h1", 2, M)
    x, y = _data()
    runs = []
    for _ in range(2):
        model = StagedModel(dropout_parts(), 2, loss_fn)
        keys = [dropout_keys(5, k, M) for k in range(2)]
        runs.append(PipelineExecutor(model, schedule, DEVICES[:2]).run_steps(model.params, [(x, y)] * 2, keys=keys))
    for a, b in zip(*runs):
        assert a.loss == b.loss
        for g, h in zip(jax.tree_util.tree_leaves(a.grads), jax.tree_util.tree_leaves(b.grads)):
            assert np.array_equal(np.asarray(g), np.asarray(h))
    assert runs[0][0].loss != runs[0][1].loss


def test_dropout_keys_cross_processes_each_rank_drawing_its_own():
    """One process per rank (runtime.processes.connect): each rank's executor puts its own stages' keys;
    the gradients are the masked model's."""
    schedule = zb.build_schedule("zb-h1", 2, M)
    model = StagedModel(dropout_parts(), 2, loss_fn)
    x, y = _data()
    keys = dropout_keys(7, 3, M)
    results = run_one_process_per_rank(model, schedule, lambda executor: executor.run(model.params, x, y, keys))
    ref_loss, ref_grads = jax.value_and_grad(model.loss)(model.params, x, y, keys)
    assert results[1].loss == pytest.approx(float(ref_loss), rel=1e-5)
    for s in range(2):
        for i in model.parts[s]:
            _assert_close(results[s].grads[i], ref_grads[i])


def test_what_cannot_run_is_refused_in_one_line_saying_what_to_do():
    schedule = zb.build_schedule("zb-h1", 2, M)
    model = StagedModel(dropout_parts(), 2, loss_fn)
    x, y = _data()
    refusals = [
        (lambda: PipelineExecutor(model, schedule, DEVICES[:2]).run(model.params, x, y),
         r"parts \[0, 1, 2, 3, 4\] use dropout: pass the step's dropout_keys\(seed, step, 4\) as keys"),
        (lambda: SpmdExecutor(model, schedule, DEVICES[:2]).run(model.params, x, y),
         r"parts \[0, 1, 2, 3, 4\] use dropout: .* or build the StagedModel with deterministic=True"),
        (lambda: PipelineExecutor(model, schedule, DEVICES[:2]).run(model.params, x, y, dropout_keys(0, 0, 2)),
         r"keys must be one dropout_keys\(seed, step, 4\) per step"),
        (lambda: StagedModel([Block(nnx.Rngs(0)), nnx.Sequential(nnx.Dropout(0.1)), Head(nnx.Rngs(1))], 1),
         r"module 1 \(Sequential\) has an nnx.Dropout without rngs; build it with nnx.Dropout\(rate, rngs=rngs\)"),
        (lambda: StagedModel([(embed, {"key": jax.random.key(0)}), Block(nnx.Rngs(0)), Head(nnx.Rngs(1))], 1),
         r"part 0: parameters must be floating-point .* take the key as an argument, fn\(params, x, key\)"),
        (lambda: StagedModel([(lambda params, x, rng: embed(params, x), {}), Block(nnx.Rngs(0)), Head(nnx.Rngs(1))], 1),
         r"part 0: fn\(params, x, rng\) is called as fn\(params, x\), or fn\(params, x, key\) for dropout: "
         r"take exactly those, the key third and named 'key'$"),
        *[(lambda f=f: StagedModel([(f, {}), Block(nnx.Rngs(0)), Head(nnx.Rngs(1))], 1), r"part 0: fn\(.*\) is called as")
          for f in (lambda params, x, *, key: x, lambda params, x, key, extra: x, lambda key, params, x: x,
                    lambda params, x, rng=None: x)],  # rng=None: dropout never applied, without a word
        (lambda: StagedModel([nnx.BatchNorm(D, rngs=nnx.Rngs(0)), Block(nnx.Rngs(0)), Head(nnx.Rngs(1))], 1),
         r"module 0 \(BatchNorm\) holds state other than parameters and RNG streams"),
    ]
    for call, message in refusals:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert len(str(err.value).splitlines()) == 1


def test_deterministic_runs_without_dropout_and_without_keys():
    schedule = zb.build_schedule("zb-h1", 2, M)
    model = StagedModel(dropout_parts(), 2, loss_fn, deterministic=True)
    x, y = _data()
    result = PipelineExecutor(model, schedule, DEVICES[:2]).run(model.params, x, y)
    ref_loss, ref_grads = jax.value_and_grad(model.loss)(model.params, x, y)
    assert result.loss == pytest.approx(float(ref_loss), rel=1e-5)
    _assert_close(result.grads, ref_grads)
    keyed = PipelineExecutor(model, schedule, DEVICES[:2]).run(model.params, x, y, dropout_keys(0, 0, M))
    assert keyed.loss == result.loss  # keys given to a deterministic model are unused


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_training_draws_each_steps_keys_from_the_runs_seed(max_grad_norm):
    """train_steps (the loop of train and launch; with max_grad_norm the optimizer in the rank threads,
    run_steps) on the digits with dropout: the first step equals the masked unpartitioned model's, and a
    second run under the same seed repeats every loss."""
    from zbpp_lite.training.model import ModelConfig, RunConfig
    from zbpp_lite.training.train import train_steps

    def pixels(params, x, key):  # digits (b, 8, 8) -> (b, D), with dropout
        return embed(params, x.reshape(len(x), -1), key)

    schedule = zb.build_schedule("zb-h1", 2, M)
    run = RunConfig(batch=2 * M, max_grad_norm=max_grad_norm)
    losses = []
    for _ in range(2):
        rngs = nnx.Rngs(0)
        parts = [(pixels, {"w": jax.random.normal(jax.random.key(1), (64, D)) / 8}), Block(rngs),
                 Block(rngs, remat=True), Head(rngs, classes=10)]
        executor = PipelineExecutor(StagedModel(parts, 2), schedule, DEVICES[:2])
        result = train_steps(executor, 3, ModelConfig(), run)
        assert result.grad_max_rel_error < 1e-5 and result.loss_error < 1e-5
        losses.append(result.losses)
    assert losses[0] == losses[1]
