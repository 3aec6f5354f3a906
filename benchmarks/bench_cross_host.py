"""Step time of the same training across two processes: ``train --coordinator`` with the
processes on two loopback addresses (127.0.0.1 and 127.0.0.2, as two hosts) against ``launch``
(both on 127.0.0.1), run one after the other in this script; prints each run's median step
(process 0's, steps after the first) and their ratio, with the machine's load.

    python benchmarks/bench_cross_host.py [--steps 12] [--schedule zb-h1] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from zbpp_lite.runtime.cluster import free_port


def median_step(text: str) -> float:
    m = re.search(r"median step ([\d.]+) ms", text)
    if not m:
        raise SystemExit(f"no median step in the output:\n{text[-3000:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--schedule", default="zb-h1")
    ap.add_argument("--microbatches", type=int, default=8)
    a = ap.parse_args()
    job = ["--schedule", a.schedule, "--ranks", "2", "--microbatches", str(a.microbatches), "--steps", str(a.steps)]
    py = [sys.executable, "-m", "zbpp_lite"]
    load0 = os.getloadavg()[0]

    t0 = time.perf_counter()
    out = subprocess.run([*py, "launch", "--processes", "2", "--", "train", *job], capture_output=True, text=True, timeout=900)
    launch_ms, launch_s = median_step(out.stdout), time.perf_counter() - t0

    port = free_port()
    procs = []
    t0 = time.perf_counter()
    for q, host in enumerate(("127.0.0.1", "127.0.0.2")):
        procs.append(subprocess.Popen(
            [*py, "train", *job, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(q),
             "--transfer-address", f"{host}:{free_port(host)}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    texts = [p.communicate(timeout=900)[0] for p in procs]
    hosts_ms, hosts_s = median_step(texts[0]), time.perf_counter() - t0

    print(f"{a.schedule}, 2 ranks, {a.microbatches} microbatches, {a.steps} steps; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"launch, both on 127.0.0.1:          median step {launch_ms:8.2f} ms   (whole run {launch_s:.1f} s)")
    print(f"train --coordinator, two addresses: median step {hosts_ms:8.2f} ms   (whole run {hosts_s:.1f} s)")
    print(f"two addresses / launch: {hosts_ms / launch_ms:.3f}")


if __name__ == "__main__":
    main()
