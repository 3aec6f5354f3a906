"""``python -m zbpp_lite train``: train the digits Transformer (or ``--model gpt``, a byte-level GPT on
Python's own source) with one schedule, live.

Devices: accelerators when there are enough, else simulated CPU ones (``--platform`` picks). Prints
each step's loss, test accuracy, the gradient check against the unpartitioned model, and measured
makespan and bubble rate beside the simulated ones; ``--json PATH`` writes it all plus the trace.
``--platform gpu|tpu`` with fewer such devices than ranks (one at least): stages are timed on one
accelerator and the pipeline simulated (PROFILED), then trained on simulated CPU devices (REAL).
"""

# JAX-importing modules are imported inside functions: the parser and first checks run before JAX.
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import zbpp_lite as zb

from ..analysis.profiling.timelines import timed_steps
from ..runtime import devices as dev  # a module: tests stand a CPU device in for an accelerator
from ..runtime.processes import allowed_cores
from ..schedules import strict_json
from ..viz.memory import memory_lines
from . import CliError, add_output, check_against_csv, refuse_unused
from .join import add_join_arguments, run_joined, wants_join

THREADS_NOTE = ("note: ranks run as threads of one process ({}); on shared cores a waiting rank lends its "
                "core to the others, so measured bubbles look smaller than on real devices")
PROCESSES_NOTE = "{}: one process per rank, each pinned to its own core ({} ranks)"


BLOCKS_HELP = ("Transformer blocks (default: 4, or one per stage if the schedule has more; fewer than its "
               "stages is refused)")


GPT_FLAGS = {"context": "--context", "dropout": "--dropout", "bf16": "--bf16", "remat": "--remat",
             "eval_every": "--eval-every"}
"""The GPT's own flags (dest: flag), refused with the digits."""

GPT_STEPS = 1500
"""``train --model gpt``'s default steps. Measured (the default size, 2 shared cores): 320 CPU seconds in
all processes, so about 160 s on 2 idle cores plus the ranks' idle time (a bubble rate near 0.1); the
validation loss then 1.848 nats/byte, 42.9% below the unigram baseline 3.237 (5.605 before training)."""

DEFAULTS = {"digits": {"d": 32, "heads": 4, "batch": 64, "lr": 1e-3, "steps": 30},
            "gpt": {"d": 128, "heads": 4, "context": 128, "dropout": 0.1, "batch": 16, "lr": 3e-3,
                    "steps": GPT_STEPS}}
"""Each model's defaults for the flags left unset (None); a command's own ``set_defaults`` come first.
The GPT learns with a smaller batch and a larger rate (bench_gpt_learns.py measured them)."""


def add_model_arguments(parser: argparse.ArgumentParser, blocks_help: str = BLOCKS_HELP,
                        gpt: bool = True) -> None:
    """Model, data and optimizer flags of ``train``, ``compare`` and ``adapt`` (each ``set_defaults``);
    ``blocks_help``: how the command picks the blocks; ``gpt``: offer ``--model gpt`` and its flags."""
    add = parser.add_argument
    if gpt:
        add("--model", choices=("digits", "gpt"), default="digits",
            help="digits: the digits Transformer classifier; gpt: a byte-level GPT (tied embedding, "
                 "dropout) on this Python's standard library source, split by file (default %(default)s)")
        add("--context", type=int, default=None, help="gpt: bytes per sequence (default 128)")
        add("--dropout", type=float, default=None, help="gpt: dropout rate (default 0.1; 0: none)")
        add("--bf16", action="store_true", help="gpt: compute in bfloat16 (parameters and sums float32)")
        add("--remat", action="store_true", help="gpt: each block under jax.checkpoint (B recomputes it)")
        add("--eval-every", type=int, default=None, metavar="N",
            help="gpt: the validation loss every N steps, drawn over the steps in the report (default: "
                 "a tenth of the steps, compare's learning run's; 0: at the end only)")
    add("--d", type=int, default=None,
        help="model width (default: digits 32, the PyTorch job uses 128; gpt 128)")
    add("--heads", type=int, default=None, help="attention heads (default 4)")
    add("--blocks", type=int, default=None, help=blocks_help)
    add("--batch", type=int, default=None,
        help="global batch, a multiple of --microbatches (default: digits 64, gpt 16 sequences)")
    add("--lr", type=float, default=None, help="AdamW learning rate (default: digits 0.001, gpt 0.003)")
    add("--seed", type=int, default=0, help="seed of init and batch order (default %(default)s)")
    add("--holdout", type=float, default=0.2, help="fraction of the digits held out for test accuracy "
        "(default %(default)s; 0 = the PyTorch job's batches, tested on all); gpt: of the files, validation")


def add_platform_argument(parser: argparse.ArgumentParser) -> None:
    """``--platform``, shared by ``train`` and ``compare``."""
    parser.add_argument(
        "--platform", choices=dev.PLATFORMS, default=None,
        help="devices to run on: cpu = simulated CPU devices; gpu / tpu = that platform's devices, or, with "
             "fewer than the ranks, per-stage costs profiled on one of them and the pipeline simulated from "
             "them, beside a real run on simulated CPU devices (default: accelerators when there are enough, "
             "else CPU)")


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help=help_text, description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--schedule", default="zb-h1", help=f"schedule name: {', '.join(zb.SCHEDULES)} (default zb-h1)")
    add("--schedule-csv", metavar="PATH",
        help="run a schedule read from PyTorch's CSV form instead of --schedule")
    add("--ranks", "-p", type=int, default=2, help="pipeline ranks = devices (default 2)")
    add("--microbatches", "-m", type=int, default=4, help="microbatches per step (default 4)")
    add("--steps", type=int, default=None,
        help=f"training steps (default: digits 30, gpt {GPT_STEPS}: about 3 minutes on 2 cores)")
    add("--option", action="append", default=[], metavar="KEY=VALUE",
        help="builder option, e.g. stages_per_rank=2 (repeatable)")
    add_model_arguments(p)
    add("--init", metavar="NPZ", help="start from torch_pp_bench.py --save-init weights")
    add_output(p, "--json", help="write the results (and the measured trace) as JSON")
    add_output(p, "--html", help="write the report as one HTML page: the timeline planned over measured and, "
               "with --model gpt, the loss over the steps and what the model writes")
    add("--no-progress", dest="progress", action="store_false",
        help="no progress bar (there is none when stderr is not a terminal)")
    add_ranks_as(p)
    add("--max-grad-norm", type=float, default=None, metavar="NORM",
        help="clip gradients to this global norm, skip steps with NaN/Inf; the optimizer step then runs in "
             "the rank threads, synchronously unless --post-validation (arXiv 2401.10241 section 4)")
    add("--post-validation", action="store_true",
        help="with --max-grad-norm: step speculatively on the partial norm, validate, roll back if wrong")
    add("--spmd", action="store_true", help="run the schedule compiled into one SPMD program (lockstep "
        "ticks, zbpp_lite.runtime.spmd) instead of one thread per rank")
    add("--overlap", action="store_true", help="with --spmd: each tick sends what the tick before made "
        "beside its own switch, so asynchronous collectives may overlap compute (one more tick a link)")
    add_platform_argument(p)
    add_join_arguments(p)
    p.set_defaults(_parser=p)
    return p


def model_config(args, blocks: int):
    """The job's :class:`~zbpp_lite.training.model.ModelConfig` (``--model gpt``: a ``GPTConfig``) from
    the model flags (:func:`check_model_arguments` fills the defaults)."""
    from ..training.model import GPTConfig, ModelConfig

    if getattr(args, "model", "digits") != "gpt":
        return ModelConfig(d=args.d, heads=args.heads, blocks=blocks, seed=args.seed)
    return GPTConfig(d=args.d, heads=args.heads, blocks=blocks, seed=args.seed, context=args.context,
                     dropout=args.dropout, dtype="bfloat16" if args.bf16 else "float32", remat=args.remat)


def run_config(args, **more):
    """The job's :class:`~zbpp_lite.training.model.RunConfig` from the data and optimizer flags."""
    from ..training.model import RunConfig

    return RunConfig(batch=args.batch, lr=args.lr, seed=args.seed, holdout=args.holdout,
                     eval_every=getattr(args, "eval_every", None) or 0, **more)


def train_spmd_command(args, schedule, blocks: int, devices, process: int = 0) -> int:
    """``train --spmd`` (:func:`zbpp_lite.training.spmd.train_spmd`); process 0 prints, writes JSON."""
    import jax

    from ..runtime.stages import StagedModel
    from ..training.data import load_data
    from ..training.model import build_parts
    from ..training.spmd import train_spmd

    config = model_config(args, blocks)
    model = StagedModel(build_parts(config), schedule.num_stages)
    data = load_data(config, run_config(args))
    batches = [data.batch(k, args.batch) for k in range(args.steps)]

    def on_step(k: int, loss: float, seconds: float) -> None:
        if process == 0:
            print(f"step {k:4d}  loss {loss:.4f}  {seconds * 1e3:8.2f} ms (SPMD, lockstep)", flush=True)

    result = train_spmd(schedule, model, model.params, batches, args.lr, devices=devices, on_step=on_step,
                        overlap=args.overlap)
    if process == 0:
        timed = sorted(timed_steps(result.step_seconds))
        print(grad_check_line(result, check_tolerance(args)))
        print(f"SPMD: median step {timed[len(timed) // 2] * 1e3:.2f} ms over {len(timed)} step(s); "
              f"{result.lockstep.makespan:g} lockstep ticks of the slowest action each (units of T_F)"
              + (", each sending what the tick before made" if args.overlap else ""))
        if args.json:
            data = {**result.to_json(schedule), "processes": jax.process_count()}
            print(strict_json.write(args.json, data))
    return grad_check_status(result, check_tolerance(args), process if jax.process_count() > 1 else None)


def describe_model(args) -> str:
    """E.g. ``d=32 heads=4`` (digits) or ``gpt d=128 heads=4 context=128 dropout 0.1 float32``."""
    if getattr(args, "model", "digits") != "gpt":
        return f"d={args.d} heads={args.heads}"
    return (f"gpt d={args.d} heads={args.heads} context={args.context} dropout {args.dropout:g} "
            f"{'bfloat16' if args.bf16 else 'float32'}{' remat' if args.remat else ''}")


def check_tolerance(args) -> float:
    """Step 0's gradient check tolerance for the run's compute dtype (``--bf16``:
    :func:`~zbpp_lite.training.reference.grad_check_tolerance`)."""
    from ..training.reference import grad_check_tolerance

    return grad_check_tolerance("bfloat16" if getattr(args, "bf16", False) else "float32")


def grad_check_line(result, tolerance: float) -> str:
    """The report's line on step 0's check against the unpartitioned model, with the tolerance."""
    return ("gradient check vs the unpartitioned model (step 0): max relative error "
            f"{result.grad_max_rel_error:.2e}, loss difference {result.loss_error:.2e} (tolerance "
            f"{tolerance:g}, relative)")


def grad_check_status(result, tolerance: float, process: int | None = None) -> int:
    """0, or 1 after an ``error:`` line on stderr (naming ``process`` where given) when step 0's gradient
    check failed by ``tolerance`` (:func:`~zbpp_lite.training.reference.grad_check_failure`)."""
    from ..training.reference import grad_check_failure

    failure = grad_check_failure(result.grad_max_rel_error, result.loss_error, result.losses[0], tolerance)
    if failure is None:
        return 0
    who = f"process {process}: " if process is not None else ""
    print(f"error: {who}{failure}", file=sys.stderr, flush=True)
    return 1


def parse_options(pairs: list[str]) -> dict:
    """``["stages_per_rank=2", "memory_limit=4.5"]`` -> ``{"stages_per_rank": 2, "memory_limit": 4.5}``."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--option needs KEY=VALUE, got {pair!r}")
        for cast in (int, float, str):
            try:
                options[key.strip().replace("-", "_")] = cast(value)
                break
            except ValueError:
                continue
    return options


def resolve_schedule(args):
    """The Schedule the arguments ask for (validated), or CliError / ValueError naming the problem."""
    if not args.schedule_csv:
        options = parse_options(args.option)
        return zb.validate(zb.build_schedule(args.schedule, args.ranks, args.microbatches, **options))
    if not os.path.isfile(args.schedule_csv):
        raise CliError(f"--schedule-csv: no such file {args.schedule_csv!r} (a CSV file is expected)")
    schedule = zb.validate(zb.Schedule.from_csv(args.schedule_csv))
    check_against_csv(args, "--schedule-csv", schedule, ("schedule", "option"))
    return schedule


def check_model_arguments(args, num_microbatches: int) -> None:
    """--steps, --d with --heads, --batch with the microbatches, the GPT's flags (refused with the digits),
    --ranks-as processes against flags that need threads: checked, and the model's defaults filled in,
    before JAX starts."""
    gpt = getattr(args, "model", "digits") == "gpt"
    if not gpt:
        refuse_unused(args, [d for d in GPT_FLAGS if hasattr(args, d)], "--context, --dropout, --bf16, "
                      "--remat and --eval-every set the GPT (--model gpt)")
    # the GPT's own flags stay None with the digits (launch passes only what differs from the defaults)
    for dest, value in DEFAULTS["gpt" if gpt else "digits"].items():
        if getattr(args, dest, 0) is None:
            setattr(args, dest, value)
    _refuse_processes(args, _flags_need_threads(args))  # after the defaults: --steps may have been None
    if gpt and getattr(args, "eval_every", 0) is None:  # 10 points over the run drawn (each ~1 CPU s)
        args.eval_every = getattr(args, "learn_steps", args.steps) // 10
    if gpt and (args.context < 1 or not 0 <= args.dropout < 1 or args.eval_every < 0):
        raise CliError(f"--context must be >= 1, --dropout in [0, 1) and --eval-every >= 0, got "
                       f"{args.context}, {args.dropout}, {args.eval_every}")
    if gpt and (getattr(args, "init", None) or getattr(args, "spmd", False)):
        raise CliError("--model gpt starts from its own init and draws dropout keys, which --spmd's loop "
                       "does not pass yet: drop --init / --spmd")
    if args.steps < 1:
        raise CliError(f"--steps must be >= 1, got {args.steps}")
    if getattr(args, "blocks", None) is not None and args.blocks < 1:
        raise CliError(f"--blocks must be >= 1, got {args.blocks}")
    if args.seed < 0:
        raise CliError(f"--seed must be an integer >= 0 (NumPy's generators take no negative seed), got "
                       f"{args.seed}")
    if args.d < 1 or args.heads < 1 or args.d % args.heads:
        raise CliError(f"--d {args.d} must be a positive multiple of --heads {args.heads}")
    from ..runtime.stages import microbatch_size

    microbatch_size(args.batch, num_microbatches)  # ValueError: printed as one line


def check_sizes(args, schedule) -> int:
    """Sizes and the optimizer/SPMD flags checked before JAX starts; returns the number of blocks."""
    check_model_arguments(args, schedule.num_microbatches)
    blocks = args.blocks if args.blocks is not None else max(4, schedule.num_stages)
    if blocks < schedule.num_stages:
        raise CliError(f"--blocks {blocks} is fewer than the schedule's {schedule.num_stages} stages; every "
                       f"stage needs a block (use --blocks {schedule.num_stages} or more)")
    norm = getattr(args, "max_grad_norm", None)
    if getattr(args, "post_validation", False) and norm is None:
        raise CliError("--post-validation validates a clipped step: give --max-grad-norm N too")
    if norm is not None and not norm > 0:  # also NaN
        raise CliError(f"--max-grad-norm must be a number > 0, got {norm}")
    if getattr(args, "spmd", False) and (norm is not None or args.init):
        raise CliError("--spmd trains plain AdamW from the model's own init: drop --max-grad-norm / "
                       "--post-validation / --init")
    if getattr(args, "overlap", False) and not getattr(args, "spmd", False):
        raise CliError("--overlap changes the SPMD program's ticks: give --spmd too")
    if getattr(args, "spmd", False) and (getattr(args, "threads", False) or getattr(args, "ranks_as", None)):
        flag = "--threads" if getattr(args, "threads", False) else "--ranks-as"
        raise CliError(f"--spmd runs one SPMD program, not a thread or process per rank: drop {flag}")
    return blocks


def check_launchable(args) -> None:
    """Train options ``launch`` cannot honour, refused with the flags named (CliError)."""
    unsupported = [flag for flag, on in (("--init", bool(args.init)),
                                          ("--platform", getattr(args, "platform", None) is not None),
                                          ("--threads", getattr(args, "threads", False)),
                                          ("--ranks-as threads",
                                           getattr(args, "ranks_as", None) == "threads")) if on]
    if unsupported:
        raise CliError(f"launch trains from the model's own init on the processes' CPU devices, "
                       f"a process per rank: {', '.join(unsupported)} is not supported there (drop it, or "
                       "run train in one process)")


def setup_devices(num_ranks: int, platform: str | None = None):
    try:
        return dev.ensure_devices(num_ranks, platform=platform)
    except RuntimeError as e:
        raise CliError(str(e)) from None


def setup_platform(num_ranks: int, platform: str | None):
    """``(devices, accelerator)``: the real run's devices and the one to profile on (None unless
    ``platform`` is gpu/tpu with 1 <= devices < ranks; the real run then gets simulated CPU devices)."""
    if platform is None:
        return setup_devices(num_ranks), None
    if not dev.backend_started():  # CPU devices beside the accelerator: asked for before JAX starts
        os.environ["XLA_FLAGS"] = dev.cpu_device_flags(num_ranks)
    accelerators = [] if platform == "cpu" else dev.platform_devices(platform)
    if platform == "cpu" or len(accelerators) >= num_ranks or not accelerators:  # none: CliError says so
        devices, accelerator = setup_devices(num_ranks, platform), None
    else:
        devices, accelerator = setup_devices(num_ranks, "cpu"), accelerators[0]
    return devices, accelerator


def say_platform(what: str, devices) -> None:
    """Prints e.g. ``REAL run on 2 simulated CPU devices``."""
    kind = "simulated CPU" if devices[0].platform == "cpu" else devices[0].platform.upper()
    print(f"{what} on {len(devices)} {kind} devices", flush=True)


def say_mode(what: str, num_ranks: int, why_threads: str | None, tails: tuple[str, str] = ("", "")) -> None:
    """One process per rank (``what``: "REAL run"), or why the ranks are threads; each with its tail."""
    line = PROCESSES_NOTE.format(what, num_ranks) + tails[0] if why_threads is None else \
        THREADS_NOTE.format(why_threads) + tails[1]
    print(line, flush=True)


def plan_with_job_memory(args, schedule, blocks: int, say=print):
    """The schedule to run: a name through :func:`~zbpp_lite.training.train.job_plan` (a planner that
    takes ``costs`` plans with this job's M_B, M_W in bytes; ``--option memory_limit=...`` with it is
    refused), a CSV's unchanged. ``say`` prints the bytes (None: silent). Call once JAX has its devices."""
    from ..schedules.builders.greedy import HeavyW
    from ..training.train import job_plan

    if args.schedule_csv:
        return schedule
    try:
        planned, costs = job_plan(args.schedule, args.ranks, args.microbatches, parse_options(args.option),
                                  model_config(args, blocks), run_config(args))
    except HeavyW as e:  # the planner's advice is for the API: say what the command line can do
        raise CliError(f"{e.what}: {args.schedule} plans W apart from B, and "
                       "under --remat B recomputes what W needs and holds it until W; train --remat with a "
                       "schedule that fuses B and W (--schedule 1f1b) or drop --remat") from None
    if costs is not None and say is not None:
        mem_b, mem_w = ([int(v) for v in mem] for mem in (costs.mem_b, costs.mem_w))  # Costs holds floats
        say(f"{planned.name}: planned with this job's activation memory per stage, M_B {mem_b} and "
            f"M_W {mem_w} bytes", flush=True)
    return planned


def profiled_costs(device, num_stages: int, num_microbatches: int, args, blocks: int, by_shape: dict):
    """The job's stage costs cut into ``num_stages`` stages, timed on ``device``; one profile per
    (stages, microbatch size), cached in ``by_shape``."""
    from ..analysis.profiling.device import profile_stage_costs
    from ..runtime.stages import microbatch_size
    from ..training.train import job_microbatch

    shape = (num_stages, microbatch_size(args.batch, num_microbatches))
    if shape not in by_shape:
        job = job_microbatch(num_stages, num_microbatches, model_config(args, blocks), run_config(args))
        by_shape[shape] = profile_stage_costs(*job, device)
    return by_shape[shape]


def cost_table(costs, num_stages: int) -> list[str]:
    """A header and one line of T_F, T_B, T_W (ms) per stage."""
    return [f"{'stage':>7}{'T_F (ms)':>11}{'T_B (ms)':>11}{'T_W (ms)':>11}",
            *(f"{s:>7}{costs.f[s] * 1e3:>11.3f}{costs.b[s] * 1e3:>11.3f}{costs.w[s] * 1e3:>11.3f}"
              for s in range(num_stages))]


def profile_json(device, costs, timeline) -> dict:
    return {"device": str(device), "costs_seconds": {k: list(getattr(costs, k)) for k in "fbw"},
            "simulated": {"makespan": timeline.makespan, "bubble_rate": timeline.bubble_rate}}


def run(args) -> int:
    schedule = resolve_schedule(args)
    blocks = check_sizes(args, schedule)
    if wants_join(args):  # one process of a run on several hosts (docs/OPERATIONS.md "Several hosts")
        check_launchable(args)
        return run_joined(args, schedule, args._parser)
    refuse_unused(args, ("timeout", "heartbeat"), "--timeout and --heartbeat bound the waits of a run on "
                  "several hosts (with --coordinator, --num-processes, --process-id)")
    if args.init and not os.path.exists(args.init):
        raise CliError(f"--init: no such file {args.init!r}")
    devices, accelerator = setup_platform(schedule.num_ranks, args.platform)
    schedule = plan_with_job_memory(args, schedule, blocks)
    profiled = None
    if accelerator is not None:
        costs = profiled_costs(accelerator, schedule.num_stages, schedule.num_microbatches, args, blocks, {})
        simulated = zb.simulate(schedule, costs)
        print("\n".join([
            f"PROFILED on {accelerator}: T_F, T_B, T_W per stage, each stage timed alone on this one device",
            *cost_table(costs, schedule.num_stages),
            f"PROFILED on {accelerator}: simulated pipeline from measured per-stage costs "
            f"({schedule.num_ranks} ranks, no transfer cost; nothing ran on {schedule.num_ranks} devices): "
            f"makespan {simulated.makespan * 1e3:.3f} ms, bubble rate {simulated.bubble_rate:.4f}"]),
          flush=True)
        profiled = profile_json(accelerator, costs, simulated)
    if args.platform is not None:
        say_platform("REAL run", devices)
    print(f"{schedule.name or 'custom'}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
          f"{schedule.num_microbatches} microbatches; model {describe_model(args)} blocks={blocks}; "
          f"batch {args.batch}; devices {', '.join(str(d) for d in devices)}", flush=True)
    if args.spmd:
        return train_spmd_command(args, schedule, blocks, devices)
    result = _train(args, schedule, blocks, devices)
    from . import compare_report

    print(report(result, check_tolerance(args)))
    written = written_lines(result, model_config(args, blocks), args.seed) if args.model == "gpt" else None
    if written is not None:
        print(f"{curve_line(result)}\n{written}" if result.validation else written)
    if args.html:
        with open(args.html, "w") as f:
            f.write(compare_report.run_page(result, report(result, check_tolerance(args)), written))
        print(f"wrote {args.html}")
    if args.json:
        data = result.to_json()
        if profiled is not None:
            data["profiled"] = profiled
        print(strict_json.write(args.json, data))
    return grad_check_status(result, check_tolerance(args))


def _train(args, schedule, blocks: int, devices):
    """Train in pinned processes (:func:`~zbpp_lite.training.turns.train_in_turns`) or threads."""
    from tqdm.auto import tqdm

    from ..training.train import TrainOptions, train
    from ..training.turns import train_in_turns

    def on_step(k: int, loss: float, timeline) -> None:
        tqdm.write(f"step {k:4d}  loss {loss:.4f}  makespan {timeline.makespan * 1e3:8.2f} ms  "
                   f"bubble rate {timeline.bubble_rate:.3f}")
        if loss != loss or abs(loss) == float("inf"):
            tqdm.write(f"step {k:4d}  the loss is not finite: the run diverged (a smaller --lr may help)")

    run = run_config(args, init=args.init, progress=args.progress and sys.stderr.isatty(),  # a bar: on a tty
                     max_grad_norm=args.max_grad_norm, post_validation=args.post_validation)
    model = model_config(args, blocks)
    why_threads = threads_reason(args, schedule.num_ranks, devices)
    say_mode("REAL run", schedule.num_ranks, why_threads)
    if why_threads is not None:
        return train(schedule, steps=args.steps, model=model, run=run,
                     options=TrainOptions(devices=devices, on_step=on_step))
    named = dataclasses.replace(schedule, name=schedule.name or "custom")
    return train_in_turns([named], args.steps, model=model, run=run,
                          on_step=lambda name, k, loss, timeline: on_step(k, loss, timeline))[named.name]


def add_ranks_as(parser: argparse.ArgumentParser) -> None:
    """``--ranks-as threads|processes`` (and ``--threads``, its older spelling of ``threads``): how the
    ranks of ``train``, ``compare`` and ``adapt`` run; :func:`threads_reason` decides and says why."""
    parser.add_argument("--ranks-as", choices=("threads", "processes"), default=None,
                        help="threads: one process, a thread per rank; processes: a process per rank, each "
                             "pinned to its own core (default: processes on a CPU with a core per rank, "
                             "else threads; every run prints which and why)")
    parser.add_argument("--threads", action="store_true", help="the same as --ranks-as threads")


def threads_reason(args, num_ranks: int, devices) -> str | None:
    """Why the ranks run as threads, or None for a pinned process each (CPU, a core per rank, two steps or
    more). Raises CliError for ``--ranks-as processes`` where processes cannot run, naming
    why, and for ``--threads`` beside ``--ranks-as processes``."""
    asked = getattr(args, "ranks_as", None)
    if getattr(args, "threads", False) and asked != "processes":
        return "--threads"
    if asked == "threads":
        return "--ranks-as threads"
    reason = None
    if devices[0].platform != "cpu":
        reason = f"{devices[0].platform.upper()} devices, one per rank"
    elif len(allowed_cores()) < num_ranks:
        reason = f"{len(allowed_cores())} core(s) for {num_ranks} ranks"
    reason = reason or _flags_need_threads(args)
    _refuse_processes(args, reason)
    return reason


def _refuse_processes(args, reason: str | None) -> None:
    """CliError for ``--ranks-as processes`` beside ``--threads``, or where ``reason`` keeps the ranks
    threads; nothing otherwise."""
    if getattr(args, "ranks_as", None) != "processes":
        return
    if getattr(args, "threads", False):
        raise CliError("--threads and --ranks-as processes disagree: give one of them")
    if reason is not None:
        raise CliError(f"--ranks-as processes cannot run here: {reason}; use --ranks-as threads (or leave "
                       "it out to let the run choose)")


def _flags_need_threads(args) -> str | None:
    """The flag that makes ranks run as threads (known before JAX starts), or None."""
    if getattr(args, "steps", 2) < 2:
        return "--steps 1: a run in processes times the steps after the first"
    return None


def written_lines(result, config, seed: int = 0, prompt: bytes = b"def ") -> str:
    """A few lines the trained GPT (``config``) writes after ``prompt``
    (:func:`~zbpp_lite.training.reference.write_bytes` on the run's final parameters, drawn with ``seed``:
    the same run and seed write the same bytes), decoded as UTF-8 with errors replaced, and control
    characters other than newline and tab shown as U+FFFD: an untrained model writes terminal escapes."""
    from ..runtime.stages import StagedModel
    from ..training.model import build_parts
    from ..training.reference import write_bytes

    model = StagedModel(build_parts(config), 1)
    written = write_bytes(model, result.params, prompt, 240, config.context, seed=seed)
    text = "".join(c if c.isprintable() or c in "\n\t" else "\ufffd"
                   for c in (prompt + written).decode("utf-8", "replace"))
    return (f"what the model writes after {prompt.decode()!r} (temperature 0.8, seed {seed}):\n"
            + "\n".join(text.splitlines()[:6]))


def curve_line(result) -> str:
    """E.g. ``validation loss after 0, 150, ... steps: 5.62, 2.91, ...`` (``result.validation``)."""
    steps = ", ".join(str(k) for k, _ in result.validation)
    return f"validation loss after {steps} steps: {', '.join(f'{v:.3f}' for _, v in result.validation)}"


def report(result, tolerance: float) -> str:
    """The closing lines: accuracy, gradient check, measured vs simulated (time and memory)."""
    m, s = result.measured, result.simulated
    held = "held-out" if result.config.get("holdout") else "all"
    unigram = result.config.get("unigram_nats")
    lines = [
        f"test accuracy ({held} samples): {result.test_accuracy:.4f}   test loss {result.test_loss:.4f}"
        if unigram is None else
        f"validation loss {result.test_loss:.4f} nats/byte ({result.test_loss / math.log(2):.3f} bits), "
        f"{abs(1 - result.test_loss / unigram):.1%} {'below' if result.test_loss <= unigram else 'above'} "
        f"the unigram baseline {unigram:.4f} nats/byte (the entropy of the validation bytes' frequencies); "
        f"next-byte accuracy {result.test_accuracy:.4f}",
        grad_check_line(result, tolerance),
        f"{'':10}{'makespan':>14}{'bubble rate':>14}",
        f"{'measured':10}{m.makespan * 1e3:>11.2f} ms{m.bubble_rate:>14.4f}",
        f"{'simulated':10}{s.makespan * 1e3:>11.2f} ms{s.bubble_rate:>14.4f}   (measured mean action costs)",
        f"measured / simulated makespan: {m.makespan / s.makespan:.3f}",
        *memory_lines(m),
    ]
    guard = result.config.get("guard_reports")
    if guard:
        policy = "post-validation" if result.config.get("post_validation") else "synchronous"
        periods = sorted(result.step_seconds[1:-1]) or result.step_seconds
        lines.append(f"optimizer step in the rank threads, {policy}, max_grad_norm "
                     f"{result.config['max_grad_norm']:g}: "
                     f"{sum(r['clipped'] for r in guard)} of {len(guard)} steps clipped, "
                     f"{sum(r['skipped'] for r in guard)} skipped, "
                     f"{sum(bool(r['rolled_back']) for r in guard)} rolled back; "
                     f"median step period {periods[len(periods) // 2] * 1e3:.2f} ms")
    return "\n".join(lines)
