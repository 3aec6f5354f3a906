"""Schedules trained side by side, one pinned process per rank, taking turns step by step
(:func:`train_in_turns`, how ``compare`` and ``train`` measure with a core per rank), and the one-core
helper process (:class:`OneCore`).

A rank pinned to its own core (:class:`~zbpp_lite.runtime.processes.RankProcesses`) leaves it idle
while waiting, as a device does, so measured bubbles are the schedule's. Every schedule has its own
model copy (same initial parameters) and AdamW state; step k of every schedule runs on batch k before
step k + 1 of any, so machine drift meets all alike. Ranks report events on the shared CLOCK_MONOTONIC,
by which the parent aligns timelines; step 0 compiles. Messages are typed JSON
(:mod:`~zbpp_lite.training.messages`), never unpickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from ..analysis.profiling.device import profile_stage_costs
from ..analysis.rebalance import check_parts
from ..runtime.devices import ensure_devices
from ..runtime.executor import PipelineExecutor
from ..runtime.processes import RankProcesses, allowed_cores, connect, disconnect
from ..runtime.stages import StagedModel
from ..schedules.costs import Costs
from ..schedules.ir import Action, Schedule
from ..schedules.memory import MeasuredMemory
from ..schedules.timeline import Event, Timeline
from .data import ByteText, Digits, data_json, load_data
from .messages import Message, parse
from .model import ModelConfig, RunConfig, build_parts, config_json, config_of, load_torch_init, settings_json
from .reference import evaluate, max_relative_error, reference_grads, step_dropout_keys, train_baseline
from .train import (ClippedAdamW, StageAdamW, TrainResult, checked_schedule, eval_due, guard_json,
                    job_microbatch, stage_optimizer, train_step, with_stage_leaves)

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
        raise ValueError(f"the schedule's rows place its stages {list(s.placement)}, "
                         f"not {list(d['placement'])}")
    return s


def _job_json(config: ModelConfig, run: RunConfig) -> dict:
    """The job's ``model`` and ``run`` settings as JSON for a helper process (their fields by name)."""
    return {"model": config_json(config),
            "run": {**dataclasses.asdict(run), "init": None if run.init is None else str(run.init)}}


def enough_cores(num_ranks: int) -> bool:
    """Whether this process may use at least ``num_ranks`` cores (one per rank)."""
    return len(allowed_cores()) >= num_ranks


# ----------------------------------------------------------------------------- the messages


@dataclass(frozen=True)
class Step(Message):
    """Parent to ranks: run step ``step`` (on batch ``step``) of ``schedule``; ``grads``: send them."""

    op = "step"
    schedule: str
    step: int
    grads: bool = False


@dataclass(frozen=True)
class Stepped(Message):
    """A rank's answer to :class:`Step`: wall times (to the end of AdamW) and the executor's, the last
    stage's microbatch losses, events ``[rank, action, start, end]`` and memory on the shared clock,
    with ``grads`` its gradient leaves ``{stage: [leaf]}``; a clipped run's ``guard``, the step's
    :attr:`~zbpp_lite.training.train.ClippedAdamW.reports` entry as this rank saw it."""

    op = "stepped"
    seconds: float
    run_seconds: float
    losses: list
    events: list
    memory: dict | None = None
    grads: dict | None = None
    guard: dict | None = None


@dataclass(frozen=True)
class GetParams(Message):
    """Parent to ranks: send ``schedule``'s current parameters."""

    op = "params"
    schedule: str


@dataclass(frozen=True)
class Params(Message):
    """A rank's answer to :class:`GetParams`: its stages' parameter leaves, ``{stage: [leaf]}``."""

    op = "params are"
    params: dict


# ----------------------------------------------------------------------------- a rank's process


def _rank_runs(rank: int, peers: dict, device, config: dict
               ) -> dict[str, tuple[Any, StageAdamW | ClippedAdamW]]:
    """Every schedule's executor for rank ``rank`` and the run's optimizer on its stages
    (:func:`~zbpp_lite.training.train.stage_optimizer`), each with its own state."""
    run = RunConfig(**config["run"])
    schedules = {name: schedule_from_json(d) for name, d in config["schedules"].items()}
    model_config = config_of(config["model"])
    cuts = config.get("parts") or {}  # {name: partition} for the schedules not cut the default way
    counts = sorted({s.num_stages for s in schedules.values()})
    shared = {S: StagedModel(build_parts(model_config), S) for S in counts}
    models = {name: StagedModel(build_parts(model_config), s.num_stages, parts=cuts[name]) if cuts.get(name)
              else shared[s.num_stages] for name, s in schedules.items()}
    initial = load_torch_init(run.init, model_config) if run.init else next(iter(shared.values())).params

    def executor(name: str, s: Schedule) -> Callable:
        return lambda link: PipelineExecutor(models[name], s, [device], ranks=[rank], transport=link)

    executors = connect(peers, {name: executor(name, s) for name, s in schedules.items()})
    runs = {}
    for name, executor in executors.items():
        params = [jax.device_put(p, device) for p in initial]
        homes = dict.fromkeys(executor.local_stages, device)
        optimizer = stage_optimizer(executor, params, run, homes)
        optimizer.warm_up()
        runs[name] = executor, optimizer
    return runs


def _leaves(tree) -> list:
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(tree)]


def _memory_json(memory, rank: int, at: float) -> dict:
    """This rank's activation-memory curves on the shared clock, its stages' M_B and M_W."""
    return {"held": [[at + s, b] for s, b in memory.held[rank]],
            "received": [[at + s, b] for s, b in memory.received[rank]],
            "mem_b": list(memory.mem_b), "mem_w": list(memory.mem_w),
            "device_peak": memory.device_peak[rank] if len(memory.device_peak) > rank else None}


def _rank_step(executor, adamw: StageAdamW | ClippedAdamW, rank: int, command: Step, batch, seed: int
               ) -> Stepped:
    """One step of one schedule on this rank: :func:`~zbpp_lite.training.train.train_step` (dropout keys
    from the run's ``seed``)."""
    keys = step_dropout_keys(executor.model, seed, command.step, executor.schedule.num_microbatches)
    result, seconds, ran = train_step(executor, adamw, *batch, keys)
    at, memory = result.started_at, result.timeline.measured_memory
    grads = {str(s): _leaves(executor.model.stage_params(result.grads, s)) for s in executor.local_stages}
    return Stepped(
        seconds=seconds, run_seconds=ran, losses=list(result.microbatch_losses),
        events=[[e.rank, str(e.action), at + e.start, at + e.end] for e in result.timeline.events],
        memory=None if memory is None else _memory_json(memory, rank, at),
        grads=grads if command.grads else None,
        guard=adamw.reports[-1] if isinstance(adamw, ClippedAdamW) else None)


def rank_main(rank: int, peers: dict, control, config: dict) -> None:
    """One pipeline rank process: steps on the parent's word (:class:`Step`, :class:`GetParams`)."""
    device = ensure_devices(1)[0]
    runs = _rank_runs(rank, peers, device, config)
    run = RunConfig(**config["run"])
    data = load_data(config_of(config["model"]), run)
    while (message := control.recv()) is not None:
        command = parse(message, Step, GetParams)
        executor, adamw = runs[command.schedule]
        if isinstance(command, GetParams):
            reply = Params({str(s): _leaves(p) for s, p in adamw.stage_params().items()})
        else:
            batch = data.batch(command.step, config["run"]["batch"])
            reply = _rank_step(executor, adamw, rank, command, batch, run.seed)
        control.send(reply.to_wire())
    disconnect(peers)


# ----------------------------------------------------------------------------- the parent


def _aligned(replies: list[Stepped], num_ranks: int, num_stages: int) -> Timeline:
    """One timeline from every rank's events and memory, counted from the step's first action."""
    origin = min(t0 for rep in replies for _, _, t0, _ in rep.events)
    events = [Event(r, Action.from_str(a), t0 - origin, t1 - origin)
              for rep in replies for r, a, t0, t1 in rep.events]
    timeline = Timeline.from_events(events, num_ranks, num_stages=num_stages, source="measured")
    if all(rep.memory is not None for rep in replies):
        mem = [rep.memory for rep in replies]  # rank order
        curve = lambda points: tuple((max(t - origin, 0.0), int(b)) for t, b in points)  # noqa: E731
        memory = MeasuredMemory(held=tuple(curve(m["held"]) for m in mem),
                                received=tuple(curve(m["received"]) for m in mem),
                                mem_b=tuple(max(m["mem_b"][s] for m in mem) for s in range(num_stages)),
                                mem_w=tuple(max(m["mem_w"][s] for m in mem) for s in range(num_stages)),
                                device_peak=tuple(m["device_peak"] for m in mem))
        timeline = replace(timeline, measured_memory=memory)
    return timeline


@dataclass
class _Record:
    """What the parent keeps of one schedule's steps."""

    schedule: Schedule
    losses: list = field(default_factory=list)
    timelines: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    grads: dict | None = None  # step 0's gradient leaves per stage, when checked
    final: dict | None = None  # the trained parameter leaves per stage
    validation: list = field(default_factory=list)  # (steps done, held-out loss), taken between steps
    guard: list = field(default_factory=list)  # a clipped run's reports, one per step, every rank's merged


def _stage_leaves(replies: list, key: str) -> dict[int, list]:
    return {int(s): list(leaves) for rep in replies for s, leaves in getattr(rep, key).items()}


class _Turns:
    """The rank processes of a run in turns and the steps they take."""

    def __init__(self, ranks: RankProcesses, bar: tqdm):
        self.ranks, self.bar = ranks, bar

    def step(self, name: str, rec: _Record, k: int, grads: bool) -> None:
        """Step ``k`` of ``name`` on every rank; loss, timeline and wall time appended to ``rec``."""
        self.ranks.broadcast(Step(name, k, grads).to_wire())
        replies = [Stepped.from_wire(r) for r in self.ranks.gather()]
        rec.losses.append(float(np.mean(np.asarray(next(r.losses for r in replies if r.losses), np.float64))))
        rec.timelines.append(_aligned(replies, rec.schedule.num_ranks, rec.schedule.num_stages))
        rec.seconds.append(max(r.seconds for r in replies))
        if grads:
            rec.grads = _stage_leaves(replies, "grads")
        if replies[0].guard is not None:  # every rank saw the norm; each knows whether it rolled back
            rolled = sorted({r for rep in replies for r in rep.guard["rolled_back"]})
            rec.guard.append({**replies[0].guard, "rolled_back": rolled})
        self.bar.update()
        self.bar.set_postfix_str(f"{name} loss {rec.losses[-1]:.4f}")

    def params(self, name: str) -> dict[int, list]:
        self.ranks.broadcast(GetParams(name).to_wire())
        return _stage_leaves([Params.from_wire(r) for r in self.ranks.gather()], "params")


class InTurns(dict):
    """``{name: TrainResult}`` in the order given; :attr:`then`: the schedule ``then`` chose (or None)."""

    then: TrainResult | None = None


def _checked(schedules: Sequence[Schedule], steps: int, config: ModelConfig, run: RunConfig,
             parts) -> tuple[list, dict]:
    """The schedules' names and the partitions asked for, once everything is checked."""
    names = [s.name or f"schedule {i}" for i, s in enumerate(schedules)]
    if not schedules:
        raise ValueError("train_in_turns needs at least one schedule")
    if len(set(names)) != len(names):
        raise ValueError(f"schedules run in turns need distinct names, got {names}")
    if len({(s.num_ranks, s.num_microbatches) for s in schedules}) != 1:
        raise ValueError("schedules run in turns need the same numbers of ranks and microbatches, got "
                         + ", ".join(f"{n}: p={s.num_ranks} m={s.num_microbatches}"
                                     for n, s in zip(names, schedules)))
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2 (the first compiles), got {steps!r}")
    for s in schedules:
        checked_schedule(s, s.num_ranks, s.num_microbatches, steps, config, run, None)
    cuts = {}
    for n, cut in (parts or {}).items():
        if n not in names:
            raise ValueError(f"parts names {n!r}, which is not one of the schedules {names}")
        checked = check_parts(cut, config.blocks + 2, schedules[names.index(n)].num_stages)
        cuts[n] = [list(stage) for stage in checked]
    return names, cuts


def train_in_turns(schedules: Sequence[Schedule], steps: int, *, model: ModelConfig | None = None,
                   run: RunConfig | None = None, data: Digits | ByteText | None = None,
                   on_step: Callable[[str, int, float, Timeline], None] | None = None,
                   parts: dict[str, Sequence[Sequence[int]]] | None = None,
                   then: Callable[[dict[str, list[float]]], tuple[str, int] | None] | None = None) -> InTurns:
    """Train every schedule ``steps`` (>= 2) steps taking turns, one process per rank: step k in the
    order given for even k, reversed for odd k.

    Args:
        schedules: distinct names, same ranks and microbatches (stage counts may differ).
        model, run, data: as for :func:`~zbpp_lite.training.train.train`.
        on_step: called with (schedule name, step, loss, timeline).
        parts: ``{name: partition}`` for schedules not cut by :func:`~zbpp_lite.runtime.stages.stage_parts`
            (``partition[s]``: part indices of stage s, 0 the embedding, blocks + 1 the head).
        then: called with ``{name: step seconds}``; may return ``(name, extra)`` to train that schedule
            ``extra`` more steps alone in the same processes (:attr:`InTurns.then`); with ``then``, the
            held-out loss (``run.eval_every``) is taken between steps of that run only, from ``steps`` on.

    Returns:
        :class:`InTurns`: ``step_seconds`` on the slowest rank (to the end of AdamW), ``timelines``
        aligned across ranks, step 0 checked against the unpartitioned model.

    Raises:
        ValueError: no schedules, duplicate names, differing rank or microbatch counts, < 2 steps,
            a batch that does not divide, or ``parts`` naming an unknown schedule or a bad partition.
        RuntimeError: a rank's process failed (its error is printed by that process).
    """
    config, run = model or ModelConfig(), run or RunConfig()
    schedules = list(schedules)
    names, cuts = _checked(schedules, steps, config, run, parts)
    p = schedules[0].num_ranks
    data = data if data is not None else load_data(config, run)
    spec = {"schedules": {n: schedule_to_json(s) for n, s in zip(names, schedules)}, "parts": cuts,
            **_job_json(config, run)}
    records = {n: _Record(s) for n, s in zip(names, schedules)}
    finish = _Finish(config, run, data, p)
    bar = tqdm(total=steps * len(names), desc=f"{len(names)} schedules in turns, p={p}", leave=False,
               disable=not run.progress)
    # rank r on the r-th allowed core (:func:`enough_cores`)
    with RankProcesses(ENTRY, p, spec, pin=True) as ranks:
        turns = _Turns(ranks, bar)

        def validate(n: str, rec: _Record, done: int, total: int) -> None:  # the curve's points
            if eval_due(run, done, total) and done > 0:
                rec.validation.append((done, finish.held_out(rec.schedule, cuts.get(n), turns.params(n))))

        for k in range(steps):
            # there and back: even steps in the order given, odd ones reversed, so that
            # neighbours in the order stay a step apart and no place in the round is favoured
            for n in (names if k % 2 == 0 else names[::-1]):
                turns.step(n, records[n], k, k == 0 and run.check_grads)
                if then is None:  # else only the run chosen to go on is drawn
                    validate(n, records[n], k + 1, steps)
                if on_step is not None:
                    on_step(n, k, records[n].losses[-1], records[n].timelines[-1])
        for n in names:
            records[n].final = turns.params(n)
        chosen = then({n: list(records[n].seconds) for n in names}) if then is not None else None
        go_on = chosen is not None and chosen[1] > 0
        more = _go_on(turns, records, chosen, steps, run.progress, validate) if go_on else None
    turns.bar.close()
    results = InTurns((n, finish.result(records[n], cuts.get(n))) for n in names)
    if more is not None:
        results.then = finish.result(more, cuts.get(chosen[0]))
    return results


def _go_on(turns: _Turns, records: dict[str, _Record], chosen: tuple[str, int], steps: int,
           progress: bool, validate: Callable) -> _Record:
    """``then``'s choice trained ``extra`` more steps alone (losses and held-out points from the start,
    timings of the extra); ``validate(name, record, steps done, steps in all)`` after each step."""
    n, extra = chosen
    rec = _Record(records[n].schedule, losses=list(records[n].losses),
                  validation=[(k, v) for k, v in records[n].validation if k <= steps],
                  guard=list(records[n].guard))
    turns.bar.close()
    turns.bar = tqdm(total=extra, desc=f"training {n} on", leave=False, disable=not progress)
    validate(n, rec, steps, steps + extra)
    for k in range(steps, steps + extra):
        turns.step(n, rec, k, False)
        validate(n, rec, k + 1, steps + extra)
    rec.final = turns.params(n)
    return rec


class _Finish:
    """The parent's side: the gradient check (one reference: all start alike), test accuracy, the
    measured step and its simulation."""

    def __init__(self, config: ModelConfig, run: RunConfig, data: Digits | ByteText, num_ranks: int):
        self.config, self.run, self.data, self.num_ranks = config, run, data, num_ranks
        self.reference = None  # (loss, gradients) of the unpartitioned model on batch 0, computed once
        self.models: dict = {}  # (stages, cut) -> StagedModel
        self.initial_loss = None  # held-out loss of the initial parameters (all start alike), computed once

    def _staged(self, schedule: Schedule, cut) -> StagedModel:
        key = (schedule.num_stages, None if cut is None else tuple(map(tuple, cut)))
        if key not in self.models:
            self.models[key] = StagedModel(build_parts(self.config), schedule.num_stages, parts=cut)
        return self.models[key]

    def held_out(self, schedule: Schedule, cut, leaves: dict | None = None) -> float:
        """The held-out loss of ``schedule``'s parameters ``leaves`` (``{stage: [leaf]}``; None: the initial
        ones)."""
        staged = self._staged(schedule, cut)
        initial = load_torch_init(self.run.init, self.config) if self.run.init is not None else staged.params
        params = initial if leaves is None else with_stage_leaves(staged, initial, leaves)
        return evaluate(staged, params, self.data.test_x, self.data.test_y)[0]

    def result(self, rec: _Record, cut=None) -> TrainResult:
        config, run, schedule = self.config, self.run, rec.schedule
        staged = self._staged(schedule, cut)
        initial = load_torch_init(run.init, config) if run.init is not None else staged.params
        grad_error = loss_error = None
        if rec.grads is not None:  # every stage is some rank's
            if self.reference is None:
                x, y = self.data.batch(0, run.batch)
                keys = step_dropout_keys(staged, run.seed, 0, schedule.num_microbatches)
                self.reference = reference_grads(staged, initial, x, y, jax.devices()[0], keys)
            ref_loss, ref_grads = self.reference
            grad_error = max_relative_error(with_stage_leaves(staged, initial, rec.grads), ref_grads)
            loss_error = abs(rec.losses[0] - ref_loss)
        final = with_stage_leaves(staged, initial, rec.final)
        tested = evaluate(staged, final, self.data.test_x, self.data.test_y)
        cores = allowed_cores()
        settings = {**settings_json(config, run), **data_json(self.data),
                    "devices": [f"rank {r}: own process, core {cores[r % len(cores)]}"
                                for r in range(self.num_ranks)],
                    "processes": "one per rank, pinned", "parts": [list(stage) for stage in staged.parts],
                    **guard_json(run, rec.guard)}
        errors = (grad_error, loss_error)
        result = TrainResult.of(schedule, (rec.losses, rec.timelines, rec.seconds), final, errors, tested,
                                settings)
        if run.eval_every > 0:
            if self.initial_loss is None:
                self.initial_loss = self.held_out(schedule, cut)
            result.validation = [(0, self.initial_loss), *rec.validation, (len(rec.losses), result.test_loss)]
        return result


# ----------------------------------------------------------------------------- one core


ONE_CORE_ENTRY = "zbpp_lite.training.turns:one_core_main"


@dataclass(frozen=True)
class OneCoreJob(Message):
    """To :class:`OneCore`'s helper: ``what`` "costs" (T_F, T_B, T_W, T_BW per stage in seconds, M_B,
    M_W in bytes, of the job cut into ``stages`` stages) or "whole batch" (the seconds of each of
    ``steps`` whole-batch jitted steps accumulating the job's microbatches,
    :func:`~zbpp_lite.training.reference.train_baseline`)."""

    op = "one core"
    what: str
    stages: int = 1
    steps: int = 0


@dataclass(frozen=True)
class OneCoreAnswer(Message):
    """The answer to :class:`OneCoreJob`: ``values``, the Costs fields or ``step_seconds``."""

    op = "one core answer"
    values: dict


class OneCore:
    """Single-device work (stage costs, the whole-batch reference) in a helper process pinned to one
    core from its start, so XLA sizes its pool for it (pinned later: passes 10-35% slower on 2 cores).
    Started on first use, stopped on leaving the ``with`` block; the job is ``model``, ``run`` and
    ``microbatches``; with ``use_processes`` false the work runs in this process."""

    def __init__(self, model: ModelConfig, run: RunConfig, microbatches: int, use_processes: bool):
        self.job = {**_job_json(model, run), "microbatches": microbatches}
        self.use_processes, self.helper = use_processes, None

    def __enter__(self) -> "OneCore":
        return self

    def __exit__(self, kind, *exc) -> None:
        if self.helper is not None:
            self.helper.close(timeout=30.0 if kind is None else 0.0)  # on an error or Ctrl-C: at once
            self.helper = None

    def _ask(self, job: OneCoreJob, device=None) -> dict:
        if not self.use_processes:
            with one_core(pin=job.what == "whole batch"):
                return _one_core_work(job, self.job, device)
        if self.helper is None:
            self.helper = RankProcesses(ONE_CORE_ENTRY, 1, self.job, pin=True)
        self.helper.broadcast(job.to_wire())
        return OneCoreAnswer.from_wire(self.helper.gather()[0]).values

    def costs(self, num_stages: int) -> Costs:
        """The job's stage costs cut into ``num_stages`` stages, as the planners use them."""
        return Costs(**self._ask(OneCoreJob("costs", stages=num_stages)))

    def whole_batch(self, steps: int, device=None) -> list[float]:
        """Step seconds of the whole batch as one jitted step on one core, every step; the step
        accumulates the job's microbatches one after another (a ``scan``), the fastest single-device
        form on XLA:CPU: one microbatch's activations stay in the caches where the whole batch's leave
        them (``docs/XLA_BACKWARD.md``)."""
        return self._ask(OneCoreJob("whole batch", steps=steps), device)["step_seconds"]


def one_core_main(rank: int, peers: dict, control, config: dict) -> None:
    """:class:`OneCore`'s helper: :class:`OneCoreJob` -> :class:`OneCoreAnswer`."""
    device = ensure_devices(1)[0]
    while (message := control.recv()) is not None:
        job = parse(message, OneCoreJob)
        control.send(OneCoreAnswer(_one_core_work(job, config, device)).to_wire())


def _one_core_work(job: OneCoreJob, config: dict, device) -> dict:
    model, run = config_of(config["model"]), RunConfig(**config["run"])
    if job.what == "costs":
        staged, x, y = job_microbatch(job.stages, config["microbatches"], model, run)
        costs = profile_stage_costs(staged, x, y, repeats=15, fused=True)
        return {k: list(getattr(costs, k)) for k in ("f", "b", "w", "bw", "mem_b", "mem_w")}
    step = train_baseline(job.steps, model=model, run=run, microbatches=config["microbatches"], device=device)
    return {"step_seconds": step.step_seconds}


@contextlib.contextmanager
def one_core(pin: bool = True):
    """This process on its first allowed core while the block runs (no-op if not ``pin`` or unknown)."""
    affinity = os.sched_getaffinity(0) if pin and hasattr(os, "sched_getaffinity") else None

    def every_thread(cores) -> None:  # Linux sets a thread's affinity, not a process's: each of them
        tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
        for tid in tasks:
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:  # a thread that ended meanwhile
                pass

    try:
        if affinity:
            every_thread({min(affinity)})
        yield
    finally:
        if affinity:
            every_thread(affinity)
