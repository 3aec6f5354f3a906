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
                     _one_slow_stage, _with_fresh, course_cache)


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
    at four fresh points up to p = 12, m = 3p, the package out of bounds. Answers that give the ranks
    behind the slow stage the end of those in front of it, or every rank the form of those in front, are
    named. The derivation: the lesson's Solutions."""
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


# The fastest cut by time alone, 5, 9, 7 (layers 3, 2, 3), leaves rank 0 holding 3 x 3 = 9 > 8; the best
# cut that fits is 11 (2, 3, 3 or 2, 2, 4).
LAYER_COSTS = (1.0, 2.0, 2.0, 5.0, 4.0, 2.0, 1.0, 4.0)
"""The lesson's 8 layers: per-layer cost (T_F + T_B + T_W); exercise 7.2's first case, with
:data:`LAYER_ACTS` and a limit of 8 on 3 ranks."""

LAYER_ACTS = (1.0,) * 8
"""What each of :data:`LAYER_COSTS`' layers keeps per microbatch in exercise 7.2's first case (units)."""

SPLIT_CASES = ((LAYER_COSTS, LAYER_ACTS, 3, 8.0),
               ((1.0, 2.0, 3.0, 4.0, 5.0, 6.0), (3.0, 1.0, 1.0, 1.0, 1.0, 1.0), 3, 9.0),
               ((2.0, 1.0, 3.0, 1.0, 4.0, 4.0, 4.0, 4.0), (2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0), 4, 8.0),
               ((7.0, 8.0, 5.0, 7.0, 6.0), (1.0, 1.0, 1.0, 1.0, 1.0), 3, 9.0),
               ((3.0, 1.0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0), 2, 4.0),
               ((1.0, 2.0, 1.0), (1.0, 1.0, 1.0), 1, 3.0),
               ((4.0, 1.0, 2.0, 7.0), (1.0, 1.0, 1.0, 1.0), 4, 4.0),
               ((5.0, 1.0, 1.0, 1.0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0, 1.0, 1.0), 3, 100.0))
"""Exercise 7.2's (per-layer costs, per-layer activations, stages, limit) cases: memory binding at the front,
a heavy first layer, [7, 8, 5, 7, 6] into 3 (filling stages to their share then moving boundaries stops
at 15 where 13 fits), one stage, one layer per stage, and a limit too loose to bind."""

SPLIT_FRESH = 20
"""How many more exercise 7.2 cases its check draws afresh at each call: 5 to 10 layers costing 1 to 9,
keeping 1 to 4, 2 to 4 stages, a limit that some cut meets."""

SPLIT_DEEP = dict(layers=96, stages=8, steps=2_000_000)
"""Exercise 7.2's last case, drawn afresh (costs 1 to 9, activations 1 to 4): a real model's depth, where
trying every cut (C(95, 7), about 1.1e10) cannot finish; the learner's function is stopped past ``steps``
steps (lines run and calls)."""


def _stage_sums(values: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Each stage's total of ``values`` when the layers are cut, front to back, into stages of ``counts``."""
    ends = list(itertools.accumulate(counts))
    return [sum(values[a:b]) for a, b in zip([0, *ends], ends)]


def _fill(costs: Sequence[float], acts: Sequence[float], stages: int, limit: float,
          slowest: float) -> list[int] | None:
    """Layers per stage when each stage, front to back, takes layers while its cost stays at most ``slowest``
    and rank r's memory, (stages - r) x its activations, at most ``limit``; None when that needs more than
    ``stages`` stages. Greedy is exact where every layer fits rank 0 alone (stages x its activations at
    most ``limit``, as in every case the check draws or lists): the limits only loosen towards the back, so
    a stage that takes more leaves the rest an easier problem."""
    counts: list[int] = []
    cost = act = 0.0
    for c, a in zip(costs, acts):
        if not counts or cost + c > slowest or (stages - len(counts) + 1) * (act + a) > limit:
            counts.append(0)
            cost = act = 0.0
            if len(counts) > stages or c > slowest or (stages - len(counts) + 1) * a > limit:
                return None
        counts[-1] += 1
        cost, act = cost + c, act + a
    return counts


def _fewest_slowest(costs: Sequence[float], acts: Sequence[float], stages: int, limit: float) -> float | None:
    """The least slowest stage over every contiguous cut whose ranks fit ``limit`` (rank r holding stages - r
    microbatches, 1F1B's warm-up), or None if none fits: the smallest sum of neighbouring layers' costs that
    :func:`_fill` meets, by bisection."""
    ends = [0.0, *itertools.accumulate(costs)]
    totals = sorted({b - a for i, a in enumerate(ends) for b in ends[i + 1:]})
    if _fill(costs, acts, stages, limit, totals[-1]) is None:
        return None
    low, high = 0, len(totals) - 1
    while low < high:
        mid = (low + high) // 2
        fits = _fill(costs, acts, stages, limit, totals[mid]) is not None
        low, high = (low, mid) if fits else (mid + 1, high)
    return totals[low]


def _split_problem(case: tuple, counts: Any, shown: str | None = None) -> str:
    """Why ``counts`` is not an optimal cut that fits for ``case`` = (costs, acts, stages, limit), or "";
    ``shown`` names the case in the text (else its lists)."""
    costs, acts, stages, limit = case
    shown = f"costs {list(costs)}, acts {list(acts)}" if shown is None else shown
    shown = f"{shown}, {stages} stage(s), limit {limit:g}"
    try:
        whole = [int(k) for k in counts if _as_number(k) is not None and _as_number(k).is_integer()]
    except TypeError:
        whole = []
    if len(whole) != stages or len(whole) != len(counts) or min(whole) < 1 or sum(whole) != len(costs):
        return (f"on {shown}: expected {stages} whole layer counts >= 1 adding up to {len(costs)}, "
                f"got {counts!r}.")
    held = [(stages - r) * a for r, a in enumerate(_stage_sums(acts, whole))]
    over = [r for r, h in enumerate(held) if h > limit + 1e-9]
    if over:
        return (f"on {shown}: your cut {whole} has rank {over[0]} holding {stages - over[0]} microbatches of "
                f"{held[over[0]] / (stages - over[0]):g}, {held[over[0]]:g}, over the limit.")
    slower, best = max(_stage_sums(costs, whole)), _fewest_slowest(costs, acts, stages, limit)
    if slower > best + 1e-9:
        return f"on {shown}: your cut {whole} fits, with a stage of {slower:g}; {best:g} is possible."
    return ""


def _split_draw(rng: random.Random, layers: int, stages: int) -> tuple:
    """A case of ``layers`` layers (costs 1 to 9, activations 1 to 4) into ``stages`` with a limit some cut
    meets and every layer fits rank 0 alone: from the least such whole limit (at least stages x the largest
    activation) to 1.5 times it."""
    costs = tuple(float(rng.randint(1, 9)) for _ in range(layers))
    acts = tuple(float(rng.randint(1, 4)) for _ in range(layers))
    low = stages * max(acts)
    while _fill(costs, acts, stages, low, sum(costs)) is None:
        low += 1.0
    return costs, acts, stages, float(rng.randint(int(low), int(low * 1.5)))


def best_split(fn: Any) -> Verdict:
    """Exercise 7.2: ``best_split(costs, acts, stages, limit)``, the layers per stage, front to back, of a
    contiguous cut into ``stages`` stages that minimises the slowest stage's cost while rank r, holding
    stages - r microbatches (1F1B's warm-up, lesson 1), keeps at most ``limit``: (stages - r) x its layers'
    ``acts`` (any optimum is right); checked on :data:`SPLIT_CASES`, :data:`SPLIT_FRESH` cases drawn afresh
    at each call and one of :data:`SPLIT_DEEP`'s depth, where a function trying every cut is stopped."""
    deep = SPLIT_DEEP
    hint = ("trying every cut works for a few layers, not for a model's depth. Ask the easier question: "
            "can the slowest stage be at most T? Fill the stages front to back, each taking layers while it "
            "stays within T and its rank within the limit; why is taking as many as fit never a mistake "
            "here? Then search T over the sums of neighbouring layers' costs.")
    missing = _function_missing("7.2", fn, hint)
    if missing is not None:
        return missing
    def draw(rng):
        n = rng.randint(5, 10)
        return _split_draw(rng, n, rng.randint(2, min(4, n)))

    deep_case = _split_draw(random.Random(), deep["layers"], deep["stages"])
    shown = f"{deep['layers']} layers drawn afresh"
    cases = [(case, None, None) for case in _with_fresh(SPLIT_CASES, draw, SPLIT_FRESH)]
    for case, steps, where in [*cases, (deep_case, deep["steps"], shown)]:
        costs, acts, stages, limit = case
        label = None if where is None else f"{where}, {stages} stages"
        counts, refused = _called("7.2", fn, (list(costs), list(acts), stages, limit), hint, steps, label)
        if refused is not None:
            return refused
        # (an array answer is a list already: _called settles what the answer returns)
        readable = isinstance(counts, Sequence) and not isinstance(counts, (str, bytes))
        why = _split_problem(case, counts if readable else [counts], shown=where)
        if why:
            return Verdict("7.2", False, why, hint)
    return Verdict("7.2", True, f"best_split is optimal on all {len(cases) + 1} cases checked (memory "
                                "binding at the front, one stage, one layer per stage, cases new at each "
                                f"check, and {deep['layers']} layers into {deep['stages']} stages).")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "7.1": slow_stage_idle, "7.2": best_split
}
"""Lesson 7's exercises by id -> check."""

REVEALS: dict[str, Callable[[Any], Any]] = {
    "7.1": lambda answer: timeline_figure(simulate(build_schedule("zb-h1", 4, 8), SLOW_MIDDLE_STAGE),
                                   "ZB-H1, stage 2 twice as slow")}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "SLOW_MIDDLE_STAGE", "slow_stage_idle", "LAYER_COSTS", "LAYER_ACTS", "SPLIT_CASES", "SPLIT_DEEP",
    "best_split",
    "EXERCISES", "REVEALS"
]
