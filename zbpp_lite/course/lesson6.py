"""Lesson 6's exercise checks (interleaved and looped placements): one function per exercise, which says
right or not yet with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any, Callable

from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.simulate import simulate
from .checks import Verdict, _function_check, _with_fresh, course_cache


INTERLEAVED_CASE = dict(num_ranks=4, stages_per_rank=2, comm=0.25)
"""Exercise 6.1's reveal: interleaved 1F1B and looped BFS, p = 4, m = 2p = 8, v = 2 stages per rank, each
stage's T_F = T_B = T_W = 1/v (a whole rank's 1), T_comm = 1/4."""


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


def _placed_spans(p: int, v: int, comm: float) -> dict:
    """{name: timeline} of interleaved 1F1B and looped BFS on p ranks, v stages a rank, m = 2p, each stage's
    T_F = T_B = T_W = 1/v and M_B 1/v, T_comm = ``comm``."""
    stage = Costs(f=1 / v, b=1 / v, w=1 / v, comm=comm, mem_b=1 / v)
    return {name: simulate(build_schedule(name, p, 2 * p, stages_per_rank=v), stage)
            for name in ("interleaved-1f1b", "looped-bfs")}


def _bfs_lead(p: int, v: int, comm: float) -> float:
    """How much sooner looped BFS ends than interleaved 1F1B (:func:`_placed_spans`), by the simulator."""
    runs = _placed_spans(p, v, comm)
    return runs["interleaved-1f1b"].makespan - runs["looped-bfs"].makespan


def bfs_lead(fn: Any) -> Verdict:
    """Exercise 6.1 (predicted): ``bfs_lead(p, v, c)``, how much sooner looped BFS ends than interleaved
    1F1B on p >= 2 ranks, v >= 2 stages a rank (the looped placement), m = 2p, each stage's T_F = T_B = T_W
    = 1/v, T_comm = c at most a stage's T_F. Checked at p = 2..6, v = 2..4 and c of a quarter, a half and
    all of 1/v, and at three points drawn afresh up to p = 12, against the simulator, the package out of
    bounds. The T_comm = 0 answer (none), interleaved 1F1B's transfers alone, looped BFS charged every
    pass's links, and each link counted once get their own messages. The derivation: the lesson's
    Solutions (Narayanan et al., SC 2021, section 2.2, for the interleaved order)."""
    fixed = [(p, v, k / (4 * v)) for p in range(2, 7) for v in (2, 3, 4) for k in (1, 2, 4)]

    def draw(rng):
        v = rng.randint(2, 5)
        return rng.randint(7, 12), v, round(rng.uniform(0.05, 1.0) / v, 4)

    hint = ("in both, which transfers can no action hide? Follow the first microbatch's forward and the last "
            "one's backward, and ask, at each hop between passes, whether the next rank is still busy.")
    known = [(lambda p, v, c: 0.0, "that is T_comm = 0's answer (the cell above): the two differ in which "
                                   "transfers their critical paths cross."),
             (lambda p, v, c: 2 * (v * p - 1) * c, "that is every transfer interleaved 1F1B pays; looped "
                                                   "BFS pays some too."),
             (lambda p, v, c: 2 * (v - 1) * c, "that has looped BFS pay p - 1 links on every pass; does "
                                               "its critical path cross the later passes' links?"),
             (lambda p, v, c: (v - 1) * p * c, "that counts each link once; a critical path crosses them "
                                               "going down (the first microbatch's F's) and again coming "
                                               "back (the last one's backwards).")]
    return _function_check("6.1", fn, _with_fresh(fixed, draw, 3), _bfs_lead, "bfs_lead(p, v, c)", hint,
                           known=known)


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
    "6.1": bfs_lead, "6.2": interleaved_peak
}
"""Lesson 6's exercises by id -> check."""

def _reveal_6_1() -> Any:
    """Exercise 6.1's reveal: :data:`INTERLEAVED_CASE`'s two timelines on one time axis, rank 0's memory
    beneath (looped BFS holds every microbatch's forwards)."""
    from ..viz.figures import schedules_figure

    c = INTERLEAVED_CASE
    runs = _placed_spans(c["num_ranks"], c["stages_per_rank"], c["comm"])
    named = [("interleaved 1F1B", runs["interleaved-1f1b"]), ("looped BFS", runs["looped-bfs"])]
    return schedules_figure(named, title=f"p = {c['num_ranks']}, m = {2 * c['num_ranks']}, v = "
                                         f"{c['stages_per_rank']}, T_comm = {c['comm']:g}")


REVEALS: dict[str, Callable[[Any], Any]] = {"6.1": lambda answer: _reveal_6_1()}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "INTERLEAVED_CASE", "recorded", "bfs_lead", "interleaved_peak",
    "EXERCISES", "REVEALS"
]
