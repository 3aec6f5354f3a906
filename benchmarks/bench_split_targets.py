"""Issue 18's two targets for the backward split, measured side by side (no timing: program sizes).

1. Remat honoured: a stage whose blocks run under ``jax.checkpoint`` / ``nnx.remat``. Bytes F
   keeps per microbatch (:func:`zbpp_lite.runtime.split.forward_kept_bytes`: B's residuals less
   the parameters, plus W's operands) against what ``jax.vjp`` of the same stage under the same
   policy keeps (:func:`~zbpp_lite.runtime.split.vjp_residual_bytes`). Target: ratio <= 1.1.
   Also printed: what F keeps without remat (the saving remat exists for), and with the
   checkpoint inlined as the split did before issue 18; ``h + tanh(sin(h @ a)) @ b`` with and
   without a checkpoint (W operands B's residuals hold: kept once since issue 32, was 1.31x / 2x);
   and XLA's flops of B and W against the fused backward under the same remat (B recomputes the
   blocks, W does the weight products).
2. Scanned layer stacks: flops(B) + flops(W) against the fused backward (``jax.vjp``'s pullback),
   XLA's compiled cost analysis (:func:`~zbpp_lite.runtime.split.compiled_flops`). Target: <= 1.05.
   Also printed: W against the weight products alone, and the scan kept whole (one weight
   operation whose W re-runs the loop's vjp), as before issue 18.

Run: python benchmarks/bench_split_targets.py [--d 128] [--batch 32] [--blocks 4]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from zbpp_lite.runtime import split as split_module
from zbpp_lite.runtime.split import StageSplit, compiled_flops, forward_kept_bytes, vjp_residual_bytes


class Block(nnx.Module):
    """Pre-norm feed-forward block with a skip connection (d -> 4d -> d)."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


def stage(d: int, blocks: int, policy):
    """fn(params, x, aux) of ``blocks`` blocks; ``policy`` "none" (no remat), "nnx.remat", or a
    jax.checkpoint policy (None: save nothing but each block's input)."""
    graphdefs, params = zip(*(nnx.split(Block(d, nnx.Rngs(i))) for i in range(blocks)))

    def fn(params, x, aux):
        for g, p in zip(graphdefs, params):
            apply = lambda p, x, g=g: nnx.merge(g, p)(x)  # noqa: E731
            if policy == "none":
                x = apply(p, x)
            elif policy == "nnx.remat":
                x = nnx.remat(lambda m, x: m(x))(nnx.merge(g, p), x)
            else:
                x = jax.checkpoint(apply, policy=policy)(p, x)
        return x

    return fn, list(params)


def _tanh_sin(p, h, aux):
    return h + jnp.tanh(jnp.sin(h @ p["a"])) @ p["b"]


def _fused_flops(fn, params, x) -> float:
    tree = []

    def fused_residuals(p, v):
        leaves, treedef = jax.tree_util.tree_flatten(jax.vjp(lambda p, v: fn(p, v, None), p, v)[1])
        tree.append(treedef)
        return leaves

    leaves = jax.eval_shape(fused_residuals, params, x)
    return compiled_flops(
        lambda r, g: jax.tree_util.tree_unflatten(tree[0], r)(g),
        leaves,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
    )


def _split_flops(split, params, x) -> tuple[float, float]:
    y, res, kept = jax.eval_shape(split.forward, params, x, None)
    _, grads_out = jax.eval_shape(split.backward_input, res, y)
    return compiled_flops(split.backward_input, res, y), compiled_flops(
        split.weight_gradient, params, kept, grads_out
    )


def remat_bytes(d: int, batch: int, blocks: int) -> None:
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32)
    print(f"remat: {blocks} blocks d={d}, {batch} samples per microbatch; bytes kept per microbatch")
    print(f"  {'policy':<22} {'F keeps':>10} {'jax.vjp keeps':>14} {'ratio':>6}")
    for name, policy in [
        ("no remat", "none"),
        ("nnx.remat", "nnx.remat"),
        ("checkpoint (nothing)", None),
        ("dots_saveable", jax.checkpoint_policies.dots_saveable),
    ]:
        fn, params = stage(d, blocks, policy)
        kept = forward_kept_bytes(StageSplit(fn, params, x), params, x)
        ref = vjp_residual_bytes(fn, params, x)
        print(f"  {name:<22} {kept:>10,} {ref:>14,} {kept / ref:>6.3f}")
    # h + tanh(sin(h @ a)) @ b, h (32, 64): tanh's output and the checkpoint's input h are W's
    # operands and B's residuals, kept once (1.31x and 2.00x when F kept them twice)
    h, f32 = jax.ShapeDtypeStruct((32, 64), jnp.float32), jnp.float32
    p = {"a": jax.ShapeDtypeStruct((64, 256), f32), "b": jax.ShapeDtypeStruct((256, 64), f32)}
    for name, fn in [("tanh(sin(h@a))@b", _tanh_sin), ("the same, checkpoint", jax.checkpoint(_tanh_sin))]:
        kept, ref = forward_kept_bytes(StageSplit(fn, p, h), p, h), vjp_residual_bytes(fn, p, h)
        print(f"  {name:<22} {kept:>10,} {ref:>14,} {kept / ref:>6.3f}")
    remat, split_module._REMAT = split_module._REMAT, set()  # the split before issue 18: checkpoints inlined
    try:
        fn, params = stage(d, blocks, "nnx.remat")
        kept, ref = (
            forward_kept_bytes(StageSplit(fn, params, x), params, x),
            vjp_residual_bytes(fn, params, x),
        )
    finally:
        split_module._REMAT = remat
    print(
        f"  {'nnx.remat, inlined':<22} {kept:>10,} {ref:>14,} {kept / ref:>6.3f}  "
        "(before: checkpoint inlined)"
    )
    products = blocks * 2 * (2 * batch * d * 4 * d)
    print(
        f"  {'XLA flops (under remat B recomputes)':<40} {'B':>12} {'W':>12} "
        f"{'(B+W)/fused':>12} {'W/products':>11}"
    )
    for name, policy in [("no remat", "none"), ("nnx.remat", "nnx.remat")]:
        fn, params = stage(d, blocks, policy)
        b, w = _split_flops(StageSplit(fn, params, x), params, x)
        print(
            f"  {name:<40} {b:>12,.0f} {w:>12,.0f} "
            f"{(b + w) / _fused_flops(fn, params, x):>12.3f} {w / products:>11.3f}"
        )


def scanned_stack(d: int, batch: int, layers: int):
    """fn(params, x, aux): ``layers`` feed-forward layers (d -> 4d -> d, tanh, a skip connection)
    with parameters stacked on a layer axis, under jax.lax.scan. unroll=True: XLA's cost analysis
    counts a while loop's body once, so every iteration is put in the program for the count."""

    def fn(p, x, aux):
        def body(h, lp):
            return h + jnp.tanh((h * lp["g"]) @ lp["w"] + lp["b"]) @ lp["w2"], None

        return jax.lax.scan(body, x, p, unroll=True)[0]

    f32 = jnp.float32
    p = {
        "w": jax.ShapeDtypeStruct((layers, d, 4 * d), f32),
        "b": jax.ShapeDtypeStruct((layers, 4 * d), f32),
        "w2": jax.ShapeDtypeStruct((layers, 4 * d, d), f32),
        "g": jax.ShapeDtypeStruct((layers, d), f32),
    }
    return fn, p, jax.ShapeDtypeStruct((batch, d), f32)


def scan_flops(d: int, batch: int, layers: int) -> None:
    fn, p, x = scanned_stack(d, batch, layers)
    fused = _fused_flops(fn, p, x)
    products = layers * 2 * (2 * batch * d * 4 * d)
    print(
        f"scan: {layers} layers d={d} under jax.lax.scan, {batch} samples; "
        f"XLA flops (fused backward {fused:,.0f}, "
        f"weight products {products:,})"
    )
    print(f"  {'split':<22} {'B':>12} {'W':>12} {'(B+W)/fused':>12} {'W/products':>11}")
    whole = split_module._split_loop
    for name, loop_rule in [("scan split inside", whole), ("scan kept whole", lambda *a: None)]:
        split_module._split_loop = loop_rule  # "kept whole": the split before issue 18 (one weight op)
        try:
            b, w = _split_flops(StageSplit(fn, p, x), p, x)
        finally:
            split_module._split_loop = whole
        print(f"  {name:<22} {b:>12,.0f} {w:>12,.0f} {(b + w) / fused:>12.3f} {w / products:>11.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    remat_bytes(args.d, args.batch, args.blocks)
    scan_flops(args.d, args.batch, args.blocks)


if __name__ == "__main__":
    main()
