"""Lesson 6's exercise checks (interleaved and looped placements): one function per exercise, which says
right or not yet with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any, Callable

import plotly.graph_objects as go

from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from .checks import Verdict, _function_check, _with_fresh, course_cache


INTERLEAVED_CASE = dict(num_ranks=4, num_microbatches=8, whole_rank=1.0, compared=(2, 3))
"""Exercise 6.1's reveal: interleaved 1F1B, p = 4, m = 8, a whole rank's T_F = T_B = T_W = 1 (each of v
stages per rank costs 1/v of it), T_comm = c; v = 2 against v = 3, for c up to one stage's T_F."""


REPOSITORY_NOTEBOOKS = "https://raw.githubusercontent.com/zbpp-lite/zbpp_lite/main/notebooks/"
"""Where a lesson run outside the repository (Colab) reads the records committed beside the lessons."""


def recorded(path: str) -> dict:
    """A run recorded as JSON beside the lessons (``path`` relative to ``notebooks/``, e.g.
    ``"figures/data/06_gpt_main_job.json"``): read from disk where it exists, else from the repository on
    GitHub. Raises OSError: neither is reachable; ValueError: not strict JSON."""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as source:
            return json.load(source)
    with urllib.request.urlopen(REPOSITORY_NOTEBOOKS + path, timeout=30) as source:
        return json.load(source)


def _interleaved_span(v: int, comm: float) -> float:
    c = INTERLEAVED_CASE
    cost = c["whole_rank"] / v
    plan = build_schedule("interleaved-1f1b", c["num_ranks"], c["num_microbatches"], stages_per_rank=v)
    return simulate(plan, Costs(f=cost, b=cost, w=cost, comm=comm)).makespan


def _tie(p: int, v: int) -> float:
    """The T_comm at which interleaved 1F1B with v + 1 stages per rank is as fast as with v (a stage's
    T_F = T_B = T_W = 1/v, m a multiple of p), in closed form; tests/test_lesson6_claims.py compares it
    with the simulator."""
    return 3 * (p - 1) / (2 * p * v * (v + 1))


def interleaved_crossover(fn: Any) -> Verdict:
    """Exercise 6.1: ``tie(p, v)``, the T_comm at which interleaved 1F1B with v + 1 stages per rank is exactly
    as fast as with v (v >= 2; below it v + 1 is faster), a stage's T_F = T_B = T_W = 1/v (a whole rank's 1)
    and m a multiple of p; predicted, which needs the makespan as a function of v and T_comm (which
    transfers lie on the critical path). Checked at p = 2 to 6, v = 2 to 4 and at points drawn afresh up
    to p = 12, the package out of bounds. Derivations that miscount the links get their own message: each
    link counted once (the way down only), and the links within each pass over the ranks counted without
    the hop from the last rank back to the first. The derivation: the lesson's Solutions."""
    fixed = [(p, v) for p in range(2, 7) for v in (2, 3, 4)]

    def draw(rng):
        return rng.randint(7, 12), rng.randint(2, 5)

    hint = ("write the makespan for v stages per rank: the bubble (p-1)(T_F+T_B+T_W)/v, plus T_comm for "
            "every transfer no action hides. Which links does the first microbatch's forward cross, and the "
            "last one's backward? Set the v and v + 1 makespans equal.")
    known = [(lambda p, v: 2 * _tie(p, v),
              "that counts each link once; the critical path crosses them going down (the first "
              "microbatch's F) and again coming back (the last one's backward)."),
             (lambda p, v: 3 / (2 * v * (v + 1)),
              "that counts p - 1 links per pass over the ranks; between two passes the hop from rank p-1 "
              "back to rank 0 is a link too.")]
    return _function_check("6.1", fn, _with_fresh(fixed, draw, 3), _tie, "tie(p, v)", hint, known=known)


@course_cache(maxsize=128)
def _interleaved_peak(p: int, v: int, m: int) -> tuple:
    """Each rank's peak, in M_B/v, under interleaved 1F1B with v stages per rank (the simulator's count)."""
    return simulate(build_schedule("interleaved-1f1b", p, m, stages_per_rank=v), Costs()).peak_memory


def interleaved_peak(fn: Any) -> Verdict:
    """Exercise 6.2: ``peak(p, v, m, r)``, the most forwards' activations (M_B/v each) rank r holds under
    interleaved 1F1B with v stages per rank, m a multiple of p; checked for p = 2..5, v = 1..6, m = p, 2p
    and 3p, every rank, at six points drawn afresh at each call (p = 6..16, v = 1..6, m = p to 3p), and at
    one with p = 40..80 against a closed form the tests check up to p = 16. At v = 1 the builder keeps
    Megatron's order (the lesson shows it). Patterns fitted from v = 1 get their own message (v times its
    count, and v = 1's count for a pipeline of vp ranks), and so do v times 1F1B's warm-up count and a
    count right from m = 2p on given also to m = p. The derivation: the lesson's Solutions."""
    points = [(p, v, k * p, r) for p in (2, 3, 4, 5) for v in (1, 2, 3, 4, 5, 6) for k in (1, 2, 3)
              for r in range(p)]
    why_once = ("v times v = 1's count repeats the wait for the round trip through the ranks after r on "
                "every pass; microbatch 0 makes that trip once, at the end. What do earlier passes add?")
    why_deep = ("that is v = 1's count for one stage on each of vp ranks; here rank r's first backward is "
                "for its last stage, so microbatch 0 need not come back all the way to stage r.")
    known = [(lambda p, v, m, r: v * (2 * (p - r) - 1), why_once),
             (lambda p, v, m, r: 2 * (v * p - r) - 1, why_deep),
             (lambda p, v, m, r: v * (p - r), "v times 1F1B's p - r: at v = 1 the builder keeps Megatron's "
                                              "order, 2(p - r) - 1 forwards before the first BW, not "
                                              "1F1B's p - r."),
             (lambda p, v, m, r: v * p + p - 1 - 2 * r, "right for m >= 2p; at m = p some ranks hold "
                                                        "fewer: how many forwards does rank r run in all?")]
    def draw(rng):  # a point beyond the fixed ones
        p = rng.randint(6, 16)
        return p, rng.randint(1, 6), p * rng.randint(1, 3), rng.randrange(p)

    def deep(rng):  # one where simulating a table is slow
        p = rng.randint(40, 80)
        return p, rng.randint(2, 6), p * rng.randint(1, 3), rng.randrange(p)

    def expected(p, v, m, r):
        return _interleaved_peak(p, v, m)[r] if p <= 16 else min(v * m, v * p + p - 1 - 2 * r)

    return _function_check("6.2", fn, [*_with_fresh(points, draw, 6), *_with_fresh([], deep, 1)],
                           expected, "peak(p, v, m, r)",
                           "follow microbatch 0 from rank r's first stage to rank r's first backward, which "
                           "is for its last stage: count the stages it passes on the way down and the way "
                           "back; rank r fills each of those slots with one forward, then runs one more "
                           "before that backward frees one (Megatron's order, even at v = 1), if it has "
                           "that many forwards to run.", known=known)


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "6.1": interleaved_crossover, "6.2": interleaved_peak
}
"""Lesson 6's exercises by id -> check."""

def _reveal_6_1():
    fewer, more = INTERLEAVED_CASE["compared"]
    comms = [k / 64 for k in range(0, 1 + int(64 * INTERLEAVED_CASE["whole_rank"] / more))]
    fig = go.Figure(layout=dict(title="interleaved 1F1B, p = 4, m = 8: makespan against T_comm",
                                xaxis_title="T_comm (a whole rank's T_F = 1)", yaxis_title="makespan",
                                height=340))
    for v in (fewer, more):
        fig.add_scatter(x=comms, y=[_interleaved_span(v, c) for c in comms], mode="lines", name=f"v = {v}")
    return fig


REVEALS: dict[str, Callable[[Any], Any]] = {"6.1": lambda answer: _reveal_6_1()}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "INTERLEAVED_CASE", "recorded", "interleaved_crossover", "interleaved_peak",
    "EXERCISES", "REVEALS"
]
