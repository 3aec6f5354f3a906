"""Lesson 1's exercise checks (pipeline bubbles): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

from typing import Any, Callable

from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from ..viz.figures import timeline_figure
from .checks import Verdict, _function_check, _hand_schedule, _one_slow_stage, _with_fresh


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
                                     "a schedule within the limit can end sooner.", hint)
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


BLOCKING_POINTS = tuple((m, d, t) for m in (1, 2, 3, 8, 20)
                        for d, t in ((1.0, 3.0), (3.0, 1.0), (2.0, 2.0), (0.02, 1.5), (0.5, 0.05)))
"""Exercise 1.2's fixed points (m calls, d to dispatch one, t to run one, in any unit); the check adds three
drawn afresh (m up to 50, d and t from 0.01 to 5)."""


def _blocking_cost(m: int, d: float, t: float) -> float:
    """How much longer m calls take blocked one by one, m (d + t), than dispatched at once: Python and the
    device then work as a two-stage pipeline, timed by the simulator (GPipe on two stages, T_F = d on the
    first, t on the second, no backward)."""
    queued = simulate(build_schedule("gpipe", 2, m), Costs(f=[d, t], b=0.0, w=0.0)).makespan
    return m * (d + t) - queued


def blocking_cost(fn: Any) -> Verdict:
    """Exercise 1.2: ``blocking_cost(m, d, t)``, how much longer m calls take when Python blocks on each
    call's result before dispatching the next (as the executor does, to time each action) than when it
    dispatches each at once (JAX's asynchronous dispatch; the device runs the calls in order), Python
    taking d to dispatch a call and the device t to run it, nothing else costing time. Checked at
    :data:`BLOCKING_POINTS` and three points drawn afresh against :func:`_blocking_cost`, the package out of
    bounds. An answer right only while d <= t (or t <= d), and one that counts the first call too, get
    their own messages. The derivation: the lesson's Solutions; the model of dispatch: JAX's documentation,
    "Asynchronous dispatch"."""
    def draw(rng):
        return rng.randint(2, 50), round(rng.uniform(0.01, 5.0), 3), round(rng.uniform(0.01, 5.0), 3)

    known = [(lambda m, d, t: (m - 1) * d, "right only while d <= t: when Python is the slower side, what "
              "hides behind each dispatch is the device's t."),
             (lambda m, d, t: (m - 1) * t, "right only while t <= d: when the device is the slower side, "
              "what hides behind each run is Python's d."),
             (lambda m, d, t: m * min(d, t), "the first call hides nothing either way: the device has "
              "nothing to run while Python dispatches it.")]
    hint = ("draw both ways on two rows of time, Python's and the device's. With the next call dispatched "
            "at once, which row sets the pace, and what of the other row's time is hidden?")
    return _function_check("1.2", fn, _with_fresh(list(BLOCKING_POINTS), draw, 3), _blocking_cost,
                           "blocking_cost(m, d, t)", hint, known=known)


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "1.1": makespan_1f1b, "1.2": blocking_cost, "1.3": lean_schedule, "1.4": peak_memory_1f1b
}
"""Lesson 1's exercises by id -> check."""

REVEALS: dict[str, Callable[[Any], Any]] = {
    "1.1": lambda answer: timeline_figure(simulate(build_schedule("1f1b", 3, 6), SLOW_MIDDLE),
                                   "1F1B, p = 3, m = 6, stage 1 twice as slow")}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "SLOW_MIDDLE", "LEAN_LIMIT", "makespan_1f1b", "lean_schedule", "peak_memory_1f1b", "BLOCKING_POINTS",
    "blocking_cost", "EXERCISES", "REVEALS"
]
