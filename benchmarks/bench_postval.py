"""Post-validation vs a synchronous optimizer step, zb-h2 at p = 2 with clipping on.

For several training steps: the executor runs zb-h2 and measures every action; each rank's
optimizer step (AdamW, with the clip) is timed on that rank's device. One step's makespan with
the optimizer included is then composed from those measured parts both ways
(:func:`zbpp_lite.postval.step_makespans`): synchronous (every rank waits for the last rank and
the global norm before stepping) and post-validated (each rank steps when its own last action
ends). The executor runs one training step at a time, so this composes measured pieces rather
than timing two concurrent runs; the simulator predicts the same gap ((p-1) T_F for ZB-H2).

Run: python benchmarks/bench_postval.py [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from zbpp_lite.devices import cpu_device_flags

os.environ["XLA_FLAGS"] = cpu_device_flags(2)

import jax  # noqa: E402

import zbpp_lite as zb  # noqa: E402
from zbpp_lite.data import load_digits  # noqa: E402
from zbpp_lite.executor import PipelineExecutor, measured_costs  # noqa: E402
from zbpp_lite.model import ModelConfig, StagedModel, build_parts  # noqa: E402
from zbpp_lite.postval import post_validated_step, step_makespans  # noqa: E402
from zbpp_lite.rollback import AdamWConfig, adamw_rollback  # noqa: E402


def seconds_of(fn):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    schedule = zb.build_schedule("zb-h2", 2, args.microbatches)
    model = StagedModel(build_parts(ModelConfig(d=64, heads=4, blocks=4)), 2)
    devices = jax.devices()[:2]
    executor = PipelineExecutor(model, schedule, devices)
    data = load_digits(0.2, 0)
    cfg = AdamWConfig()
    params = [jax.device_put(model.stage_params(model.params, s), devices[s]) for s in range(2)]
    states = [jax.device_put(cfg.optimizer().init(p), devices[s]) for s, p in enumerate(params)]
    # max_norm: the 80th percentile of the first steps' norms, so clipping triggers now and then
    norms = []
    for k in range(5):
        x, y = data.batch(k, 128)
        g = executor.run(model.join_stage_params(params), x, y).grads
        norms.append(float(sum(float((v * v).sum()) for v in jax.tree_util.tree_leaves(g)) ** 0.5))
    max_norm = sorted(norms)[3]
    rows = []
    for k in range(args.steps):
        x, y = data.batch(k, 128)
        result = executor.run(model.join_stage_params(params), x, y)
        grads = [jax.device_put(model.stage_params(result.grads, s), devices[s]) for s in range(2)]
        new_params, new_states, report = post_validated_step(params, states, grads, cfg, max_norm, schedule.placement)
        # each rank's optimizer work, timed on its device: one AdamW step; post-validation adds a
        # rollback and a redone step on the ranks whose speculative step was wrong
        opt = cfg.optimizer()
        step_s = [seconds_of(lambda s=s: opt.update(grads[s], states[s], params[s])) for s in range(2)]
        redo_s = [seconds_of(lambda s=s: adamw_rollback(new_params[s], new_states[s], grads[s], cfg)) + step_s[s]
                  if schedule.placement[s] in report.rolled_back else 0.0 for s in range(2)]
        sync_spans = step_makespans(result.timeline, step_s)
        pv_spans = step_makespans(result.timeline, [a + b for a, b in zip(step_s, redo_s)])
        params, states = new_params, new_states
        rows.append((sync_spans["synchronous"], pv_spans["post_validation"], result.timeline, report))
    timed = rows[2:]  # the first steps compile
    sync = statistics.median(r[0] for r in timed)
    pv = statistics.median(r[1] for r in timed)
    costs = measured_costs(timed[-1][2], 2)
    predicted = zb.simulate(schedule, costs)
    print(f"zb-h2, p=2, m={args.microbatches}, {len(timed)} timed steps, clipping on "
          f"({sum(bool(r[3].rolled_back) for r in timed)} steps rolled back)")
    print(f"synchronous optimizer step: median makespan {sync * 1e3:8.2f} ms")
    print(f"post-validation:            median makespan {pv * 1e3:8.2f} ms")
    print(f"post-validation / synchronous: {pv / sync:.3f}")
    print(f"simulator's synchronisation bubble for these costs: {predicted.sync_bubble * 1e3:.2f} ms "
          f"(measured difference {(sync - pv) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
