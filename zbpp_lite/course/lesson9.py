"""Lesson 9's exercise checks (the pipeline as one SPMD program): one function per exercise, which says right
or not yet with a hint (:class:`zbpp_lite.course.checks.Verdict`). No JAX at import.

Source: lockstep ticks as :func:`zbpp_lite.schedules.simulate.lockstep_ticks` (a compiled SPMD program of
a schedule, as :mod:`zbpp_lite.runtime.spmd` runs it); schedules from Qi et al., arXiv 2401.10241,
sections 2-3 and 6 (ZB-V).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.ir import KIND_CODE
from ..schedules.program import consumer_stage
from ..schedules.simulate import lockstep_ticks, simulate
from ..viz.figures import compare_figure
from .checks import (Verdict, _called, _function_check, _function_missing, _shown, _unanswered, _whole,
                     _with_fresh, course_cache)
from .lesson8 import BUILD_CASE, BUILD_TOLERANCE, gradient_problem

TICK_CASES = (("zb-h1", 4, 8), ("1f1b", 4, 8), ("zb-h2", 3, 6), ("gpipe", 3, 4), ("zb-v", 2, 4))
"""Exercise 9.1's schedules (name, ranks, microbatches): ZB-V's V placement puts stages 1 and 2 on one
rank, so an activation can stay on its rank and still wait a tick."""

TICK_FRESH = 3
"""How many more exercise 9.1 schedules its check draws afresh at each call."""

ROWS_CASES = (("zb-h1", 4, 8), ("zb-h2", 4, 8), ("1f1b", 4, 8), ("gpipe", 3, 4), ("zb-h2", 5, 3))
"""Exercise 9.3's schedules (name, ranks, microbatches), one stage a rank: ZB-H2's activations may wait a
tick, 1F1B's BW keeps no dz, GPipe holds every microbatch, and m below p caps each buffer at m."""

BUFFERS = ("act", "grad", "ins", "outs", "dz")
"""Lesson 9's buffers: what arrived (``act``, ``grad``) and what F and B keep for later (``ins``, ``outs``,
``dz``)."""

FUSED = Costs(f=1.0, b=1.0, w=1.0, bw=2.0)
"""Exercise 9.2's costs: T_F = 1 and 1F1B's fused T_BW = 2, T_comm = 0 (not lesson 9's figure's)."""


def _live(schedule, overlap: bool = False) -> dict:
    """Per (buffer, stage) of lesson 9's tick: one ``(microbatch, tick written, tick last read)`` per value,
    in the schedule's lockstep form. ``act``/``grad`` arrive at the end of their producer's tick (with
    ``overlap``, lesson 10's one-tick link, a tick later from another rank); ``ins`` (read by W), ``outs``
    (read by B) and ``dz`` (read by W) are written by the action's own tick."""
    when = {}
    for t, row in enumerate(lockstep_ticks(schedule, overlap=overlap)):
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
                link = overlap and schedule.placement[s1] != schedule.placement[s2]
                live.setdefault((buffer, s), []).append((j, when[k1, s1, j] + link, when[k2, s2, j]))
    return live


def buffer_depths(schedule, overlap: bool = False) -> dict:
    """``{buffer: [rows stage s needs]}``: the fewest rows K per buffer of each stage for which lesson 9's
    tick may keep microbatch j in row ``j % K``, no row written while the microbatch it holds still waits
    to be read (lesson 9, "How many rows a buffer needs"). ZB-H1's rank r: ``outs`` p - r (its F's before
    its first B), ``dz`` r + 1 (W lags B by r), ``ins`` p; ZB-H2's 2(p - r) - 1, 2r + 1 and 2p - 1 (lesson
    3's memory); each at most m; 0 where the stage keeps no value (stage 0's ``act``) and 1 where it keeps
    none past its own tick (1F1B's ``dz``, which BW makes and reads at once). ``overlap``: for lesson 10's
    program that sends during the next tick (its longer ticks, arrivals from another rank a tick later)."""
    return _depths(schedule, overlap=overlap)


def _depths(schedule, inclusive: bool = False, overlap: bool = False) -> dict:
    """:func:`buffer_depths`; ``inclusive``: a row read in a tick counted busy at that tick's end too (one
    row too many wherever the next value lands as the last read runs)."""
    def clash(K: int, values: list) -> bool:
        return any(j1 != j2 and j1 % K == j2 % K and w1 <= w2 and (w2 <= r1 if inclusive else w2 < r1)
                   for j1, w1, r1 in values for j2, w2, _ in values)

    live, m = _live(schedule, overlap), schedule.num_microbatches
    depths: dict = {}
    for (buffer, s), values in sorted(live.items()):
        column = depths.setdefault(buffer, [0] * schedule.num_stages)
        column[s] = next(K for K in range(1, m + 1) if not clash(K, values))
    return depths


def _reads_keeps(schedule, r: int, a: Any, v: bool) -> str:
    """:func:`tick_messages`' column for action ``a`` on rank ``r``: the rows it reads, then what it keeps."""
    if a is None:
        return "-"
    j = f"{schedule.stages_of(r).index(a.stage)}, {a.microbatch}" if v else f"{a.microbatch}"
    given = f"X[{a.microbatch}]" if a.stage == 0 else f"act[{j}]"
    loss = f"Y[{a.microbatch}]" if a.stage == schedule.num_stages - 1 else f"grad[{j}]"
    return {"F": f"{given} -> ins[{j}], outs[{j}]", "B": f"outs[{j}], {loss} -> dz[{j}]",
            "W": f"ins[{j}], dz[{j}] -> dA, dc", "BW": f"outs[{j}], ins[{j}], {loss} -> dA, dc"}[a.kind]


def tick_messages(schedule, t: int, reads: bool = True) -> str:
    """Lesson 9's worked tick ``t`` as a table, one line per rank: the action it runs (``F3``; on the V
    with its stage, as ``Action.text`` writes it: ``6F3``), the buffer rows it reads and what it keeps (F:
    ``act[j]``, or ``X[j]`` on the first stage, into ``ins[j], outs[j]``; B: ``outs[j]`` and ``grad[j]``, or
    the loss's gradient from ``Y[j]`` on the last stage, into ``dz[j]``; W: ``ins[j], dz[j]`` into ``dA, dc``;
    BW both; on the V each index led by the chunk), what its branch sends to rank r+1 and to r-1
    (an F's output y, a B's or BW's input gradient dx; one stage per rank with its tag j + 1), and where
    the rank stores what arrives at the tick's end (:func:`zbpp_lite.runtime.spmd.tick_tables`' ``recv``:
    ``act[j]`` or ``grad[j]``, on the V ``act[chunk, j]``, from rank r - 1, r + 1 or itself). ``-``:
    nothing. ``reads=False`` leaves out the reads -> keeps column (the lessons' sources write the rest)."""
    from ..runtime.spmd import ACT_BUFFER, tick_tables

    recv, step = tick_tables(schedule).recv, lockstep_ticks(schedule)[t]
    v, S = len(schedule.stages_of(0)) > 1, schedule.num_stages
    wide = 42 if v else 36  # the reads -> keeps column

    def column(text: str) -> str:
        return f"{text:{wide}}" if reads else ""

    lines = [f"{'tick ' + str(t):8}{'runs':{9 if v else 6}}{column('reads -> keeps')}"
             f"{'sends down (to r+1)':22}{'sends up (to r-1)':20}arrivals stored"]
    for r, i in enumerate(step):
        a = schedule.actions[r][i] if i is not None else None
        sent = {}  # rank offset of the receiver (1: r+1, -1: r-1, 0: itself) -> what goes there
        if a and a.kind != "W" and 0 <= (consumer := consumer_stage(a.kind, a.stage)) < S:
            sent[schedule.placement[consumer] - r] = ("y" if a.kind == "F" else "dx") + (
                "" if v else f", tag {a.microbatch + 1}")
        stores = []
        for src, sender in (("left", f"rank {r - 1}'s"), ("right", f"rank {r + 1}'s"), ("self", "its own")):
            buf, chunk, j = (table[r, t] for table in recv[src])
            if buf:
                name, what = ("act", "y") if buf == ACT_BUFFER else ("grad", "dx")
                stores.append(f"{name}[{f'{chunk}, ' if v else ''}{j}] <- {sender} {what}")
        label = (a.text if v else a.label) if a else "."  # the V's: stage, kind, microbatch
        lines.append(f"{'rank ' + str(r):8}{label:{9 if v else 6}}{column(_reads_keeps(schedule, r, a, v))}"
                     f"{sent.get(1, '-'):22}{sent.get(-1, '-'):20}{', '.join(stores) or '-'}")
    return "\n".join(lines)


def tick_grid(schedule) -> str:
    """The schedule's lockstep ticks as text, one line per rank: ``F3`` for rank r's action in the tick (its
    kind and microbatch), ``.`` for an idle tick."""
    ticks = lockstep_ticks(schedule)
    cell = lambda a: f"{a.kind}{a.microbatch}" if a else ". "  # noqa: E731
    return "\n".join(f"rank {r}: " + " ".join(cell(row[r] is not None and schedule.actions[r][row[r]])
                                               for row in ticks) for r in range(schedule.num_ranks))


def buffer_rows(schedule, K: int, buffer: str = "ins", stage: int = 0) -> str:
    """Lesson 9's worked table: buffer ``buffer`` of ``stage`` with K rows, microbatch j in row ``j % K``, one
    line per row and one character per lockstep tick: the microbatch (its last digit) the row holds from the
    tick it is written to the tick it is last read, ``.`` when free, ``!`` where two microbatches would need
    the row at once."""
    grid = [["."] * len(lockstep_ticks(schedule)) for _ in range(K)]
    for j, written, read in _live(schedule)[buffer, stage]:
        for t in range(written, read + 1):
            grid[j % K][t] = str(j % 10) if grid[j % K][t] == "." else "!"
    return "\n".join(f"row {k}: " + "".join(line) for k, line in enumerate(grid))


def _rows(schedule) -> list:
    """The schedule's actions as plain ``(kind, stage, microbatch)`` tuples, one list per rank."""
    return [[(a.kind, a.stage, a.microbatch) for a in row] for row in schedule.actions]


def tick_table(answer: Any) -> Verdict:
    """Exercise 9.1: ``ticks_of(actions)`` -> ``table[tick][rank]``, the index of the action each rank runs
    in that lockstep tick or None; ``actions``: per rank a list of ``(kind, stage, microbatch)``. Checked
    against :func:`lockstep_ticks` on :data:`TICK_CASES` and :data:`TICK_FRESH` cases drawn afresh at each
    call (p = 2..12, m = p..3p), the package out of bounds."""
    hint = ("each action takes the earliest tick after its rank's previous action and after the tick of "
            "what it needs from another stage (F of stage s needs F of stage s-1 of its microbatch, B or BW "
            "of stage s needs B or BW of stage s+1): a result is usable from the next tick on. Sweep the "
            "ranks again and again, placing each rank's next action once what it needs has a tick.")
    missing = _function_missing("9.1", answer, hint, "ticks_of", "a function ticks_of(actions)")
    if missing is not None:
        return missing
    def draw(rng):  # a schedule of TICK_CASES' kinds at p = 2..12, m = p..3p
        p = rng.randint(2, 12)
        return rng.choice([name for name, _, _ in TICK_CASES]), p, rng.randint(p, 3 * p)

    for name, p, m in _with_fresh(TICK_CASES, draw, TICK_FRESH):
        schedule = build_schedule(name, p, m)
        got, refused = _called("9.1", answer, (_rows(schedule),), hint)
        if refused is not None:
            return refused
        want = lockstep_ticks(schedule)
        try:
            got = [[None if i is None else _whole(i) for i in row] for row in got]
        except (TypeError, ValueError, OverflowError):
            return Verdict("9.1", False, f"{name}: expected a list of ticks, each a list of indices or None.",
                           hint)
        for t, (mine, ref) in enumerate(zip(got, want)):
            if mine != ref:
                return Verdict("9.1", False, f"{name} (p = {p}, m = {m}): tick {t} is {mine}, the "
                               f"simulator's lockstep form has {ref}.", hint)
        if len(got) != len(want):
            return Verdict("9.1", False, f"{name} (p = {p}, m = {m}): {len(got)} ticks, the simulator's "
                           f"lockstep form has {len(want)}.", hint)
    checked = len(TICK_CASES) + TICK_FRESH
    return Verdict("9.1", True, f"your ticks equal the simulator's lockstep form on {checked} "
                   "schedules, ZB-V's V placement and cases new at each check included.")


def lockstep_1f1b(fn: Any) -> Verdict:
    """Exercise 9.2 (predicted): ``lockstep_span(p, m)``, 1F1B's lockstep makespan on p >= 2 ranks and m
    microbatches under :data:`FUSED` (a tick lasts its slowest action: 2 where any rank runs a BW), checked
    against the simulator's lockstep form at fixed points (m below, at and above p) and fresh ones, the
    package out of bounds. The tick count, every tick at 2 and the event-driven makespan are named. The
    derivation: the lesson's Solutions."""
    hint = ("a tick lasts as long as its slowest action: 2 wherever any rank runs a BW, 1 elsewhere. Count "
            "the ticks first (how many actions has a rank, and how late does the last rank start?), then "
            "find the tick of the first BW (on which rank?) and ask whether a later tick can be free of "
            "BWs.")
    fixed = [(4, 8), (2, 1), (3, 2), (5, 5), (6, 13), (2, 9)]
    points = _with_fresh(fixed, lambda rng: (rng.randint(2, 8), rng.randint(1, 16)), TICK_FRESH)
    known = [(lambda p, m: 2 * (m + p - 1), "that is the number of ticks: each lasted 1 when every action "
                                            "did."),
             (lambda p, m: 4 * (m + p - 1), "that lets every tick last 2: not all hold a BW."),
             (lambda p, m: 3 * (m + p - 1), "that is the event-driven (MPMD) makespan, 3(m + p - 1), where a "
                                            "rank's F does not wait for another rank's BW.")]
    return _function_check("9.2", fn, points, _lockstep_span, "lockstep_span(p, m)", hint, known=known)


@course_cache(maxsize=64)
def _lockstep_span(p: int, m: int) -> float:
    return simulate(build_schedule("1f1b", p, m), FUSED, lockstep=True).makespan


def reveal_lockstep_1f1b() -> Any:
    """Exercise 9.2's reveal: 1F1B at p = 4, m = 8 under :data:`FUSED`, event-driven above lockstep."""
    schedule = build_schedule("1f1b", 4, 8)
    return compare_figure(simulate(schedule, FUSED), simulate(schedule, FUSED, lockstep=True),
                          titles=("MPMD: event-driven", "SPMD: lockstep ticks"),
                          title="1F1B, p = 4, m = 8, T_F = 1, T_BW = 2")


def rows_needed(answer: Any) -> Verdict:
    """Exercise 9.3: ``depths(actions, ticks)`` -> ``{buffer: [rows rank r needs]}`` for :data:`BUFFERS`, one
    stage a rank; ``actions`` per rank ``(kind, stage, microbatch)`` tuples, ``ticks`` the schedule's
    lockstep table (:func:`lockstep_ticks`, exercise 9.1's). Checked against :func:`buffer_depths` on
    :data:`ROWS_CASES` and :data:`TICK_FRESH` cases drawn afresh at each call (ZB-H1, ZB-H2, 1F1B or GPipe,
    p = 2..8, m = 1..3p), the package out of bounds; where a rank keeps no value past its own tick, 0 and
    1 are both right (a buffer of no rows, or the one row every array has)."""
    hint = ("for each value a buffer keeps, find the tick at whose end it is stored (an arrival: the tick "
            "its sender ran; ins, outs: its F's; dz: its B's) and the tick it is last read (act: F; grad, "
            "outs: B; ins, dz: W; a BW is B and W in one tick). K rows serve when no two microbatches j, j' "
            "with j % K == j' % K are held at once.")
    missing = _function_missing("9.3", answer, hint, "depths", "a function depths(actions, ticks)")
    if missing is not None:
        return missing
    names = sorted({name for name, _, _ in ROWS_CASES})

    def draw(rng):  # a schedule of ROWS_CASES' kinds at p = 2..8, m = 1..3p
        p = rng.randint(2, 8)
        return rng.choice(names), p, rng.randint(1, 3 * p)

    for name, p, m in _with_fresh(ROWS_CASES, draw, TICK_FRESH):
        schedule = build_schedule(name, p, m)
        case = f"{name} (p = {p}, m = {m})"
        got, refused = _called("9.3", answer, (_rows(schedule), lockstep_ticks(schedule)), hint, where=case)
        if refused is not None:
            return refused
        try:
            got = {b: [_whole(k) for k in got[b]] for b in BUFFERS}
        except (TypeError, ValueError, OverflowError, KeyError, IndexError):
            return Verdict("9.3", False, f"{case}: expected a dict of {', '.join(BUFFERS)}, each a list of "
                           f"{p} whole numbers (rows by rank), got {_shown(got, 80, repr)}.", hint)
        want, held = buffer_depths(schedule), _held(schedule)
        for b in BUFFERS:
            if len(got[b]) != p:
                return Verdict("9.3", False, f"{case}: {b} is a list of {len(got[b])}, where {p} ranks need "
                               f"{p} numbers.", hint)
            for r in range(p):
                if got[b][r] == want[b][r] or (not held[b][r] and got[b][r] in (0, 1)):
                    continue
                said = (" A row read in a tick may take the next value at that tick's end: the read comes "
                        "first." if got[b][r] == _depths(schedule, inclusive=True)[b][r] else "")
                return Verdict("9.3", False, f"{case}: rank {r}'s {b} needs {want[b][r]} rows, you gave "
                               f"{got[b][r]}.{said}", hint)
    checked = len(ROWS_CASES) + TICK_FRESH
    return Verdict("9.3", True, f"your rows equal the package's on {checked} schedules, ZB-H2's waiting "
                   "activations, 1F1B's BW and cases new at each check included.")


def _held(schedule) -> dict:
    """``{buffer: [bool by stage]}``: whether the stage keeps any of the buffer's values past the tick that
    stores it (:func:`_live`; a BW makes and reads dz in one tick)."""
    held = {b: [False] * schedule.num_stages for b in BUFFERS}
    for (buffer, s), values in _live(schedule).items():
        held[buffer][s] = any(read > written for _, written, read in values)
    return held


def _step_problem(key: str, result: Any, name: str, call: str, outputs: str, hint: str) -> Verdict | None:
    """The refusal of a whole step's result (:func:`zbpp_lite.course.bench._traced_run`'s forms) that is no
    answer yet, raised, would hang (a collective inside a branch: not run), returned other than
    ``outputs``, or makes more than one ``shard_map`` call; else None."""
    if _unanswered(result):
        return Verdict(key, False, f"no answer yet: write {name}.", hint)
    if not isinstance(result, dict) or "error" not in result:
        return Verdict(key, False, f"expected {call}'s result, got {type(result).__name__}.", hint)
    if result["error"]:
        return Verdict(key, False, f"running it raised {result['error']}", hint)
    if result.get("hang"):
        return Verdict(key, False, f"not run: the program calls {', '.join(result['hang'])} inside a switch "
                       "or cond branch, which the ranks in other branches never reach, so it would wait "
                       "forever.", "keep every collective outside the branches; jax.grad with respect to a "
                       "value every rank holds alike (passed whole, P()) sums its gradient over the ranks "
                       "there: cast it to varying before the scan.")
    if result.get("copied"):
        return Verdict(key, False, f"{name} calls the package's {result['copied']}: build the tick tables "
                       "with your own ticks_of (exercise 9.1).", hint)
    if "shape" in result:
        return Verdict(key, False, f"{name} returned a {result['shape']}, not {outputs}.", hint)
    if result["shard_maps"] != 1:
        return Verdict(key, False, f"the step makes {result['shard_maps']} shard_map calls, not one.", hint)
    return None


def _values_problem(key: str, name: str, result: dict, why: str) -> Verdict | None:
    """The verdict on a whole step (schedule ``name``) whose loss (``result["loss"]``) is not one number
    within :data:`~zbpp_lite.course.lesson8.BUILD_TOLERANCE` of the whole model's (``result["loss_ref"]``;
    m times it and 1/m of it named, ``why`` the hint), or whose gradients are not jax.grad's
    (:func:`~zbpp_lite.course.lesson8.gradient_problem`); None when both are right."""
    loss, ref, m = _number(result["loss"]), float(result["loss_ref"]), BUILD_CASE["microbatches"]
    if loss.shape != ():
        what = f"has shape {loss.shape}" if loss.size else f"is {result['loss']!r:.60}"
        return Verdict(key, False, f"the loss {what}, not one number for the step.",
                       "sum it over the ranks with lax.psum, which makes it the same on every rank, and "
                       "return it with out_specs P().")
    if not abs(loss - ref) <= BUILD_TOLERANCE * abs(ref):   # (a NaN, or None, is off too)
        said = (f" ({m} times it)" if abs(loss - m * ref) <= BUILD_TOLERANCE * m * abs(ref) else
                f" (1/{m} of it)" if abs(m * loss - ref) <= BUILD_TOLERANCE * abs(ref) else "")
        return Verdict(key, False, f"the loss is {float(loss):.6g}, the whole model's {ref:.6g}{said}.", why)
    return gradient_problem(key, name, result, m)


def _number(value: Any) -> np.ndarray:
    """``value`` as a float64 array, or an array of shape (0,) where it is no number or array of numbers."""
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return np.zeros((0,))


def _pipeline_problem(key: str, result: Any, most: int, hint: str, w_more: int = 0) -> Verdict | None:
    """The refusal of a whole step that computes right but is no pipeline, or runs work twice
    (:func:`~zbpp_lite.course.bench.branch_products`, :func:`~zbpp_lite.course.bench.loose_products`): no
    tick's ``lax.switch`` over the kinds; any matrix product outside the switches (the model's work beside
    the schedule's actions, or W's deferred past the loop; sums after it, such as a ``psum``, are no
    products); a tick table among its constants that is not ZB-H1's, or none (``result["order"]`` False or
    None); an idle branch running any; an F branch running more than ``most`` (one stage's, the head's
    included); a B running more than F, a W more than F + ``w_more`` (a gradient F applies without a product,
    such as a scale's or an embedding's, may be one) or any product summing over other than the
    microbatch's samples (``result["w_reruns"]``: F's or B's work again), any further branch (BW, or more)
    more than B and W together; an F, B or W branch running none (the work done elsewhere); else None. A
    ``scan``'s body counts once per iteration."""
    products, loose = result.get("products"), result.get("loose", 0)
    if products is None:
        return Verdict(key, False, "no lax.switch over the tick's kinds (0 idle, 1 F, 2 B, 3 W) found in the "
                       "program: each rank's tick picks its action there.", hint)
    if result.get("order") is False:
        return Verdict(key, False, "the program's tick table (kinds by rank and tick) is not ZB-H1's: it "
                       "runs another order.", "build the table from zb.build_schedule(\"zb-h1\", p, m) "
                       "with your ticks_of (exercise 9.1), in the schedule's order.")
    if loose:
        return Verdict(key, False, f"{loose} matrix products run outside the tick's switch: the model's "
                       "work runs beside the schedule's actions, not as them (each product belongs to an "
                       "action: a forward's to F, a weight gradient's, the head's too, to W).", hint)
    idle, f, b, w, *bw = products
    if idle or f > most:
        branch, n = ("the idle", idle) if idle else ("F's", f)
        return Verdict(key, False, f"{branch} branch runs {n} matrix products, where an F runs one stage's, "
                       f"{most}, and an idle tick none: a rank runs more than its own stage.", hint)
    extra = next(((4 + i, n) for i, n in enumerate(bw) if n > b + w), None)
    if extra:
        return Verdict(key, False, f"branch {extra[0]} of the switch runs {extra[1]} matrix products, more "
                       f"than B and W together ({b + w}): a rank runs more than its own stage.", hint)
    if b > f or w > f + w_more:
        more = f", W {w_more} more, for a gradient F applies without a product" if w_more else ", W as many"
        return Verdict(key, False, f"B runs {b} matrix products and W {w}, where F runs {f} (B may run as "
                       f"many{more}): work runs twice (F again inside jax.grad or jax.vjp, W's products in "
                       "B, or more than the stage).",
                       "keep F's pullback (or what stage_B reads) for B, and for W what each weight "
                       "multiplies, with the gradient where it is applied.")
    if result.get("w_reruns"):
        return Verdict(key, False, f"{result['w_reruns']} of W's {w} matrix products sum over a width, not "
                       "over the microbatch's samples: a weight's gradient sums over the samples (x.T @ dz), "
                       "so W runs F's or B's products again.",
                       "keep what each weight multiplies in F, and its gradient from B, for W.")
    empty = [kind for kind, n in (("F", f), ("B", b), ("W", w)) if n == 0]
    if empty:
        names = empty[0] if len(empty) == 1 else ", ".join(empty[:-1]) + " and " + empty[-1]
        runs = "branches run" if len(empty) > 1 else "branch runs"
        return Verdict(key, False, f"the switch's {names} {runs} no matrix product: the stage's work runs "
                       "elsewhere, not as the schedule's actions.", hint)
    if "order" in result and result["order"] is None:
        return Verdict(key, False, "no tick table (kinds by rank and tick: whole numbers 0 to 4) is among "
                       "the program's constants, so the check cannot tell which order it runs.",
                       "build the tables with NumPy from your ticks_of (exercise 9.1): the program then "
                       "closes over them.")
    return None


def _step_rows_limit() -> int:
    """Exercise 9.4's bound on the (samples, d) rows its step's scan state may hold: ZB-H1's five buffers
    (:func:`buffer_depths` on :data:`~zbpp_lite.course.lesson8.BUILD_CASE`, each buffer the rows of its
    busiest rank; ``ins``, ``outs`` and ``dz`` two layers a row) and two more of the head's, each at most as
    deep as ``dz``. A step with m rows a buffer holds more."""
    c = BUILD_CASE
    k = {b: max(v) for b, v in buffer_depths(build_schedule("zb-h1", c["ranks"], c["microbatches"])).items()}
    return k["act"] + k["grad"] + 2 * (k["ins"] + k["outs"] + k["dz"]) + 2 * k["dz"]


def _rows_problem(result: Any) -> Verdict | None:
    """Exercise 9.4's refusal of a step whose tick loop is no ``lax.scan`` (or ``while``) over the ticks, or
    whose state holds more (samples, d) rows than :func:`_step_rows_limit` (any layout: ``result["rows"]``,
    :func:`~zbpp_lite.course.bench.state_rows`); else None. Results without ``"state"`` are not checked."""
    if "state" not in result:
        return None
    if result["state"] is None:
        return Verdict("9.4", False, "no lax.scan over the ticks runs the tick's switch: the ticks are "
                       "unrolled in Python, one switch each.", "scan the tick over the tick tables, as "
                       "pipeline_step does: one compiled tick, its state carried from tick to tick.")
    rows, limit = result["rows"], _step_rows_limit()
    if rows <= limit:
        return None
    shapes = ", ".join(map(str, result["counted"]))
    return Verdict("9.4", False, f"your tick loop's state holds {rows:g} rows of (samples, d) numbers in all "
                   f"({shapes}); ZB-H1 needs at most {limit} here.",
                   "give each buffer only the rows its busiest rank needs, counted as 'How many rows a "
                   "buffer needs' counts them, the head's buffers too (which rank holds them, from when to "
                   "when?), and keep no value twice; microbatch j in row j % rows, arrivals too.")


def spmd_step(result: Any) -> Verdict:
    """Exercise 9.4: the learner's ``spmd_step(As, cs, H, X, Y) -> (loss, dAs, dcs, dH)`` for ZB-H1 with a
    linear head ``H`` after the last stage (:func:`zbpp_lite.course.bench.head_loss`), run by lesson 9's
    ``lab.try_step``; ``result`` as :meth:`zbpp_lite.course.bench.SpmdLab.try_step` gives it. Right when the
    whole step is one ``shard_map`` program (no model work outside it) that is a pipeline
    (:func:`_pipeline_problem`: a tick's switch, no product outside it, 3 in F), the loss is one
    number equal to the whole model's within :data:`~zbpp_lite.course.lesson8.BUILD_TOLERANCE` (relative), and
    the gradients, the head's too, equal ``jax.grad``'s."""
    hint = ("one jitted shard_map program: the tick tables and A, c cut by rank, H, X and Y whole; the "
            "last rank's F adds its microbatch's loss, its B starts from the head's gradient and keeps "
            "it, and its W adds y.T @ that gradient to dH, as W does dA; the program returns the loss and "
            "dH summed over the ranks (lax.psum: the same on every rank, out_specs P()) beside dA, dc "
            "(P(\"rank\")).")
    refused = _step_problem("9.4", result, "spmd_step", "lab.try_step(spmd_step)", "(loss, dAs, dcs, dH)",
                            hint)
    if refused is not None:
        return refused
    work = [op for op in result["outside"] if op in ("dot_general", "tanh", "integer_pow", "reduce_sum")]
    if work:
        return Verdict("9.4", False, f"the model runs outside the SPMD program too ({', '.join(work)}).",
                       "the loss comes from inside the program: the last rank has each microbatch's output "
                       "when its F runs.")
    shape = _pipeline_problem("9.4", result, 3, hint)    # a stage's two layers and the head
    if shape is not None:
        return shape
    problem = _rows_problem(result)
    if problem is not None:
        return problem
    problem = _values_problem("9.4", "zb-h1", result, "the step's loss is the mean of the m microbatch "
                              "losses, each the mean squared error of one microbatch's y @ H, added once, on "
                              "the last rank.")
    if problem is not None:
        return problem
    if not result["dH_error"] <= BUILD_TOLERANCE:
        off = result["dH_error"]
        return Verdict("9.4", False, f"dH differs from jax.grad's (relative difference {off:.1e}).",
                       "only the last rank's W adds the head's gradient, y.T @ (the gradient at y @ H), "
                       "for each microbatch; every other rank adds nothing before the psum.")
    loss, ref = float(_number(result["loss"])), float(result["loss_ref"])
    return Verdict("9.4", True, f"one SPMD program ran ZB-H1's step with its head: loss {loss:.6f}, "
                   f"the whole model's {ref:.6f}, and jax.grad's gradients (largest relative difference "
                   f"{max(result['grad_error'], result['dH_error']):.1e}).")


def gpipe_step(result: Any) -> Verdict:
    """Exercise 9.5: the learner's ``gpipe_step(As, cs, X, Y) -> (loss, dAs, dcs)``, GPipe's step as one SPMD
    program with its backward written by hand (``result`` as :meth:`zbpp_lite.course.bench.SpmdLab.try_gpipe`
    gives it). Right when it is one ``shard_map`` program with no model work outside it, running two
    ``lax.scan``'s of m + p - 1 ticks (the lesson's forward; then the backward, the last rank first, each dx
    sent to rank r - 1), without jax's own differentiation, and gives the whole model's loss and
    ``jax.grad``'s gradients within :data:`~zbpp_lite.course.lesson8.BUILD_TOLERANCE` (GPipe: Huang et al.,
    arXiv 1811.06965; the backward jax.grad makes of the lesson's ``forward_all``)."""
    p, m = BUILD_CASE["ranks"], BUILD_CASE["microbatches"]
    hint = ("the lesson's forward_ticks (each tick's y, ins and outs, stacked), then a second scan in "
            "which rank r runs one BW a tick (stage_B, then stage_W) and sends dx to rank r - 1, the "
            "last rank first, from the loss's gradient. Which microbatch does rank r run in backward tick t, "
            "and in which forward tick did it keep that microbatch's ins and outs?")
    if isinstance(result, dict) and result.get("copied"):
        return Verdict("9.5", False, f"gpipe_step calls jax's {result['copied']}: this exercise asks for the "
                       "backward by hand, from stage_B and stage_W.", hint)
    refused = _step_problem("9.5", result, "gpipe_step", "lab.try_gpipe(gpipe_step)", "(loss, dAs, dcs)",
                            hint)
    if refused is not None:
        return refused
    work = [op for op in result["outside"] if op in ("dot_general", "tanh", "integer_pow", "reduce_sum")]
    if work:
        return Verdict("9.5", False, f"the model runs outside the SPMD program too ({', '.join(work)}).",
                       hint)
    lengths, ticks = [n for n, _ in result["scans"]], m + p - 1
    if len(lengths) != 2:
        return Verdict("9.5", False, f"the program runs {len(lengths)} scan(s); GPipe's step is two: the "
                       "ticks of every F, then the ticks of every BW.", hint)
    if lengths != [ticks, ticks]:
        return Verdict("9.5", False, f"its scans run {lengths[0]} and {lengths[1]} ticks at p = {p}, "
                       f"m = {m}; each way, the last microbatch needs m + p - 1 ticks to cross every stage.",
                       hint)
    problem = _values_problem("9.5", "gpipe", result, "the step's loss is the mean of the m microbatch "
                              "losses, each the mean squared error of one microbatch's last output.")
    if problem is not None:
        return problem
    loss = float(_number(result["loss"]))
    return Verdict("9.5", True, f"one SPMD program ran GPipe's step by hand: {ticks} ticks of F, then "
                   f"{ticks} of BW with each dx sent up; loss {loss:.6f}, jax.grad's gradients "
                   f"(largest relative difference {result['grad_error']:.1e}). It is the program jax.grad "
                   "made of forward_all; make_tick's table runs B and W where a zero-bubble schedule puts "
                   "them instead.")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {"9.1": tick_table, "9.2": lockstep_1f1b, "9.3": rows_needed,
                                                  "9.4": spmd_step, "9.5": gpipe_step}
"""Lesson 9's exercises by id -> check."""

REVEALS: dict[str, Callable[[Any], Any]] = {"9.2": lambda answer: reveal_lockstep_1f1b()}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = ["KIND_CODE", "TICK_CASES", "ROWS_CASES", "BUFFERS", "FUSED", "tick_table", "lockstep_1f1b",
           "rows_needed", "spmd_step", "gpipe_step", "buffer_depths", "buffer_rows", "tick_grid",
           "tick_messages", "EXERCISES", "REVEALS"]
