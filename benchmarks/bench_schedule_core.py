"""How fast the pure-Python schedule layers are: build, validate and simulate large schedules.

Target (issue 2): zb-h1 with p = 32, m = 256 well under a second in all.
Target (issue 31): every registered schedule builds in under 2 s at p = 64, m = 128 and under 10 s at
p = 128, m = 256 (``--planning``: one build of each at m = 2p, wall and CPU seconds, with the load
average beside them, since the CPU time is what a loaded machine does not inflate).
Target (issue 39): ``python -m zbpp_lite plan`` under 20 s for every registered schedule at p = 256,
m = 512 (``--plan-at 256 512``: per schedule the wall and CPU seconds of the ``plan`` command itself,
each in a fresh process as a user runs it, with the load average beside them; ``--phases`` adds the CPU
seconds of its steps: build, checks, lowering, execution order, timing, timeline, text grid).
Run: python benchmarks/bench_schedule_core.py [--planning [--ranks 16 32 64 128] [--skip-after 60]]
     python benchmarks/bench_schedule_core.py --plan-at 256 512 [--only zb-v v-half] [--phases]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import zbpp_lite as zb


def timed(fn, repeat=5):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times), min(times)


def main() -> None:
    costs = zb.Costs(f=18.522, b=18.086, w=9.337, comm=0.601)
    print(f"{'schedule':<18} {'p':>3} {'m':>4} {'actions':>8} {'build ms':>9} {'validate ms':>12} {'simulate ms':>12} {'total ms':>9}")
    for name, p, m, kw in [("zb-h1", 32, 256, {}), ("zb-h2", 32, 256, {}), ("1f1b", 32, 256, {}),
                           ("interleaved-1f1b", 32, 256, {"stages_per_rank": 2})]:
        s, t_build, _ = timed(lambda: zb.build_schedule(name, p, m, **kw))
        _, t_val, _ = timed(lambda: zb.validate(s))
        _, t_sim, _ = timed(lambda: zb.simulate(s, costs, check=False))
        total = t_build + t_val + t_sim
        print(f"{name:<18} {p:>3} {m:>4} {len(s):>8} {t_build*1e3:>9.1f} {t_val*1e3:>12.1f} {t_sim*1e3:>12.1f} {total*1e3:>9.1f}")
    print("(medians of 5; total = build + validate + simulate; target for zb-h1 p=32 m=256: < 1000 ms)")


def planning(ranks: list[int], skip_after: float) -> None:
    """One build of every registered schedule at p in ``ranks``, m = 2p; a schedule whose build took
    more than ``skip_after`` wall seconds is not built at larger p."""
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    print(f"{'schedule':<18} {'p':>4} {'m':>4} {'actions':>8} {'wall s':>8} {'cpu s':>8} {'load':>6}")
    slow: set[str] = set()
    for p in ranks:
        for name in zb.SCHEDULES:
            if name in slow:
                print(f"{name:<18} {p:>4} {2 * p:>4} {'skipped (slower than --skip-after below)':>30}")
                continue
            c0, w0 = time.process_time(), time.perf_counter()
            s = zb.build_schedule(name, p, 2 * p)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            print(f"{name:<18} {p:>4} {2 * p:>4} {len(s):>8} {wall:>8.2f} {cpu:>8.2f} {os.getloadavg()[0]:>6.2f}", flush=True)
            if wall > skip_after:
                slow.add(name)
    print("(targets: < 2 s at p = 64, < 10 s at p = 128; load: the 1-minute load average after the build)")


PHASES = {  # phase -> (module, attribute) of the function plan's step calls; nested ones subtracted
    "build": ("zbpp_lite", "build_schedule"),
    "check": ("zbpp_lite.schedules.simulate", "checked_program"),
    "lower": ("zbpp_lite.schedules.validate", "lower"),
    "order": ("zbpp_lite.schedules.validate", "execution_order"),
    "time": ("zbpp_lite.schedules.simulate", "_timed_events"),
    "timeline": ("zbpp_lite.schedules.simulate", "Timeline"),
    "text": ("zbpp_lite.cli.plan", "text_grid"),
}
"""What ``--phases`` times inside the command (``check``: checked_program less lowering and order)."""


def _timed_phases(spent: dict):
    """Context: PHASES' functions wrapped to add their CPU seconds to ``spent`` (Timeline: its
    ``from_events``; a call inside the build, such as v-min timing its tight block, counts as build),
    restored after."""
    import contextlib
    import functools
    import importlib

    building = []

    def wrap(name, fn):
        @functools.wraps(fn)
        def timed_fn(*args, **kwargs):
            if building:
                return fn(*args, **kwargs)
            building.extend(["build"] if name == "build" else [])
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.process_time() - c0
                building.clear()
        return timed_fn

    @contextlib.contextmanager
    def patched():
        saved = []
        for name, (module, attr) in PHASES.items():
            owner = importlib.import_module(module)
            if attr == "Timeline":
                owner, attr = owner.Timeline, "from_events"
                fn = owner.__dict__[attr]
                new = classmethod(wrap(name, fn.__func__))
            else:
                fn = getattr(owner, attr)
                new = wrap(name, fn)
            saved.append((owner, attr, fn))
            setattr(owner, attr, new)
        try:
            yield
        finally:
            for owner, attr, fn in saved:
                setattr(owner, attr, fn)
    return patched()


def plan_steps(p: int, m: int, names: list[str], phases: bool = False) -> None:
    """``python -m zbpp_lite plan -s NAME -p p -m m`` for each schedule in ``names``, each in a fresh
    process as a user runs it (interpreter start and imports included): its wall and CPU seconds, with
    the load average (CPU time is what a loaded machine does not inflate). One process plans one
    schedule: planning several in one process leaves a heap that slows the later ones by up to 1.9x (v-min
    timed 4.8 s after zb-v and v-half, 2.5 s alone). ``phases``: also the CPU seconds of its steps
    (:data:`PHASES`), timed inside that process (:func:`_plan_here`)."""
    import json
    import resource
    import subprocess
    import sys

    def children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    print(f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores; p = {p}, m = {m}, unit costs")
    print(f"{'schedule':<18} {'wall s':>7} {'cpu s':>7} {'load':>6}" + ("".join(f"{k:>9}" for k in PHASES)
          if phases else ""))
    for name in names:
        command = [sys.executable, __file__, "--plan-at", str(p), str(m), "--only", name, "--here"] + \
            (["--phases"] if phases else [])
        c0, t0 = children_cpu(), time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        line = f"{name:<18} {time.perf_counter() - t0:>7.2f} {children_cpu() - c0:>7.2f} {os.getloadavg()[0]:>6.2f}"
        if done.returncode != 0:
            print(line + f"  (exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]})", flush=True)
            continue
        spent = json.loads(done.stdout.strip().splitlines()[-1])
        print(line + "".join(f"{spent.get(k, 0.0):>9.2f}" for k in PHASES if phases), flush=True)
    print("(target: < 20 s per schedule; each in its own process; phases in CPU s, the rest of cpu s is "
          "starting Python, imports, parsing and printing)")


def _plan_here(p: int, m: int, name: str, phases: bool) -> None:
    """The child of :func:`plan_steps`: the command in this process, its output discarded; prints the
    phases' CPU seconds as one JSON line."""
    import contextlib
    import io
    import json

    from zbpp_lite.cli import main

    spent: dict[str, float] = {}
    with contextlib.redirect_stdout(io.StringIO()), (_timed_phases(spent) if phases else contextlib.nullcontext()):
        status = main(["plan", "-s", name, "-p", str(p), "-m", str(m)])
    if phases:
        spent["check"] = spent.get("check", 0.0) - spent.get("lower", 0.0) - spent.get("order", 0.0)
    print(json.dumps(spent))
    raise SystemExit(status)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--planning", action="store_true", help="time one build of every schedule at m = 2p")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64, 128], help="p values for --planning")
    parser.add_argument("--skip-after", type=float, default=60.0, help="wall seconds after which larger p is skipped")
    parser.add_argument("--plan-at", type=int, nargs=2, metavar=("P", "M"), help="time plan's steps at p, m")
    parser.add_argument("--only", nargs="+", help="schedules for --plan-at (default: all registered)")
    parser.add_argument("--phases", action="store_true", help="with --plan-at: CPU seconds of plan's steps")
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # plan_steps' child
    args = parser.parse_args()
    if args.plan_at and args.here:
        _plan_here(*args.plan_at, args.only[0], args.phases)
    elif args.plan_at:
        plan_steps(*args.plan_at, args.only or list(zb.SCHEDULES), args.phases)
    elif args.planning:
        planning(args.ranks, args.skip_after)
    else:
        main()
