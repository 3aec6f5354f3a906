"""The single-device baseline: the unpartitioned model, one jitted training step on one device.

What a pipeline's speed-up is measured against (the PyTorch benchmark's ``baseline`` run,
``shared/peers/torch_pp_bench.py``): the whole model, the whole global batch at once, on one
device, ``jax.value_and_grad`` of the mean loss and the AdamW update in one ``jax.jit``-ed
program whose parameters and optimizer state are donated (updated in place). Same model, data,
batch order, initial weights and optimizer as :func:`zbpp_lite.training.train.train`, so the two give the
same losses step for step (up to float32 rounding).

Why this whole-batch step is slower on XLA:CPU than our executor on one rank (about 2.8x on the
peer job, d = 128, batch 256, one core): its weight gradients ``dW = x^T dy`` contract over the
batch and token dimensions of 3-D activations, and XLA:CPU makes ``x^T`` with a strided
transpose copy of every (2048, 128) activation before a plain (non-YNNPACK) dot. In a profile of
one step (``jax.profiler``, op by op) those ``copy_bitcast_fusion`` transposes take more time
than the products themselves. The backward split (:mod:`zbpp_lite.runtime.split`) stores ``x^T``
in F for each 32-sample microbatch, where the transpose fits in cache, and W is one row-major
product. So speed-ups are taken against the faster of the two single-device references
(``compare`` names it): this step, and our executor on one rank (the same kernels and
microbatches as the pipeline).

``microbatches`` > 1 is an option of ours, not the PyTorch job's: the same step accumulating the
gradient over that many microbatches in order (``jax.lax.scan``), still on one device. It
separates what microbatching alone changes (smaller working sets) from what the pipeline adds
(a second device).

Importing this module does not import JAX (the functions do).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .data import Digits, load_digits
from ..runtime.stages import microbatch_size


def make_step(model, optimizer, microbatches: int = 1) -> Callable:
    """The jitted training step ``step(params, opt_state, x, labels) -> (params, opt_state, loss)``.

    Args:
        model: a :class:`~zbpp_lite.runtime.stages.StagedModel` (any number of stages: only its
            unpartitioned :meth:`~zbpp_lite.runtime.stages.StagedModel.loss` is used).
        optimizer: an optax transformation (e.g. :func:`adamw`).
        microbatches: 1 for the whole batch at once; m > 1 accumulates the gradient over m
            equal microbatches (the mean of their mean losses, i.e. the global-batch mean).

    ``x`` is (b, ...) float32 and ``labels`` (b,) integers; ``loss`` is the global-batch mean
    loss before the update (float32 scalar). ``params`` and ``opt_state`` are donated: the arrays
    passed in are consumed, use the returned ones.
    """
    import jax
    import jax.numpy as jnp
    import optax

    grad_fn = jax.value_and_grad(model.loss)

    def loss_and_grads(params, x, labels):
        if microbatches == 1:
            return grad_fn(params, x, labels)
        xs = x.reshape(microbatches, -1, *x.shape[1:])
        ys = labels.reshape(microbatches, -1)

        def one(carry, batch):
            loss, grads = grad_fn(params, *batch)
            return jax.tree_util.tree_map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(one, zeros, (xs, ys))
        return jax.tree_util.tree_map(lambda v: v / microbatches, (loss, grads))

    def step(params, opt_state, x, labels):
        loss, grads = loss_and_grads(params, x, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


@dataclass
class BaselineResult:
    """What one baseline run did and measured.

    Attributes:
        losses: global-batch mean training loss of every step (before its update), floats.
        step_seconds: wall time of every step, the update included (the first includes
            compilation).
        test_loss, test_accuracy: the trained model on the test samples.
        params: the trained parameters (one pytree per model module).
        config: the settings of the run.
    """

    losses: list[float]
    step_seconds: list[float]
    test_loss: float
    test_accuracy: float
    params: Any = field(repr=False)
    config: dict = field(default_factory=dict)


def train_baseline(
    steps: int = 20,
    *,
    d: int = 32,
    heads: int = 4,
    blocks: int = 4,
    batch: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    seed: int = 0,
    holdout: float = 0.2,
    init: str | os.PathLike | None = None,
    microbatches: int = 1,
    device: Any = None,
    data: Digits | None = None,
) -> BaselineResult:
    """Train the unpartitioned digits Transformer on one device, one jitted step per batch.

    Arguments as :func:`zbpp_lite.training.train.train` (same model, data, batches and AdamW); ``device``
    defaults to JAX's first device; ``microbatches`` as in :func:`make_step`.

    Raises:
        ValueError: steps < 1, or a batch that does not divide into ``microbatches``; before any
            compute. FileNotFoundError / ValueError: an ``init`` file that is missing or does not
            fit the model (see :func:`zbpp_lite.training.model.load_torch_init`).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    microbatch_size(batch, microbatches)
    from .model import ModelConfig

    config = ModelConfig(d=d, heads=heads, blocks=blocks, seed=seed)
    import jax

    from ..runtime.stages import StagedModel
    from .model import build_parts, load_torch_init
    from .reference import adamw, evaluate

    device = device if device is not None else jax.devices()[0]
    data = data if data is not None else load_digits(holdout, seed)
    model = StagedModel(build_parts(config), 1)
    optimizer = adamw(lr, weight_decay)
    params = jax.device_put(load_torch_init(init, config) if init is not None else model.params, device)
    opt_state = jax.device_put(optimizer.init(params), device)
    step = make_step(model, optimizer, microbatches)
    losses, seconds = [], []
    for k in range(steps):
        x, y = data.batch(k, batch)
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, jax.device_put(x, device), jax.device_put(y, device))
        jax.block_until_ready(params)
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss))
    test_loss, test_accuracy = evaluate(model, params, data.test_x, data.test_y, device)
    return BaselineResult(
        losses=losses, step_seconds=seconds, test_loss=test_loss, test_accuracy=test_accuracy, params=params,
        config={"d": d, "heads": heads, "blocks": blocks, "batch": batch, "lr": lr, "weight_decay": weight_decay,
                "seed": seed, "holdout": holdout, "init": None if init is None else str(init),
                "microbatches": microbatches, "device": str(device)},
    )


def step_stats(step_seconds: list[float], warmup: int) -> dict:
    """Median and minimum step time in milliseconds over the steps after ``warmup``."""
    timed = np.asarray(step_seconds[warmup:], np.float64) * 1e3
    if timed.size == 0:
        raise ValueError(f"no timed steps: {len(step_seconds)} step(s), {warmup} warm-up")
    return {"median_ms": float(np.median(timed)), "min_ms": float(timed.min()), "step_ms": timed.tolist()}
