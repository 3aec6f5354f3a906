"""``python -m zbpp_lite plan``: build (or read), validate and simulate one schedule; no JAX.

Prints the text grid (a row per rank, time left to right, idle as dots), makespan, bubble rate and peak
activation memory per rank. ``--csv`` writes PyTorch's compute-only CSV, ``--from-csv`` plans a schedule
read from one, ``--trace`` writes a Chrome/Perfetto trace.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
from dataclasses import replace

import zbpp_lite as zb

from ..schedules.builders import options_of
from ..schedules.memory import MemoryPlan, order_peaks
from ..viz.text import text_grid
from ..viz.trace import write_chrome_trace
from . import CliError, add_output, check_against_csv, refuse_unused

SLOW_BUILD = 64 * 128
"""p * m from which a cost-driven planner (zb-auto, zb-v, ...) says it is planning: from there it takes
seconds of CPU time (``benchmarks/bench_schedule_core.py --planning`` measures it)."""

_COSTS = {  # flag -> help: the Costs fields plan takes from the command line
    "f": "T_F, forward time per stage and microbatch (default 1)",
    "b": "T_B, input-gradient backward time (default 1)",
    "w": "T_W, weight-gradient backward time (default 1)",
    "comm": "T_comm, transfer time between ranks (default 0)",
    "bw": "T_BW, the fused backward's time, if measured below T_B + T_W (default T_B + T_W); "
          "zb-auto then splits only where it pays",
    "fb": "T_F&B, the time of an overlapped F&B pair (dualpipe-v; default T_F + T_BW, no overlap)",
    "mem_b": "M_B, the activation memory F keeps per stage and microbatch, in the unit of --memory-limit "
             "(default 1)",
    "mem_w": "M_W, what a microbatch holds from B until W, same unit (default 7/16 M_B, the paper's ratio; "
             "above M_B under activation checkpointing, which the planners refuse)",
}
_DEFAULTS = {"f": 1.0, "b": 1.0, "w": 1.0, "comm": 0.0}


def add_parser(sub, help_text: str) -> None:
    p = sub.add_parser("plan", help=help_text, description=__doc__)
    p.add_argument("--schedule", "-s", default="zb-h1", help="schedule name (default zb-h1); see --list")
    p.add_argument("--ranks", "-p", type=int, default=4, help="pipeline ranks p (default 4)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches m (default 8)")
    p.add_argument("--stages-per-rank", "-v", type=int, default=None,
                   help="stages per rank, for interleaved schedules")
    p.add_argument("--memory-limit", type=float, default=None,
                   help="per-rank activation memory limit in units of one stage's M_B, or of --mem-b "
                        "(automatic schedules)")
    for name, text in _COSTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=_DEFAULTS.get(name), help=text)
    p.add_argument("--width", type=int, default=120, help="characters per grid row (default 120)")
    add_output(p, "--csv", help="write the schedule as PyTorch's compute-only CSV")
    p.add_argument("--from-csv", metavar="PATH",
                   help="plan a schedule read from a PyTorch-form CSV instead of building one")
    add_output(p, "--trace", help="write a Chrome-trace (Perfetto) JSON of the simulated timeline")
    p.add_argument("--list", action="store_true", help="list the schedule names and exit")


def _schedule(args: argparse.Namespace, costs: zb.Costs) -> zb.Schedule:
    if args.from_csv:
        schedule = zb.Schedule.from_csv(args.from_csv)
        check_against_csv(args, "--from-csv", schedule, ("schedule", "stages_per_rank", "memory_limit"))
        return schedule
    if args.ranks < 1 or args.microbatches < 1:
        raise CliError(f"--ranks and --microbatches must be >= 1 (got {args.ranks}, {args.microbatches})")
    accepted, options = options_of(args.schedule), {}
    if args.stages_per_rank is not None:
        if "stages_per_rank" not in accepted:
            raise CliError(f"schedule {args.schedule!r} has a fixed number of stages per rank; drop "
                           "--stages-per-rank")
        options["stages_per_rank"] = args.stages_per_rank
    if args.memory_limit is not None:
        if "memory_limit" not in accepted:
            raise CliError(f"schedule {args.schedule!r} takes no memory limit; automatic schedules "
                           "(zb-auto) do")
        options["memory_limit"] = args.memory_limit
    if "costs" not in accepted:
        return zb.build_schedule(args.schedule, args.ranks, args.microbatches, **options)
    slow = args.ranks * args.microbatches >= SLOW_BUILD  # a search of greedy runs: say so
    if slow:
        print(f"planning {args.schedule} for p = {args.ranks}, m = {args.microbatches} ...", file=sys.stderr,
              flush=True)
    started = time.perf_counter()
    schedule = zb.build_schedule(args.schedule, args.ranks, args.microbatches, costs=costs, **options)
    if slow:
        print(f"planned in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return schedule


def _costs(args: argparse.Namespace) -> zb.Costs:
    """The flags' Costs; CliError for a value not finite and >= 0 (--mem-w above M_B: the planners refuse it,
    the simulator counts it)."""
    values = {name: getattr(args, name) for name in _COSTS}
    for name, value in values.items():
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise CliError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    return zb.Costs(**{k: v for k, v in values.items() if v is not None})


def _print_m_w(schedule: zb.Schedule, costs: zb.Costs, unit: str) -> None:
    """Which M_W the peak assumed (and the limit planned under), and the peak of the same order were M_W
    = M_B: a W that waits holds M_W, so the peak moves with it."""
    plan = schedule.memory_plan or MemoryPlan.of(costs, schedule.num_stages)
    limit = "" if plan.limit is None else ", planned under " + " ".join(f"{x:g}" for x in plan.limit)
    print(f"assumed      {plan.assumed()}{limit}  (--mem-w: your model's M_W)")
    heavy = order_peaks(schedule, replace(costs, mem_w=costs.mem_b))  # the simulator's peak, not simulating
    print("at M_W = M_B " + " ".join(f"{m:g}" for m in heavy) + f"  (peak per rank of this order, {unit})")


def _check_costs_used(args: argparse.Namespace, schedule: zb.Schedule) -> None:
    """--bw for a schedule with no BW action, --fb with no F&B pair: refused unless its builder plans
    with the costs (CliError)."""
    if not args.from_csv and "costs" in options_of(args.schedule):
        return
    name = schedule.name or "this schedule"
    if not any(a.kind == "BW" for r in range(schedule.num_ranks) for a in schedule.rank_actions(r)):
        refuse_unused(args, ("bw",), f"{name} has no fused backward (BW) and plans without costs")
    if not schedule.has_pairs:
        refuse_unused(args, ("fb",), f"{name} has no overlapped F&B pair and plans without costs")


@contextlib.contextmanager
def _cycles_uncollected():
    """Python's cycle collector paused inside (restored after): planning at p = 256, m = 512 makes millions
    of small acyclic objects (actions, keys, events) that it walks again and again, 15-30% of plan's CPU time
    (``benchmarks/bench_schedule_core.py --plan-at``); reference counting still frees them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run(args: argparse.Namespace) -> int:
    with _cycles_uncollected():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.list:
        others = sorted(getattr(args, "given", set()) - {"list"})
        refuse_unused(args, others, "--list prints the schedule names only")
        print("\n".join(zb.SCHEDULES))
        print("(each also as NAME+fuse: a B right before its own W runs as one BW where no other rank waits)")
        return 0
    costs = _costs(args)
    schedule = _schedule(args, costs)
    _check_costs_used(args, schedule)
    timeline = zb.simulate(schedule, costs)
    name = schedule.name or (args.from_csv and f"from {args.from_csv}") or args.schedule
    print(f"{name}: p = {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
          f"m = {schedule.num_microbatches} microbatches")
    print(text_grid(timeline, width=args.width))
    print(f"makespan     {timeline.makespan:.6g}")
    print(f"bubble rate  {timeline.bubble_rate:.4f}")
    unit = "units of one stage's M_B" if args.mem_b is None else "the unit of --mem-b"
    print("peak memory  " + " ".join(f"{m:g}" for m in timeline.peak_memory) + f"  (per rank, {unit})")
    if any(a.kind == "W" for _, a in schedule):
        _print_m_w(schedule, costs, unit)
    if args.csv:
        schedule.to_csv(args.csv)
        print(f"wrote {args.csv}")
    if args.trace:
        write_chrome_trace(timeline, args.trace)
        print(f"wrote {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
