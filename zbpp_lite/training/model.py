"""The jobs' models (Flax NNX): the digits Transformer classifier, the job of this project's course and
benchmarks, and a GPT-style byte-level language model (:class:`GPTConfig`), the model people train.

It is ``shared/peers/torch_pp_bench.py``'s job, so losses match PyTorch number for number (float32):

    x (b, 8, 8): 8 row tokens of 8 pixels / 16
    -> Linear(8, d) + learned position embedding (8, d)                        Embed   (part 0)
    -> N x [x + proj(MHSA_h(LN1 x)); x + fc2(GELU(fc1(LN2 x)))]                Block   (parts 1..N)
    -> LayerNorm -> mean over the 8 tokens -> Linear(d, 10)                    Head    (part N+1)
    -> mean cross-entropy over the (micro)batch

Attention: one fused qkv Linear(d, 3d) laid out [q | k | v], each [head 0 | head 1 | ...];
softmax(q k^T / sqrt(d/h)), no mask. GELU exact (erf); LayerNorm eps 1e-5, two-pass variance. Init is
PyTorch's in distribution (Linear ~ U(-1/sqrt(in), 1/sqrt(in)), position embedding ~ N(0, 0.02^2));
:func:`load_torch_init` loads the script's exact values. The pipeline gets the list of parts
(:func:`build_parts`), cut into stages by :class:`zbpp_lite.runtime.stages.StagedModel`.

The GPT (decoder-only, as GPT-2: Radford et al. 2019; nanoGPT's layout) is the same Block, causal:

    tokens (b, t) int32 bytes
    -> Embed(256, d) + learned position embedding (context, d), dropout       TokenEmbed   (part 0)
    -> N x [x + drop(proj(causal MHSA_h(LN1 x))); x + drop(fc2(GELU(fc1(LN2 x))))]   Block (parts 1..N)
    -> LayerNorm -> logits h E^T with E the token embedding (tied)            LMHead       (part N+1)
    -> mean cross-entropy over every position's next byte (nats)

Options: dropout rate (no dropout on the attention weights), ``dtype`` "bfloat16" (matmuls and
activations in bf16; parameters, softmax, logits and gradient sums in float32) and ``remat`` (each block
under ``jax.checkpoint``: B recomputes its forward from the block's input and dropout key).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..runtime.stages import Params

SEQ_LEN = 8
"""Tokens per image: its 8 rows."""
TOKEN_DIM = 8
"""Pixels per token."""
NUM_CLASSES = 10


@jax.custom_jvp
def gelu(u: jax.Array) -> jax.Array:
    """Exact (erf) GELU ``0.5 u (1 + erf(u / sqrt 2))`` as PyTorch's ``nn.GELU()``, elementwise, float32.

    Equals ``jax.nn.gelu(u, approximate=False)`` within 1e-6; the slope ``Phi(u) + u * phi(u)`` is
    computed in the forward, so the backward keeps one array where JAX's rule keeps three (about 5% of
    F and B on this job, ``benchmarks/bench_vs_torch.py``).
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


@dataclass(frozen=True)
class RunConfig:
    """How a training run goes (everything but the model and the schedule).

    Attributes:
        batch: global batch, samples; a multiple of the microbatch count.
        lr, weight_decay: AdamW (PyTorch's defaults otherwise). seed: batch order, held-out split and, for
            a model with dropout, the keys (:func:`~zbpp_lite.runtime.stages.dropout_keys`).
        holdout: fraction held out for the test (0: the PyTorch job's batches, tested on all samples).
        init: a ``torch_pp_bench.py --save-init`` .npz to start from (same ``d`` and ``blocks``).
        check_grads: compare the first step with the unpartitioned model. progress: a tqdm bar.
        max_grad_norm: clip to this global norm, skip a step with NaN/Inf (Optax
            ``clip_by_global_norm``); the optimizer then steps inside the rank threads
            (:class:`zbpp_lite.training.train.ClippedAdamW`), synchronous or, with ``post_validation``,
            post-validated at each step's end (paper section 4); ``TrainResult.config`` gets
            ``guard_reports``.
        post_validation: see ``max_grad_norm`` (requires it).
        eval_every: the held-out loss every this many steps besides at the start and the end
            (``TrainResult.validation``, for the curve over steps; 0: at the end only).

    Raises:
        ValueError: a non-positive batch, lr or max_grad_norm, a holdout outside [0, 1), a negative
            eval_every, or post_validation without max_grad_norm.
    """

    batch: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    holdout: float = 0.2
    init: str | os.PathLike | None = None
    check_grads: bool = True
    progress: bool = False
    max_grad_norm: float | None = None
    post_validation: bool = False
    eval_every: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {self.batch!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"eval_every must be an integer >= 0 (0: at the end only), got "
                             f"{self.eval_every!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.post_validation and self.max_grad_norm is None:
            raise ValueError("post_validation validates a clipped step: give max_grad_norm too")


@dataclass(frozen=True)
class GPTConfig(ModelConfig):
    """Size and options of the GPT (see the module docstring); the digits' fields, other defaults.

    The default trains on 2 CPU cores; GPT-2 small is ``GPTConfig(d=768, heads=12, blocks=12,
    context=1024)`` (124M parameters with GPT-2's 50,257 tokens, 86.0M with our 256 bytes).
    """

    d: int = 128  # model width
    heads: int = 4  # attention heads
    blocks: int = 4  # Transformer blocks N
    context: int = 128  # tokens per sequence (the position embedding's rows)
    vocab: int = 256  # tokens: bytes
    dropout: float = 0.1  # rate after the embedding and on each residual branch (0: none)
    dtype: str = "float32"  # compute dtype: "float32" or "bfloat16" (parameters stay float32)
    remat: bool = False  # each block under jax.checkpoint (nnx.remat)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("context", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"GPTConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")


MODELS = {"digits": ModelConfig, "gpt": GPTConfig}
"""The jobs' models by name (``--model``): their configuration classes."""


def model_name(config: ModelConfig) -> str:
    """``"gpt"`` for a :class:`GPTConfig`, else ``"digits"``."""
    return "gpt" if isinstance(config, GPTConfig) else "digits"


def config_json(config: ModelConfig) -> dict:
    """``config``'s fields and its model's name (``"model"``), JSON-ready; :func:`config_of` reads it."""
    return {"model": model_name(config), **dataclasses.asdict(config)}


def config_of(data: Mapping[str, Any]) -> ModelConfig:
    """The configuration :func:`config_json` wrote (no ``"model"``: the digits')."""
    fields = dict(data)
    return MODELS[fields.pop("model", "digits")](**fields)


def settings_json(config: ModelConfig, run: RunConfig) -> dict:
    """The model's and the run's settings as ``TrainResult.config`` records them (JSON-ready)."""
    # the model's name and the GPT's own fields, then the digits' settings as before
    extra = {k: v for k, v in config_json(config).items() if k not in ("d", "heads", "blocks", "seed")}
    return {**extra, "d": config.d, "heads": config.heads, "blocks": config.blocks, "batch": run.batch,
            "lr": run.lr, "weight_decay": run.weight_decay, "seed": run.seed, "holdout": run.holdout,
            "init": None if run.init is None else str(run.init)}


# ---------------------------------------------------------------------------- layers


def _linear(n_in: int, n_out: int, rngs: nnx.Rngs, dtype: Any = None) -> nnx.Linear:
    """PyTorch's default Linear init: weight and bias ~ U(-1/sqrt(n_in), 1/sqrt(n_in)); float32
    parameters, computed in ``dtype`` (None: float32)."""
    bound = 1.0 / math.sqrt(n_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return nnx.Linear(n_in, n_out, kernel_init=init, bias_init=init, dtype=dtype, rngs=rngs)


def _layer_norm(d: int, rngs: nnx.Rngs, dtype: Any = None) -> nnx.LayerNorm:
    return nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, dtype=dtype, rngs=rngs)


class Embed(nnx.Module):
    """Part 0: token projection Linear(8, d) plus a learned position embedding (8, d)."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.tok = _linear(TOKEN_DIM, d, rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, d), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:  # (b, 8, 8) -> (b, 8, d)
        return self.tok(x) + self.pos[...]


class Block(nnx.Module):
    """One pre-norm Transformer block: attention then MLP (d -> 4d -> d), each with a residual.

    ``causal``: position i attends to positions <= i (the GPT); ``dropout`` > 0: an ``nnx.Dropout`` on
    each residual branch (its masks drawn from the microbatch's key, :class:`StagedModel`); ``dtype``:
    the compute dtype (None: float32), the attention softmax in float32 always; ``remat``: the block
    under ``nnx.remat`` (``jax.checkpoint``). The digits use none of them (the PyTorch job's block).
    """

    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs, causal: bool = False, dropout: float = 0.0,
                 dtype: Any = None, remat: bool = False):
        if d % heads:
            raise ValueError(f"d={d} is not divisible by heads={heads}")
        self.heads, self.causal, self.remat = heads, causal, remat
        self.ln1 = _layer_norm(d, rngs, dtype)
        self.qkv = _linear(d, 3 * d, rngs, dtype)
        self.proj = _linear(d, d, rngs, dtype)
        self.ln2 = _layer_norm(d, rngs, dtype)
        self.fc1 = _linear(d, 4 * d, rngs, dtype)
        self.fc2 = _linear(4 * d, d, rngs, dtype)
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None  # drawn after the parameters

    def __call__(self, x: jax.Array) -> jax.Array:  # (b, t, d) -> (b, t, d)
        return nnx.remat(type(self).forward)(self, x) if self.remat else self.forward(x)

    def forward(self, x: jax.Array) -> jax.Array:
        """The block without the checkpoint: (b, t, d) -> (b, t, d)."""
        b, t, d = x.shape
        h = self.heads
        # [q | k | v] split, not sliced: the backward of a split is one concatenation, where three
        # slices' backward pads each gradient to the full width and adds the three (3x the writes)
        qkv = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for a in qkv)  # each (b, h, t, d/h)
        scores = (q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // h)).astype(jnp.float32)
        if self.causal:  # (t, t): key j visible to query i when j <= i
            scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
        a = jax.nn.softmax(scores, axis=-1).astype(v.dtype) @ v  # (b, h, t, d/h)
        x = x + self._dropped(self.proj(a.transpose(0, 2, 1, 3).reshape(b, t, d)))
        return x + self._dropped(self.fc2(gelu(self.fc1(self.ln2(x)))))

    def _dropped(self, branch: jax.Array) -> jax.Array:
        return branch if self.drop is None else self.drop(branch)


class Head(nnx.Module):
    """Part N+1: final LayerNorm, mean over tokens, Linear(d, 10) -> logits."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.ln = _layer_norm(d, rngs)
        self.out = _linear(d, NUM_CLASSES, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # (b, t, d) -> (b, 10)
        return self.out(self.ln(x).mean(axis=1))


class TokenEmbed(nnx.Module):
    """The GPT's part 0: byte embedding ``E`` (vocab, d) ~ N(0, 0.02^2) plus a learned position
    embedding (context, d) ~ N(0, 0.02^2), then dropout; tokens (b, t) int, t <= context -> (b, t, d)."""

    def __init__(self, config: "GPTConfig", *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.tok = nnx.Embed(config.vocab, config.d, dtype=dtype, rngs=rngs,
                             embedding_init=nnx.initializers.normal(0.02))
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (config.context, config.d), jnp.float32))
        self.drop = nnx.Dropout(config.dropout, rngs=rngs) if config.dropout else None

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]].astype(self.tok.dtype)
        return h if self.drop is None else self.drop(h)


class LMHead(nnx.Module):
    """The GPT's part N+1: final LayerNorm, then logits ``h E^T`` with ``tied`` (the token embedding's
    ``nnx.Embed``, the same module: Press & Wolf, arXiv 1608.05859); (b, t, d) -> (b, t, vocab) float32."""

    def __init__(self, tied: nnx.Embed, d: int, dtype: Any, *, rngs: nnx.Rngs):
        self.ln = _layer_norm(d, rngs, dtype)
        self.tied = tied

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.tied.attend(self.ln(h)).astype(jnp.float32)


def build_parts(config: ModelConfig = ModelConfig()) -> list[nnx.Module]:
    """The model as its list of parts (fresh init): the digits' ``[Embed, Block x N, Head]``, or for a
    :class:`GPTConfig` ``[TokenEmbed, Block x N, LMHead]`` (the head holds the embedding: tied). Under
    ``nnx.eval_shape`` (:func:`abstract_parts`) nothing is allocated."""
    rngs = nnx.Rngs(config.seed)
    if isinstance(config, GPTConfig):
        embed, dtype = TokenEmbed(config, rngs=rngs), jnp.dtype(config.dtype)
        blocks = [Block(config.d, config.heads, rngs=rngs, causal=True, dropout=config.dropout, dtype=dtype,
                        remat=config.remat) for _ in range(config.blocks)]
        return [embed, *blocks, LMHead(embed.tok, config.d, dtype, rngs=rngs)]
    embed = Embed(config.d, rngs=rngs)  # in this order: each part draws its initial values from rngs in turn
    blocks = [Block(config.d, config.heads, rngs=rngs) for _ in range(config.blocks)]
    return [embed, *blocks, Head(config.d, rngs=rngs)]


# ---------------------------------------------------------------------------- PyTorch weights


def abstract_parts(config: ModelConfig) -> list[nnx.Module]:
    """:func:`build_parts` with ``jax.ShapeDtypeStruct`` for every parameter (``nnx.eval_shape``): plans
    and memory from shapes (GPT-2 small's 124M parameters are never allocated)."""
    return nnx.eval_shape(lambda: build_parts(config))


def torch_names(config: ModelConfig) -> dict[str, tuple[int, tuple[str, ...], bool]]:
    """PyTorch state-dict name (``0.tok.weight``, ``{i}.qkv.weight``, ...) -> (part index, path in its
    nnx.State, transpose? (Linear (out, in) vs Flax (in, out))); LayerNorm ``weight`` is ``scale``."""
    head = config.blocks + 1
    block = (("ln1", False), ("qkv", True), ("proj", True), ("ln2", False), ("fc1", True), ("fc2", True))
    layers = [(0, "tok", True), *((i, name, linear) for i in range(1, head) for name, linear in block),
              (head, "ln", False), (head, "out", True)]  # (part, layer, Linear? else LayerNorm)
    names = {"0.pos": (0, ("pos",), False)}
    for part, layer, linear in layers:
        names[f"{part}.{layer}.weight"] = (part, (layer, "kernel" if linear else "scale"), linear)
        names[f"{part}.{layer}.bias"] = (part, (layer, "bias"), False)
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
            f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
            f"unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}"
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
    """Read ``torch_pp_bench.py``'s ``--save-init`` .npz (``config`` with the script's d, blocks, heads).
    Raises FileNotFoundError or ValueError (see :func:`torch_params`)."""
    if isinstance(config, GPTConfig):
        raise ValueError("PyTorch weights (init) are the digits job's; the GPT starts from its own init")
    with np.load(path) as data:
        return torch_params({k: data[k] for k in data.files}, config)
