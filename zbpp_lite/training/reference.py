"""The single-device reference every pipeline run is checked and timed against.

Correctness: :func:`reference_grads`, :func:`evaluate`, :func:`max_relative_error`. The one optimizer:
:func:`jitted_update` (Optax's AdamW of :class:`~.postval.rollback.AdamWConfig`). Speed:
:func:`train_baseline` (the PyTorch benchmark's ``baseline``: whole batch, loss, gradients and AdamW in
one jitted step with donated state; same model, data, batches, init and optimizer as
:func:`zbpp_lite.training.train.train`, so losses agree to float32 rounding; ``microbatches`` m > 1
accumulates the batch's m microbatches one after another inside that step) and :func:`one_rank_schedule`
(our executor on one rank). On XLA:CPU the whole batch in one program is the slowest of the three at the
peer job's size: its backward reads every block's activations back after they have left the caches, and
each weight gradient first copies an operand transposed; accumulated microbatches keep one microbatch's
activations in cache (``docs/XLA_BACKWARD.md``). ``compare`` times the accumulated step and the one-rank
executor and takes speed-ups against the faster, which it names.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..analysis.profiling.timelines import timed_steps
from ..runtime.stages import StagedModel, dropout_keys, microbatch_size
from ..schedules.builders import build_schedule
from ..schedules.ir import Schedule
from .data import ByteText, Digits, load_data
from .model import ModelConfig, RunConfig, build_parts, load_torch_init, settings_json
from .postval.rollback import AdamWConfig


@functools.lru_cache(maxsize=8)
def jitted_update(config: AdamWConfig) -> Callable:
    """``config.optimizer()`` jitted over lists: ``update(grads, states, params) -> (params, states)``,
    one entry per model module (or per stage's leaves)."""
    opt = config.optimizer()

    @jax.jit
    def update(grads, states, params):
        out = [opt.update(g, st, p) for g, st, p in zip(grads, states, params)]
        return [optax.apply_updates(p, u) for p, (u, _) in zip(params, out)], [st for _, st in out]

    return update


def adamw_step(params: Any, state: Any, grads: Any, config: AdamWConfig) -> tuple[Any, Any]:
    """One AdamW step of ``config`` (:func:`jitted_update`): ``(params, state)`` after ``grads``."""
    new, states = jitted_update(config)([grads], [state], [params])
    return new[0], states[0]


def max_relative_error(grads: Sequence[Any], reference: Sequence[Any]) -> float:
    """Largest over leaves of max|g - r| / max|r| (max|g - r| where r is all zero)."""
    worst = 0.0
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        scale = np.abs(r).max()
        worst = max(worst, float(np.abs(g - r).max() / (scale if scale > 0 else 1.0)))
    return worst


GRAD_CHECK_TOLERANCE = 1e-3
"""The largest step-0 difference from the unpartitioned model a run accepts, relative: the gradients' max
relative error (:func:`max_relative_error`) and the loss difference over the loss. Float32 rounding of
another summation order stays near 1e-6 on CPU (the tests hold 1e-5); TF32 matmuls (JAX's default for
float32 on recent NVIDIA GPUs) keep 10 mantissa bits, about 1e-3. A wrong gradient is far above it: a
microbatch of four lost is 0.25, another initialisation about 1."""


def grad_check_tolerance(compute_dtype: str = "float32") -> float:
    """The check's tolerance for a model computing in ``compute_dtype``: :data:`GRAD_CHECK_TOLERANCE`, or 4
    machine epsilons of a narrower float (bfloat16, 8 significant bits: 0.03125). Two summation orders of
    the same bfloat16 products (the pipeline's microbatches against the whole batch) differ by rounding:
    5.6e-3 to 2.1e-2 on small GPTs (``train --model gpt --bf16``, d 16, m 2-8). Coarser than float32's:
    a wrong initialisation (about 1) still fails, but one microbatch of m lost (about 1/m) only below
    m = 32."""
    return max(GRAD_CHECK_TOLERANCE, 4 * float(np.finfo(jnp.dtype(compute_dtype)).eps))


def grad_check_failure(grad_error: float | None, loss_error: float | None, loss: float,
                       tolerance: float = GRAD_CHECK_TOLERANCE) -> str | None:
    """One line saying how step 0's gradients or loss differ from the unpartitioned model's by more than
    ``tolerance`` (:func:`grad_check_tolerance`), or None when both are within it (or the check was off:
    None errors). ``loss``: step 0's loss; NaN errors fail."""
    if grad_error is None or loss_error is None:
        return None
    relative = loss_error / max(abs(loss), 1e-30)
    if grad_error <= tolerance and relative <= tolerance:
        return None
    return (f"the gradient check failed: step 0 differs from the unpartitioned model by a max relative "
            f"gradient error of {grad_error:.2e} and a relative loss difference of {relative:.2e}, beyond "
            f"the tolerance {tolerance:g}: this run's gradients are wrong")


_JITTED: dict = {}  # (what, the model's structure) -> its jitted function, compiled once per shape


def _jitted(what: str, model, make):
    """One jitted ``make(model)`` per model structure, shared by every staged copy however cut."""
    graphdefs = tuple(getattr(model, "graphdefs", ()))
    if not graphdefs:  # no structure to key on: this model's own function, not kept
        return make(model)
    key = (what, graphdefs, getattr(model, "loss_fn", None), getattr(model, "ties", ()),
           getattr(model, "deterministic", False))
    if key not in _JITTED:
        _JITTED[key] = make(model)
    return _JITTED[key]


def step_dropout_keys(model: StagedModel, seed: int, step: int, num_microbatches: int) -> Any:
    """Step ``step``'s dropout keys from the run's ``seed`` (:func:`~zbpp_lite.runtime.stages.dropout_keys`,
    uint32 (m, 2)), or None for a model without dropout: what every training loop and reference uses."""
    return dropout_keys(seed, step, num_microbatches) if model.random_parts else None


def reference_grads(model, params, x, y, device, keys=None) -> tuple[float, Any]:
    """Loss and gradients of the unpartitioned model on the whole batch (one device); ``keys``: the step's
    dropout keys, each microbatch masked as the pipeline masks it (``StagedModel.loss``)."""
    params = jax.device_put(params, device)
    loss, grads = _jitted("grads", model, lambda m: jax.jit(jax.value_and_grad(m.loss)))(params, x, y, keys)
    return float(loss), grads


def evaluate(model, params, x: np.ndarray, y: np.ndarray, device=None) -> tuple[float, float]:
    """Mean loss and accuracy of the whole (unpartitioned) model on ``x``, ``y``."""
    params = jax.device_put(params, device) if device is not None else params

    def make(m):
        @jax.jit
        def run(params, x, y):
            logits = m.logits(params, x)
            return m.loss_fn(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

        return run

    loss, acc = _jitted("evaluate", model, make)(params, x, y)
    return float(loss), float(acc)


def write_bytes(model, params, prompt: bytes, n: int, context: int, seed: int = 0,
                temperature: float = 0.8) -> bytes:
    """``n`` bytes a byte-level language model writes after ``prompt``: the unpartitioned model (no
    dropout) on the last ``context`` bytes (the prompt padded on the left with spaces), the next byte
    drawn from ``softmax(logits / temperature)`` with ``jax.random.key(seed)``; one jitted forward of
    (1, context) per byte. ``model``: the GPT's :class:`~zbpp_lite.runtime.stages.StagedModel`.

    Raises:
        ValueError: an empty prompt, n < 0 or a temperature <= 0.
    """
    if not prompt or n < 0 or not temperature > 0:
        raise ValueError(f"write_bytes needs a prompt, n >= 0 and temperature > 0, got {len(prompt)} bytes, "
                         f"n={n}, temperature={temperature}")

    def make(m):
        return jax.jit(lambda params, window, key: jax.random.categorical(
            key, m.logits(params, window)[0, -1] / temperature))

    step = _jitted("write", model, make)
    params = jax.device_put(params, jax.devices()[0])  # the stages' devices: one for the whole model
    window = np.frombuffer(prompt[-context:].rjust(context, b" "), np.uint8).astype(np.int32)[None]
    keys = jax.random.split(jax.random.key(seed), max(n, 1))
    out = bytearray()
    for k in range(n):
        out.append(int(step(params, window, keys[k])))
        window = np.concatenate([window[:, 1:], [[out[-1]]]], axis=1).astype(np.int32)
    return bytes(out)


# ----------------------------------------------------------------------------- the baseline's speed


ONE_RANK = "one-rank reference"
"""The name of :func:`one_rank_schedule`'s schedule (in compare's turns)."""


def one_rank_schedule(num_ranks: int, num_microbatches: int) -> Schedule:
    """The whole model as one stage on rank 0 (GPipe's order), in a ``num_ranks``-rank schedule whose
    other ranks are idle, so it can take turns among the pipelines."""
    alone = build_schedule("gpipe", 1, num_microbatches)
    return Schedule((alone.actions[0], *([()] * (num_ranks - 1))), (0,), num_microbatches, ONE_RANK)


def make_step(model, optimizer, microbatches: int = 1) -> Callable:
    """The jitted training step ``step(params, opt_state, x, labels, keys=None) -> (params, opt_state,
    loss)``.

    ``model``: a :class:`~zbpp_lite.runtime.stages.StagedModel` (only its unpartitioned loss is used);
    ``optimizer``: optax; ``microbatches`` m > 1 accumulates over m equal microbatches. ``x`` (b, ...),
    ``labels`` (b, ...) int; ``keys``: the step's dropout keys (m, 2) (microbatch j masked with row j, as
    the pipeline masks it) or None; ``loss``: global-batch mean before the update (float32 scalar).
    ``params`` and ``opt_state`` are donated: use the returned ones.
    """
    grad_fn = jax.value_and_grad(model.loss)

    def loss_and_grads(params, x, labels, keys):
        if microbatches == 1:
            return grad_fn(params, x, labels, keys)
        xs = x.reshape(microbatches, -1, *x.shape[1:])
        ys = labels.reshape(microbatches, -1, *labels.shape[1:])
        ks = None if keys is None else keys[:, None]  # microbatch j: its row as a one-microbatch step's keys

        def one(carry, batch):
            loss, grads = grad_fn(params, *batch)
            return jax.tree_util.tree_map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(one, zeros, (xs, ys, ks))
        return jax.tree_util.tree_map(lambda v: v / microbatches, (loss, grads))

    def step(params, opt_state, x, labels, keys=None):
        loss, grads = loss_and_grads(params, x, labels, keys)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


@dataclass
class BaselineResult:
    """One baseline run: every step's mean loss (before its update) and ``step_seconds`` (the first
    compiles), test loss and accuracy, the trained ``params`` (one pytree per module), ``config``."""

    losses: list[float]
    step_seconds: list[float]
    test_loss: float
    test_accuracy: float
    params: Any = field(repr=False)
    config: dict = field(default_factory=dict)


def train_baseline(
    steps: int = 20,
    *,
    model: ModelConfig | None = None,
    run: RunConfig | None = None,
    microbatches: int = 1,
    device: Any = None,
    data: Digits | ByteText | None = None,
) -> BaselineResult:
    """Train the unpartitioned model (digits, or the GPT) on one device, one jitted step per batch
    (with dropout: each step's keys as the pipeline's).

    Arguments as :func:`zbpp_lite.training.train.train` (no gradient check, progress or clipping);
    ``device``: default JAX's first; ``microbatches`` as in :func:`make_step`.

    Raises:
        ValueError: steps < 1, or a batch that does not divide into ``microbatches``; before any
            compute. FileNotFoundError / ValueError: a bad ``init`` file (:func:`~.model.load_torch_init`).
    """
    config, run = model or ModelConfig(), run or RunConfig()
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    microbatch_size(run.batch, microbatches)
    device = device if device is not None else jax.devices()[0]
    data = data if data is not None else load_data(config, run)
    staged = StagedModel(build_parts(config), 1)
    optimizer = AdamWConfig(learning_rate=run.lr, weight_decay=run.weight_decay).optimizer()
    params = load_torch_init(run.init, config) if run.init is not None else staged.params
    params = jax.device_put(params, device)
    if staged.ties:  # tied copies are one array object; the step donates its parameters: one buffer each
        params = jax.tree_util.tree_map(jnp.copy, params)
    opt_state = jax.device_put(optimizer.init(params), device)
    step = make_step(staged, optimizer, microbatches)
    losses, seconds = [], []
    for k in range(steps):
        x, y = data.batch(k, run.batch)
        t0 = time.perf_counter()
        x, y = jax.device_put(x, device), jax.device_put(y, device)
        keys = step_dropout_keys(staged, run.seed, k, microbatches)
        params, opt_state, loss = step(params, opt_state, x, y, keys)
        jax.block_until_ready(params)
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss))
    test_loss, test_accuracy = evaluate(staged, params, data.test_x, data.test_y, device)
    return BaselineResult(
        losses=losses, step_seconds=seconds, test_loss=test_loss, test_accuracy=test_accuracy, params=params,
        config={**settings_json(config, run), "microbatches": microbatches, "device": str(device)},
    )


def step_stats(step_seconds: list[float], warmup: int) -> dict:
    """Median and minimum step time (ms) over the steps after ``warmup``."""
    if len(step_seconds) <= warmup:
        raise ValueError(f"no timed steps: {len(step_seconds)} step(s), {warmup} warm-up")
    timed = np.asarray(timed_steps(step_seconds, warmup), np.float64) * 1e3
    return {"median_ms": float(np.median(timed)), "min_ms": float(timed.min()), "step_ms": timed.tolist()}
