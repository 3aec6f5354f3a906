"""``python -m zbpp_lite adapt``: measure a run, find where its bubbles come from, remove them, train.

Trains a few ZB-H1 steps (``--imbalance FACTOR``: FACTOR times the blocks on the last stage), profiles
stage costs, attributes each idle gap, rebalances layers and re-plans with zb-auto from measured costs,
then trains ``--steps`` steps, re-planning when costs drift. ``--json PATH`` writes ``before``/``after``
(measured ``makespan``, ``bubble_rate``), plan changes and attribution; ``--html PATH`` the figures.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from ..schedules import strict_json
from ..training.adapt import AdaptOptions, adapt, adapt_settings
from ..training.model import ModelConfig, RunConfig
from ..viz.attribution import attribution_figure
from . import CliError, add_output, refuse_unused
from .train import (add_model_arguments, add_ranks_as, check_model_arguments, say_mode, setup_devices,
                    threads_reason)


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser("adapt", help=help_text, description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--ranks", "-p", type=int, default=2, help="pipeline ranks = devices, >= 2 (default 2)")
    add("--microbatches", "-m", type=int, default=8, help="microbatches per step (default 8)")
    add("--steps", type=int, default=20, help="training steps after adapting, >= 2 (default 20)")
    add("--imbalance", type=float, default=1.0, metavar="FACTOR",
        help="the original last stage holds FACTOR times the blocks of each other stage (>= 1; default 1: "
             "even)")
    add("--profile-steps", type=int, default=6, help="ZB-H1 steps measured before adapting, >= 2 (default 6)")
    add("--memory-limit", type=float, default=None, help="zb-auto's per-rank activation limit, units of M_B "
        "(default p)")
    add("--every", type=int, default=10, help="online: steps between checks of the measured costs "
        "(default 10)")
    add("--threshold", type=float, default=0.15, help="online: drift that counts, fraction of a stage's cost "
        "(default 0.15)")
    add("--patience", type=int, default=2, help="online: drifted checks in a row before re-planning "
        "(default 2)")
    add("--min-gain", type=float, default=0.03, help="adopt a change only if predicted this much faster "
        "(default 0.03)")
    add("--margin", type=float, default=0.1, help="a stage is slow when its cost exceeds the mean by this "
        "fraction (default 0.1)")
    add("--no-rebalance", dest="rebalance", action="store_false", help="keep the original partition")
    add("--no-replan", dest="replan_schedule", action="store_false", help="keep ZB-H1 (no zb-auto re-plan)")
    add("--no-online", dest="online", action="store_false", help="no online re-planning while training")
    add("--no-control", dest="control", action="store_false",
        help="no A/A control (the original plan run twice in turns to measure the noise)")
    add("--confidence", type=float, default=0.95,
        help="of the intervals that judge measured gains and drift (default 0.95)")
    add_ranks_as(p)
    add_model_arguments(p, gpt=False)
    # actions of milliseconds, so compute, not dispatch, sets the stage costs
    p.set_defaults(d=128, batch=256)
    helps = {"d": "model width (default 128 here, so that compute sets the stage costs)",
             "batch": "global batch, a multiple of --microbatches (default 256 here)",
             "blocks": "Transformer blocks (default: 2 per stage, about 2 x FACTOR on the last)"}
    for action in p._actions:
        action.help = helps.get(action.dest, action.help)
    add_output(p, "--json", help="write before / after, the changes and the attribution as JSON")
    add_output(p, "--html", help="write the attribution figures (before and after) as HTML")
    return p


OFF_FLAGS = {"online": "--no-online", "replan_schedule": "--no-replan", "rebalance": "--no-rebalance"}
UNUSED = (  # (parts all turned off, the flags they leave unused, why)
    (("online",), ("every", "threshold", "patience"), "nothing re-plans online, so no drift is checked"),
    (("online", "replan_schedule"), ("memory_limit",), "zb-auto never plans, so it takes no memory limit"),
    (("online", "replan_schedule", "rebalance"), ("min_gain",), "no change is tried, so none needs a gain"),
)
"""Flags a command line may not give when every part that uses them is off (:func:`_settings`)."""


def _settings(args) -> tuple:
    """Every argument checked before JAX starts (a ValueError names the bad one): the options, model and
    run configs (:func:`~zbpp_lite.training.adapt.adapt_settings`)."""
    if args.ranks < 2:
        raise CliError(f"--ranks must be >= 2 (a pipeline to balance), got {args.ranks}")
    if args.microbatches < 1:
        raise CliError(f"--microbatches must be >= 1, got {args.microbatches}")
    if not args.imbalance >= 1:
        raise CliError("--imbalance must be >= 1 (1 = even stages; 2 = the last stage holds twice the "
                       f"blocks), got {args.imbalance}")
    if args.steps < 2 or args.profile_steps < 2:
        raise CliError("--steps and --profile-steps must be >= 2 (each phase's first step is not timed), "
                       f"got {args.steps}, {args.profile_steps}")
    check_model_arguments(args, args.microbatches)
    for off, dests, why in UNUSED:
        if not any(getattr(args, part) for part in off):
            refuse_unused(args, dests, f"{' '.join(OFF_FLAGS[part] for part in off)}: {why}")
    names = {f.name for config in (AdaptOptions, ModelConfig, RunConfig) for f in fields(config)}
    return adapt_settings(**{k: v for k, v in vars(args).items() if k in names})


def run(args) -> int:
    options, model, run = _settings(args)
    devices = setup_devices(args.ranks)
    why_threads = threads_reason(args, args.ranks, devices)
    say_mode("REAL run", args.ranks, why_threads, ("; the plans take turns step by step and a change is kept "
                                                   "only when measured faster beyond the run's noise",
                                                   ", and changes are adopted on their predicted gain"))
    print(f"adapt: {args.ranks} ranks, {args.microbatches} microbatches, imbalance {args.imbalance:g}; "
          f"model d={args.d} heads={args.heads} blocks={model.blocks}; batch {args.batch}; devices "
          f"{', '.join(str(d) for d in devices)}", flush=True)

    def on_step(phase: str, k: int, loss: float, timeline) -> None:
        print(f"{phase:18} step {k:4d}  loss {loss:.4f}  makespan {timeline.makespan * 1e3:8.2f} ms  "
              f"bubble rate {timeline.bubble_rate:.3f}", flush=True)

    result = adapt(replace(options, processes=why_threads is None), model=model, run=run,
                   devices=None if why_threads is None else devices, on_step=on_step)
    print(f"\nmeasured before adapting (ZB-H1, original partition):\n{result.profile.table()}\n"
          f"{result.attribution.table()}\n\n{result.report()}")
    print(f"test accuracy: {result.test_accuracy:.4f}   test loss {result.test_loss:.4f}")
    if args.json:
        print(strict_json.write(args.json, result.to_json()))
    if args.html:
        _write_html(result, args.html)
        print(f"wrote {args.html}")
    return 0


def _write_html(result, path: str) -> None:
    before = attribution_figure(result.attribution, result.before.measured,
                                "before: ZB-H1 on the original partition")
    after = attribution_figure(result.attribution_after, result.after.measured,
                               "after: rebalanced and re-planned")
    with open(path, "w") as f:
        f.write("<html><head><meta charset='utf-8'><title>zbpp_lite adapt</title></head><body>\n")
        f.write(before.to_html(full_html=False, include_plotlyjs=True))
        f.write(after.to_html(full_html=False, include_plotlyjs=False))
        f.write("</body></html>\n")
