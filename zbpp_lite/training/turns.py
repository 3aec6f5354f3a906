"""Several schedules trained side by side, one pinned process per rank, taking turns step by step.

:func:`train_in_turns` is how ``compare`` and ``train`` measure on a machine with at least as
many cores as ranks. Each rank is its own process pinned to its own core
(:class:`zbpp_lite.runtime.processes.RankProcesses`), so a rank that waits leaves its core idle,
as a real device does, and the measured bubbles are the schedule's. Every schedule keeps its own
copy of the model (the same initial parameters) and its own AdamW state, and step k of every
schedule trains on batch k: the schedules compute the same losses, and step k of all of them
runs before step k + 1 of any, so whatever drifts on the machine during the run (other load, a
slow spell of one core) meets every schedule alike. Their ratios are the fairest this machine
gives.

Per step and schedule, each rank runs its actions (the executor, ``ranks=[r]``), then AdamW on its
own stages, and reports its wall time, the last stage's microbatch losses and the measured events
on the clock all processes share (Linux's CLOCK_MONOTONIC), by which the parent aligns the ranks'
timelines. The first step of each schedule compiles; :class:`~zbpp_lite.training.train.TrainResult`'s
measured timeline is the median step after it.

Layer: training.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from ..analysis.rebalance import check_parts
from ..runtime.processes import RankProcesses, allowed_cores, connect, disconnect
from ..schedules.ir import Action, Schedule
from ..schedules.simulate import simulate
from ..schedules.timeline import Event, Timeline
from .data import Digits, load_digits
from .model import ModelConfig
from .train import RunConfig, TrainResult, _pick_measured, settings_json

ENTRY = "zbpp_lite.training.turns:rank_main"


def schedule_to_json(s: Schedule) -> dict:
    """A schedule as JSON-ready data: per-rank action strings, placement, microbatches, name."""
    return {"actions": [[str(a) for a in row] for row in s.actions], "placement": list(s.placement),
            "microbatches": s.num_microbatches, "name": s.name}


def schedule_from_json(d: dict) -> Schedule:
    """Inverse of :func:`schedule_to_json` (validated by the executor that runs it).

    Raises:
        ValueError: an unparsable entry, or rows whose placement is not the one given.
    """
    s = Schedule.from_rows(d["actions"], int(d["microbatches"]), name=d.get("name", ""))
    if list(s.placement) != list(d["placement"]):
        raise ValueError(f"the schedule's rows place its stages {list(s.placement)}, not {list(d['placement'])}")
    return s


def enough_cores(num_ranks: int) -> bool:
    """Whether this process may use at least ``num_ranks`` cores (one per rank)."""
    return len(allowed_cores()) >= num_ranks


# ----------------------------------------------------------------------------- a rank's process


def rank_main(rank: int, peers: dict, control, config: dict) -> None:
    """One pipeline rank: every schedule's executor for this rank, AdamW on its stages, steps on
    the parent's word. Runs in its own process (:class:`~zbpp_lite.runtime.processes.RankProcesses`)."""
    from ..runtime.devices import ensure_devices

    device = ensure_devices(1)[0]
    import jax

    from ..runtime.executor import PipelineExecutor
    from ..runtime.stages import StagedModel
    from .model import build_parts, load_torch_init
    from .reference import jitted_adamw

    run = config["run"]
    schedules = {name: schedule_from_json(d) for name, d in config["schedules"].items()}
    model_config = ModelConfig(**config["model"])
    cuts = config.get("parts") or {}  # {name: partition} for the schedules not cut the default way
    shared = {S: StagedModel(build_parts(model_config), S) for S in sorted({s.num_stages for s in schedules.values()})}
    models = {name: StagedModel(build_parts(model_config), s.num_stages, parts=cuts[name]) if cuts.get(name) else shared[s.num_stages]
              for name, s in schedules.items()}
    initial = load_torch_init(run["init"], model_config) if run.get("init") else next(iter(shared.values())).params
    executors = connect(peers, {name: (lambda remote, name=name, s=s: PipelineExecutor(models[name], s, [device], ranks=[rank], remote=remote))
                                for name, s in schedules.items()})
    opt, update = jitted_adamw(run["lr"], run["weight_decay"])
    state = {}
    for name, s in schedules.items():  # each schedule its own parameters and AdamW state
        model = models[name]
        mine = executors[name].local_stages
        params = [jax.device_put(p, device) for p in initial]
        stage_params = {st: jax.device_put(model.stage_params(params, st), device) for st in mine}
        state[name] = {"model": model, "params": params, "stages": stage_params,
                       "opt": {st: jax.device_put(opt.init(p), device) for st, p in stage_params.items()}}
        for st, p in stage_params.items():  # compile the update for step 0's inputs and for its own outputs (later steps)
            zeros = jax.tree_util.tree_map(jax.numpy.zeros_like, p)
            once = update(zeros, state[name]["opt"][st], p)
            jax.block_until_ready(update(zeros, once[1], once[0]))
    data = load_digits(run["holdout"], run["seed"])
    while (command := control.recv()) is not None:
        name = command["schedule"]
        st, executor = state[name], executors[name]
        if command["op"] == "params":
            control.send({"params": {str(s): [np.asarray(a) for a in jax.tree_util.tree_leaves(p)] for s, p in st["stages"].items()}})
            continue
        x, y = data.batch(command["step"], run["batch"])
        model = st["model"]
        for s, p in st["stages"].items():
            for i, part in zip(model.parts[s], p):
                st["params"][i] = part
        t0 = time.perf_counter()
        result = executor.run(st["params"], x, y)
        ran = time.perf_counter() - t0
        for s in st["stages"]:
            st["stages"][s], st["opt"][s] = update(model.stage_params(result.grads, s), st["opt"][s], st["stages"][s])
        jax.block_until_ready(st["stages"])
        seconds = time.perf_counter() - t0
        at = result.started_at
        reply = {"seconds": seconds, "run_seconds": ran, "losses": list(result.microbatch_losses),
                 "events": [[e.rank, str(e.action), at + e.start, at + e.end] for e in result.timeline.events]}
        memory = result.timeline.measured_memory
        if memory is not None:  # this rank's curves on the shared clock, its stages' M_B and M_W
            reply["memory"] = {"held": [[at + s, b] for s, b in memory.held[rank]],
                               "received": [[at + s, b] for s, b in memory.received[rank]],
                               "mem_b": list(memory.mem_b), "mem_w": list(memory.mem_w),
                               "device_peak": memory.device_peak[rank] if len(memory.device_peak) > rank else None}
        if command.get("grads"):
            reply["grads"] = {str(s): [np.asarray(a) for a in jax.tree_util.tree_leaves(model.stage_params(result.grads, s))]
                              for s in st["stages"]}
        control.send(reply)
    disconnect(peers)


# ----------------------------------------------------------------------------- the parent


def _aligned(replies: list, num_ranks: int, num_stages: int) -> Timeline:
    """One measured timeline from every rank's events (and activation memory) on the clock all
    processes share, counted from the step's first action."""
    import dataclasses

    from ..schedules.memory import MeasuredMemory

    origin = min(t0 for rep in replies for _, _, t0, _ in rep["events"])
    events = [Event(r, Action.from_str(a), t0 - origin, t1 - origin) for rep in replies for r, a, t0, t1 in rep["events"]]
    timeline = Timeline.from_events(events, num_ranks, num_stages=num_stages, source="measured")
    if all("memory" in rep for rep in replies):
        mem = [rep["memory"] for rep in replies]  # rank order
        curve = lambda points: tuple((max(t - origin, 0.0), int(b)) for t, b in points)  # noqa: E731
        memory = MeasuredMemory(held=tuple(curve(m["held"]) for m in mem), received=tuple(curve(m["received"]) for m in mem),
                                mem_b=tuple(max(m["mem_b"][s] for m in mem) for s in range(num_stages)),
                                mem_w=tuple(max(m["mem_w"][s] for m in mem) for s in range(num_stages)),
                                device_peak=tuple(m["device_peak"] for m in mem))
        timeline = dataclasses.replace(timeline, measured_memory=memory)
    return timeline


def _step(ranks: RankProcesses, name: str, schedule: Schedule, k: int, grads: bool, rec: dict) -> list:
    """Step ``k`` of schedule ``name`` on every rank: its mean loss, aligned timeline and wall time
    (the slowest rank's) appended to ``rec``; returns the ranks' replies."""
    ranks.broadcast({"op": "step", "schedule": name, "step": k, "grads": grads})
    replies = ranks.gather()
    rec["losses"].append(float(np.mean(np.asarray(next(r["losses"] for r in replies if r["losses"]), np.float64))))
    rec["timelines"].append(_aligned(replies, schedule.num_ranks, schedule.num_stages))
    rec["seconds"].append(max(r["seconds"] for r in replies))
    return replies


def _stage_leaves(replies: list, key: str) -> dict[int, list]:
    return {int(s): list(leaves) for rep in replies for s, leaves in rep[key].items()}


def train_in_turns(
    schedules: Sequence[Schedule],
    steps: int,
    *,
    model: ModelConfig | None = None,
    run: RunConfig | None = None,
    data: Digits | None = None,
    pin: bool = True,
    progress: bool = False,
    on_step: Callable[[str, int, float, Timeline], None] | None = None,
    parts: dict[str, Sequence[Sequence[int]]] | None = None,
    then: Callable[[dict[str, list[float]]], tuple[str, int] | None] | None = None,
) -> dict[str, TrainResult]:
    """Train every schedule for ``steps`` steps, taking turns step by step, one process per rank.

    Step k of every schedule runs before step k + 1 of any: in the order given for even k, in
    reverse for odd k. The machine's slow spells (seconds long on a shared virtual machine) then
    meet neighbours in the order alike: put the schedules to compare next to each other.

    Args:
        schedules: valid schedules with distinct names, all with the same number of ranks and
            microbatches (their stage counts may differ: each has its own copy of the model).
        steps: steps per schedule (>= 2: the first compiles and is not timed).
        model, run: as for :func:`~zbpp_lite.training.train.train` (``run.max_grad_norm`` is not
            supported here: the clipped optimizer runs in threads, see ``train``).
        data: the digits split (default ``load_digits(run.holdout, run.seed)``).
        pin: pin rank r to the r-th allowed core (see :func:`enough_cores`).
        progress: a tqdm bar over the steps.
        on_step: called after every step with (schedule name, step, loss, measured timeline).
        parts: ``{name: partition}`` for schedules whose model is cut otherwise than the default
            (``partition[s]``: the model part indices of stage s, 0 = embedding, 1..blocks = the
            blocks, blocks + 1 = the head; e.g. from :func:`zbpp_lite.analysis.rebalance.best_partition`);
            the others get :func:`zbpp_lite.runtime.stages.stage_parts`.
        then: called once the turns are over with ``{name: step seconds}``; it may return
            ``(name, extra)`` to go on training that schedule alone for ``extra`` more steps in
            the same processes (already compiled: no second start-up), on batches ``steps``,
            ``steps + 1``, ... Its result is then under the key ``"then"``: the same schedule
            trained ``steps + extra`` steps from the start, with the loss of every step.

    Returns:
        ``{name: TrainResult}`` in the order given. ``step_seconds`` are each step's wall time on
        its slowest rank (from the parent's word to the end of that rank's AdamW update);
        ``timelines`` are aligned across ranks; the gradient check compares step 0 with the
        unpartitioned model (in this process); ``params`` and the test accuracy are the trained
        model's.

    Raises:
        ValueError: no schedules, duplicate names, differing rank or microbatch counts, fewer
            than 2 steps, clipping requested, a batch that does not divide, or ``parts`` naming
            an unknown schedule or holding a partition that is not one of this model.
        RuntimeError: a rank's process failed (its error is printed by that process and named).
    """
    from .reference import evaluate, max_relative_error, reference_grads
    from .train import _checked_schedule

    config, run = model or ModelConfig(), run or RunConfig()
    schedules = list(schedules)
    names = [s.name or f"schedule {i}" for i, s in enumerate(schedules)]
    if not schedules:
        raise ValueError("train_in_turns needs at least one schedule")
    if len(set(names)) != len(names):
        raise ValueError(f"schedules run in turns need distinct names, got {names}")
    if len({(s.num_ranks, s.num_microbatches) for s in schedules}) != 1:
        raise ValueError("schedules run in turns need the same numbers of ranks and microbatches, got "
                         + ", ".join(f"{n}: p={s.num_ranks} m={s.num_microbatches}" for n, s in zip(names, schedules)))
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2 (the first compiles), got {steps!r}")
    if run.max_grad_norm is not None:
        raise ValueError("max_grad_norm runs the optimizer inside the rank threads: use train() (threads) for clipping")
    for s in schedules:
        _checked_schedule(s, s.num_ranks, s.num_microbatches, steps, config, run, None)
    cuts = {}
    for n, cut in (parts or {}).items():
        if n not in names:
            raise ValueError(f"parts names {n!r}, which is not one of the schedules {names}")
        s = schedules[names.index(n)]
        cuts[n] = [list(stage) for stage in check_parts(cut, config.blocks + 2, s.num_stages)]
    p = schedules[0].num_ranks
    data = data if data is not None else load_digits(run.holdout, run.seed)
    spec = {"schedules": {n: schedule_to_json(s) for n, s in zip(names, schedules)},
            "model": {"d": config.d, "heads": config.heads, "blocks": config.blocks, "seed": config.seed},
            "parts": cuts,
            "run": {"batch": run.batch, "lr": run.lr, "weight_decay": run.weight_decay, "seed": run.seed,
                    "holdout": run.holdout, "init": None if run.init is None else str(run.init)}}
    record = {n: {"losses": [], "timelines": [], "seconds": [], "grads": None} for n in names}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps * len(names), desc=f"{len(names)} schedules in turns, p={p}", leave=False)
    with RankProcesses(ENTRY, p, spec, pin=pin) as ranks:
        for k in range(steps):
            # there and back: even steps in the order given, odd ones reversed, so that
            # neighbours in the order stay a step apart and no place in the round is favoured
            for n, s in (zip(names, schedules) if k % 2 == 0 else reversed(list(zip(names, schedules)))):
                replies = _step(ranks, n, s, k, k == 0 and run.check_grads, record[n])
                loss, timeline = record[n]["losses"][-1], record[n]["timelines"][-1]
                if k == 0 and run.check_grads:
                    record[n]["grads"] = _stage_leaves(replies, "grads")
                if bar is not None:
                    bar.update()
                    bar.set_postfix_str(f"{n} loss {loss:.4f}")
                if on_step is not None:
                    on_step(n, k, loss, timeline)
        finals = {}
        for n in names:
            ranks.broadcast({"op": "params", "schedule": n})
            finals[n] = _stage_leaves(ranks.gather(), "params")
        chosen = then({n: list(record[n]["seconds"]) for n in names}) if then is not None else None
        if chosen is not None and chosen[1] > 0:
            n, extra = chosen
            s = schedules[names.index(n)]
            rec = {**record[n], "losses": list(record[n]["losses"]), "timelines": [], "seconds": [], "grads": None}
            if bar is not None:
                bar.close()
                from tqdm.auto import tqdm

                bar = tqdm(total=extra, desc=f"training {n} on", leave=False)
            for k in range(steps, steps + extra):
                _step(ranks, n, s, k, False, rec)
                if bar is not None:
                    bar.update()
                    bar.set_postfix_str(f"loss {rec['losses'][-1]:.4f}")
            ranks.broadcast({"op": "params", "schedule": n})
            record["then"], finals["then"] = rec, _stage_leaves(ranks.gather(), "params")
    if bar is not None:
        bar.close()
    once: list = []  # every schedule starts from the same parameters on batch 0: one reference for all

    def reference_once(*args):
        if not once:
            once.append(reference_grads(*args))
        return once[0]

    results = {n: _result(n, s, record[n], finals[n], config, run, data, p, pin, evaluate, max_relative_error, reference_once,
                          cuts.get(n))
               for n, s in zip(names, schedules)}
    if "then" in record:
        n = chosen[0]
        results["then"] = _result(n, schedules[names.index(n)], record["then"], finals["then"], config, run, data, p, pin, evaluate,
                                  max_relative_error, reference_once, cuts.get(n))
    return results


def _result(name, schedule, rec, final_stages, config, run, data, p, pin, evaluate, max_relative_error, reference_grads,
            cut=None) -> TrainResult:
    import jax

    from ..analysis.profiling.timelines import measured_costs
    from ..runtime.stages import StagedModel
    from .model import build_parts, load_torch_init

    staged = StagedModel(build_parts(config), schedule.num_stages, parts=cut)
    initial = load_torch_init(run.init, config) if run.init is not None else staged.params

    def assemble(per_stage: dict[int, list]) -> list:
        out = list(initial)
        for s, leaves in per_stage.items():
            like = staged.stage_params(initial, s)
            for i, part in zip(staged.parts[s], jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)):
                out[i] = part
        return out

    grad_error = loss_error = None
    if rec["grads"] is not None:
        x, y = data.batch(0, run.batch)
        ref_loss, ref_grads = reference_grads(staged, initial, x, y, jax.devices()[0])
        grad_error = max_relative_error(assemble(rec["grads"]), ref_grads)  # every stage is some rank's
        loss_error = abs(rec["losses"][0] - ref_loss)
    final = assemble(final_stages)
    test_loss, test_accuracy = evaluate(staged, final, data.test_x, data.test_y)
    measured = _pick_measured(rec["timelines"])
    costs = measured_costs(measured, schedule.num_stages)
    cores = allowed_cores()
    return TrainResult(
        schedule=schedule, losses=rec["losses"], test_accuracy=test_accuracy, test_loss=test_loss,
        grad_max_rel_error=grad_error, loss_error=loss_error, measured=measured, costs=costs,
        simulated=simulate(schedule, costs), timelines=rec["timelines"], step_seconds=rec["seconds"], params=final,
        config={**settings_json(config, run),
                "devices": [f"rank {r}: own process, " + (f"core {cores[r % len(cores)]}" if pin else "unpinned") for r in range(p)],
                "processes": "one per rank, pinned" if pin else "one per rank",
                "parts": [list(stage) for stage in staged.parts]},
    )
