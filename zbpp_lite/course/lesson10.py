"""Lesson 10's exercise checks (ZB-V as one SPMD program: several stages per rank): one function per
exercise, which says right or not yet with a hint (:class:`zbpp_lite.course.checks.Verdict`). No JAX at
import.

Source: ZB-V, arXiv 2401.10241, section 6, on the V placement, arXiv 2405.15362, section 3; lockstep ticks as
:func:`zbpp_lite.schedules.simulate.lockstep_ticks`, routed as :func:`zbpp_lite.runtime.spmd.tick_tables`.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.simulate import lockstep_ticks, simulate
from ..viz.figures import timeline_figure
from .checks import (Verdict, _called, _function_check, _function_missing, _unanswered, _whole, _with_fresh,
                     course_cache)
from .lesson8 import BUILD_CASE, BUILD_TOLERANCE, gradient_problem
from .lesson9 import _number, _pipeline_problem, _rows, _step_problem

OVERLAP_CASE = ("zb-h2", 4, 8)
"""Exercise 10.1's schedule and the case its reveal draws (name, ranks, microbatches): ZB-H2 with each
tick sending what the tick before it made (``lockstep_ticks(..., overlap=True)``)."""

ROUTE_CASES = (("zb-v", 4, 8), ("zb-v", 3, 5), ("zb-h1", 4, 8), ("interleaved-1f1b", 3, 6))
"""Exercise 10.2's schedules (name, ranks, microbatches): the V (rank p - 1 sends to itself where the V
turns), one stage per rank, and interleaved 1F1B's looped placement (stage p - 1 on rank p - 1 sends to
stage p on rank 0, its right neighbour on the ring). p >= 3: at p = 2 a rank's left and right neighbour
are one rank."""

OWN_CASE = dict(ranks=4, microbatches=8, tokens=16, vocab=32, width=64, hidden=128, classes=10)
"""Exercise 10.4's model (:func:`zbpp_lite.course.bench.own_model`): an embedding of 32 tokens to width 64,
one block a rank, its input added to its output (hidden width 128), a head to 10 classes; 8 microbatches of 16
tokens."""

V_RUNS = ("zb-v",)
"""Exercise 10.3's schedule: ZB-V, two stages per rank (chunk 0: stage r, chunk 1: stage 2p - 1 - r)."""

V_CASE = {**BUILD_CASE, "layers": 16}
"""Exercise 10.3's model: :data:`~zbpp_lite.course.lesson8.BUILD_CASE` with 16 layers, so ZB-V's 2p = 8
stages have two layers each, as lesson 9's ``stage_F`` takes (lesson 10's program)."""


def overlapped_ticks(fn: Any) -> Verdict:
    """Exercise 10.1 (predicted): ``overlapped_ticks(p, m)``, how many lockstep ticks ZB-H2 takes when each
    tick sends what the tick before it made, so a value reaches another rank two ticks after it is made
    (``lockstep_ticks(schedule, overlap=True)``), on p >= 2 ranks and m >= 2p - 1 microbatches, each
    action one tick; checked exactly at fixed and fresh points (p up to 12), the package out of bounds.
    The count without the link, one with the way back paid too (lesson 3's round trip) and one paying two
    ticks a link both ways are named. The derivation: the lesson's Solutions."""
    hint = ("when does the last rank run its first action, and does it ever wait after that? Its B needs "
            "only its own F; its F's come from rank p - 2, and ZB-H2's warm-up runs 2(p - r) - 1 forwards "
            "ahead on rank r.")
    fixed = [(4, 8), (2, 3), (3, 5), (5, 12), (6, 11)]

    def draw(rng):   # beyond the fixed points too: p up to 12, m from 2p - 1 to 6p
        p = rng.randint(2, 12)
        return p, rng.randint(2 * p - 1, 6 * p)

    known = [(lambda p, m: 3 * m + p - 1, "that is ZB-H2's count with no link: the first forward now takes "
                                          "two ticks to cross each link."),
             (lambda p, m: 3 * m + 3 * (p - 1), "that pays the link on the way back too, as lesson 3's round "
                                                "trip does: does the last rank ever wait for a gradient, and "
                                                "do the ranks above it end after it?"),
             (lambda p, m: 3 * m + 4 * (p - 1), "that pays two ticks a link both ways: the way down costs "
                                                "one tick more a link, not two, and the way back is hidden.")]
    return _function_check("10.1", fn, _with_fresh(fixed, draw, 3), _overlapped_ticks,
                           "overlapped_ticks(p, m)", hint, tol=0.0, known=known)   # a count: whole, exactly


@course_cache(maxsize=64)
def _overlapped_ticks(p: int, m: int) -> int:
    return len(lockstep_ticks(build_schedule(OVERLAP_CASE[0], p, m), overlap=True))


def reveal_overlapped_ticks() -> Any:
    """Exercise 10.1's reveal: ZB-H2's lockstep timeline at p = 4, m = 8 with each tick sending what the tick
    before it made, each action one tick."""
    name, p, m = OVERLAP_CASE
    plan = simulate(build_schedule(name, p, m), Costs(), lockstep=True, overlap=True)
    return timeline_figure(plan, f"ZB-H2 in lockstep, each tick sending what the last one made, p = {p}, "
                                 f"m = {m}: {plan.global_span:g} ticks")


def _routes(schedule) -> dict:
    """Exercise 10.2's answer for ``schedule``: :func:`zbpp_lite.runtime.spmd.tick_tables`' ``recv``, as
    ``{source: (buffer, chunk, microbatch)}`` of nested lists (ranks, ticks)."""
    from ..runtime.spmd import tick_tables  # JAX's module: imported when a check runs, not at import

    return {src: tuple(np.asarray(a).tolist() for a in t) for src, t in tick_tables(schedule).recv.items()}


def routing(answer: Any) -> Verdict:
    """Exercise 10.2 (derived): ``routing(actions, placement, ticks) -> {source: (buffer, chunk,
    microbatch)}``, each a (ranks, ticks) table of ints: what rank r receives at the end of tick t from
    ``"left"`` (rank r - 1, rank p - 1 for rank 0), ``"right"`` (rank r + 1, rank 0 for rank p - 1) and
    ``"self"``: buffer 1 (``act``, an F's output) or 2 (``grad``, a B's or BW's input gradient), 0 for
    nothing, the receiving stage's chunk (its index among the rank's stages in increasing order) and the
    microbatch. ``actions`` per rank ``(kind, stage, microbatch)`` tuples, ``placement[stage]`` its rank,
    ``ticks`` :func:`lockstep_ticks`' table. Checked against :func:`zbpp_lite.runtime.spmd.tick_tables` on
    :data:`ROUTE_CASES`: the V (a turn on rank p - 1), one stage per rank, and the looped placement's hop
    from rank p - 1 back to rank 0; the package out of bounds. The first wrong entry is named, with what
    differs."""
    hint = ("a value sent in tick t arrives at the end of tick t: an F of stage s sends its output to "
            "stage s + 1's act, a B or BW of stage s its input gradient to stage s - 1's grad (none past "
            "either end, none from a W). Which rank holds the receiving stage, which neighbour is the "
            "sender to it, and which of its stages (chunk) receives?")
    missing = _function_missing("10.2", answer, hint, "routing",
                                "a function routing(actions, placement, ticks)")
    if missing is not None:
        return missing
    fields = ("buffer", "chunk", "microbatch")
    for name, p, m in ROUTE_CASES:
        schedule = build_schedule(name, p, m)
        ticks = lockstep_ticks(schedule)
        got, refused = _called("10.2", answer, (_rows(schedule), list(schedule.placement), ticks), hint)
        if refused is not None:
            return refused
        want = _routes(schedule)   # (after the answer ran: nothing of it to read while it runs)
        case = f"{name} (p = {p}, m = {m})"
        try:   # each table (p, ticks) of whole numbers, as nested lists
            got = {src: tuple([[_whole(x) for x in row] for row in
                               np.asarray(got[src][k], dtype=object).reshape(p, len(ticks)).tolist()]
                              for k in range(3)) for src in want}
        except (TypeError, ValueError, KeyError, IndexError, OverflowError):
            return Verdict("10.2", False, f"{case}: expected {{source: (buffer, chunk, microbatch)}} for "
                           f"sources {', '.join(want)}, each a ({p}, {len(ticks)}) table of ints.", hint)
        for t in range(len(ticks)):
            for r in range(p):
                for src in want:
                    mine, need = (tuple(got[src][k][r][t] for k in range(3)),
                                  tuple(want[src][k][r][t] for k in range(3)))
                    if mine == need:
                        continue
                    off = [f for f, x, y in zip(fields, mine, need) if x != y]
                    why = {"buffer": "which kind of action sent it, and is anything sent at all?",
                           "chunk": "the chunk is the receiving stage's index on its own rank, not the "
                                    "sender's.",
                           "microbatch": "the value keeps its microbatch."}[off[0]]
                    if mine[0] == 0 and need[0]:
                        why = ("something arrives here from this source: which rank sends to rank "
                               f"{r}'s stages, and is it a neighbour on the ring (rank 0's left "
                               "neighbour is rank p - 1) or rank r itself?")
                    return Verdict("10.2", False, f"{case}: rank {r}, end of tick {t}, from {src}: you give "
                                   f"(buffer, chunk, microbatch) {mine}, the program needs {need}; "
                                   f"{' and '.join(off)} differ{'s' if len(off) == 1 else ''}. {why}", hint)
    return Verdict("10.2", True, f"your routing equals the package's on {len(ROUTE_CASES)} schedules: the "
                   "V's turn, one stage per rank and the looped placement's hop back to rank 0.")


def _v_runs(result: Any, hint: str) -> Verdict | float:
    """Exercise 10.3's reading of ``vlab.try_v(make_v_tick)``'s result: the refusal of one that is no answer
    yet (``make_v_tick`` still ``...``), not that call's dict with its runs, or raised; or of the first run
    of :data:`V_RUNS` missing, that ran another branch than the schedule's lockstep form in some tick, is
    no pipeline or runs work twice (:func:`_pipeline_problem`, a stage two layers: the kind a tick reports
    is not taken on trust), or has gradients off (:func:`gradient_problem`, with ``hint`` where it names
    no particular mistake); else the largest relative gradient difference."""
    from ..runtime.spmd import tick_tables

    if _unanswered(result):
        return Verdict("10.3", False, "no answer yet: write make_v_tick.", hint)
    if not isinstance(result, dict) or not isinstance(result.get("runs"), dict):
        return Verdict("10.3", False, "expected vlab.try_v(make_v_tick)'s result, got "
                       f"{type(result).__name__}.", hint)
    if result.get("error"):
        return Verdict("10.3", False, f"running it raised {result['error']}", hint)
    worst = 0.0
    for name in V_RUNS:
        run = result["runs"].get(name)
        if run is None:
            return Verdict("10.3", False, f"no run of {name}.", hint)
        schedule = build_schedule(name, BUILD_CASE["ranks"], BUILD_CASE["microbatches"])
        want = tick_tables(schedule, overlap=True).kind   # vlab's program sends during the next tick
        ran = np.asarray(run["ran"])
        if ran.shape != want.shape or (ran != want).any():
            if ran.shape != want.shape:
                bad = f"ran has shape {ran.shape}, the table {want.shape} (ranks, ticks)"
            else:
                r, t = np.argwhere(ran != want)[0]
                bad = f"rank {r} ran branch {ran[r, t]} in tick {t}, the table says {want[r, t]}"
            return Verdict("10.3", False, f"{name}: {bad}.", "scan over the rank's row of each tick table, "
                           "in order; each branch returns its own kind code (0 idle, 1 F, 2 B, 3 W, 4 BW).")
        problem = _pipeline_problem("10.3", run, 2, hint) if "products" in run else None   # 2 layers a stage
        if problem is None:   # (a refusal is a false Verdict)
            problem = gradient_problem("10.3", name, run, BUILD_CASE["microbatches"], hint)
        if problem is not None:
            return problem
        worst = max(worst, float(run["grad_error"]))
    return worst


def spmd_v(result: Any) -> Verdict:
    """Exercise 10.3: the learner's ZB-V ``make_tick``, sending during the next tick, run by lesson 10's
    ``vlab.try_v``; ``result`` is ``{"rows": {buffer: rows}, "error": None or text, "runs": {"zb-v":
    run}}``, a run as :meth:`zbpp_lite.course.bench.SpmdLab.run` gives it, read by :func:`_v_runs`. Right
    when every rank ran the lockstep form's branch in every tick and the gradients equal ``jax.grad``'s within
    :data:`~zbpp_lite.course.lesson8.BUILD_TOLERANCE`; a gradient off names what the V changes (first and
    last per chunk, the previous tick's message sent, arrivals stored where ``recv`` says)."""
    hint = ("on the V the tick reads (kind, chunk, microbatch, recv): index A, c and every buffer by the "
            "chunk; first and last are per chunk (first[ch], last[ch]: stage 2p - 1 is rank 0's chunk 1); "
            "the tick sends st['msg'], the previous tick's message, both ways, keeps its branch's message "
            "as the next msg, and stores each arrival where recv[source] = (buffer, chunk, microbatch) says, "
            "in row microbatch % rows (\"self\": this tick's own message).")
    worst = _v_runs(result, hint)
    if isinstance(worst, Verdict):
        return worst
    return Verdict("10.3", True, f"ZB-V ran as one SPMD program, two chunks a rank, tick for tick as the "
                   f"simulator's lockstep form, with jax.grad's gradients (largest relative difference "
                   f"{worst:.1e}), rows {result.get('rows')}.")


def own_step(result: Any) -> Verdict:
    """Exercise 10.4: the learner's ``own_step(params, tokens, labels) -> (loss, grads)``, ZB-H1 for
    :data:`OWN_CASE`'s model (an embedding, a block a rank, a head, cross-entropy on integer labels) as one
    ``shard_map`` program, run by :func:`zbpp_lite.course.bench.try_own_step`. Right when the step is one
    program with no model work outside it, a pipeline that runs nothing twice
    (``lesson9._pipeline_problem``: a tick's switch, no product outside it, one block's and the
    head's in F (and the embedding's, as a one-hot product), B no more than F, W two more for g's and
    the embedding's gradients written as products, which F may apply without one, each W product over
    the tokens; a B or W that runs F again inside ``jax.grad`` or ``jax.vjp`` runs F's
    products and its own: 6 and 9), its loss is jax's within :data:`~zbpp_lite.course.lesson8.BUILD_TOLERANCE`
    (relative), and every gradient leaf is ``jax.grad``'s (the first wrong leaf is named)."""
    hint = ("one jitted shard_map program: the blocks cut by rank, the embedding, head, tokens and labels "
            "whole and cast to varying first; F embeds where first, then runs jax.vjp of the block and "
            "the loss where last with probes where g, W1, W2 and the head are applied, and keeps the "
            "pullback's arrays and what W multiplies by; B calls the rebuilt pullback and keeps the probes' "
            "gradients for W; the embedding's and head's gradients and the loss summed over the ranks by "
            "lax.psum outside every branch.")
    refused = _step_problem("10.4", result, "own_step", "bench.try_own_step(own_step, ex.OWN_CASE)",
                            "(loss, grads)", hint)
    if refused is not None:
        return refused
    work = [op for op in result["outside"] if op in ("dot_general", "tanh", "log_softmax", "reduce_sum",
                                                      "exp", "gather")]
    if work:
        return Verdict("10.4", False, f"the model runs outside the SPMD program too ({', '.join(work)}).",
                       hint)
    shape = _pipeline_problem("10.4", result, 4, hint, w_more=2)   # a block's 2 matrices, the head, and the
                                                                    # embedding if a one-hot product
    if shape is not None:
        return shape
    loss, ref = _number(result["loss"]), float(result["loss_ref"])
    if loss.shape != () or not abs(loss - ref) <= BUILD_TOLERANCE * abs(ref):   # (a NaN, or None, is off)
        shown = f"{float(loss):.6g}" if loss.shape == () else f"{result['loss']!r:.60}"
        return Verdict("10.4", False, f"the loss is {shown}, the whole model's {ref:.6g}.",
                       "each microbatch adds its mean cross-entropy over m, once, on the last rank; a psum "
                       "makes it one number (out_specs P()).")
    wrong = {k: e for k, e in result["errors"].items() if not e <= BUILD_TOLERANCE}
    if wrong:
        name, off = next(iter(wrong.items()))
        return Verdict("10.4", False, f"the gradient {name} differs from jax.grad's (relative difference "
                       f"{off:.1e}; {len(wrong)} of {len(result['errors'])} leaves differ).", hint)
    f, b, w = result["products"][1:4]
    return Verdict("10.4", True, f"one SPMD program ran ZB-H1 for a model with an embedding, blocks and a "
                   f"head: loss {float(loss):.6f}, jax's {ref:.6f}, every gradient jax.grad's (largest "
                   f"relative difference {max(result['errors'].values()):.1e}); F, B and W run {f}, {b} and "
                   f"{w} matrix products, none again.")


EXERCISES: dict[str, Callable[[Any], Verdict]] = {"10.1": overlapped_ticks, "10.2": routing, "10.3": spmd_v,
                                                   "10.4": own_step}
"""Lesson 10's exercises by id -> check."""

REVEALS: dict[str, Callable[[Any], Any]] = {"10.1": lambda answer: reveal_overlapped_ticks()}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = ["OVERLAP_CASE", "OWN_CASE", "ROUTE_CASES", "V_RUNS", "V_CASE", "overlapped_ticks", "routing",
           "own_step", "spmd_v", "EXERCISES", "REVEALS"]
