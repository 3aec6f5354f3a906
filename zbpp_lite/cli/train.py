"""``python -m zbpp_lite train``: train the digits Transformer with one schedule, live.

Sets up the devices itself (real accelerators when there are enough, else single-threaded
simulated CPU devices), prints every step's loss, the test accuracy, the gradient check against
the unpartitioned model, and the measured makespan and bubble rate beside the simulated ones for
the measured mean action costs. ``--json PATH`` writes all of it plus the measured trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import CliError


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, data and optimizer flags shared by ``train`` and ``compare``."""
    parser.add_argument("--d", type=int, default=32, help="model width (default 32; the PyTorch job uses 128)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--blocks", type=int, default=None, help="Transformer blocks (default: 4, or one per stage if more stages)")
    parser.add_argument("--batch", type=int, default=64, help="global batch, a multiple of --microbatches (default 64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of init and batch order (default 0)")
    parser.add_argument(
        "--holdout", type=float, default=0.2,
        help="fraction of the digits held out for test accuracy (default 0.2; 0 = the PyTorch job's batches, tested on all)",
    )


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help=help_text, description=__doc__.split("\n\n")[0])
    import zbpp_lite as zb

    p.add_argument("--schedule", default="zb-h1", help=f"schedule name: {', '.join(zb.SCHEDULES)} (default zb-h1)")
    p.add_argument("--schedule-csv", metavar="PATH", help="run a schedule read from PyTorch's CSV form instead of --schedule")
    p.add_argument("--ranks", "-p", type=int, default=2, help="pipeline ranks = devices (default 2)")
    p.add_argument("--microbatches", "-m", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="builder option, e.g. stages_per_rank=2 (repeatable)")
    add_model_arguments(p)
    p.add_argument("--init", metavar="NPZ", help="start from torch_pp_bench.py --save-init weights")
    p.add_argument("--json", metavar="PATH", help="write the results (and the measured trace) as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (there is none when stderr is not a terminal)")
    return p


def parse_options(pairs: list[str]) -> dict:
    """``["stages_per_rank=2", "memory_limit=4.5"]`` -> ``{"stages_per_rank": 2, "memory_limit": 4.5}``."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--option needs KEY=VALUE, got {pair!r}")
        for cast in (int, float):
            try:
                options[key.strip().replace("-", "_")] = cast(value)
                break
            except ValueError:
                continue
        else:
            options[key.strip().replace("-", "_")] = value
    return options


def resolve_schedule(args):
    """The Schedule the arguments ask for (validated), or CliError / ValueError naming the problem."""
    import zbpp_lite as zb

    if args.schedule_csv:
        if not os.path.exists(args.schedule_csv):
            raise CliError(f"--schedule-csv: no such file {args.schedule_csv!r}")
        schedule = zb.Schedule.from_csv(args.schedule_csv)
    else:
        schedule = zb.build_schedule(args.schedule, args.ranks, args.microbatches, **parse_options(args.option))
    return zb.validate(schedule)


def check_model_arguments(args, num_microbatches: int) -> None:
    """--steps, --d with --heads, --batch with the microbatches: checked before JAX starts."""
    if args.steps < 1:
        raise CliError(f"--steps must be >= 1, got {args.steps}")
    if args.d < 1 or args.heads < 1 or args.d % args.heads:
        raise CliError(f"--d {args.d} must be a positive multiple of --heads {args.heads}")
    from zbpp_lite.data import microbatch_size

    microbatch_size(args.batch, num_microbatches)  # ValueError: printed as one line


def check_sizes(args, schedule) -> int:
    """Check every size before JAX starts; return the number of blocks to use."""
    check_model_arguments(args, schedule.num_microbatches)
    blocks = args.blocks if args.blocks is not None else max(4, schedule.num_stages)
    if blocks < schedule.num_stages:
        raise CliError(
            f"--blocks {blocks} is fewer than the schedule's {schedule.num_stages} stages; every stage needs a block "
            f"(use --blocks {schedule.num_stages} or more)"
        )
    return blocks


def setup_devices(num_ranks: int):
    from zbpp_lite.devices import ensure_devices

    try:
        return ensure_devices(num_ranks)
    except RuntimeError as e:
        raise CliError(str(e)) from None


def run(args) -> int:
    schedule = resolve_schedule(args)
    blocks = check_sizes(args, schedule)
    if args.init and not os.path.exists(args.init):
        raise CliError(f"--init: no such file {args.init!r}")
    devices = setup_devices(schedule.num_ranks)

    from tqdm.auto import tqdm

    from zbpp_lite.train import train

    print(
        f"{schedule.name or 'custom'}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatches; model d={args.d} heads={args.heads} blocks={blocks}; "
        f"batch {args.batch}; devices {', '.join(str(d) for d in devices)}",
        flush=True,
    )

    def on_step(k: int, loss: float, timeline) -> None:
        tqdm.write(f"step {k:4d}  loss {loss:.4f}  makespan {timeline.makespan * 1e3:8.2f} ms  bubble rate {timeline.bubble_rate:.3f}")

    result = train(
        schedule, steps=args.steps, d=args.d, heads=args.heads, blocks=blocks, batch=args.batch, lr=args.lr,
        seed=args.seed, holdout=args.holdout, init=args.init, devices=devices, on_step=on_step,
        progress=args.progress and sys.stderr.isatty(),  # a bar only on a terminal
    )
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=1)
        print(f"wrote {args.json}")
    return 0


def report(result) -> str:
    """The closing lines: accuracy, gradient check, measured vs simulated."""
    m, s = result.measured, result.simulated
    held = "held-out" if result.config.get("holdout") else "all"
    lines = [
        f"test accuracy ({held} samples): {result.test_accuracy:.4f}   test loss {result.test_loss:.4f}",
        f"gradient check vs the unpartitioned model (step 0): max relative error {result.grad_max_rel_error:.2e}, "
        f"loss difference {result.loss_error:.2e}",
        f"{'':10}{'makespan':>14}{'bubble rate':>14}",
        f"{'measured':10}{m.makespan * 1e3:>11.2f} ms{m.bubble_rate:>14.4f}",
        f"{'simulated':10}{s.makespan * 1e3:>11.2f} ms{s.bubble_rate:>14.4f}   (measured mean action costs)",
        f"measured / simulated makespan: {m.makespan / s.makespan:.3f}",
    ]
    return "\n".join(lines)
