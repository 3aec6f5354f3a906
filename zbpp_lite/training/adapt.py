"""Detect and remove bubbles in a real run: profile, attribute, rebalance, re-plan, train (JAX).

:func:`adapt` (``python -m zbpp_lite adapt``): 1. *before*: ZB-H1 steps on the original partition
(last stage ``imbalance`` times the blocks, :func:`~zbpp_lite.analysis.rebalance.imbalanced_parts`);
2. *detect*: per-stage T_F, T_B, T_W, T_comm (:func:`~zbpp_lite.analysis.profiling.timelines.profile`),
idle gaps by cause (:func:`~zbpp_lite.analysis.attribute.attribute`); 3. *rebalance*: parts timed alone,
calibrated, the partition with the smallest largest stage
(:func:`~zbpp_lite.analysis.rebalance.best_partition`); 4. *re-plan*: zb-auto under the memory limit
(:func:`~zbpp_lite.analysis.replan.replan`) with moved parts' costs shifted; 5. *after*, re-planned online
when costs drift (:class:`~zbpp_lite.analysis.replan.OnlineReplanner`). Steps 1-4 are one path; only step
5 differs by transport: rank threads train on (same parameters and AdamW state), adopting changes predicted
``min_gain`` better; pinned processes run the plans in turns and adopt those measured faster beyond the
noise. The first step of every plan is checked against the unpartitioned model's gradients.
Source: Qi et al., arXiv 2401.10241, sections 2-3.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Sequence

import jax

from ..analysis.attribute import Attribution, attribute
from ..analysis.noise import PairedGain, beats_noise, paired_gain
from ..analysis.profiling.parts import profile_parts
from ..analysis.profiling.timelines import CostProfile, profile, timed_steps
from ..analysis.rebalance import (PartCosts, Parts, best_partition, calibrate, imbalanced_parts, moved_costs,
                                  partition_cost)
from ..analysis.replan import OnlineReplanner, replan
from ..runtime.devices import ensure_devices
from ..runtime.executor import PipelineExecutor
from ..runtime.stages import StagedModel, microbatch_size
from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.ir import Schedule
from ..schedules.timeline import Timeline
from .data import Digits, load_digits
from .model import ModelConfig, RunConfig, build_parts, settings_json
from .reference import evaluate
from .train import StageAdamW, check_step, pick_measured, train_step
from .turns import enough_cores, train_in_turns


@dataclass
class Phase:
    """One stretch of training with one partition (``parts[s]``: module indices of stage s): every step's
    schedule, measured timeline and mean loss; ``grad_max_rel_error`` (worst max|g - g_ref| / max|g_ref|)
    and ``loss_error`` over the checked steps vs the unpartitioned model (None when not checked)."""

    parts: Parts
    schedules: list[Schedule] = field(default_factory=list)
    timelines: list[Timeline] = field(default_factory=list, repr=False)
    losses: list[float] = field(default_factory=list)
    grad_max_rel_error: float | None = None
    loss_error: float | None = None

    @property
    def makespan(self) -> float:
        """Median makespan (seconds), the phase's first step left out."""
        return statistics.median(t.makespan for t in timed_steps(self.timelines))

    @property
    def bubble_rate(self) -> float:
        """Median bubble rate, the phase's first step left out."""
        return statistics.median(t.bubble_rate for t in timed_steps(self.timelines))

    @property
    def measured(self) -> Timeline:
        """The step with the median makespan (after the phase's first)."""
        return pick_measured(self.timelines)

    @property
    def measured_schedule(self) -> Schedule:
        """The schedule that produced :attr:`measured`."""
        chosen = self.measured
        return next(s for s, t in zip(self.schedules, self.timelines) if t is chosen)

    def to_json(self) -> dict:
        return {
            "parts": [list(p) for p in self.parts], "schedule": self.schedules[-1].name or "custom",
            "makespan": self.makespan, "bubble_rate": self.bubble_rate,
            "grad_max_rel_error": self.grad_max_rel_error, "loss_error": self.loss_error,
            "steps": [{"loss": loss, "makespan": t.makespan, "bubble_rate": t.bubble_rate,
                       "schedule": s.name or "custom"}
                      for loss, t, s in zip(self.losses, self.timelines, self.schedules)],
        }


@dataclass
class AdaptResult:
    """What :func:`adapt` measured, found and changed.

    ``profile``: ``before``'s per-stage costs (seconds); ``attribution(_after)``: idle gaps of the median
    step by cause; ``part_costs``: calibrated per-part costs (seconds); ``changes``: dicts with ``kind``
    ("rebalance", "replan", "online-replan"), ``adopted``, ``why`` and the numbers (an online re-plan's
    ``step`` is its first step); ``online_checks``: ``step`` (last of the window, counted over both
    phases), ``drift``, ``decision``, ``gain``; ``comparison``/``control``: with processes, the paired
    after/before and A/A ratios.
    """

    before: Phase
    after: Phase
    profile: CostProfile
    attribution: Attribution
    attribution_after: Attribution
    part_costs: PartCosts
    changes: list[dict]
    online_checks: list[dict]
    test_accuracy: float
    test_loss: float
    config: dict
    comparison: PairedGain | None = None
    control: PairedGain | None = None
    profiled: Phase | None = None

    @property
    def makespan_ratio(self) -> float:
        """after / before makespan: the median step-by-step ratio with :attr:`comparison`, else the
        ratio of the phases' medians."""
        if self.comparison is not None:
            return self.comparison.ratio
        return self.after.makespan / self.before.makespan

    def to_json(self) -> dict:
        """JSON-ready dict (makespans in seconds)."""
        before, after = self.before.to_json(), self.after.to_json()
        before["costs"] = self.profile.to_json()
        before["attribution"] = self.attribution.to_json()
        after["attribution"] = self.attribution_after.to_json()
        optional = {"comparison": self.comparison, "control": self.control, "profiled": self.profiled}
        return {"before": before, "after": after, "makespan_ratio": self.makespan_ratio,
                "changes": self.changes, "online_checks": self.online_checks,
                "part_costs": self.part_costs.to_json(),
                "test_accuracy": self.test_accuracy, "test_loss": self.test_loss, "config": self.config,
                **{k: None if v is None else v.to_json() for k, v in optional.items()}}

    def report(self) -> str:
        """Closing lines: before / after, the changes, the gradient checks."""
        b, a = self.before, self.after
        lines = [f"{'':8}{'schedule':>10}{'partition (blocks per stage)':>32}{'makespan':>14}"
                 f"{'bubble rate':>13}"]
        for name, ph in (("before", b), ("after", a)):
            lines.append(f"{name:8}{ph.schedules[-1].name:>10}{str(_block_counts(ph.parts)):>32}"
                         f"{ph.makespan * 1e3:>11.2f} ms{ph.bubble_rate:>13.4f}")
        lines.append(f"after / before measured makespan: {self.makespan_ratio:.3f}")
        if self.comparison is not None:
            c = self.comparison
            lines.append(f"  step by step, taking turns: {c.text()}; gain {c.gain:+.1%}")
        if self.control is not None:
            lines.append(f"  noise: the same plan twice in the same run: {self.control.text()}")
        if not any(c["adopted"] for c in self.changes):
            lines.append("  nothing adopted: the plan after is the plan before; "
                         "a ratio away from 1 above is the run's noise")
        lines += [f"  {c['kind']}: {'adopted' if c['adopted'] else 'not adopted'} ({c['why']})"
                  for c in self.changes]
        lines += [f"gradient check {name} (first step of every plan) vs the unpartitioned model: "
                  f"max relative error {ph.grad_max_rel_error:.2e}, loss difference {ph.loss_error:.2e}"
                  for name, ph in (("before", b), ("after", a)) if ph.grad_max_rel_error is not None]
        return "\n".join(lines)


NOT_FASTER = "not adopted: not faster beyond the noise"


def _change(ok: bool, why: str, **record) -> dict:
    """A change record: ``tried`` (on rank threads also ``adopted``) when predicted ``min_gain`` better;
    in processes :func:`_judge` decides ``adopted`` from the measured steps."""
    return {**record, "adopted": ok, "tried": ok, "predicted_gain": record["gain"],
            "why": why + ("" if ok else "; not tried (no predicted gain of min_gain)")}


def _block_counts(parts: Parts) -> list[int]:
    n = sum(len(p) for p in parts)
    return [sum(1 for i in p if 0 < i < n - 1) for p in parts]


def default_blocks(num_stages: int, imbalance: float) -> int:
    """Default blocks: 2 per stage but the last, about ``2 * imbalance`` (>= 3 if imbalanced) on it."""
    if imbalance == 1:
        return 2 * num_stages
    return 2 * (num_stages - 1) + max(3, round(2 * imbalance))


@dataclass(frozen=True)
class AdaptOptions:
    """What :func:`adapt` runs, how it measures, and what it may change.

    ``steps``: *after* phase steps; ``profile_steps``: *before* phase (ZB-H1) steps, the first of each
    phase left out of medians. ``imbalance``: the original last stage holds this many times the blocks
    (1: even). ``memory_limit``: zb-auto's per-rank limit in units of one stage's M_B (default p).
    ``every, threshold, patience, min_gain``: the :class:`~zbpp_lite.analysis.replan.OnlineReplanner`
    (``min_gain`` also gates rebalance and re-plan). ``margin``: a stage is slow above mean * (1 + margin).
    ``repeats``: timed calls per part. ``processes``: one pinned process per rank, plans taking turns,
    changes adopted only beyond the noise (default: no devices given, CPU backend, a core per rank);
    otherwise rank threads and predicted gains. ``control``: also run the original plan twice (A/A noise).
    ``confidence``: of the intervals in :mod:`zbpp_lite.analysis.noise`.

    Raises:
        ValueError: p < 2, m < 1, steps or profile_steps < 2, imbalance < 1, confidence outside (0, 1),
            margin < 0, or bad online settings.
    """

    ranks: int = 2
    microbatches: int = 8
    steps: int = 20
    imbalance: float = 2.0
    profile_steps: int = 6
    memory_limit: float | None = None
    every: int = 10
    threshold: float = 0.15
    patience: int = 2
    min_gain: float = 0.03
    margin: float = 0.1
    rebalance: bool = True
    replan_schedule: bool = True
    online: bool = True
    repeats: int = 7
    processes: bool | None = None
    control: bool = True
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or self.ranks < 2:
            raise ValueError(f"adapt needs at least 2 ranks (a pipeline to balance), got {self.ranks!r}")
        if self.steps < 2 or self.profile_steps < 2:
            raise ValueError("steps and profile_steps must be >= 2 (the first step of a phase is not timed), "
                             f"got {self.steps}, {self.profile_steps}")
        if not self.imbalance >= 1:
            raise ValueError(f"the imbalance factor must be >= 1 (1 = even stages), got {self.imbalance}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must lie in (0, 1), got {self.confidence}")
        if not self.margin >= 0:
            raise ValueError(f"margin must be >= 0 (a stage is slow above mean * (1 + margin)), "
                             f"got {self.margin}")
        # checks the online settings
        self.replanner(build_schedule("zb-h1", self.ranks, self.microbatches), Costs())

    def replanner(self, schedule: Schedule, costs: Costs) -> OnlineReplanner:
        """The online re-planner with these settings, starting at ``schedule`` planned on ``costs``."""
        return OnlineReplanner(schedule, costs, self.every, self.threshold, self.patience, self.min_gain,
                               self.memory_limit, confidence=self.confidence)

    def to_json(self, config: ModelConfig, run: RunConfig) -> dict:
        """The settings as :attr:`AdaptResult.config` records them."""
        keys = ("ranks", "microbatches", "steps", "profile_steps", "imbalance", "memory_limit", "every",
                "threshold", "patience", "min_gain", "margin", "confidence")
        return {**settings_json(config, run), **{k: getattr(self, k) for k in keys}}


def adapt_settings(options: AdaptOptions | None = None, model: ModelConfig | None = None,
                   run: RunConfig | None = None, **settings) -> tuple[AdaptOptions, ModelConfig, RunConfig]:
    """The three configs (defaults where None) with ``settings`` applied by field name (``seed`` sets
    model's and run's); blocks default to :func:`default_blocks`. Checked before any compute.

    Raises:
        TypeError: a setting that is no field of the three. ValueError: as the three check, too few
            blocks for the imbalance, a batch that does not divide into microbatches.
    """
    groups = {cls: {k: v for k, v in settings.items() if k in {f.name for f in fields(cls)}}
              for cls in (AdaptOptions, ModelConfig, RunConfig)}
    unknown = set(settings) - {k for g in groups.values() for k in g}
    if unknown:
        raise TypeError(f"adapt got unknown setting(s) {sorted(unknown)}")
    options = replace(options or AdaptOptions(), **groups[AdaptOptions])
    model_settings = {k: v for k, v in groups[ModelConfig].items() if not (k == "blocks" and v is None)}
    if model is None and "blocks" not in model_settings:
        model_settings["blocks"] = default_blocks(options.ranks, options.imbalance)
    model = replace(model or ModelConfig(), **model_settings)
    run = replace(run or RunConfig(), **groups[RunConfig])
    imbalanced_parts(model.blocks, options.ranks, options.imbalance)  # ValueError naming the blocks needed
    microbatch_size(run.batch, options.microbatches)
    return options, model, run


def adapt(options: AdaptOptions | None = None, *, model: ModelConfig | None = None,
          run: RunConfig | None = None, devices: Sequence[Any] | None = None, data: Digits | None = None,
          on_step: Callable[[str, int, float, Timeline], None] | None = None, **settings) -> AdaptResult:
    """Profile, detect, rebalance, re-plan, then train (see the module docstring).

    ``model``/``run`` as for :func:`zbpp_lite.training.train.train`; ``devices``: one per rank (given
    devices mean rank threads); ``data``: default ``load_digits(run.holdout, run.seed)``; ``on_step(phase,
    step, loss, timeline)``; ``settings``: any config field by name (:func:`adapt_settings`).

    Raises:
        ValueError: as :func:`adapt_settings`, before any compute. RuntimeError: too few devices, or a
            rank's process failed.
    """
    options, config, run = adapt_settings(options, model, run, **settings)
    data = data if data is not None else load_digits(run.holdout, run.seed)
    processes = options.processes
    if processes is None:
        processes = devices is None and jax.default_backend() == "cpu" and enough_cores(options.ranks)
    job = _Job(options, config, run, data, imbalanced_parts(config.blocks, options.ranks, options.imbalance),
               on_step)
    return job.adapt(None if processes else list(devices or ensure_devices(options.ranks)))


@dataclass
class _Job:
    """One adapt run's settings and inputs; its steps 1-4 are the same on rank threads and in processes."""

    options: AdaptOptions
    config: ModelConfig
    run: RunConfig
    data: Digits
    original: Parts
    on_step: Callable[[str, int, float, Timeline], None] | None

    def adapt(self, devices: list | None) -> AdaptResult:
        """Steps 1-5 on rank threads on ``devices``, or (None) in one pinned process per rank."""
        o, zb_h1 = self.options, build_schedule("zb-h1", self.options.ranks, self.options.microbatches)
        threads = _Threads(self, devices) if devices is not None else None
        # 1. before: ZB-H1 on the original partition
        plan = {"before": (self.original, zb_h1)}
        profiled = threads.run(plan, o.profile_steps) if threads else _phase(self, _in_turns(
            self, plan, "profile", o.profile_steps)["before"])
        # 2. detect
        measured = profile(timed_steps(profiled.timelines), o.ranks)
        found = attribute(profiled.measured, profiled.measured_schedule, measured.costs(), o.margin)
        # 3. rebalance, 4. re-plan from the measured costs, moved parts accounted for
        part_costs, changes, parts, predicted, schedule = self.candidates(
            measured, devices[0] if threads else jax.devices()[0], zb_h1)
        # 5. after: train on, re-planning online (threads), or judge the plans in turns (processes)
        if threads:
            kept = _after_in_threads(threads, profiled, (parts, schedule), predicted, changes)
        else:
            kept = _after_in_processes(self, profiled, (parts, schedule), predicted, changes)
        kept["config"] = {**o.to_json(self.config, self.run), **kept["config"]}
        after = kept["after"]
        return AdaptResult(
            profile=measured, attribution=found, part_costs=part_costs, changes=changes,
            attribution_after=attribute(after.measured, after.measured_schedule, None, o.margin), **kept)

    def candidates(self, measured: CostProfile, device: Any,
                   start: Schedule) -> tuple[PartCosts, list[dict], Parts, Costs, Schedule]:
        """Steps 3-4: every part timed alone on one microbatch, calibrated to the measured stage totals;
        (part costs, change records, partition, its predicted costs, schedule)."""
        o, original = self.options, self.original
        mb = microbatch_size(self.run.batch, o.microbatches)
        x0, y0 = self.data.batch(0, self.run.batch)
        staged = StagedModel(build_parts(self.config), o.ranks, parts=original)
        part_costs = calibrate(profile_parts(staged, x0[:mb], y0[:mb], device, o.repeats), original,
                               measured.costs())
        changes, parts, schedule = [], original, start
        if o.rebalance:
            candidate = best_partition(part_costs, o.ranks)
            now, new = (partition_cost(part_costs.totals, p) for p in (original, candidate))
            gain = 1 - new / now if now > 0 else 0.0
            ok = candidate != original and gain >= o.min_gain
            parts = candidate if ok else original
            changes.append(_change(
                ok, f"largest stage F+B+W {now * 1e3:.3f} -> {new * 1e3:.3f} ms predicted ({gain:.1%}), "
                    f"blocks per stage {_block_counts(original)} -> {_block_counts(candidate)}",
                kind="rebalance", predicted_largest_stage=new, current_largest_stage=now, gain=gain,
                **{"from": [list(p) for p in original], "to": [list(p) for p in candidate]}))
        predicted = moved_costs(part_costs, original, parts, measured.costs())
        if o.replan_schedule:
            result = replan(predicted, o.ranks, o.microbatches, o.memory_limit, current=start)
            ok = result.gain >= o.min_gain and result.schedule.actions != start.actions
            schedule = result.schedule if ok else start
            why = (f"zb-auto predicted {result.predicted * 1e3:.2f} ms vs zb-h1 "
                   f"{result.current * 1e3:.2f} ms ({result.gain:.1%})")
            changes.append(_change(
                ok, why,
                kind="replan", to=result.schedule.name, predicted_makespan=result.predicted,
                current_makespan=result.current, gain=result.gain, memory_limit=list(result.memory_limit),
                **{"from": start.name}))
        return part_costs, changes, parts, predicted, schedule


def _checks(replanner: OnlineReplanner | None, offset: int) -> list[dict]:
    """The online re-planner's checks, steps counted from 0 over both phases."""
    return [{"step": offset + c.step, "drift": c.drift, "decision": c.decision, "gain": c.gain}
            for c in (replanner.history if replanner else [])]


# ----------------------------------------------------------------------------- rank threads


class _Threads:
    """Rank threads of this process, one phase after the other; AdamW's state carried from partition to
    partition, the first step of every plan checked against the reference."""

    def __init__(self, job: _Job, devices: list):
        self.job, self.devices, self.step_no = job, devices, 0
        self.modules = build_parts(job.config)
        self.model = StagedModel(self.modules, job.options.ranks)
        self.adamw = StageAdamW(self.model.params, job.run)
        self.executor: PipelineExecutor | None = None

    def use(self, parts: Parts, schedule: Schedule) -> None:
        """Run the next steps with this partition and schedule."""
        if self.model.parts != [list(p) for p in parts]:
            self.model = StagedModel(self.modules, self.job.options.ranks, parts=parts)
        self.executor = PipelineExecutor(self.model, schedule, self.devices)
        self.adamw.place(self.model, dict(enumerate(self.executor.stage_devices)))

    def run(self, plan: dict[str, tuple[Parts, Schedule]], count: int,
            replanner: OnlineReplanner | None = None, changes: list[dict] | None = None) -> Phase:
        """``count`` steps of the one plan ``{name: (parts, schedule)}``; online re-plans recorded in
        ``changes``."""
        job, check = self.job, self.job.run.check_grads
        [(name, (parts, schedule))] = plan.items()
        phase = Phase(tuple(tuple(p) for p in parts))
        self.use(parts, schedule)
        for _ in range(count):
            x, y = job.data.batch(self.step_no, job.run.batch)
            before = list(self.adamw.params)
            result, _, _ = train_step(self.executor, self.adamw, x, y)
            if check:
                g_err, l_err = check_step(self.model, before, x, y, result, self.devices[0])
                phase.grad_max_rel_error = max(g_err, phase.grad_max_rel_error or 0.0)
                phase.loss_error = max(l_err, phase.loss_error or 0.0)
            check = False
            phase.schedules.append(self.executor.schedule)
            phase.timelines.append(result.timeline)
            phase.losses.append(result.loss)
            if job.on_step is not None:
                job.on_step(name, self.step_no, result.loss, result.timeline)
            self.step_no += 1
            new = replanner.observe(result.timeline) if replanner is not None else None
            if new is not None:
                changes.append(_online_change(new, replanner, adopted=True, step=self.step_no))
                changes[-1]["why"] += f"; predicted {new.gain:.1%} faster"
                self.use(phase.parts, new.schedule)
                check = job.run.check_grads
        return phase


def _after_in_threads(threads: _Threads, before: Phase, plan: tuple[Parts, Schedule], predicted: Costs,
                      changes: list[dict]) -> dict:
    """The changes adopted on their predicted gain, training going on with them: the result's fields."""
    job, o = threads.job, threads.job.options
    replanner = o.replanner(plan[1], predicted) if o.online else None
    after = threads.run({"after": plan}, o.steps, replanner, changes)
    test_loss, test_accuracy = evaluate(threads.model, threads.adamw.params, job.data.test_x,
                                        job.data.test_y, threads.devices[0])
    return {"before": before, "after": after, "online_checks": _checks(replanner, o.profile_steps - 1),
            "test_accuracy": test_accuracy, "test_loss": test_loss,
            "config": {"devices": [str(dev) for dev in threads.devices],
                       "measured": "rank threads of one process, one phase after the other"}}


# ----------------------------------------------------------------------------- one process per rank


def _phase(job: _Job, result, parts: Parts | None = None) -> Phase:
    """A :class:`Phase` from one plan's result in a run in turns (``parts``: default the original)."""
    return Phase(tuple(tuple(p) for p in parts or job.original), [result.schedule] * len(result.timelines),
                 list(result.timelines), list(result.losses), result.grad_max_rel_error, result.loss_error)


def _spans(result) -> list[float]:
    return [t.makespan for t in timed_steps(result.timelines)]


def _in_turns(job: _Job, plans: dict[str, tuple[Parts, Schedule]], phase: str, steps: int,
              offset: int = 0) -> dict:
    """``plans`` taking turns (:func:`~zbpp_lite.training.turns.train_in_turns`), each schedule named as
    its plan; ``on_step`` gets ``phase:plan`` and the steps counted from ``offset``."""
    def on_step(name: str, k: int, loss: float, timeline: Timeline) -> None:
        if job.on_step is not None:
            job.on_step(f"{phase}:{name}", offset + k, loss, timeline)

    return train_in_turns([replace(s, name=name) for name, (_, s) in plans.items()], steps,
                          model=job.config, run=job.run, data=job.data,
                          parts={name: p for name, (p, _) in plans.items()}, on_step=on_step)


def _after_in_processes(job: _Job, profiled: Phase, plan: tuple[Parts, Schedule], predicted: Costs,
                        changes: list[dict]) -> dict:
    """Every plan (original, A/A control, candidates predicted ``min_gain`` faster) taking turns in one
    run; a candidate adopted when its paired step makespans beat the noise (:func:`_judge`), an online
    re-plan judged likewise (:func:`_online`). ``after`` is the kept plan (nothing kept: the control, or
    the original). The result's fields."""
    o, (parts, schedule) = job.options, plan
    zb_h1 = build_schedule("zb-h1", o.ranks, o.microbatches)
    plans = {"before": (job.original, zb_h1)}
    if o.control:
        plans["control"] = (job.original, zb_h1)
    trials = [(c, PLANS[c["kind"]]) for c in changes if c["tried"]]
    plans.update({name: (parts, schedule if name == "re-planned" else zb_h1) for _, name in trials})
    results = _in_turns(job, plans, "judge", o.steps, o.profile_steps)
    spans = {name: _spans(r) for name, r in results.items()}
    noise = paired_gain(spans["before"], spans["control"], o.confidence) if o.control else None
    kept = _judge(trials, spans, noise, o.confidence)
    checks, kept_name = ([], kept)
    if o.online:
        checks, kept_name = _online(job, plans, results, kept, predicted, noise, changes)
    after_name = kept if kept != "before" else ("control" if o.control else "before")
    final = results[kept_name]
    return {"before": _phase(job, results["before"]), "profiled": profiled,
            "after": _phase(job, results[after_name], plans[after_name][0]), "online_checks": checks,
            "test_accuracy": final.test_accuracy, "test_loss": final.test_loss,
            "comparison": paired_gain(spans["before"], spans[after_name], o.confidence), "control": noise,
            "config": {"plans": list(plans), "kept": kept_name, "devices": final.config["devices"],
                       "measured": "one pinned process per rank, the plans taking turns step by step"}}


PLANS = {"rebalance": "rebalanced", "replan": "re-planned"}
"""The plan that tries each kind of change in a run in turns."""


def _judge(trials: list[tuple[dict, str]], spans: dict, noise: PairedGain | None, confidence: float,
           kept: str = "before") -> str:
    """Each tried change (its record, its plan) against the plan it would replace, in order; returns the
    kept plan's name."""
    for record, name in trials:
        judged = paired_gain(spans[kept], spans[name], confidence)
        adopted = beats_noise(judged, noise)
        record.update({"adopted": adopted, "measured_against": kept, "measured": judged.to_json(),
                       "gain": judged.gain, "noise": None if noise is None else noise.deviation})
        record["why"] += (f"; measured {name} / {kept}: {judged.text()}, "
                          + (f"noise (same plan twice) {noise.deviation:.1%}; " if noise is not None else "")
                          + ("adopted: faster beyond the noise" if adopted else NOT_FASTER))
        kept = name if adopted else kept
    return kept


def _online_change(proposal, replanner: OnlineReplanner, **record) -> dict:
    """The change record of an online re-plan ``proposal`` (a :class:`~zbpp_lite.analysis.replan.Replan`)."""
    return {"kind": "online-replan", "to": proposal.schedule.name, "predicted_gain": proposal.gain,
            "predicted_makespan": proposal.predicted, "current_makespan": proposal.current,
            "gain": proposal.gain, "why": f"costs drifted by {replanner.history[-1].drift:.1%}", **record}


def _online(job: _Job, plans: dict, results: dict, kept: str, predicted: Costs, noise: PairedGain | None,
            changes: list[dict]) -> tuple[list[dict], str]:
    """Watch the kept plan for drift, judge a re-plan in one more run; (online checks, kept name)."""
    o = job.options
    kept_parts, kept_schedule = plans[kept]
    replanner = o.replanner(kept_schedule, predicted)
    proposal = None
    for t in timed_steps(results[kept].timelines):
        proposal = replanner.observe(t) or proposal
    checks = _checks(replanner, o.profile_steps)
    if proposal is None or proposal.schedule.actions == kept_schedule.actions:
        return checks, kept
    online = (kept_parts, proposal.schedule)
    again = _in_turns(job, {kept: plans[kept], "online": online}, "online", o.steps)
    changes.append(_online_change(proposal, replanner, adopted=False))
    spans = {name: _spans(r) for name, r in again.items()}
    if _judge([(changes[-1], "online")], spans, noise, o.confidence, kept) == kept:
        return checks, kept
    plans["online"], results["online"] = online, again["online"]
    return checks, "online"
