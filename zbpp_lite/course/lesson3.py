"""Lesson 3's exercise checks (ZB-H1 and ZB-H2): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

from typing import Any, Callable


from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from ..viz.figures import timeline_figure
from .checks import Verdict, _function_check, _with_fresh, course_cache


FEW_MICROBATCHES = dict(num_ranks=4, num_microbatches=2, costs=Costs(f=1.0, b=2.0, w=1.5))
"""Exercise 3.1's drawn case: ZB-H1 with fewer microbatches than ranks, p = 4, m = 2, T_F = 1, T_B = 2,
T_W = 1.5, T_comm = 0 (outside the form's domain m >= p; T_W > T_F, so rank 0's W delays its next B)."""


def _few_microbatches():
    c = FEW_MICROBATCHES
    return simulate(build_schedule("zb-h1", c["num_ranks"], c["num_microbatches"]), c["costs"])


@course_cache(maxsize=256)
def _zb_h1_makespan(p: int, m: int, f: float, b: float, w: float) -> float:
    return simulate(build_schedule("zb-h1", p, m), Costs(f=f, b=b, w=w)).makespan


def zb_h1_makespan(fn: Any) -> Verdict:
    """Exercise 3.1 (predicted): ``few(p, m, f, b, w)``, ZB-H1's makespan with m < p microbatches, any
    T_F = f, T_B = b, T_W = w, T_comm = 0; checked against the simulator at fixed points (T_W below, at
    and above T_F) and fresh ones, the package out of bounds. The lesson's forms copied (ZB-H1's makespan,
    which needs m >= p, and 1F1B's) and an answer right only while T_W <= T_F (a W that never delays the
    next B) get their own messages. The derivation: the lesson's Solutions."""
    hint = ("print zb.build_schedule(\"zb-h1\", 4, 2) to see rank 0's order once its forwards are done; "
            "when does microbatch 0's B reach rank 0, how long after it does the next B arrive, and what if "
            "rank 0's W is still running then?")
    fixed = [(4, 2, 1.0, 2.0, 0.5), (4, 2, 1.0, 1.0, 3.0), (5, 3, 1.0, 2.0, 1.5), (3, 1, 2.0, 1.0, 1.0),
             (6, 5, 1.0, 1.0, 0.5), (3, 2, 0.5, 1.0, 2.0), (2, 1, 1.0, 1.0, 1.0)]

    def draw(rng):
        p = rng.randint(2, 8)
        return (p, rng.randint(1, p - 1), *(rng.choice((0.25, 0.5, 1.0, 1.5, 2.0, 3.0)) for _ in range(3)))

    known = [(lambda p, m, f, b, w: m * (f + b + w) + (p - 1) * (f + b - w),
              "that is ZB-H1's form, which needs m >= p: with m < p rank 0 has too few W's to fill p - 1 "
              "gaps."),
             (lambda p, m, f, b, w: (m + p - 1) * (f + b + w),
              "that is 1F1B's makespan, each W right after its B; ZB-H1 moves W's into waits."),
             (lambda p, m, f, b, w: (m + p - 1) * (f + b) + w,
              "that holds while T_W <= T_F: rank 0's W then ends before the next B arrives. A longer W "
              "delays that B.")]
    return _function_check("3.1", fn, _with_fresh(fixed, draw, 5), _zb_h1_makespan, "few(p, m, f, b, w)",
                           hint, known=known)


def zb_h2_peak_memory(fn: Any) -> Verdict:
    """Exercise 3.2: ``peak(p, m, r, mem_w)``, ZB-H2's peak activation memory on rank r in M_B for
    m >= 2p - 1, with M_W = ``mem_w`` M_B; checked for p = 2..6, m = 2p - 1, 2p, 3p, every rank, M_W from
    0.25 to 2 (above 1 a B raises the memory, as for lesson 2's MLP, and the peak moves)."""
    cases = {(p, m, mw) for p in (2, 3, 4, 5, 6) for m in (2 * p - 1, 2 * p, 3 * p)
             for mw in (0.25, 0.5, 1.0, 1.25, 2.0)}
    peaks = {c: simulate(build_schedule("zb-h2", c[0], c[1]), Costs(mem_w=c[2])).peak_memory for c in cases}
    points = [(p, m, r, mw) for p, m, mw in sorted(cases) for r in range(p)]
    return _function_check("3.2", fn, points, lambda p, m, r, mw: peaks[p, m, mw][r], "peak(p, m, r, mem_w)",
                           "walk rank r's order and count, after each action, the forwards awaiting their B "
                           "and the W's owed; with M_W above M_B, which raises the memory more, an F or a B?")


def zb_h2_bubble(fn: Any) -> Verdict:
    """Exercise 3.3: a function ``bubble(p, m, f, b, w)``: ZB-H2's makespan minus m(T_F+T_B+T_W),
    T_comm = 0, m >= 2p - 1, for every T_F, T_B and T_W; compared with the simulator at points with
    T_F != T_B, four of them with T_B > T_F and T_W > T_F both, two of those with T_F + T_B - 2T_W above
    zero too. The lesson's form, clipped at zero, copied gets its own message. The derivation: the
    lesson's Solutions."""
    points = [(4, 8, 1.0, 2.0, 0.5), (4, 8, 1.0, 2.0, 1.5), (3, 6, 2.0, 1.0, 3.0), (5, 10, 1.0, 0.5, 0.25),
              (2, 3, 0.5, 1.0, 2.0), (6, 12, 2.0, 1.0, 1.0), (3, 5, 1.5, 1.0, 2.5), (4, 9, 0.5, 1.5, 0.25),
              (5, 9, 1.2, 1.5, 0.8), (4, 8, 1.0, 4.0, 1.5), (3, 6, 1.0, 3.0, 1.25)]   # last two: both waits
    return _function_check(
        "3.3", fn, points,
        lambda p, m, f, b, w: (simulate(build_schedule("zb-h2", p, m), Costs(f=f, b=b, w=w)).makespan
                               - m * (f + b + w)),
        "bubble(p, m, f, b, w)",
        "the form (p-1)(T_F+T_B-2T_W) is what the W's cannot fill; but W's cannot fill a wait for a gradient "
        "either: with T_B > T_F, how much longer does each rank wait per rank of the round trip, and when is "
        "that wait the larger?",
        known=[(lambda p, m, f, b, w: (p - 1) * max(f + b - 2 * w, 0.0),
                "that is the lesson's form, clipped at zero; at some points a wait for a gradient is "
                "longer, and no W fills it")])


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "3.1": zb_h1_makespan, "3.2": zb_h2_peak_memory, "3.3": zb_h2_bubble
}
"""Lesson 3's exercises by id -> check."""

REVEALS: dict[str, Callable[[Any], Any]] = {
    "3.1": lambda answer: timeline_figure(_few_microbatches(),
                                          "ZB-H1, p = 4, m = 2, T_F = 1, T_B = 2, T_W = 1.5")
}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = ["FEW_MICROBATCHES", "zb_h1_makespan", "zb_h2_peak_memory", "zb_h2_bubble", "EXERCISES", "REVEALS"]
