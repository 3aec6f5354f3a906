"""``python -m zbpp_lite plan``: build (or read), validate and simulate one schedule; no JAX.

Prints the text grid (one row per rank, time left to right, idle as dots), makespan, bubble
rate and peak activation memory per rank. ``--csv`` writes PyTorch's compute-only CSV,
``--from-csv`` plans a schedule read from one, ``--trace`` writes a Chrome/Perfetto trace.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from . import CliError

SLOW_BUILD = 64 * 128
"""p * m from which a cost-driven planner (zb-auto, zb-v, ...) says it is planning: from 0.7 s (zb-auto)
to 6 s (v-min) of CPU time at p = 64, m = 128 (benchmarks/bench_schedule_core.py --planning)."""


def add_parser(sub, help_text: str) -> None:
    p = sub.add_parser("plan", help=help_text, description=__doc__)
    p.add_argument("--schedule", "-s", default="zb-h1", help="schedule name (default zb-h1); see --list")
    p.add_argument("--ranks", "-p", type=int, default=4, help="pipeline ranks p (default 4)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches m (default 8)")
    p.add_argument("--stages-per-rank", "-v", type=int, default=None, help="stages per rank, for interleaved schedules")
    p.add_argument("--memory-limit", type=float, default=None, help="per-rank activation memory limit in units of M_B (automatic schedules)")
    p.add_argument("--f", type=float, default=1.0, help="T_F, forward time per stage and microbatch (default 1)")
    p.add_argument("--b", type=float, default=1.0, help="T_B, input-gradient backward time (default 1)")
    p.add_argument("--w", type=float, default=1.0, help="T_W, weight-gradient backward time (default 1)")
    p.add_argument("--comm", type=float, default=0.0, help="T_comm, transfer time between ranks (default 0)")
    p.add_argument("--bw", type=float, default=None,
                   help="T_BW, the fused backward's time, if measured below T_B + T_W (default T_B + T_W); zb-auto then splits only where it pays")
    p.add_argument("--fb", type=float, default=None,
                   help="T_F&B, the time of an overlapped F&B pair (dualpipe-v; default T_F + T_BW, no overlap)")
    p.add_argument("--width", type=int, default=120, help="characters per grid row (default 120)")
    p.add_argument("--csv", metavar="PATH", help="write the schedule as PyTorch's compute-only CSV")
    p.add_argument("--from-csv", metavar="PATH", help="plan a schedule read from a PyTorch-form CSV instead of building one")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome-trace (Perfetto) JSON of the simulated timeline")
    p.add_argument("--list", action="store_true", help="list the schedule names and exit")


def _schedule(args: argparse.Namespace):
    import zbpp_lite as zb
    from ..schedules.builders import options_of

    if args.from_csv:
        return zb.Schedule.from_csv(args.from_csv)
    if args.ranks < 1 or args.microbatches < 1:
        raise CliError(f"--ranks and --microbatches must be >= 1 (got {args.ranks}, {args.microbatches})")
    accepted = options_of(args.schedule)
    options = {}
    if args.stages_per_rank is not None:
        if "stages_per_rank" not in accepted:
            raise CliError(f"schedule {args.schedule!r} has a fixed number of stages per rank; drop --stages-per-rank")
        options["stages_per_rank"] = args.stages_per_rank
    if args.memory_limit is not None:
        if "memory_limit" not in accepted:
            raise CliError(f"schedule {args.schedule!r} takes no memory limit; automatic schedules (zb-auto) do")
        options["memory_limit"] = args.memory_limit
    if "costs" in accepted:
        options["costs"] = _costs(args)
    if "costs" in accepted and args.ranks * args.microbatches >= SLOW_BUILD:  # a search of greedy runs
        print(f"planning {args.schedule} for p = {args.ranks}, m = {args.microbatches} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        schedule = zb.build_schedule(args.schedule, args.ranks, args.microbatches, **options)
        print(f"planned in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        return schedule
    return zb.build_schedule(args.schedule, args.ranks, args.microbatches, **options)


def _costs(args: argparse.Namespace):
    import zbpp_lite as zb

    for name in ("f", "b", "w", "comm", "bw", "fb"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise CliError(f"--{name} must be a finite number >= 0, got {value}")
    return zb.Costs(f=args.f, b=args.b, w=args.w, comm=args.comm, bw=args.bw, fb=args.fb)


def run(args: argparse.Namespace) -> int:
    import zbpp_lite as zb
    from ..viz.text import text_grid

    if args.list:
        print("\n".join(zb.SCHEDULES))
        return 0
    schedule = _schedule(args)
    timeline = zb.simulate(schedule, _costs(args))
    name = schedule.name or (args.from_csv and f"from {args.from_csv}") or args.schedule
    print(f"{name}: p = {schedule.num_ranks} ranks, {schedule.num_stages} stages, m = {schedule.num_microbatches} microbatches")
    print(text_grid(timeline, width=args.width))
    print(f"makespan     {timeline.makespan:.6g}")
    print(f"bubble rate  {timeline.bubble_rate:.4f}")
    print("peak memory  " + " ".join(f"{m:g}" for m in timeline.peak_memory) + "  (per rank, units of M_B)")
    if args.csv:
        schedule.to_csv(args.csv)
        print(f"wrote {args.csv}")
    if args.trace:
        from ..viz.trace import write_chrome_trace

        write_chrome_trace(timeline, args.trace)
        print(f"wrote {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
