"""Adapting an imbalanced pipeline: the measured makespan before and after, side by side in one run.

Target (issue 7): at p = 2 on single-threaded simulated CPU devices, with the last stage about
twice as slow (``--imbalance 2``: the original partition puts 2 blocks on stage 0 and 4 on stage
1), the adapted plan (rebalanced partition, schedule re-planned from measured costs) has a
measured makespan at least 10% below ZB-H1's on the original partition, with gradients equal to
the unpartitioned model's.

How: :func:`zbpp_lite.training.adapt.adapt` profiles ZB-H1 on the original partition, attributes its idle
time, rebalances and re-plans, and trains a few steps with the result. Then, so that a machine
shared with other work slows both alike, the original and the adapted plan run alternately on the
same parameters and batch for ``--rounds`` rounds; the ratio is of the medians. m = 8, d = 128,
4 heads, batch 256 (32 samples per microbatch), so actions take milliseconds.
Run: python benchmarks/bench_adapt.py [--rounds N] [--imbalance F] [--microbatches M]
"""

from __future__ import annotations

import argparse
import os
import statistics

from zbpp_lite.runtime.devices import ensure_devices


def parallel_efficiency(devices, seconds: float = 0.3) -> float:
    """How much of two cores the two devices get right now: the time of a fixed computation on one
    device alone over its time while the other device runs the same (1.0: two free cores; about
    0.5 when other processes keep the machine busy, and then no balancing can shorten a step)."""
    import threading
    import time

    import jax
    import jax.numpy as jnp

    work = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    inputs = [jax.device_put(jnp.ones((256, 256), jnp.float32) / 256, d) for d in devices]
    for a in inputs:
        work(a).block_until_ready()

    def loop(a, out, k):
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < seconds:
            work(a).block_until_ready()
            n += 1
        out[k] = (time.perf_counter() - start) / n

    alone = [0.0]
    loop(inputs[0], alone, 0)
    together = [0.0, 0.0]
    threads = [threading.Thread(target=loop, args=(a, together, k)) for k, a in enumerate(inputs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return alone[0] / max(together)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16, help="alternating rounds of the before / after comparison (default 16)")
    parser.add_argument("--imbalance", type=float, default=2.0, help="blocks on the last stage / blocks on the others (default 2)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    args = parser.parse_args()
    devices = ensure_devices(2)  # before JAX starts: 2 single-threaded CPU devices

    import jax

    import zbpp_lite as zb
    from zbpp_lite.training.adapt import adapt
    from zbpp_lite.training.data import load_digits
    from zbpp_lite.runtime.executor import PipelineExecutor
    from zbpp_lite.training.model import ModelConfig, build_parts
    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.training.reference import max_relative_error

    m, d, batch = args.microbatches, 128, 256
    load = os.getloadavg()[0]
    efficiency = parallel_efficiency(devices)
    print(f"machine: {os.cpu_count()} cores, load average {load:.2f}; the two devices get {efficiency:.0%} "
          "of two free cores (a balanced pipeline needs both)")
    print(f"1. adapt: p=2, m={m}, d={d}, 4 heads, batch {batch}, imbalance {args.imbalance:g}")
    result = adapt(2, m, 6, imbalance=args.imbalance, profile_steps=6, d=d, heads=4, batch=batch, devices=devices, online=False)
    print(result.profile.table())
    print(result.attribution.table())
    print(result.report())

    config = ModelConfig(d=d, heads=4, blocks=result.config["blocks"], seed=0)
    plans = {
        "before": (result.before.parts, result.before.schedules[-1]),
        "after": (result.after.parts, result.after.schedules[-1]),
    }
    x, y = load_digits(0.2, 0).batch(0, batch)
    executors, errors, spans = {}, {}, {name: [] for name in plans}
    for name, (parts, schedule) in plans.items():
        model = StagedModel(build_parts(config), 2, parts=parts)
        executors[name] = (model, PipelineExecutor(model, schedule, devices))
    model = executors["before"][0]
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(model.loss))(jax.device_put(model.params, devices[0]), x, y)
    for k in range(args.rounds + 1):
        order = list(plans) if k % 2 == 0 else list(plans)[::-1]
        for name in order:
            model, executor = executors[name]
            step = executor.run(model.params, x, y)
            if k == 0:  # the first round compiles; check the gradients there
                errors[name] = (max_relative_error(step.grads, ref_grads), abs(step.loss - float(ref_loss)))
            else:
                spans[name].append(step.timeline.makespan)
    print(f"\n2. alternating, {args.rounds} rounds, same parameters and batch (medians)")
    print(f"{'plan':<8}{'schedule':>10}{'blocks per stage':>18}{'makespan ms':>13}{'grad rel. err':>15}{'loss err':>10}")
    medians = {}
    for name, (parts, schedule) in plans.items():
        medians[name] = statistics.median(spans[name])
        blocks = [sum(1 for i in p if 0 < i < config.blocks + 1) for p in parts]
        print(f"{name:<8}{schedule.name:>10}{str(blocks):>18}{medians[name] * 1e3:>13.2f}{errors[name][0]:>15.2e}{errors[name][1]:>10.1e}")
    ratio = medians["after"] / medians["before"]
    print(f"adapted / zb-h1 on the original partition, measured makespan: {ratio:.3f} (target <= 0.90): "
          f"{'met' if ratio <= 0.9 else 'NOT met'}")
    fastest = min(spans["after"]) / min(spans["before"])
    print(f"the same ratio for the fastest (least disturbed) round of each plan: {fastest:.3f}")
    efficiency_after = parallel_efficiency(devices)
    print(f"the two devices got {efficiency:.0%} / {efficiency_after:.0%} of two free cores before / after the runs, "
          f"load average now {os.getloadavg()[0]:.2f}"
          + ("" if min(efficiency, efficiency_after) > 0.8 else "; with the machine shared, both plans are partly limited "
             "by the cores they get rather than by the balance (the prediction below assumes free cores)"))
    print(f"gradients equal to the unpartitioned model's (max relative error < 1e-5): "
          f"{'yes' if max(e[0] for e in errors.values()) < 1e-5 else 'NO'}")
    sim = {name: zb.simulate(s, result.part_costs.stage_costs(p, comm=result.profile.comm)).makespan for name, (p, s) in plans.items()}
    print(f"predicted from the calibrated part costs: {sim['after'] / sim['before']:.3f}")


if __name__ == "__main__":
    main()
