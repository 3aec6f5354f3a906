"""The course's exercises: one check function per exercise, which says right or wrong and hints.

Each lesson (notebooks 01-08) asks at least two questions; the learner types an answer into the
exercise cell and calls its check. A check never raises for a wrong answer: it returns a
:class:`Verdict`, which prints "right" or "not yet" with a hint, and is truthy only when right
(so a notebook's solutions section can ``assert`` it). Answers are compared with what the
simulator, the validator, the placement functions, the attribution or the rebalancer compute, or
(for the flop counts) with a count the check makes from the matrix shapes; no answer is stored.

Pure Python: the schedule layer and :mod:`zbpp_lite.analysis` (attribution, rebalancing) are
imported inside the checks that use them; no JAX.

Sources: Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv 2401.10241), sections 2-3
(bubble formulas, memory, the heuristic); Qi et al., "Pipeline Parallelism with Controllable
Memory", NeurIPS 2024 (arXiv 2405.15362), section 3 (the V placement); Narayanan et al., SC 2021,
section 2.2 (interleaved 1F1B).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

from ..schedules.builders import build_schedule
from ..schedules.costs import Costs
from ..schedules.ir import Action, Schedule, looped_placement as _looped, v_placement as _v
from ..schedules.simulate import simulate
from ..schedules.validate import ScheduleError, validate


@dataclass(frozen=True)
class Verdict:
    """What a check says about one answer.

    Attributes:
        exercise: the exercise's id, e.g. ``"1.1"`` (lesson 1, exercise 1).
        ok: True when the answer is right.
        message: why it is right, or what is wrong with it.
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


def _number_check(exercise: str, answer: Any, expected: float, what: str, hint: str, tol: float = 1e-6) -> Verdict:
    if _unanswered(answer):
        return Verdict(exercise, False, "no answer yet: replace ... with yours.", hint)
    value = _as_number(answer)
    if value is None:
        return Verdict(exercise, False, f"expected a number for {what}, got {answer!r}.", hint)
    if abs(value - expected) <= tol * max(1.0, abs(expected)):
        return Verdict(exercise, True, f"{what} is {expected:g}.")
    return Verdict(exercise, False, f"{value:g} is not {what}.", hint)


def _sequence_check(exercise: str, answer: Any, expected: Sequence, what: str, hint: str) -> Verdict:
    if _unanswered(answer):
        return Verdict(exercise, False, "no answer yet: replace ... with yours.", hint)
    try:
        given = tuple(answer)
    except TypeError:
        return Verdict(exercise, False, f"expected a list for {what}, got {answer!r}.", hint)
    if len(given) != len(expected):
        return Verdict(exercise, False, f"{what} has {len(expected)} entries, you gave {len(given)}.", hint)
    values = [_as_number(x) for x in given]
    if any(v is None for v in values):
        return Verdict(exercise, False, f"every entry of {what} is a number, got {list(given)!r}.", hint)
    wrong = [i for i, (v, e) in enumerate(zip(values, expected)) if abs(v - e) > 1e-6 * max(1.0, abs(e))]
    if not wrong:
        return Verdict(exercise, True, f"{what} is {list(expected)}.")
    return Verdict(exercise, False, f"entry {wrong[0]} of {what} is off ({len(wrong)} of {len(expected)} entries wrong).", hint)


# ------------------------------------------------------------------ lesson 1: pipeline bubbles


def bubble_rate_1f1b(answer: Any) -> Verdict:
    """Exercise 1.1: 1F1B's bubble rate for p = 3 ranks, m = 6 microbatches, T_F = T_B = T_W = 1,
    T_comm = 0, derived by hand (a number or a string such as ``"2/8"``)."""
    p, m = 3, 6
    expected = simulate(build_schedule("1f1b", p, m), Costs()).bubble_rate
    return _number_check(
        "1.1", answer, expected, f"1F1B's bubble rate at p = {p}, m = {m}",
        "each rank idles (p-1)(T_F+T_B+T_W) and works m(T_F+T_B+T_W); the rate is idle / (idle + work).",
    )


def microbatches_for_bubble(answer: Any) -> Verdict:
    """Exercise 1.2: the smallest m for which 1F1B on p = 4 ranks (equal costs, T_comm = 0) has a
    bubble rate below 10%."""
    if _unanswered(answer) or _as_number(answer) is None or not float(_as_number(answer)).is_integer():
        return _number_check("1.2", None if _unanswered(answer) else answer, -1, "the smallest m",
                             "m is a whole number of microbatches; solve (p-1)/(m+p-1) < 0.1 for m.")
    m = int(_as_number(answer))
    rate = lambda mm: simulate(build_schedule("1f1b", 4, mm), Costs()).bubble_rate  # noqa: E731
    hint = "solve (p-1)/(m+p-1) < 0.1 for the smallest whole m (p = 4); the rate must be strictly below 10%."
    if m < 1:
        return Verdict("1.2", False, f"m = {m} is not a number of microbatches.", hint)
    if rate(m) >= 0.1:
        return Verdict("1.2", False, f"at m = {m} the bubble rate is {rate(m):.1%}, not below 10%.", hint)
    if m > 1 and rate(m - 1) < 0.1:
        return Verdict("1.2", False, f"m = {m} works, but m = {m - 1} already gives {rate(m - 1):.1%}.", hint)
    return Verdict("1.2", True, f"m = {m} gives {rate(m):.2%}; m = {m - 1} gives {rate(m - 1):.2%}.")


def two_rank_schedule(actions: Any) -> Verdict:
    """Exercise 1.3: a valid schedule for p = 2 ranks (stage r on rank r) and m = 2 microbatches,
    written as two lists of actions in PyTorch's text form (``"0F1"``: stage 0's F of
    microbatch 1; ``"1B0"``: stage 1's fused backward BW of microbatch 0; ``"1I0"``/``"1W0"``: B and
    W apart), or as :class:`~zbpp_lite.schedules.ir.Action` objects. Passes when
    :func:`zbpp_lite.validate` accepts it; otherwise the hint is the validator's message."""
    hint = ("rank 0 runs stage 0's F and backward of microbatches 0 and 1, rank 1 the same for stage 1; "
            "a stage's F comes before its backward, and stage 0's backward needs stage 1's.")
    if _unanswered(actions):
        return Verdict("1.3", False, "no answer yet: replace ... with two lists of actions.", hint)
    try:
        rows = [[a if isinstance(a, Action) else Action.from_str(str(a)) for a in row] for row in actions]
    except (TypeError, ValueError) as e:
        return Verdict("1.3", False, f"could not read the actions: {e}", "write each action as text, e.g. \"0F0\" or \"1B1\".")
    if len(rows) != 2:
        return Verdict("1.3", False, f"two ranks need two lists, you gave {len(rows)}.", hint)
    try:
        validate(Schedule(tuple(map(tuple, rows)), (0, 1), 2, "mine"))
    except ScheduleError as e:
        return Verdict("1.3", False, "zb.validate refuses it.", str(e).splitlines()[0])
    return Verdict("1.3", True, "zb.validate accepts it: complete, ordered and free of deadlock.")


# ------------------------------------------------------------------ lesson 2: the backward split

MLP_TOKENS, MLP_WIDTHS = 16, (32, 64, 32)
"""The two-layer MLP of notebook 02: 16 tokens, x (16, 32) @ W1 (32, 64), then (16, 64) @ W2 (64, 32)."""


def _matmul(rows: int, inner: int, cols: int) -> int:
    return 2 * rows * inner * cols  # one multiply and one add per term


def w_flops(answer: Any) -> Verdict:
    """Exercise 2.1: the matmul flops of W (both weight gradients, ``x.T @ dh`` and ``a.T @ dy``)
    for notebook 02's two-layer MLP; a (r, k) @ (k, c) product counts 2 r k c flops."""
    n, (d0, d1, d2) = MLP_TOKENS, MLP_WIDTHS
    expected = _matmul(d0, n, d1) + _matmul(d1, n, d2)
    return _number_check("2.1", answer, expected, "W's matmul flops", "dW1 = x.T @ dh is (32, 16) @ (16, 64); dW2 = a.T @ dy is (64, 16) @ (16, 32).")


def w_flops_without_kept_gradients(answer: Any) -> Verdict:
    """Exercise 2.2: W's matmul flops for the same MLP when B keeps no output gradients, so W must
    recompute dh itself from dy (the elementwise GELU derivative is not counted)."""
    n, (d0, d1, d2) = MLP_TOKENS, MLP_WIDTHS
    expected = _matmul(d0, n, d1) + _matmul(d1, n, d2) + _matmul(n, d2, d1)  # + da = dy @ W2.T
    return _number_check(
        "2.2", answer, expected, "W's matmul flops without kept output gradients",
        "W still needs dh = (dy @ W2.T) * gelu'(h): add the product dy @ W2.T, (16, 32) @ (32, 64), to exercise 2.1's count.",
    )


# ------------------------------------------------------------------ lesson 3: ZB-H1 and ZB-H2


def zb_h1_makespan(answer: Any) -> Verdict:
    """Exercise 3.1: ZB-H1's makespan for p = 4, m = 8, T_F = T_B = 1, T_W = 0.5, T_comm = 0,
    predicted before simulating."""
    expected = simulate(build_schedule("zb-h1", 4, 8), Costs(f=1.0, b=1.0, w=0.5)).makespan
    return _number_check("3.1", answer, expected, "ZB-H1's makespan", "m(T_F+T_B+T_W) of work plus the bubble (p-1)(T_F+T_B-T_W).")


def zb_h2_peak_memory(answer: Any) -> Verdict:
    """Exercise 3.2: ZB-H2's peak activation memory on rank 0, in M_B, for p = 5 and m = 10."""
    expected = max(simulate(build_schedule("zb-h2", 5, 10), Costs()).peak_memory)
    return _number_check("3.2", answer, expected, "ZB-H2's peak on rank 0 (in M_B)", "rank 0 runs 2(p-r)-1 warm-up forwards before its first B.")


def gpipe_makespan_with_comm(answer: Any) -> Verdict:
    """Exercise 3.3: GPipe's makespan for p = 4, m = 8, T_F = T_B = T_W = 1, T_comm = 0.25."""
    expected = simulate(build_schedule("gpipe", 4, 8), Costs(comm=0.25)).makespan
    return _number_check("3.3", answer, expected, "GPipe's makespan with T_comm = 0.25",
                         "the bubble becomes (p-1)(T_F+T_B+T_W+2T_comm): one transfer on the way down, one on the way back.")


# ------------------------------------------------------------------ lesson 4: zb-auto

AUTO_CASE = dict(num_ranks=4, num_microbatches=12, costs=Costs(f=1.0, b=1.0, w=0.5, comm=0.05))
"""Notebook 04's explorer case: p = 4, m = 12, T_F = T_B = 1, T_W = 0.5, T_comm = 0.05."""


def _auto(limit: float):
    from ..schedules.builders.auto import auto_plan

    c = AUTO_CASE
    return auto_plan(c["num_ranks"], c["num_microbatches"], c["costs"], limit)


def memory_limit_for_bubble(answer: Any) -> Verdict:
    """Exercise 4.1: the smallest whole memory limit (in M_B, at least p) at which zb-auto's bubble
    rate drops below 5% in :data:`AUTO_CASE`."""
    hint = "sweep auto_plan(4, 12, costs, limit) over limits 4, 5, 6, ... and read bubble_rate."
    value = None if _unanswered(answer) else _as_number(answer)
    if value is None or not value.is_integer():
        return _number_check("4.1", None if _unanswered(answer) else answer, -1, "the limit", hint + " The limit is a whole number.")
    limit = int(value)
    p = AUTO_CASE["num_ranks"]
    if limit < p:
        return Verdict("4.1", False, f"a limit of {limit} M_B is below 1F1B's {p}; start the sweep at p.", hint)
    here = _auto(limit).bubble_rate
    if here >= 0.05:
        return Verdict("4.1", False, f"at {limit} M_B the bubble rate is {here:.2%}, not below 5%.", hint)
    if limit > p and _auto(limit - 1).bubble_rate < 0.05:
        return Verdict("4.1", False, f"{limit} M_B works, but a smaller limit does too.", hint)
    return Verdict("4.1", True, f"{limit} M_B gives {here:.2%}; {limit - 1} M_B gives {_auto(limit - 1).bubble_rate:.2%}.")


def warmup_forwards(answer: Any) -> Verdict:
    """Exercise 4.2: how many F rank 0 runs before its first B when zb-auto plans
    :data:`AUTO_CASE` under a memory limit of 5 M_B."""
    row = _auto(5.0).schedule.actions[0]
    expected = next(i for i, a in enumerate(row) if a.kind != "F")
    return _number_check("4.2", answer, expected, "rank 0's warm-up forwards under a 5 M_B limit",
                         "each F holds M_B until its B, and no B can come before the first microbatch has gone down and back.")


# ------------------------------------------------------------------ lesson 5: V-shaped schedules


def v_placement(answer: Any) -> Verdict:
    """Exercise 5.1: the V placement for p = 3 ranks, 6 stages: the rank of each stage, stage 0 first."""
    return _sequence_check("5.1", answer, _v(3), "the V placement for p = 3",
                           "stages 0..p-1 go down the ranks 0..p-1; stages p..2p-1 come back up, so stage 2p-1 is on rank 0.")


def zb_v_peak_memory(answer: Any) -> Verdict:
    """Exercise 5.2: ZB-V's peak activation memory on each rank for p = 4, m = 8, in units of one
    stage's M_B (a list of 4 numbers, rank 0 first)."""
    expected = simulate(build_schedule("zb-v", 4, 8), Costs()).peak_memory
    return _sequence_check("5.2", answer, expected, "ZB-V's per-rank peaks (stage units)",
                           "a rank holds two stages; the V makes every rank hold the same: 2p stage-units, 1F1B's p whole-rank M_B.")


# ------------------------------------------------------------------ lesson 6: interleaved, looped


def looped_placement(answer: Any) -> Verdict:
    """Exercise 6.1: the looped placement of interleaved 1F1B for p = 2 ranks and v = 2 stages per
    rank: the rank of each of the 4 stages."""
    return _sequence_check("6.1", answer, _looped(2, 4), "the looped placement for p = 2, v = 2", "stage s goes to rank s % p.")


def interleaved_makespan(answer: Any) -> Verdict:
    """Exercise 6.2: interleaved 1F1B's makespan for p = 4, m = 8, v = 2 stages per rank, each stage
    costing T_F = T_B = T_W = 0.5 (half a rank's layers), T_comm = 0."""
    expected = simulate(build_schedule("interleaved-1f1b", 4, 8), Costs(f=0.5, b=0.5, w=0.5)).makespan
    return _number_check("6.2", answer, expected, "interleaved 1F1B's makespan",
                         "work m(T_F+T_B+T_W) per rank in whole-rank costs, plus 1F1B's bubble divided by v.")


# ------------------------------------------------------------------ lesson 7: bubble detection


def blamed_stage(answer: Any) -> Verdict:
    """Exercise 7.1: ZB-H1 on p = 4, m = 8 with stage 1 twice as slow as the others (T_F, T_B, T_W
    = 2 there, 1 elsewhere): which stage does ``attribute`` blame most for imbalance?"""
    from ..analysis.attribute import attribute

    costs = Costs(f=[1, 2, 1, 1], b=[1, 2, 1, 1], w=[1, 2, 1, 1])
    schedule = build_schedule("zb-h1", 4, 8)
    found = attribute(simulate(schedule, costs), schedule, costs).by_stage()
    blame = {s: causes.get("imbalance", 0.0) for s, causes in found.items()}
    expected = max(blame, key=lambda s: blame[s])
    return _number_check("7.1", answer, expected, "the stage blamed most for imbalance", "the ranks around a slow stage wait for it, and it is its time that is missing.")


LAYER_COSTS = (1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0)
"""Exercise 7.2's per-layer costs (T_F + T_B + T_W of each of 8 layers)."""


def balanced_partition(answer: Any) -> Verdict:
    """Exercise 7.2: how many of :data:`LAYER_COSTS`' 8 layers (taken from the front) go on stage 0
    of 2 so that the slower stage is as fast as it can be?"""
    from ..analysis.rebalance import best_partition

    best = best_partition(list(LAYER_COSTS), 2)
    hint = "add layer costs from the front until stage 0 holds half of the total, 12."
    value = None if _unanswered(answer) else _as_number(answer)
    if value is None or not value.is_integer() or not 1 <= value <= len(LAYER_COSTS) - 1:
        return _number_check("7.2", None if _unanswered(answer) else answer, len(best[0]), "the layers on stage 0", hint)
    k = int(value)
    slowest = max(sum(LAYER_COSTS[:k]), sum(LAYER_COSTS[k:]))
    optimum = max(sum(LAYER_COSTS[i] for i in part) for part in best)
    if slowest <= optimum + 1e-9:
        return Verdict("7.2", True, f"{k} layers on stage 0: both stages cost {optimum:g}.")
    return Verdict("7.2", False, f"with {k} layers on stage 0 the slower stage costs {slowest:g}; {optimum:g} is possible.", hint)


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "1.1": bubble_rate_1f1b,
    "1.2": microbatches_for_bubble,
    "1.3": two_rank_schedule,
    "2.1": w_flops,
    "2.2": w_flops_without_kept_gradients,
    "3.1": zb_h1_makespan,
    "3.2": zb_h2_peak_memory,
    "3.3": gpipe_makespan_with_comm,
    "4.1": memory_limit_for_bubble,
    "4.2": warmup_forwards,
    "5.1": v_placement,
    "5.2": zb_v_peak_memory,
    "6.1": looped_placement,
    "6.2": interleaved_makespan,
    "7.1": blamed_stage,
    "7.2": balanced_partition,
}
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
    import numpy as np

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
            return f"parameter {i} equals another layer's gradient: pair each layer's input with its own output gradient."
        return (f"parameter {i} is off: dW = x.T @ dz with x the layer's input (kept by F) and dz its "
                "output gradient (kept by B); db = dz summed over the rows.")
    return ""


def stage_split(result: Any) -> Verdict:
    """Exercise 8.1: a stage's F, B and W written by the learner. ``result`` is what notebook
    08's ``try_stage(F, B, W)`` returns: ``{"error": None or the exception's text, "cases": [...]}``,
    one case per tried stage, each a dict of NumPy arrays: ``y`` / ``ref_y`` (F's output and the
    stage function's), ``dx`` / ``ref_dx`` (B's input gradient and ``jax.vjp``'s; None for stage 0),
    ``grads`` / ``ref_grads`` (W's parameter gradients and ``jax.vjp``'s, flat, layer order) and
    ``recomputed`` (True when B or W ran the stage's forward again instead of using what F kept)."""
    hint = ("F: jax.vjp of the stage with respect to its input and the zero probes, keep the pullback and "
            "the layer inputs; B: call the pullback on dy; W: x.T @ dz and dz.sum(0) per layer.")
    if _unanswered(result):
        return Verdict("8.1", False, "no answer yet: fill in F, B and W.", hint)
    if not isinstance(result, dict) or "cases" not in result:
        return Verdict("8.1", False, f"expected try_stage(F, B, W)'s result, got {type(result).__name__}.", hint)
    if result.get("error"):
        return Verdict("8.1", False, f"your functions raised {result['error']}", hint)
    if not result["cases"]:
        return Verdict("8.1", False, "no stage was tried.", hint)
    worst = 0.0
    for case in result["cases"]:
        s = case["stage"]
        if case.get("recomputed"):
            return Verdict("8.1", False, f"on stage {s}, B or W ran the stage's layers again.",
                           "F keeps the pullback jax.vjp returned; B only calls it, W only multiplies what F and B kept.")
        if _rel_diff(case["y"], case["ref_y"]) > BUILD_TOLERANCE:
            return Verdict("8.1", False, f"F's output on stage {s} is not the stage's output.", hint)
        if case["ref_dx"] is not None and _rel_diff(case["dx"], case["ref_dx"]) > BUILD_TOLERANCE:
            return Verdict("8.1", False, f"B's input gradient on stage {s} differs from jax.vjp's.",
                           "B returns the pullback's gradient for the stage input, first of its two outputs.")
        mine, ref = list(case["grads"] or ()), list(case["ref_grads"])
        why = _weight_hint(mine, ref)
        if why:
            return Verdict("8.1", False, f"W's gradients on stage {s} differ from jax.vjp's.", why)
        worst = max([worst, _rel_diff(case["y"], case["ref_y"])] + [_rel_diff(a, b) for a, b in zip(mine, ref)])
    stages = ", ".join(str(c["stage"]) for c in result["cases"])
    return Verdict("8.1", True, f"on stages {stages}, F, B and W give the stage's output and jax.vjp's gradients "
                                f"(largest relative difference {worst:.1e}).")


def weight_bytes(answer: Any) -> Verdict:
    """Exercise 8.2: M_W of one stage of :data:`BUILD_CASE` for one microbatch, in bytes: what B
    keeps for W (each layer's input and its output gradient), predicted from the shapes."""
    c = BUILD_CASE
    per_stage = c["layers"] // c["ranks"]
    expected = per_stage * 2 * c["microbatch_size"] * c["width"] * c["itemsize"]
    return _number_check("8.2", answer, expected, "M_W in bytes",
                         "W needs, for each layer of the stage, its input x and its output gradient dz: "
                         "each (rows, width) float32, 4 bytes a number. The bias gradient needs dz only.")


def pipeline_run(result: Any) -> Verdict:
    """Exercise 8.3: the learner's rank loop, run by notebook 08's ``try_pipeline(rank_loop)`` on
    1F1B and on ZB-H1. ``result``: ``{"error": None or text, "runs": {name: {"timeline":
    Timeline, "grad_error": float}}}``. Right when, for both schedules, every rank ran exactly its
    actions in the schedule's order (one event each), every action started after the actions of
    other ranks it needs had ended, and the gradients equal ``jax.grad``'s within
    :data:`BUILD_TOLERANCE`."""
    hint = ("walk `actions` in order; F takes its input from the inbox (stage 0: the data), B its "
            "output gradient (last stage: 1/m); block_until_ready, record the Event, then device_put "
            "the result into the next rank's inbox.")
    if _unanswered(result):
        return Verdict("8.3", False, "no answer yet: fill in rank_loop.", hint)
    if not isinstance(result, dict) or "runs" not in result:
        return Verdict("8.3", False, f"expected try_pipeline(rank_loop)'s result, got {type(result).__name__}.", hint)
    if result.get("error"):
        return Verdict("8.3", False, f"running it raised {result['error']}", hint)
    c = BUILD_CASE
    worst = 0.0
    for name in ("1f1b", "zb-h1"):
        if name not in result["runs"]:
            return Verdict("8.3", False, f"no run of {name}.", hint)
        run = result["runs"][name]
        why = _order_problem(build_schedule(name, c["ranks"], c["microbatches"]), run["timeline"])
        if why:
            return Verdict("8.3", False, f"{name}: {why}", hint)
        error = float(run["grad_error"])
        if not error <= BUILD_TOLERANCE:
            return Verdict("8.3", False, f"{name}: the gradients differ from jax.grad's (relative difference {error:.1e}).",
                           "each W must use the layer inputs and output gradients of its own (stage, microbatch), "
                           "and each stage add up its W's over all m microbatches.")
        worst = max(worst, error)
    return Verdict("8.3", True, "1F1B and ZB-H1 ran in their schedules' order on every rank, each action after its "
                                f"inputs; the gradients equal jax.grad's (largest relative difference {worst:.1e}).")


def _order_problem(schedule: Schedule, timeline: Any) -> str:
    """What is wrong with a measured run of ``schedule``, or "" when each rank ran its actions in
    order, one event each, and each action began after the other ranks' actions it needs ended."""
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
                return f"{e.action} on rank {e.rank} started before {key[0]} of stage {key[1]}, microbatch {j} had ended."
    return ""


def zb_h1_peak(answer: Any) -> Verdict:
    """Exercise 8.4: a function ``peak(p, r, mem_b, mem_w)``: the peak activation memory of rank r
    under ZB-H1 with p ranks (one stage each, m = 2p microbatches), F keeping M_B = ``mem_b`` until
    B and B keeping M_W = ``mem_w`` until W. Checked against the simulator at several points."""
    hint = ("list what rank r holds right after an F of the steady state: microbatches past F but not B "
            "hold M_B each, those past B but not W hold M_W each; ZB-H1 runs rank r's W of microbatch j "
            "after its B of microbatch j + r.")
    if _unanswered(answer):
        return Verdict("8.4", False, "no answer yet: replace ... with a function peak(p, r, mem_b, mem_w).", hint)
    if not callable(answer):
        return Verdict("8.4", False, f"expected a function of (p, r, mem_b, mem_w), got {answer!r}.", hint)
    for p, m, mem_b, mem_w in ((4, 8, 1.0, 0.5), (3, 6, 5.0, 1.0), (5, 10, 2.0, 1.5), (2, 4, 1.0, 0.0)):
        planned = simulate(build_schedule("zb-h1", p, m), Costs(mem_b=mem_b, mem_w=mem_w)).peak_memory
        for r in range(p):
            try:
                value = _as_number(answer(p, r, mem_b, mem_w))
            except Exception as e:  # noqa: BLE001 - the learner's function: say what it raised
                return Verdict("8.4", False, f"peak({p}, {r}, {mem_b}, {mem_w}) raised {type(e).__name__}: {e}", hint)
            if value is None or abs(value - planned[r]) > 1e-9 * max(1.0, planned[r]):
                return Verdict("8.4", False, f"peak({p}, {r}, {mem_b}, {mem_w}) gives {value}; the simulator gives {planned[r]:g}.", hint)
    return Verdict("8.4", True, "your peak agrees with zb.simulate on every rank of four cases (p = 2 to 5).")


EXERCISES.update({"8.1": stage_split, "8.2": weight_bytes, "8.3": pipeline_run, "8.4": zb_h1_peak})
