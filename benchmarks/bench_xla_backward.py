"""XLA:CPU compiles the backward of a deep pre-norm residual stack into work that grows with the square of
its depth: a minimal reproduction in plain JAX (no zbpp_lite), with two ways round it (issue 43).

The model is k blocks ``x + gelu(layer_norm(x) @ W1) @ W2`` (d 128, hidden 512) on a (2048, 128) float32
batch, the loss the mean square of the output. Three forms of the same gradient, equal to float32
rounding (the script checks it):

- ``whole``: ``jax.jit(jax.grad(loss))``, one program;
- ``wall``: the same one program, with a *fusion wall* between blocks: an identity whose tangent passes
  through a ``lax.cond`` on a value only known at run time, so its transpose (the residual stream's
  gradient at that boundary) is computed once and stored, not fused into its consumers;
- ``pieces``: one jitted ``jax.vjp`` per block, chained in Python (what a pipeline stage's programs do);
- ``chunks``: one program again, the batch's gradient accumulated over 8 row chunks of 256 in a ``scan``
  (what the package's single-device reference does with a run's microbatches): the backward then reads
  one chunk's activations, which the caches still hold, where the whole batch's have left them.

For each depth it prints the compiled gradient's fused-instruction count (the sum of the lines of its fused
computations, a measure of the work XLA emitted; it grows linearly with k for a stack without the layer
norm), the temporary memory of ``whole`` and ``chunks`` (XLA's buffer assignment: mostly the activations
the backward reads back; compare it with the machine's last-level cache) and the median time of each form, the three timed in alternation, step by step, in one process.
``--report`` prints the text of an upstream report. The cause (docs/XLA_BACKWARD.md): the residual
stream's gradient is a chain of cheap elementwise adds through every block; XLA:CPU's instruction fusion
duplicates cheap producers into each consumer, and each block's layer-norm backward reduces that gradient
(two reductions) and adds to it, so every block's consumers recompute the adds of all blocks above it.
``optimization_barrier`` does not help: XLA:CPU removes it before fusion.

Run (pin to one core for clean timings; about a minute):
    taskset -c 0 python benchmarks/bench_xla_backward.py
    python benchmarks/bench_xla_backward.py --depths 1,2,4,8,16 --no-time
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def layer_norm(x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def block(params: tuple, x: jax.Array) -> jax.Array:
    w1, w2 = params
    return x + jax.nn.gelu(layer_norm(x) @ w1) @ w2


@jax.custom_jvp
def wall(x: jax.Array) -> jax.Array:
    return x


@wall.defjvp
def _wall_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    known_at_run_time = x.reshape(-1)[0] == x.reshape(-1)[0]  # false only for NaN: both branches agree
    return x, jax.lax.cond(known_at_run_time, lambda t: t, lambda t: t * 1.0, t)  # (two equal branches
    # would be folded into one before XLA sees a conditional)


def loss(params: list, x: jax.Array, walls: bool = False) -> jax.Array:
    for p in params:
        x = block(p, wall(x) if walls else x)
    return jnp.mean(x ** 2)


def fused_lines(fn, *args) -> int:
    """Lines of the compiled program's fused computations: the instructions XLA emitted inside fusions."""
    text = fn.lower(*args).compile().as_text()
    return sum(c.count("\n") for c in re.split(r"\n(?=\S.*\{\n)", text) if c.startswith("%fused"))


def temp_mib(fn, *args) -> float:
    """MiB of temporary buffers in the compiled program (XLA's buffer assignment)."""
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2 ** 20


def pieces_grad(params: list, x: jax.Array):
    """The gradient as one program per block: a forward keeping each block's vjp, then the vjps in reverse."""
    vjps = []
    for p in params:
        x, vjp = _block_vjp(p, x)
        vjps.append(vjp)
    g, grads = _loss_grad(x), []
    for vjp in reversed(vjps):
        gp, g = _apply(vjp, g)
        grads.append(gp)
    return grads[::-1]


def chunks_grad(params: list, x: jax.Array, chunks: int = 8):
    """The gradient as one program accumulating ``chunks`` equal row chunks of ``x`` in a ``scan``."""
    def one(total, rows):
        return jax.tree.map(jnp.add, total, jax.grad(loss)(params, rows)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    total, _ = jax.lax.scan(one, zeros, x.reshape(chunks, -1, x.shape[-1]))
    return jax.tree.map(lambda g: g / chunks, total)  # the loss is a mean over rows: so is the sum's


_block_vjp = jax.jit(lambda p, x: jax.vjp(block, p, x))
_loss_grad = jax.jit(jax.grad(lambda y: jnp.mean(y ** 2)))
_apply = jax.jit(lambda vjp, g: vjp(g))


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def run_depth(k: int, steps: int, timed: bool) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * k)
    params = [(jax.random.normal(keys[2 * i], (128, 512)) / 128 ** 0.5,
               jax.random.normal(keys[2 * i + 1], (512, 128)) / 512 ** 0.5) for i in range(k)]
    x = jax.random.normal(jax.random.PRNGKey(1), (2048, 128))
    whole = jax.jit(jax.grad(loss))
    walled = jax.jit(jax.grad(lambda p, x: loss(p, x, walls=True)))
    chunked = jax.jit(chunks_grad)
    forms = {"whole": whole, "wall": walled, "pieces": pieces_grad, "chunks": chunked}
    ref = whole(params, x)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref))
    for name, fn in forms.items():
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(fn(params, x)), jax.tree.leaves(ref)))
        assert diff <= 1e-5 * scale, f"{name} differs from jax.grad by {diff:.2e} (scale {scale:.2e})"
    row = {"k": k, "fused_whole": fused_lines(whole, params, x), "fused_wall": fused_lines(walled, params, x),
           "temp_whole": temp_mib(whole, params, x), "temp_chunks": temp_mib(chunked, params, x)}
    if timed:
        times = {name: [] for name in forms}
        for _ in range(steps):  # alternating, step by step: a slow spell meets every form
            for name, fn in forms.items():
                times[name].append(_timed(fn, params, x))
        row.update({name: statistics.median(ts) * 1e3 for name, ts in times.items()})
        row["whole/wall"] = statistics.median(np.array(times["whole"]) / np.array(times["wall"]))
        row["whole/pieces"] = statistics.median(np.array(times["whole"]) / np.array(times["pieces"]))
        row["whole/chunks"] = statistics.median(np.array(times["whole"]) / np.array(times["chunks"]))
    return row


REPORT = """\
Title: [XLA:CPU] backward of a pre-norm residual stack: fused work grows with the square of the depth

jax {jax} / jaxlib {jaxlib}, CPU. Model: k blocks x + gelu(layer_norm(x) @ W1) @ W2, d 128, hidden 512,
batch (2048, 128) f32; jax.jit(jax.grad(mean(out**2))).

Lines inside fused computations of the compiled gradient, against k:
{lines}
Without layer_norm the count is linear in k. Dumping the module before and after the fusion pass shows
why: the residual stream's gradient is a chain of elementwise adds through all blocks; each block's
layer-norm backward reduces it twice, and instruction fusion duplicates the whole chain above into each
of those reduce fusions (on the digits Transformer of our package, an op of the loss's backward ends up in
17 fusions at 2 blocks and 53 at 8). Time of the gradient, ms (median, pinned to one core):
{times}
An identity at block boundaries whose tangent goes through a lax.cond on a run-time value restores linear
growth; optimization_barrier does not (it is removed before fusion on CPU). Expected: fusion should not
duplicate a producer chain whose size grows with the program, or should materialise a value consumed by
several reduce fusions.
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="1,2,4,8", help="comma-separated block counts k (default 1,2,4,8)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per form and depth (default 5)")
    ap.add_argument("--no-time", action="store_true", help="only the compiled programs' sizes")
    ap.add_argument("--report", action="store_true", help="print an upstream report with this run's figures")
    args = ap.parse_args(argv)
    depths = [int(k) for k in args.depths.split(",")]
    rows = []
    for k in depths:
        row = run_depth(k, args.steps, not args.no_time)
        rows.append(row)
        line = (f"k={k:3d}  fused lines: whole {row['fused_whole']:6d}, wall {row['fused_wall']:6d}  |  temp MiB: "
                f"whole {row['temp_whole']:6.1f}, chunks {row['temp_chunks']:5.1f}")
        if not args.no_time:
            line += (f"  |  ms: whole {row['whole']:7.1f}, wall {row['wall']:7.1f}, pieces {row['pieces']:7.1f}, "
                     f"chunks {row['chunks']:7.1f}  |  paired whole/wall {row['whole/wall']:.2f}, whole/pieces "
                     f"{row['whole/pieces']:.2f}, whole/chunks {row['whole/chunks']:.2f}")
        print(line, flush=True)
    if args.report:
        import jaxlib

        lines = "\n".join(f"  k={r['k']}: {r['fused_whole']} (with the wall: {r['fused_wall']})" for r in rows)
        times = "\n".join(f"  k={r['k']}: {r['whole']:.1f} (wall {r['wall']:.1f}, one program per block "
                          f"{r['pieces']:.1f}, 8 row chunks in a scan {r['chunks']:.1f}; temp MiB {r['temp_whole']:.0f} "
                          f"and {r['temp_chunks']:.0f})" for r in rows if "whole" in r) or "  (run without --no-time)"
        print("\n" + REPORT.format(jax=jax.__version__, jaxlib=jaxlib.__version__, lines=lines, times=times))


if __name__ == "__main__":
    main()
