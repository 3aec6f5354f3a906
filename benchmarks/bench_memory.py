"""What recording the measured activation memory costs, side by side in one run (issue 22).

Target: the recorder (``PipelineExecutor(record_memory=True)``, :mod:`zbpp_lite.runtime.memory`)
adds less than 2% to the step time on the peer job (``shared/peers/torch_pp_bench.py``'s: digits
Transformer d=128, 4 heads, 8 blocks, batch 256, m=8 microbatches, 2 ranks, float32).

Two executors of one schedule on the same 2 simulated CPU devices, one recording and one not,
run one step each in turn (interleaved repeats: this 2-core machine is shared, and a drift in
its speed then touches both alike). Printed per schedule: the median step time of each (wall
time of ``run``), the median of the per-pair ratios (recording / not), and the recorder's own
cost timed alone (its keep / free / settle calls on a stage's real arrays, per action) as a
share of the step. Then the load: the CPU cores other programs used meanwhile.

Also: every recorded step's peak bytes against the plan's (must be equal on every rank).

Run: python benchmarks/bench_memory.py [--pairs N] [--schedules 1f1b,zb-h1,zb-h2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_vs_torch import busy_cpu_seconds  # noqa: E402

from zbpp_lite.runtime.devices import ensure_devices  # noqa: E402


def recorder_cost(model, executor, x, y, repeat: int = 2000) -> float:
    """Seconds per action of the recorder alone: one F's keeps, one B's free and keep, one W's
    frees, each settled, on stage 0's real arrays."""
    import jax
    import numpy as np

    from zbpp_lite.runtime.memory import MemoryRecorder

    mb = x.shape[0] // executor.schedule.num_microbatches
    split = model.split_stage(0, jax.ShapeDtypeStruct((mb, *x.shape[1:]), x.dtype))
    params = tuple(jax.tree_util.tree_leaves(model.stage_params(model.params, 0)))
    _, res, kept = split.flat.forward(params, jax.device_put(x[:mb]), None, None)
    _, grads = split.flat.backward_input(params, res, jax.numpy.ones((mb, 8, 128), np.float32), None)
    rec = MemoryRecorder(2, model.num_stages)
    t0 = time.perf_counter()
    for j in range(repeat):
        rec.keep(0, ("res", 0, j), res)
        rec.keep(0, ("kept", 0, j), kept)
        rec.settle(0, 1.0)
        rec.free(0, ("res", 0, j))
        rec.keep(0, ("grads", 0, j), grads)
        rec.settle(0, 2.0)
        rec.free(0, ("kept", 0, j))
        rec.free(0, ("grads", 0, j))
        rec.settle(0, 3.0)
    return (time.perf_counter() - t0) / (3 * repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=30, help="interleaved (recording, not) step pairs per schedule (default 30)")
    parser.add_argument("--schedules", default="1f1b,zb-h1,zb-h2")
    args = parser.parse_args()
    devices = ensure_devices(2)
    import numpy as np

    import zbpp_lite as zb
    from zbpp_lite.runtime.executor import PipelineExecutor
    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.training.data import load_digits
    from zbpp_lite.training.model import ModelConfig, build_parts

    data = load_digits(0.0, 0)
    x, y = np.asarray(data.train_x[:256], np.float32), np.asarray(data.train_y[:256], np.int32)
    model = StagedModel(build_parts(ModelConfig(d=128, heads=4, blocks=8)), 2)
    print(f"peer job: d=128, 4 heads, 8 blocks, batch 256, m=8, 2 ranks; {args.pairs} interleaved pairs per schedule")
    print(f"{'schedule':<10}{'on ms':>9}{'off ms':>9}{'on/off (medians)':>18}{'pair ratio med.':>17}{'IQR':>16}"
          f"{'recorder us/action':>20}{'share':>8}{'peak == plan':>14}")
    busy0, wall0 = busy_cpu_seconds(), time.monotonic()
    own0 = time.process_time()
    for name in args.schedules.split(","):
        schedule = zb.build_schedule(name, 2, 8)
        on = PipelineExecutor(model, schedule, devices, record_memory=True)
        off = PipelineExecutor(model, schedule, devices, record_memory=False)
        for ex in (on, off, on, off):  # compile, then one warm step each
            ex.run(model.params, x, y)
        times = {"on": [], "off": []}
        exact = True
        for k in range(args.pairs):
            order = (("on", on), ("off", off)) if k % 2 == 0 else (("off", off), ("on", on))
            for key, ex in order:
                t0 = time.perf_counter()
                result = ex.run(model.params, x, y)
                times[key].append(time.perf_counter() - t0)
                if key == "on":
                    t = result.timeline
                    exact &= t.peak_memory_bytes == tuple(int(b) for b in t.planned_peak_bytes)
        ratios = sorted(a / b for a, b in zip(times["on"], times["off"]))
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        t_on, t_off = statistics.median(times["on"]), statistics.median(times["off"])
        cost = recorder_cost(model, on, x, y)
        actions_per_rank = max(len(a) for a in schedule.actions)
        share = cost * actions_per_rank / t_off
        print(f"{name:<10}{t_on * 1e3:>9.2f}{t_off * 1e3:>9.2f}{t_on / t_off:>18.4f}{statistics.median(ratios):>17.4f}"
              f"{f'[{q1:.3f}, {q3:.3f}]':>16}{cost * 1e6:>20.2f}{share:>8.2%}{'yes' if exact else 'NO':>14}", flush=True)
    wall = time.monotonic() - wall0
    if busy0 is not None:
        other = (busy_cpu_seconds() - busy0 - (time.process_time() - own0)) / wall
        print(f"other programs used {other:.2f} of {os.cpu_count()} cores meanwhile (this machine is shared: where the pair "
              "ratios' IQR spans more than the target, the pairs cannot resolve it, and the recorder's own cost, timed alone, "
              "is the figure that bounds it)")
    print("target: recording adds < 2% to the step time")


if __name__ == "__main__":
    main()
