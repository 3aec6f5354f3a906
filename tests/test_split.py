"""The backward split: F, B, W equal jax.vjp, and XLA's own flop counts show W recomputes nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zbpp_lite as zb
from zbpp_lite.runtime.executor import PipelineExecutor
from zbpp_lite.runtime.split import (
    Handover,
    StageSplit,
    _scan_counts,
    compiled_flops,
    forward_kept_bytes,
    vjp_residual_bytes,
)
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.training.model import ModelConfig, build_parts

pytestmark = pytest.mark.newest_jax  # every test here: the split reads the jaxprs of whichever JAX runs


def _max_rel(a, b) -> float:
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(y)).max(), 1e-30))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def _check_against_vjp(model: StagedModel, x, labels) -> None:
    """Every stage: F's output, B's input gradient and W's parameter gradients equal jax.vjp's."""
    h = x
    for s in range(model.num_stages):
        fn, params = model.stage_fn(s), model.stage_params(model.params, s)
        aux = labels if s == model.num_stages - 1 else None
        split = StageSplit(fn, params, h, aux, input_grad=s > 0)
        y, res, kept = split.forward(params, h, aux)
        dy = jnp.ones(()) if aux is not None else jax.random.normal(jax.random.key(s), y.shape)

        @jax.jit
        def reference(params, h, dy):
            y, pullback = jax.vjp(lambda p, v: fn(p, v, aux), params, h)
            return y, pullback(dy)

        y_ref, (g_params_ref, g_x_ref) = reference(params, h, dy)
        dx, grads_out = split.backward_input(res, dy)
        g_params = split.weight_gradient(params, kept, grads_out)
        # 1e-5, as the gradients: F and the reference are two programs; identical here (0 measured) under
        # the suite's no-fusion flags, but where XLA fuses (flags refused, another CPU's vector width)
        # each of a block's ~30 roundings and sums over d = 16 to 64 may round differently: up to
        # ~(30 + 64) u ~ 6e-6 of max|y|, over 1e-6. A wrong forward differs by O(1).
        assert _max_rel(y, y_ref) < 1e-5
        assert _max_rel(g_params, g_params_ref) < 1e-5
        if s == 0:
            assert dx is None  # the data needs no gradient
        else:
            assert _max_rel(dx, g_x_ref) < 1e-5
        h = y


def test_f_b_w_of_every_stage_equal_jax_vjp():
    """First stage (data in, no input gradient) and last stage (loss out); BW = B then W is
    checked by every GPipe / 1F1B run in test_executor.py."""
    model = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=2)), 2)
    x = jax.random.uniform(jax.random.key(0), (4, 8, 8))
    _check_against_vjp(model, x, jnp.array([1, 7, 3, 0]))


class _Mlp(nnx.Module):
    """A block of some other model: plain Flax layers, nothing zbpp_lite-specific."""

    def __init__(self, n_in: int, n_out: int, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(n_in, rngs=rngs)
        self.dense = nnx.Linear(n_in, n_out, rngs=rngs)

    def __call__(self, x):
        return nnx.tanh(self.dense(self.norm(x))) * 2.0


def test_any_nnx_model_given_as_a_list_of_blocks_splits_the_same_way():
    rngs = nnx.Rngs(3)
    modules = [
        nnx.Linear(5, 12, rngs=rngs),
        _Mlp(12, 12, rngs),
        _Mlp(12, 12, rngs),
        nnx.Linear(12, 3, rngs=rngs),
    ]

    def loss(out, target):
        return jnp.mean((out - target) ** 2)

    model = StagedModel(modules, 2, loss_fn=loss)
    assert model.parts == [[0, 1], [2, 3]]
    x = jax.random.normal(jax.random.key(1), (6, 5))
    _check_against_vjp(model, x, jax.random.normal(jax.random.key(2), (6, 3)))


def test_a_stage_whose_output_ignores_its_input_is_refused():
    with pytest.raises(ValueError, match="does not depend on the stage input"):
        StageSplit(lambda p, x, aux: p["w"] * 2.0, {"w": jnp.ones(3)}, jnp.ones(3))


# --------------------------------------------------------------------------- flops


def _weight_products(block_inputs):
    """The parameter-gradient products of 4 Transformer blocks and nothing else: x^T dy per
    Linear, sum(dy) per bias, sum(dy * x_hat) and sum(dy) per LayerNorm."""
    grads = []
    for lns, linears in block_inputs:
        for x_hat, dy in lns:
            grads += [jnp.sum(dy * x_hat, axis=0), jnp.sum(dy, axis=0)]
        for x, dy in linears:
            grads += [x.T @ dy, jnp.sum(dy, axis=0)]
    return grads


def test_b_plus_w_cost_the_fused_backward_and_w_only_the_weight_products():
    """Paper section 2: splitting the backward adds no work; W is only its weight products.
    Measured with XLA's compiled cost analysis on a stage of exactly 4 blocks."""
    cfg = ModelConfig(d=32, heads=4, blocks=12)
    model = StagedModel(build_parts(cfg), 3)
    stage = 1
    assert model.parts[stage] == [5, 6, 7, 8]  # four blocks, no embedding or head
    b, d = 4, cfg.d
    n = b * 8  # tokens
    x = jax.random.normal(jax.random.key(0), (b, 8, d))
    fn, params = model.stage_fn(stage), model.stage_params(model.params, stage)
    split = StageSplit(fn, params, x)
    # shapes only: tracing F (no compile) is enough to lower B and W for the cost analysis
    y, res, kept = jax.eval_shape(split.forward, params, x, None)
    _, grads_out = jax.eval_shape(split.backward_input, res, y)

    flops_b = compiled_flops(split.backward_input, res, y)
    flops_w = compiled_flops(split.weight_gradient, params, kept, grads_out)
    tree = []

    def fused_residuals(p, v):  # the standard backward: jax.vjp for parameters and input
        leaves, treedef = jax.tree_util.tree_flatten(jax.vjp(lambda p, v: fn(p, v, None), p, v)[1])
        tree.append(treedef)
        return leaves

    leaves = jax.eval_shape(fused_residuals, params, x)
    flops_fused = compiled_flops(lambda r, g: jax.tree_util.tree_unflatten(tree[0], r)(g), leaves, y)

    def arr(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    block = (
        [(arr(n, d), arr(n, d))] * 2,
        [
            (arr(n, d), arr(n, 3 * d)),
            (arr(n, d), arr(n, d)),
            (arr(n, d), arr(n, 4 * d)),
            (arr(n, 4 * d), arr(n, d)),
        ],
    )
    flops_products = compiled_flops(_weight_products, [block] * 4)
    assert flops_products >= 4 * 2 * n * 12 * d * d  # the four GEMMs per block dominate

    assert flops_b + flops_w <= 1.05 * flops_fused, (flops_b, flops_w, flops_fused)
    assert flops_w <= 1.05 * flops_products, (flops_w, flops_products)
    # and B holds no weight product: what B saves against the fused backward is W's share
    assert flops_b <= 1.05 * (flops_fused - flops_products), (flops_b, flops_fused, flops_products)


def test_the_flat_b_computes_bias_and_layernorm_gradients_and_the_flat_w_only_the_products():
    """What the executor runs: B reduces the output gradients of the elementwise weight
    operations (biases, LayerNorm scales and shifts) as it makes them, so it writes fewer bytes
    for W, and W's compiled program is the weight products alone (no reduction); the sum is
    jax.vjp's, for B then W and for the fused BW."""
    model = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=2)), 2)
    x = jax.random.uniform(jax.random.key(0), (4, 8, 8))
    shapes, labels = model.stage_inputs(x), jnp.array([1, 7, 3, 0])
    h = x
    for s in range(2):
        fn, params = model.stage_fn(s), model.stage_params(model.params, s)
        aux = labels if s == 1 else None
        split = model.split_stage(s, shapes[s], labels)
        assert {split.weight_primitives[j] for j in split._b_ops} == {
            "add",
            "mul",
        }  # the biases, LayerNorm's scale and shift
        p = tuple(jax.tree_util.tree_leaves(params))
        y, own, kept = split.flat.forward(p, h, aux)
        dy = jnp.ones(()) if aux is not None else jax.random.normal(jax.random.key(s), y.shape)
        dx, grads_out = split.flat.backward_input(p, own, dy)
        # what B hands W is a named record: output gradients, recomputed operands (none: no remat), B's share
        assert isinstance(grads_out, Handover) and grads_out.recomputed == ()
        assert len(grads_out.b_grads) == len(split._b_leaves) > 0
        g_w = split.flat.backward_weight(p, kept, grads_out, None)
        dx_bw, g_bw = split.flat.backward_fused(p, own, kept, dy, None)
        g_ref, dx_ref = jax.vjp(lambda q, v: fn(q, v, aux), params, h)[1](dy)
        g_ref = tuple(jax.tree_util.tree_leaves(g_ref))
        assert _max_rel(g_w, g_ref) < 1e-5 and _max_rel(g_bw, g_ref) < 1e-5
        if s == 1:
            assert _max_rel(dx, dx_ref) < 1e-5 and _max_rel(dx_bw, dx_ref) < 1e-5
        # B's outputs for W, against every distinct output gradient (what W would otherwise read)
        _, res, _ = split.forward(params, h, aux)
        _, all_grads = split.backward_input(res, dy)
        distinct = {id(g): g for g in jax.tree_util.tree_leaves(all_grads)}.values()
        assert sum(g.size for g in jax.tree_util.tree_leaves(grads_out)) < 0.9 * sum(g.size for g in distinct)
        hlo = split.flat.backward_weight.lower(p, kept, grads_out, None).compile().as_text()
        assert " reduce(" not in hlo and " dot(" in hlo
        h = y


def test_weight_operations_inside_nested_jit_and_remat_are_found():
    """A Linear inside jax.checkpoint is still split (its x^T dy lands in W, not a re-run of the
    checkpointed block); custom-derivative functions (relu, softplus) pass through whole."""

    def fn(p, x, aux):
        h = jax.nn.relu(x @ p["w"] + p["b"])
        h = jax.checkpoint(lambda h: jnp.tanh(h @ p["w2"]))(h)
        return jax.nn.softplus(h) * p["s"]

    keys = jax.random.split(jax.random.key(0), 3)
    p = {
        "w": jax.random.normal(keys[0], (4, 5)),
        "b": jnp.ones(5),
        "w2": jax.random.normal(keys[1], (5, 5)),
        "s": jnp.full(5, 2.0),
    }
    x = jax.random.normal(keys[2], (3, 4))
    split = StageSplit(fn, p, x)
    assert split.weight_primitives == ("dot_general", "add", "dot_general", "mul")
    y, res, kept = split.forward(p, x, None)
    dx, grads_out = split.backward_input(res, jnp.ones_like(y))
    g_ref, dx_ref = jax.vjp(lambda p, v: fn(p, v, None), p, x)[1](jnp.ones_like(y))
    assert _max_rel(split.weight_gradient(p, kept, grads_out), g_ref) < 1e-5
    assert _max_rel(dx, dx_ref) < 1e-5


def test_debug_prints_and_callbacks_in_a_stage_run_once_per_f_and_never_in_b_w_or_bw(capfd):
    """An equation with no outputs is a side effect: F runs it, B, W and BW skip it (W and BW
    used to fail with a KeyError on it). The gradients are still jax.vjp's."""
    calls: list = []

    def fn(p, x, aux):
        h = x @ p["w"] + p["b"]
        jax.debug.callback(lambda v: calls.append(float(v)), h.sum())  # an activation
        jax.debug.callback(lambda w, v: calls.append("w and x"), p["w"], x)  # a parameter and the input
        jax.debug.print("stage input sum {s}", s=x.sum())
        return jnp.tanh(h) * p["s"]

    keys = jax.random.split(jax.random.key(0), 2)
    p = {"w": jax.random.normal(keys[0], (4, 5)), "b": jnp.ones(5), "s": jnp.full(5, 2.0)}
    x = jax.random.normal(keys[1], (3, 4))
    split = StageSplit(fn, p, x)
    assert split.weight_primitives == ("dot_general", "add", "mul")
    for _ in range(3):
        y, res, kept = split.forward(p, x, None)
    jax.effects_barrier()
    h_sum = float((x @ p["w"] + p["b"]).sum())
    assert len(calls) == 6 and calls.count("w and x") == 3  # unordered effects: counted, not ordered
    assert [c for c in calls if c != "w and x"] == pytest.approx([h_sum] * 3, rel=1e-5)
    assert capfd.readouterr().out.count("stage input sum") == 3
    calls.clear()
    dy = jnp.ones_like(y)
    dx, grads_out = split.backward_input(res, dy)
    g_w = split.weight_gradient(p, kept, grads_out)
    dx_bw, g_bw = split.backward_fused(p, res, kept, dy, jax.tree_util.tree_map(jnp.zeros_like, p))
    jax.effects_barrier()
    assert calls == [] and capfd.readouterr().out.count("stage input sum") == 0
    g_ref, dx_ref = jax.vjp(lambda p, v: fn(p, v, None), p, x)[1](dy)
    assert _max_rel(g_w, g_ref) < 1e-5 and _max_rel(g_bw, g_ref) < 1e-5
    assert _max_rel(dx, dx_ref) < 1e-5 and _max_rel(dx_bw, dx_ref) < 1e-5


# --------------------------------------------------------------------------- remat


class _FfnBlock(nnx.Module):
    """A pre-norm feed-forward block with a skip connection; ``remat`` wraps it in nnx.remat."""

    def __init__(self, d: int, rngs: nnx.Rngs, remat: bool = False):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
        self.remat = remat

    def _apply(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))

    def __call__(self, x):
        return nnx.remat(_FfnBlock._apply)(self, x) if self.remat else self._apply(x)


def _remat_stage(policy):
    """fn(params, x, aux) of two blocks, each under jax.checkpoint with ``policy``, or plain."""
    blocks = [_FfnBlock(16, nnx.Rngs(i)) for i in range(2)]
    graphdefs, params = zip(*(nnx.split(b) for b in blocks))

    def fn(params, x, aux):
        for g, p in zip(graphdefs, params):
            apply = lambda p, x, g=g: nnx.merge(g, p)(x)  # noqa: E731
            x = apply(p, x) if policy == "none" else jax.checkpoint(apply, policy=policy)(p, x)
        return x

    return fn, list(params)


@pytest.mark.parametrize(
    "policy",
    [
        "none",
        None,
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.dots_saveable,
        "nnx.remat",
    ],
)
def test_remat_is_honoured_f_keeps_what_the_policy_saves_and_gradients_are_jax_vjps(policy):
    """F keeps at most 1.1x what jax.vjp keeps under the same checkpoint (it used to inline the
    checkpoint and keep every activation: 17x here); B recomputes, W reads what B recomputed."""
    if policy == "nnx.remat":
        blocks = [_FfnBlock(16, nnx.Rngs(i), remat=True) for i in range(2)]
        model = StagedModel(
            [nnx.Linear(16, 16, rngs=nnx.Rngs(5)), *blocks, nnx.Linear(16, 16, rngs=nnx.Rngs(6))],
            2,
            loss_fn=lambda y, t: jnp.mean((y - t) ** 2),
            parts=[[0], [1, 2, 3]],
        )
        fn, params = model.stage_fn(1), model.stage_params(model.params, 1)
        aux = jnp.ones((8, 16))
    else:
        (fn, params), aux = _remat_stage(policy), None
    x = jax.random.normal(jax.random.key(0), (8, 16))
    split = StageSplit(fn, params, x, aux)
    kept, reference = forward_kept_bytes(split, params, x, aux), vjp_residual_bytes(fn, params, x, aux)
    assert kept <= 1.1 * reference, (kept, reference)
    if policy in (None, jax.checkpoint_policies.nothing_saveable):
        # the block inputs only: 2 x (8, 16) float32, against every activation without remat
        assert kept == reference == 2 * 8 * 16 * 4
        assert (
            forward_kept_bytes(StageSplit(*_remat_stage("none"), x), _remat_stage("none")[1], x) >= 10 * kept
        )
    p_leaves = tuple(jax.tree_util.tree_leaves(params))
    y, own, kept_arrays = split.flat.forward(p_leaves, x, aux)
    dy = jnp.ones(()) if aux is not None else jax.random.normal(jax.random.key(1), y.shape)
    dx, grads_out = split.flat.backward_input(p_leaves, own, dy)
    g_w = split.flat.backward_weight(p_leaves, kept_arrays, grads_out, None)
    y, own, kept_arrays = split.flat.forward(p_leaves, x, aux)
    dx_bw, g_bw = split.flat.backward_fused(p_leaves, own, kept_arrays, dy, None)
    g_ref, dx_ref = jax.vjp(lambda p, v: fn(p, v, aux), params, x)[1](dy)
    g_ref = tuple(jax.tree_util.tree_leaves(g_ref))
    assert _max_rel(g_w, g_ref) < 1e-5 and _max_rel(g_bw, g_ref) < 1e-5
    assert _max_rel(dx, dx_ref) < 1e-5 and _max_rel(dx_bw, dx_ref) < 1e-5


# --------------------------------------------------------------------------- scanned layer stacks


def _scanned_stage(layers: int, d: int, unroll):
    """A layer stack as large JAX models write it: parameters stacked on a leading layer axis,
    one block body under jax.lax.scan (a scale, a Linear, tanh, a Linear, a skip connection)."""

    def fn(p, x, aux):
        def body(h, lp):
            return h + jnp.tanh((h * lp["g"]) @ lp["w"] + lp["b"]) @ lp["w2"], None

        return jax.lax.scan(body, x, p, unroll=unroll)[0]

    k = jax.random.split(jax.random.key(0), 3)
    p = {
        "w": jax.random.normal(k[0], (layers, d, 4 * d)) / np.sqrt(d),
        "b": jnp.full((layers, 4 * d), 0.1),
        "w2": jax.random.normal(k[1], (layers, 4 * d, d)) / np.sqrt(4 * d),
        "g": jnp.ones((layers, d)),
    }
    return fn, p


class _NnxBlock(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm, self.dense = nnx.RMSNorm(d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(self.norm(x)))


def _nnx_scan_stage(layers: int, d: int):
    """The same with Flax NNX: blocks made with nnx.vmap, run with nnx.scan."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return _NnxBlock(d, nnx.Rngs(key))

    graphdef, params = nnx.split(make(jax.random.split(jax.random.key(1), layers)))

    def fn(p, x, aux):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)

        return run(x, nnx.merge(graphdef, p))

    return fn, params


@pytest.mark.parametrize(
    "make", [lambda: _scanned_stage(3, 8, 1), lambda: _nnx_scan_stage(3, 8)], ids=["lax.scan", "nnx.scan"]
)
def test_a_scanned_layer_stack_is_split_inside_and_its_gradients_are_jax_vjps(make):
    fn, p = make()
    x = jax.random.normal(jax.random.key(2), (4, 8))
    split = StageSplit(fn, p, x)
    assert split.weight_primitives and all(name.startswith("scan/") for name in split.weight_primitives)
    assert "scan/dot_general" in split.weight_primitives  # the loop is no longer one weight operation
    p_leaves = tuple(jax.tree_util.tree_leaves(p))
    dy = jax.random.normal(jax.random.key(3), x.shape)
    y, own, kept = split.flat.forward(p_leaves, x, None)
    dx, grads_out = split.flat.backward_input(p_leaves, own, dy)
    g_w = split.flat.backward_weight(p_leaves, kept, grads_out, None)
    y, own, kept = split.flat.forward(p_leaves, x, None)
    dx_bw, g_bw = split.flat.backward_fused(p_leaves, own, kept, dy, None)
    y_ref, pullback = jax.vjp(lambda p, v: fn(p, v, None), p, x)
    g_ref, dx_ref = pullback(dy)
    g_ref = tuple(jax.tree_util.tree_leaves(g_ref))
    assert (
        _max_rel(y, y_ref) < 1e-5
    )  # as in _check_against_vjp: 3 layers of dots over 8, ~(3 * 10) u worst; 0 measured
    assert _max_rel(g_w, g_ref) < 1e-5 and _max_rel(g_bw, g_ref) < 1e-5
    assert _max_rel(dx, dx_ref) < 1e-5 and _max_rel(dx_bw, dx_ref) < 1e-5


def test_a_scanned_stack_costs_b_plus_w_no_more_than_the_fused_backward_and_w_only_its_weight_products():
    """XLA's cost analysis counts a while loop's body once, so the loop is unrolled for the count
    (unroll=True: the same scan, every iteration in the program)."""
    layers, d, b = 4, 32, 16
    fn, p = _scanned_stage(layers, d, True)
    x = jax.ShapeDtypeStruct((b, d), jnp.float32)
    split = StageSplit(fn, p, x)
    y, res, kept = jax.eval_shape(split.forward, p, x, None)
    _, grads_out = jax.eval_shape(split.backward_input, res, y)
    flops_b = compiled_flops(split.backward_input, res, y)
    flops_w = compiled_flops(split.weight_gradient, p, kept, grads_out)
    tree = []

    def fused_residuals(p, v):
        leaves, treedef = jax.tree_util.tree_flatten(jax.vjp(lambda p, v: fn(p, v, None), p, v)[1])
        tree.append(treedef)
        return leaves

    leaves = jax.eval_shape(fused_residuals, p, x)
    flops_fused = compiled_flops(lambda r, g: jax.tree_util.tree_unflatten(tree[0], r)(g), leaves, y)
    products = layers * 2 * (2 * b * d * 4 * d)  # x^T dy of the two Linears of every layer
    assert flops_b + flops_w <= 1.05 * flops_fused, (flops_b, flops_w, flops_fused)
    assert products <= flops_w <= 1.05 * products, (
        flops_w,
        products,
    )  # W: the weight products and nothing else
    assert flops_b <= 1.05 * (flops_fused - products), (flops_b, flops_fused, products)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_remat_and_scanned_stages_run_in_the_executor_with_jax_grads(schedule):
    """Stage 0 a Linear and a remat block, stage 1 a scanned stack (a plain function part) and a
    Linear: BW (1F1B) and B then W (ZB-H1) through the executor's flat programs and spares give
    jax.grad of the whole model."""
    stack_fn, stack_params = _scanned_stage(2, 16, 1)
    parts = [
        nnx.Linear(16, 16, rngs=nnx.Rngs(0)),
        _FfnBlock(16, nnx.Rngs(1), remat=True),
        (lambda p, x: stack_fn(p, x, None), stack_params),
        nnx.Linear(16, 4, rngs=nnx.Rngs(2)),
    ]
    model = StagedModel(parts, 2, loss_fn=lambda y, t: jnp.mean((y - t) ** 2))
    assert model.parts == [[0, 1], [2, 3]]
    x = jax.random.normal(jax.random.key(0), (8, 16))
    t = jax.random.normal(jax.random.key(1), (8, 4))
    result = PipelineExecutor(model, zb.build_schedule(schedule, 2, 4), jax.devices()[:2]).run(
        model.params, x, t
    )
    loss, grads = jax.value_and_grad(model.loss)(model.params, x, t)
    assert result.loss == pytest.approx(float(loss), rel=1e-5)
    assert _max_rel(result.grads, grads) < 1e-4


def test_under_remat_b_recomputes_the_blocks_and_w_does_only_the_weight_products():
    """XLA's cost analysis: B + W cost the fused backward under the same remat (which also
    recomputes), W is the two Linears' x^T dy per block and nothing more, B holds the recompute."""
    fn, params = _remat_stage(None)
    plain_fn, _ = _remat_stage("none")
    b, d = 16, 16
    x = jax.ShapeDtypeStruct((b, d), jnp.float32)

    def fused(fn):
        tree = []

        def residuals(p, v):
            leaves, treedef = jax.tree_util.tree_flatten(jax.vjp(lambda p, v: fn(p, v, None), p, v)[1])
            tree.append(treedef)
            return leaves

        leaves = jax.eval_shape(residuals, params, x)
        return compiled_flops(lambda r, g: jax.tree_util.tree_unflatten(tree[0], r)(g), leaves, x)

    split, plain = StageSplit(fn, params, x), StageSplit(plain_fn, params, x)
    flops = {}
    for name, s in (("remat", split), ("plain", plain)):
        y, res, kept = jax.eval_shape(s.forward, params, x, None)
        _, grads_out = jax.eval_shape(s.backward_input, res, y)
        flops[name] = (
            compiled_flops(s.backward_input, res, y),
            compiled_flops(s.weight_gradient, params, kept, grads_out),
        )
    products = 2 * 2 * (2 * b * d * 4 * d)  # two blocks, two Linears each
    (b_remat, w_remat), (b_plain, w_plain) = flops["remat"], flops["plain"]
    assert b_remat + w_remat <= 1.05 * fused(fn), (b_remat, w_remat)
    assert products <= w_remat <= 1.05 * products and w_remat == w_plain  # W recomputes nothing
    assert b_remat >= b_plain + products / 2  # B recomputes the blocks' forward (their products at least)


def test_a_recurrent_cell_under_scan_shared_weights_reversed_is_split_with_jax_vjps_gradients():
    """Weights shared over time (scan consts), the sequence as xs, outputs as ys, a zero initial
    state, reverse=True and unroll=2: W sums each product over the time steps."""

    def fn(p, x, aux):
        def cell(h, xt):
            h = jnp.tanh(h @ p["wh"] + xt @ p["wx"] + p["b"])
            return h, h * p["s"]

        h, ys = jax.lax.scan(cell, jnp.zeros((x.shape[1], 8)), x, reverse=True, unroll=2)
        return ys.sum(0) + h

    k = jax.random.split(jax.random.key(0), 4)
    p = {
        "wh": jax.random.normal(k[0], (8, 8)) / 3,
        "wx": jax.random.normal(k[1], (6, 8)),
        "b": jnp.ones(8),
        "s": jnp.full(8, 0.5),
    }
    x = jax.random.normal(k[2], (5, 3, 6))  # (time, batch, features)
    split = StageSplit(fn, p, x)
    assert split.weight_primitives == ("scan/dot_general", "scan/dot_general", "scan/add", "scan/mul")
    y, res, kept = split.forward(p, x, None)
    dy = jax.random.normal(k[3], y.shape)
    dx, grads_out = split.backward_input(res, dy)
    g_ref, dx_ref = jax.vjp(lambda p, v: fn(p, v, None), p, x)[1](dy)
    assert _max_rel(split.weight_gradient(p, kept, grads_out), g_ref) < 1e-5
    assert _max_rel(dx, dx_ref) < 1e-5


def _scan_equation():
    """The ``scan`` equation of a loop with one constant (the closed-over w), one carry, one xs."""

    def loop(w, h, xs):
        return jax.lax.scan(lambda c, x: (jnp.tanh(c @ w + x), c), h, xs)

    w, h, xs = jnp.ones((4, 4)), jnp.ones((2, 4)), jnp.ones((3, 2, 4))
    (eqn,) = [e for e in jax.make_jaxpr(loop)(w, h, xs).jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


def test_the_scan_equation_is_read_on_this_jax():
    """JAX 0.10-0.11 give num_consts / num_carry, JAX 0.12 ft_in (issue 31 part 7: KeyError 'num_consts')."""
    assert _scan_counts(_scan_equation()) == (1, 1)


def test_a_scan_equation_the_split_cannot_read_is_refused_in_one_line_naming_it_and_the_jax_version():
    eqn = _scan_equation()
    counts = ("num_consts", "num_carry", "ft_in")
    unknown = eqn.replace(params={k: v for k, v in eqn.params.items() if k not in counts})
    with pytest.raises(
        ValueError, match=rf"^the split cannot read JAX {jax.__version__}'s 'scan' equation: [^\n]*$"
    ):
        _scan_counts(unknown)


def _tanh_sin(p, h, aux):
    return h + jnp.tanh(jnp.sin(h @ p["a"])) @ p["b"]


@pytest.mark.parametrize("remat", [False, True])
def test_f_keeps_no_more_than_jax_vjp_where_the_stage_input_feeds_a_product(remat):
    """A W operand B's residuals hold already (tanh's output; under the checkpoint, its input h)
    is kept once and handed to W by B: 106,496 B and 8,192 B, jax.vjp's (1.31x and 2.00x before)."""
    fn = jax.checkpoint(_tanh_sin) if remat else _tanh_sin
    keys = jax.random.split(jax.random.key(0), 3)
    p = {"a": 0.1 * jax.random.normal(keys[0], (64, 256)), "b": 0.1 * jax.random.normal(keys[1], (256, 64))}
    h = jax.random.normal(keys[2], (32, 64))
    split = StageSplit(fn, p, h)
    assert forward_kept_bytes(split, p, h) == vjp_residual_bytes(fn, p, h) == (8_192 if remat else 106_496)
    # JAX 0.10's residuals hold the operand W also reads (tanh's output; h under the checkpoint):
    # kept once, shared. JAX 0.12's differ (without the checkpoint nothing is shared); the bytes above
    # equal jax.vjp's on both
    assert len(split.plan.held) == 1 if jax.__version_info__ < (0, 11) else len(split.plan.held) <= 1
    g_ref, dx_ref = jax.grad(lambda p, h: fn(p, h, None).sum(), argnums=(0, 1))(p, h)
    y, res, kept = split.forward(p, h, None)
    dx, handover = split.backward_input(res, jnp.ones_like(y))
    assert _max_rel(dx, dx_ref) < 1e-5 and _max_rel(split.weight_gradient(p, kept, handover), g_ref) < 1e-5
    p_leaves = tuple(jax.tree_util.tree_leaves(p))
    y, own, kept = split.flat.forward(p_leaves, h, None)
    dx, handover = split.flat.backward_input(p_leaves, own, jnp.ones_like(y))
    assert (
        _max_rel(
            split.flat.backward_weight(p_leaves, kept, handover, None),
            tuple(jax.tree_util.tree_leaves(g_ref)),
        )
        < 1e-5
    )
    _, g_bw = split.flat.backward_fused(p_leaves, own, kept, jnp.ones_like(y), None)
    assert _max_rel(g_bw, tuple(jax.tree_util.tree_leaves(g_ref))) < 1e-5


def _state(split: StageSplit) -> dict:
    """Each attribute's identity, and a copy of every list, dict, set and tuple among them."""
    return {k: (id(v), type(v)(v) if isinstance(v, (list, dict, set, tuple)) else None) for k, v in vars(split).items()}


def test_b_and_w_trace_first_on_a_fresh_split_and_no_trace_sets_state():
    """The plan is read when the split is made: a fresh split's B, W and BW (flat and pytree) trace before
    its F, give jax.grad's gradients, and no call (the first trace of each) changes any attribute; an
    operand B's residuals hold (h under the checkpoint) is handed over, a bias's gradient is B's share."""
    keys = jax.random.split(jax.random.key(1), 4)
    p = {"a": 0.3 * jax.random.normal(keys[0], (8, 16)), "b": 0.3 * jax.random.normal(keys[1], (16, 8)),
         "c": jax.random.normal(keys[2], (8,))}

    def fn(p, h, aux):
        return jax.checkpoint(_tanh_sin)(p, h, aux) + p["c"]

    h = jax.random.normal(keys[3], (4, 8))
    g_ref, dx_ref = jax.grad(lambda p, h: fn(p, h, None).sum(), argnums=(0, 1))(p, h)
    p_leaves, other = tuple(jax.tree_util.tree_leaves(p)), StageSplit(fn, p, h)
    y, own, kept = other.flat.forward(p_leaves, h, None)  # another split's F gives the values
    _, res, kept_tree = other.forward(p, h, None)
    split = StageSplit(fn, p, h)
    assert len(split.plan.held) == 1 and len(split.plan.distinct) >= 1
    before = _state(split)
    dx, handover = split.backward_input(res, jnp.ones_like(y))
    assert _max_rel(dx, dx_ref) < 1e-5
    assert _max_rel(split.weight_gradient(p, kept_tree, handover), g_ref) < 1e-5
    g_twice = jax.tree_util.tree_map(lambda g: 2 * g, g_ref)
    assert _max_rel(split.backward_fused(p, res, kept_tree, jnp.ones_like(y), g_ref)[1], g_twice) < 1e-5
    dx, handover = split.flat.backward_input(p_leaves, own, jnp.ones_like(y), None)
    g = split.flat.backward_weight(p_leaves, kept, handover, None)
    _, g_bw = split.flat.backward_fused(p_leaves, own, kept, jnp.ones_like(y), None)
    assert _max_rel(dx, dx_ref) < 1e-5 and _max_rel(g, g_bw) < 1e-6
    assert _max_rel(g, tuple(jax.tree_util.tree_leaves(g_ref))) < 1e-5
    split.forward(p, h, None)
    assert _state(split) == before


def test_the_first_stage_computes_no_input_gradient_in_b_or_bw():
    """Stage 0's input is data: with input_grad=False its B and BW skip at least dx = dy W^T of
    the embedding (2 b 64 d flops; XLA's cost analysis)."""
    model = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=2)), 2)
    x = jax.random.uniform(jax.random.key(0), (4, 8, 8))
    fn, params = model.stage_fn(0), model.stage_params(model.params, 0)
    p = tuple(jax.tree_util.tree_leaves(params))
    flops = {}
    for input_grad in (True, False):
        flat = StageSplit(fn, params, x, input_grad=input_grad).flat
        y, own, kept = flat.forward(p, x, None)
        dx, _ = flat.backward_input(p, own, jnp.ones_like(y))
        assert (dx is None) != input_grad
        dy = jnp.ones_like(y)
        flops[input_grad] = (
            compiled_flops(flat.backward_input, p, own, dy),
            compiled_flops(flat.backward_fused, p, own, kept, dy, None),
        )
    for with_dx, without in zip(flops[True], flops[False]):
        assert with_dx - without >= 2 * 4 * 8 * 8 * 16
