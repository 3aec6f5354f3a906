"""Post-validation vs a synchronous optimizer step, zb-h2 at p = 2 with clipping on, measured.

The executor runs the training loop itself (``PipelineExecutor.run_steps``): each rank goes on
to its next step as soon as its own share is done, and AdamW with the global-norm clip and the
NaN check runs inside the rank threads (``zbpp_lite.optimizer.StageOptimizer``) three ways:
``plain`` (no guard: the floor), ``synchronous`` (every rank waits for every rank's norm before
stepping) and ``post-validation`` (speculative step on the partial norm, validated and rolled
back before the next step's first action). ``max_norm`` is set so that clipping triggers on
some steps (rollbacks counted; each costs a rollback and a redone step). The figure is the
loop's period: per run the mean time between the starts of consecutive timed steps (each step's
first action), then the median over the runs, per policy; the policies take turns, several
rounds, to spread any drift of the machine over all three.

Run: python benchmarks/bench_postval.py [--steps 12 --rounds 3]   (PyTorch job size, ~2 min)
"""

from __future__ import annotations

import argparse
import os
import statistics

from zbpp_lite.devices import cpu_device_flags

os.environ["XLA_FLAGS"] = cpu_device_flags(2)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zbpp_lite as zb  # noqa: E402
from zbpp_lite.data import load_digits  # noqa: E402
from zbpp_lite.executor import PipelineExecutor, measured_costs  # noqa: E402
from zbpp_lite.model import ModelConfig, StagedModel, build_parts  # noqa: E402
from zbpp_lite.optimizer import POLICIES, guarded_run  # noqa: E402
from zbpp_lite.rollback import AdamWConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="zb-h2")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first 2 are not timed)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per policy, taking turns")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--clip-quantile", type=float, default=0.9, help="max_norm: this quantile of an unclipped run's norms")
    args = ap.parse_args()
    schedule = zb.build_schedule(args.schedule, 2, args.microbatches)
    model = StagedModel(build_parts(ModelConfig(d=args.d, heads=4, blocks=args.blocks)), schedule.num_stages)
    executor = PipelineExecutor(model, schedule, jax.devices()[:2])
    data = load_digits(0.0, 0)
    batches = [data.batch(k, args.batch) for k in range(args.steps)]
    cfg = AdamWConfig()
    # max_norm: the 90th percentile of the norms of an unclipped run, so clipping triggers now and
    # then, as in stable training (the case post-validation is for; --clip-quantile 0.5 makes
    # half the steps roll back)
    _, probe = guarded_run(executor, model.params, batches, "synchronous", 1e30, cfg)
    norms = sorted(r.global_norm for r in probe.reports)
    max_norm = norms[min(len(norms) - 1, int(args.clip_quantile * len(norms)))]
    periods: dict[str, list[float]] = {p: [] for p in POLICIES}
    rollbacks: dict[str, int] = {p: 0 for p in POLICIES}
    timelines = []
    for _ in range(args.rounds):
        for policy in POLICIES:
            results, opt = guarded_run(executor, model.params, batches, policy, None if policy == "plain" else max_norm, cfg)
            starts = [r.start for r in results[2:]]  # the loop's throughput: mean period over the timed steps
            periods[policy].append((starts[-1] - starts[0]) / (len(starts) - 1))
            rollbacks[policy] += sum(bool(r.rolled_back) for r in opt.reports[2:])
            timelines += [r.timeline for r in results[2:]]
    median = {p: statistics.median(v) for p, v in periods.items()}
    costs = measured_costs(timelines[len(timelines) // 2], schedule.num_stages)
    predicted = zb.simulate(schedule, costs)
    timed = args.rounds * (args.steps - 3)
    print(f"{args.schedule}, p=2, m={args.microbatches}, d={args.d}, {args.blocks} blocks, batch {args.batch}; "
          f"{args.rounds} runs x {args.steps - 2} timed steps per policy, max_norm {max_norm:.3g} (the {args.clip_quantile:g} quantile of an unclipped run's norms)")
    for p in POLICIES:
        extra = f"   rolled back on {rollbacks[p]} of {timed + args.rounds} steps" if p == "post-validation" else ""
        print(f"  {p:<16} step period {median[p] * 1e3:8.2f} ms{extra}")
    print(f"post-validation / synchronous: {median['post-validation'] / median['synchronous']:.3f}")
    print(f"synchronous - plain: {(median['synchronous'] - median['plain']) * 1e3:.2f} ms; "
          f"post-validation - plain: {(median['post-validation'] - median['plain']) * 1e3:.2f} ms")
    print(f"simulator, these costs: makespan {predicted.makespan * 1e3:.2f} ms, synchronisation bubble "
          f"{predicted.sync_bubble * 1e3:.2f} ms (the last rank's lag the synchronous step makes every rank wait for)")


if __name__ == "__main__":
    main()
