"""Issue 18's two targets for the backward split, measured side by side (no timing: program sizes).

1. Remat honoured: a stage whose blocks run under ``jax.checkpoint`` / ``nnx.remat``. Bytes F
   keeps per microbatch (:func:`zbpp_lite.runtime.split.forward_kept_bytes`: B's residuals less
   the parameters, plus W's operands) against what ``jax.vjp`` of the same stage under the same
   policy keeps (:func:`~zbpp_lite.runtime.split.vjp_residual_bytes`). Target: ratio <= 1.1.
   Also printed: what F keeps without remat, the saving remat exists for.
2. Scanned layer stacks: flops(B) + flops(W) against the fused backward (``jax.vjp``'s pullback),
   XLA's compiled cost analysis (:func:`~zbpp_lite.runtime.split.compiled_flops`). Target: <= 1.05.

Run: python benchmarks/bench_split_targets.py [--d 128] [--batch 32] [--blocks 4]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

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


def remat_bytes(d: int, batch: int, blocks: int) -> None:
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32)
    print(f"remat: {blocks} blocks d={d}, {batch} samples per microbatch; bytes kept per microbatch")
    print(f"  {'policy':<22} {'F keeps':>10} {'jax.vjp keeps':>14} {'ratio':>6}")
    for name, policy in [("no remat", "none"), ("nnx.remat", "nnx.remat"), ("checkpoint (nothing)", None),
                         ("dots_saveable", jax.checkpoint_policies.dots_saveable)]:
        fn, params = stage(d, blocks, policy)
        kept = forward_kept_bytes(StageSplit(fn, params, x), params, x)
        ref = vjp_residual_bytes(fn, params, x)
        print(f"  {name:<22} {kept:>10,} {ref:>14,} {kept / ref:>6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    remat_bytes(args.d, args.batch, args.blocks)


if __name__ == "__main__":
    main()
