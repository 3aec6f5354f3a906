"""Lesson 6's exercise checks (interleaved and looped placements): one function per exercise, which says
right or not yet with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

import functools
from typing import Any, Callable


from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from .checks import Verdict, _called, _function_check, _function_missing, _line_figure, _number_check


INTERLEAVED_CASE = dict(num_ranks=4, num_microbatches=8, whole_rank=1.0, comm=0.125, max_v=6)
"""Exercise 6.2's case: interleaved 1F1B, p = 4, m = 8, a whole rank's T_F = T_B = T_W = 1 (each of v
stages per rank costs 1/v of it), T_comm = 0.125 per transfer; v from 1 to 6."""


@functools.lru_cache(maxsize=1)
def _interleaved_makespans() -> dict[int, float]:
    c = INTERLEAVED_CASE
    return {v: simulate(build_schedule("interleaved-1f1b", c["num_ranks"], c["num_microbatches"],
                                       stages_per_rank=v),
                        Costs(f=c["whole_rank"] / v, b=c["whole_rank"] / v, w=c["whole_rank"] / v,
                              comm=c["comm"])).makespan
            for v in range(1, c["max_v"] + 1)}


def interleaved_best_v(answer: Any) -> Verdict:
    """Exercise 6.2: the v (1 .. 6) giving interleaved 1F1B the shortest makespan on
    :data:`INTERLEAVED_CASE`, where more stages per rank shrink the bubble but add transfers; predicted.
    The answers of a half-done derivation get their own message: T_comm ignored (the most v), T_comm
    counted once per link instead of on the way down and back (v = 4), no interleaving, the lesson's v."""
    spans = _interleaved_makespans()
    best = min(spans, key=spans.get)
    hint = ("the bubble (p-1)(T_F+T_B+T_W)/v falls with v; which transfers can no action hide, on the first "
            "microbatch's way down and the last one's way back? Count them as a function of v, add, "
            "minimise.")
    known = {
        float(INTERLEAVED_CASE["max_v"]): ("the most stages per rank would win if transfers were free; "
                                           "each extra link adds T_comm.", hint),
        4.0: ("4 counts each link's transfer once; the critical path crosses the links going down (the "
              "first microbatch's F) and again coming back (the last one's backward).", hint),
        1.0: ("v = 1 (one stage per rank, in Megatron's warm-up order, not 1F1B's) keeps the largest "
              "bubble, (p-1)(T_F+T_B+T_W).", hint),
        2.0: ("2 is the lesson's example, not the minimum with T_comm = 0.125.", hint),
    }
    return _number_check("6.2", answer, best, "the v with the shortest makespan", hint, known=known)


def interleaved_peak(fn: Any) -> Verdict:
    """Exercise 6.3: ``peak(p, v, r)``, rank r's peak activations under interleaved 1F1B (m >= 2p) in
    stage units (M_B/v each, lesson 5); checked for p = 2..5, v = 1..4, every rank, m = 2p and 3p. At
    v = 1 the builder keeps Megatron's warm-up, so rank r holds 2(p - r) - 1, not 1F1B's p - r."""
    def held(p, v, m):
        return simulate(build_schedule("interleaved-1f1b", p, m, stages_per_rank=v), Costs()).peak_memory

    peaks = {(p, v, m): held(p, v, m) for p in (2, 3, 4, 5) for v in (1, 2, 3, 4) for m in (2 * p, 3 * p)}
    points = [(p, v, r) for (p, v, m) in peaks for r in range(p) if m == 2 * p]

    return _function_check("6.3", fn, points,
                           lambda p, v, r: max(peaks[p, v, 2 * p][r], peaks[p, v, 3 * p][r]), "peak(p, v, r)",
                           "count rank r's forwards before its first backward: microbatch 0 must pass every "
                           "later stage (v - 1 more rounds of the ranks, then the ranks after r) and come "
                           "back to rank r, and rank r fills that wait with forwards, at most one per slot "
                           "(Megatron's warm-up, even at v = 1: not 1F1B's p - r). Count in stage units.")


def _zigzag_rank(p: int, s: int) -> int:
    """The rank of stage s when v passes over p ranks turn at each end (down, up, down, ...)."""
    return s % p if (s // p) % 2 == 0 else p - 1 - s % p


def zigzag_stages(fn: Any) -> Verdict:
    """Exercise 6.1: a function ``stages(p, v, r)``: the stages rank r holds when lesson 5's V is
    extended to v stages per rank (v passes over the ranks, down on even passes and up on odd ones,
    so a pass starts on the rank the previous one ended on; v = 2 is ZB-V's placement), as a list in
    increasing order. Checked for p = 1..5, v = 1..5, every rank."""
    hint = ("write down pass k's stages, kp .. kp + p - 1, and which rank each lands on when the pass runs "
            "down the ranks and when it runs back up; rank r gets one stage from every pass.")
    missing = _function_missing("6.1", fn, hint)
    if missing is not None:
        return missing
    points = [(p, v, r) for p in range(1, 6) for v in range(1, 6) for r in range(p)]
    wrong = []
    for p, v, r in points:
        want = [s for s in range(p * v) if _zigzag_rank(p, s) == r]
        got, refused = _called("6.1", fn, (p, v, r), hint)
        if refused is not None:
            return refused
        if not isinstance(got, (list, tuple, range)) or list(got) != want:
            wrong.append((p, v, r))
    if wrong:
        return Verdict("6.1", False,
                       f"stages(p, v, r) is off at {wrong[0]} ({len(wrong)} of {len(points)} points).", hint)
    return Verdict("6.1", True, f"stages(p, v, r) agrees at all {len(points)} points checked.")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "6.1": zigzag_stages, "6.2": interleaved_best_v, "6.3": interleaved_peak
}
"""Lesson 6's exercises by id -> check."""

def _reveal_6_2():
    spans = _interleaved_makespans()
    return _line_figure(list(spans), list(spans.values()),
                        "interleaved 1F1B, INTERLEAVED_CASE: makespan against v",
                        "stages per rank v", "makespan")


REVEALS: dict[str, Callable[[], Any]] = {"6.2": _reveal_6_2}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "INTERLEAVED_CASE", "interleaved_best_v", "interleaved_peak", "zigzag_stages", "EXERCISES", "REVEALS"
]
