"""``python -m zbpp_lite compare``: run every schedule live and write one HTML report.

Every registered schedule, plus ZB-H1/ZB-H2 with backwards fused where the split buys nothing
(:data:`FUSED`), trains one model from one start on the same batches: with a core per rank as pinned
processes taking turns step by step (:func:`zbpp_lite.training.turns.train_in_turns`, so drift meets all
alike), else as threads. Builder options: ``stages_per_rank`` 2, ``memory_limit`` p (1F1B's peak),
``costs`` timed per stage first (:class:`~zbpp_lite.training.turns.OneCore`); what cannot run is listed
with the reason. The report (:mod:`.compare_report`) ranks them, trains the winner and says why it won.
``--platform gpu|tpu`` with too few such devices: simulated from costs profiled on one (PROFILED), then
run on CPU (REAL).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys

import zbpp_lite as zb

from ..analysis.profiling.timelines import timed_median
from ..schedules.builders import lookup, options_of
from ..schedules import strict_json
from ..schedules.costs import Costs
from ..training.data import load_data
from ..training.reference import ONE_RANK, one_rank_schedule
from ..training.train import TrainOptions, train
from ..training.turns import OneCore, train_in_turns
from . import CliError, add_output, given
from .compare_report import Comparison, html_report, summary_text
from .train import (add_model_arguments, add_platform_argument, add_ranks_as, check_model_arguments,
                    cost_table, curve_line, model_config, profile_json, profiled_costs, run_config, say_mode,
                    say_platform, setup_platform, threads_reason, written_lines)


BLOCKS_HELP = ("Transformer blocks of the one model every schedule trains (default: 8, or 2 per rank if "
               "more, so every schedule's stages get a block); a schedule with more stages than blocks is "
               "not run and is listed with why")


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare", help=help_text, description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", "-p", type=int, default=2, help="pipeline ranks = devices (default 2)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument("--steps", type=int, default=8, help="training steps per schedule, the first one untimed "
                                                        "(default 8)")
    p.add_argument("--schedules", default="", help="comma-separated names, any also as NAME+fuse "
                   "(default: every registered schedule, zb-h1+fuse, zb-h2+fuse)")
    add_model_arguments(p, BLOCKS_HELP)
    # the peer job's sizes: an action takes milliseconds, well above the executor's overhead per action
    p.set_defaults(d=128, heads=4)
    next(a for a in p._actions if a.dest == "batch").help = ("global batch, a multiple of --microbatches "
                                                              f"(default: digits {DIGITS_BATCH}, gpt 16)")
    p.add_argument("--learn-steps", type=int, default=None,
                   help="then train the fastest schedule this many steps and report its test accuracy, or "
                        f"the GPT's validation loss over the steps (default: digits 150, gpt {GPT_LEARN}; "
                        "0: skip)")
    add_ranks_as(p)
    add_output(p, "--out", default="compare.html", help="HTML report path (default compare.html)")
    add_output(p, "--json", help="also write the figures of every run as JSON")
    add_platform_argument(p)
    return p


DIGITS_BATCH = 256
"""compare's digits batch: the peer job's, so that an action takes milliseconds."""

GPT_LEARN = 600
"""compare --model gpt's default ``--learn-steps``: the winner's learning run, which the report draws."""

FUSED = ("zb-h1+fuse", "zb-h2+fuse")
"""Run by default beside every registered schedule: ZB-H1 and ZB-H2 with each B that sends to no
other rank fused with its W (:func:`zbpp_lite.schedules.fuse.fuse_adjacent`)."""


def _known(name: str) -> bool:
    """Whether ``build_schedule`` knows ``name`` (a registered name, or one + "+fuse")."""
    try:
        lookup(name)
    except ValueError:
        return False
    return True


def _required(name: str) -> list[str]:
    """A builder's required options, plus ``costs`` for builders that plan with them (zb-auto, zb-1p, ...)."""
    options = options_of(name)
    return [key for key, default in options.items() if default is inspect.Parameter.empty or key == "costs"]


def _build_one(name: str, args, blocks: int, costs) -> tuple:
    """``(schedule, None)`` built with compare's values for the builder's required options, or
    ``(None, why not)``."""
    known = {"stages_per_rank": 2, "memory_limit": float(args.ranks), "costs": costs}
    missing = [key for key in _required(name) if known.get(key) is None]
    try:
        if missing:
            raise ValueError(f"needs option(s) {missing} that compare cannot supply")
        options = {key: known[key] for key in _required(name)}
        schedule = zb.build_schedule(name, args.ranks, args.microbatches, **options)
        if blocks < schedule.num_stages:
            raise ValueError(f"{blocks} blocks cannot fill {schedule.num_stages} stages (use --blocks "
                             f"{schedule.num_stages})")
    except ValueError as e:
        return None, str(e).strip().splitlines()[0]
    return schedule, None


def _profile_all(device, names: list[str], args, blocks: int) -> list[dict]:
    """A JSON-ready dict per schedule simulated from stage costs timed on ``device`` (PROFILED)."""
    print(f"PROFILED on {device}: per-stage costs timed on this one device; every pipeline below is "
          f"simulated from them ({args.ranks} ranks, no transfer cost; nothing ran on {args.ranks} devices)",
          flush=True)
    by_shape: dict = {}
    m = args.microbatches
    schedules, _ = _build(names, args, blocks, lambda S: profiled_costs(device, S, m, args, blocks, by_shape),
                          "PROFILED ", "simulated")
    profiled, shown = [], set()
    for schedule in schedules:
        costs = profiled_costs(device, schedule.num_stages, m, args, blocks, by_shape)
        timeline = zb.simulate(schedule, costs)
        if schedule.num_stages not in shown:  # each stage count's cost table once
            shown.add(schedule.num_stages)
            print("\n".join(cost_table(costs, schedule.num_stages)))
        print(f"PROFILED {schedule.name:18s} S={schedule.num_stages:<2d} simulated makespan "
              f"{timeline.makespan * 1e3:7.3f} ms  bubble rate {timeline.bubble_rate:.3f}", flush=True)
        profiled.append({"schedule": schedule.name, "stages": schedule.num_stages,
                         **profile_json(device, costs, timeline)})
    return profiled


def blocks_of(args) -> int:
    """``--blocks``, else 8 or 2 per rank if more: a block for every stage of every schedule (2 per rank
    at most), as :data:`BLOCKS_HELP` says."""
    return args.blocks if args.blocks is not None else max(8, 2 * args.ranks)


def check_arguments(args) -> None:
    """Every flag checked before JAX starts (CliError); compare's own defaults filled in."""
    gpt = args.model == "gpt"
    if args.learn_steps is None:
        args.learn_steps = GPT_LEARN if gpt else 150
    if args.learn_steps == 0 and given(args, "eval_every"):  # the timed steps draw no curve
        raise CliError("--eval-every sets the learning run's validation curve, and --learn-steps 0 runs "
                       "none: drop --eval-every, or give --learn-steps N")
    if args.batch is None and not gpt:  # the GPT's: add_model_arguments' defaults
        args.batch = DIGITS_BATCH
    for flag, value, least in (("--ranks", args.ranks, 1), ("--microbatches", args.microbatches, 1),
                               ("--steps", args.steps, 2),
                               ("--learn-steps", args.learn_steps, 0)):
        if value < least:
            extra = " (the first step compiles and is not timed)" if flag == "--steps" else ""
            raise CliError(f"{flag} must be an integer >= {least}{extra}, got {value}")
    check_model_arguments(args, args.microbatches)


def _build(names: list[str], args, blocks: int, costs_for, label: str = "", verb: str = "run") -> tuple:
    """The schedules to run (``names``' order, cost planners last, planned with ``costs_for(stages)``)
    and, for the others, why not (printed as ``{label}{name} not {verb}: why``)."""
    schedules, notes = [], {}
    for name in sorted(names, key=lambda n: "costs" in _required(n)):
        costs = None
        if "costs" in _required(name):
            planned = zb.build_schedule(name, args.ranks, args.microbatches, costs=zb.Costs())
            # profiled only where the blocks fill its stages (else refused below, and nothing profiled)
            costs = costs_for(planned.num_stages) if blocks >= planned.num_stages else zb.Costs()
        schedule, why = _build_one(name, args, blocks, costs)
        if schedule is None:
            notes[name] = why
            print(f"{label}{name:18s} not {verb}: {why}", flush=True)
        else:
            schedules.append(schedule)
    return schedules, notes


def run(args) -> int:
    check_arguments(args)
    names = [n.strip() for n in args.schedules.split(",") if n.strip()] or [*zb.SCHEDULES, *FUSED]
    unknown = [n for n in names if not _known(n)]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise CliError(f"--schedules names {twice} more than once; name each schedule once")
    if unknown:
        raise CliError(f"unknown schedule(s) {unknown}; choose from: {', '.join(zb.SCHEDULES)} "
                       "(each also as NAME+fuse)")
    blocks = blocks_of(args)
    if blocks < 2 * args.ranks:
        print(f"note: --blocks {blocks} < {2 * args.ranks}: schedules with 2 stages per rank will be refused")
    devices, accelerator = setup_platform(args.ranks, args.platform)
    profiled = _profile_all(accelerator, names, args, blocks) if accelerator is not None else []
    why_threads = threads_reason(args, args.ranks, devices)
    use_processes = why_threads is None
    if args.platform is not None:
        say_platform("REAL runs", devices)
    say_mode("REAL runs", args.ranks, why_threads, ("; schedules take turns step by step", ""))

    by_stages: dict[int, Costs] = {}
    model, config = model_config(args, blocks), run_config(args, progress=sys.stderr.isatty())
    data = load_data(model, config)
    one = OneCore(model, config, args.microbatches, use_processes)

    def costs_for(num_stages: int) -> Costs:
        if num_stages not in by_stages:
            by_stages[num_stages] = one.costs(num_stages)
        return by_stages[num_stages]

    with one:
        schedules, notes = _build(names, args, blocks, costs_for)
        if not schedules:
            raise CliError("no schedule could be run: "
                           + "; ".join(f"{n}: {why}" for n, why in notes.items()))
        results, learned, one_rank = _run_all(schedules, args, model, config, data, devices, use_processes)
        for r in results:
            print(one_line(r), flush=True)
            memory = r.measured.measured_memory
            if memory is not None:
                print(f"{'':18s} activation memory peak per rank (bytes): measured "
                      f"{list(memory.peak_bytes)}  "
                      f"planned {[int(b) for b in r.measured.planned_peak_bytes]}", flush=True)
        references = _references(args, model, config, data, devices, one_rank, one)
    if args.learn_steps > 0 and learned is None and not use_processes:
        learned = _learn(results, args, model, config, data, devices)
    gpt_learned = learned is not None and args.model == "gpt"
    written = written_lines(learned, model, args.seed) if gpt_learned else None
    comparison = Comparison(results, notes, references, learned, args, blocks,
                            "processes" if use_processes else "threads", by_stages, written)
    print(summary_text(comparison), flush=True)
    if written is not None:
        print(f"{learned.schedule.name} after {len(learned.losses)} steps: {curve_line(learned)}\n{written}")
    with open(args.out, "w") as f:
        f.write(html_report(comparison))
    print(f"wrote {args.out}")
    if args.json:
        out = comparison.to_json()
        if accelerator is not None:
            out["profiled"] = profiled
        print(strict_json.write(args.json, out))
    return 0


def _run_all(schedules, args, model, config, data, devices, use_processes) -> tuple[list, object, object]:
    """Every schedule's TrainResult; in processes also the fastest's learning run continued to
    ``--learn-steps`` (else None, :func:`_learn`) and the one-rank reference trained in the same turns
    (:func:`~zbpp_lite.training.reference.one_rank_schedule`; None in threads)."""
    steps = args.steps
    if use_processes:
        def then(seconds: dict):
            if args.learn_steps <= 0:
                return None
            best = min((n for n in seconds if n != ONE_RANK), key=lambda n: timed_median(seconds[n]))
            print(f"training {best} on to {max(args.learn_steps, steps)} steps in all to see the model "
                  "learn", flush=True)
            return best, max(args.learn_steps - steps, 0)

        turns = _turn_order([*schedules, one_rank_schedule(args.ranks, args.microbatches)])
        out = train_in_turns(turns, steps, model=model, run=config, data=data, then=then)
        reference = out.pop(ONE_RANK)
        learned = out.then
        results = [out[s.name] for s in schedules]
        if learned is None and args.learn_steps > 0:  # no more steps than the comparison's: the winner
            learned = min(results, key=lambda r: timed_median(r.step_seconds))
        return results, learned, reference
    options, timed = TrainOptions(devices=devices, data=data), dataclasses.replace(config, eval_every=0)
    return [train(s, steps=steps, model=model, run=timed, options=options) for s in schedules], None, None


NEIGHBOURS = ("one-rank reference", "zb-h1+fuse", "zb-h1", "zb-h2+fuse", "zb-h2", "1f1b", "zb-auto", "zb-2p")
"""The middle of the turns' order: the schedules the report sets against 1f1b most often run
next to it (one step apart), where the machine's slow spells meet them alike, beside the one-rank
reference the speed-ups are taken against; each fused variant next to its plain schedule."""


def _turn_order(schedules: list) -> list:
    """The other schedules first, then :data:`NEIGHBOURS` in that order (those present)."""
    rank = {n: i for i, n in enumerate(NEIGHBOURS)}
    return sorted(schedules, key=lambda s: rank.get(s.name, -1))


def _references(args, model, config, data, devices, one_rank, one) -> dict:
    """Median step seconds of the two single-device references on one core: the whole batch as one
    jitted step accumulating the run's microbatches (``baseline``) and our executor on one rank
    (``one_rank``: from the turns, or trained here in threads), over as many timed steps as the
    pipelines'."""
    if one_rank is None:
        quiet = dataclasses.replace(config, check_grads=False, progress=False)
        one_rank = train(one_rank_schedule(1, args.microbatches), steps=args.steps, model=model, run=quiet,
                         options=TrainOptions(devices=devices[:1], data=data))
    whole = one.whole_batch(args.steps, devices[0])
    return {
        f"one device, whole batch (one jitted step, its m={args.microbatches} microbatches accumulated)":
            timed_median(whole),
        f"one device, our executor (m={args.microbatches} microbatches)": timed_median(one_rank.step_seconds),
    }


def _learn(results, args, model, config, data, devices):
    """Losses and held-out accuracy of the fastest schedule trained ``--learn-steps`` steps in threads."""
    best = min(results, key=lambda r: timed_median(r.step_seconds))
    print(f"training {best.schedule.name} for {args.learn_steps} steps to see the model learn", flush=True)
    run = dataclasses.replace(config, check_grads=False)
    return train(best.schedule, steps=args.learn_steps, model=model, run=run,
                 options=TrainOptions(devices=devices, data=data))


def one_line(r) -> str:
    return (f"{r.schedule.name:18s} S={r.schedule.num_stages:<2d} loss {r.losses[0]:.4f} -> "
            f"{r.losses[-1]:.4f}  "
            f"grad err {r.grad_max_rel_error:.1e}  step {timed_median(r.step_seconds) * 1e3:7.2f} ms  "
            f"makespan {r.measured.makespan * 1e3:7.2f} ms (plan {r.simulated.makespan * 1e3:7.2f})  "
            f"bubble {timed_median([t.bubble_rate for t in r.timelines]):.3f} (plan "
            f"{r.simulated.bubble_rate:.3f})")
