"""Lesson 4's exercise checks (zb-auto): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable


from ..schedules.builders import build_schedule
from ..schedules.builders.auto import auto_plan
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from .checks import Verdict, _function_check, _line_figure, _number_check, course_cache


AUTO_CASE = dict(num_ranks=4, num_microbatches=12, costs=Costs(f=1.0, b=2.0, w=1.0))
"""Exercises 4.2 and 4.3's case: p = 4, m = 12, T_F = 1, T_B = 2, T_W = 1, T_comm = 0 (T_B != T_F, so
ZB-H2's warm-up of 2(p-r)-1 forwards does not fill the wait for the first gradient)."""


WARMUP_CASES = ((4, 12, 1.0, 2.0), (3, 12, 1.0, 3.0), (6, 18, 1.0, 2.0), (4, 12, 0.5, 1.0))
"""Exercise 4.3's cases (p, m, T_F, T_B), T_W = T_F: :data:`AUTO_CASE` first, then three more, so that an
answer written for p = 4, T_B = 2 alone, or one that ignores T_F, fails."""


@course_cache(maxsize=64)
def _auto(limit: float, p: int = AUTO_CASE["num_ranks"], m: int = AUTO_CASE["num_microbatches"],
          b: float = AUTO_CASE["costs"].b, f: float = AUTO_CASE["costs"].f):
    """zb-auto's plan under ``limit`` M_B of :data:`AUTO_CASE`, or of p ranks, m microbatches, T_B = b and
    T_F = T_W = f (AUTO_CASE's other costs) (cached)."""
    return auto_plan(p, m, replace(AUTO_CASE["costs"], f=f, b=b, w=f), limit)


def bw_break_even(fn: Any) -> Verdict:
    """Exercise 4.1: ``largest_m(p, f, b, w, bw)``, the most microbatches (m >= p) for which ZB-H1 (split)
    is strictly faster than 1F1B (fused T_BW = bw < T_B + T_W), T_comm = 0, T_W on either side of T_F;
    checked against both simulations at nine points (the paper's costs, two ties, three with T_W > T_F,
    where ZB-H1's bubble is (p-1) T_B: lesson 3)."""
    points = [(4, 1.0, 1.0, 1.0, 1.55), (2, 1.0, 1.2, 0.6, 1.45), (8, 18.522, 18.086, 9.337, 24.0),
              (5, 2.0, 1.5, 1.0, 2.2), (3, 1.0, 0.5, 0.8, 1.0), (4, 1.0, 1.0, 1.0, 1.5),   # a tie at m = 9
              (4, 1.0, 1.0, 1.5, 2.3), (3, 1.0, 2.0, 1.5, 3.0), (5, 1.0, 1.5, 2.0, 3.0)]  # T_W > T_F; tie: 8

    def largest(p, f, b, w, bw):
        c, m = Costs(f=f, b=b, w=w, bw=bw), p
        spans = lambda n: simulate(build_schedule(n, p, m), c).makespan  # noqa: E731
        while m <= 400 and spans("zb-h1") < spans("1f1b") - 1e-9:
            m += 1
        return m - 1

    return _function_check("4.1", fn, points, largest, "largest_m(p, f, b, w, bw)",
                           "the split saves bubble once per step but pays T_B + T_W - T_BW on every "
                           "microbatch: write both makespans as functions of m and find where they cross; "
                           "and which W's still fit their gaps when T_W > T_F?")


AUTO_LIMITS = tuple(range(4, 14))
"""The memory limits (M_B) exercises 4.2 and 4.3 plan :data:`AUTO_CASE` under."""


def _auto_rates() -> list[float]:
    return [_auto(float(lim)).bubble_rate for lim in AUTO_LIMITS]


def bubble_floor_limit(answer: Any) -> Verdict:
    """Exercise 4.2: the smallest whole memory limit (M_B, from 4) at which zb-auto's bubble rate on
    :data:`AUTO_CASE` reaches its floor over :data:`AUTO_LIMITS`; predicted. The lesson's limits copied
    (ZB-H2's 2p - 1, zb-2p's 2p) get their own message."""
    rates = _auto_rates()
    expected = AUTO_LIMITS[next(i for i, r in enumerate(rates) if r <= min(rates) + 1e-12)]
    p = AUTO_CASE["num_ranks"]
    why = ("a larger limit lets rank 0 start more forwards before its first B; how many fit before that B "
           "can arrive, with T_B twice T_F?")
    known = {
        2 * p - 1: (f"{2 * p - 1} = 2p - 1 is ZB-H2's warm-up, which fills rank 0's wait only when "
                    "T_B = T_F.", why),
        2 * p: (f"{2 * p} = 2p is zb-2p's limit, ZB-H2's 2p - 1 rounded up; here T_B = 2 T_F.", why),
    }
    return _number_check("4.2", answer, expected, "the limit where the bubble first reaches its floor", why,
                         known=known)


def auto_warmup(fn: Any) -> Verdict:
    """Exercise 4.3: ``warmup(p, limit, r, f, b)``, the F rank r runs before its first B when zb-auto plans
    :data:`AUTO_CASE`'s costs (T_F = ``f``, T_B = ``b``) under ``limit`` M_B; checked at limits 4 to 13, every
    rank, on each of :data:`WARMUP_CASES`."""
    ms = {p: m for p, m, _, _ in WARMUP_CASES}

    def counted(p, limit, r, f, b):
        plan = _auto(float(limit), p, ms[p], b, f).schedule
        return next(i for i, a in enumerate(plan.actions[r]) if a.kind != "F")

    points = [(p, lim, r, f, b) for p, _, f, b in WARMUP_CASES for lim in AUTO_LIMITS for r in range(p)]
    return _function_check("4.3", fn, points, counted, "warmup(p, limit, r, f, b)",
                           "two things can end a warm-up: memory, and the arrival of the rank's first B. "
                           "Which one binds on which rank, and what does the second depend on when T_B "
                           "differs from T_F?")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "4.1": bw_break_even, "4.2": bubble_floor_limit, "4.3": auto_warmup
}
"""Lesson 4's exercises by id -> check."""

REVEALS: dict[str, Callable[[], Any]] = {"4.2": lambda: _line_figure(
    list(AUTO_LIMITS), _auto_rates(),
    "zb-auto, AUTO_CASE: bubble rate against the memory limit", "memory limit (M_B)")}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "AUTO_CASE", "bw_break_even", "AUTO_LIMITS", "bubble_floor_limit", "auto_warmup", "EXERCISES", "REVEALS"
]
