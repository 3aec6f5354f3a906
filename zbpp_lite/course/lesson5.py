"""Lesson 5's exercise checks (V-shaped schedules): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

import math
from typing import Any, Callable

from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.ir import v_placement
from ..schedules.simulate import simulate
from .checks import (Verdict, _called, _crossings, _function_check, _function_missing, _line_figure,
                     _unanswered, _whole, _with_fresh, course_cache)


@course_cache(maxsize=16)
def _zb_v_sweep(p: int) -> dict[int, Any]:
    """ZB-V's timelines for m = 1 .. 2p + 1 at unit per-stage costs, T_comm = 0 (cached)."""
    return {m: simulate(build_schedule("zb-v", p, m), Costs()) for m in range(1, 2 * p + 2)}


ZB_V_RATE = 0.05
"""The bubble rate exercise 5.2's reveal marks on p = 6's sweep (unit costs), and one of its fixed targets."""


def _first_m_below(p: int, target: float) -> int:
    """Exercise 5.2's answer: from the simulator's sweep up to p = 6; past it (a sweep takes 5-13 s at
    p = 7..10), the closed form the sweeps agree with (tests/test_exercises.py)."""
    if p > 6:
        return math.floor((2 * p - 1) * (1 - target) / (1 + 5 * target)) + 1
    return min(m for m, t in _zb_v_sweep(p).items() if t.bubble_rate < target)


def zb_v_first_m_below(fn: Any) -> Verdict:
    """Exercise 5.2 (predicted): ``first_m_below(p, target)``, the smallest m with ZB-V's bubble rate below
    ``target`` (0 < target <= 0.2) on p ranks, equal per-stage costs, T_comm = 0; checked against the
    simulator's sweep at fixed points (p = 2..6), at fresh ones (p = 2..10; past 6 against a closed form
    the tests compare with the sweeps), and at one fresh p from 20 to 60, so that a table of simulated
    rates does not pass; the package out of bounds. The bubble over the work instead of the makespan gets
    its own message. The derivation: the lesson's Solutions."""
    why = "the rate is the bubble over the makespan, work plus bubble: solve for m."
    hint = ("how many forwards does rank 0 need to cover microbatch 0's trip down and up the V, and how many "
            "does it have when m is small? That gives its idle time; then the rate; then solve for m.")
    fixed = [(6, ZB_V_RATE), (4, ZB_V_RATE), (2, 0.08), (3, 0.02), (5, 0.08), (6, 0.06), (4, 0.12), (6, 0.2),
             (3, 0.001)]   # four where dividing by the work instead gives one more

    def draw(rng):
        return rng.randint(2, 10), rng.uniform(0.002, 0.2)

    def over_work(p, target):   # bubble / work < target
        return min(m for m in range(1, 2 * p) if (2 * p - 1 - m) / (6 * m) < target)

    deep = _with_fresh([], lambda rng: (rng.randint(20, 60), rng.uniform(0.002, 0.2)), 1)   # no sweep there
    points = [*_with_fresh(fixed, draw, 5), *deep]
    return _function_check("5.2", fn, points, _first_m_below, "first_m_below(p, target)",
                           hint, known=[(over_work, f"that divides the bubble by the work; {why}")])


def _zb_v_span(p: int, m: int) -> float:
    """Exercise 5.3's answer at unit costs in closed form: equal to the simulator's sweep
    (tests/test_exercises.py), and used past p = 6, where a sweep takes seconds."""
    return 6 * m + max(4 * p - 1 - 4 * m, 2 * p - 1 - m, 0)


def zb_v_makespan(fn: Any) -> Verdict:
    """Exercise 5.3: ``makespan(p, m, t)``, ZB-V's makespan for every m >= 1 (the lesson shows m >= p only)
    with T_F = T_B = T_W = t, T_comm = 0; checked for p = 2, 3, 5, m = 1 .. 2p + 1, t in (1, 0.5), at
    four fresh points (p = 4..10, m = 1..2p + 1) against the simulator up to p = 6 and :func:`_zb_v_span`
    past it, and at one fresh p from 20 to 60 against :func:`_zb_v_span`."""
    fixed = [(p, m, t) for p in (2, 3, 5) for m in range(1, 2 * p + 2) for t in (1.0, 0.5)]

    def draw(rng):   # points new at each check, so that a table of the fixed ones does not pass
        p = rng.randint(4, 10)
        return p, rng.randint(1, 2 * p + 1), rng.choice((0.5, 1.0, 2.0))

    def deep(rng):
        p = rng.randint(20, 60)
        return p, rng.randint(1, 2 * p + 1), rng.choice((0.5, 1.0, 2.0))

    points = [*_with_fresh(fixed, draw, 4), *_with_fresh([], deep, 1)]
    # every cost scales with t (T_comm = 0), so the makespan is t times the t = 1 one
    return _function_check("5.3", fn, points, lambda p, m, t: t * (_zb_v_sweep(p)[m].makespan if p <= 6
                                                                   else _zb_v_span(p, m)),
                           "makespan(p, m, t)",
                           "6t of work per microbatch on a rank; with few microbatches rank 0 waits for "
                           "microbatch 0's round trip; with very few, every microbatch's F and B on the loss "
                           "stage queue on rank 0, and the last one's B must then cross back to stage 0: "
                           "which wait is longer at each m?")


def fewest_sends(fn: Any) -> Verdict:
    """Exercise 5.1: a function ``fewest(p)`` returning ``(placement, sends, v_sends)``: a placement (a tuple
    of 2p ints, stage s on rank ``placement[s]``) of 2p stages on p >= 2 ranks, two stages a rank, rank 0
    holding the first and the last (as the V does), that sends as few values between ranks per microbatch as
    any such placement, how many it sends and how many the V
    (:func:`~zbpp_lite.schedules.ir.v_placement`) sends, per microbatch: an F's activation goes to stage
    s + 1, a B's input gradient to stage s - 1, and only a change of rank is a send
    (:func:`~zbpp_lite.course.checks._crossings`). Checked for p = 2..8 and at two p drawn from 9 to 60:
    a placement sending more than the fewest, and a wrong count for yours or for the V, are named. The
    derivation: the lesson's Solutions."""
    hint = ("every change of rank between neighbouring stages costs two sends, one F and one B: how few "
            "changes can a path from rank 0 back to rank 0 make when every other rank must hold two stages? "
            "And how many does the V make?")
    shape = "a function fewest(p) returning (placement, sends, v_sends)"
    missing = _function_missing("5.1", fn, hint, shape=shape)
    if missing is not None:
        return missing
    for p in _with_fresh(list(range(2, 9)), lambda rng: rng.randint(9, 60), 2):
        got, refused = _called("5.1", fn, (p,), hint)
        if refused is not None:
            return refused
        if _unanswered(got):
            return Verdict("5.1", False, "your function returned ...: replace the ... in its body.", hint,
                           attempt=False)
        try:
            placement, said, said_v = got
            place = tuple(_whole(r) for r in placement)
            said, said_v = _whole(said), _whole(said_v)
        except (TypeError, ValueError):
            return Verdict("5.1", False, f"at p = {p} expected (placement, sends, v_sends), a tuple of 2p "
                           f"whole ranks and two whole counts, got {got!r}.", hint)
        if len(place) != 2 * p or sorted(place) != sorted(2 * list(range(p))):
            return Verdict("5.1", False, f"at p = {p} {place} does not put two of the {2 * p} stages on each "
                           f"rank 0 .. {p - 1}.", hint)
        if place[0] != 0 or place[-1] != 0:
            return Verdict("5.1", False, f"at p = {p} rank 0 must hold the first and the last stage, as in "
                           f"the V (the loss stage with the first); {place} does not.", hint)
        total = _crossings(place, 1)
        if total > 2 * p:
            return Verdict("5.1", False, f"at p = {p} {place} sends {total} values a microbatch; fewer is "
                           "possible.", hint)
        if said != total:
            return Verdict("5.1", False, f"at p = {p} your placement sends {total} values a microbatch; you "
                           f"said {said}.", hint)
        if said_v != _crossings(v_placement(p), 1):   # 4p - 4: a change at every link but the turn
            return Verdict("5.1", False, f"at p = {p} the V does not send {said_v} values a microbatch.",
                           hint)
    return Verdict("5.1", True, "2p sends a microbatch, the fewest, against the V's 4p - 4: leaving rank 0 "
                   "and coming back enters every rank once, two sends a change; the V changes rank at every "
                   "step but its turn.")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "5.1": fewest_sends, "5.2": zb_v_first_m_below, "5.3": zb_v_makespan
}
"""Lesson 5's exercises by id -> check."""

def _reveal_5_2():
    sweep = _zb_v_sweep(6)
    figure = _line_figure(list(sweep), [t.bubble_rate for t in sweep.values()],
                          f"ZB-V, p = 6: bubble rate against m (dotted: {ZB_V_RATE:g})", "microbatches m")
    return figure.add_hline(y=ZB_V_RATE, line_dash="dot")


REVEALS: dict[str, Callable[[Any], Any]] = {"5.2": lambda answer: _reveal_5_2()}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = ["ZB_V_RATE", "zb_v_first_m_below", "zb_v_makespan", "fewest_sends", "EXERCISES", "REVEALS"]
