"""Lesson 9's exercise checks (the pipeline as one SPMD program): one function per exercise, which says right
or not yet with a hint (:class:`zbpp_lite.course.checks.Verdict`). No JAX at import.

Source: lockstep ticks as :func:`zbpp_lite.schedules.simulate.lockstep_ticks` (a compiled SPMD program of
a schedule, as :mod:`zbpp_lite.runtime.spmd` runs it); schedules from Qi et al., arXiv 2401.10241,
sections 2-3, and arXiv 2405.15362, section 3 (ZB-V).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.simulate import lockstep_ticks, simulate
from ..viz.figures import compare_figure
from .checks import Verdict, _called, _function_missing, _number_check, _unanswered
from .lesson8 import BUILD_CASE, gradient_problem

KIND_CODE = {"F": 1, "B": 2, "W": 3, "BW": 4}
"""Lesson 9's branch index of each action kind in the tick's ``lax.switch`` (0: idle)."""

TICK_CASES = (("zb-h1", 4, 8), ("1f1b", 4, 8), ("zb-h2", 3, 6), ("gpipe", 3, 4), ("zb-v", 2, 4))
"""Exercise 9.1's schedules (name, ranks, microbatches): ZB-V's V placement puts stages 1 and 2 on one
rank, so an activation can stay on its rank and still wait a tick."""

SPMD_RUNS = ("zb-h1", "1f1b", "zb-h2")
"""Exercise 9.3's schedules, on lesson 8's :data:`~zbpp_lite.course.lesson8.BUILD_CASE`: ZB-H2, which lesson 9
does not show, keeps more microbatches in flight (lesson 3), so its buffers need more rows."""

SLOW_W = Costs(f=1.0, b=1.0, w=2.0)
"""Exercise 9.2's costs: T_F = T_B = 1, T_W = 2, T_comm = 0 (not lesson 9's figure's)."""


def _live(schedule) -> dict:
    """Per (buffer, stage) of lesson 9's tick: one ``(microbatch, tick written, tick last read)`` per value,
    in the schedule's lockstep form. ``act``/``grad`` arrive at the end of their producer's tick; ``ins``
    (read by W), ``outs`` (read by B) and ``dz`` (read by W) are written by the action's own tick."""
    when = {}
    for t, row in enumerate(lockstep_ticks(schedule)):
        for r, i in enumerate(row):
            if i is not None:
                a = schedule.actions[r][i]
                for kind in ("B", "W") if a.kind == "BW" else (a.kind,):
                    when[kind, a.stage, a.microbatch] = t
    S, live = schedule.num_stages, {}
    for s in range(S):
        for j in range(schedule.num_microbatches):
            spans = {"ins": ("F", s, "W", s), "outs": ("F", s, "B", s), "dz": ("B", s, "W", s)}
            if s > 0:
                spans["act"] = ("F", s - 1, "F", s)
            if s < S - 1:
                spans["grad"] = ("B", s + 1, "B", s)
            for buffer, (k1, s1, k2, s2) in spans.items():
                live.setdefault((buffer, s), []).append((j, when[k1, s1, j], when[k2, s2, j]))
    return live


def slots_needed(schedule) -> int:
    """The fewest rows K per buffer for which lesson 9's tick may keep microbatch j in row ``j % K``: no row
    is written while the microbatch it holds still waits to be read (exercise 9.3). ZB-H1 and 1F1B need p,
    ZB-H2 2p - 1: the microbatches in flight, as lesson 3's memory p M_B and (2p - 1) M_B."""
    def clash(K: int, values: list) -> bool:
        return any(j1 != j2 and j1 % K == j2 % K and w1 <= w2 < r1
                   for j1, w1, r1 in values for j2, w2, _ in values)

    live = _live(schedule)
    return next(K for K in range(1, schedule.num_microbatches + 1)
                if not any(clash(K, values) for values in live.values()))


def _rows(schedule) -> list:
    """The schedule's actions as plain ``(kind, stage, microbatch)`` tuples, one list per rank."""
    return [[(a.kind, a.stage, a.microbatch) for a in row] for row in schedule.actions]


def tick_table(answer: Any) -> Verdict:
    """Exercise 9.1: ``ticks_of(actions)`` -> ``table[tick][rank]``, the index of the action each rank runs
    in that lockstep tick or None; ``actions``: per rank a list of ``(kind, stage, microbatch)``. Checked
    against :func:`lockstep_ticks` on :data:`TICK_CASES`, the package out of bounds."""
    hint = ("each action takes the earliest tick after its rank's previous action and after the tick of "
            "what it needs from another stage (F of stage s needs F of stage s-1 of its microbatch, B or BW "
            "of stage s needs B or BW of stage s+1): a result is usable from the next tick on. Sweep the "
            "ranks again and again, placing each rank's next action once what it needs has a tick.")
    missing = _function_missing("9.1", answer, hint, "ticks_of", "a function ticks_of(actions)")
    if missing is not None:
        return missing
    for name, p, m in TICK_CASES:
        schedule = build_schedule(name, p, m)
        got, refused = _called("9.1", answer, (_rows(schedule),), hint)
        if refused is not None:
            return refused
        want = lockstep_ticks(schedule)
        try:
            got = [[None if i is None else int(i) for i in row] for row in got]
        except (TypeError, ValueError):
            return Verdict("9.1", False, f"{name}: expected a list of ticks, each a list of indices or None.",
                           hint)
        for t, (mine, ref) in enumerate(zip(got, want)):
            if mine != ref:
                return Verdict("9.1", False, f"{name} (p = {p}, m = {m}): tick {t} is {mine}, the "
                               f"simulator's lockstep form has {ref}.", hint)
        if len(got) != len(want):
            return Verdict("9.1", False, f"{name} (p = {p}, m = {m}): {len(got)} ticks, the simulator's "
                           f"lockstep form has {len(want)}.", hint)
    return Verdict("9.1", True, f"your ticks equal the simulator's lockstep form on {len(TICK_CASES)} "
                   "schedules, ZB-V's V placement included.")


def lockstep_slow_w(answer: Any) -> Verdict:
    """Exercise 9.2 (predicted): ZB-H1's lockstep makespan at p = 4, m = 8 under :data:`SLOW_W` (a tick lasts
    its slowest action: 2 where any rank runs a W). The unit-tick count, every tick at 2, the event-driven
    makespan and the figure's and the earlier T_W = 0.5 makespans are refused with their hints."""
    schedule = build_schedule("zb-h1", 4, 8)
    ticks = len(lockstep_ticks(schedule))
    event = simulate(schedule, SLOW_W).makespan
    hint = ("a tick lasts as long as its slowest action: 2 wherever any rank runs a W, 1 elsewhere. Count "
            "the ticks (columns) of the grid the lesson printed that hold at least one W.")
    copied = ("{:g} is a makespan at T_W = 0.5 (the figure's, or the same without T_comm), not at "
              "T_W = 2.")
    return _number_check("9.2", answer, simulate(schedule, SLOW_W, lockstep=True).makespan,
                         "ZB-H1's lockstep makespan with T_W = 2", hint, known={
                             ticks: (f"{ticks} is the number of ticks: each lasted 1 when T_W was 1.", hint),
                             2 * ticks: (f"{2 * ticks} lets every tick last 2: only those with a W do.",
                                         hint),
                             event: (f"{event:g} is the event-driven (MPMD) makespan, where a rank moves on "
                                     "as soon as its own W ends.", hint),
                             29: (copied.format(29), hint), 26.5: (copied.format(26.5), hint)})


def reveal_slow_w() -> Any:
    """Exercise 9.2's reveal: ZB-H1 at p = 4, m = 8 under :data:`SLOW_W`, event-driven above lockstep."""
    schedule = build_schedule("zb-h1", 4, 8)
    return compare_figure(simulate(schedule, SLOW_W), simulate(schedule, SLOW_W, lockstep=True),
                          titles=("MPMD: event-driven", "SPMD: lockstep ticks"),
                          title="ZB-H1, p = 4, m = 8, T_W = 2")


def spmd_pipeline(result: Any) -> Verdict:
    """Exercise 9.3: the learner's ``make_tick`` run by lesson 9's ``try_spmd``; ``result`` is
    ``{"error": None or text, "runs": {name: {"grad_error", "stage_errors", "scale" (as
    :func:`zbpp_lite.course.bench.gradient_report` gives them), "ran": (ranks, ticks) ints}}}`` for
    :data:`SPMD_RUNS`, ``ran[r, t]`` the :data:`KIND_CODE` of the branch rank r ran in tick t. Right when
    every rank ran the branch the schedule's lockstep form gives in every tick and the gradients equal
    ``jax.grad``'s within :data:`~zbpp_lite.course.lesson8.BUILD_TOLERANCE`."""
    hint = ("the lesson's tick keeps microbatch j in row j; with K rows, every read and write of a buffer, "
            "the receiver's store included, needs the row microbatch j may use while it is in flight.")
    if _unanswered(result):
        return Verdict("9.3", False, "no answer yet: write make_tick.", hint)
    if not isinstance(result, dict) or "runs" not in result:
        return Verdict("9.3", False, "expected try_spmd(make_tick, slots)'s result, got "
                       f"{type(result).__name__}.", hint)
    refused = _slots_problem(result.get("slots"))
    if refused is not None:
        return refused
    if result.get("error"):
        return Verdict("9.3", False, f"running it raised {result['error']}", "every branch of a lax.switch "
                       "returns the same structure, shapes, dtypes and varying types (spmd.to_varying), "
                       "idle included; a scan's carry keeps its own.")
    worst = 0.0
    for name in SPMD_RUNS:
        run = result["runs"].get(name)
        if run is None:
            return Verdict("9.3", False, f"no run of {name}.", hint)
        schedule = build_schedule(name, 4, 8)
        want = np.zeros((schedule.num_ranks, len(lockstep_ticks(schedule))), int)
        for t, row in enumerate(lockstep_ticks(schedule)):
            for r, i in enumerate(row):
                want[r, t] = 0 if i is None else KIND_CODE[schedule.actions[r][i].kind]
        ran = np.asarray(run["ran"])
        if ran.shape != want.shape or (ran != want).any():
            if ran.shape != want.shape:
                bad = f"ran has shape {ran.shape}, the table {want.shape} (ranks, ticks)"
            else:
                r, t = np.argwhere(ran != want)[0]
                bad = f"rank {r} ran branch {ran[r, t]} in tick {t}, the table says {want[r, t]}"
            return Verdict("9.3", False, f"{name}: {bad}.", "scan over the rank's (kind, microbatch) columns "
                           "in order; each branch returns its own kind code (0 idle, 1 F, 2 B, 3 W, 4 BW).")
        problem = gradient_problem("9.3", name, run, BUILD_CASE["microbatches"])
        if problem is not None:
            return problem
        worst = max(worst, float(run["grad_error"]))
    return Verdict("9.3", True, f"{', '.join(SPMD_RUNS)} ran as one SPMD program, tick for tick as the "
                   "simulator's lockstep form, with jax.grad's gradients (largest relative difference "
                   f"{worst:.1e}), each buffer {result['slots']} rows deep instead of 8.")


def _slots_problem(slots: Any) -> Verdict | None:
    """Exercise 9.3's rows per buffer: a dict with the fewest that work (:func:`slots_needed`) per schedule of
    :data:`SPMD_RUNS`, else the refusal."""
    hint = ("row j % K is safe when no microbatch is written into a row whose earlier microbatch still waits "
            "to be read: how many microbatches does each schedule keep in flight on its busiest rank "
            "(lesson 3's memory)?")
    if _unanswered(slots):
        return Verdict("9.3", False, "no answer yet: give slots, the rows per buffer for each schedule.",
                       hint)
    if not isinstance(slots, dict) or set(slots) != set(SPMD_RUNS):
        return Verdict("9.3", False, f"expected slots as {{name: rows}} for {', '.join(SPMD_RUNS)}, got "
                       f"{slots!r}.", hint)
    for name in SPMD_RUNS:
        need = slots_needed(build_schedule(name, 4, 8))
        if not isinstance(slots[name], int) or slots[name] < need:
            return Verdict("9.3", False, f"{name}: {slots[name]!r} rows are too few: a row would be "
                           "rewritten while the microbatch it holds still waits to be read.", hint)
        if slots[name] > need:
            return Verdict("9.3", False, f"{name}: {slots[name]} rows work but keep more than {name} has in "
                           "flight: fewer do.", hint)
    return None


EXERCISES: dict[str, Callable[[Any], Verdict]] = {"9.1": tick_table, "9.2": lockstep_slow_w,
                                                  "9.3": spmd_pipeline}
"""Lesson 9's exercises by id -> check."""

REVEALS: dict[str, Callable[[], Any]] = {"9.2": reveal_slow_w}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = ["KIND_CODE", "TICK_CASES", "SPMD_RUNS", "SLOW_W", "tick_table", "lockstep_slow_w", "spmd_pipeline",
           "slots_needed", "EXERCISES", "REVEALS"]
