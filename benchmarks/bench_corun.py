"""How much slower a stage's passes run while another core works: the price of ranks side by side.

A pipeline's p ranks compute at the same time, each on its own core. Cores share the last-level
cache and the memory bandwidth (and on many cloud machines two "cores" are the two hardware
threads of one physical core), so a pass may take longer beside a busy core than alone. The
single-device reference runs alone. This benchmark times the peer job's two stages (d 128, 8
blocks, microbatch 32: ``bench_vs_torch.py``) on core 0, pinned single-threaded from its start,
with core 1:

- idle (``alone``);
- running the same stage passes (``compute``: what the other rank of a pipeline does);
- streaming 32 MB arrays through memory (``stream``: bandwidth and cache, few flops).

The machine drifts over minutes (other tenants of the host), more than the effect sought, so the
partner is switched on and off every ``--toggle`` seconds (SIGSTOP / SIGCONT) while core 0 times
without a pause, and each timed call is classed by the partner's state during it: idle and working
interleave, seconds apart. Printed: the medians of T_F, T_B, T_W, T_BW per stage (ms) with core 1
idle and working, their ratio, and (T_B + T_W) / T_BW in both states.

    python benchmarks/bench_corun.py [--seconds 60] [--toggle 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

JOB = {"d": 128, "heads": 4, "blocks": 8, "microbatch": 32}
KINDS = ("f", "b", "w", "bw")


def _pin(core: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[core % len(cores)]})


def _model():
    from zbpp_lite.runtime.devices import ensure_devices

    ensure_devices(1)
    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.training.data import load_digits
    from zbpp_lite.training.model import ModelConfig, build_parts

    model = StagedModel(build_parts(ModelConfig(d=JOB["d"], heads=JOB["heads"], blocks=JOB["blocks"])), 2)
    x, y = load_digits(0.0, 0).batch(0, JOB["microbatch"])
    return model, x, y


def partner(kind: str, seconds: float) -> None:
    """Core 1's work for ``seconds``: the stage passes (``compute``) or a memory stream (``stream``)."""
    _pin(1)
    end = time.time() + seconds
    if kind == "stream":
        import numpy as np

        a = np.ones(8 * 1024 * 1024, np.float32)  # 32 MB, the size of the shared L3 here
        b = np.empty_like(a)
        while time.time() < end:
            np.multiply(a, 1.0001, out=b)
            a, b = b, a
        return
    from zbpp_lite.analysis.profiling.device import profile_stage_costs

    model, x, y = _model()
    while time.time() < end:
        profile_stage_costs(model, x, y, repeats=3, fused=True)


def measure(seconds: float) -> None:
    """Core 0: time the stages' F, B, W, BW over and over for ``seconds`` (one repeat per call of
    the profiler), printing one JSON line per call: {"t0", "t1", "f", "b", "w", "bw"} (s, ms)."""
    _pin(0)
    from zbpp_lite.analysis.profiling.device import profile_stage_costs

    model, x, y = _model()
    profile_stage_costs(model, x, y, repeats=1, fused=True)  # compiles
    print("ready", flush=True)
    end = time.time() + seconds
    while time.time() < end:
        t0 = time.time()
        costs = profile_stage_costs(model, x, y, repeats=1, fused=True)
        print(json.dumps({"t0": t0, "t1": time.time(), **{k: [v * 1e3 for v in getattr(costs, k)] for k in KINDS}}), flush=True)


def _child(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds per partner kind (default 60)")
    ap.add_argument("--toggle", type=float, default=2.0, help="seconds between switching the partner on and off (default 2)")
    ap.add_argument("--role", choices=("measure", "compute", "stream"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "measure":
        measure(args.seconds)
        return 0
    if args.role:
        partner(args.role, args.seconds)
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores: one to time on, one to keep busy")
    kinds = ("compute", "stream")
    timer = _child("--role", "measure", "--seconds", str(len(kinds) * (args.seconds + 15)), stdout=subprocess.PIPE, text=True)
    assert timer.stdout is not None
    if timer.stdout.readline().strip() != "ready":
        raise SystemExit("the timing process failed to start")
    spans: list[tuple[str, bool, float, float]] = []  # (partner kind, working?, from, to)
    for kind in kinds:
        other = _child("--role", kind, "--seconds", str(args.seconds + 30))
        time.sleep(12)  # it compiles (compute) or allocates, then works
        end, working = time.time() + args.seconds, True
        while time.time() < end:
            os.kill(other.pid, signal.SIGCONT if working else signal.SIGSTOP)
            t0 = time.time()
            time.sleep(args.toggle)
            spans.append((kind, working, t0 + 0.05, time.time()))
            working = not working
        other.kill()
        other.wait()
    timer.kill()
    calls = [json.loads(line) for line in timer.stdout.read().splitlines() if line.startswith("{")]
    timer.wait()
    print("median ms per stage [stage 0, stage 1] of the calls wholly inside one state of core 1, then idle / working:")
    for kind in kinds:
        state = {True: [], False: []}
        for c in calls:
            inside = [w for k, w, a, b in spans if k == kind and a <= c["t0"] and c["t1"] <= b]
            if inside:
                state[inside[0]].append(c)
        if not state[True] or not state[False]:
            print(f"  {kind}: too few calls inside one state ({len(state[True])} / {len(state[False])})")
            continue
        med = {w: {k: [statistics.median(c[k][s] for c in cs) for s in range(2)] for k in KINDS} for w, cs in state.items()}
        split = {w: [(m["b"][s] + m["w"][s]) / m["bw"][s] for s in range(2)] for w, m in med.items()}
        print(f"  core 1 {kind:7s} ({len(state[False])} calls idle, {len(state[True])} working)")
        for k in KINDS:
            print(f"    {k.upper():2s} idle {med[False][k][0]:6.2f} {med[False][k][1]:6.2f}   working {med[True][k][0]:6.2f} {med[True][k][1]:6.2f}"
                  f"   ratio {med[True][k][0] / med[False][k][0]:.3f} {med[True][k][1] / med[False][k][1]:.3f}")
        print(f"    (T_B + T_W) / T_BW  idle {split[False][0]:.3f} {split[False][1]:.3f}   working {split[True][0]:.3f} {split[True][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
