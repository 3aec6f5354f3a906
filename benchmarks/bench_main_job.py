"""The main job's targets, measured: README command 1 (``compare --ranks 2 --microbatches 8``)
run as a user runs it, then its figures checked side by side.

Prints, per run: the wall time of the whole command; the measured bubble rates of 1f1b, zb-h1
and zb-h2 (their order); the median step of zb-h2 and of zb-auto over 1f1b's (same run, the
schedules taking turns step by step), and the same ratios step by step (the median of step k's
ratio, with its distribution-free interval: what cancels the machine's slow spells); measured / simulated makespan of every schedule with one
stage per rank; the speed-up of the fastest schedule over the faster single-device reference;
the long run's test accuracy; and the load of other programs during the run.

    python benchmarks/bench_main_job.py [--repeats N] [--keep DIR] [-- extra compare flags]

``--model gpt``: the same command on the byte-level GPT; prints each schedule's median step over 1f1b's,
step by step (the paired ratio and its interval), and the split's price at this model's shapes:
(T_B + T_W) / T_BW with each stage timed alone (what zb-auto plans with) and as the pipelines paid it
(zb-h2's, else zb-h1's, B + W over 1f1b's BW). ``--save PATH`` writes them as JSON (lesson 6 reads one).

    python benchmarks/bench_main_job.py --model gpt --save notebooks/figures/data/06_gpt_main_job.json \
        -- --schedules 1f1b,gpipe,zb-h1,zb-h2,zb-auto,zb-v --steps 10 --learn-steps 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from zbpp_lite.schedules import strict_json


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def one_run(extra: list[str], keep: str | None = None, model: str = "digits") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "compare.json")
        cmd = [sys.executable, "-m", "zbpp_lite", "compare", "--ranks", "2", "--microbatches", "8",
               "--model", model, "--out", os.path.join(tmp, "compare.html"), "--json", out, *extra]
        before = load_average()
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"compare failed ({done.returncode}):\n{done.stderr[-2000:]}")
        report = json.load(open(out))
        report["command"] = " ".join(["python -m zbpp_lite", *cmd[3:10], *extra])
        if keep:
            os.makedirs(keep, exist_ok=True)
            stamp = time.strftime("%H%M%S")
            for name in ("compare.json", "compare.html"):
                os.replace(os.path.join(tmp, name), os.path.join(keep, f"{stamp}-{name}"))
            with open(os.path.join(keep, f"{stamp}-compare.txt"), "w") as f:
                f.write(done.stdout)
    report["wall_seconds"], report["load_before"], report["load_after"] = seconds, before, load_average()
    return report


def figures(report: dict) -> dict:
    runs = {r["schedule"]: r for r in report["runs"]}
    step = {n: r["median_step_ms"] for n, r in runs.items()}
    bubble = {n: r["median_bubble_rate"] for n, r in runs.items()}
    one_stage = {n: r["measured"]["makespan"] / r["simulated"]["makespan"] for n, r in runs.items() if r["stages"] == r["ranks"]}
    return {
        "wall_s": report["wall_seconds"],
        "bubble 1f1b > zb-h1 > zb-h2": (bubble["1f1b"], bubble["zb-h1"], bubble["zb-h2"]),
        "order holds": bubble["1f1b"] > bubble["zb-h1"] > bubble["zb-h2"],
        "zb-h2 / 1f1b": step["zb-h2"] / step["1f1b"],
        "zb-auto / 1f1b": step["zb-auto"] / step["1f1b"],
        "zb-h2 / 1f1b step by step [interval]": _paired(runs["zb-h2"]),
        "zb-auto / 1f1b step by step [interval]": _paired(runs["zb-auto"]),
        "measured / simulated (one stage per rank)": {n: round(v, 3) for n, v in sorted(one_stage.items())},
        "median step (ms)": {n: round(v, 1) for n, v in sorted(step.items(), key=lambda kv: kv[1])},
        "fastest": min(step, key=step.get),
        "speed-up over " + report["reference"]: max(r["speedup"] for r in runs.values()),
        "test accuracy": report.get("learned", {}).get("test_accuracy"),
        "load (1-min average) before / after": (round(report["load_before"], 2), round(report["load_after"], 2)),
    }


def gpt_figures(report: dict) -> dict:
    """``--model gpt``'s figures, JSON-ready: every schedule's median step and its paired ratio to 1f1b's
    (``[ratio, low, high]``, None for 1f1b), the split's price, each stage's costs timed alone (ms, by
    number of stages: what the planners used), the wall time, the load."""
    runs = {r["schedule"]: r for r in report["runs"]}
    paired = {n: r.get("vs_1f1b") for n, r in runs.items()}
    return {
        "command": report["command"], "wall_s": round(report["wall_seconds"], 1),
        "median_step_ms": {n: round(r["median_step_ms"], 2) for n, r in runs.items()},
        "vs_1f1b": {n: g and [round(g[k], 4) for k in ("ratio", "low", "high")] for n, g in paired.items()},
        "coverage": next((g["coverage"] for g in paired.values() if g), None),
        "split_price": report.get("split_price"),
        "stage_costs_ms": report.get("stage_costs_ms"),
        "load_before_after": [round(report["load_before"], 2), round(report["load_after"], 2)],
    }


def _paired(run: dict) -> str:
    g = run.get("vs_1f1b")
    return "n/a" if g is None else f"{g['ratio']:.3f} [{g['low']:.3f}, {g['high']:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", metavar="DIR", help="keep each run's printed report, JSON and HTML page in DIR")
    parser.add_argument("--model", choices=("digits", "gpt"), default="digits")
    parser.add_argument("--save", metavar="PATH", help="--model gpt: write the last run's figures as JSON")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    for k in range(args.repeats):
        report = one_run(extra, args.keep, args.model)
        if args.model == "gpt":
            f = gpt_figures(report)
            print(f"run {k + 1}: {f['command']}")
            for name, ms in sorted(f["median_step_ms"].items(), key=lambda kv: kv[1]):
                g = f["vs_1f1b"][name]
                print(f"  {name:18s} {ms:8.2f} ms  vs 1f1b step by step "
                      + ("-" if g is None else f"{g[0]:.3f} [{g[1]:.3f}, {g[2]:.3f}]"))
            print(f"  split's price (T_B + T_W) / T_BW: {f['split_price']}; wall {f['wall_s']} s, load "
                  f"before / after {f['load_before_after']}", flush=True)
            if args.save:
                print(strict_json.write(args.save, f))
            continue
        f = figures(report)
        print(f"run {k + 1}:")
        for name, value in f.items():
            print(f"  {name:45s} {value if not isinstance(value, float) else round(value, 3)}")
        print("  targets: wall <= 240 s: {}, zb-h2 <= 0.97: {}, zb-auto <= 0.95: {}, measured/simulated <= 1.10: {}".format(
            f["wall_s"] <= 240, f["zb-h2 / 1f1b"] <= 0.97, f["zb-auto / 1f1b"] <= 0.95,
            all(v <= 1.10 for v in f["measured / simulated (one stage per rank)"].values())), flush=True)


if __name__ == "__main__":
    main()
