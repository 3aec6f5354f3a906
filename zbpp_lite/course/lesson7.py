"""Lesson 7's exercise checks (bubble detection): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable, Sequence


from ..schedules.builders import build_schedule
from ..schedules.simulate import simulate
from ..viz.figures import timeline_figure
from .checks import (Verdict, _as_number, _called, _function_check, _function_missing,
                     _one_slow_stage, _settled, _unanswered, _with_fresh, course_cache)


SLOW_MIDDLE_STAGE = _one_slow_stage(4, 2)
"""Exercise 7.1's drawn case: ZB-H1 on p = 4, m = 8 with stage 2 twice as slow as the others (the lesson
plants and draws the slow stage at the front; no figure or output of it shows this case)."""


@course_cache(maxsize=256)
def _slow_idle(p: int, m: int, slow: int) -> tuple[float, ...]:
    """Each rank's idle time inside its span in ZB-H1 on p ranks, m microbatches, stage ``slow`` at twice the
    others' unit costs (simulated, cached)."""
    return simulate(build_schedule("zb-h1", p, m), _one_slow_stage(p, slow)).idle_time


def slow_stage_idle(fn: Any) -> Verdict:
    """Exercise 7.1 (predicted): ``idle(p, m, slow, r)``, rank r's idle time inside its span in ZB-H1 on
    p >= 2 ranks, m >= p microbatches, stage ``slow`` twice as slow as the others (unit costs elsewhere,
    T_comm = 0); checked against the simulator at every slow stage and rank for p = 3..5, m = p and 2p, and
    at four fresh points up to p = 12, m = 3p, the package out of bounds. The slow rank is never idle. A fast
    rank works 3m: in front of the slow stage (r < slow) it runs from r to 6m - 1, idling 3m - 1 - r; behind
    it, from r + 1 to 6m - 2p + 2 slow, idling 3m - 2p - 1 + 2 slow - r. Answers that give the ranks behind
    the front's end, or every rank the front's form, are named."""
    fixed = [(p, m, slow, r) for p in (3, 4, 5) for m in (p, 2 * p) for slow in range(p) for r in range(p)]

    def draw(rng):
        p = rng.randint(6, 12)
        return p, rng.randint(p, 3 * p), rng.randrange(p), rng.randrange(p)

    def front_everywhere(p, m, slow, r):
        return 0 if r == slow else 3 * m - 1 - r

    def behind_end_late(p, m, slow, r):
        return 0 if r == slow else 3 * m - 1 - r if r < slow else 3 * m - 2 - r

    known = [(front_everywhere, "that is the form of the ranks in front of the slow stage, given to every "
              "rank: behind it a rank starts one later and ends earlier"),
             (behind_end_late, "the ranks behind the slow stage do not wait for its last backwards: they "
              "end once they have handed it theirs, with their held W's run")]
    hint = ("the slow rank is never idle: it runs 6m from its start. A fast rank's idle time is its span "
            "less its 3m of work: when does microbatch 0's F reach it, and when does it end? After its "
            "last B it still runs the W's it holds (W of i runs after B of i + r, lesson 3). In front, the "
            "last B comes back from the slow rank; behind, count what the slow rank runs after its last F.")
    return _function_check("7.1", fn, _with_fresh(fixed, draw, 4), lambda p, m, slow, r:
                           _slow_idle(p, m, slow)[r], "idle(p, m, slow, r)", hint, known=known)


LAYER_COSTS = (1.0, 2.0, 2.0, 5.0, 4.0, 2.0, 1.0, 4.0)
"""Exercise 7.2's per-layer costs (T_F + T_B + T_W of each of 8 layers), cut into 3 contiguous stages: the
bound max(total / 3, costliest layer) = 7 is out of reach (the best cut's slowest stage is 9), and filling
stages up to a third of the total misses the best cut."""


SPLIT_CASES = ((LAYER_COSTS, 3), ((2.0, 1.0, 3.0, 1.0, 4.0, 4.0, 4.0, 4.0), 3),
               ((1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0), 3), ((7.0, 8.0, 5.0, 7.0, 6.0), 3),
               ((3.0, 1.0, 1.0, 1.0), 2), ((1.0, 1.0, 1.0, 5.0), 2), ((2.0, 1.0, 1.0, 2.0), 3),
               ((1.0, 2.0, 3.0, 4.0, 5.0, 6.0), 3), ((5.0, 1.0, 1.0, 1.0, 1.0, 1.0), 3),
               ((3.0, 3.0, 2.0, 2.0, 2.0, 3.0, 3.0), 3), ((1.0, 2.0, 1.0), 1), ((4.0, 1.0, 2.0, 7.0), 4))
"""Exercise 7.3's (per-layer costs, stages) cases: unequal costs, ties, one stage, one layer per stage, and
[7, 8, 5, 7, 6] into 3, where filling each stage to its share of what remains and then moving boundaries
while that helps stops at 15 (13 is possible)."""

SPLIT_FRESH = 20
"""How many more exercise 7.3 cases its check draws afresh at each call: 5 to 10 layers costing 1 to 9,
2 to 4 stages."""

SPLIT_DEEP = dict(layers=96, stages=8, steps=2_000_000)
"""Exercise 7.3's last case, drawn afresh (costs 1 to 9): a real model's depth, where trying every cut
(C(95, 7), about 1.1e10) cannot finish; the learner's function is stopped past ``steps`` steps (lines
run and calls)."""


def _slowest(costs: Sequence[float], counts: Sequence[int]) -> float:
    """The largest stage total when ``costs`` is cut, front to back, into stages of ``counts`` layers."""
    ends = list(itertools.accumulate(counts))
    return max(sum(costs[a:b]) for a, b in zip([0, *ends], ends))


def _fewest_slowest(costs: Sequence[float], stages: int) -> float:
    """The smallest slowest stage over every contiguous cut: the least stage total (a sum of neighbouring
    layers' costs) for which filling each stage up to it, front to back, needs at most ``stages`` stages."""
    def fits(limit: float) -> bool:
        used, total = 1, 0.0
        for c in costs:
            if c > limit:
                return False
            used, total = (used + 1, c) if total + c > limit else (used, total + c)
        return used <= stages

    ends = [0.0, *itertools.accumulate(costs)]
    totals = sorted({b - a for i, a in enumerate(ends) for b in ends[i + 1:]})
    low, high = 0, len(totals) - 1                   # fits(totals[-1]), the whole model, always
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(totals[mid]) else (mid + 1, high)
    return totals[low]


def _split_problem(costs: Sequence[float], stages: int, counts: Any, say_best: bool = True,
                   shown: str | None = None) -> str:
    """Why ``counts`` is not an optimal cut of ``costs`` into ``stages`` contiguous stages, or "" (with the
    best slowest stage where ``say_best``: not where that is the exercise's own question); ``shown``
    names the costs in the text (else the list itself)."""
    shown = str(list(costs)) if shown is None else shown
    try:
        whole = [int(k) for k in counts if _as_number(k) is not None and _as_number(k).is_integer()]
    except TypeError:
        whole = []
    if len(whole) != stages or len(whole) != len(counts) or min(whole) < 1 or sum(whole) != len(costs):
        return (f"on {shown}, {stages} stage(s): expected {stages} whole layer counts >= 1 adding up "
                f"to {len(costs)}, got {counts!r}.")
    slower, best = _slowest(costs, whole), _fewest_slowest(costs, stages)
    if slower > best + 1e-9:
        return (f"on {shown}, {stages} stage(s): your cut {whole} leaves a stage of {slower:g}; "
                + (f"{best:g} is possible." if say_best else "a cut with a faster slowest stage exists."))
    return ""


def balanced_partition(answer: Any) -> Verdict:
    """Exercise 7.2: the layers per stage, front to back, cutting :data:`LAYER_COSTS` into 3 contiguous stages
    so that the slowest is as fast as possible (any optimal cut is right)."""
    hint = ("no cut beats the larger of the costliest layer and a third of the total; start from that "
            "bound, see which stage breaks it, and raise it to the next stage total reachable.")
    if _unanswered(answer):
        return Verdict("7.2", False, "no answer yet: write the three layer counts.", hint)
    answer = _settled(answer)
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Sequence):
        return Verdict("7.2", False, f"expected three layer counts such as (3, 3, 2), got {answer!r}.", hint)
    why = _split_problem(LAYER_COSTS, 3, answer, say_best=False)
    if why:
        return Verdict("7.2", False, why, hint)
    counts = tuple(int(_as_number(k)) for k in answer)   # whole, as _split_problem found them
    return Verdict("7.2", True, f"{counts}: the slowest stage costs {_slowest(LAYER_COSTS, counts):g}, "
                                "the least any contiguous cut into 3 allows.")


def best_split(fn: Any) -> Verdict:
    """Exercise 7.3: ``best_split(costs, stages)``, the layers per stage, front to back, of a contiguous cut
    into ``stages`` stages that minimises the slowest (any optimum is right); checked on
    :data:`SPLIT_CASES`, :data:`SPLIT_FRESH` cases drawn afresh at each call and one of
    :data:`SPLIT_DEEP`'s depth, where a function trying every cut is stopped."""
    deep = SPLIT_DEEP
    hint = ("trying every cut works for a few layers, not for a model's depth. The best cut's slowest stage "
            "is one of the sums of neighbouring layers' costs: the smallest for which filling each stage "
            "up to it, front to back, needs at most `stages` stages (then split a stage further). Or "
            "build the best cut of the first i layers into k stages from those into k - 1.")
    missing = _function_missing("7.3", fn, hint)
    if missing is not None:
        return missing
    def draw(rng):  # 5 to 10 layers costing 1 to 9, 2 to 4 stages
        n = rng.randint(5, 10)
        return tuple(float(rng.randint(1, 9)) for _ in range(n)), rng.randint(2, min(4, n))

    rng = random.Random()
    deep_costs = tuple(float(rng.randint(1, 9)) for _ in range(deep["layers"]))
    shown = f"{deep['layers']} layers costing 1 to 9 (drawn afresh)"
    cases = [(*case, None, None) for case in _with_fresh(SPLIT_CASES, draw, SPLIT_FRESH)]
    for costs, stages, steps, where in [*cases, (deep_costs, deep["stages"], deep["steps"], shown)]:
        counts, refused = _called("7.3", fn, (list(costs), stages), hint, steps,  # the package: refused
                                  None if where is None else f"{where}, {stages} stages")
        if refused is not None:
            return refused
        # (an array answer is a list already: _called settles what the answer returns)
        readable = isinstance(counts, Sequence) and not isinstance(counts, (str, bytes))
        why = _split_problem(costs, stages, counts if readable else [counts], shown=where)
        if why:
            return Verdict("7.3", False, why, hint)
    return Verdict("7.3", True, f"best_split is optimal on all {len(cases) + 1} cases checked (ties, one "
                                f"stage, one layer per stage, cases new at each check, and "
                                f"{deep['layers']} layers into {deep['stages']} stages).")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "7.1": slow_stage_idle, "7.2": balanced_partition, "7.3": best_split
}
"""Lesson 7's exercises by id -> check."""

REVEALS: dict[str, Callable[[], Any]] = {
    "7.1": lambda: timeline_figure(simulate(build_schedule("zb-h1", 4, 8), SLOW_MIDDLE_STAGE),
                                   "ZB-H1, stage 2 twice as slow")}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "SLOW_MIDDLE_STAGE", "slow_stage_idle", "LAYER_COSTS", "SPLIT_CASES", "SPLIT_DEEP", "balanced_partition",
    "best_split",
    "EXERCISES", "REVEALS"
]
