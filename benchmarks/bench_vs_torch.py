"""Ours against PyTorch's pipelining runtime on the same job, side by side in one run (issue 9).

The job is the one ``shared/peers/torch_pp_bench.py`` states: digits as 8 row tokens, the pre-norm
Transformer classifier (d=128, 4 heads, 8 blocks), global batch 256, m=8 microbatches, AdamW
(lr 1e-3, weight decay 0.01), 2 ranks, float32; warm-up steps, then timed steps; a step is the
forward, the backward and the optimizer update. This script

1. runs PyTorch's side with a Python that has torch (``--torch-python``; default the
   ZBPP_TORCH_PYTHON environment variable, else /work/torchvenv/bin/python if it exists; without
   one the PyTorch side is skipped, saying so), which also writes the initial weights;
2. runs ours, each run in fresh processes started from the same initial weights, on the same
   batches, in two set-ups:
   - ``NAME@procs``: PyTorch's set-up, one process per rank, each pinned to its own core before
     JAX starts (so XLA's threads serve that rank only), the package's executor running that
     rank's actions (``PipelineExecutor(ranks=[r], transport=...)``), activations and gradients
     between ranks through pipes, AdamW on the rank's stages after its last action, a common
     start signal per step and the slower rank's time as the step's (:func:`rank_process`);
   - ``NAME``: ``zbpp_lite.training.train.train`` as a user calls it, one process with 2 simulated CPU
     devices, ranks as threads, pinned to the first two cores. The devices share XLA's thread
     pool there, so a waiting rank's core works for the other: bubbles cost less than idle
     cores, and a schedule's fewer bubbles count for less;
   - ``NAME@turns`` (the run ``turns@procs``): the one-stage-per-rank schedules 1f1b, zb-h1,
     zb-h2, zb-auto, zb-h1+fuse and zb-h2+fuse in the ``@procs`` set-up, in one run, taking
     turns step by step (one training run whose steps rotate through the schedules). Separate
     runs on this shared 2-core machine drift by 10-20% from run to run; in turns, every
     schedule meets the same drift, so their ratios (zero bubble vs 1f1b) are the ones to
     trust. ``baseline-1stage`` takes its turns there too, on its own copy of the model
     (``baseline-1stage@turns``), so the speed-up over it compares steps that met the same
     machine;
   and the single-device baseline ``zbpp_lite.training.reference.train_baseline`` pinned to one core as
   PyTorch's (``baseline``), plus three references of ours: the same with the 8 microbatches
   accumulated (``baseline-acc8``), unpinned with XLA's threads on both cores
   (``baseline-2cores``), and our executor on one rank holding the whole model as one stage
   (``baseline-1stage``: the pipeline's own split kernels, microbatched, nothing to overlap; the
   strictest reference for the pipeline's speed-up);
3. does 1 and 2 again, in ``--rounds`` rounds (default 3), PyTorch's runs and ours alternating
   (A B A B A B), so a slow spell of the machine meets both sides; prints each round's ratios,
   ours over PyTorch's for 1f1b (against its 1F1B) and zb-auto (against its best of the round),
   and zb-h1+fuse and zb-h2+fuse over our 1f1b, and their medians over the rounds
   (:func:`round_ratios`; ours from ``@turns`` where it ran, else ``@procs``, else threads);
4. prints, for the first round, one table (median and minimum step time over the timed steps,
   speed-up over the side's own 1-core baseline, loss of the first and last step, the largest
   difference of any step's loss from PyTorch's baseline, and the CPU cores other programs used
   meanwhile) and the issue's targets for each set-up, each with PASS or FAIL.

Schedules that take planned costs (zb-v, zb-auto) are planned from costs measured on this job:
a short calibration run with unit costs, then the schedule is rebuilt from its measured mean
action costs (``zbpp_lite.analysis.profiling.timelines.measured_costs``) and trained from the start. For zb-auto a
short 1F1B run adds the fused backward's measured cost (``Costs.bw``): where BW costs less than
B and W apart, zb-auto splits the backward only where W fills a bubble.

Timings are only meaningful on an otherwise idle machine: every run reports the CPU cores other
programs used while it ran, and a run above 0.1 is flagged to be repeated.

Run (about 15 minutes a round on 2 cores):
    python benchmarks/bench_vs_torch.py --json vs_torch.json
    python benchmarks/bench_vs_torch.py --runs baseline,1f1b,zb-h2 --torch-schedules baseline,1F1B --steps 5
    python benchmarks/bench_vs_torch.py --runs turns@procs --torch-schedules 1F1B --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zbpp_lite.runtime.processes import RankProcesses, connect, disconnect

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCRIPT = ROOT.parent / "shared" / "peers" / "torch_pp_bench.py"
JOB = {"d": 128, "heads": 4, "blocks": 8, "batch": 256, "microbatches": 8, "lr": 1e-3, "weight_decay": 0.01, "seed": 0}
RANKS = 2
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zb-v", "zb-auto")
BEST_ZB = ("zb-h2", "zb-v", "zb-auto")  # the "best zero-bubble schedule" candidates
BASELINES = {
    "baseline": {"microbatches": 1, "cores": 1},  # PyTorch's baseline: whole batch, one core
    "baseline-acc8": {"microbatches": 8, "cores": 1},  # the 8 microbatches, one after another, one core
    "baseline-2cores": {"microbatches": 1, "cores": 2},  # whole batch, XLA's threads on both cores
    "baseline-1stage": {"microbatches": 8, "cores": 1, "executor": True},  # our executor, 1 rank, 1 stage: the pipeline's own kernels
}
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", *ZERO_BUBBLE]
PROCS = "@procs"  # suffix: one pinned single-threaded process per rank (PyTorch's set-up)
FUSED = ("zb-h1+fuse", "zb-h2+fuse")  # B and W fused where no other rank waits (issue 32)
TURNS = ("1f1b", "zb-h1", "zb-h2", "zb-auto", *FUSED)  # one stage per rank: run in turns, step by step
TURN = "@turns"  # suffix of their figures
TURNS_RUN = "turns" + PROCS  # the run that does it
REFERENCE = "baseline-1stage"  # also takes its turns there, as compare's one-rank reference does
OURS = [*BASELINES, TURNS_RUN, *(name + PROCS for name in SCHEDULES), *SCHEDULES]
TORCH_ZB = ("InterleavedZeroBubble", "ZBVZeroBubble")
BUSY_CORES = 0.1
LOSS_TOLERANCE = 1e-4


# ----------------------------------------------------------------------------- load


def busy_cpu_seconds() -> float | None:
    """CPU time the whole machine has spent so far (Linux /proc/stat), seconds."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(limit: float, longest: float) -> float | None:
    """Wait (at most ``longest`` seconds) until other programs use at most ``limit`` cores over
    3 s; returns the last load seen (None where /proc/stat cannot be read)."""
    deadline, load = time.monotonic() + longest, None
    while True:
        busy0 = busy_cpu_seconds()
        if busy0 is None:
            return None
        time.sleep(3.0)
        load = (busy_cpu_seconds() - busy0) / 3.0
        if load <= limit or time.monotonic() > deadline:
            return load


def run_measured(command: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float | None, float]:
    """Run a child to completion; return it, the CPU cores other programs used meanwhile (the
    machine's busy time less the child's own, over the wall time) and the wall time."""
    busy0, own0, t0 = busy_cpu_seconds(), children_cpu_seconds(), time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    other = None
    if busy0 is not None:
        other = max(0.0, (busy_cpu_seconds() - busy0) - (children_cpu_seconds() - own0)) / wall
    return done, other, wall


# ----------------------------------------------------------------------------- worker (one of our runs)


def pin(cores: int) -> list[int]:
    """Hold this process (before JAX starts its threads) on its first ``cores`` allowed cores."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    allowed = sorted(os.sched_getaffinity(0))
    chosen = set(allowed[:cores])
    os.sched_setaffinity(0, chosen)
    return sorted(chosen)


def worker(args) -> dict:
    """One of our runs, in this (fresh) process; returns its figures."""
    name = args.worker
    if name == TURNS_RUN:
        return turns_pipeline(args)
    if name.endswith(PROCS):
        return process_pipeline(name.removesuffix(PROCS), args)
    cores = BASELINES[name]["cores"] if name in BASELINES else RANKS
    pinned = pin(cores) if args.pin else []
    from zbpp_lite.runtime.devices import ensure_devices

    devices = ensure_devices(1 if name in BASELINES else RANKS)
    steps = args.warmup + args.steps
    from zbpp_lite.training.model import ModelConfig
    from zbpp_lite.training.train import RunConfig

    piped = dict(model=ModelConfig(d=JOB["d"], heads=JOB["heads"], blocks=JOB["blocks"], seed=JOB["seed"]),
                 run=RunConfig(batch=JOB["batch"], lr=JOB["lr"], weight_decay=JOB["weight_decay"], seed=JOB["seed"],
                               holdout=0.0, init=args.init, check_grads=False))
    extra: dict = {}
    if name in BASELINES and BASELINES[name].get("executor"):
        from zbpp_lite.training.train import TrainOptions, train

        result = train("gpipe", 1, BASELINES[name]["microbatches"], steps, options=TrainOptions(devices=devices[:1]),
                       **piped)
    elif name in BASELINES:
        from zbpp_lite.training.reference import train_baseline

        result = train_baseline(steps, microbatches=BASELINES[name]["microbatches"], device=devices[0], **piped)
    else:
        import zbpp_lite as zb
        from zbpp_lite.schedules.builders import options_of
        from zbpp_lite.training.train import TrainOptions, train

        options = {}
        if "costs" in options_of(name):  # plan from costs measured on this job
            from zbpp_lite.analysis.profiling.timelines import measured_costs

            calibration = train(name, RANKS, JOB["microbatches"], 3, **piped,
                                options=TrainOptions(devices=devices, schedule_options={"costs": zb.Costs()}))
            timelines = [calibration.timelines[-1]]
            if calibration.schedule.num_stages == RANKS:  # one stage per rank: the fused BW's cost from a 1F1B run
                timelines.append(train("1f1b", RANKS, JOB["microbatches"], 3, options=TrainOptions(devices=devices), **piped).timelines[-1])
            options["costs"] = measured_costs(timelines, calibration.schedule.num_stages)
            extra["planned_costs_ms"] = planned_ms(options["costs"])
        result = train(name, RANKS, JOB["microbatches"], steps, **piped,
                       options=TrainOptions(devices=devices, schedule_options=options))
        timed = result.timelines[args.warmup:]
        extra["action_ms"] = action_medians(timed)
        extra["makespan_ms"] = statistics.median(t.makespan for t in timed) * 1e3
        extra["bubble_rate"] = statistics.median(t.bubble_rate for t in timed)
        extra["stages"] = result.schedule.num_stages
    from zbpp_lite.training.reference import step_stats

    return {
        **step_stats(result.step_seconds, args.warmup),
        **extra,
        "losses": result.losses,
        "eval_loss": result.test_loss,
        "eval_acc": result.test_accuracy,
        "cores": pinned,
    }


def planned_ms(costs) -> dict:
    """The measured costs a schedule was planned from, per stage, in ms."""
    return {k: [round(1e3 * v, 3) for v in getattr(costs.table(len(costs.f)), k)] for k in ("f", "b", "w", "bw")}


def action_medians(timelines) -> dict:
    """Median measured duration of each kind of action per stage ("F0", "B1", "W1", "BW0"), ms:
    the profile the issue asks for before anything changes."""
    durations: dict[str, list[float]] = {}
    for t in timelines:
        for e in t.events:
            durations.setdefault(f"{e.action.kind}{e.action.stage}", []).append(e.duration * 1e3)
    return {k: round(statistics.median(v), 3) for k, v in sorted(durations.items())}


# ----------------------------------------------------------------------------- one process per rank


def rank_process(rank: int, peers: dict, control, config: dict) -> None:
    """One pipeline rank in its own process, as PyTorch's benchmark runs its ranks: pinned to one
    core before JAX starts (so XLA's threads are this rank's only), one CPU device, the package's
    executor for this rank's actions (``PipelineExecutor(ranks=[rank], transport=...)``), one per
    schedule of ``plans`` ({name: build options}, all cutting the model alike, but for
    :data:`REFERENCE`: the whole model as one stage on rank 0), values to and from the other
    ranks through pipes (:mod:`zbpp_lite.runtime.processes`), AdamW on this rank's stages after
    its last action. Steps on the parent's word (batch number, schedule): the pipelines'
    parameters carry over from step to step whatever the schedule; the reference trains its own
    copy. Each step reports its wall time, the losses (last stage) and the measured events."""
    import zbpp_lite as zb

    # costs cross the process boundary as plain fields (JSON), the rest of a plan as it is
    plans = {name: {k: (zb.Costs(**v) if k == "costs" else v) for k, v in options.items()} for name, options in config["plans"].items()}
    init = config["init"]
    from zbpp_lite.runtime.devices import ensure_devices

    device = ensure_devices(1)[0]
    import jax
    import optax

    from zbpp_lite.training.postval.rollback import AdamWConfig
    from zbpp_lite.training.data import load_digits
    from zbpp_lite.runtime.executor import PipelineExecutor
    from zbpp_lite.training.model import ModelConfig, build_parts, load_torch_init
    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.training.reference import one_rank_schedule

    schedules = {name: one_rank_schedule(RANKS, JOB["microbatches"]) if name == REFERENCE else
                 zb.build_schedule(name, RANKS, JOB["microbatches"], **options) for name, options in plans.items()}
    if len({s.num_stages for n, s in schedules.items() if n != REFERENCE}) > 1:
        raise ValueError(f"schedules run in turns must cut the model alike: {sorted(plans)}")
    config = ModelConfig(d=JOB["d"], heads=JOB["heads"], blocks=JOB["blocks"], seed=JOB["seed"])
    optimizer = AdamWConfig(learning_rate=JOB["lr"], weight_decay=JOB["weight_decay"]).optimizer()

    def apply(grads, state, p):
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    update = jax.jit(apply, donate_argnums=(1, 2))
    # one training run per cut of the model, from the same initial weights: the pipelines share one
    # (the parameters carry over whatever the schedule), the one-stage reference trains its own copy
    cuts = {}
    for num_stages in sorted({s.num_stages for s in schedules.values()}):
        model = StagedModel(build_parts(config), num_stages)
        cuts[num_stages] = {"model": model, "params": list(load_torch_init(init, config) if init else model.params)}
    executors = connect(peers, {name: (lambda transport, s=s: PipelineExecutor(cuts[s.num_stages]["model"], s, [device], ranks=[rank], transport=transport))
                                for name, s in schedules.items()})
    for num_stages, cut in cuts.items():
        model, params = cut["model"], cut["params"]
        mine = sorted({st for n, e in executors.items() if schedules[n].num_stages == num_stages for st in e.local_stages})
        # each stage's parameters and AdamW state as flat tuples of arrays: the update's call then
        # walks no Flax state (3.6 -> 2.4 ms a step for a stage of this job, measured on one core)
        cut["trees"] = {st: jax.tree_util.tree_structure(model.stage_params(params, st)) for st in mine}
        cut["stage_params"] = {st: tuple(jax.device_put(jax.tree_util.tree_leaves(model.stage_params(params, st)), device)) for st in mine}
        cut["states"] = {st: jax.device_put(optimizer.init(p), device) for st, p in cut["stage_params"].items()}  # committed, as update's outputs
    data = load_digits(0.0, JOB["seed"])
    while (command := control.recv()) is not None:
        k, name = command
        x, y = data.batch(k, JOB["batch"])
        cut = cuts[schedules[name].num_stages]
        model, params, stage_params, states, trees = (cut[key] for key in ("model", "params", "stage_params", "states", "trees"))
        for s, p in stage_params.items():
            for i, part in zip(model.parts[s], jax.tree_util.tree_unflatten(trees[s], p)):
                params[i] = part
        t0 = time.perf_counter()
        result = executors[name].run(params, x, y)
        ran = time.perf_counter() - t0
        for s in stage_params:
            grads = tuple(jax.tree_util.tree_leaves(model.stage_params(result.grads, s)))
            stage_params[s], states[s] = update(grads, states[s], stage_params[s])
        jax.block_until_ready(stage_params)
        seconds = time.perf_counter() - t0
        at = result.started_at  # the clock all processes share: the ranks' timelines align by it
        events = [(e.rank, str(e.action), at + e.start, at + e.end) for e in result.timeline.events]
        control.send((seconds, list(result.microbatch_losses), events, ran))
    disconnect(peers)


def run_processes(plans: dict, order: list[str], init: str | None, pin_ranks: bool) -> tuple[list, list, list, list]:
    """Train one step per entry of ``order`` (schedule names of ``plans``, {name: build
    options}), step k with schedule ``order[k]``, with one process per rank (the pipelines on
    batches 0, 1, 2, ... in turn; :data:`REFERENCE` on its own copy of the model, on its own
    batches 0, 1, 2, ...); returns per step
    (seconds, loss, Timeline, seconds of the slowest rank's executor run before its update). A
    step's time is the slowest rank's, from the common start signal to the end of its update."""
    import numpy as np

    from zbpp_lite.schedules.ir import Action
    from zbpp_lite.schedules.timeline import Event, Timeline

    import dataclasses

    plain = {name: {k: (dataclasses.asdict(v) if k == "costs" else v) for k, v in options.items()} for name, options in plans.items()}
    ranks = RankProcesses(f"{os.path.abspath(__file__)}:rank_process", RANKS, {"plans": plain, "init": init}, pin=pin_ranks)
    controls = ranks.controls
    seconds, losses, timelines, runs = [], [], [], []
    batch = {"pipelines": 0, REFERENCE: 0}  # the next batch of each training run
    try:
        for name in order:
            run = REFERENCE if name == REFERENCE else "pipelines"
            for control in controls:
                control.send((batch[run], name))
            batch[run] += 1
            replies = [control.recv() for control in controls]
            seconds.append(max(r[0] for r in replies))
            runs.append(max(r[3] for r in replies))
            mb_losses = next(r[1] for r in replies if r[1])
            losses.append(float(np.mean(np.asarray(mb_losses, np.float64))))
            origin = min(t0 for rep in replies for _, _, t0, _ in rep[2])
            events = [Event(r, Action.from_str(a), t0 - origin, t1 - origin) for rep in replies for r, a, t0, t1 in rep[2]]
            timelines.append(Timeline.from_events(events, RANKS, source="measured"))
    finally:
        ranks.close()
    return seconds, losses, timelines, runs


def calibrated(names: list[str], args) -> tuple[dict, dict]:
    """Build options for ``names``: schedules that take costs are planned from costs measured on
    this job in this set-up (a short run with unit costs; with one stage per rank, 1F1B's steps
    in turns add the fused backward's cost, T_BW). Returns (plans, what each was planned from)."""
    import zbpp_lite as zb
    from zbpp_lite.schedules.builders import options_of
    from zbpp_lite.analysis.profiling.timelines import measured_costs

    plans, extra = {}, {}
    for name in names:
        plans[name] = {}
        if "costs" not in options_of(name):
            continue
        num_stages = zb.build_schedule(name, RANKS, JOB["microbatches"], costs=zb.Costs()).num_stages
        probe = {name: {"costs": zb.Costs()}, **({"1f1b": {}} if num_stages == RANKS else {})}
        order = [n for _ in range(3) for n in probe]
        timelines = run_processes(probe, order, args.init, args.pin)[2][len(probe):]  # the first round compiles
        plans[name]["costs"] = measured_costs(timelines, num_stages)
        extra[name] = planned_ms(plans[name]["costs"])
    return plans, extra


def figures(seconds, losses, timelines, runs, warmup: int) -> dict:
    from zbpp_lite.training.reference import step_stats

    timed = timelines[warmup:]
    return {
        **step_stats(seconds, warmup),
        "action_ms": action_medians(timed),
        "run_ms": statistics.median(runs[warmup:]) * 1e3,
        "makespan_ms": statistics.median(t.makespan for t in timed) * 1e3,
        "bubble_rate": statistics.median(t.bubble_rate for t in timed),
        "losses": losses,
    }


def process_pipeline(name: str, args) -> dict:
    """Our run with one pinned process per rank (PyTorch's set-up): figures as :func:`worker`'s."""
    plans, extra = calibrated([name], args)
    result = figures(*run_processes(plans, [name] * (args.warmup + args.steps), args.init, args.pin), args.warmup)
    if name in extra:
        result["planned_costs_ms"] = extra[name]
    return {**result, "cores": "one per rank" if args.pin else []}


def turns_pipeline(args) -> dict:
    """The schedules of :data:`TURNS` in one run, one pinned process per rank, taking turns step
    by step (step k runs ``TURNS[k % len(TURNS)]``; one training run, the parameters carry over):
    whatever drifts on the machine during the run affects every schedule alike, so their ratios
    are the fairest this machine gives. :data:`REFERENCE`, our executor on one rank, takes its
    turns too (``baseline-1stage@turns``), on its own copy of the model: the speed-ups over it
    then compare steps that met the same machine. Figures per schedule over its own timed steps
    (after ``args.warmup`` of its own), as ``NAME@turns``."""
    plans, extra = calibrated(list(TURNS), args)
    plans[REFERENCE] = {}
    members = (REFERENCE, *TURNS)
    order = [name for _ in range(args.warmup + args.steps) for name in members]
    seconds, losses, timelines, runs = run_processes(plans, order, args.init, args.pin)
    piped = [loss for name, loss in zip(order, losses) if name != REFERENCE]  # the pipelines' training run, every step
    group = {}
    for i, name in enumerate(members):
        mine = slice(i, None, len(members))
        group[name + TURN] = {**figures(seconds[mine], losses[mine] if name == REFERENCE else piped, timelines[mine], runs[mine], args.warmup),
                              **({"planned_costs_ms": extra[name]} if name in extra else {}),
                              "cores": "one per rank" if args.pin else []}
    own = losses[0::len(members)]  # the reference's run: the same model, batches and optimizer as the pipelines'
    gap = max(abs(a - b) for a, b in zip(own, piped))
    print(f"[ours] {REFERENCE}{TURN}: largest loss difference from the pipelines' run at the same step {gap:.1e}", flush=True)
    group[REFERENCE + TURN]["loss_gap_vs_pipelines"] = gap
    group[TURNS_RUN] = {"losses": piped, "order": order}
    return {"group": group}


# ----------------------------------------------------------------------------- the two sides


def torch_python(flag: str | None) -> str | None:
    if flag:
        return flag
    if os.environ.get("ZBPP_TORCH_PYTHON"):
        return os.environ["ZBPP_TORCH_PYTHON"]
    default = "/work/torchvenv/bin/python"
    return default if os.path.exists(default) else None


def run_torch(args, init: str, workdir: str) -> dict:
    """PyTorch's runs (its script), or {} with the reason printed."""
    python = torch_python(args.torch_python)
    if python is None:
        print("PyTorch side SKIPPED: no Python with torch (give --torch-python or set ZBPP_TORCH_PYTHON)", flush=True)
        return {}
    try:
        probe = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    except OSError as e:
        print(f"PyTorch side SKIPPED: cannot run {python}: {e}", flush=True)
        return {}
    if probe.returncode != 0:
        print(f"PyTorch side SKIPPED: {python} cannot import torch: {probe.stderr.strip().splitlines()[-1:]}", flush=True)
        return {}
    if not Path(args.torch_script).exists():
        print(f"PyTorch side SKIPPED: no {args.torch_script}", flush=True)
        return {}
    out = os.path.join(workdir, "torch.json")

    def run(schedules: str) -> dict:
        command = [python, args.torch_script, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--schedules", schedules, "--save-init", init, "--json", out,
                   *[f"--{k}={JOB[k]}" for k in ("d", "heads", "blocks", "batch", "microbatches", "lr", "seed")]]
        if not args.pin:
            command.append("--no-pin")
        print(f"[torch] {' '.join(command[2:])}", flush=True)
        if os.path.exists(out):
            os.remove(out)
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        if not os.path.exists(out):
            raise RuntimeError(f"PyTorch's run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.load(open(out))

    wait_quiet(BUSY_CORES, args.quiet_wait)
    report = run(args.torch_schedules)
    for _ in range(args.retries):  # a run on a busy machine is repeated, not quoted
        busy = [n for n, r in report["results"].items() if (r.get("other_load_cores") or 0) > BUSY_CORES]
        if not busy:
            break
        print(f"[torch] busy machine during {', '.join(busy)}: again", flush=True)
        wait_quiet(BUSY_CORES, args.quiet_wait)
        again = run(",".join(busy))["results"]
        for name in busy:
            if (again[name].get("other_load_cores") or 0) < (report["results"][name].get("other_load_cores") or 0):
                report["results"][name] = again[name]
    for name, r in report["results"].items():
        if "error" in r:
            print(f"[torch] {name} FAILED: {r['error'].strip().splitlines()[-1]}", flush=True)
        else:
            print(f"[torch] {name:<22} median {r['median_ms']:7.1f} ms  other {r['other_load_cores']:.2f}", flush=True)
    return report


def run_ours(args, init: str | None, workdir: str) -> dict:
    results = {}
    for name in args.runs.split(","):
        out = os.path.join(workdir, f"ours_{name}.json")
        command = [sys.executable, __file__, "--worker", name, "--out", out, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), *(["--init", init] if init else []), *([] if args.pin else ["--no-pin"])]
        for attempt in range(1 + args.retries):  # a run on a busy machine is repeated, not quoted
            if os.path.exists(out):
                os.remove(out)
            wait_quiet(BUSY_CORES, args.quiet_wait)
            done, other, wall = run_measured(command, args.timeout)
            if done.returncode != 0 or not os.path.exists(out):
                break
            result = {**json.load(open(out)), "other_load_cores": other, "wall_s": wall, "attempt": attempt + 1}
            if name not in results or (other or 0) < (results[name]["other_load_cores"] or 0):
                results[name] = result
            if (other or 0) <= BUSY_CORES:
                break
            again = "again" if attempt < args.retries else "no retries left: quoted as measured"
            print(f"[ours] {name}: busy machine ({other:.2f} cores), {again}", flush=True)
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            results[name] = {"error": tail[0]}
            print(f"[ours] {name} FAILED: {tail[0]}", flush=True)
            continue
        if "group" in results[name]:  # one run, several schedules' figures
            run = results.pop(name)
            for member, figs in run["group"].items():
                if member != name:
                    results[member] = {**figs, **{k: run[k] for k in ("other_load_cores", "wall_s", "attempt")}}
            for member in [m for m in run["group"] if m != name]:
                report_run(member, results[member])
            continue
        report_run(name, results[name])
    return results


def report_run(name: str, r: dict) -> None:
    """One line for one of our runs as it finishes."""
    other = r["other_load_cores"]
    span = f"  makespan {r['makespan_ms']:7.1f} ms  bubble {r['bubble_rate']:.3f}" if "makespan_ms" in r else ""
    print(f"[ours] {name:<22} median {r['median_ms']:7.1f} ms  min {r['min_ms']:7.1f}{span}"
          f"  other {other if other is not None else float('nan'):.2f}  ({r['wall_s']:.0f} s)", flush=True)


# ----------------------------------------------------------------------------- report


def loss_gap(losses: list[float], reference: list[float] | None) -> float | None:
    if not reference:
        return None
    n = min(len(losses), len(reference))
    return max(abs(a - b) for a, b in zip(losses[:n], reference[:n]))


def table(ours: dict, torch_results: dict) -> list[dict]:
    rows = []
    torch_base = torch_results.get("baseline", {})
    reference = torch_base.get("train_losses")
    for side, results, base_name in (("torch", torch_results, "baseline"), ("ours", ours, "baseline")):
        base = results.get(base_name, {}).get("median_ms")
        for name, r in results.items():
            if "error" in r:
                rows.append({"side": side, "run": name, "error": r["error"]})
                continue
            losses = r.get("losses") or r.get("train_losses")
            rows.append({
                "side": side, "run": name, "median_ms": r["median_ms"], "min_ms": r["min_ms"],
                "speedup": base / r["median_ms"] if base else None,
                "loss_first": losses[0], "loss_last": losses[-1],
                "loss_gap": loss_gap(losses, reference), "other": r.get("other_load_cores"),
                "bubble_rate": r.get("bubble_rate"),
            })
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'side':<6}{'run':<24}{'median ms':>10}{'min ms':>9}{'vs base':>8}{'loss@1':>9}{'loss@last':>10}{'max|dloss|':>11}{'other':>7}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['side']:<6}{r['run']:<24}FAILED: {r['error'][:80]}")
            continue
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"{r['side']:<6}{r['run']:<24}{r['median_ms']:>10.1f}{r['min_ms']:>9.1f}{speedup:>8}"
              f"{r['loss_first']:>9.4f}{r['loss_last']:>10.4f}{fmt(r['loss_gap'], '>11.1e'):>11}{fmt(r['other'], '>7.2f'):>7}")
    print("vs base: the side's own 1-core baseline median / the run's median. max|dloss|: largest difference of any\n"
          "step's training loss from PyTorch's baseline run (same initial weights and batches). other: CPU cores\n"
          "used by other programs during the run (should be ~0).")


def targets(ours: dict, torch_results: dict, rows: list[dict], suffix: str = "") -> list[tuple[str, str, bool | None]]:
    """The issue's targets for our runs named ``schedule + suffix``: (what, measured figures,
    passed; None when a side is missing)."""
    med = lambda results, names: {n: results[n]["median_ms"] for n in names if n in results and "error" not in results[n]}  # noqa: E731
    checks = []
    ours_zb, best_zb = med(ours, [n + suffix for n in ZERO_BUBBLE]), med(ours, [n + suffix for n in BEST_ZB])
    torch_all = med(torch_results, [n for n in torch_results if n != "baseline"])
    torch_zb = med(torch_results, TORCH_ZB)
    if best_zb and torch_all:
        name, t = min(best_zb.items(), key=lambda kv: kv[1])
        tname, tt = min(torch_all.items(), key=lambda kv: kv[1])
        checks.append((f"our best zero-bubble ({name}) / PyTorch's best ({tname}) <= 0.8", f"{t:.1f} / {tt:.1f} = {t / tt:.3f}", t / tt <= 0.8))
    else:
        checks.append(("our best zero-bubble / PyTorch's best <= 0.8", "a side is missing", None))
    if ours_zb and med(ours, ["1f1b" + suffix]):
        ref = ours["1f1b" + suffix]["median_ms"]
        for name, t in ours_zb.items():
            checks.append((f"our {name} faster than our 1f1b{suffix}", f"{t:.1f} / {ref:.1f} = {t / ref:.3f}", t < ref))
    if best_zb and torch_zb and torch_all:
        name, t = min(best_zb.items(), key=lambda kv: kv[1])
        zname, zt = min(torch_zb.items(), key=lambda kv: kv[1])
        tt = min(torch_all.values())
        checks.append((f"ahead of PyTorch's zero bubble ({zname}) by a wider margin than of its best",
                       f"{zt / t:.2f}x vs {tt / t:.2f}x", zt / t > tt / t and zt > t))
    base = med(ours, ["baseline"]).get("baseline")
    if base and best_zb:
        name, t = min(best_zb.items(), key=lambda kv: kv[1])
        checks.append((f"speed-up of {name} over our 1-core baseline >= 1.7", f"{base:.1f} / {t:.1f} = {base / t:.2f}", base / t >= 1.7))
    one_stage = med(ours, ["baseline-1stage"]).get("baseline-1stage")
    if one_stage and best_zb:  # the stricter reference: the same kernels on one core, nothing to overlap
        name, t = min(best_zb.items(), key=lambda kv: kv[1])
        checks.append((f"speed-up of {name} over our executor on 1 rank, 1 stage (same kernels) >= 1.7",
                       f"{one_stage:.1f} / {t:.1f} = {one_stage / t:.2f}", one_stage / t >= 1.7))
    mine = lambda run: run in BASELINES or (run.endswith(suffix) if suffix else PROCS not in run and TURN not in run)  # noqa: E731
    gaps = [(r["run"], r["loss_gap"]) for r in rows if r["side"] == "ours" and r.get("loss_gap") is not None and mine(r["run"])]
    if gaps:
        worst = max(gaps, key=lambda g: g[1])
        checks.append((f"losses equal PyTorch's step for step within {LOSS_TOLERANCE:g} (every run of ours)",
                       f"worst {worst[1]:.1e} ({worst[0]})", worst[1] <= LOSS_TOLERANCE))
    else:
        checks.append(("losses equal PyTorch's within 1e-4", "no PyTorch losses to compare", None))
    busy = [f"{r['side']} {r['run']} ({r['other']:.2f})" for r in rows
            if (r.get("other") or 0) > BUSY_CORES and (r["side"] == "torch" or mine(r["run"]))]
    checks.append(("machine otherwise idle (other load <= 0.1 core in every run)", ", ".join(busy) or "yes", not busy))
    return checks


def targets_main_job(ours: dict, torch_results: dict) -> list[tuple[str, str, bool | None]]:
    """Issue 16's targets for the peer job, on the schedules that took turns (``NAME@turns``):
    zb-h2 <= 0.95 x our 1f1b (also step by step: the median of the paired ratios, with its
    interval), zb-auto <= 0.85 x PyTorch's best, and zb-auto's speed-up over the fastest of
    the single-device references (``baseline``, ``baseline-acc8``, the form ``compare`` takes, and
    ``baseline-1stage@turns``, stepped in the same turns, else ``baseline-1stage``) >= 1.85."""
    from zbpp_lite.analysis.noise import paired_gain

    ok = lambda name: name in ours and "error" not in ours[name]  # noqa: E731
    checks = []
    h2, one, auto = "zb-h2" + TURN, "1f1b" + TURN, "zb-auto" + TURN
    if ok(h2) and ok(one):
        g = paired_gain(ours[one]["step_ms"], ours[h2]["step_ms"], 0.95)
        t, ref = ours[h2]["median_ms"], ours[one]["median_ms"]
        checks.append(("zb-h2 <= 0.95 x our 1f1b", f"{t:.1f} / {ref:.1f} = {t / ref:.3f}; step by step {g.ratio:.3f} "
                       f"[{g.low:.3f}, {g.high:.3f}]", t / ref <= 0.95))
    else:
        checks.append(("zb-h2 <= 0.95 x our 1f1b", "the turns run is missing", None))
    theirs = {n: r["median_ms"] for n, r in torch_results.items() if n != "baseline" and "error" not in r}
    if ok(auto) and theirs:
        tname, tt = min(theirs.items(), key=lambda kv: kv[1])
        t = ours[auto]["median_ms"]
        checks.append((f"zb-auto <= 0.85 x PyTorch's best ({tname})", f"{t:.1f} / {tt:.1f} = {t / tt:.3f}", t / tt <= 0.85))
    else:
        checks.append(("zb-auto <= 0.85 x PyTorch's best", "a side is missing", None))
    paired = REFERENCE + TURN
    refs = {n: ours[n]["median_ms"] for n in ("baseline", "baseline-acc8", paired if ok(paired) else REFERENCE)
            if ok(n)}
    if ok(auto) and refs:
        rname, rt = min(refs.items(), key=lambda kv: kv[1])
        t = ours[auto]["median_ms"]
        step = ""
        if rname == paired:  # the reference took its turns beside zb-auto: step k's ratio too
            g = paired_gain(ours[auto]["step_ms"], ours[paired]["step_ms"], 0.95)
            step = f"; step by step {g.ratio:.2f} [{g.low:.2f}, {g.high:.2f}]"
        checks.append((f"zb-auto's speed-up over the fastest single-device reference ({rname}) >= 1.85",
                       f"{rt:.1f} / {t:.1f} = {rt / t:.2f}{step}", rt / t >= 1.85))
    else:
        checks.append(("zb-auto's speed-up over the fastest single-device reference >= 1.85", "a side is missing", None))
    return checks


def _ours_median(ours: dict, name: str, suffixes: tuple[str, ...]) -> tuple[float, str] | None:
    """(median ms, the run's name) of ``name`` in the first set-up of ``suffixes`` where it ran."""
    for suffix in suffixes:
        r = ours.get(name + suffix)
        if r is not None and "error" not in r:
            return r["median_ms"], name + suffix
    return None


def round_ratios(torch_results: dict, ours: dict) -> dict[str, float | None]:
    """One round's ratios (None where a side is missing): ours / PyTorch's for 1f1b (its 1F1B)
    and zb-auto (its best pipeline of the round), and zb-h1+fuse, zb-h2+fuse / our 1f1b in the
    same set-up (``@turns``, else ``@procs``, else threads)."""
    theirs = {n: r["median_ms"] for n, r in torch_results.items() if n != "baseline" and "error" not in r}
    setups = (TURN, PROCS, "")
    out: dict[str, float | None] = {}
    for name, their in (("1f1b", theirs.get("1F1B")), ("zb-auto", min(theirs.values(), default=None))):
        mine = _ours_median(ours, name, setups)
        label = f"{name} / PyTorch's {'1F1B' if name == '1f1b' else 'best'}"
        out[label] = mine[0] / their if mine and their else None
    for name in FUSED:
        pair = next(((ours[name + x]["median_ms"], ours["1f1b" + x]["median_ms"]) for x in setups
                     if _ours_median(ours, name, (x,)) and _ours_median(ours, "1f1b", (x,))), None)
        out[f"{name} / our 1f1b"] = pair[0] / pair[1] if pair else None
    return out


def report_rounds(ratios: list[dict[str, float | None]]) -> dict[str, dict]:
    """Print each round's ratios and their median over the rounds; returns {ratio: {"rounds", "median"}}."""
    out = {}
    print(f"\nrounds (PyTorch's runs and ours alternating): ratio by round and the median of {len(ratios)}")
    heads = [f"round {k + 1}" for k in range(len(ratios))] + ["median"]
    print(f"  {'ratio':<28}" + "".join(f"{h:>9}" for h in heads))
    for key in ratios[0]:
        values = [r[key] for r in ratios]
        known = [v for v in values if v is not None]
        median = statistics.median(known) if known else None
        out[key] = {"rounds": values, "median": median}
        cells = "".join(f"{'-' if v is None else format(v, '.3f'):>9}" for v in (*values, median))
        print(f"  {key:<28}{cells}")
    print("  below 1: ours faster (or the fused variant faster than our 1f1b); '-': a side did not run")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torch-python", help="a Python that can import torch (default: $ZBPP_TORCH_PYTHON, else /work/torchvenv/bin/python)")
    p.add_argument("--torch-script", default=str(DEFAULT_SCRIPT), help=f"PyTorch's side (default {DEFAULT_SCRIPT})")
    p.add_argument("--torch-schedules", default="baseline,GPipe,1F1B,Interleaved1F1B,InterleavedZeroBubble,ZBVZeroBubble")
    p.add_argument("--runs", default=",".join(OURS), help=f"our runs (default {','.join(OURS)})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per run (default 3)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run (default 1800)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="pin no process to cores")
    p.add_argument("--retries", type=int, default=2, help="times a run on a busy machine is repeated (default 2)")
    p.add_argument("--quiet-wait", type=float, default=120, help="seconds to wait for a quiet machine before each run (default 120)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of PyTorch's runs then ours (default 3, at least 3)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = worker(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    unknown = [n for n in args.runs.split(",") if n not in OURS]
    if unknown:
        p.error(f"unknown runs {unknown}; choose from {','.join(OURS)}")
    if args.rounds < 3:
        p.error(f"--rounds must be an integer >= 3 (a median of rounds needs three), got {args.rounds}")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench_vs_torch_") as workdir:
        for k in range(args.rounds):  # A B A B ...: PyTorch's runs, then ours
            print(f"\n=== round {k + 1} of {args.rounds}: PyTorch's runs, then ours ===", flush=True)
            init = os.path.join(workdir, "init.npz")
            torch_report = run_torch(args, init, workdir)
            if not os.path.exists(init):
                init = None
                print("no PyTorch initial weights: our runs start from our own init (no loss comparison)",
                      flush=True)
            rounds.append((torch_report, run_ours(args, init, workdir)))
    torch_report, ours = rounds[0]
    torch_results = torch_report.get("results", {})
    rows = table(ours, torch_results)
    print(f"\njob: {JOB}, p={RANKS}, warm-up {args.warmup} + {args.steps} timed steps per run; "
          "step = forward + backward + optimizer; the table and the targets: round 1")
    print_table(rows)
    checks = {}
    for suffix, title in ((TURN, "one pinned single-threaded process per rank, schedules taking turns step by step in one run"),
                          (PROCS, "one pinned single-threaded process per rank, as PyTorch's"), ("", "one process, ranks as threads")):
        if not any(n.endswith(suffix) and n not in BASELINES for n in ours) if suffix else not any(
                n in SCHEDULES for n in ours):
            continue
        print(f"\ntargets (issue 9), ours with {title}:")
        checks[suffix or "threads"] = targets(ours, torch_results, rows, suffix)
        for what, figures, passed in checks[suffix or "threads"]:
            print(f"  {'PASS' if passed else 'FAIL' if passed is not None else 'n/a '}  {what}: {figures}")
    by_round = report_rounds([round_ratios(t.get("results", {}), o) for t, o in rounds])
    print("\ntargets (issue 16), the schedules taking turns:")
    checks["issue 16"] = targets_main_job(ours, torch_results)
    for what, figures, passed in checks["issue 16"]:
        print(f"  {'PASS' if passed else 'FAIL' if passed is not None else 'n/a '}  {what}: {figures}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"job": JOB, "steps": args.steps, "warmup": args.warmup, "ours": ours, "torch": torch_report,
                       "rows": rows, "targets": {mode: [{"target": w, "figures": f, "passed": ok} for w, f, ok in c]
                                                  for mode, c in checks.items()},
                       "rounds": [{"torch": t, "ours": o} for t, o in rounds], "round_ratios": by_round},
                      f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
