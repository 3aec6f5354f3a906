"""The digits Transformer classifier and its cut into pipeline stages (Flax NNX).

The model is the job fixed by ``shared/peers/torch_pp_bench.py`` so that losses can be compared
with PyTorch number for number (float32 throughout):

    x (b, 8, 8): 8 row tokens of 8 pixels / 16
    -> Linear(8, d) + learned position embedding (8, d)                        Embed   (part 0)
    -> N x [x + proj(MHSA_h(LN1 x)); x + fc2(GELU(fc1(LN2 x)))]                Block   (parts 1..N)
    -> LayerNorm -> mean over the 8 tokens -> Linear(d, 10)                    Head    (part N+1)
    -> mean cross-entropy over the (micro)batch

Attention uses one fused qkv Linear(d, 3d) with bias whose outputs are laid out
[q | k | v], each [head 0 | head 1 | ...]; softmax(q k^T / sqrt(d/h)), no mask; GELU is the
exact (erf) form; LayerNorm eps 1e-5 with scale and bias, two-pass variance as PyTorch. Init
follows PyTorch's defaults in distribution (Linear weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)),
LayerNorm 1 and 0, position embedding ~ N(0, 0.02^2)); :func:`load_torch_init` takes the exact
values from the script's ``--save-init`` file.

Stages (:class:`StagedModel`): a model given as a list of NNX modules ``[first, *blocks, last]``
is cut into ``num_stages`` stages of whole blocks, the first module with stage 0 and the last
module (and the loss) with the last stage, the blocks split as evenly as rounding allows
(:func:`stage_parts`, the same rule as the PyTorch script). Any list of NNX modules whose state
is parameters only splits the same way.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from .split import StageSplit

SEQ_LEN = 8
"""Tokens per image: its 8 rows."""
TOKEN_DIM = 8
"""Pixels per token."""
NUM_CLASSES = 10

Params = list  # one nnx.State of parameters per part, in model order

_SPLITS: dict = {}  # StagedModel.split_stage's cache, shared by every staged model


@jax.custom_jvp
def gelu(u: jax.Array) -> jax.Array:
    """Exact (erf) GELU, ``u * Phi(u)``, elementwise, any shape, float32 in and out.

    The values are PyTorch's ``nn.GELU()`` formula ``0.5 u (1 + erf(u / sqrt 2))``, equal to
    ``jax.nn.gelu(u, approximate=False)`` within 1e-6 absolute (JAX's erfc form avoids the
    float32 cancellation of ``1 + erf`` below u = -5, where both are under 1e-6); the
    derivative rule differs: the slope ``Phi(u) + u * phi(u)`` is computed in the forward, so the
    backward keeps that one array (the size of ``u``) where JAX's generic rule keeps three. On
    this project's job that is 4 MB less for F to write and B to read per stage and microbatch,
    about 5% of each (``benchmarks/bench_vs_torch.py``'s per-action times).
    """
    return u * _normal_cdf(u)


def _normal_cdf(u: jax.Array) -> jax.Array:
    return 0.5 * (1.0 + jax.lax.erf(u * math.sqrt(0.5)))  # PyTorch's form; erfc costs ~10% more in F


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    (u,), (du,) = primals, tangents
    cdf = _normal_cdf(u)
    slope = cdf + u * jnp.exp(-0.5 * u * u) * (1.0 / math.sqrt(2.0 * math.pi))
    return u * cdf, slope * du


@dataclass(frozen=True)
class ModelConfig:
    """Size of the digits Transformer. The PyTorch benchmark job uses d=128, heads=4, blocks=8."""

    d: int = 32  # model width (features per token)
    heads: int = 4  # attention heads; d must be a multiple of heads
    blocks: int = 4  # Transformer blocks N
    seed: int = 0  # seed of the parameter initialisation (jax.random, not PyTorch's stream)

    def __post_init__(self) -> None:
        for name in ("d", "heads", "blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be an integer >= 1, got {value!r}")
        if self.d % self.heads:
            raise ValueError(f"ModelConfig: d={self.d} is not divisible by heads={self.heads}")


# ---------------------------------------------------------------------------- layers


def _torch_uniform(fan_in: int) -> Callable:
    """PyTorch's default Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _linear(n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    init = _torch_uniform(n_in)
    return nnx.Linear(n_in, n_out, kernel_init=init, bias_init=init, rngs=rngs)


def _layer_norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, rngs=rngs)


class Embed(nnx.Module):
    """Part 0: token projection Linear(8, d) plus a learned position embedding (8, d)."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.tok = _linear(TOKEN_DIM, d, rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, d), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:  # (b, 8, 8) -> (b, 8, d)
        return self.tok(x) + self.pos[...]


class Block(nnx.Module):
    """One pre-norm Transformer block: attention then MLP (d -> 4d -> d), each with a residual."""

    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
        if d % heads:
            raise ValueError(f"d={d} is not divisible by heads={heads}")
        self.heads = heads
        self.ln1 = _layer_norm(d, rngs)
        self.qkv = _linear(d, 3 * d, rngs)
        self.proj = _linear(d, d, rngs)
        self.ln2 = _layer_norm(d, rngs)
        self.fc1 = _linear(d, 4 * d, rngs)
        self.fc2 = _linear(4 * d, d, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # (b, t, d) -> (b, t, d)
        b, t, d = x.shape
        h = self.heads
        qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, h, d // h)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # each (b, h, t, d/h)
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // h)
        a = jax.nn.softmax(scores, axis=-1) @ v  # (b, h, t, d/h)
        x = x + self.proj(a.transpose(0, 2, 1, 3).reshape(b, t, d))
        return x + self.fc2(gelu(self.fc1(self.ln2(x))))


class Head(nnx.Module):
    """Part N+1: final LayerNorm, mean over tokens, Linear(d, 10) -> logits."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.ln = _layer_norm(d, rngs)
        self.out = _linear(d, NUM_CLASSES, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # (b, t, d) -> (b, 10)
        return self.out(self.ln(x).mean(axis=1))


def build_parts(config: ModelConfig = ModelConfig()) -> list[nnx.Module]:
    """The digits Transformer as its list of parts ``[Embed, Block x N, Head]`` (fresh init)."""
    rngs = nnx.Rngs(config.seed)
    return [Embed(config.d, rngs=rngs), *[Block(config.d, config.heads, rngs=rngs) for _ in range(config.blocks)], Head(config.d, rngs=rngs)]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` (b, classes) float32 against integer ``labels`` (b,)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# ---------------------------------------------------------------------------- stages


def stage_parts(num_blocks: int, num_stages: int) -> list[list[int]]:
    """Indices of the parts (0 = first module, 1..N = blocks, N+1 = last module) in each stage.

    Block boundaries at ``round(i * N / S)``, the first module with stage 0, the last with stage
    S-1: the rule of the PyTorch benchmark's ``stage_parts``.

    Raises:
        ValueError: fewer blocks than stages (a stage would hold no block), or num_stages < 1.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if num_blocks < num_stages:
        raise ValueError(
            f"{num_blocks} blocks cannot fill {num_stages} stages: every stage needs at least one "
            f"block; use a model with >= {num_stages} blocks or a schedule with fewer stages"
        )
    cuts = [round(i * num_blocks / num_stages) for i in range(num_stages + 1)]
    parts = [[1 + b for b in range(cuts[s], cuts[s + 1])] for s in range(num_stages)]
    parts[0].insert(0, 0)
    parts[-1].append(num_blocks + 1)
    return parts


class StagedModel:
    """A model given as a list of NNX modules ``[first, *blocks, last]``, cut into stages.

    Attributes:
        num_stages: S.
        parts: ``parts[s]`` lists the module indices of stage s (:func:`stage_parts`, or the
            ``parts`` argument: a custom contiguous partition, e.g. from the rebalancer).
        params: the parameters, one ``nnx.State`` per module (a list; pytrees of float32 arrays).

    Stage s is the pure function :meth:`stage_fn` ``(stage_params, x, labels) -> y``: stage 0
    takes the input batch, the last stage returns the scalar ``loss_fn(logits, labels)``, the
    others ignore ``labels``. :meth:`split_stage` gives its F, B, W and BW
    (:class:`~zbpp_lite.split.StageSplit`); :meth:`loss` is the unpartitioned model on a whole batch.

    Raises:
        ValueError: fewer than two modules, fewer blocks than stages, or a module holding state
            other than parameters (batch statistics, RNG counters).
    """

    def __init__(self, modules: Sequence[nnx.Module], num_stages: int, loss_fn: Callable = cross_entropy,
                 parts: Sequence[Sequence[int]] | None = None):
        if len(modules) < 2:
            raise ValueError(f"a staged model needs at least a first and a last module, got {len(modules)} module(s)")
        self.num_stages = num_stages
        self.parts = stage_parts(len(modules) - 2, num_stages) if parts is None else [list(p) for p in parts]
        if parts is not None and (len(self.parts) != num_stages or not all(self.parts) or sum(self.parts, []) != list(range(len(modules)))):
            raise ValueError(f"parts must split modules 0 .. {len(modules) - 1} in order into {num_stages} non-empty stages, got {self.parts}")
        self.loss_fn = loss_fn
        self.graphdefs, self.params = [], []
        for i, module in enumerate(modules):
            graphdef, params, rest = nnx.split(module, nnx.Param, ...)
            if jax.tree_util.tree_leaves(rest):
                raise ValueError(f"module {i} ({type(module).__name__}) holds state other than parameters; only nnx.Param state is supported")
            self.graphdefs.append(graphdef)
            self.params.append(params)

    @property
    def num_parts(self) -> int:
        return len(self.graphdefs)

    def stage_params(self, params: Params, stage: int) -> list:
        """The entries of a per-module parameter list that belong to ``stage``."""
        return [params[i] for i in self.parts[stage]]

    def join_stage_params(self, per_stage: Sequence[Sequence[Any]]) -> Params:
        """Inverse of :meth:`stage_params` over all stages: per-stage lists -> one per-module list."""
        return [p for stage in per_stage for p in stage]

    def _apply(self, indices: Sequence[int], params: Sequence, x: jax.Array) -> jax.Array:
        for i, p in zip(indices, params):
            x = nnx.merge(self.graphdefs[i], p)(x)
        return x

    def stage_fn(self, stage: int) -> Callable:
        """Pure ``(stage_params, x, labels) -> y`` of one stage; the last stage returns the loss."""
        indices, last = self.parts[stage], stage == self.num_stages - 1

        def fn(stage_params, x, labels):
            y = self._apply(indices, stage_params, x)
            return self.loss_fn(y, labels) if last else y

        return fn

    def stage_inputs(self, x: Any) -> list[jax.ShapeDtypeStruct]:
        """Shape and dtype of every stage's input for a (micro)batch shaped like ``x``."""
        shapes = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))]
        for s in range(self.num_stages - 1):
            shapes.append(jax.eval_shape(self.stage_fn(s), self.stage_params(self.params, s), shapes[-1], None))
        return shapes

    def split_stage(self, stage: int, x: Any, labels: Any = None) -> StageSplit:
        """F, B, W and BW of ``stage`` (:class:`~zbpp_lite.split.StageSplit`) for a stage input
        shaped like ``x`` and, on the last stage, labels shaped like ``labels``.

        Cached by what the stage computes (its modules' structure, first / last, loss, shapes),
        so stages alike (in this model or another) share one set of jitted functions, compiled
        once per device.
        """
        last = stage == self.num_stages - 1
        aux = labels if last else None
        params = self.stage_params(self.params, stage)
        key = (
            tuple(self.graphdefs[i] for i in self.parts[stage]),
            stage == 0,
            self.loss_fn if last else None,
            *[(tuple(np.shape(a)), str(jnp.result_type(a))) for a in jax.tree_util.tree_leaves((params, x, aux))],
        )
        if key not in _SPLITS:
            _SPLITS[key] = StageSplit(self.stage_fn(stage), params, x, aux, input_grad=stage > 0)
        return _SPLITS[key]

    def logits(self, params: Params, x: jax.Array) -> jax.Array:
        """The unpartitioned model's output (logits) on ``x``."""
        return self._apply(range(self.num_parts), params, x)

    def loss(self, params: Params, x: jax.Array, labels: jax.Array) -> jax.Array:
        """The unpartitioned model's loss on a whole batch (the reference for the pipeline)."""
        return self.loss_fn(self.logits(params, x), labels)


# ---------------------------------------------------------------------------- PyTorch weights


def torch_names(config: ModelConfig) -> dict[str, tuple[int, tuple[str, ...], bool]]:
    """PyTorch state-dict name -> (part index, path inside that part's nnx.State, transpose?).

    Names follow ``nn.Sequential(Embed, *Blocks, Head)`` of the PyTorch script: ``0.tok.weight``,
    ``0.pos``, ``{i}.qkv.weight`` ..., ``{N+1}.out.bias``. PyTorch's Linear weight is (out, in)
    and Flax's kernel (in, out), hence the transpose; LayerNorm ``weight`` is Flax's ``scale``.
    """
    names: dict[str, tuple[int, tuple[str, ...], bool]] = {}

    def linear(part: int, layer: str) -> None:
        names[f"{part}.{layer}.weight"] = (part, (layer, "kernel"), True)
        names[f"{part}.{layer}.bias"] = (part, (layer, "bias"), False)

    def norm(part: int, layer: str) -> None:
        names[f"{part}.{layer}.weight"] = (part, (layer, "scale"), False)
        names[f"{part}.{layer}.bias"] = (part, (layer, "bias"), False)

    linear(0, "tok")
    names["0.pos"] = (0, ("pos",), False)
    for i in range(1, config.blocks + 1):
        norm(i, "ln1")
        linear(i, "qkv")
        linear(i, "proj")
        norm(i, "ln2")
        linear(i, "fc1")
        linear(i, "fc2")
    head = config.blocks + 1
    norm(head, "ln")
    linear(head, "out")
    return names


def torch_params(arrays: Mapping[str, Any], config: ModelConfig) -> Params:
    """Parameters (one nnx.State per part) from a PyTorch state dict given as NumPy arrays.

    Raises:
        ValueError: a missing or unexpected name, or an array whose shape does not fit ``config``
            (the message names the array, its shape and the expected one).
    """
    names = torch_names(config)
    missing = sorted(set(names) - set(arrays))
    extra = sorted(set(arrays) - set(names))
    if missing or extra:
        raise ValueError(
            f"PyTorch weights do not match the model (d={config.d}, blocks={config.blocks}): "
            f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}"
        )
    params = [nnx.state(m, nnx.Param) for m in build_parts(config)]
    pure = [nnx.to_pure_dict(p) for p in params]
    for name, (part, path, transpose) in names.items():
        value = np.asarray(arrays[name], dtype=np.float32)
        value = value.T if transpose else value
        node = pure[part]
        for key in path[:-1]:
            node = node[key]
        expected = tuple(node[path[-1]].shape)
        if value.shape != expected:
            shown = value.T.shape if transpose else value.shape
            want = expected[::-1] if transpose else expected
            raise ValueError(f"PyTorch weight {name!r} has shape {shown}, expected {want} for d={config.d}")
        node[path[-1]] = jnp.asarray(value)
    for p, d in zip(params, pure):
        nnx.replace_by_pure_dict(p, d)
    return params


def load_torch_init(path: str | os.PathLike, config: ModelConfig) -> Params:
    """Read the ``--save-init`` .npz of ``torch_pp_bench.py`` into our parameters.

    ``config`` must have the script's d and blocks (heads does not change shapes, so give the
    same heads too). Raises FileNotFoundError or ValueError (see :func:`torch_params`).
    """
    with np.load(path) as data:
        return torch_params({k: data[k] for k in data.files}, config)
