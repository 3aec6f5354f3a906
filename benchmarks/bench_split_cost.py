"""What the backward split costs in time on this machine, and where it goes, op by op.

The peer job's stage (d = 128, 4 heads, 4 of its 8 blocks, 32-sample microbatches), one process
pinned to one core:

1. T_F, T_B, T_W and the fused T_BW of both stages as the executor calls them
   (:func:`~zbpp_lite.analysis.profiling.device.profile_stage_costs`, the stages and passes
   interleaved so that a slow spell meets every pass alike), and the ratio (T_B + T_W) / T_BW
   (the target is <= 1.08);
2. where the time goes: one profile (``jax.profiler``) of the same calls, each XLA operation
   classified from the compiled HLO (a product, a reduction, a transpose or copy, the rest
   elementwise) and summed per pass, and B + W against BW per class and per output shape. (These
   calls allocate their outputs afresh, so they run a little slower than in part 1.)

    taskset -c 1 python benchmarks/bench_split_cost.py [--repeats 40] [--stage 0]
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
import tempfile


def classify(hlo: str) -> dict[str, tuple[str, str]]:
    """Operation name -> (class, output shape) for every instruction of the entry computation."""
    bodies = {}
    for m in re.finditer(r"^%?([\w.]+) .*?\{\n(.*?)\n\}", hlo, re.S | re.M):
        body = m.group(2)
        bodies[m.group(1)] = ("product" if (" dot(" in body or "convolution(" in body) else "reduction" if " reduce(" in body
                              else "transpose/copy" if (" transpose(" in body or " copy(" in body) else "elementwise")
    out = {}
    for line in hlo[hlo.index("ENTRY"):].splitlines():
        m = re.search(r"%([\w.]+) = (\S+) (\w+)\(.*?calls=%([\w.]+)", line)
        if m:
            out[m.group(1)] = (bodies.get(m.group(4), "elementwise"), m.group(2).split("{")[0])
            continue
        m = re.search(r"%([\w.]+) = (\S+) (dot|transpose|copy|reduce)\(", line)
        if m:
            out[m.group(1)] = ({"dot": "product", "reduce": "reduction"}.get(m.group(3), "transpose/copy"), m.group(2).split("{")[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--stage", type=int, default=0, help="the stage profiled op by op (default 0)")
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    import jax
    import jax.numpy as jnp

    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.training.data import load_digits
    from zbpp_lite.training.model import ModelConfig, build_parts

    model = StagedModel(build_parts(ModelConfig(d=128, heads=4, blocks=8)), 2)
    x, y = load_digits(0.0, 0).batch(0, 32)
    shapes = model.stage_inputs(x)
    h, stages = jnp.asarray(x), []
    for s in range(2):
        flat = model.split_stage(s, shapes[s], y).flat
        p = tuple(jax.tree_util.tree_leaves(model.stage_params(model.params, s)))
        aux = jnp.asarray(y) if s == 1 else None
        out, own, kept = flat.forward(p, h, aux)
        dy = jnp.ones(jnp.shape(out), out.dtype)
        _, grads = flat.backward_input(p, own, dy)
        jax.block_until_ready((flat.backward_weight(p, kept, grads, None), flat.backward_fused(p, own, kept, dy, None)))
        calls = {"F": lambda f=flat, p=p, h=h, a=aux: f.forward(p, h, a),
                 "B": lambda f=flat, p=p, o=own, d=dy: f.backward_input(p, o, d),
                 "W": lambda f=flat, p=p, k=kept, g=grads: f.backward_weight(p, k, g, None),
                 "BW": lambda f=flat, p=p, o=own, k=kept, d=dy: f.backward_fused(p, o, k, d, None)}
        hlo = {"F": flat.forward.lower(p, h, aux).compile().as_text(), "B": flat.backward_input.lower(p, own, dy).compile().as_text(),
               "W": flat.backward_weight.lower(p, kept, grads, None).compile().as_text(),
               "BW": flat.backward_fused.lower(p, own, kept, dy, None).compile().as_text()}
        stages.append((calls, hlo))
        h = out

    from zbpp_lite.analysis.profiling.device import profile_stage_costs

    print(f"1. per-pass times, ms, medians of {args.repeats} interleaved repeats on one core, each pass called as the "
          f"executor calls it (spare output buffers and running sums donated; load average {os.getloadavg()[0]:.2f})")
    costs = profile_stage_costs(model, x, y, repeats=args.repeats, fused=True)
    for s in range(2):
        f, b, w, bw = (v[s] * 1e3 for v in (costs.f, costs.b, costs.w, costs.bw))
        print(f"   stage {s}: F {f:.2f}  B {b:.2f}  W {w:.2f}  BW {bw:.2f}   (B+W)/BW {(b + w) / bw:.3f}")

    calls, hlo = stages[args.stage]
    with tempfile.TemporaryDirectory() as tmp:
        jax.block_until_ready([c() for c in calls.values()])
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(10):
                for kind, call in calls.items():
                    jax.block_until_ready(call())
        trace = json.load(gzip.open(glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    programs = sorted((e for e in events if e.get("ph") == "X" and e["name"].startswith("PjitFunction(")), key=lambda e: e["ts"])
    starts = [e["ts"] for e in programs]
    name_of = {"_forward_flat": "F", "_backward_input_flat": "B", "_backward_weight_flat": "W", "_backward_fused_flat": "BW"}
    ops = {k: classify(v) for k, v in hlo.items()}
    by_class: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    by_shape: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    for e in events:
        if e.get("ph") != "X":
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0:
            continue
        kind = name_of.get(programs[i]["name"][len("PjitFunction("):-1])
        if kind is None or e["name"] not in ops[kind]:
            continue
        cls, shape = ops[kind][e["name"]]
        by_class[cls][kind] += e["dur"] / 10 / 1e3
        by_shape[(cls, shape)][kind] += e["dur"] / 10 / 1e3
    print(f"\n2. stage {args.stage} op by op (profiled, so slower than above; ms per call): B + W against BW")
    for cls in sorted(by_class):
        v = by_class[cls]
        print(f"   {cls:15s} F {v['F']:6.2f}  B {v['B']:6.2f}  W {v['W']:6.2f}  B+W {v['B'] + v['W']:6.2f}  BW {v['BW']:6.2f}  "
              f"extra {v['B'] + v['W'] - v['BW']:+6.2f}")
    print("   by output shape (largest differences first):")
    rows = sorted(by_shape.items(), key=lambda kv: -abs(kv[1]["B"] + kv[1]["W"] - kv[1]["BW"]))
    for (cls, shape), v in rows[:12]:
        print(f"   {cls:15s} {shape:22s} B {v['B']:5.2f}  W {v['W']:5.2f}  BW {v['BW']:5.2f}  extra {v['B'] + v['W'] - v['BW']:+5.2f}")


if __name__ == "__main__":
    main()
