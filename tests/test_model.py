"""The digits Transformer: the PyTorch job's architecture, stage cut, weights loader and data."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zbpp_lite.training.data import NUM_SAMPLES, batch_indices, load_digit_tokens, load_digits
from zbpp_lite.training import model as model_lib
from zbpp_lite.training.model import ModelConfig, build_parts, torch_names, torch_params
from zbpp_lite.runtime.stages import StagedModel, stage_parts

CFG = ModelConfig(d=16, heads=2, blocks=3, seed=0)


# --------------------------------------------------------------------------- stage cut


@pytest.mark.parametrize(
    "blocks, stages, expected",
    [
        (8, 2, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
        (5, 3, [[0, 1, 2], [3], [4, 5, 6]]),  # cuts round(5/3) = 2, round(10/3) = 3
        (6, 4, [[0, 1, 2], [3], [4], [5, 6, 7]]),  # round(1.5) = 2, round(4.5) = 4 (to even)
        (4, 1, [[0, 1, 2, 3, 4, 5]]),
    ],
)
def test_stage_parts_follows_the_pytorch_rule(blocks, stages, expected):
    assert stage_parts(blocks, stages) == expected


def test_fewer_blocks_than_stages_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"3 blocks cannot fill 4 stages.*>= 4 blocks"):
        stage_parts(3, 4)
    with pytest.raises(ValueError, match="cannot fill 8 stages"):
        StagedModel(build_parts(CFG), 8)


def test_parameter_count_and_init_bounds_match_pytorch_defaults():
    d, n = 24, 2
    parts = build_parts(ModelConfig(d=d, heads=3, blocks=n))
    count = sum(x.size for p in parts for x in jax.tree_util.tree_leaves(nnx.state(p, nnx.Param)))
    # Embed 8d + d + 8d; block 12 d^2 + 13 d; head 2d + 10 d + 10
    assert count == 17 * d + n * (12 * d * d + 13 * d) + 12 * d + 10
    block = parts[1]
    for layer, fan_in in (("qkv", d), ("fc2", 4 * d)):
        kernel = np.asarray(getattr(block, layer).kernel[...])
        assert np.abs(kernel).max() <= 1 / math.sqrt(fan_in)
        assert np.abs(kernel).max() > 0.9 / math.sqrt(fan_in)  # uniform over the whole range


# --------------------------------------------------------------------------- PyTorch weights


def _fake_torch_state(cfg: ModelConfig, seed: int = 1) -> dict[str, np.ndarray]:
    """Random arrays under PyTorch's names and layouts (Linear weight (out, in))."""
    rng = np.random.default_rng(seed)
    d, shapes = cfg.d, {}
    shapes["0.tok.weight"], shapes["0.tok.bias"], shapes["0.pos"] = (d, 8), (d,), (8, d)
    for i in range(1, cfg.blocks + 1):
        for name, shape in {
            "ln1.weight": (d,), "ln1.bias": (d,), "qkv.weight": (3 * d, d), "qkv.bias": (3 * d,),
            "proj.weight": (d, d), "proj.bias": (d,), "ln2.weight": (d,), "ln2.bias": (d,),
            "fc1.weight": (4 * d, d), "fc1.bias": (4 * d,), "fc2.weight": (d, 4 * d), "fc2.bias": (d,),
        }.items():
            shapes[f"{i}.{name}"] = shape
    h = cfg.blocks + 1
    shapes[f"{h}.ln.weight"], shapes[f"{h}.ln.bias"], shapes[f"{h}.out.weight"], shapes[f"{h}.out.bias"] = (d,), (d,), (10, d), (10,)
    return {k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in shapes.items()}


def _torch_forward(w: dict[str, np.ndarray], x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The PyTorch script's model written out in NumPy (float64), from its state dict."""
    from scipy.special import erf

    def linear(name, v):
        return v @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def norm(name, v):
        mu = v.mean(-1, keepdims=True)
        var = ((v - mu) ** 2).mean(-1, keepdims=True)
        return (v - mu) / np.sqrt(var + 1e-5) * w[f"{name}.weight"] + w[f"{name}.bias"]

    b, t, d, h = x.shape[0], 8, cfg.d, cfg.heads
    v = linear("0.tok", x) + w["0.pos"]
    for i in range(1, cfg.blocks + 1):
        qkv = linear(f"{i}.qkv", norm(f"{i}.ln1", v)).reshape(b, t, 3, h, d // h)
        q, k, val = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // h)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ val
        v = v + linear(f"{i}.proj", a.transpose(0, 2, 1, 3).reshape(b, t, d))
        u = linear(f"{i}.fc1", norm(f"{i}.ln2", v))
        v = v + linear(f"{i}.fc2", 0.5 * u * (1 + erf(u / np.sqrt(2))))
    head = cfg.blocks + 1
    return linear(f"{head}.out", norm(f"{head}.ln", v).mean(1))


def test_torch_weights_give_the_torch_model_number_for_number():
    state = {k: v.astype(np.float64) for k, v in _fake_torch_state(CFG).items()}
    params = torch_params(state, CFG)
    model = StagedModel(build_parts(CFG), 2)
    x = load_digit_tokens()[0][:5]
    ours = np.asarray(model.logits(params, x))
    ref = _torch_forward(state, x.astype(np.float64), CFG)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5)
    # every name lands somewhere: all parameters of the model come from the file
    assert len(torch_names(CFG)) == sum(len(jax.tree_util.tree_leaves(p)) for p in params)


def test_torch_weights_with_a_wrong_shape_or_name_are_refused(tmp_path):
    state = _fake_torch_state(CFG)
    bad = dict(state, **{"1.qkv.weight": np.zeros((3 * CFG.d, CFG.d + 1), np.float32)})
    with pytest.raises(ValueError, match=r"'1.qkv.weight' has shape \(48, 17\), expected \(48, 16\)"):
        torch_params(bad, CFG)
    missing = {k: v for k, v in state.items() if k != "0.pos"}
    with pytest.raises(ValueError, match=r"missing \['0.pos'\]"):
        torch_params(missing, CFG)
    path = tmp_path / "init.npz"
    np.savez(path, **state)
    from zbpp_lite.training.model import load_torch_init

    loaded = load_torch_init(path, CFG)
    np.testing.assert_array_equal(np.asarray(loaded[0]["tok"]["kernel"][...]), state["0.tok.weight"].T)


# --------------------------------------------------------------------------- data


def test_digit_tokens_are_rows_of_pixels_over_16():
    from sklearn.datasets import load_digits as sk_digits

    x, y = load_digit_tokens()  # read from scikit-learn's file: every sample equals its load_digits()
    assert x.shape == (NUM_SAMPLES, 8, 8) and x.dtype == np.float32 and y.dtype == np.int32
    digits = sk_digits()
    np.testing.assert_array_equal(x * 16, digits.images)
    np.testing.assert_array_equal(y, digits.target)
    assert 0.0 <= x.min() and x.max() == 1.0


def test_the_digits_come_from_scikit_learns_loader_where_its_file_is_not_found(monkeypatch):
    from sklearn.datasets import load_digits as sk_digits

    from zbpp_lite.training import data

    monkeypatch.setattr(data, "_digits_file", lambda: None)
    x, y = load_digit_tokens()
    digits = sk_digits()
    np.testing.assert_array_equal(x * 16, digits.images)
    np.testing.assert_array_equal(y, digits.target)


def test_batches_follow_the_pytorch_order_and_cover_an_epoch():
    data = load_digits(holdout=0.0, seed=3)
    perm = np.random.default_rng(3).permutation(NUM_SAMPLES)
    x, y = data.batch(2, 100)  # step 2 = samples perm[200:300]
    np.testing.assert_array_equal(y, load_digit_tokens()[1][perm[200:300]])
    # the step that crosses the end of the permutation wraps around (the script's "% n")
    assert list(batch_indices(NUM_SAMPLES, 100, 17, 3)) == list(perm[1700:1797]) + list(perm[:3])


def test_holdout_split_is_disjoint_and_reproducible():
    a, b = load_digits(holdout=0.2, seed=0), load_digits(holdout=0.2, seed=0)
    assert len(a.test_y) == round(0.2 * NUM_SAMPLES) and len(a.train_y) + len(a.test_y) == NUM_SAMPLES
    np.testing.assert_array_equal(a.test_x, b.test_x)
    # train + test is the whole data set, each sample once: a partition
    def rows(*xs):
        flat = np.concatenate([x.reshape(len(x), -1) for x in xs])
        return flat[np.lexsort(flat.T[::-1])]

    np.testing.assert_array_equal(rows(a.train_x, a.test_x), rows(load_digit_tokens()[0]))
    with pytest.raises(ValueError, match="holdout must be in"):
        load_digits(holdout=1.0)


def test_gelu_equals_the_exact_gelu_and_its_derivative():
    """model.gelu has its own derivative rule (one residual, not three); values and gradients
    must still be JAX's exact GELU's, which is PyTorch's nn.GELU()."""
    u = jnp.linspace(-8.0, 8.0, 4001, dtype=jnp.float32)
    # atol 4e-6, not 1e-6: JAX's 0.5 u (1 + erf(u / sqrt 2)) cancels for u < -4, so its absolute error
    # is 0.5 |u| times erf's near -1, a few ulps of 1 (2^-24 each): 9.5e-7 measured at u = -5.3, and
    # 0.5 * 8 * 16 * 2^-24 = 3.8e-6 allows 16 ulps at |u| = 8; the tanh GELU is up to 4.7e-4 away
    np.testing.assert_allclose(model_lib.gelu(u), jax.nn.gelu(u, approximate=False), rtol=1e-6, atol=4e-6)
    assert float(model_lib.gelu(jnp.float32(-1.0))) == pytest.approx(-0.15865525, abs=1e-7)  # -Phi(-1)
    ours = jax.vmap(jax.grad(model_lib.gelu))(u)
    theirs = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=False)))(u)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    # the slope of x * Phi(x): 0.5 at 0, -> 1 far right, -> 0 far left, overshoots 1 near x = 1.4
    assert abs(float(ours[2000]) - 0.5) < 1e-6 and float(ours[-1]) > 0.9999 and abs(float(ours[0])) < 1e-6
    assert float(ours.max()) > 1.1
    # the backward keeps one array the size of u, where JAX's own rule keeps more
    x = jnp.ones((32, 8, 512), jnp.float32)
    ours_res = jax.tree_util.tree_leaves(jax.vjp(model_lib.gelu, x)[1])
    theirs_res = jax.tree_util.tree_leaves(jax.vjp(lambda v: jax.nn.gelu(v, approximate=False), x)[1])
    assert sum(a.size for a in ours_res) == x.size < sum(a.size for a in theirs_res)


# --------------------------------------------------------------------------- the fusion wall (issue 43)


def _fused_lines(fn, *args) -> int:
    import re

    text = fn.lower(*args).compile().as_text()
    return sum(c.count("\n") for c in re.split(r"\n(?=\S.*\{\n)", text) if c.startswith("%fused"))


def test_the_fusion_wall_changes_no_value_or_gradient():
    from zbpp_lite.runtime.stages import fusion_wall

    model = StagedModel(build_parts(CFG), 1)
    x, y = jax.random.normal(jax.random.PRNGKey(1), (8, 8, 8)), jnp.arange(8) % 10

    def plain(params):  # the parts in turn, no wall
        return model.loss_fn(functools.reduce(lambda h, i: model.apply_part(i, params[i], h),
                                              range(model.num_parts), x), y)

    got, want = jax.value_and_grad(model.loss)(model.params, x, y), jax.value_and_grad(plain)(model.params)
    assert float(got[0]) == float(want[0])
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    u = jnp.arange(6.0).reshape(2, 3)
    assert jnp.array_equal(jax.vmap(jax.grad(lambda v: jnp.sum(fusion_wall(v) ** 2)))(u), 2 * u)
    assert fusion_wall(jnp.arange(3)).dtype == jnp.arange(3).dtype  # integers pass through


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the wall is XLA:CPU's (fusion there)")
def test_the_unpartitioned_gradient_grows_linearly_with_depth_on_the_cpu():
    """XLA:CPU's fused work for the whole model's gradient: without the walls it grows with the square of
    the depth (1,363 / 2,636 / 6,046 fused lines at 1 / 2 / 4 blocks of d 128), with them linearly."""
    x, y = jnp.zeros((16, 8, 8)), jnp.arange(16) % 10
    lines = []
    for blocks in (1, 2, 4):
        model = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=blocks)), 1)
        lines.append(_fused_lines(jax.jit(jax.grad(model.loss)), model.params, x, y))
    per_block_first, per_block_next = lines[1] - lines[0], (lines[2] - lines[1]) / 2
    assert per_block_next <= 1.1 * per_block_first, lines
