"""Lesson 4's exercise checks (zb-auto): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence


from ..schedules.builders import build_schedule
from ..schedules.builders.auto import auto_plan
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from .checks import (Verdict, _called, _function_missing, _hand_schedule, _settled, _shown, _unanswered,
                     _with_fresh, course_cache)


# zb-auto's plan takes 31 and the optimum is 30 (proven by the MILP); with zb-auto's orders kept on ranks 0
# and 2, rank 1's order alone reaches 30: B2 before F3, then F4 before B3 (tests/test_exercises.py).
HAND_CASE = dict(num_ranks=3, num_microbatches=5, costs=Costs(f=1.0, b=2.0, w=1.0),
                 memory_limit=(2.0, 3.0, 3.0))
"""Exercise 4.2's case: p = 3, m = 5, T_F = 1, T_B = 2, T_W = 1, T_comm = 0, M_W = 7/16 M_B; rank 0 may hold 2
M_B of activations (it also holds, say, an embedding table), ranks 1 and 2 zb-auto's default, p M_B;
zb-auto's plan takes 31 and the MILP's optimum is 30 (the lesson shows both)."""


SPLIT_COSTS = Costs(f=7.7, b=8.0, w=6.5, bw=11.9)
"""Exercise 4.1's costs (ms): the lesson's CPU measurement, with the fused backward's own cost; a split
costs T_B + T_W - T_BW = 2.6 ms of work."""


def _split_plan(p: int, m: int, splits: frozenset) -> Any:
    """1F1B on p ranks (stage r on rank r) and m microbatches, with the backward of each (rank, microbatch) in
    ``splits`` run split: its B in the BW's place, its W moved to the end of the rank's list (in the order
    of the B's); every other backward stays fused."""
    from ..schedules.ir import Action, Schedule

    base, rows = build_schedule("1f1b", p, m), []
    for r, row in enumerate(base.actions):
        kept, moved = [], []
        for a in row:
            if a.kind == "BW" and (r, a.microbatch) in splits:
                kept.append(Action("B", a.stage, a.microbatch))
                moved.append(Action("W", a.stage, a.microbatch))
            else:
                kept.append(a)
        rows.append(tuple(kept + moved))
    return Schedule(tuple(rows), base.placement, m, "1f1b, some split")


def _split_span(p: int, m: int, splits: frozenset) -> float:
    return simulate(_split_plan(p, m, splits), SPLIT_COSTS).makespan


@course_cache(maxsize=64)
def _auto_span(p: int, m: int) -> float:
    """zb-auto's makespan on :data:`SPLIT_COSTS` (it fuses some backwards and splits the rest; cached)."""
    return simulate(build_schedule("zb-auto", p, m, costs=SPLIT_COSTS), SPLIT_COSTS).makespan


SPLIT_POINTS = ((2, 4), (2, 7), (3, 6), (3, 10))
"""Exercise 4.1's fixed points (p, m); the check adds two drawn afresh (p = 2 or 3, m = 2p to 6p)."""


def split_where_it_pays(fn: Any) -> Verdict:
    """Exercise 4.1: ``split_these(p, m)``, the backwards (rank, microbatch) to run split in 1F1B on
    :data:`SPLIT_COSTS` (B in the BW's place, W at the rank's end: :func:`_split_plan`), p = 2 or 3, m >= 2p.
    Right when, at :data:`SPLIT_POINTS` and two points drawn afresh, the step is as short as zb-auto's plan
    and every split pays: without any one of them the step is longer. Not in the paper, which takes T_BW =
    T_B + T_W (arXiv 2401.10241, section 2)."""
    hint = ("a split pays only where another rank is waiting for that B, and its W needs room where its own "
            "rank would otherwise wait: read both off 1F1B's timeline, at the start and at the end.")
    missing = _function_missing("4.1", fn, hint, shape="a function split_these(p, m)")
    if missing is not None:
        return missing

    def draw(rng):
        p = rng.choice((2, 3))
        return p, rng.randint(2 * p, 6 * p)

    for p, m in _with_fresh(list(SPLIT_POINTS), draw, 2):
        got, refused = _called("4.1", fn, (p, m), hint)
        if refused is not None:
            return refused
        if _unanswered(got):
            return Verdict("4.1", False, f"at p = {p}, m = {m} your function returned {_shown(got)}: replace "
                           "the ... in its body.", hint, attempt=False)
        pairs = got if isinstance(got, (list, tuple)) else None
        if pairs is None or not all(isinstance(x, (list, tuple)) and len(x) == 2 and all(
                isinstance(i, int) and not isinstance(i, bool) for i in x) for x in pairs):
            return Verdict("4.1", False, f"at p = {p}, m = {m} expected (rank, microbatch) pairs such as "
                           f"{{(1, 0)}}, got {_shown(got)}.", hint)
        splits = frozenset((r, j) for r, j in pairs)
        outside = sorted(x for x in splits if not (0 <= x[0] < p and 0 <= x[1] < m))
        if outside:
            return Verdict("4.1", False, f"at p = {p}, m = {m} there is no backward {outside[0]}: ranks run "
                           f"0 to {p - 1}, microbatches 0 to {m - 1}.", hint)
        span, auto, plain = _split_span(p, m, splits), _auto_span(p, m), _split_span(p, m, frozenset())
        where = f"at p = {p}, m = {m}"
        if span > auto + 1e-6:
            return Verdict("4.1", False, f"{where} your splits give a step of {span:.1f} ms; zb-auto's plan "
                           f"takes {auto:.1f} and 1F1B {plain:.1f}.", hint)
        for x in sorted(splits):
            if _split_span(p, m, splits - {x}) <= span + 1e-6:
                price = SPLIT_COSTS.b + SPLIT_COSTS.w - SPLIT_COSTS.bw
                return Verdict("4.1", False, f"{where} the split of backward {x} buys nothing: the "
                               f"step takes {span:.1f} ms with it and without it, and the split costs "
                               f"{price:.1f} ms of work and holds its M_W to the rank's end.", hint)
    return Verdict("4.1", True, f"at each point the step is as short as zb-auto's plan ({where}: "
                   f"{span:.1f} ms against 1F1B's {plain:.1f}), and every split pays: each shortens "
                   "another rank's wait, and its W runs where its own rank would wait.")


@course_cache(maxsize=1)
def _hand_best() -> float:
    """The MILP's optimal makespan for :data:`HAND_CASE` (proven: its lower bound equals it; 0.1 s)."""
    from ..schedules.builders.milp import solve_optimal

    c = HAND_CASE
    return solve_optimal(c["num_ranks"], c["num_microbatches"], c["costs"], list(c["memory_limit"]),
                         time_limit=30).makespan


@course_cache(maxsize=1)
def _greedy() -> tuple[list[list[str]], float]:
    """zb-auto's plan for :data:`HAND_CASE`: each rank's actions in our text form, and its makespan."""
    c = HAND_CASE
    plan = auto_plan(c["num_ranks"], c["num_microbatches"], c["costs"], list(c["memory_limit"]))
    return [[a.text for a in row] for row in plan.schedule.actions], plan.makespan


def plan_around(order: Any) -> Verdict:
    """Exercise 4.2: rank 1's order for :data:`HAND_CASE`, a list of its actions in our text form
    (``"1F0"``, ``"1B2"``, ``"1W4"``; B and W split or fused), run with zb-auto's orders on ranks 0 and 2:
    right when the plan is valid (:func:`zbpp_lite.validate`), each rank within its own memory limit
    (:func:`zbpp_lite.simulate`'s peaks, M_W included) and as short as the MILP's optimum
    (:func:`_hand_best`; paper appendix)."""
    c = HAND_CASE
    limits, (greedy, greedy_span) = c["memory_limit"], _greedy()
    hint = ("twice, rank 1 has two inputs ready at once: which of the two does the rank that waits longest "
            "need first? Rank 0, held to 2 M_B, cannot start an F until a B and its W free one; the last "
            "microbatch's trip down and back ends the step.")
    if _unanswered(order):
        return Verdict("4.2", False, "no answer yet: replace ... with rank 1's actions, in order.", hint)
    order = _settled(order)
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
        return Verdict("4.2", False, f"expected a list of rank 1's actions such as ['1F0', '1F1', ...], "
                       f"got {order!r}.", hint)
    schedule, refused = _hand_schedule("4.2", [greedy[0], list(order), greedy[2]], c["num_ranks"],
                                       c["num_microbatches"], hint, '"1F0", "1B2" or "1W4"')
    if refused is not None:
        return refused
    run = simulate(schedule, c["costs"])
    peaks = [round(x, 4) for x in run.peak_memory]
    over = [r for r, (peak, limit) in enumerate(zip(run.peak_memory, limits)) if peak > limit + 1e-9]
    if over:
        r = over[0]
        return Verdict("4.2", False, f"valid, but rank {r} holds {peaks[r]:g} M_B at once, over its limit "
                       f"of {limits[r]:g} (peaks {peaks}).", hint)
    best = _hand_best()
    if run.makespan > best + 1e-9:
        same = " (zb-auto's own order)" if [str(a) for a in order] == greedy[1] else ""
        return Verdict("4.2", False, f"valid and within every rank's limit (peaks {peaks} M_B), but it takes "
                       f"{run.makespan:g}{same}; an order of rank 1 takes {best:g}.", hint)
    return Verdict("4.2", True, f"valid, within the limits (peaks {peaks} M_B against {list(limits)}), and "
                   f"{run.makespan:g}, the optimum the MILP proves for this case; zb-auto's plan takes "
                   f"{greedy_span:g}.")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "4.1": split_where_it_pays, "4.2": plan_around
}
"""Lesson 4's exercises by id -> check."""

def reveal_splits(fn: Any) -> Any:
    """Exercise 4.1's reveal: the timeline of 1F1B with ``fn(3, 6)``'s backwards split (:func:`_split_plan`)
    on :data:`SPLIT_COSTS`, zb-auto's makespan and 1F1B's in the title beside its own; None, with a line
    saying why, if ``fn(3, 6)`` raises or returns no (rank, microbatch) pairs."""
    from ..viz.figures import timeline_figure

    p, m = 3, 6
    try:
        splits = frozenset((int(r), int(j)) for r, j in fn(p, m))
    except Exception as e:  # the learner's function: any error is reported, not raised
        print(f"Exercise 4.1: split_these({p}, {m}) gave no (rank, microbatch) pairs ({type(e).__name__}).")
        return None
    plan, plain = simulate(_split_plan(p, m, splits), SPLIT_COSTS), _split_span(p, m, frozenset())
    return timeline_figure(plan, f"1F1B with your {len(splits)} splits, p = {p}, m = {m}, in ms (zb-auto "
                                 f"{_auto_span(p, m):.1f}, 1F1B {plain:.1f})")


REVEALS: dict[str, Callable[[Any], Any]] = {"4.1": reveal_splits}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "SPLIT_COSTS", "SPLIT_POINTS", "split_where_it_pays", "reveal_splits", "HAND_CASE", "plan_around",
    "EXERCISES", "REVEALS"
]
