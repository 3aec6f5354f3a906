"""The package on one accelerator (a GPU or a TPU chip): correctness and per-action costs, in one
short run for a machine lent for minutes.

With one accelerator a pipeline cannot spread over devices, but every piece of the package still
runs there: both ranks' executors are given the same device (the ranks take turns on it), which
checks the backward split and the executor on that platform's compiler, not pipeline speed. It

Everything runs with float32 matrix products at full precision ("highest"; GPUs default to TF32).

1. profiles each stage's F, B, W and fused BW on the accelerator
   (``zbpp_lite.analysis.profiling.device.profile_stage_costs(..., fused=True)``, medians), the job of
   ``bench_vs_torch.py`` (d 128, 8 blocks, 2 stages, 32 samples per microbatch), and prints
   T_BW / (T_B + T_W): whether the split costs extra there too (``Costs.bw``);
2. trains 1f1b, zb-h2 and zb-auto (planned from those costs) for a few steps on it, with the
   gradient check against the unpartitioned model (relative error printed; fails above 1e-4);
3. runs the optimizer inside the ranks with the global-norm clip, synchronous and post-validated
   (speculative warm-up), and compares the parameters (fails above 1e-5 relative).

Run: python benchmarks/accelerator_check.py [--platform gpu|tpu|cpu] [--json PATH]
(``--platform cpu`` runs the same checks on two simulated CPU devices, for a dry run.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", default="gpu", choices=("gpu", "tpu", "cpu"))
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    from zbpp_lite.runtime.devices import ensure_devices

    devices = ensure_devices(2 if args.platform == "cpu" else 1, platform=args.platform)
    pair = devices[:2] if args.platform == "cpu" else [devices[0]] * 2
    import jax
    import jax.numpy as jnp
    import numpy as np

    # float32 proper, set before anything compiles: GPUs multiply float32 in TF32 by default
    # (about 1e-3 relative, which would hide a real error in the gradient check), and a stage's
    # jitted functions, once compiled, keep the precision they were compiled with
    jax.config.update("jax_default_matmul_precision", "highest")

    import zbpp_lite as zb
    from zbpp_lite.analysis.profiling.device import profile_stage_costs
    from zbpp_lite.training.data import load_digits
    from zbpp_lite.runtime.executor import PipelineExecutor
    from zbpp_lite.training.model import ModelConfig, build_parts
    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.training.postval.optimizer import guarded_run
    from zbpp_lite.training.train import RunConfig, TrainOptions, train

    report: dict = {"platform": args.platform, "device": str(devices[0]), "jax": jax.__version__}
    print(f"JAX {jax.__version__} on {devices[0]} ({getattr(devices[0], 'device_kind', '?')})", flush=True)
    ok = True

    # 1. per-action costs on the accelerator: F, B, W, BW per stage, medians of 20 after an untimed round
    model = StagedModel(build_parts(ModelConfig(d=128, heads=4, blocks=8)), 2)
    data = load_digits(0.0, 0)
    x, y = data.batch(0, 256)
    costs = profile_stage_costs(model, np.asarray(x)[:32], np.asarray(y)[:32], devices[0], repeats=20, fused=True)
    costs = zb.Costs(**{k: [1e3 * v for v in getattr(costs, k)] for k in ("f", "b", "w", "bw")})  # ms
    costs_ms = {f"{kind.upper()}{s}": getattr(costs, kind)[s] for s in range(2) for kind in ("f", "b", "w", "bw")}
    ratio = [costs.bw[s] / (costs.b[s] + costs.w[s]) for s in range(2)]
    print("per-action medians (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in costs_ms.items()))
    print(f"T_BW / (T_B + T_W) per stage: {', '.join(f'{r:.2f}' for r in ratio)}", flush=True)
    report["action_ms"], report["bw_over_b_plus_w"] = costs_ms, ratio

    # 2. training on the accelerator with the gradient check, 1f1b / zb-h2 / zb-auto
    report["train"] = {}
    for name in ("1f1b", "zb-h2", "zb-auto"):
        options = {"costs": costs} if name == "zb-auto" else {}
        result = train(name, 2, 8, args.steps, model=ModelConfig(d=128, heads=4, blocks=8), run=RunConfig(batch=256),
                       options=TrainOptions(devices=pair, schedule_options=options))
        err = result.grad_max_rel_error
        kinds = sorted({a.kind for row in result.schedule.actions for a in row})
        print(f"train {name:<8} losses {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, gradient check {err:.1e}, "
              f"actions {kinds}, step {statistics.median(result.step_seconds) * 1e3:.1f} ms (both ranks on one device)", flush=True)
        report["train"][name] = {"losses": result.losses, "grad_max_rel_error": err, "kinds": kinds}
        ok = ok and all(np.isfinite(result.losses)) and err <= 1e-4

    # 3. the optimizer inside the ranks: synchronous vs post-validated with the global-norm clip
    small = StagedModel(build_parts(ModelConfig(d=32, heads=4, blocks=4)), 2)
    schedule = zb.build_schedule("zb-h2", 2, 4)
    executor = PipelineExecutor(small, schedule, pair)
    batches = [data.batch(k, 64) for k in range(5)]
    first = executor.run(small.params, *batches[0]).grads
    norm = float(np.sqrt(sum(float(jnp.sum(jnp.square(v))) for v in jax.tree_util.tree_leaves(first))))
    from zbpp_lite.training.postval.rollback import AdamWConfig

    cfg = AdamWConfig(learning_rate=1e-2, eps=1e-3)
    runs = {}
    for policy in ("synchronous", "post-validation"):
        _, opt = guarded_run(executor, small.params, batches, policy, 0.9 * norm, cfg)
        runs[policy] = (opt.params(), [r.clipped for r in opt.reports], [r.rolled_back for r in opt.reports])
    gap = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-30))
              for s in range(2) for a, b in zip(runs["post-validation"][0][s], runs["synchronous"][0][s]))
    print(f"post-validation vs synchronous: parameters within {gap:.1e} relative; clipped {runs['synchronous'][1]}, "
          f"rolled back {runs['post-validation'][2]}", flush=True)
    report["postval_gap"] = gap
    ok = ok and gap <= 1e-5 and runs["synchronous"][1] == runs["post-validation"][1]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
