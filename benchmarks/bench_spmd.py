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

Run: python benchmarks/bench_spmd.py [--schedule zb-h1] [--steps 6] [--d 64] [--switch]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from zbpp_lite.analysis.profiling.timelines import timed_median
from zbpp_lite.runtime.devices import ensure_devices


def switch_copy() -> None:
    """Print the per-tick cost of the two tick forms (module docstring, --switch)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    S, D, T = 64, 256, 64   # a message's samples and width, ticks
    work = lambda x: jnp.tanh(x) * 1.01  # noqa: E731

    def program(rows: int, whole: bool):
        def tick(st, kj):
            k, j = kj
            r = j % rows
            if whole:   # every branch takes and returns the state: F writes ins, B dz, W adds to acc
                st = lax.switch(k, [lambda s: s, lambda s: {**s, "ins": s["ins"].at[r].set(work(s["ins"][r]))},
                                    lambda s: {**s, "dz": s["dz"].at[r].set(work(s["dz"][r]))},
                                    lambda s: {**s, "acc": s["acc"] + s["ins"][r, 0].T @ s["dz"][r, 0]}], st)
                return st, None
            zero = jnp.zeros((D, D))
            a, b, acc = lax.switch(k, [lambda a, b: (a, b, zero), lambda a, b: (work(a), b, zero),
                                       lambda a, b: (a, work(b), zero), lambda a, b: (a, b, a[0].T @ b[0])],
                                   st["ins"][r], st["dz"][r])   # reads rows, returns what it made
            return {"ins": st["ins"].at[r].set(a), "dz": st["dz"].at[r].set(b), "acc": st["acc"] + acc}, None

        def run(ks, js):
            st = dict(ins=jnp.zeros((rows, 2, S, D)), dz=jnp.zeros((rows, 2, S, D)), acc=jnp.zeros((D, D)))
            return lax.scan(tick, st, (ks, js))[0]["acc"][0, 0]
        return jax.jit(run)

    def best(f, n):
        ks, js = jnp.zeros(n, jnp.int32), jnp.arange(n)
        jax.block_until_ready(f(ks, js))
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            jax.block_until_ready(f(ks, js))
            times.append(time.perf_counter() - t0)
        return min(times)

    print(f"{jax.devices()[0].platform}, JAX {jax.__version__}: one all-idle tick (us), state of 2 buffers "
          f"(rows, 2, {S}, {D}) float32 and a ({D}, {D}) sum")
    for rows in (8, 128):
        per = {}
        for whole in (True, False):
            f = program(rows, whole)
            per[whole] = max(best(f, 3 * T) - best(f, T), 0.0) / (2 * T) * 1e6
        print(f"  {rows:4d} rows ({2 * rows * 2 * S * D * 4 / 1e6:5.1f} MB): branches return the whole state "
              f"{per[True]:8.1f}, what they made {per[False]:6.1f}, ratio {per[True] / max(per[False], 1e-3):6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="zb-h1")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--switch", action="store_true", help="only the switch's per-tick cost (see above)")
    args = ap.parse_args()
    if args.switch:
        switch_copy()
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
