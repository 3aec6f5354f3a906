"""Bring your own model: a model that is not ours, written as people write it, pipelined.

An MLP with a residual connection whose stages pass a tuple ``(hidden, residual)`` (and a dict),
given as plain functions with their parameters and as NNX modules: every schedule's loss and
gradients equal ``jax.grad`` of the whole model (Qi et al., arXiv 2401.10241, section 2: the
split changes when gradients are computed, never what they are)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zbpp_lite as zb
from zbpp_lite.runtime.executor import PipelineExecutor
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.schedules.builders import options_of

DEVICES = jax.devices()
D, CLASSES, MB = 8, 4, 2  # width, classes, samples per microbatch: tiny, so every schedule compiles fast


def embed(params, x):
    """x (b, D) -> (hidden, residual), both (b, D)."""
    h = jnp.tanh(x @ params["w"] + params["b"])
    return h, h


def residual_block(params, hr):
    """(hidden, residual) -> (residual + tanh(hidden W + b), hidden): the skip path crosses stages."""
    h, r = hr
    return r + jnp.tanh(h @ params["w"] + params["b"]), h


class Head(nnx.Module):
    """An NNX module beside the functions: (hidden, residual) -> logits (b, CLASSES)."""

    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(D, CLASSES, rngs=rngs)

    def __call__(self, hr):
        h, r = hr
        return self.out(h + r)


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _dense(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (D, D), jnp.float32) / np.sqrt(D), "b": 0.1 * jax.random.normal(k2, (D,), jnp.float32)}


def byo_parts(num_blocks: int) -> list:
    keys = jax.random.split(jax.random.key(0), num_blocks + 1)
    return [(embed, _dense(keys[0])), *[(residual_block, _dense(k)) for k in keys[1:]], Head(nnx.Rngs(1))]


def whole_model_loss(params, x, labels):
    """The model written out by hand, as its author would: the reference for jax.grad."""
    hr = embed(params[0], x)
    for p in params[1:-1]:
        hr = residual_block(p, hr)
    head = params[-1]
    logits = (hr[0] + hr[1]) @ head["out"]["kernel"][...] + head["out"]["bias"][...]
    return loss_fn(logits, labels)


def _data(m: int):
    rng = np.random.default_rng(0)
    return rng.normal(size=(MB * m, D)).astype(np.float32), rng.integers(0, CLASSES, MB * m).astype(np.int32)


def _build(name: str, p: int, m: int) -> zb.Schedule:
    options = {}
    for key, default in options_of(name).items():
        if default is inspect.Parameter.empty:
            options[key] = {"costs": zb.Costs(), "memory_limit": 2.0 * p}[key]
    return zb.build_schedule(name, p, m, **options)


def _assert_close(got, want, tol=1e-5):
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True):
        g, r = np.asarray(g), np.asarray(r)
        assert np.abs(g - r).max() <= tol * max(np.abs(r).max(), 1e-6), jax.tree_util.keystr(path)


@pytest.mark.parametrize("name", list(zb.SCHEDULES))
def test_every_schedule_pipelines_a_residual_mlp_passing_tuples(name):
    p, m = 2, 4
    schedule = _build(name, p, m)
    model = StagedModel(byo_parts(4), schedule.num_stages, loss_fn)
    assert isinstance(model.stage_inputs(np.zeros((MB, D), np.float32))[1], tuple)
    x, y = _data(m)
    result = PipelineExecutor(model, schedule, DEVICES[:p]).run(model.params, x, y)
    ref_loss, ref_grads = jax.value_and_grad(whole_model_loss)(model.params, x, y)
    assert result.loss == pytest.approx(float(ref_loss), rel=1e-5)
    _assert_close(result.grads, ref_grads)
    # and the staged model's own unpartitioned loss agrees with the hand-written one
    assert float(model.loss(model.params, x, y)) == pytest.approx(float(ref_loss), rel=1e-6)


def test_a_stage_may_pass_a_dict():
    def first(params, x):
        h = jnp.tanh(x @ params["w"] + params["b"])
        return {"hidden": h, "skip": 2.0 * h}

    def last(params, d):
        return (d["hidden"] * d["skip"]) @ params["w"][:, :CLASSES] + params["b"][:CLASSES]

    keys = jax.random.split(jax.random.key(3))
    model = StagedModel([(first, _dense(keys[0])), (last, _dense(keys[1]))], 2, loss_fn, parts=[[0], [1]])
    x, y = _data(3)
    result = PipelineExecutor(model, zb.build_schedule("zb-h1", 2, 3), DEVICES[:2]).run(model.params, x, y)
    ref_loss, ref_grads = jax.value_and_grad(lambda ps: loss_fn(last(ps[1], first(ps[0], x)), y))(model.params)
    assert result.loss == pytest.approx(float(ref_loss), rel=1e-5)
    _assert_close(result.grads, ref_grads)


def test_a_part_that_is_neither_a_module_nor_a_function_pair_is_refused():
    with pytest.raises(ValueError, match=r"part 1 is a dict; expected an nnx.Module or a pair \(fn, params\)"):
        StagedModel([(embed, _dense(jax.random.key(0))), {"w": 1.0}, Head(nnx.Rngs(0))], 1, loss_fn)
    with pytest.raises(ValueError, match="part 0: parameters must be floating-point arrays"):
        StagedModel([(embed, {"w": np.ones((2, 2), np.int32)}), (residual_block, _dense(jax.random.key(0))), Head(nnx.Rngs(0))], 1, loss_fn)


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_spmd_pipelines_tuple_activations(name):
    """One SPMD program: every buffer of activations and their gradients holds one array per leaf
    of the tuple (hidden, residual); loss and gradients are jax.grad's of the whole model."""
    from zbpp_lite.runtime.spmd import SpmdExecutor

    m = 4
    schedule = zb.build_schedule(name, 2, m)
    model = StagedModel(byo_parts(schedule.num_stages), schedule.num_stages, loss_fn)  # one block a stage
    x, y = _data(m)
    result = SpmdExecutor(model, schedule, DEVICES[:2]).run(model.params, x, y)
    ref_loss, ref_grads = jax.value_and_grad(whole_model_loss)(model.params, x, y)
    assert result.loss == pytest.approx(float(ref_loss), rel=1e-5)
    _assert_close(result.grads, ref_grads)


def test_a_debug_callback_in_a_stage_runs_once_per_f_in_a_pipeline():
    """jax.debug.callback inside a stage: once for each F of that stage, never in B, W or BW."""
    calls: list = []

    def noisy_block(params, hr):
        jax.debug.callback(lambda v: calls.append(float(v)), hr[0].sum())
        return residual_block(params, hr)

    keys = jax.random.split(jax.random.key(5), 3)
    parts = [(embed, _dense(keys[0])), (noisy_block, _dense(keys[1])), (residual_block, _dense(keys[2])), Head(nnx.Rngs(2))]
    m = 3
    x, y = _data(m)
    for name in ("1f1b", "zb-h1"):  # fused BW, then split B and W
        model = StagedModel(parts, 2, loss_fn)
        executor = PipelineExecutor(model, zb.build_schedule(name, 2, m), DEVICES[:2])
        executor.run(model.params, x, y)  # compiles (and warms up: untimed F's also call back)
        jax.effects_barrier()
        calls.clear()
        result = executor.run(model.params, x, y)
        jax.effects_barrier()
        assert len(calls) == m, name  # stage 0 holds the noisy block: one call per F of stage 0
        ref_loss, ref_grads = jax.value_and_grad(whole_model_loss)(model.params, x, y)
        assert result.loss == pytest.approx(float(ref_loss), rel=1e-5)
        _assert_close(result.grads, ref_grads)


def run_one_process_per_rank(model: StagedModel, schedule: zb.Schedule, run) -> dict:
    """``{rank: run(executor)}`` for a 2-rank schedule, each rank its own executor on the one-process-per-rank
    path (zbpp_lite.runtime.processes.connect) over a real socket and shared-memory ring pair (here both
    ends in one process)."""
    import socket
    import threading
    from multiprocessing.shared_memory import SharedMemory

    from zbpp_lite.runtime.processes import connect, disconnect

    assert schedule.num_ranks == 2
    rings = [SharedMemory(create=True, size=1 << 20) for _ in range(2)]
    a, b = (end.detach() for end in socket.socketpair())
    peers = [{"1": {"fd": a, "out": rings[0].name, "in": rings[1].name}}, {"0": {"fd": b, "out": rings[1].name, "in": rings[0].name}}]
    try:
        executors = [connect(peers[r], lambda transport, r=r: PipelineExecutor(model, schedule, [DEVICES[r]], ranks=[r], transport=transport))
                     for r in range(2)]
        results: dict = {}
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, run(executors[r]))) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for r in range(2):
            disconnect(peers[r])
    finally:
        for ring in rings:
            ring.close()
            ring.unlink()
    assert set(results) == {0, 1}
    return results


def test_tuple_activations_cross_processes_through_the_shared_memory_rings():
    """The one-process-per-rank path (zbpp_lite.runtime.processes.connect): each rank its own
    executor, a tuple activation and its input gradient sent as their leaves through a real socket
    and shared-memory ring pair (here both ends in one process), unflattened by the receiver."""
    m = 3
    schedule = zb.build_schedule("zb-h1", 2, m)
    model = StagedModel(byo_parts(2), 2, loss_fn)
    x, y = _data(m)
    results = run_one_process_per_rank(model, schedule, lambda executor: executor.run(model.params, x, y))
    ref_loss, ref_grads = jax.value_and_grad(whole_model_loss)(model.params, x, y)
    assert results[1].loss == pytest.approx(float(ref_loss), rel=1e-5)
    for s in range(2):
        for i in model.parts[s]:
            _assert_close(results[s].grads[i], ref_grads[i])


def test_the_distributed_runtime_executor_refuses_pytree_activations_in_one_line():
    """The cross-process transport (runtime.distributed.process_executor) moves one array per transfer: it calls
    this check before any compute, which names the stage and the pytree."""
    from zbpp_lite.runtime.stages import refuse_pytree_activations

    model = StagedModel(byo_parts(2), 2, loss_fn)
    x, _ = _data(1)
    with pytest.raises(ValueError, match=r"^the cross-process transport passes one array between stages, but stage 0 passes a "
                                         r"tuple of 2 arrays \(pytree activations\); run this model with PipelineExecutor") as err:
        refuse_pytree_activations(model, x, "the cross-process transport")
    assert len(str(err.value).splitlines()) == 1
    single = StagedModel([(lambda p, x: x @ p, jnp.eye(D)), (lambda p, x: x @ p, jnp.eye(D)), (lambda p, x: x @ p, jnp.ones((D, CLASSES)))], 1, loss_fn)
    refuse_pytree_activations(single, x, "the cross-process transport")  # one array: accepted
