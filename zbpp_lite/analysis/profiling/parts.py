"""Time every part of a staged model on its own: per-part T_F, T_B, T_W for the rebalancer (JAX).

Each part becomes a one-part stage split into F, B, W by :class:`zbpp_lite.runtime.split.StageSplit` as
the executor's stages are (Qi et al., arXiv 2401.10241, section 2), timed round-robin on one device as
:func:`~zbpp_lite.analysis.profiling.device.profile_stage_costs` times stages; alike parts share one
compiled split. These times miss what a run adds: :func:`zbpp_lite.analysis.rebalance.calibrate` takes
the scale from a run and the ratios from here.
"""

from __future__ import annotations

import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...runtime.stages import StagedModel
from ..rebalance import PartCosts
from .device import timed
from ...runtime.split import StageSplit

_PART_SPLITS: dict = {}


def _part_split(model: StagedModel, i: int, x: Any, labels: Any) -> StageSplit:
    last = i == model.num_parts - 1
    graphdef = model.graphdefs[i]

    def fn(params, x, labels):
        y = model.apply_part(i, params, x)
        return model.loss_fn(y, labels) if last else y

    aux = labels if last else None
    leaves = jax.tree_util.tree_leaves((model.params[i], x, aux))
    key = (graphdef, i == 0, model.loss_fn if last else None,
           *[(np.shape(a), str(jnp.result_type(a))) for a in leaves])
    if key not in _PART_SPLITS:
        _PART_SPLITS[key] = StageSplit(fn, model.params[i], x, aux, input_grad=i > 0)
    return _PART_SPLITS[key]


def profile_parts(model: StagedModel, x: Any, labels: Any, device: Any = None, repeats: int = 7) -> PartCosts:
    """Median T_F, T_B, T_W (seconds) of every part of ``model`` on one microbatch ``x`` (b, ...)
    float32, ``labels`` (b,) ints, ``repeats`` timed calls each: a
    :class:`~zbpp_lite.analysis.rebalance.PartCosts` in model order.

    Raises:
        ValueError: repeats < 1, or inputs and labels of different lengths.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if np.shape(x)[0] != np.shape(labels)[0]:
        raise ValueError(f"the microbatch has {np.shape(x)[0]} inputs but {np.shape(labels)[0]} labels")
    device = device if device is not None else jax.devices()[0]
    h = jax.device_put(jnp.asarray(x), device)
    y = jax.device_put(jnp.asarray(labels), device)
    seed = jax.device_put(jnp.ones((), jnp.float32), device)
    n = model.num_parts
    calls = []  # per part: (split, params, input, aux, output gradient, accumulator)
    for i in range(n):  # the first round: compile, and the activations every part gets
        last = i == n - 1
        split = _part_split(model, i, h, y)
        params = jax.device_put(model.params[i], device)
        acc = jax.device_put(jax.tree_util.tree_map(jnp.zeros_like, params), device)
        aux = y if last else None
        out, res, kept = split.forward(params, h, aux)
        dy = seed if last else jnp.ones_like(out)
        _, grads_out = split.backward_input(res, dy)
        jax.block_until_ready(split.backward_weight(params, kept, grads_out, acc))
        calls.append((split, params, h, aux, dy, acc))
        h = out
    times = {kind: [[] for _ in range(n)] for kind in "FBW"}
    for _ in range(repeats):  # round-robin over the parts: a slow spell of the machine hits all alike
        for i, (split, params, h, aux, dy, acc) in enumerate(calls):
            tf, (_, res, kept) = timed(split.forward, params, h, aux)
            tb, (_, grads_out) = timed(split.backward_input, res, dy)
            tw, _ = timed(split.backward_weight, params, kept, grads_out, acc)
            times["F"][i].append(tf)
            times["B"][i].append(tb)
            times["W"][i].append(tw)
    f, b, w = ([statistics.median(v) for v in times[kind]] for kind in "FBW")
    return PartCosts(f, b, w)
