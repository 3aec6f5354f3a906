"""Detect and remove bubbles in a real run: profile, attribute, rebalance, re-plan, train (JAX).

:func:`adapt` (``python -m zbpp_lite adapt``): 1. *before*: ZB-H1 steps on the original partition
(last stage ``imbalance`` times the blocks, :func:`~zbpp_lite.analysis.rebalance.imbalanced_parts`);
2. *detect*: per-stage T_F, T_B, T_W, T_comm (:func:`~zbpp_lite.analysis.profiling.timelines.profile`),
idle gaps by cause (:func:`~zbpp_lite.analysis.attribute.attribute`); 3. *rebalance*: parts timed alone,
calibrated, the partition with the smallest largest stage
(:func:`~zbpp_lite.analysis.rebalance.best_partition`); 4. *re-plan*: zb-auto under the memory limit
(:func:`~zbpp_lite.analysis.replan.replan`) with moved parts' costs shifted; 5. *after*: training goes on
(same parameters and AdamW state), re-planned online when costs drift
(:class:`~zbpp_lite.analysis.replan.OnlineReplanner`). Changes 3-4 are adopted when predicted ``min_gain``
better (rank threads) or measured faster beyond the noise (processes). The first step of every plan is
checked against the unpartitioned model's gradients.
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

    def _timed(self) -> list[Timeline]:
        return timed_steps(self.timelines)

    @property
    def makespan(self) -> float:
        """Median makespan (seconds), the phase's first step left out."""
        return statistics.median(t.makespan for t in self._timed())

    @property
    def bubble_rate(self) -> float:
        """Median bubble rate, the phase's first step left out."""
        return statistics.median(t.bubble_rate for t in self._timed())

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


def _change(change: dict, ok: bool, judged: bool, why: str) -> dict:
    """A change record: adopted on the prediction, or (``judged``) tried now, judged by :func:`_judge`."""
    if not judged:
        return {**change, "adopted": ok, "why": why}
    return {**change, "adopted": False, "tried": ok, "predicted_gain": change["gain"],
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
            or bad online settings.
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
    model's and run's); blocks default to :func:`default_blocks`.

    Raises:
        TypeError: a setting that is no field of the three. ValueError: as the three check.
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
    return options, model, replace(run or RunConfig(), **groups[RunConfig])


def adapt(options: AdaptOptions | None = None, *, model: ModelConfig | None = None,
          run: RunConfig | None = None, devices: Sequence[Any] | None = None, data: Digits | None = None,
          on_step: Callable[[str, int, float, Timeline], None] | None = None, **settings) -> AdaptResult:
    """Profile, detect, rebalance, re-plan, then train (see the module docstring).

    ``model``/``run`` as for :func:`zbpp_lite.training.train.train`; ``devices``: one per rank (given
    devices mean rank threads); ``data``: default ``load_digits(run.holdout, run.seed)``; ``on_step(phase,
    step, loss, timeline)``; ``settings``: any config field by name (:func:`adapt_settings`).

    Raises:
        ValueError: bad options, too few blocks for the imbalance, a batch that does not divide
            into microbatches; all before any compute. RuntimeError: too few devices, or a rank's
            process failed.
    """
    options, config, run = adapt_settings(options, model, run, **settings)
    original = imbalanced_parts(config.blocks, options.ranks, options.imbalance)
    microbatch_size(run.batch, options.microbatches)
    data = data if data is not None else load_digits(run.holdout, run.seed)
    processes = options.processes
    if processes is None:
        processes = devices is None and jax.default_backend() == "cpu" and enough_cores(options.ranks)
    job = _Job(options, config, run, data, original, on_step)
    if processes:
        return _adapt_in_processes(job)
    return _adapt_in_threads(job, devices or ensure_devices(options.ranks))


@dataclass
class _Job:
    """One adapt run's settings and inputs, as the two ways of measuring share them."""

    options: AdaptOptions
    config: ModelConfig
    run: RunConfig
    data: Digits
    original: Parts
    on_step: Callable[[str, int, float, Timeline], None] | None

    def part_costs(self, measured: CostProfile, device: Any) -> PartCosts:
        """Every part timed alone on one microbatch, calibrated to the measured stage totals."""
        mb = microbatch_size(self.run.batch, self.options.microbatches)
        x0, y0 = self.data.batch(0, self.run.batch)
        staged = StagedModel(build_parts(self.config), self.options.ranks, parts=self.original)
        timed_parts = profile_parts(staged, x0[:mb], y0[:mb], device, self.options.repeats)
        return calibrate(timed_parts, self.original, measured.costs())

    def candidates(self, measured: CostProfile, device: Any, start: Schedule,
                   judged: bool) -> tuple[PartCosts, list[dict], Parts, Costs, Schedule]:
        """Steps 3-4: (part costs, change records, partition, its predicted costs, schedule)."""
        o, part_costs = self.options, self.part_costs(measured, device)
        changes, parts, schedule = [], self.original, start
        if o.rebalance:
            parts, change = self.rebalance(part_costs, judged)
            changes.append(change)
        predicted = moved_costs(part_costs, self.original, parts, measured.costs())
        if o.replan_schedule:
            schedule, change = self.replan(predicted, start, judged)
            changes.append(change)
        return part_costs, changes, parts, predicted, schedule

    def rebalance(self, part_costs: PartCosts, judged: bool) -> tuple[Parts, dict]:
        """The best partition and the change record (``judged``: tried now, measured later)."""
        o, original = self.options, self.original
        candidate = best_partition(part_costs, o.ranks)
        now, new = partition_cost(part_costs.totals, original), partition_cost(part_costs.totals, candidate)
        gain = 1 - new / now if now > 0 else 0.0
        ok = candidate != original and gain >= o.min_gain
        why = (f"largest stage F+B+W {now * 1e3:.3f} -> {new * 1e3:.3f} ms predicted ({gain:.1%}), "
               f"blocks per stage {_block_counts(original)} -> {_block_counts(candidate)}")
        change = {"kind": "rebalance", "from": [list(p) for p in original],
                  "to": [list(p) for p in candidate],
                  "predicted_largest_stage": new, "current_largest_stage": now, "gain": gain}
        return (candidate if ok else original), _change(change, ok, judged, why)

    def replan(self, predicted: Costs, current: Schedule, judged: bool) -> tuple[Schedule, dict]:
        """zb-auto from ``predicted`` and the change record (``judged`` as in :meth:`rebalance`)."""
        o = self.options
        result = replan(predicted, o.ranks, o.microbatches, o.memory_limit, current=current)
        ok = result.gain >= o.min_gain and (not judged or result.schedule.actions != current.actions)
        why = (f"zb-auto predicted {result.predicted * 1e3:.2f} ms vs zb-h1 {result.current * 1e3:.2f} ms "
               f"({result.gain:.1%})")
        change = {"kind": "replan", "from": current.name, "to": result.schedule.name,
                  "predicted_makespan": result.predicted, "current_makespan": result.current,
                  "gain": result.gain, "memory_limit": list(result.memory_limit)}
        return (result.schedule if ok else current), _change(change, ok, judged, why)

    def stepper(self, phase: str, offset: int = 0) -> Callable[[str, int, float, Timeline], None]:
        """``on_step`` for a run in turns: the phase and the plan's name, steps counted from ``offset``."""
        def call(name: str, k: int, loss: float, timeline: Timeline) -> None:
            if self.on_step is not None:
                self.on_step(f"{phase}:{name}", offset + k, loss, timeline)
        return call


# ----------------------------------------------------------------------------- rank threads


def _worst(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


class _Phases:
    """Rank threads, one phase after the other; AdamW's state carried from partition to partition."""

    def __init__(self, job: _Job, devices: Sequence[Any]):
        self.job, self.devices, self.step_no = job, list(devices), 0
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

    def run(self, phase: Phase, name: str, count: int, replanner: OnlineReplanner | None,
            changes: list[dict]) -> None:
        """``count`` steps of ``phase``; the first step of every plan checked against the reference."""
        job, check = self.job, self.job.run.check_grads
        for _ in range(count):
            x, y = job.data.batch(self.step_no, job.run.batch)
            before = list(self.adamw.params)
            result, _, _ = train_step(self.executor, self.adamw, x, y)
            if check:
                g_err, l_err = check_step(self.model, before, x, y, result, self.devices[0])
                phase.grad_max_rel_error = _worst(phase.grad_max_rel_error, g_err)
                phase.loss_error = _worst(phase.loss_error, l_err)
            check = False
            phase.schedules.append(self.executor.schedule)
            phase.timelines.append(result.timeline)
            phase.losses.append(result.loss)
            if job.on_step is not None:
                job.on_step(name, self.step_no, result.loss, result.timeline)
            self.step_no += 1
            new = replanner.observe(result.timeline) if replanner is not None else None
            if new is not None:
                changes.append({
                    "kind": "online-replan", "adopted": True, "step": self.step_no, "to": new.schedule.name,
                    "predicted_makespan": new.predicted, "current_makespan": new.current, "gain": new.gain,
                    "why": f"costs drifted by {replanner.history[-1].drift:.1%}; "
                           f"predicted {new.gain:.1%} faster",
                })
                self.use(phase.parts, new.schedule)
                check = job.run.check_grads


def _adapt_in_threads(job: _Job, devices: Sequence[Any]) -> AdaptResult:
    """Rank threads of this process, one phase after the other; changes adopted on their predicted gain."""
    o = job.options
    start = build_schedule("zb-h1", o.ranks, o.microbatches)
    phases = _Phases(job, devices)
    # 1. before: ZB-H1 on the original partition
    before = Phase(job.original)
    phases.use(job.original, start)
    phases.run(before, "before", o.profile_steps, None, [])
    # 2. detect
    measured = profile(before._timed(), o.ranks)
    found = attribute(before.measured, before.measured_schedule, measured.costs(), o.margin)
    # 3. rebalance, 4. re-plan from the measured costs, moved parts accounted for
    found_plan = job.candidates(measured, devices[0], start, judged=False)
    part_costs, changes, parts, predicted, schedule = found_plan
    # 5. after: train with the new partition and plan, re-planning online
    after = Phase(tuple(tuple(p) for p in parts))
    phases.use(parts, schedule)
    replanner = o.replanner(schedule, predicted) if o.online else None
    phases.run(after, "after", o.steps, replanner, changes)
    test_loss, test_accuracy = evaluate(phases.model, phases.adamw.params, job.data.test_x, job.data.test_y,
                                        devices[0])
    return AdaptResult(
        before=before, after=after, profile=measured, attribution=found,
        attribution_after=attribute(after.measured, after.measured_schedule, None, o.margin),
        part_costs=part_costs, changes=changes,
        online_checks=_checks(replanner, o.profile_steps - 1),
        test_accuracy=test_accuracy, test_loss=test_loss,
        config={**o.to_json(job.config, job.run), "devices": [str(dev) for dev in devices],
                "measured": "rank threads of one process, one phase after the other"},
    )


# ----------------------------------------------------------------------------- one process per rank


def _named(schedule: Schedule, name: str) -> Schedule:
    return replace(schedule, name=name)


def _phase(parts: Parts, result) -> Phase:
    """A :class:`Phase` from one plan's result in a run in turns."""
    return Phase(tuple(tuple(p) for p in parts), [result.schedule] * len(result.timelines),
                 list(result.timelines), list(result.losses), result.grad_max_rel_error, result.loss_error)


def _spans(result) -> list[float]:
    return [t.makespan for t in timed_steps(result.timelines)]


def _in_turns(job: _Job, plans: dict, on_step, steps: int | None = None) -> dict:
    return train_in_turns([s for _, s in plans.values()], steps or job.options.steps, model=job.config,
                          run=job.run, data=job.data, parts={name: p for name, (p, _) in plans.items()},
                          on_step=on_step)


def _checks(replanner: OnlineReplanner | None, offset: int) -> list[dict]:
    """The online re-planner's checks, steps counted from 0 over both phases."""
    return [{"step": offset + c.step, "drift": c.drift, "decision": c.decision, "gain": c.gain}
            for c in (replanner.history if replanner else [])]


def _adapt_in_processes(job: _Job) -> AdaptResult:
    """:func:`adapt` on pinned processes (:func:`~zbpp_lite.training.turns.train_in_turns`): profile,
    then every plan (original, A/A control, candidates predicted ``min_gain`` faster) takes turns in
    one run; a candidate is adopted when its paired step makespans beat the noise
    (:func:`~zbpp_lite.analysis.noise.beats_noise`); an online re-plan is judged likewise (:func:`_online`).
    ``after`` is the kept plan (nothing kept: the control, or the original)."""
    o = job.options
    zb_h1 = build_schedule("zb-h1", o.ranks, o.microbatches)
    # 1. profile
    first = {"before": (job.original, _named(zb_h1, "before"))}
    profiled = _in_turns(job, first, job.stepper("profile"), o.profile_steps)["before"]
    profiled_phase = _phase(job.original, profiled)
    measured = profile(profiled_phase._timed(), o.ranks)
    found = attribute(profiled_phase.measured, profiled_phase.measured_schedule, measured.costs(), o.margin)
    # 2. candidates
    found_plan = job.candidates(measured, jax.devices()[0], zb_h1, judged=True)
    part_costs, changes, parts, predicted, schedule = found_plan
    plans: dict[str, tuple[Parts, Schedule]] = {"before": (job.original, _named(zb_h1, "before"))}
    if o.control:
        plans["control"] = (job.original, _named(zb_h1, "control"))
    tried = {c["kind"] for c in changes if c["tried"]}
    if "rebalance" in tried:
        plans["rebalanced"] = (parts, _named(zb_h1, "rebalanced"))
    if "replan" in tried:
        plans["re-planned"] = (parts, _named(schedule, "re-planned"))
    # 3. judge: every plan in turns, step by step
    results = _in_turns(job, plans, job.stepper("judge", o.profile_steps))
    spans = {name: _spans(r) for name, r in results.items()}
    noise = paired_gain(spans["before"], spans["control"], o.confidence) if o.control else None
    kept = _judge(changes, plans, spans, noise, o.confidence)
    # 4. online
    checks, kept_name = ([], kept)
    if o.online:
        checks, kept_name = _online(job, plans, results, kept, predicted, noise, changes)
    after_name = kept if kept != "before" else ("control" if o.control else "before")
    after_phase = _phase(plans[after_name][0], results[after_name])
    final = results[kept_name]
    return AdaptResult(
        before=_phase(job.original, results["before"]), after=after_phase, profile=measured,
        attribution=found,
        attribution_after=attribute(after_phase.measured, after_phase.measured_schedule, None, o.margin),
        part_costs=part_costs, changes=changes, online_checks=checks,
        test_accuracy=final.test_accuracy, test_loss=final.test_loss,
        config={**o.to_json(job.config, job.run), "plans": list(plans), "kept": kept_name,
                "devices": final.config["devices"],
                "measured": "one pinned process per rank, the plans taking turns step by step"},
        comparison=paired_gain(spans["before"], spans[after_name], o.confidence), control=noise,
        profiled=profiled_phase,
    )


def _judge(changes: list[dict], plans: dict, spans: dict, noise: PairedGain | None, confidence: float) -> str:
    """Each tried candidate against the plan it would replace, in order; returns the kept plan's name."""
    kept = "before"
    for change, name in (("rebalance", "rebalanced"), ("replan", "re-planned")):
        record = next((c for c in changes if c["kind"] == change), None)
        if record is None or name not in plans:
            continue
        judged = paired_gain(spans[kept], spans[name], confidence)
        adopted = beats_noise(judged, noise)
        record.update({"adopted": adopted, "measured_against": kept, "measured": judged.to_json(),
                       "gain": judged.gain, "noise": None if noise is None else noise.deviation})
        record["why"] += (f"; measured {name} / {kept}: {judged.text()}, "
                          + (f"noise (same plan twice) {noise.deviation:.1%}; " if noise is not None else "")
                          + ("adopted: faster beyond the noise" if adopted else NOT_FASTER))
        if adopted:
            kept = name
    return kept


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
    online_plans = {kept: plans[kept], "online": (kept_parts, _named(proposal.schedule, "online"))}
    again = _in_turns(job, online_plans, job.stepper("online"))
    judged = paired_gain(_spans(again[kept]), _spans(again["online"]), o.confidence)
    adopted = beats_noise(judged, noise)
    changes.append({"kind": "online-replan", "adopted": adopted, "to": proposal.schedule.name,
                    "predicted_gain": proposal.gain, "gain": judged.gain, "measured": judged.to_json(),
                    "why": f"costs drifted significantly ({replanner.history[-1].drift:.1%}); "
                           f"measured online / {kept}: {judged.text()}; "
                           + ("adopted" if adopted else NOT_FASTER)})
    if not adopted:
        return checks, kept
    plans["online"] = online_plans["online"]
    results["online"] = again["online"]
    return checks, "online"
