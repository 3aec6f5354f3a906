"""Re-plan from measured costs: zb-auto under a memory limit, once or online while training (pure Python).

:func:`replan` feeds measured per-stage costs to the automatic scheduler
(:func:`zbpp_lite.schedules.builders.auto.auto_plan`; Qi et al., arXiv 2401.10241, section 3.1) and
simulates the new and the current schedule under the same costs. :class:`OnlineReplanner` does it while
training: every K steps it profiles the last K timelines and re-plans after ``patience`` drifted checks
in a row, switching only for a predicted ``min_gain``; drift threshold, K-step averaging and required
gain are the hysteresis that keeps noise from changing the plan.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Sequence

from ..schedules.builders.auto import auto_plan
from ..schedules.costs import Costs
from ..schedules.ir import Schedule
from ..schedules.simulate import simulate
from ..schedules.timeline import Timeline
from ..schedules.validate import validate
from .noise import median_interval
from .profiling.timelines import CostProfile, profile


@dataclass(frozen=True)
class Replan:
    """A zb-auto ``schedule`` for ``costs`` under ``memory_limit`` per rank (units of Costs.mem_b);
    simulated makespans ``predicted`` (its) and ``current`` (None without a current schedule)."""

    schedule: Schedule
    costs: Costs
    predicted: float
    current: float | None
    memory_limit: tuple[float, ...]

    @property
    def gain(self) -> float:
        """1 - predicted / current (0 without a current)."""
        if self.current is None or self.current <= 0:
            return 0.0
        return 1.0 - self.predicted / self.current


def replan(costs: Costs | CostProfile, num_ranks: int, num_microbatches: int,
           memory_limit: float | Sequence[float] | None = None, current: Schedule | None = None) -> Replan:
    """zb-auto for ``costs`` (one stage per rank; a :class:`CostProfile` gives means and T_comm) under
    ``memory_limit`` (units of Costs.mem_b; default p, the peak of 1F1B), beside ``current``.

    Raises:
        ValueError: costs for other than p stages, a memory limit no schedule fits (the message names
            the smallest feasible one), bad sizes.
    """
    if isinstance(costs, CostProfile):
        costs = costs.costs()
    costs.table(num_ranks)  # ValueError for a per-stage length other than p
    if current is not None and (current.num_ranks, current.num_stages) != (num_ranks, num_ranks):
        raise ValueError(f"the current schedule has {current.num_ranks} ranks and {current.num_stages} "
                         f"stages; zb-auto plans one stage per rank for {num_ranks} ranks")
    plan = auto_plan(num_ranks, num_microbatches, costs, memory_limit)
    validate(plan.schedule)
    now = simulate(current, costs).makespan if current is not None else None
    return Replan(plan.schedule, costs, simulate(plan.schedule, costs).makespan, now, plan.memory_limit)


def drift(reference: Costs, observed: Costs, num_stages: int) -> float:
    """Largest change of any stage's T_F, T_B or T_W as a fraction of its reference T_F + T_B + T_W
    (T_comm: of their mean over stages), so a tiny T_W wobbling is no large drift: :func:`significant_drift`
    of one step each.

    Raises:
        ValueError: costs with the wrong number of per-stage values.
    """
    return significant_drift([reference], [observed], num_stages, math.inf)[0]


def significant_drift(reference: Sequence[Costs], window: Sequence[Costs], num_stages: int, threshold: float,
                      confidence: float = 0.95) -> tuple[float, bool]:
    """Drift of per-step costs from a reference window, against the noise between steps: step k of
    each is paired, each cost's change scaled by the stage's median reference T_F + T_B + T_W (T_comm's by
    their mean; a zero scale counts as 1), its median given an interval
    (:func:`zbpp_lite.analysis.noise.median_interval`).

    Returns:
        ``(drift, significant)``: the largest median change, and whether some change exceeds
        ``threshold`` with its interval excluding 0 (Bonferroni over the 4 * num_stages tests; with 2
        stages at 95% that needs >= 9 paired steps).

    Raises:
        ValueError: an empty window or reference, or costs with the wrong number of stages.
    """
    n = min(len(reference), len(window))
    if n == 0:
        raise ValueError("significant_drift needs at least one step in the window and in the reference")
    ref = [c.table(num_stages) for c in reference[:n]]
    obs = [c.table(num_stages) for c in window[:n]]
    totals = [statistics.median(r.f[s] + r.b[s] + r.w[s] for r in ref) for s in range(num_stages)]
    comm_scale = sum(totals) / num_stages or 1.0
    worst, significant = 0.0, False
    each = 1 - (1 - confidence) / (4 * num_stages)  # Bonferroni: 4 costs a stage, the family at `confidence`
    for s in range(num_stages):
        for kind in ("f", "b", "w", "comm"):
            by = comm_scale if kind == "comm" else totals[s] if totals[s] > 0 else 1.0
            changes = [(getattr(o, kind)[s] - getattr(r, kind)[s]) / by for r, o in zip(ref, obs)]
            middle = statistics.median(changes)
            low, high, coverage = median_interval(changes, each)
            worst = max(worst, abs(middle))
            significant |= abs(middle) > threshold and (low > 0 or high < 0) and coverage >= each
    return worst, significant


@dataclass(frozen=True)
class Check:
    """One check after ``step`` timelines: ``drift``, ``decision`` ("reference": the first window, with
    ``confidence``; "steady"; "wait": patience not reached; "kept": gain too small; "switched") and the
    re-plan's predicted ``gain`` (or None)."""

    step: int
    drift: float
    decision: str
    gain: float | None = None


@dataclass
class OnlineReplanner:
    """Re-plan every ``every`` steps when the measured costs drift, with hysteresis.

    :meth:`observe` every step's timeline; it returns a :class:`Replan` when the plan changes.

    Attributes:
        schedule: in use (one stage per rank). reference: the costs it was last judged by.
        every: K, steps between checks. threshold: :func:`drift` above which a check is drifted.
        patience: drifted checks in a row before re-planning. min_gain: predicted fraction faster
            needed to switch. memory_limit: for zb-auto (units of Costs.mem_b; default p).
        history: every :class:`Check`. confidence: None, or the first K steps are the reference and
            drift must also be significant (:func:`significant_drift`).

    Raises:
        ValueError: every < 1, threshold or min_gain < 0, patience < 1, or a schedule with other
            than one stage per rank.
    """

    schedule: Schedule
    reference: Costs
    every: int = 10
    threshold: float = 0.15
    patience: int = 2
    min_gain: float = 0.03
    memory_limit: float | Sequence[float] | None = None
    history: list[Check] = field(default_factory=list)
    confidence: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an integer >= 1 (steps between checks), got {self.every!r}")
        if self.threshold < 0 or self.min_gain < 0:
            raise ValueError(f"threshold and min_gain must be >= 0, got {self.threshold}, {self.min_gain}")
        if not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"patience must be an integer >= 1, got {self.patience!r}")
        if self.schedule.num_stages != self.schedule.num_ranks:
            raise ValueError("the online re-planner re-plans with zb-auto, one stage per rank; the schedule "
                             f"has {self.schedule.num_stages} stages on {self.schedule.num_ranks} ranks")
        self.reference.table(self.schedule.num_stages)
        if self.confidence is not None and not 0 < self.confidence < 1:
            raise ValueError(f"confidence must lie in (0, 1) or be None, got {self.confidence}")
        self._reference_steps: list[Costs] | None = None
        self._window: list[Timeline] = []
        self._steps = self._strikes = 0

    def _check(self, moved: float, decision: str, gain: float | None = None) -> None:
        self.history.append(Check(self._steps, moved, decision, gain))

    def observe(self, timeline: Timeline) -> Replan | None:
        """Record one step's timeline; every K, check the drift and maybe re-plan. Returns the
        :class:`Replan` when the plan changed, else None.

        Raises:
            ValueError: a timeline lacking events a stage needs (see :func:`.profiling.timelines.profile`).
        """
        self._window.append(timeline)
        self._steps += 1
        if len(self._window) < self.every:
            return None
        S, window, self._window = self.schedule.num_stages, self._window, []
        # a timeline measures times, not memory: the plan keeps the reference's M_B and M_W
        observed = replace(profile(window, S).costs(), mem_b=self.reference.mem_b, mem_w=self.reference.mem_w)
        steps = None
        if self.confidence is not None:
            steps = [profile([t], S).costs() for t in window]
            if self._reference_steps is None:
                self._reference_steps, self.reference = steps, observed
                return self._check(0.0, "reference")
            moved, significant = significant_drift(self._reference_steps, steps, S, self.threshold,
                                                   self.confidence)
        else:
            moved = drift(self.reference, observed, S)
            significant = moved > self.threshold
        if not significant:
            self._strikes = 0
            return self._check(moved, "steady")
        self._strikes += 1
        if self._strikes < self.patience:
            return self._check(moved, "wait")
        self._strikes = 0
        s = self.schedule
        result = replan(observed, s.num_ranks, s.num_microbatches, self.memory_limit, s)
        self.reference = observed  # the current plan has now been judged by these costs
        if steps is not None:
            self._reference_steps = steps
        if result.gain < self.min_gain:
            return self._check(moved, "kept", result.gain)
        self._check(moved, "switched", result.gain)
        self.schedule = result.schedule
        return result
