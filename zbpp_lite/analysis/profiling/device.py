"""Per-stage T_F, T_B, T_W timed on one device: the pipeline of a machine with too few accelerators.

:func:`profile_stage_costs` times every stage's F, B and W (Qi et al., arXiv 2401.10241, section 2) on
one device with the executor's own jitted functions (:attr:`zbpp_lite.runtime.split.StageSplit.flat`),
called as the executor calls them; :func:`zbpp_lite.simulate` draws the pipeline from those costs (a
timeline in seconds), leaving out transfers (T_comm = 0) and the executor's per-action overhead. Imports JAX.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...schedules.costs import Costs
from ...runtime.memory import stage_bytes
from ...runtime.stages import StagedModel


def timed(fn, *args) -> tuple[float, Any]:
    """``(seconds, fn(*args))``: one call's wall time until its outputs are ready (the one timer)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def stage_memory_bytes(model: StagedModel, x: Any, labels: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(mem_b, mem_w)``: per-stage bytes (tuples of ints) for one microbatch ``x`` (b, ...), labels
    (b,) (arrays or ``jax.ShapeDtypeStruct``), from shapes only (nothing runs). M_B: what F keeps;
    M_W: what waits from B until W; as :mod:`zbpp_lite.runtime.memory` counts them. Source: Qi et al.,
    arXiv 2401.10241, section 2.3, table 1."""
    shapes = model.stage_inputs(np.asarray(x) if not isinstance(x, jax.ShapeDtypeStruct) else x)
    mem_b, mem_w = [], []
    for s in range(model.num_stages):
        flat = model.split_stage(s, shapes[s], labels).flat
        p = tuple(jax.tree_util.tree_leaves(model.stage_params(model.params, s)))
        aux = labels if s == model.num_stages - 1 else None
        out, own, kept = jax.eval_shape(flat.forward, p, shapes[s], aux)
        _, grads_out = jax.eval_shape(flat.backward_input, p, own, out)
        b, w = stage_bytes(own, kept, grads_out)
        mem_b.append(b)
        mem_w.append(w)
    return tuple(mem_b), tuple(mem_w)


def profile_stage_costs(model: StagedModel, x: Any, labels: Any, device: Any = None, repeats: int = 7,
                        fused: bool = False) -> Costs:
    """Median T_F, T_B, T_W (with ``fused`` also T_BW) of every stage on one microbatch, one device.

    Each stage runs on the previous one's real output; after untimed compiling calls, each F, B, W
    runs ``repeats`` (>= 1) times round-robin over the stages (a slow spell hits all alike). ``x``: (b,
    ...) float32, ``labels`` (b,) ints, ``device`` default ``jax.devices()[0]``. Returns
    :class:`~zbpp_lite.schedules.costs.Costs` in seconds per stage, ``comm`` 0, ``mem_b``/``mem_w`` in
    bytes (:func:`stage_memory_bytes`).

    Raises:
        ValueError: ``repeats`` below 1, or inputs and labels of different lengths.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if np.shape(x)[0] != np.shape(labels)[0]:
        raise ValueError(f"the microbatch has {np.shape(x)[0]} inputs but {np.shape(labels)[0]} labels")
    device = device if device is not None else jax.devices()[0]
    labels = np.asarray(labels)
    y = jax.device_put(labels, device)
    h = jax.device_put(np.asarray(x), device)
    S = model.num_stages
    shapes = model.stage_inputs(np.asarray(x))
    states = []  # per stage: the arguments and the outputs the next call reuses
    for s in range(S):  # the untimed round: compile, and the activations every stage gets
        flat = model.split_stage(s, shapes[s], labels).flat
        p = jax.device_put(tuple(jax.tree_util.tree_leaves(model.stage_params(model.params, s))), device)
        aux = y if s == S - 1 else None
        _, own, _ = flat.forward(p, h, aux)
        out, own, kept = flat.forward(p, h, aux, own)  # again, into a spare (another program)
        dy = jax.device_put(jnp.ones(jnp.shape(out), out.dtype), device)  # the last stage's: the scalar loss
        _, grads_out = flat.backward_input(p, own, dy)
        _, grads_out = flat.backward_input(p, own, dy, grads_out)
        acc = flat.backward_weight(p, kept, grads_out, None)  # a stage's first W: no sum yet
        acc = jax.block_until_ready(flat.backward_weight(p, kept, grads_out, acc))
        acc_bw = None
        if fused:  # its own running sum (BW donates it), compiled without and with one
            acc_bw = flat.backward_fused(p, own, kept, dy, None)[1]
            acc_bw = jax.block_until_ready(flat.backward_fused(p, own, kept, dy, acc_bw)[1])
        states.append({"flat": flat, "p": p, "h": h, "aux": aux, "dy": dy, "own": own, "grads": grads_out,
                       "acc": acc, "acc_bw": acc_bw})
        h = out
    kinds = ("F", "B", "W", "BW") if fused else ("F", "B", "W")
    times: dict[str, list[list[float]]] = {kind: [[] for _ in range(S)] for kind in kinds}
    for _ in range(repeats):
        for s, st in enumerate(states):
            flat = st["flat"]
            tf, (_, own, kept) = timed(flat.forward, st["p"], st["h"], st["aux"], st["own"])
            tb, (_, grads_out) = timed(flat.backward_input, st["p"], own, st["dy"], st["grads"])
            tw, st["acc"] = timed(flat.backward_weight, st["p"], kept, grads_out, st["acc"])
            if fused:
                tbw, (_, st["acc_bw"]) = timed(flat.backward_fused, st["p"], own, kept, st["dy"],
                                               st["acc_bw"])
                times["BW"][s].append(tbw)
            st["own"], st["grads"] = own, grads_out  # the donated spares were used up: these are next
            times["F"][s].append(tf)
            times["B"][s].append(tb)
            times["W"][s].append(tw)
    medians = {kind: [statistics.median(v) for v in per_stage] for kind, per_stage in times.items()}
    mem_b, mem_w = stage_memory_bytes(model, x, labels)
    return Costs(f=medians["F"], b=medians["B"], w=medians["W"], bw=medians.get("BW"),
                 mem_b=mem_b, mem_w=mem_w)
