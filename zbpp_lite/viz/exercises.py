"""The course's exercises: one check function per exercise, which says right or wrong and hints.

Each lesson (notebooks 01-08) asks at least three questions, one predicted before the simulation runs
(:func:`reveal` draws it only once answered); formula answers are functions of p, m and the costs, called at
several points; in lesson 8 the learner writes the pipeline. A check never raises for a wrong answer: it
returns a :class:`Verdict` (prints "right" or "not yet" with a hint; truthy only when right, so solutions can
``assert`` it). Answers are compared with what the simulator, validator, placements, attribution or
rebalancer compute, or with flop counts from the shapes; no answer is stored. No JAX at import. A function
answer runs with the package out of bounds: one that calls any zbpp_lite function (the simulator, a builder,
a planner, a closed form) is refused, so that wrapping ``zb.simulate`` does not pass for a derivation.

Sources: arXiv 2401.10241 sections 2-3 (bubbles, memory, heuristic); arXiv 2405.15362 section 3
(V placement); Narayanan et al., SC 2021, section 2.2 (interleaved 1F1B).
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import os
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np
import plotly.graph_objects as go

from ..schedules.builders import build_schedule
from ..schedules.builders.auto import auto_plan
from ..schedules.costs import Costs
from ..schedules.ir import Action, Schedule, v_placement as _v
from ..schedules.simulate import simulate
from ..schedules.validate import ScheduleError, validate
from .figures import timeline_figure


@dataclass(frozen=True)
class Verdict:
    """What a check says about one answer.

    Attributes:
        exercise: the exercise's id, e.g. ``"1.1"`` (lesson 1, exercise 1).
        ok: True when the answer is right.
        message: why it is right, or what is wrong.
        hint: a nudge towards the answer (empty when right).
    """

    exercise: str
    ok: bool
    message: str
    hint: str = ""

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"Exercise {self.exercise}: right. {self.message}"
        hint = f"\n  Hint: {self.hint}" if self.hint else ""
        return f"Exercise {self.exercise}: not yet. {self.message}{hint}"

    __repr__ = __str__


def _unanswered(answer: Any) -> bool:
    return answer is None or answer is Ellipsis


def _as_number(answer: Any) -> float | None:
    """A real number from an int, float, Fraction or a string such as "2/8" (None if not one)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Real):
        value = float(answer)
    elif isinstance(answer, str):
        try:
            value = float(Fraction(answer.strip()))
        except (ValueError, ZeroDivisionError):
            return None
    else:
        return None
    return value if math.isfinite(value) else None


def _number_check(exercise: str, answer: Any, expected: float, what: str, hint: str,
                  tol: float = 1e-6, known: dict[float, tuple[str, str]] | None = None) -> Verdict:
    """``answer`` against ``expected`` within ``tol`` (relative above 1); ``known`` maps a wrong answer the
    lesson's printed pattern gives to its own (message, hint)."""
    if _unanswered(answer):
        return Verdict(exercise, False, "no answer yet: replace ... with yours.", hint)
    value = _as_number(answer)
    if value is None:
        return Verdict(exercise, False, f"expected a number for {what}, got {answer!r}.", hint)

    def near(target: float) -> bool:
        return abs(value - target) <= tol * max(1.0, abs(target))

    if near(expected):
        return Verdict(exercise, True, f"{what} is {expected:g}.")
    for wrong, (message, why) in (known or {}).items():
        if near(wrong):
            return Verdict(exercise, False, message, why)
    return Verdict(exercise, False, f"{value:g} is not {what}.", hint)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The zbpp_lite folder: a function answer may call nothing in it (module docstring)."""


class _UsedPackage(Exception):
    """The learner's function called ``name``, a zbpp_lite function."""


def _alone(fn: Callable, point: tuple) -> Any:
    """``fn(*point)``, raising :class:`_UsedPackage` if it called any zbpp_lite function (a profile hook)."""
    used: list[str] = []

    def watch(frame, event, arg):
        if event == "call" and not used and frame.f_code.co_filename.startswith(_PACKAGE):
            used.append(f"{frame.f_code.co_name} ({os.path.relpath(frame.f_code.co_filename, _PACKAGE)})")

    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        got = fn(*point)
    finally:
        sys.setprofile(previous)
    if used:
        raise _UsedPackage(used[0])
    return got


def _called(exercise: str, fn: Callable, point: tuple, hint: str) -> tuple[Any, Verdict | None]:
    """``(fn(*point), None)``, or ``(None, the verdict)`` when it raised or called the package."""
    try:
        return _alone(fn, point), None
    except _UsedPackage as e:
        return None, Verdict(exercise, False, f"your function called zbpp_lite's {e} at {point}: this "
                             "exercise asks you to derive the answer, so the check refuses one that asks the "
                             "package (the simulator, a builder, a planner or a closed form).", hint)
    except Exception as e:  # noqa: BLE001  (the learner's error is an answer to report, not to raise)
        return None, Verdict(exercise, False, f"your function raised {type(e).__name__} at {point}: {e}",
                             hint)


def _function_check(exercise: str, fn: Any, points: Sequence[tuple], expected: Callable[..., float],
                    what: str, hint: str, tol: float = 1e-6) -> Verdict:
    """Call the learner's function at every point (:func:`_alone`) and compare with ``expected(*point)``."""
    if _unanswered(fn):
        return Verdict(exercise, False, "no answer yet: write the function.", hint)
    if not callable(fn):
        return Verdict(exercise, False, f"expected a function for {what}, got {fn!r}.", hint)
    for point in points:
        want = expected(*point)
        got, refused = _called(exercise, fn, point, hint)
        if refused is not None:
            return refused
        value = _as_number(got) if not isinstance(got, bool) else None
        if isinstance(want, bool):
            if not isinstance(got, (bool,)) and not (hasattr(got, "__bool__")
                                                     and type(got).__name__ == "bool_"):
                return Verdict(exercise, False, f"at {point} expected True or False, got {got!r}.", hint)
            if bool(got) != want:
                return Verdict(exercise, False,
                               f"at {point} your function gives {bool(got)}, the simulator {want}.", hint)
            continue
        if value is None:
            return Verdict(exercise, False, f"at {point} expected a number, got {got!r}.", hint)
        if abs(value - want) > tol * max(1.0, abs(want)):
            return Verdict(exercise, False, f"at {point} your function gives {value:g}, not {want:g}.", hint)
    return Verdict(exercise, True, f"{what} agrees at all {len(points)} points checked.")


# ------------------------------------------------------------------ lesson 1: pipeline bubbles


SLOW_MIDDLE = Costs(f=[1.0, 2.0, 1.0], b=[1.0, 2.0, 1.0], w=[1.0, 2.0, 1.0])
"""Exercise 1.1's costs: p = 3 stages, T_F = 1 and a fused T_BW = 2, but stage 1 twice as slow."""


def makespan_1f1b(answer: Any) -> Verdict:
    """Exercise 1.1: 1F1B's makespan for p = 3, m = 6, T_F = 1, T_BW = 2 (twice on stage 1:
    :data:`SLOW_MIDDLE`), T_comm = 0; predicted."""
    expected = simulate(build_schedule("1f1b", 3, 6), SLOW_MIDDLE).makespan
    return _number_check(
        "1.1", answer, expected, "1F1B's makespan with a slow stage 1",
        "the slow rank 1 computes m(2+4) = 36 and sets the pace; add what it waits for: rank 0's first F "
        "before it starts, rank 0's last BW after it ends, and, once, microbatch 0's gradient coming "
        "back from rank 2.",
    )


def lean_schedule(actions: Any) -> Verdict:
    """Exercise 1.3: a valid schedule for p = 3, m = 4 (stage r on rank r) in which no rank holds more than
    2 microbatches' activations (1F1B's rank 0 holds 3): three lists of actions in PyTorch's text form
    (``"0F1"``, ``"1B0"`` fused, ``"1I0"``/``"1W0"`` split) or :class:`~zbpp_lite.schedules.ir.Action`.
    Checked with :func:`zbpp_lite.validate` and :func:`zbpp_lite.simulate` (unit costs, peak <= 2 M_B)."""
    hint = ("each rank may start at most 2 forwards before its first backward; stage 0's backward needs "
            "stage 1's, which needs stage 2's, so count what each rank can run while it waits.")
    if _unanswered(actions):
        return Verdict("1.3", False, "no answer yet: replace ... with three lists of actions.", hint)
    try:
        rows = [[a if isinstance(a, Action) else Action.from_str(str(a)) for a in row] for row in actions]
    except (TypeError, ValueError) as e:
        return Verdict("1.3", False, f"could not read the actions: {e}",
                       "write each action as text, e.g. \"0F0\" or \"1B1\".")
    if len(rows) != 3:
        return Verdict("1.3", False, f"three ranks need three lists, you gave {len(rows)}.", hint)
    schedule = Schedule(tuple(map(tuple, rows)), (0, 1, 2), 4, "mine")
    try:
        validate(schedule)
    except ScheduleError as e:
        return Verdict("1.3", False, "zb.validate refuses it.", str(e).splitlines()[0])
    peaks = simulate(schedule, Costs()).peak_memory
    over = [r for r, peak in enumerate(peaks) if peak > 2]
    if over:
        held = f"{peaks[over[0]]:g}"
        return Verdict("1.3", False, f"valid, but rank {over[0]} holds {held} microbatches at once.", hint)
    return Verdict("1.3", True, f"zb.validate accepts it and the ranks hold at most {max(peaks):g} "
                                f"microbatches (per rank {[int(x) for x in peaks]}).")


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


# ------------------------------------------------------------------ lesson 2: the backward split

MLP_TOKENS, MLP_WIDTHS = 16, (32, 64, 32)
"""The two-layer MLP of notebook 02: 16 tokens, x (16, 32) @ W1 (32, 64), then (16, 64) @ W2 (64, 32)."""
FIRST_STAGE_WIDTHS = (32, 64, 16, 8)
"""Exercise 2.3's first stage: three layers ``z_l = a_l @ W_l`` of these widths (2.1's convention)."""


def _matmul(rows: int, inner: int, cols: int) -> int:
    return 2 * rows * inner * cols  # one multiply and one add per term


WIDTH_LISTS = ((32, 64, 32), (8, 16, 4, 2), (3, 5, 7, 11, 13), (1, 1), (64, 256, 64, 256, 64, 16))
"""The widths lists exercises 2.1 and 2.2 try: one to five layers of uneven widths."""


def _layer_products(n: int, widths: Sequence[int]) -> list[int]:
    """Flops of each layer's weight-gradient product x_l.T @ dz_l, (d_l, n) @ (n, d_{l+1})."""
    return [_matmul(a, n, b) for a, b in itertools.pairwise(widths)]


def _widths_check(exercise: str, fn: Any, expected: Callable[[int, Sequence[int]], int], what: str,
                  hint: str) -> Verdict:
    points = [(n, list(w)) for n, w in itertools.product((16, 5), WIDTH_LISTS)]
    return _function_check(exercise, fn, points, lambda n, w: expected(n, tuple(w)), what, hint)


def w_held_floats(fn: Any) -> Verdict:
    """Exercise 2.1: ``m_w(n, widths)``, the floats a microbatch holds from B to W (its M_W) for
    ``len(widths) - 1`` layers ``z_l = a_l @ W_l`` on n tokens (``widths[l]``: layer l's input width,
    ``widths[-1]``: the output width), B having kept every output gradient: the sizes of the arrays W
    reads, each once. Checked on :data:`WIDTH_LISTS`."""

    def read_by_w(n, w):  # a_l (n, w[l]) and dz_l (n, w[l+1]) for every layer l
        return sum(n * a + n * b for a, b in itertools.pairwise(w))

    return _widths_check("2.1", fn, read_by_w, "m_w(n, widths)",
                         "W of layer l is a_l.T @ dz_l: what shape is each operand, and which of them are "
                         "the same array for two layers?")


def w_flops_without_kept_gradients(fn: Any) -> Verdict:
    """Exercise 2.2: ``w_flops_recompute(n, widths)``, W's matmul flops on 2.1's stack when B keeps the
    output gradients of the even layers (0, 2, ...) only, so W rebuilds each odd layer's from the one
    after it (activation derivative not counted); (r, k) @ (k, c) counts 2 r k c."""

    def recompute(n, w):
        layers = len(w) - 1
        back = [_matmul(n, w[k + 2], w[k + 1]) for k in range(1, layers - 1, 2)]  # dz_{l+1} @ W_{l+1}.T
        return sum(_layer_products(n, w)) + sum(back)

    return _widths_check("2.2", fn, recompute, "w_flops_recompute(n, widths)",
                         "an odd layer's output gradient costs one product dz_{l+1} @ W_{l+1}.T, "
                         "(n, widths[l+2]) @ (widths[l+2], widths[l+1]), from the kept one after it; "
                         "but the last layer's arrives from the next stage, whatever its parity.")


def first_stage_b_ratio(answer: Any) -> Verdict:
    """Exercise 2.3: on the *first* stage (no dx needed), B's matmul flops over F's for the stack
    :data:`FIRST_STAGE_WIDTHS` on :data:`MLP_TOKENS` tokens; predicted."""
    n, w = MLP_TOKENS, FIRST_STAGE_WIDTHS
    f = sum(_matmul(n, a, b) for a, b in itertools.pairwise(w))
    b = sum(_matmul(n, b, a) for a, b in itertools.pairwise(w[1:]))  # dz_{l+1} @ W_{l+1}.T; no dx
    return _number_check("2.3", answer, b / f, "B's matmul flops over F's on the first stage",
                         "B must still make every layer's output gradient for W, each one product "
                         "dz_{l+1} @ W_{l+1}.T; only dx = dz_0 @ W_0.T has no reader on the first stage. "
                         "Which of F's products has no counterpart in B?")


# ------------------------------------------------------------------ lesson 3: ZB-H1 and ZB-H2


FEW_MICROBATCHES = dict(num_ranks=4, num_microbatches=2, costs=Costs(f=1.0, b=2.0, w=0.5))
"""Exercise 3.1's case: ZB-H1 with fewer microbatches than ranks, p = 4, m = 2, T_F = 1, T_B = 2,
T_W = 0.5, T_comm = 0 (outside the form's domain m >= p)."""


def _few_microbatches():
    c = FEW_MICROBATCHES
    return simulate(build_schedule("zb-h1", c["num_ranks"], c["num_microbatches"]), c["costs"])


def zb_h1_makespan(answer: Any) -> Verdict:
    """Exercise 3.1: ZB-H1's makespan on :data:`FEW_MICROBATCHES` (m < p); predicted."""
    return _number_check("3.1", answer, _few_microbatches().makespan, "ZB-H1's makespan with m < p",
                         "the form (p-1)(T_F+T_B-T_W) counts p - 1 W's filling gaps on the busiest rank; "
                         "with m < p, how many W's does rank 0 have, and which of them can still hide in a "
                         "wait for a gradient?")


def zb_h2_peak_memory(fn: Any) -> Verdict:
    """Exercise 3.2: ``peak(p, m, r, mem_w)``, ZB-H2's peak activation memory on rank r in M_B (any m >= 1,
    M_W = ``mem_w``); checked for p = 2..6, m = 1..2p+1 (five values), every rank, M_W in 0.25 .. 1."""
    cases = {(p, m, mw) for p in (2, 3, 4, 5, 6) for m in (1, 2, p, 2 * p - 2, 2 * p + 1)
             for mw in (0.25, 0.5, 1.0)}
    peaks = {c: simulate(build_schedule("zb-h2", c[0], c[1]), Costs(mem_w=c[2])).peak_memory for c in cases}
    points = [(p, m, r, mw) for p, m, mw in sorted(cases) for r in range(p)]
    return _function_check("3.2", fn, points, lambda p, m, r, mw: peaks[p, m, mw][r], "peak(p, m, r, mem_w)",
                           "right after rank r's warm-up its forwards hold M_B each; how many W's does the "
                           "rank owe at that moment later on, when W lags B by 2r microbatches, and what if "
                           "m is too small for either?")


# ------------------------------------------------------------------ lesson 4: zb-auto

AUTO_CASE = dict(num_ranks=4, num_microbatches=12, costs=Costs(f=1.0, b=1.0, w=0.5, comm=0.05))
"""Notebook 04's explorer case: p = 4, m = 12, T_F = T_B = 1, T_W = 0.5, T_comm = 0.05."""


@functools.lru_cache(maxsize=16)
def _auto(limit: float):
    """zb-auto's plan of :data:`AUTO_CASE` under ``limit`` M_B (cached)."""

    c = AUTO_CASE
    return auto_plan(c["num_ranks"], c["num_microbatches"], c["costs"], limit)


def bw_break_even(fn: Any) -> Verdict:
    """Exercise 4.1: ``largest_m(p, f, b, w, bw)``, the most microbatches (m >= p) for which ZB-H1 (split)
    is strictly faster than 1F1B (fused T_BW = bw < T_B + T_W), T_W <= T_F, T_comm = 0; checked
    against both simulations at six points (the paper's costs, and a tie)."""
    points = [(4, 1.0, 1.0, 1.0, 1.55), (2, 1.0, 1.2, 0.6, 1.45), (8, 18.522, 18.086, 9.337, 24.0),
              (5, 2.0, 1.5, 1.0, 2.2), (3, 1.0, 0.5, 0.8, 1.0), (4, 1.0, 1.0, 1.0, 1.5)]  # a tie at m = 9

    def largest(p, f, b, w, bw):
        c, m = Costs(f=f, b=b, w=w, bw=bw), p
        spans = lambda n: simulate(build_schedule(n, p, m), c).makespan  # noqa: E731
        while m <= 400 and spans("zb-h1") < spans("1f1b") - 1e-9:
            m += 1
        return m - 1

    return _function_check("4.1", fn, points, largest, "largest_m(p, f, b, w, bw)",
                           "the split saves bubble once per step but pays T_B + T_W - T_BW on every "
                           "microbatch: write both makespans as functions of m and find where they cross.")


AUTO_LIMITS = tuple(range(4, 11))
"""The memory limits (M_B) exercises 4.2 and 4.3 plan :data:`AUTO_CASE` under."""


def _auto_rates() -> list[float]:
    return [_auto(float(lim)).bubble_rate for lim in AUTO_LIMITS]


def bubble_floor_limit(answer: Any) -> Verdict:
    """Exercise 4.2: the smallest whole memory limit (M_B, from 4) at which zb-auto's bubble rate on
    :data:`AUTO_CASE` reaches its floor over :data:`AUTO_LIMITS`; predicted."""
    rates = _auto_rates()
    expected = AUTO_LIMITS[next(i for i, r in enumerate(rates) if r <= min(rates) + 1e-12)]
    return _number_check("4.2", answer, expected, "the limit where the bubble first reaches its floor",
                         "a larger limit lets rank 0 start more forwards before its first B; how many can it "
                         "start before that B could possibly arrive, the round trip being ZB-H2's warm-up?")


def auto_warmup(fn: Any) -> Verdict:
    """Exercise 4.3: ``warmup(p, limit, r)``, the F rank r runs before its first B when zb-auto plans
    :data:`AUTO_CASE` under ``limit`` M_B; checked at limits 4 to 9, every rank."""
    plans = {lim: _auto(float(lim)).schedule for lim in AUTO_LIMITS[:-1]}

    def counted(p, limit, r):
        return next(i for i, a in enumerate(plans[limit].actions[r]) if a.kind != "F")

    points = [(AUTO_CASE["num_ranks"], lim, r) for lim in plans for r in range(AUTO_CASE["num_ranks"])]
    return _function_check("4.3", fn, points, counted, "warmup(p, limit, r)",
                           "each warm-up F holds one M_B, so the limit caps the count; but a rank stops "
                           "starting forwards once its first B could have arrived: lesson 3's ZB-H2 warm-up.")


# ------------------------------------------------------------------ lesson 5: V-shaped schedules


@functools.lru_cache(maxsize=8)
def _zb_v_sweep(p: int) -> dict[int, Any]:
    """ZB-V's timelines for m = 1 .. 2p + 1 at unit per-stage costs, T_comm = 0 (cached)."""
    return {m: simulate(build_schedule("zb-v", p, m), Costs()) for m in range(1, 2 * p + 2)}


ZB_V_RATE = 0.05
"""Exercise 5.2's target: the bubble rate ZB-V must fall below (p = 6, unit costs)."""


def zb_v_first_zero(answer: Any) -> Verdict:
    """Exercise 5.2: the smallest m with ZB-V's bubble rate below :data:`ZB_V_RATE` on p = 6 (unit costs,
    T_comm = 0); predicted. The lesson prints only p = 4's sweep."""
    expected = min(m for m, t in _zb_v_sweep(6).items() if t.bubble_rate < ZB_V_RATE)
    return _number_check("5.2", answer, expected,
                         f"the smallest m with a bubble rate below {ZB_V_RATE:g} at p = 6",
                         "write rank 0's idle time as a function of m between p and the first bubble-free m "
                         "(p = 4's sweep shows how it falls per microbatch), then the rate idle / makespan "
                         "with makespan = 6m + idle; solve for m.")


def zb_v_makespan(fn: Any) -> Verdict:
    """Exercise 5.3: ``makespan(p, m, t)``, ZB-V's makespan for every m >= 1 (the lesson shows m >= p only)
    with T_F = T_B = T_W = t, T_comm = 0; checked for p = 2, 3, 5, m = 1 .. 2p + 1, t in (1, 0.5)."""
    points = [(p, m, t) for p in (2, 3, 5) for m in range(1, 2 * p + 2) for t in (1.0, 0.5)]
    # every cost scales with t (T_comm = 0), so the makespan is t times the t = 1 one
    return _function_check("5.3", fn, points, lambda p, m, t: t * _zb_v_sweep(p)[m].makespan,
                           "makespan(p, m, t)",
                           "6t of work per microbatch on a rank; with few microbatches rank 0 waits for "
                           "microbatch 0's round trip, with very few (m = 1: F down and up 2p stages, B "
                           "back, then W) for the last microbatch's: which wait is longer at each m?")


# ------------------------------------------------------------------ lesson 6: interleaved, looped


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
    :data:`INTERLEAVED_CASE`, where more stages per rank shrink the bubble but add transfers; predicted."""
    spans = _interleaved_makespans()
    best = min(spans, key=spans.get)
    return _number_check("6.2", answer, best, "the v with the shortest makespan",
                         "the bubble (p-1)(T_F+T_B+T_W)/v falls with v; T_comm is paid on every link the "
                         "first microbatch's forward and the last one's backward cross (vp - 1 each): add "
                         "the two and minimise over v.")


def interleaved_peak(fn: Any) -> Verdict:
    """Exercise 6.3: ``peak(p, v, r)``, rank r's peak activations under interleaved 1F1B (m >= 2p) in one
    stage's M_B; checked for p = 2..5, v = 1..4, every rank, m = 2p and 3p."""
    def held(p, v, m):
        return simulate(build_schedule("interleaved-1f1b", p, m, stages_per_rank=v), Costs()).peak_memory

    peaks = {(p, v, m): held(p, v, m) for p in (2, 3, 4, 5) for v in (1, 2, 3, 4) for m in (2 * p, 3 * p)}
    points = [(p, v, r) for (p, v, m) in peaks for r in range(p) if m == 2 * p]

    return _function_check("6.3", fn, points,
                           lambda p, v, r: max(peaks[p, v, 2 * p][r], peaks[p, v, 3 * p][r]), "peak(p, v, r)",
                           "count rank r's warm-up forwards: enough to cover the other ranks' first pass "
                           "down (2 per rank below it) and a whole extra round of p on each further stage it "
                           "holds; then one more.")


# ------------------------------------------------------------------ lesson 7: bubble detection


SLOW_STAGE_0 = Costs(f=[2, 1, 1, 1], b=[2, 1, 1, 1], w=[2, 1, 1, 1])
"""Exercise 7.1's costs: ZB-H1 on p = 4, m = 8 with stage 0 twice as slow as the others."""


def idlest_rank(answer: Any) -> Verdict:
    """Exercise 7.1: the rank idling longest inside its span in ZB-H1, p = 4, m = 8, :data:`SLOW_STAGE_0`
    (the lesson's planted case slows the last stage instead); predicted."""
    t = simulate(build_schedule("zb-h1", 4, 8), SLOW_STAGE_0)
    expected = max(range(4), key=lambda r: t.bubble_time[r])
    return _number_check("7.1", answer, expected, "the rank with the most idle time",
                         "the slow rank sets the pace and never waits; the others all do the same work, "
                         "T_F+T_B+T_W = 3 per microbatch, so the one with the longest span idles most: "
                         "when does each start and end?")


LAYER_COSTS = (2.0, 1.0, 3.0, 1.0, 4.0, 4.0, 4.0, 4.0)
"""Exercise 7.2's per-layer costs (T_F + T_B + T_W of each of 8 layers), cut into 3 contiguous stages."""

SPLIT_CASES = ((LAYER_COSTS, 3), (LAYER_COSTS, 2), ((1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0), 3),
               ((3.0, 1.0, 1.0, 1.0), 2), ((1.0, 1.0, 1.0, 5.0), 2), ((2.0, 1.0, 1.0, 2.0), 3),
               ((1.0, 2.0, 3.0, 4.0, 5.0, 6.0), 3), ((5.0, 1.0, 1.0, 1.0, 1.0, 1.0), 3),
               ((3.0, 3.0, 2.0, 2.0, 2.0, 3.0, 3.0), 3), ((1.0, 2.0, 1.0), 1), ((4.0, 1.0, 2.0, 7.0), 4))
"""Exercise 7.3's (per-layer costs, stages) cases: unequal costs, ties, one stage, one layer per stage."""


def _slowest(costs: Sequence[float], counts: Sequence[int]) -> float:
    """The largest stage total when ``costs`` is cut, front to back, into stages of ``counts`` layers."""
    ends = list(itertools.accumulate(counts))
    return max(sum(costs[a:b]) for a, b in zip([0, *ends], ends))


def _fewest_slowest(costs: Sequence[float], stages: int) -> float:
    """The smallest slowest stage over every contiguous cut (exhaustive: the lists are short)."""
    n = len(costs)
    return min(_slowest(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))])
               for cuts in itertools.combinations(range(1, n), stages - 1))


def _split_problem(costs: Sequence[float], stages: int, counts: Any) -> str:
    """Why ``counts`` is not an optimal cut of ``costs`` into ``stages`` contiguous stages, or ""."""
    try:
        whole = [int(k) for k in counts if _as_number(k) is not None and _as_number(k).is_integer()]
    except TypeError:
        whole = []
    if len(whole) != stages or len(whole) != len(counts) or min(whole) < 1 or sum(whole) != len(costs):
        return (f"on {list(costs)}, {stages} stage(s): expected {stages} whole layer counts >= 1 adding up "
                f"to {len(costs)}, got {counts!r}.")
    slower, best = _slowest(costs, whole), _fewest_slowest(costs, stages)
    if slower > best + 1e-9:
        return (f"on {list(costs)}, {stages} stage(s): your cut {whole} leaves a stage of {slower:g}; "
                f"{best:g} is possible.")
    return ""


def balanced_partition(answer: Any) -> Verdict:
    """Exercise 7.2: the layers per stage, front to back, cutting :data:`LAYER_COSTS` into 3 contiguous stages
    so that the slowest is as fast as possible (any optimal cut is right)."""
    hint = ("no cut beats the larger of the costliest layer and a third of the total; start from that "
            "bound, see which stage breaks it, and raise it to the next stage total reachable.")
    if _unanswered(answer):
        return Verdict("7.2", False, "no answer yet: write the three layer counts.", hint)
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Sequence):
        return Verdict("7.2", False, f"expected three layer counts such as (3, 3, 2), got {answer!r}.", hint)
    why = _split_problem(LAYER_COSTS, 3, answer)
    if why:
        return Verdict("7.2", False, why, hint)
    slowest = _slowest(LAYER_COSTS, answer)
    return Verdict("7.2", True, f"{tuple(answer)}: the slowest stage costs {slowest:g}, "
                                "the least any contiguous cut into 3 allows.")


def best_split(fn: Any) -> Verdict:
    """Exercise 7.3: ``best_split(costs, stages)``, the layers per stage, front to back, of a contiguous cut
    into ``stages`` stages that minimises the slowest (any optimum is right); checked on
    :data:`SPLIT_CASES`."""
    hint = ("one cut is a choice of stages - 1 places among len(costs) - 1 (itertools.combinations); "
            "or, faster: the best cut's slowest stage is the smallest limit for which filling each stage "
            "greedily up to the limit needs at most `stages` stages (then split further).")
    if _unanswered(fn):
        return Verdict("7.3", False, "no answer yet: write the function.", hint)
    if not callable(fn):
        return Verdict("7.3", False, f"expected a function, got {fn!r}.", hint)
    for costs, stages in SPLIT_CASES:
        counts, refused = _called("7.3", fn, (list(costs), stages), hint)  # the package's rebalancer: refused
        if refused is not None:
            return refused
        why = _split_problem(costs, stages, counts if isinstance(counts, Sequence) else [counts])
        if why:
            return Verdict("7.3", False, why, hint)
    return Verdict("7.3", True, f"best_split is optimal on all {len(SPLIT_CASES)} cases checked "
                                "(ties, one stage, one layer per stage included).")


def _line_figure(x: list, y: list, title: str, x_title: str, y_title: str = "bubble rate"):
    """A bubble rate (or ``y_title``) against one swept quantity (a reveal's plotly figure)."""

    return go.Figure(go.Scatter(x=x, y=y, mode="lines+markers"),
                     layout=dict(title=title, xaxis_title=x_title, yaxis_title=y_title, height=340))


def _reveal_figure(key: str):

    if key == "1.1":
        return timeline_figure(simulate(build_schedule("1f1b", 3, 6), SLOW_MIDDLE),
                               "1F1B, p = 3, m = 6, stage 1 twice as slow")
    if key == "3.1":
        return timeline_figure(_few_microbatches(), "ZB-H1, p = 4, m = 2, T_F = 1, T_B = 2, T_W = 0.5")
    if key == "4.2":
        return _line_figure(list(AUTO_LIMITS), _auto_rates(),
                            "zb-auto, AUTO_CASE: bubble rate against the memory limit", "memory limit (M_B)")
    if key == "5.2":
        sweep = _zb_v_sweep(6)
        return _line_figure(list(sweep), [t.bubble_rate for t in sweep.values()],
                            "ZB-V, p = 6: bubble rate against m", "microbatches m")
    if key == "6.2":
        spans = _interleaved_makespans()
        return _line_figure(list(spans), list(spans.values()),
                            "interleaved 1F1B, INTERLEAVED_CASE: makespan against v", "stages per rank v",
                            "makespan")
    if key == "7.1":
        return timeline_figure(simulate(build_schedule("zb-h1", 4, 8), SLOW_STAGE_0),
                               "ZB-H1, stage 0 twice as slow")
    raise KeyError(f"no reveal for exercise {key}; give show=")


def reveal(key: str, answer: Any, show: Callable[[], Any] | None = None) -> Any:
    """A predict-first exercise's simulation (a figure, or what ``show()`` returns) once ``answer`` holds a
    prediction; before that, a line asking for one (and None)."""
    if _unanswered(answer):
        print(f"Exercise {key}: commit to your prediction above first; then this cell shows the simulation.")
        return None
    return show() if show is not None else _reveal_figure(key)


"""Every exercise by id ("lesson.number") -> its check."""


# ------------------------------------------------------------------ lesson 8: build the pipeline

BUILD_CASE = dict(ranks=4, microbatches=8, layers=8, width=256, microbatch_size=64, itemsize=4)
"""Notebook 08's model: an MLP of 8 layers ``tanh(x @ W + b)`` of width 256, cut into 4 stages of 2
layers (stage s on rank s), a global batch of 8 microbatches of 64 rows, float32."""

BUILD_TOLERANCE = 1e-4
"""Largest relative difference (to the reference's largest magnitude) accepted between the
learner's arrays and JAX's: float32 sums in another order differ by about 1e-6 on any CPU."""


def _rel_diff(mine: Any, ref: Any) -> float:
    """max |mine - ref| / max |ref| for two arrays of one shape (inf for other shapes)."""

    try:
        a, b = np.asarray(mine, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    except (TypeError, ValueError):
        return math.inf
    if a.shape != b.shape:
        return math.inf
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / max(scale, 1e-30) if a.size else 0.0


def _weight_hint(mine: Sequence, ref: Sequence) -> str:
    """Why W's gradients differ from the reference's, from the common mistakes."""
    if len(mine) != len(ref):
        return (f"W returned {len(mine)} arrays where the stage has {len(ref)} parameters: one (dW, db) "
                "pair per layer, in layer order.")
    for i, (a, b) in enumerate(zip(mine, ref)):
        if _rel_diff(a, b) <= BUILD_TOLERANCE:
            continue
        if getattr(b, "ndim", 0) == 2 and _rel_diff(a, b.T) <= BUILD_TOLERANCE:
            return f"parameter {i} is the transpose of dW: dW = x.T @ dz, (width, rows) @ (rows, width)."
        if any(_rel_diff(a, c) <= BUILD_TOLERANCE for c in ref if c is not b):
            return (f"parameter {i} equals another layer's gradient: "
                    "pair each layer's input with its own output gradient.")
        return (f"parameter {i} is off: dW = x.T @ dz with x the layer's input (kept by F) and dz its "
                "output gradient (kept by B); db = dz summed over the rows.")
    return ""


def _run_problem(key: str, result: Any, field: str, call: str, fill: str, who: str,
                 hint: str) -> Verdict | None:
    """The verdict on a lesson-8 result not ready to check (no answer, wrong type, or an error raised by
    ``who``), or None when ``result[field]`` is there."""
    if _unanswered(result):
        return Verdict(key, False, f"no answer yet: fill in {fill}.", hint)
    if not isinstance(result, dict) or field not in result:
        return Verdict(key, False, f"expected {call}'s result, got {type(result).__name__}.", hint)
    if result.get("error"):
        return Verdict(key, False, f"{who} raised {result['error']}", hint)
    return None


def stage_split(result: Any) -> Verdict:
    """Exercise 8.1: a stage's F, B and W written by the learner.

    ``result`` is notebook 08's ``try_stage(F, B, W)``: ``{"error": None or text, "cases": [...]}``, per
    tried stage a dict of NumPy arrays ``y``/``ref_y``, ``dx``/``ref_dx`` (None for stage 0),
    ``grads``/``ref_grads`` (flat, layer order; refs from ``jax.vjp``), ``recomputed`` (B or W reran F) and
    ``b_flops``/``ref_b_flops`` (XLA's flops of B and of the input-gradient pullback; None: not counted).
    """
    hint = ("F: jax.vjp of the stage with respect to its input and the zero probes, keep the pullback and "
            "the layer inputs; B: call the pullback on dy; W: x.T @ dz and dz.sum(0) per layer.")
    problem = _run_problem("8.1", result, "cases", "try_stage(F, B, W)", "F, B and W", "your functions", hint)
    if problem is not None:
        return problem
    if not result["cases"]:
        return Verdict("8.1", False, "no stage was tried.", hint)
    worst = 0.0
    for case in result["cases"]:
        s = case["stage"]
        if case.get("recomputed"):
            return Verdict("8.1", False, f"on stage {s}, B or W ran the stage's layers again.",
                           "F keeps the pullback jax.vjp returned; "
                           "B only calls it, W only multiplies what F and B kept.")
        extra = (case.get("b_flops") or 0.0) / (case.get("ref_b_flops") or float("inf"))
        if extra > 1.5:
            return Verdict("8.1", False, f"on stage {s}, B did {extra:.1f}x the flops of the input gradient "
                           "alone: it computes the weight gradients too.",
                           "take jax.vjp with respect to x and the probes only; dW and db are W's work.")
        if _rel_diff(case["y"], case["ref_y"]) > BUILD_TOLERANCE:
            return Verdict("8.1", False, f"F's output on stage {s} is not the stage's output.", hint)
        if case["ref_dx"] is not None and _rel_diff(case["dx"], case["ref_dx"]) > BUILD_TOLERANCE:
            return Verdict("8.1", False, f"B's input gradient on stage {s} differs from jax.vjp's.",
                           "B returns the pullback's gradient for the stage input, first of its two outputs.")
        mine, ref = list(case["grads"] or ()), list(case["ref_grads"])
        why = _weight_hint(mine, ref)
        if why:
            return Verdict("8.1", False, f"W's gradients on stage {s} differ from jax.vjp's.", why)
        worst = max([worst, _rel_diff(case["y"], case["ref_y"])]
                    + [_rel_diff(a, b) for a, b in zip(mine, ref)])
    stages = ", ".join(str(c["stage"]) for c in result["cases"])
    return Verdict("8.1", True,
                   f"on stages {stages}, F, B and W give the stage's output and jax.vjp's gradients "
                   f"(largest relative difference {worst:.1e}).")


WIDE_STAGE = dict(widths=(256, 512, 128), rows=64, itemsize=2)
"""Exercise 8.2's stage: 2 layers ``tanh(x @ W + b)``, 256 -> 512 -> 128 wide, 64 rows, bfloat16."""


def weight_bytes(answer: Any) -> Verdict:
    """Exercise 8.2: of M_W (what B keeps for W: each layer's input x and output gradient dz), the bytes of
    :data:`WIDE_STAGE` for one microbatch that B newly creates: the dz's (the x's are F's arrays, handed
    on); predicted. The whole M_W is refused with its own hint."""
    c = WIDE_STAGE
    rows, widths, size = c["rows"], c["widths"], c["itemsize"]
    hint = ("W of a layer a -> b wide needs its input x, (rows, a), and its output gradient dz, (rows, b); "
            "bfloat16 is 2 bytes a number. Which of these existed before B ran?")
    whole = sum(rows * (a + b) * size for a, b in zip(widths, widths[1:]))
    return _number_check("8.2", answer, rows * sum(widths[1:]) * size,
                         "the bytes of M_W that B creates (the output gradients dz)", hint,
                         known={whole: (f"{whole} bytes is all of M_W, not what B adds.",
                                        "each layer's input x was kept by F (stage_apply returned it); B "
                                        "hands those very arrays on. Count only what B computes.")})


PIPELINE_RUNS = (("1f1b", 4), ("zb-h1", 4), ("zb-v", 2))
"""Exercise 8.3's runs (schedule, ranks) on :data:`BUILD_CASE`'s 4 stages: ZB-V's V placement (0, 1, 1, 0)
catches a loop that sends to rank +- 1 instead of the rank ``placement`` names."""


def pipeline_run(result: Any) -> Verdict:
    """Exercise 8.3: the learner's rank loop, run by notebook 08's ``try_pipeline(rank_loop)`` on
    :data:`PIPELINE_RUNS`; ``result`` is ``{"error": None or text, "runs": {name: {"timeline": Timeline,
    "grad_error": float}}}``. Right when every rank ran its actions in order, one event each, each after
    its inputs ended, and the gradients equal ``jax.grad``'s within :data:`BUILD_TOLERANCE`."""
    hint = ("walk `actions` in order; F takes its input from the inbox (stage 0: the data), B its "
            "output gradient (last stage: 1/m); block_until_ready, record the Event, then device_put "
            "the result into the inbox of the rank `placement` names for the next (or previous) stage.")
    problem = _run_problem("8.3", result, "runs", "try_pipeline(rank_loop)", "rank_loop", "running it", hint)
    if problem is not None:
        return problem
    c = BUILD_CASE
    worst = 0.0
    for name, ranks in PIPELINE_RUNS:
        if name not in result["runs"]:
            return Verdict("8.3", False, f"no run of {name}.", hint)
        run = result["runs"][name]
        why = _order_problem(build_schedule(name, ranks, c["microbatches"]), run["timeline"])
        if why:
            return Verdict("8.3", False, f"{name}: {why}", hint)
        error = float(run["grad_error"])
        if not error <= BUILD_TOLERANCE:
            return Verdict("8.3", False,
                           f"{name}: the gradients differ from jax.grad's (relative difference {error:.1e}).",
                           "each W must use the layer inputs and output gradients of its own "
                           "(stage, microbatch), and each stage add up its W's over all m microbatches.")
        worst = max(worst, error)
    return Verdict("8.3", True,
                   "1F1B, ZB-H1 and ZB-V ran in their schedules' order on every rank, each action after its "
                   f"inputs; the gradients equal jax.grad's (largest relative difference {worst:.1e}).")


def _order_problem(schedule: Schedule, timeline: Any) -> str:
    """What is wrong with a measured run of ``schedule`` (order, one event each, inputs first), or ""."""
    events = getattr(timeline, "events", None)
    if not events:
        return "the run recorded no events: append one zb.Event per action."
    ended: dict = {}
    for e in events:
        ended[(e.action.kind if e.action.kind != "BW" else "B", e.action.stage, e.action.microbatch)] = e.end
    for rank, planned in enumerate(schedule.actions):
        ran = [e.action for e in sorted((e for e in events if e.rank == rank), key=lambda e: e.start)]
        for k, (a, b) in enumerate(zip(ran, planned)):
            if a != b:
                return f"rank {rank}'s action {k} was {a}, the schedule says {b}."
        if len(ran) != len(planned):
            return f"rank {rank} ran {len(ran)} actions, the schedule has {len(planned)}."
    S = schedule.num_stages
    for e in events:
        s, j = e.action.stage, e.action.microbatch
        need = [("F", s - 1, j)] if e.action.kind == "F" and s > 0 else []
        if e.action.kind in ("B", "BW") and s < S - 1:
            need = [("B", s + 1, j)]
        for key in need:
            if key not in ended or e.start < ended[key]:
                return (f"{e.action} on rank {e.rank} started before {key[0]} of stage {key[1]}, "
                        f"microbatch {j} had ended.")
    return ""


def zb_h1_peak(answer: Any) -> Verdict:
    """Exercise 8.4: ``peak(p, m, r, mem_b, mem_w)``, rank r's peak activation memory under ZB-H1 for every
    m >= 1 (fewer microbatches than ranks too), F keeping M_B = ``mem_b`` until B and B keeping M_W =
    ``mem_w`` until W; checked against the simulator at p = 2 to 5, m = 1 to 2p + 1, three memory pairs."""
    hint = ("list what rank r holds right after an F of the steady state: microbatches past F but not B "
            "hold M_B each, those past B but not W hold M_W each; ZB-H1 runs rank r's W of microbatch j "
            "after its B of microbatch j + r. With few microbatches, how many of each exist at all?")
    cases = [(p, m, mem_b, mem_w) for p in (2, 3, 5) for m in range(1, 2 * p + 2)
             for mem_b, mem_w in ((1.0, 0.5), (5.0, 1.0), (2.0, 1.5))]
    planned = {case: simulate(build_schedule("zb-h1", case[0], case[1]),
                              Costs(mem_b=case[2], mem_w=case[3])).peak_memory for case in cases}
    points = [(p, m, r, mem_b, mem_w) for (p, m, mem_b, mem_w) in cases for r in range(p)]
    return _function_check("8.4", answer, points, lambda p, m, r, b, w: planned[p, m, b, w][r],
                           "peak(p, m, r, mem_b, mem_w)", hint, tol=1e-9)


# ------------------------------------------------------------------ reworked exercises 1.2 and 3.3

BATCH_SPLIT = dict(num_ranks=4, f_work=48.0, backward_work=96.0, splits=(8, 16))
"""Exercise 1.2's case: 1F1B on 4 ranks; one step's batch cut into m microbatches; every action costs a
fixed price c plus its share of the batch's work, so T_F = c + 48/m and the fused backward, one action,
T_BW = c + 96/m; T_comm = 0. The question: the c at which the two ``splits`` tie."""


def _batch_split_span(m: int, price: float) -> float:
    c = BATCH_SPLIT
    f, bw = price + c["f_work"] / m, price + c["backward_work"] / m
    return simulate(build_schedule("1f1b", c["num_ranks"], m), Costs(f=f, b=bw / 2, w=bw / 2, bw=bw)).makespan


def batch_split(answer: Any) -> Verdict:
    """Exercise 1.2 (an inverse question): the fixed price c per action at which 1F1B on
    :data:`BATCH_SPLIT` takes as long with m = 8 as with m = 16; the makespans are linear in c, so
    the reference solves the two simulations at c = 0 and c = 1 for their crossing. Pricing the fused
    backward twice (as a B and a W) gives 9/8, refused with its own hint."""
    small, large = BATCH_SPLIT["splits"]
    slope = {m: _batch_split_span(m, 1.0) - _batch_split_span(m, 0.0) for m in (small, large)}
    tie = (_batch_split_span(small, 0.0) - _batch_split_span(large, 0.0)) / (slope[large] - slope[small])
    verdict = _number_check("1.2", answer, tie, f"the price at which m = {small} and m = {large} tie",
                            "write the makespan (m+p-1)(T_F+T_BW) with T_F and T_BW as functions of c "
                            "and m (how many actions, so how many prices c, does a microbatch's backward "
                            "take in 1F1B?), once for each m, and set the two equal.",
                            known={9 / 8: ("9/8 prices the backward twice.",
                                           "1F1B runs each backward fused: one action, so one price c, "
                                           "not two.")})
    if verdict.ok:
        verdict = Verdict("1.2", True, f"{verdict.message} Both take {_batch_split_span(small, tie):g}; "
                                       f"a smaller price favours m = {large}, a larger one m = {small}.")
    return verdict


def zb_h2_bubble(fn: Any) -> Verdict:
    """Exercise 3.3: a function ``bubble(p, m, f, b, w)``: ZB-H2's makespan minus m(T_F+T_B+T_W),
    T_comm = 0, m >= 2p, for every T_F, T_B and T_W (the lesson's form holds only while it is
    positive and T_B <= T_F); compared with the simulator at points with T_F != T_B."""
    points = [(4, 8, 1.0, 2.0, 0.5), (4, 8, 1.0, 2.0, 1.5), (3, 6, 2.0, 1.0, 3.0), (5, 10, 1.0, 0.5, 0.25),
              (2, 4, 0.5, 1.0, 2.0), (6, 12, 2.0, 1.0, 1.0), (3, 7, 1.5, 1.0, 2.5), (4, 9, 0.5, 1.5, 0.25),
              (5, 11, 1.2, 1.5, 0.8)]
    return _function_check(
        "3.3", fn, points,
        lambda p, m, f, b, w: (simulate(build_schedule("zb-h2", p, m), Costs(f=f, b=b, w=w)).makespan
                               - m * (f + b + w)),
        "bubble(p, m, f, b, w)",
        "the form (p-1)(T_F+T_B-2T_W) is what the W's cannot fill; but W's cannot fill a wait for a gradient "
        "either: with T_B > T_F, how much longer does each rank wait per rank of the round trip?")


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
    if _unanswered(fn):
        return Verdict("6.1", False, "no answer yet: write the function.", hint)
    if not callable(fn):
        return Verdict("6.1", False, f"expected a function, got {fn!r}.", hint)
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


def v_sends(fn: Any) -> Verdict:
    """Exercise 5.1: a function ``sends(p, r)``: how many values rank r sends to another rank for one
    microbatch's F's and B's under ZB-V's V placement (2p stages on p ranks): an F's activation goes
    to stage s + 1, a B's input gradient to stage s - 1, and only a change of rank is a send.
    Counted from the placement for p = 1..8, every rank."""

    def count(p, r):
        place = _v(p)
        down = sum(place[s] == r != place[s + 1] for s in range(2 * p - 1))
        up = sum(place[s] == r != place[s - 1] for s in range(1, 2 * p))
        return down + up

    points = [(p, r) for p in range(1, 9) for r in range(p)]
    return _function_check("5.1", fn, points, count, "sends(p, r)",
                           "list rank r's two stages, r and 2p-1-r; for each, does its F's output and its "
                           "B's input gradient leave the rank? Look at the ends of the V and at its turn.")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "1.1": makespan_1f1b,
    "1.2": batch_split,
    "1.3": lean_schedule,
    "1.4": peak_memory_1f1b,
    "2.1": w_held_floats,
    "2.2": w_flops_without_kept_gradients,
    "2.3": first_stage_b_ratio,
    "3.1": zb_h1_makespan,
    "3.2": zb_h2_peak_memory,
    "3.3": zb_h2_bubble,
    "4.1": bw_break_even,
    "4.2": bubble_floor_limit,
    "4.3": auto_warmup,
    "5.1": v_sends,
    "5.2": zb_v_first_zero,
    "5.3": zb_v_makespan,
    "6.1": zigzag_stages,
    "6.2": interleaved_best_v,
    "6.3": interleaved_peak,
    "7.1": idlest_rank,
    "7.2": balanced_partition,
    "7.3": best_split,
    "8.1": stage_split,
    "8.2": weight_bytes,
    "8.3": pipeline_run,
    "8.4": zb_h1_peak,
}
"""Every exercise's key ("3.2") to its check; the tests and the notebook hygiene test read it."""
