"""Lesson 1's exercise checks (pipeline bubbles): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

import math
import random
import time
from fractions import Fraction
from typing import Any, Callable

from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from ..viz.figures import timeline_figure
from .checks import (Verdict, _alone, _as_number, _called, _function_check, _hand_schedule, _one_slow_stage,
                     _with_fresh, course_cache)


SLOW_MIDDLE = _one_slow_stage(3, 1)
"""Exercise 1.1's reveal: p = 3 stages, T_F = 1 and a fused T_BW = 2, but stage 1 twice as slow."""


def makespan_1f1b(fn: Any) -> Verdict:
    """Exercise 1.1: ``slow_1f1b(p, m, s)``, 1F1B's makespan on p >= 2 ranks, m >= p microbatches, T_F = 1
    and T_BW = 2 except on stage ``s``, where both are twice that, T_comm = 0; checked against the simulator
    for p = 2 to 5, every s, m = p and 2p + 1, at p = 3, m = 6, s = 1 (:data:`SLOW_MIDDLE`, the reveal's
    case) and at points drawn afresh up to p = 12, the package out of bounds. A count that leaves out the
    slow rank's wait in its warm-up, and one that prices the gradient's way back to the first stage at T_F
    instead of T_BW, get their own messages. The derivation: the lesson's Solutions."""
    fixed = [(p, m, s) for p in range(2, 6) for s in range(p) for m in (p, 2 * p + 1)] + [(3, 6, 1)]

    def draw(rng):
        p = rng.randint(6, 12)
        return p, rng.randint(p, 3 * p), rng.randint(0, p - 1)

    def expected(p, m, s):
        return simulate(build_schedule("1f1b", p, m), _one_slow_stage(p, s)).makespan

    known = [(lambda p, m, s: 6 * m + 3 * s,
              "the slow rank's own work plus the way down to it and back is not all: in its warm-up it "
              "runs out of forwards before microbatch 0's gradient comes back."),
             (lambda p, m, s: 6 * m + p - 1 + s,
              "after the slow rank's last BW, its gradient still goes back through the stages before it, "
              "each running a BW, not an F.")]
    return _function_check("1.1", fn, _with_fresh(fixed, draw, 3), expected, "slow_1f1b(p, m, s)",
                           "which rank sets the pace? Start from its own work, then add the time it cannot "
                           "overlap with it: what must run before it can start, what runs after it ends, and "
                           "any moment it waits for another rank.", known=known)


LEAN_LIMIT = 2
"""Exercise 1.3's limit: no rank may hold more than this many microbatches' activations (in M_B)."""


def _lean_reference() -> float:
    """The least makespan of exercise 1.3's schedules (F's and fused BW's, p = 3, m = 4, T_F = 1, T_BW = 2):
    a bound no such schedule beats, and one attains it (tests/test_lesson1_claims.py)."""
    # Rank 0 runs at most LEAN_LIMIT F's before its first BW, which waits for the chain down and back
    # (3 T_F + 3 T_BW = 9): idle at least 9 - 2 T_F - T_BW; its last BW waits for the chain after its last F
    # (2 T_F + 3 T_BW = 8) with at most LEAN_LIMIT BW's left to run: idle at least 8 - 2 T_BW; add its busy
    # time 4 (T_F + T_BW).
    unit, p, m = Costs(), 3, 4  # the costs lean_schedule simulates with
    f, bw = unit.f, unit.b + unit.w
    first_wait = p * (f + bw) - LEAN_LIMIT * f - bw
    last_wait = (p - 1) * f + p * bw - LEAN_LIMIT * bw
    return m * (f + bw) + first_wait + last_wait


def lean_schedule(actions: Any) -> Verdict:
    """Exercise 1.3: a valid schedule for p = 3, m = 4 (stage r on rank r) in which no rank holds more than
    :data:`LEAN_LIMIT` microbatches' activations (1F1B's rank 0 holds 3), of F's and fused BW's only (lesson
    1 does not split the backward), finishing as early as any such schedule at unit costs
    (:func:`_lean_reference`): three lists of actions in our text form (``"0F1"``, ``"1BW0"``;
    :meth:`~zbpp_lite.schedules.ir.Action.from_text`) or ``Action``'s. Checked with
    :func:`zbpp_lite.validate` and :func:`zbpp_lite.simulate` (unit costs)."""
    hint = ("rank 0 may run 2 F's before a gradient comes back: does each rank run every F it may, and what "
            "in your order makes a gradient leave rank 1 later than it could?")
    schedule, refused = _hand_schedule("1.3", actions, 3, 4, hint, '"0F0" or "1BW1"')
    if refused is not None:
        return refused
    if any(a.kind not in ("F", "BW") for row in schedule.actions for a in row):
        return Verdict("1.3", False, "valid, but it splits a backward into B and W; this exercise fuses "
                       "them.", "write each backward as one BW, as lesson 1 does (lesson 2 splits it).")
    run = simulate(schedule, Costs())
    over = [r for r, peak in enumerate(run.peak_memory) if peak > LEAN_LIMIT]
    if over:
        held = f"{run.peak_memory[over[0]]:g}"
        return Verdict("1.3", False, f"valid, but rank {over[0]} holds {held} microbatches at once.", hint)
    best = _lean_reference()
    if run.makespan > best + 1e-9:
        return Verdict("1.3", False, f"valid and within the limit, but it takes {run.makespan:g} time units; "
                                     f"a schedule within the limit takes {best:g}.", hint)
    return Verdict("1.3", True, f"zb.validate accepts it, the ranks hold at most {max(run.peak_memory):g} "
                                f"microbatches (per rank {[int(x) for x in run.peak_memory]}), and it takes "
                                f"{run.makespan:g}, as fast as the limit allows.")


def peak_memory_1f1b(fn: Any) -> Verdict:
    """Exercise 1.4: ``last_peak(p, m, r, f, bw)``, the last time rank r's activations rise to their peak
    under 1F1B (T_F = f, fused T_BW = bw, T_comm = 0, memory counted from an F's start). Checked at
    p = 1..6, m = 1..9, every rank, four (T_F, T_BW) (one with T_BW < T_F), against the simulator's memory
    curve. The time rank r first reaches its peak, given for the last, and a form right in the steady state
    given also to an m too small to have one, get their own messages. The derivation: the lesson's
    Solutions."""
    points = [(p, m, r, f, bw) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 9) for r in range(p)
              for f, bw in ((1.0, 2.0), (1.5, 1.0), (0.5, 3.0), (2.0, 0.5))]

    def last_peak(p: int, m: int, r: int, f: float, bw: float) -> float:
        curve = simulate(build_schedule("1f1b", p, m), Costs(f=f, b=bw / 2, w=bw / 2)).memory_curve(r)
        top = max(v for _, v in curve)
        return [t for t, v in curve if v == top][-1]

    known = [(lambda p, m, r, f, bw: (min(p, r + m) - 1) * f, "that is the first time rank r reaches its "
              "peak, at its last warm-up F; in the steady state a BW frees one and the next F brings it "
              "back"),
             (lambda p, m, r, f, bw: (m - 1) * (f + bw) + r * f, "right in the steady state; with m <= p - r "
              "there is none: every F is a warm-up F")]
    return _function_check("1.4", fn, points, last_peak, "last_peak(p, m, r, f, bw)",
                           "which F brings rank r to its peak for the last time? When m > p - r it comes "
                           "right after a BW: which microbatch's, and when does that BW end, given the last "
                           "rank's?", known=known)


BATCH_SPLIT = dict(f_work=48.0, backward_work=96.0, ranks=(1, 2, 4, 8), fixed=(0.05, 0.3, 1.0, 4.0, 20.0),
                   near_half=((2, 5.9), (4, 7.17)), tiny=(8, 1e-6), seconds=2e-3)
"""Exercise 1.2's case: 1F1B on p ranks; one step's batch cut into m microbatches, any whole m >= 1 (no cap:
a large batch); every action costs a fixed cost c plus its share of the batch's work, so T_F = c + 48/m and
the fused backward, one action, T_BW = c + 96/m; T_comm = 0. Checked at every p of ``ranks`` and c of
``fixed``, at the ``near_half`` points (p, c), where rounding the real-valued best m to the nearest whole
number gives the wrong m, and at ``tiny``, where the best m is over 20,000: there, and
at five more points of its p with c drawn from c to 2c (a new c each call, so no answer cached from an
earlier call helps), an answer must come within ``seconds`` (2 ms, the fastest of the five), too little to
try every m (some 20,000 steps of a Python loop take several ms on any CPU; a formula, microseconds)."""
# near_half: sqrt(72 (p - 1) / c) is 3.49 and 5.49, but the next whole m is shorter (n (n + 1) < 72 (p - 1)
# / c); tiny: the best m is 22,450.


def _batch_split_span(p: int, m: int, fixed: float, per_action: int = 2) -> Fraction:
    """1F1B's makespan (m + p - 1)(T_F + T_BW) in exact arithmetic, ``per_action`` fixed costs per microbatch
    and stage (2: one F, one BW; 3: the backward charged as a B and a W). Equal to the simulator's for 1F1B
    at T_comm = 0 (lesson 1's closed form; tests/test_exercises.py checks it against ``simulate``)."""
    work = Fraction(BATCH_SPLIT["f_work"] + BATCH_SPLIT["backward_work"])
    return (m + p - 1) * (per_action * Fraction(str(fixed)) + work / m)   # c as written: 0.3, not its binary


@course_cache(maxsize=32)
def _best_m(p: int, fixed: float, per_action: int = 2) -> int:
    """Exercise 1.2's answer at (p, c) (``per_action``: as :func:`_batch_split_span`), the smaller m on a
    tie, compared exactly (cached)."""
    # The makespan is per_action c m + 144 (p - 1)/m plus terms free of m, least at
    # s = sqrt(144 (p - 1) / (per_action c)); the best whole m is floor(s) or ceil(s) (at least 1),
    # whichever is shorter, the smaller on a tie, compared exactly.
    s = math.sqrt((BATCH_SPLIT["f_work"] + BATCH_SPLIT["backward_work"]) * (p - 1) / (per_action * fixed))
    near = {max(1, math.floor(s)), max(1, math.ceil(s))}
    return min(near, key=lambda m: (_batch_split_span(p, m, fixed, per_action), m))


def batch_split(fn: Any) -> Verdict:
    """Exercise 1.2: ``best_m(p, c)``, the number of microbatches m (any whole m >= 1) for which 1F1B on p
    ranks (:data:`BATCH_SPLIT`, each action paying a fixed cost c) has the shortest makespan, the smallest m
    on a tie, checked at every point of ``BATCH_SPLIT``, one rank included: rounding the real optimum to
    the nearest whole number fails somewhere, and at ``tiny`` an answer that takes over 2 ms (every m
    tried) is refused. Charging c twice for the fused backward gets its own hint. The derivation: the
    lesson's Solutions."""
    hint = ("write the makespan (m + p - 1)(T_F + T_BW) with T_F and T_BW as functions of c and m: which "
            "part grows with m, which shrinks? Find where the sum is least, then compare the whole numbers "
            "on either side.")
    points = [(p, c) for p in BATCH_SPLIT["ranks"] for c in BATCH_SPLIT["fixed"]]
    points += [*BATCH_SPLIT["near_half"], BATCH_SPLIT["tiny"]]
    verdict = _function_check("1.2", fn, points, _best_m, "best_m(p, c)", hint)
    if not callable(fn):
        return verdict
    if verdict.ok:
        p, c = BATCH_SPLIT["tiny"]
        took = []
        for point in [(p, c * random.uniform(1.0, 2.0)) for _ in range(5)]:   # new each call: none cached
            try:
                seconds, _ = _seconds(fn, point)   # timed without the watch, which would slow it
            except (Exception, SystemExit) as e:  # noqa: BLE001  (the learner's error is the verdict)
                return Verdict("1.2", False, f"your function raised {type(e).__name__} at {point}: {e}", hint)
            got, refused = _called("1.2", fn, point, hint)   # then judged as the other points, watched
            if refused is not None:
                return refused
            value, best = _as_number(got), _best_m(*point)
            span = lambda m: _batch_split_span(point[0], m, point[1])  # noqa: E731
            whole = None if value is None or value < 1 else round(value)
            if whole is None or abs(value - whole) > 1e-6 * whole or (   # (a tie: as short within float
                    whole != best and span(whole) > span(best) * (1 + 1e-12)):   # rounding, a float's pick)
                return Verdict("1.2", False, f"at {point} your function gives {got!r}, which is wrong there.",
                               hint)
            took.append(seconds)
        if min(took) > BATCH_SPLIT["seconds"]:   # the fastest of five: load aside
            return Verdict("1.2", False, f"right, but best_m(p, c) at p = {p} and c from {c:g} to {2 * c:g} "
                           f"took {min(took) * 1e3:.1f} ms at the fastest: trying every m is too slow for a "
                           "tiny c (the check allows 2 ms).", hint)
        return verdict
    try:
        twice = all(_alone(fn, (p, c)) == _best_m(p, c, 3) for p, c in points)
    except (Exception, SystemExit):  # noqa: BLE001  (the learner's function raising is the verdict above)
        twice = False
    if twice:
        return Verdict("1.2", False, "that is the best m with c charged twice for each backward.",
                       "1F1B runs each backward fused: one action, so one c, not two.")
    return verdict


def _seconds(fn: Callable, point: tuple) -> tuple[float, Any]:
    """(seconds one call ``fn(*point)`` takes, what it returned); no profile hook, which would slow it."""
    start = time.perf_counter()
    got = fn(*point)
    return time.perf_counter() - start, got


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "1.1": makespan_1f1b, "1.2": batch_split, "1.3": lean_schedule, "1.4": peak_memory_1f1b
}
"""Lesson 1's exercises by id -> check."""

REVEALS: dict[str, Callable[[Any], Any]] = {
    "1.1": lambda answer: timeline_figure(simulate(build_schedule("1f1b", 3, 6), SLOW_MIDDLE),
                                   "1F1B, p = 3, m = 6, stage 1 twice as slow")}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "SLOW_MIDDLE", "LEAN_LIMIT", "makespan_1f1b", "lean_schedule", "peak_memory_1f1b", "BATCH_SPLIT",
    "batch_split",
    "EXERCISES", "REVEALS"
]
