"""Tied weights: one embedding matrix used by the first stage (the token lookup) and by the last (the
head's logits ``h E^T``), as GPT-2 does (Press & Wolf, arXiv 1608.05859). The parts hold the same
array (one dict in two ``(fn, params)`` pairs, or one ``nnx.Embed`` in two modules); the staged model
records the tie, and every pipeline gives each copy the tied parameter's whole gradient (the sum of
the copies' shares), so AdamW keeps the copies equal and trains as Optax on the tied model does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zbpp_lite as zb
from zbpp_lite.runtime.executor import PipelineExecutor, run_schedule
from zbpp_lite.runtime.spmd import SpmdExecutor
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.runtime.stages import dropout_keys as zb_dropout_keys
from zbpp_lite.training.model import RunConfig
from zbpp_lite.training.postval.optimizer import guarded_run
from zbpp_lite.training.postval.rollback import AdamWConfig
from zbpp_lite.training.train import StageAdamW, train_step

DEVICES = jax.devices()
V, D, BLOCKS, MB = 12, 8, 4, 2  # vocabulary (= classes), width, blocks, samples per microbatch
RUN = RunConfig(lr=0.05, weight_decay=0.1)  # large steps: an untied copy drifts visibly in 3 of them


def lookup(params, tokens):
    return params["embedding"][tokens]


def block(params, h):
    return jnp.tanh(h @ params["w"] + params["b"])


def logits_of(params, h):
    return h @ params["embedding"].T


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _blocks() -> list:
    keys = jax.random.split(jax.random.key(1), BLOCKS)
    return [{"w": jax.random.normal(k, (D, D)) / np.sqrt(D), "b": jnp.full((D,), 0.1)} for k in keys]


def _embedding():
    return 0.5 * jax.random.normal(jax.random.key(0), (V, D))


def function_parts() -> list:
    """``[(lookup, pE), (block, ...) x 4, (logits_of, pE)]``: one dict in both places."""
    shared = {"embedding": _embedding()}
    return [(lookup, shared), *[(block, p) for p in _blocks()], (logits_of, shared)]


class Head(nnx.Module):
    """The logits from the (shared) embedding module: ``h E^T``."""

    def __init__(self, embed: nnx.Embed):
        self.embed = embed

    def __call__(self, h):
        return self.embed.attend(h)


def module_parts() -> list:
    """One ``nnx.Embed`` as the first module and inside the last."""
    embed = nnx.Embed(V, D, embedding_init=lambda key, shape, dtype=jnp.float32: _embedding(), rngs=nnx.Rngs(0))
    return [embed, *[(block, p) for p in _blocks()], Head(embed)]


def tied_loss(params, tokens, labels):
    """The tied model written out by hand: ONE embedding parameter, the reference for jax.grad and Optax."""
    h = params["embedding"][tokens]
    for p in params["blocks"]:
        h = block(p, h)
    return loss_fn(h @ params["embedding"].T, labels)


def _start() -> dict:
    return {"embedding": _embedding(), "blocks": _blocks()}


def _batch(m: int, k: int = 0):
    rng = np.random.default_rng(k)
    return rng.integers(0, V, MB * m).astype(np.int32), rng.integers(0, V, MB * m).astype(np.int32)


def _copies(model: StagedModel, params) -> list:
    """Each copy of the tied embedding, as NumPy."""
    (tie,) = model.ties
    return [np.asarray(jax.tree_util.tree_leaves(params[part])[leaf]) for part, leaf, _ in tie.copies]


def _close(got, want, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert np.abs(got - want).max() <= tol * np.abs(want).max(), np.abs(got - want).max()


PARTS = {"functions": function_parts, "nnx": module_parts}


@pytest.mark.parametrize("form", list(PARTS))
def test_the_staged_model_records_the_tie_and_its_loss_treats_it_as_one_parameter(form):
    model = StagedModel(PARTS[form](), 2, loss_fn)
    (tie,) = model.ties
    assert [part for part, _, _ in tie.copies] == [0, BLOCKS + 1]
    assert tie.describe().startswith(f"parts 0 and {BLOCKS + 1} share one array (part 0 at ")
    assert model.tied_leaves() == (((0, 0), (1, 2 * (BLOCKS // 2))),)  # after the last stage's blocks' w, b
    x, y = _batch(4)
    ref_loss, ref = jax.value_and_grad(tied_loss)(_start(), x, y)
    loss, grads = jax.value_and_grad(model.loss)(model.params, x, y)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for copy in _copies(model, grads):  # every copy: the tied parameter's whole gradient
        _close(copy, ref["embedding"])
    assert not StagedModel(function_parts()[:-1] + [(logits_of, {"embedding": _embedding()})], 2, loss_fn).ties


@pytest.mark.parametrize("form", list(PARTS))
@pytest.mark.parametrize("name, p, executor", [("zb-h1", 2, "threads"), ("zb-v", 2, "threads"), ("1f1b", 2, "spmd"),
                                               pytest.param("zb-v", 2, "spmd", marks=pytest.mark.newest_jax)])
def test_every_copy_gets_the_tied_gradient(form, name, p, executor):
    """Across ranks (zb-h1: the first and last stage on ranks 0 and 1) and on one rank (zb-v's V puts
    both on rank 0): each copy's gradient is jax.grad of the tied model, not its own share."""
    m = 4
    schedule = zb.build_schedule(name, p, m)
    model = StagedModel(PARTS[form](), schedule.num_stages, loss_fn)
    x, y = _batch(m)
    result = run_schedule(schedule, model, x, y, devices=DEVICES[:p], executor=executor)
    ref_loss, ref = jax.value_and_grad(tied_loss)(_start(), x, y)
    assert result.loss == pytest.approx(float(ref_loss), rel=1e-5)
    copies = _copies(model, result.grads)
    assert np.array_equal(copies[0], copies[1])
    _close(copies[0], ref["embedding"])
    for i, r in enumerate(ref["blocks"], start=1):
        _close(result.grads[i]["w"], r["w"])
    if executor == "threads":  # the exchange is in the step's result: a send each way across ranks
        ranks = {schedule.placement[0], schedule.placement[-1]}
        assert sorted(t.rank for t in result.tie_sums) == sorted(ranks)
        assert all(t.ranks == tuple(sorted(ranks)) and t.nbytes == V * D * 4 and t.end >= t.start
                   for t in result.tie_sums)


def _optax_steps(steps: int, batches: list, clip: float | None = None) -> dict:
    """``steps`` AdamW steps of Optax on the tied model (one embedding parameter)."""
    opt = AdamWConfig(learning_rate=RUN.lr, weight_decay=RUN.weight_decay).optimizer()
    if clip is not None:
        opt = optax.chain(optax.clip_by_global_norm(clip), opt)
    params = _start()
    state = opt.init(params)
    for x, y in batches[:steps]:
        updates, state = opt.update(jax.grad(tied_loss)(params, x, y), state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("form", list(PARTS))
def test_three_adamw_steps_train_the_tied_model_as_optax_does(form):
    """The one training step (train_step: the executor's run, then AdamW per stage) three times: the two
    copies stay equal and match Optax's AdamW on the tied model."""
    m = 4
    schedule = zb.build_schedule("zb-h1", 2, m)
    model = StagedModel(PARTS[form](), 2, loss_fn)
    executor = PipelineExecutor(model, schedule, DEVICES[:2])
    adamw = StageAdamW(model.params, RUN).place(model, dict(enumerate(executor.stage_devices)))
    batches = [_batch(m, k) for k in range(3)]
    for x, y in batches:
        train_step(executor, adamw, x, y)
    want = _optax_steps(3, batches)
    copies = _copies(model, adamw.params)
    assert np.array_equal(copies[0], copies[1])
    _close(copies[0], want["embedding"], 1e-4)
    for i, r in enumerate(want["blocks"], start=1):
        _close(adamw.params[i]["w"], r["w"], 1e-4)


@pytest.mark.parametrize("policy, clip", [("plain", None), ("synchronous", 0.05), ("post-validation", 0.05)])
def test_adamw_in_the_rank_threads_counts_the_tie_once_in_the_global_norm(policy, clip):
    """The optimizer inside the rank threads (StageOptimizer): plain, and clipped by a global norm small
    enough to clip every step (synchronously, or post-validated: every speculative step rolled back and
    redone), which must count the tied parameter once, as optax.clip_by_global_norm on the tied model does."""
    m = 4
    schedule = zb.build_schedule("zb-h1", 2, m)
    model = StagedModel(function_parts(), 2, loss_fn)
    executor = PipelineExecutor(model, schedule, DEVICES[:2])
    batches = [_batch(m, k) for k in range(3)]
    config = AdamWConfig(learning_rate=RUN.lr, weight_decay=RUN.weight_decay)
    _, optimizer = guarded_run(executor, model.params, batches, policy, clip, config)
    if clip is not None:
        assert all(r.clipped for r in optimizer.reports)
    want = _optax_steps(3, batches, clip)
    params = optimizer.params()
    tied = model.tied_leaves()[0]
    (s0, i0), (s1, i1) = tied
    assert np.array_equal(np.asarray(params[s0][i0]), np.asarray(params[s1][i1]))
    _close(params[s0][i0], want["embedding"], 1e-4)


def test_the_copies_gradients_cross_processes_through_the_shared_memory_rings():
    """One executor per rank (zbpp_lite.runtime.processes), linked by a socket and shared-memory rings:
    each rank sends its copy's share to the other, and both copies get the tied gradient."""
    from test_byo_model import run_one_process_per_rank

    m = 3
    schedule = zb.build_schedule("zb-h1", 2, m)
    model = StagedModel(function_parts(), 2, loss_fn)
    x, y = _batch(m)
    results = run_one_process_per_rank(model, schedule, lambda executor: executor.run(model.params, x, y))
    ref = jax.grad(tied_loss)(_start(), x, y)
    (tie,) = model.ties  # the first part's copy on rank 0, the last part's on rank 1
    copies = [np.asarray(jax.tree_util.tree_leaves(results[r].grads[part])[leaf]) for r, (part, leaf, _) in enumerate(tie.copies)]
    assert np.array_equal(copies[0], copies[1])
    _close(copies[0], ref["embedding"])
    assert [t.rank for t in results[0].tie_sums + results[1].tie_sums] == [0, 1]


def test_two_ties_one_of_them_inside_a_stage():
    """Blocks 1 and 2 share one dict (both in stage 0 of zb-h1, so on one rank) beside the embedding tie:
    two ties, each copy with its tie's gradient."""
    blocks = _blocks()
    blocks[1] = blocks[0]
    shared = {"embedding": _embedding()}
    model = StagedModel([(lookup, shared), *[(block, p) for p in blocks], (logits_of, shared)], 2, loss_fn)
    assert [[part for part, _, _ in tie.copies] for tie in model.ties] == [[0, 5], [1, 2], [1, 2]]  # w, b
    assert model.ties[1].describe().startswith("parts 1 and 2 share one array (part 1 at ['b'], part 2 at ['b']")
    m = 4
    x, y = _batch(m)
    result = run_schedule(zb.build_schedule("zb-h1", 2, m), model, x, y, devices=DEVICES[:2])
    ref = jax.grad(tied_loss)({"embedding": _embedding(), "blocks": blocks}, x, y)  # blocks' shares apart
    for i in (1, 2):
        for key in ("w", "b"):  # d/dp L(p, p) = the two uses' shares summed
            _close(result.grads[i][key], ref["blocks"][0][key] + ref["blocks"][1][key])
    _close(result.grads[0]["embedding"], ref["embedding"])
    _close(result.grads[5]["embedding"], ref["embedding"])
    same = StagedModel([(lookup, {"embedding": _embedding(), "again": shared["embedding"]}), *[(block, p) for p in _blocks()],
                        (logits_of, shared)], 2, loss_fn)
    assert same.ties[0].describe().startswith("parts 0 and 5 share one array (part 0 at ['again'], part 5")
    one_part = StagedModel([(lookup, {"embedding": shared["embedding"], "again": shared["embedding"]}),
                            *[(block, p) for p in _blocks()], (logits_of, {"embedding": _embedding()})], 2, loss_fn)
    assert one_part.ties[0].describe() == ("part 0 holds one array in 2 places (part 0 at ['again'], part 0 at "
                                           "['embedding']; tied weights)")


def dropout_block(params, h, key):
    """A block with dropout (rate 0.25) after its tanh: the masks come from the microbatch's key."""
    y = jnp.tanh(h @ params["w"] + params["b"])
    if key is None:  # dropout off (no keys: evaluation)
        return y
    keep = jax.random.bernoulli(key, 0.75, y.shape)
    return jnp.where(keep, y / 0.75, 0.0)


@pytest.mark.parametrize("name, executor", [pytest.param("zb-h1", "threads", marks=pytest.mark.newest_jax),
                                             ("zb-v", "threads"), ("zb-h1", "spmd")])
def test_tied_weights_with_dropout_equal_jax_grad_of_the_same_masked_tied_model(name, executor):
    """Ties and dropout together (a GPT-style model has both): every copy's gradient is jax.grad of the
    unpartitioned model's loss with the same keys, whose tied copies are one parameter."""
    m = 4
    schedule = zb.build_schedule(name, 2, m)
    shared = {"embedding": _embedding()}
    parts = [(lookup, shared), *[(dropout_block, p) for p in _blocks()], (logits_of, shared)]
    model = StagedModel(parts, schedule.num_stages, loss_fn)
    assert model.ties and model.random_parts
    x, y = _batch(m)
    keys = zb_dropout_keys(7, 0, m)
    if executor == "spmd":
        result = SpmdExecutor(model, schedule, DEVICES[:2]).run(model.params, x, y, keys)
    else:
        result = PipelineExecutor(model, schedule, DEVICES[:2]).run(model.params, x, y, keys)
    ref_loss, ref = jax.value_and_grad(model.loss)(model.params, x, y, keys)
    assert float(ref_loss) != pytest.approx(float(model.loss(model.params, x, y)), rel=1e-3)  # masks are on
    assert result.loss == pytest.approx(float(ref_loss), rel=1e-5)
    copies = _copies(model, result.grads)
    assert np.array_equal(copies[0], copies[1])
    _close(copies[0], _copies(model, ref)[0])
    for i in range(1, BLOCKS + 1):
        _close(result.grads[i]["w"], ref[i]["w"])
