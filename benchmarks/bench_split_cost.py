"""What the backward split costs in time on this machine, and where it goes, op by op.

The peer job's stage (d = 128, 4 heads, 4 of its 8 blocks, 32-sample microbatches), one process
pinned to one core:

1. T_F, T_B, T_W and the fused T_BW of both stages as the executor calls them
   (:func:`~zbpp_lite.analysis.profiling.device.profile_stage_costs`, the stages and passes
   interleaved so that a slow spell meets every pass alike), and the ratio (T_B + T_W) / T_BW
   (the target is <= 1.08); then zb-h1+fuse and zb-h2+fuse simulated from those costs against
   1f1b (p = 2, m = 8), and the highest split price at which each would take 0.97 of 1f1b's step
   (T_B and T_W rescaled with ``Costs.with_split_price``). Issue 32, one idle run (load 1.6):
   prices 1.168 and 1.164; zb-h1+fuse needs 1.038 or less, zb-h2+fuse 1.095 or less;
2. where the time goes: one profile (``jax.profiler``) of the same calls, each XLA operation
   classified from the compiled HLO (a product, a reduction, a transpose or copy, the rest
   elementwise) and summed per pass, and B + W against BW per class and per output shape. (These
   calls allocate their outputs afresh, so they run a little slower than in part 1.)
3. stage 0 computes no input gradient (its input is data): XLA's flops of its B and BW built with
   ``input_grad=True`` (before) and ``False`` (the executor's), from the compiled cost analysis.
4. what a call costs beyond its compiled program (flattening and checking the arguments,
   dispatch): F, B, W and BW of a tiny stage (d = 16, 4 samples) called as ``jax.jit`` functions
   (as the executor calls them) and as their compiled XLA executables on pre-flattened argument
   lists, interleaved; medians of ``--repeats`` rounds of 100 calls. On JAX 0.10 the executable
   called from Python was no faster than jit's C++ dispatch (issue 32: 2 runs under load 12-16).
   Then, on the peer job's stage, what the wait between two calls costs: B then W with a wait for
   B's outputs between them (as the executor runs them: it times B and sends its input gradient
   first), against W dispatched before B ends (the device runs it straight after B), against BW;
   one timer around each, no running sums (W and BW write fresh gradients). Issue 32, two idle runs
   (load 0.6 and 1.1): 1.037 and 1.057, 1.016 and 1.051, against (B + W) / BW 1.157 and 1.169 from
   part 1's separate timers and donated sums: beyond the products, the second call's wake-up and
   timer and W's sum make most of the split's price here.

    taskset -c 1 python benchmarks/bench_split_cost.py [--repeats 40] [--stage 0] [--parts 1234]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from zbpp_lite.analysis.profiling.device import profile_stage_costs, timed  # noqa: E402
from zbpp_lite.runtime.split import StageSplit, compiled_flops  # noqa: E402
from zbpp_lite.schedules.builders import build_schedule  # noqa: E402
from zbpp_lite.schedules.simulate import simulate  # noqa: E402
from zbpp_lite.runtime.stages import StagedModel  # noqa: E402
from zbpp_lite.training.data import load_digits  # noqa: E402
from zbpp_lite.training.model import ModelConfig, build_parts  # noqa: E402


def classify(hlo: str) -> dict[str, tuple[str, str]]:
    """Operation name -> (class, output shape) for every instruction of the entry computation."""
    bodies = {}
    for m in re.finditer(r"^%?([\w.]+) .*?\{\n(.*?)\n\}", hlo, re.S | re.M):
        body = m.group(2)
        bodies[m.group(1)] = (
            "product"
            if (" dot(" in body or "convolution(" in body)
            else "reduction"
            if " reduce(" in body
            else "transpose/copy"
            if (" transpose(" in body or " copy(" in body)
            else "elementwise"
        )
    out = {}
    for line in hlo[hlo.index("ENTRY") :].splitlines():
        m = re.search(r"%([\w.]+) = (\S+) (\w+)\(.*?calls=%([\w.]+)", line)
        if m:
            out[m.group(1)] = (bodies.get(m.group(4), "elementwise"), m.group(2).split("{")[0])
            continue
        m = re.search(r"%([\w.]+) = (\S+) (dot|transpose|copy|reduce)\(", line)
        if m:
            out[m.group(1)] = (
                {"dot": "product", "reduce": "reduction"}.get(m.group(3), "transpose/copy"),
                m.group(2).split("{")[0],
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--stage", type=int, default=0, help="the stage profiled op by op (default 0)")
    parser.add_argument("--parts", default="1234", help="which parts to run, e.g. 34 (default all)")
    args = parser.parse_args()
    model = StagedModel(build_parts(ModelConfig(d=128, heads=4, blocks=8)), 2)
    x, y = load_digits(0.0, 0).batch(0, 32)
    if "1" in args.parts:
        print(
            f"1. per-pass times, ms, medians of {args.repeats} interleaved repeats on one core, "
            f"each pass called as "
            f"the executor calls it (spare output buffers and running sums donated; load average "
            f"{os.getloadavg()[0]:.2f})"
        )
        costs = profile_stage_costs(model, x, y, repeats=args.repeats, fused=True)
        for s in range(2):
            f, b, w, bw = (v[s] * 1e3 for v in (costs.f, costs.b, costs.w, costs.bw))
            print(f"   stage {s}: F {f:.2f}  B {b:.2f}  W {w:.2f}  BW {bw:.2f}   (B+W)/BW {(b + w) / bw:.3f}")
        _what_the_ratio_buys(costs)
    if "2" in args.parts:
        _profile(_stage_passes(model, x, y, args.stage), args.stage)
    if "3" in args.parts:
        _first_stage_flops(model, x)
    if "4" in args.parts:
        _dispatch_overhead(args.repeats)
        _wait_between(_stage_passes(model, x, y, args.stage), args.repeats, args.stage)


def _what_the_ratio_buys(costs, target: float = 0.97) -> None:
    """The peer job's schedules (p = 2, m = 8) simulated from these costs against 1f1b, and the
    largest split price (T_B + T_W) / T_BW at which each would take ``target`` of 1f1b's step (T_B
    and T_W scaled alike, T_F and T_BW as measured; no transfer cost)."""

    def ratios(price: float | None) -> dict[str, float]:
        c = costs if price is None else costs.with_split_price(price)
        base = simulate(build_schedule("1f1b", 2, 8), c).makespan
        return {n: simulate(build_schedule(n, 2, 8), c).makespan / base for n in SIMULATED}

    now = ratios(None)
    by_price = {price: ratios(price) for price in (1 + k / 1000 for k in range(0, 301))}
    print("   simulated at these costs, p = 2, m = 8, against 1f1b: "
          + ", ".join(f"{n} {r:.3f}" for n, r in now.items()))
    for n in SIMULATED:
        fits = [price for price, r in by_price.items() if r[n] <= target]
        where = f"at a split price of {max(fits):.3f} or less" if fits else "at no split price from 1.000 to 1.300"
        print(f"   {n} would take {target} of 1f1b's step {where}")


SIMULATED = ("zb-h1+fuse", "zb-h2+fuse")


def _stage_passes(model, x, y, stage: int) -> dict:
    """``{kind: (jitted function, args)}``: the F, B, W and BW calls of ``stage`` on one microbatch."""
    shapes, h = model.stage_inputs(x), jnp.asarray(x)
    for s in range(stage + 1):
        flat = model.split_stage(s, shapes[s], y).flat
        p = tuple(jax.tree_util.tree_leaves(model.stage_params(model.params, s)))
        aux = jnp.asarray(y) if s == model.num_stages - 1 else None
        out, own, kept = flat.forward(p, h, aux)
        h, h_in = out, h
    dy = jnp.ones(jnp.shape(out), out.dtype)
    _, grads = flat.backward_input(p, own, dy)
    return {
        "F": (flat.forward, (p, h_in, aux)),
        "B": (flat.backward_input, (p, own, dy)),
        "W": (flat.backward_weight, (p, kept, grads, None)),
        "BW": (flat.backward_fused, (p, own, kept, dy, None)),
    }


def _dispatch_overhead(repeats: int) -> None:
    """Part 4: microseconds per call of each jitted pass beyond its compiled executable."""
    model = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=2)), 2)
    passes = _stage_passes(model, *load_digits(0.0, 0).batch(0, 4), 1)
    calls = {}
    for kind, (fn, call_args) in passes.items():
        compiled = fn.lower(*call_args).compile()
        leaves = jax.tree_util.tree_leaves(call_args)
        used = sorted(
            getattr(compiled._executable, "_kept_var_idx", range(len(leaves)))
        )  # unused args are pruned
        executable, flat_args = compiled.runtime_executable(), [leaves[i] for i in used]
        calls[kind] = (lambda fn=fn, a=call_args: fn(*a), lambda e=executable, a=flat_args: e.execute(a))
    times = collections.defaultdict(list)
    for _ in range(repeats):
        for kind, pair in calls.items():
            for way, call in enumerate(pair):
                jax.block_until_ready(call())
                start = time.perf_counter()
                for _ in range(100):
                    result = call()
                jax.block_until_ready(result)
                times[kind, way].append((time.perf_counter() - start) / 100 * 1e6)
    print(
        f"\n4. per call, microseconds (median of {repeats} x 100, tiny stage; "
        f"load average {os.getloadavg()[0]:.2f})"
    )
    for kind in calls:
        jitted, direct = (statistics.median(times[kind, way]) for way in (0, 1))
        print(
            f"   {kind:2s} jax.jit {jitted:7.1f}  compiled executable {direct:7.1f}  "
            f"overhead {jitted - direct:+7.1f}"
        )


def _wait_between(passes: dict, repeats: int, stage: int) -> None:
    """Part 4, second half: B;W with a wait between, B;W without, and BW (ms, paired medians)."""
    (b, b_args), (w, w_args), (bw, bw_args) = passes["B"], passes["W"], passes["BW"]

    def split(wait: bool):
        dx, grads_out = b(*b_args)
        if wait:
            jax.block_until_ready((dx, grads_out))
        return jax.block_until_ready((dx, w(w_args[0], w_args[1], grads_out, None)))

    ways = {"B, wait, W": lambda: split(True), "B, W queued": lambda: split(False), "BW": lambda: bw(*bw_args)}
    times = collections.defaultdict(list)
    for _ in range(2):
        [jax.block_until_ready(call()) for call in ways.values()]
    for _ in range(repeats):
        for name, call in ways.items():
            times[name].append(timed(call)[0] * 1e3)
    print(f"   stage {stage} of the peer job, ms per microbatch (median of {repeats}; load average "
          f"{os.getloadavg()[0]:.2f}):")
    for name in ways:
        ratio = statistics.median(a / c for a, c in zip(times[name], times["BW"]))
        print(f"   {name:12s} {statistics.median(times[name]):6.2f}   / BW {ratio:.3f} (paired)")


def _first_stage_flops(model, x) -> None:
    """Part 3: stage 0's B and BW flops with and without the input gradient."""
    params = model.stage_params(model.params, 0)
    p, x = tuple(jax.tree_util.tree_leaves(params)), jnp.asarray(x)
    flops = {}
    for input_grad in (True, False):
        flat = StageSplit(model.stage_fn(0), params, x, input_grad=input_grad).flat
        y, own, kept = flat.forward(p, x, None)
        dy = jnp.ones_like(y)
        flops[input_grad] = (
            compiled_flops(flat.backward_input, p, own, dy),
            compiled_flops(flat.backward_fused, p, own, kept, dy, None),
        )
    print("\n3. stage 0 without its input gradient (XLA's cost analysis, MFLOP per microbatch)")
    for k, kind in enumerate(("B", "BW")):
        before, after = flops[True][k] / 1e6, flops[False][k] / 1e6
        print(
            f"   {kind:2s} {before:9.3f} -> {after:9.3f}  "
            f"saved {before - after:.3f} ({(before - after) / before:.2%})"
        )


def _profile(passes: dict, index: int) -> None:
    """Part 2: one profile of stage ``index``'s calls, its time per XLA operation class and shape."""
    calls = {kind: (lambda fn=fn, a=a: fn(*a)) for kind, (fn, a) in passes.items()}
    hlo = {kind: fn.lower(*a).compile().as_text() for kind, (fn, a) in passes.items()}
    with tempfile.TemporaryDirectory() as tmp:
        jax.block_until_ready([c() for c in calls.values()])
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(10):
                for kind, call in calls.items():
                    jax.block_until_ready(call())
        trace = json.load(gzip.open(glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    programs = sorted(
        (e for e in events if e.get("ph") == "X" and e["name"].startswith("PjitFunction(")),
        key=lambda e: e["ts"],
    )
    starts = [e["ts"] for e in programs]
    name_of = {
        "_forward_flat": "F",
        "_backward_input_flat": "B",
        "_backward_weight_flat": "W",
        "_backward_fused_flat": "BW",
    }
    ops = {k: classify(v) for k, v in hlo.items()}
    by_class: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    by_shape: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    for e in events:
        if e.get("ph") != "X":
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0:
            continue
        kind = name_of.get(programs[i]["name"][len("PjitFunction(") : -1])
        if kind is None or e["name"] not in ops[kind]:
            continue
        cls, shape = ops[kind][e["name"]]
        by_class[cls][kind] += e["dur"] / 10 / 1e3
        by_shape[(cls, shape)][kind] += e["dur"] / 10 / 1e3
    print(f"\n2. stage {index} op by op (profiled, so slower than above; ms per call): B + W against BW")
    for cls in sorted(by_class):
        v = by_class[cls]
        print(
            f"   {cls:15s} F {v['F']:6.2f}  B {v['B']:6.2f}  W {v['W']:6.2f}  "
            f"B+W {v['B'] + v['W']:6.2f}  BW {v['BW']:6.2f}  "
            f"extra {v['B'] + v['W'] - v['BW']:+6.2f}"
        )
    print("   by output shape (largest differences first):")
    rows = sorted(by_shape.items(), key=lambda kv: -abs(kv[1]["B"] + kv[1]["W"] - kv[1]["BW"]))
    for (cls, shape), v in rows[:12]:
        print(
            f"   {cls:15s} {shape:22s} B {v['B']:5.2f}  W {v['W']:5.2f}  BW {v['BW']:5.2f}  "
            f"extra {v['B'] + v['W'] - v['BW']:+5.2f}"
        )


if __name__ == "__main__":
    main()
