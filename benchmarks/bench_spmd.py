"""Compiled SPMD executor against the MPMD executor at p = 2, one run, with the lockstep
simulator's prediction beside the measured ratio; then the MPMD executor across 2 processes.

Prints: per-step times (median over steps after the first) of MPMD single-process, SPMD, and
both across 2 processes; the measured SPMD / MPMD ratio and the predicted one,
simulate(lockstep=True).makespan / simulate().makespan for the MPMD run's measured mean costs;
the parity errors of each against the unpartitioned model; the 2-process startup time.

With --switch, only this instead: what a tick's ``lax.switch`` costs when its branches return the whole
loop state (lesson 9's first tick did) against returning only what they made (lesson 9's tick and the
executor's), on one device of any platform: per all-idle tick, by the time of 3T ticks less that of T
over 2T, for buffers of 8 and 128 rows, and the ratio. A branch that reads buffers and writes something
else (W: a gradient from ``ins`` and ``dz``) is what made XLA on a CPU copy the state each tick.

With --overlap, only this instead: the compiled program sending each tick's message during the next tick
(``SpmdExecutor(..., overlap=True)``, lesson 10) against sending it at the tick's end, ZB-H1 and ZB-H2 at
p = 2, steps paired and alternated: the step times, their ratio, and the ratio of the programs' ticks (a
CPU runs a collective and compute in turn: expect no gain there, only the extra ticks' and the carried
message's cost).

Run: python benchmarks/bench_spmd.py [--schedule zb-h1] [--steps 6] [--d 64] [--switch | --overlap]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from zbpp_lite.analysis.profiling.timelines import timed_median
from zbpp_lite.runtime.devices import ensure_devices


def switch_copy() -> None:
    """Print :func:`zbpp_lite.course.bench.switch_costs` at 8 and 128 rows (module docstring, --switch)."""
    import jax

    from zbpp_lite.course.bench import switch_costs

    print(f"{jax.devices()[0].platform}, JAX {jax.__version__}: one all-idle tick (us), the state two buffers "
          f"(rows, 2, 64, 256) float32 and a (256, 256) sum")
    for rows, (whole, made) in switch_costs((8, 128)).items():
        print(f"  {rows:4d} rows ({2 * rows * 2 * 64 * 256 * 4 / 1e6:5.1f} MB): branches return the whole state "
              f"{whole * 1e6:8.1f}, what they made {made * 1e6:6.1f}, ratio {whole / max(made, 1e-9):6.1f}")


def overlap_cost(steps: int, d: int, m: int, batch: int) -> None:
    """Print the overlapped program against the plain one (module docstring, --overlap)."""
    devices = ensure_devices(2)

    import zbpp_lite as zb
    from zbpp_lite.runtime.spmd import SpmdExecutor
    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.training.data import load_digits
    from zbpp_lite.training.model import ModelConfig, build_parts

    x, y = load_digits(0.2, 0).batch(0, batch)
    print(f"p = 2, m = {m}, d = {d}, 4 blocks, batch {batch}, {steps} paired steps (median after the first), "
          f"{devices[0].platform}")
    for name in ("zb-h1", "zb-h2"):
        s = zb.build_schedule(name, 2, m)
        model = StagedModel(build_parts(ModelConfig(d=d, heads=4, blocks=4)), s.num_stages)
        runs = {o: SpmdExecutor(model, s, devices, overlap=o) for o in (False, True)}
        times: dict = {False: [], True: []}
        for _ in range(steps):
            for o, executor in runs.items():
                t0 = time.perf_counter()
                executor.run(model.params, x, y)
                times[o].append(time.perf_counter() - t0)
        plain, early = (timed_median(times[o]) for o in (False, True))
        ticks = [runs[o].tables.num_ticks for o in (False, True)]
        print(f"  {name}: step {1e3 * plain:.2f} ms, sending during the next tick {1e3 * early:.2f} ms, ratio "
              f"{early / plain:.3f}; ticks {ticks[0]} and {ticks[1]}, ratio {ticks[1] / ticks[0]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="zb-h1")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--switch", action="store_true", help="only the switch's per-tick cost (see above)")
    ap.add_argument("--overlap", action="store_true", help="only the overlapped program against the plain one")
    args = ap.parse_args()
    if args.switch:
        switch_copy()
        return
    if args.overlap:
        overlap_cost(args.steps, args.d, args.microbatches, args.batch)
        return
    devices = ensure_devices(2)

    import jax

    import zbpp_lite as zb
    from zbpp_lite.training.data import load_digits
    from zbpp_lite.runtime.executor import PipelineExecutor
    from zbpp_lite.analysis.profiling.timelines import measured_costs
    from zbpp_lite.training.model import ModelConfig, build_parts
    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.runtime.spmd import SpmdExecutor
    from zbpp_lite.training.reference import max_relative_error

    s = zb.build_schedule(args.schedule, 2, args.microbatches)
    model = StagedModel(build_parts(ModelConfig(d=args.d, heads=4, blocks=4)), s.num_stages)
    data = load_digits(0.2, 0)
    x, y = data.batch(0, args.batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(model.loss))(model.params, x, y)

    mpmd, spmd = PipelineExecutor(model, s, devices), SpmdExecutor(model, s, devices)
    times = {"mpmd": [], "spmd": []}
    errors, costs = {}, None
    for k in range(args.steps):
        for name, ex in (("mpmd", mpmd), ("spmd", spmd)):
            t0 = time.perf_counter()
            r = ex.run(model.params, x, y)
            times[name].append(time.perf_counter() - t0)
            if k == 0:
                errors[name] = max_relative_error(r.grads, ref_grads)
            if name == "mpmd" and k == args.steps - 1:
                costs = measured_costs(r.timeline, s.num_stages)
    med = {n: timed_median(v) for n, v in times.items()}
    predicted = zb.simulate(s, costs, lockstep=True).makespan / zb.simulate(s, costs).makespan

    with tempfile.TemporaryDirectory() as tmp:
        from zbpp_lite.cli.launch import launch

        runs = {}
        for flags in ([], ["--spmd"]):
            out = f"{tmp}/run{len(flags)}.json"
            t0 = time.perf_counter()
            status, failures = launch(["--schedule", args.schedule, "--ranks", "2", "-m", str(args.microbatches), "--steps", str(args.steps),
                                       "--d", str(args.d), "--heads", "4", "--blocks", "4", "--batch", str(args.batch), *flags, "--json", out],
                                      processes=2, timeout=120, deadline=600, echo=lambda line: None)
            runs[bool(flags)] = (json.load(open(out)) if status == 0 else None, time.perf_counter() - t0, failures)

    print(f"{args.schedule}, p=2, m={args.microbatches}, d={args.d}, 4 blocks, batch {args.batch}, {args.steps} steps "
          f"(median of steps after the first)")
    print(f"{'executor':<24}{'step ms':>10}{'grad rel. error':>18}")
    print(f"{'MPMD, 1 process':<24}{1e3 * med['mpmd']:>10.2f}{errors['mpmd']:>18.2e}")
    print(f"{'SPMD compiled, 1 proc.':<24}{1e3 * med['spmd']:>10.2f}{errors['spmd']:>18.2e}")
    for label, (run, wall, failures) in (("MPMD, 2 processes", runs[False]), ("SPMD, 2 processes", runs[True])):
        if run is None:
            print(f"{label}: failed: {failures}")
            continue
        secs = [st["seconds"] for st in run["steps"]]
        startup = f"startup of the runtime {run['startup_seconds']:.2f} s; " if "startup_seconds" in run else ""
        print(f"{label:<24}{1e3 * timed_median(secs):>10.2f}{run['grad_max_rel_error']:>18.2e}"
              f"   ({startup}whole launch {wall:.1f} s)")
    print(f"SPMD / MPMD step time: measured {med['spmd'] / med['mpmd']:.3f}, predicted by the lockstep simulator {predicted:.3f} "
          f"(costs T_F {[f'{1e3 * v:.2f}' for v in costs.f]} ms, T_B {[f'{1e3 * v:.2f}' for v in costs.b]}, "
          f"T_W {[f'{1e3 * v:.2f}' for v in costs.w]})")


if __name__ == "__main__":
    main()
