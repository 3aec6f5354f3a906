"""Our rank processes (shared-memory rings, ``zbpp_lite.runtime.processes``) against JAX's
distributed runtime (``launch``: cross-host ``device_put`` over sockets), the same job side by
side: the peer job's sizes, 1f1b, 2 ranks in 2 processes, the same steps.

Prints each run's median step time over the timed steps (the first compiles) and the ratio, then
the load of the machine. Runs alternate (``--rounds``), so a drift of the machine meets both.

    python benchmarks/bench_transport.py [--rounds 2] [--steps 10] [--schedule 1f1b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from zbpp_lite.analysis.profiling.timelines import timed_median

JOB = ["--microbatches", "8", "--d", "128", "--heads", "4", "--blocks", "8", "--batch", "256", "--no-progress"]


def median_step_ms(cmd: list[str], out: str) -> float:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed:\n{done.stderr[-1500:]}")
    steps = json.load(open(out))["steps"]
    return timed_median([s["seconds"] for s in steps]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    train = ["train", "--schedule", args.schedule, "--steps", str(args.steps), *JOB]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            ours = median_step_ms([sys.executable, "-m", "zbpp_lite", *train, "--json", f"{tmp}/ours.json"], f"{tmp}/ours.json")
            jax_rt = median_step_ms([sys.executable, "-m", "zbpp_lite", "launch", "--processes", "2", "--", *train,
                                     "--json", f"{tmp}/jax.json"], f"{tmp}/jax.json")
            rows.append((ours, jax_rt))
            print(f"round {k + 1}: rank processes (rings) {ours:8.1f} ms   JAX distributed runtime {jax_rt:8.1f} ms   "
                  f"ratio JAX / ours {jax_rt / ours:.2f}   (load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"median over rounds: ours {statistics.median(r[0] for r in rows):.1f} ms, JAX's runtime "
          f"{statistics.median(r[1] for r in rows):.1f} ms")


if __name__ == "__main__":
    main()
