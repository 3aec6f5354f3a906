"""Lesson 1's exercise checks (pipeline bubbles): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

from typing import Any, Callable


from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from ..viz.figures import timeline_figure
from .checks import Verdict, _function_check, _hand_schedule, _number_check


SLOW_MIDDLE = Costs(f=[1.0, 2.0, 1.0], b=[1.0, 2.0, 1.0], w=[1.0, 2.0, 1.0])
"""Exercise 1.1's costs: p = 3 stages, T_F = 1 and a fused T_BW = 2, but stage 1 twice as slow."""


def makespan_1f1b(answer: Any) -> Verdict:
    """Exercise 1.1: 1F1B's makespan for p = 3, m = 6, T_F = 1, T_BW = 2 (twice on stage 1:
    :data:`SLOW_MIDDLE`), T_comm = 0; predicted."""
    expected = simulate(build_schedule("1f1b", 3, 6), SLOW_MIDDLE).makespan
    return _number_check(
        "1.1", answer, expected, "1F1B's makespan with a slow stage 1",
        "which rank sets the pace? Start from its own work, then add the time it cannot overlap with it: "
        "what must run before it can start, what runs after it ends, and any moment it waits for another "
        "rank.",
    )


LEAN_LIMIT = 2
"""Exercise 1.3's limit: no rank may hold more than this many microbatches' activations (in M_B)."""


def _lean_reference() -> float:
    """The least makespan of exercise 1.3's schedules (F's and fused BW's, p = 3, m = 4, T_F = 1, T_BW = 2):
    a bound no such schedule beats, and one attains it (tests/test_lesson1_claims.py). Rank 0 runs at most
    LEAN_LIMIT F's before its first BW, which waits for the chain down and back (3 T_F + 3 T_BW = 9): idle
    at least 9 - 2 T_F - T_BW; its last BW waits for the chain after its last F (2 T_F + 3 T_BW = 8) with at
    most LEAN_LIMIT BW's left to run: idle at least 8 - 2 T_BW; add its busy time 4 (T_F + T_BW)."""
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
    """Exercise 1.4: ``peak_time(p, m, r, f, bw)``, the earliest time rank r holds its peak activations
    under 1F1B (T_F = f, fused T_BW = bw, T_comm = 0); checked at p = 1..6, m = 1..9, every rank, three
    (T_F, T_BW), against the simulator's memory curve."""
    points = [(p, m, r, f, bw) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 9) for r in range(p)
              for f, bw in ((1.0, 2.0), (1.5, 1.0), (0.5, 3.0))]

    def first_peak(p: int, m: int, r: int, f: float, bw: float) -> float:
        curve = simulate(build_schedule("1f1b", p, m), Costs(f=f, b=bw / 2, w=bw / 2)).memory_curve(r)
        top = max(v for _, v in curve)
        return next(t for t, v in curve if v == top)

    return _function_check("1.4", fn, points, first_peak, "peak_time(p, m, r, f, bw)",
                           "the peak comes with rank r's last warm-up F: how many F's does it run before its "
                           "first backward (mind m < p), and when can each start, given rank r - 1's?")


BATCH_SPLIT = dict(f_work=48.0, backward_work=96.0, splits=(8, 16), ranks=(1, 2, 3, 4, 6, 8))
"""Exercise 1.2's case: 1F1B on p ranks; one step's batch cut into m microbatches; every action costs a
fixed cost c plus its share of the batch's work, so T_F = c + 48/m and the fused backward, one action,
T_BW = c + 96/m; T_comm = 0. The question: the c at which the two ``splits`` tie, as a function of p,
checked at ``ranks``."""


def _batch_split_span(p: int, m: int, fixed: float) -> float:
    c = BATCH_SPLIT
    f, bw = fixed + c["f_work"] / m, fixed + c["backward_work"] / m
    return simulate(build_schedule("1f1b", p, m), Costs(f=f, b=bw / 2, w=bw / 2, bw=bw)).makespan


def _tie(p: int) -> float:
    """The fixed cost at which the two splits tie on p ranks: the makespans are linear in c, so the crossing
    of the two simulations at c = 0 and c = 1."""
    small, large = BATCH_SPLIT["splits"]
    slope = {m: _batch_split_span(p, m, 1.0) - _batch_split_span(p, m, 0.0) for m in (small, large)}
    gap = _batch_split_span(p, small, 0.0) - _batch_split_span(p, large, 0.0)
    return gap / (slope[large] - slope[small])


def batch_split(fn: Any) -> Verdict:
    """Exercise 1.2 (an inverse question): ``tie_cost(p)``, the fixed cost c per action at which 1F1B on p
    ranks (:data:`BATCH_SPLIT`) takes as long with m = 8 as with m = 16; checked against the simulator at
    every p of ``BATCH_SPLIT["ranks"]``. Charging c twice for the fused backward (as a B and a W) gives 2/3
    of it, refused with its own hint."""
    small, large = BATCH_SPLIT["splits"]
    points = [(p,) for p in BATCH_SPLIT["ranks"]]
    hint = ("write the makespan (m+p-1)(T_F+T_BW) with T_F and T_BW as functions of c and m (how many "
            "actions, so how many fixed costs c, does a microbatch's backward take in 1F1B?), once for each "
            "m, and solve for c; what does the bubble's share (p-1) do to the answer?")
    verdict = _function_check("1.2", fn, points, _tie, "tie_cost(p)", hint)
    if not verdict.ok and callable(fn) and _function_check("1.2", fn, points, lambda p: _tie(p) * 2 / 3, "",
                                                           hint).ok:
        return Verdict("1.2", False, "2/3 of the tie: your function charges c twice for the backward.",
                       "1F1B runs each backward fused: one action, so one c, not two.")
    if verdict.ok:
        both = _batch_split_span(4, small, _tie(4))
        verdict = Verdict("1.2", True, f"{verdict.message} At p = 4 both take {both:g}; a smaller cost "
                                       f"favours m = {large}, a larger one m = {small}, and the more ranks, "
                                       "the more the bubble favours many microbatches.")
    return verdict


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "1.1": makespan_1f1b, "1.2": batch_split, "1.3": lean_schedule, "1.4": peak_memory_1f1b
}
"""Lesson 1's exercises by id -> check."""

REVEALS: dict[str, Callable[[], Any]] = {
    "1.1": lambda: timeline_figure(simulate(build_schedule("1f1b", 3, 6), SLOW_MIDDLE),
                                   "1F1B, p = 3, m = 6, stage 1 twice as slow")}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "SLOW_MIDDLE", "LEAN_LIMIT", "makespan_1f1b", "lean_schedule", "peak_memory_1f1b", "BATCH_SPLIT",
    "batch_split",
    "EXERCISES", "REVEALS"
]
