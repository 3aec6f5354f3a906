"""Lesson 4's exercise checks (zb-auto): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence


from ..schedules.builders import build_schedule
from ..schedules.builders.auto import auto_plan
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from .checks import (Verdict, _called, _function_check, _function_missing, _hand_schedule, _line_figure,
                     _settled, _shown, _unanswered, _with_fresh, course_cache)


AUTO_CASE = dict(num_ranks=4, num_microbatches=16, costs=Costs(f=1.0, b=2.0, w=1.0))
"""Exercise 4.2's case: p = 4, m = 16 (4p, as the exercise), T_F = 1, T_B = 2, T_W = 1, T_comm = 0 (T_B !=
T_F, so ZB-H2's warm-up of 2(p-r)-1 forwards does not fill the wait for the first gradient)."""


# zb-auto's plan takes 31 and the optimum is 30 (proven by the MILP); with zb-auto's orders kept on ranks 0
# and 2, rank 1's order alone reaches 30: B2 before F3, then F4 before B3 (tests/test_exercises.py).
HAND_CASE = dict(num_ranks=3, num_microbatches=5, costs=Costs(f=1.0, b=2.0, w=1.0),
                 memory_limit=(2.0, 3.0, 3.0))
"""Exercise 4.3's case: p = 3, m = 5, T_F = 1, T_B = 2, T_W = 1, T_comm = 0, M_W = 7/16 M_B; rank 0 may hold 2
M_B of activations (it also holds, say, an embedding table), ranks 1 and 2 zb-auto's default, p M_B;
zb-auto's plan takes 31 and the MILP's optimum is 30 (the lesson shows both)."""


@course_cache(maxsize=64)
def _auto(limit: float):
    """zb-auto's plan under ``limit`` M_B of :data:`AUTO_CASE` (cached)."""
    c = AUTO_CASE
    return auto_plan(c["num_ranks"], c["num_microbatches"], c["costs"], limit)


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


AUTO_LIMITS = tuple(range(4, 14))
"""The memory limits (M_B) exercise 4.2's reveal plans :data:`AUTO_CASE` under."""


def _auto_rates() -> list[float]:
    return [_auto(float(lim)).bubble_rate for lim in AUTO_LIMITS]


@course_cache(maxsize=64)
def _floor_limit(p: int, f: float, b: float) -> int:
    """The smallest whole memory limit (M_B, from p to 4p + 2) at which zb-auto's bubble rate on p ranks,
    m = 4p, T_F = T_W = f, T_B = b, T_comm = 0 is at its least over those limits (cached)."""
    costs = Costs(f=float(f), b=float(b), w=float(f))
    rates = {limit: auto_plan(p, 4 * p, costs, float(limit)).bubble_rate for limit in range(p, 4 * p + 3)}
    floor = min(rates.values())
    return min(limit for limit, rate in rates.items() if rate <= floor + 1e-12)


def _floor_by_form(p: int, f: float, b: float) -> int:
    """Exercise 4.2's answer in closed form, for b a whole multiple of f (1 to 3 times): equal to
    :func:`_floor_limit` at p = 2..4 and two scaled points (tests/test_exercises.py), and used past the
    planned points."""
    # p + (p - 1) b / f: rank 0's first gradient is back after p T_F + (p - 1) T_B, and each forward
    # filling that wait holds 1 M_B.
    return p + (p - 1) * round(b / f)


FLOOR_PLANNED = ((2, 1.0, 1.0), (3, 1.0, 2.0), (4, 1.0, 2.0), (3, 1.0, 3.0), (2, 0.5, 1.0), (2, 2.0, 6.0),
                 (3, 0.5, 1.5))
"""Exercise 4.2's points (p, T_F, T_B) checked against zb-auto itself (planned once, then cached)."""


def bubble_floor_limit(fn: Any) -> Verdict:
    """Exercise 4.2 (predicted): ``floor_limit(p, f, b)``, the smallest whole memory limit (M_B) at which
    zb-auto's bubble rate on p ranks, m = 4p, T_F = T_W = f, T_B = b (a whole multiple of f, 1 to 3
    times), T_comm = 0 reaches its floor; checked against zb-auto at :data:`FLOOR_PLANNED` and at two
    points drawn afresh (p = 20..60, too many ranks to plan a table of quickly) against
    :func:`_floor_by_form`, a closed form the tests compare with zb-auto, the package out of bounds.
    ZB-H2's limit, zb-2p's, and the limit of the lesson's case (T_B = 2 T_F) given to every T_B, copied,
    get their own messages. The derivation: the lesson's Solutions."""
    why = ("a larger limit lets rank 0 start more forwards before its first B; how many forwards fit "
           "before that B can arrive?")
    known = [(lambda p, f, b: 2 * p - 1, "2p - 1 is ZB-H2's warm-up, which fills rank 0's wait only when "
                                         "T_B = T_F."),
             (lambda p, f, b: 2 * p, "2p is zb-2p's limit, ZB-H2's 2p - 1 rounded up."),
             (lambda p, f, b: 3 * p - 2, "3p - 2 holds where T_B = 2 T_F only, as in the lesson's case.")]

    def draw(rng):   # p too large to plan a table of quickly
        f = rng.choice((0.5, 1.0, 2.0))
        return rng.randint(20, 60), f, f * rng.randint(1, 3)

    points = _with_fresh(list(FLOOR_PLANNED), draw, 2)

    def expected(p, f, b):
        return _floor_limit(p, f, b) if (p, f, b) in FLOOR_PLANNED else _floor_by_form(p, f, b)

    return _function_check("4.2", fn, points, expected, "floor_limit(p, f, b)", why, known=known)


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
    """Exercise 4.3: rank 1's order for :data:`HAND_CASE`, a list of its actions in our text form
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
        return Verdict("4.3", False, "no answer yet: replace ... with rank 1's actions, in order.", hint)
    order = _settled(order)
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
        return Verdict("4.3", False, f"expected a list of rank 1's actions such as ['1F0', '1F1', ...], "
                       f"got {order!r}.", hint)
    schedule, refused = _hand_schedule("4.3", [greedy[0], list(order), greedy[2]], c["num_ranks"],
                                       c["num_microbatches"], hint, '"1F0", "1B2" or "1W4"')
    if refused is not None:
        return refused
    run = simulate(schedule, c["costs"])
    peaks = [round(x, 4) for x in run.peak_memory]
    over = [r for r, (peak, limit) in enumerate(zip(run.peak_memory, limits)) if peak > limit + 1e-9]
    if over:
        r = over[0]
        return Verdict("4.3", False, f"valid, but rank {r} holds {peaks[r]:g} M_B at once, over its limit "
                       f"of {limits[r]:g} (peaks {peaks}).", hint)
    best = _hand_best()
    if run.makespan > best + 1e-9:
        same = " (zb-auto's own order)" if [str(a) for a in order] == greedy[1] else ""
        return Verdict("4.3", False, f"valid and within every rank's limit (peaks {peaks} M_B), but it takes "
                       f"{run.makespan:g}{same}; an order of rank 1 takes {best:g}.", hint)
    return Verdict("4.3", True, f"valid, within the limits (peaks {peaks} M_B against {list(limits)}), and "
                   f"{run.makespan:g}, the optimum the MILP proves for this case; zb-auto's plan takes "
                   f"{greedy_span:g}.")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "4.1": split_where_it_pays, "4.2": bubble_floor_limit, "4.3": plan_around
}
"""Lesson 4's exercises by id -> check."""

REVEALS: dict[str, Callable[[], Any]] = {"4.2": lambda: _line_figure(
    list(AUTO_LIMITS), _auto_rates(),
    "zb-auto, p = 4, m = 16, T_F = 1, T_B = 2, T_W = 1: bubble rate against the memory limit",
    "memory limit (M_B)")}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "SPLIT_COSTS", "SPLIT_POINTS", "split_where_it_pays", "AUTO_CASE", "AUTO_LIMITS", "FLOOR_PLANNED",
    "bubble_floor_limit", "HAND_CASE", "plan_around", "EXERCISES", "REVEALS"
]
