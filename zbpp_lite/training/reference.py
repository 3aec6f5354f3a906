"""The unpartitioned model as the reference every pipeline run is checked against.

What a pipelined step must reproduce: :func:`reference_grads` (loss and gradients of the whole
model on the whole batch, one device), :func:`evaluate` (loss and accuracy),
:func:`max_relative_error` (the gradient check's measure) and the optimizer both sides use,
:func:`adamw` with PyTorch's defaults (:func:`jitted_adamw` its jitted update).

Layer: training.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np


def adamw(lr: float = 1e-3, weight_decay: float = 0.01):
    """``optax.adamw`` with PyTorch's AdamW defaults (betas 0.9, 0.999, eps 1e-8)."""
    import optax

    return optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)


def max_relative_error(grads: Sequence[Any], reference: Sequence[Any]) -> float:
    """Largest over leaves of max|g - r| / max|r| (max|g - r| where r is all zero)."""
    import jax

    worst = 0.0
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        scale = np.abs(r).max()
        worst = max(worst, float(np.abs(g - r).max() / (scale if scale > 0 else 1.0)))
    return worst


@functools.lru_cache(maxsize=8)
def jitted_adamw(lr: float, weight_decay: float):
    """AdamW with PyTorch's defaults (:func:`adamw`) and its jitted update
    ``update(grads, state, params) -> (params, state)``; shared by train, adapt and distributed."""
    import jax
    import optax

    opt = adamw(lr, weight_decay)

    @jax.jit
    def update(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return opt, update


_JITTED: dict = {}  # (what, the model's structure) -> its jitted function, compiled once per shape


def _jitted(what: str, model, make):
    """One jitted ``make(model)`` per model structure (its modules and loss): every staged copy
    of one model, however cut, computes the same unpartitioned function, so they share it."""
    graphdefs = tuple(getattr(model, "graphdefs", ()))
    if not graphdefs:  # no structure to key on: this model's own function, not kept
        return make(model)
    key = (what, graphdefs, getattr(model, "loss_fn", None))
    if key not in _JITTED:
        _JITTED[key] = make(model)
    return _JITTED[key]


def reference_grads(model, params, x, y, device) -> tuple[float, Any]:
    """Loss and gradients of the unpartitioned model on the whole batch (one device)."""
    import jax

    params = jax.device_put(params, device)
    loss, grads = _jitted("grads", model, lambda m: jax.jit(jax.value_and_grad(m.loss)))(params, x, y)
    return float(loss), grads


def evaluate(model, params, x: np.ndarray, y: np.ndarray, device=None) -> tuple[float, float]:
    """Mean loss and accuracy of the whole (unpartitioned) model on ``x``, ``y``."""
    import jax
    import jax.numpy as jnp

    params = jax.device_put(params, device) if device is not None else params

    def make(m):
        @jax.jit
        def run(params, x, y):
            logits = m.logits(params, x)
            return m.loss_fn(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

        return run

    loss, acc = _jitted("evaluate", model, make)(params, x, y)
    return float(loss), float(acc)
