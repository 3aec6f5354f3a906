"""Lesson 8's exercise checks (build the pipeline): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`). What runs the learner's code is :mod:`.bench`."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from ..schedules.builders import build_schedule
from ..schedules.ir import Schedule
from ..schedules.program import consumer_stage, producer_stage
from .checks import Verdict, _settled, _shown, _unanswered


BUILD_CASE = dict(ranks=4, microbatches=8, layers=8, width=256, microbatch_size=64, itemsize=4)
"""Notebook 08's model: an MLP of 8 layers ``tanh(x @ A + c)`` of width 256, cut into 4 stages of 2
layers (stage s on rank s), a global batch of 8 microbatches of 64 rows, float32."""


BUILD_TOLERANCE = 1e-4
"""Largest relative difference (to the reference's largest magnitude) accepted between the
learner's arrays and JAX's: float32 sums in another order differ by about 1e-6 on any CPU."""


def _rel_diff(mine: Any, ref: Any) -> float:
    """max |mine - ref| / max |ref| for two arrays of one shape (inf for other shapes, or a NaN)."""

    try:
        a, b = np.asarray(mine, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    except (TypeError, ValueError):
        return math.inf
    if a.shape != b.shape:
        return math.inf
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    off = float(np.max(np.abs(a - b))) / max(scale, 1e-30) if a.size else 0.0
    return off if math.isfinite(off) else math.inf   # a NaN anywhere is as far off as can be


def _weight_hint(mine: Sequence, ref: Sequence) -> str:
    """Why W's gradients differ from the reference's, from the common mistakes."""
    if len(mine) != len(ref):
        return (f"W returned {len(mine)} arrays where the stage has {len(ref)} parameters: one (dA, dc) "
                "pair per layer, in layer order.")
    for i, (a, b) in enumerate(zip(mine, ref)):
        if _rel_diff(a, b) <= BUILD_TOLERANCE:
            continue
        if getattr(b, "ndim", 0) == 2 and _rel_diff(a, b.T) <= BUILD_TOLERANCE:
            return (f"parameter {i} is the transpose of dA: dA = x.T @ dz, (width, samples) @ "
                    "(samples, width).")
        if any(_rel_diff(a, c) <= BUILD_TOLERANCE for c in ref if c is not b):
            return (f"parameter {i} equals another layer's gradient: "
                    "pair each layer's input with its own dz.")
        return (f"parameter {i} is off: dA = x.T @ dz with x the layer's input (kept by F) and dz the "
                "gradient at its pre-activation (from B); dc = dz summed over the samples.")
    return ""


def _run_problem(key: str, result: Any, field: str, call: str, fill: str, who: str,
                 hint: str) -> Verdict | None:
    """The verdict on a lesson-8 result not ready to check (no answer, wrong type, or an error raised by
    ``who``), or None when ``result[field]`` is there."""
    if _unanswered(result):
        return Verdict(key, False, f"no answer yet: fill in {fill}.", hint)
    if not isinstance(result, dict) or not isinstance(result.get(field), (dict, list)):
        return Verdict(key, False, f"expected {call}'s result, got {type(result).__name__}.", hint)
    if result.get("error"):
        return Verdict(key, False, f"{who} raised {result['error']}", hint)
    return None


def stage_split(result: Any) -> Verdict:
    """Exercise 8.1: a stage's F, B and W written by the learner.

    ``result`` is notebook 08's ``try_stage(F, B, W)``: ``{"error": None or text, "cases": [...]}``, per
    tried stage a dict of NumPy arrays ``y``/``ref_y``, ``dx``/``ref_dx`` (None for stage 0),
    ``grads``/``ref_grads`` (flat, layer order; refs from ``jax.vjp``), ``recomputed`` (B or W reran F),
    ``b_flops``/``ref_b_flops`` (XLA's flops of B and of the input-gradient pullback), ``b_error``
    (why jax.jit could not compile B, else None: a B whose flops cannot be counted does not pass) and
    ``for_w_bytes``/``w_needs_bytes`` (the distinct arrays' bytes B hands to W, and those of each layer's
    input and dz: more fails), ``w_flops``/``w_products_flops``
    (XLA's flops of W, and of each layer's ``x.T @ dz``: W doing more than 1.5 times those runs the layers
    again), ``w_error`` (why jax.jit could not compile W, else None) and ``b_products``/``ref_b_products``
    (the matrix products B and the input-gradient pullback run as traced: work whose result B drops,
    which XLA's flops leave out, counts).
    """
    hint = ("F: a jax.vjp with respect to which arguments gives B the input gradient and every layer's dz, "
            "and no weight gradient? What must F keep for B, and what for W? W: which two arrays per "
            "layer, and lesson 2's rule for dA?")
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
        for part, error, flops, ref, what, why, fix in (
                ("B", "b_error", "b_flops", "ref_b_flops", "the input gradient alone",
                 "it computes the weight gradients too, or runs the layers again",
                 "take jax.vjp with respect to x and the probes only; dA and dc are W's work."),
                ("W", "w_error", "w_flops", "w_products_flops", "each layer's x.T @ dz",
                 "it runs the layers again",
                 "W only multiplies what B hands it: each layer's input and dz.")):
            if case.get(error):
                return Verdict("8.1", False, f"on stage {s}, jax.jit could not compile {part} "
                               f"({case[error]}), so its flops cannot be counted.", f"write {part} with JAX "
                               "operations on arrays only: no Python branch on a value, no NumPy conversion.")
            extra = (case.get(flops) or 0.0) / (case.get(ref) or float("inf"))
            if extra > 1.5:
                return Verdict("8.1", False, f"on stage {s}, {part} did {extra:.1f}x the flops of {what}: "
                               f"{why}.", fix)
        b, ref_b = case.get("b_products"), case.get("ref_b_products")
        if b is not None and ref_b is not None and b > ref_b:
            return Verdict("8.1", False, f"on stage {s}, B runs {b} matrix products where the input gradient "
                           f"takes {ref_b}: it computes the weight gradients too (even unused), or runs the "
                           "layers again.", "take jax.vjp with respect to x and the probes only; dA and dc "
                           "are W's work.")
        held, needed = case.get("for_w_bytes", 0), case.get("w_needs_bytes", 0)
        if held > needed:
            return Verdict("8.1", False, f"on stage {s}, B hands W {held:,} bytes; W needs each layer's "
                           f"input x and dz, {needed:,} bytes.", "what else does B return for W? A pullback "
                           "holds every array F kept; W needs none of them but x and dz.")
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


PIPELINE_RUNS = (("1f1b", 4), ("zb-h1", 4), ("zb-h2", 4), ("zb-v", 2))
"""Exercise 8.2's runs (schedule, ranks) on :data:`BUILD_CASE`'s 4 stages: 1F1B's fused BW, ZB-H2's longer
W lag, ZB-V's V placement (0, 1, 1, 0), which catches a loop that sends to rank +- 1 instead of the rank
``placement`` names; lesson 8 draws only ZB-H1."""


def gradient_problem(key: str, name: str, run: dict, microbatches: int, otherwise: str | None = None
        ) -> Verdict | None:
    """The verdict on a pipeline run whose gradients are not ``jax.grad``'s within :data:`BUILD_TOLERANCE`,
    naming the likely mistake from ``run``'s :func:`zbpp_lite.course.bench.gradient_report` fields
    (``grad_error``, ``stage_errors``, ``scale``); None when they are (exercises 8.2 and 9.4).
    ``otherwise``: the hint where no particular mistake is named (default: lesson 8's)."""
    error = float(run.get("grad_error", float("inf")))
    if error <= BUILD_TOLERANCE:
        return None
    errors = list(run.get("stage_errors") or [])
    scale, m = float(run.get("scale", float("nan"))), microbatches
    say = lambda what, hint: Verdict(key, False, f"{name}: {what}", hint)  # noqa: E731
    if run.get("not_finite"):
        return say(f"stage(s) {run['not_finite']} have gradients that are not numbers (NaN or infinity).",
                   "a NaN comes from 0/0, 0 * inf or an array read before it was written: find the first "
                   "action whose output holds one.")
    missing = [s for s, e in enumerate(errors) if e == float("inf")]
    if missing:
        return say(f"no gradients (or the wrong shapes) for stage(s) {missing}.",
                   "every stage's W gradients, summed over the microbatches, must come back.")
    if abs(scale - m) <= 1e-3 * m:
        return say(f"every gradient is {m} times jax.grad's.",
                   "the loss is the mean of the m microbatch losses: where does the last stage's "
                   "backward start?")
    if abs(scale * m - 1) <= 1e-3:
        return say(f"every gradient is 1/{m} of jax.grad's.", "the 1/m of the mean is taken twice.")
    right = [s for s, e in enumerate(errors) if e <= BUILD_TOLERANCE]
    if right and right == list(range(min(right), len(errors))) and min(right) > 0:
        k = min(right)
        good = f"stage {k} is" if k == len(errors) - 1 else f"stages {k} to {len(errors) - 1} are"
        return say(f"{good} right, stage {k - 1} is not.",
                   f"what stage {k} sends back to stage {k - 1} (the input gradient), or where it is taken "
                   "or stored, is not that microbatch's.")
    return say(f"the gradients differ from jax.grad's (relative difference {error:.1e}).", otherwise or (
               "each F, B and W must read its own (stage, microbatch)'s values, still intact when it runs "
               "(not another microbatch's, not overwritten), and each stage add up all m W's."))


def pipeline_run(result: Any) -> Verdict:
    """Exercise 8.2: the learner's rank loop, run by notebook 08's ``try_pipeline(rank_loop)`` on
    :data:`PIPELINE_RUNS`; ``result`` is ``{"error": None or text, "runs": {name: {"timeline": Timeline,
    "w_calls", "moved", "calls", "w_wrong", "grad_error", "stage_errors", "scale"}}}``. Right when every rank
    ran its actions in order, one event each, each after its inputs ended, each W and BW event held one call
    of the learner's W (:func:`_w_problem`), the gradients equal ``jax.grad``'s within
    :data:`BUILD_TOLERANCE` (:func:`gradient_problem` names a wrong gradient's likely cause), F and B ran once
    per action (:func:`_calls_problem`: nothing run again), each rank returned only its own stages while
    what crossed the ranks was each stage boundary's value (:func:`_moved_problem`), and each W call
    returned its own microbatch's weight gradient (:func:`_w_results_problem`)."""
    hint = ("follow one microbatch through the figure: what must each of F, B, W and BW have before it "
            "starts, which rank holds the stage that needs its result, and when is that result ready?")
    if isinstance(result, dict) and result.get("error"):   # a wait that never ends, a send to no rank
        return Verdict("8.2", False, f"running it raised {result['error']}", "a wait in vain or a rank out "
                       "of range: a value goes to the inbox of the rank `placement` names for the stage that "
                       "needs it, under the key of its action; a JAX error: see what F or B got.")
    problem = _run_problem("8.2", result, "runs", "try_pipeline(rank_loop)", "rank_loop", "running it", hint)
    if problem is not None:
        return problem
    if isinstance(result.get("stage"), dict):
        split = stage_split(result["stage"])
        if not split:
            return Verdict("8.2", False, f"your F, B and W do not pass exercise 8.1 yet: {split.message}",
                           split.hint)
    c = BUILD_CASE
    worst = 0.0
    for name, ranks in PIPELINE_RUNS:
        if name not in result["runs"]:
            return Verdict("8.2", False, f"no run of {name}.", hint)
        run = result["runs"][name]
        why = (_order_problem(build_schedule(name, ranks, c["microbatches"]), run["timeline"])
               or _w_problem(run["timeline"], run.get("w_calls")))
        if why:
            return Verdict("8.2", False, f"{name}: {why}", hint)
        problem = gradient_problem("8.2", name, run, c["microbatches"])
        if problem is not None:
            return problem
        why = (_calls_problem(build_schedule(name, ranks, c["microbatches"]), run.get("calls"))
               or _moved_problem(run.get("moved")) or _w_results_problem(run.get("w_wrong")))
        if why:
            return Verdict("8.2", False, f"{name}: {why}", "each rank runs only its own stages, on what it "
                           "receives, and sends each result to the rank holding the stage that needs it.")
        error = float(run["grad_error"])
        worst = max(worst, error)
    names = ", ".join(name for name, _ in PIPELINE_RUNS)
    return Verdict("8.2", True,
                   f"{names} ran in their schedules' order on every rank, each action after its inputs and "
                   f"each weight gradient in its own W; the gradients equal jax.grad's (largest relative "
                   f"difference {worst:.1e}).")


def _calls_problem(schedule: Any, calls: dict | None) -> str:
    """What is wrong with how often a run called the learner's F and B (``calls``: counts, None where not
    read), or "": each F action calls F once, each B and BW action B once (a B or W that runs F or B again
    calls it again; fewer calls are left to the other checks, as an F the learner jitted is seen only when
    it compiles)."""
    actions = [a.kind for row in schedule.actions for a in row]
    want = {"F": actions.count("F"), "B": actions.count("B") + actions.count("BW")}
    again = {"F": "B must start from what F kept", "B": "W must use what B handed it"}
    for name, n in want.items():   # (fewer calls are not judged: a jitted F is seen only as it compiles)
        got = (calls or {}).get(name)
        if got is not None and got > n:
            return (f"your {name} ran {got} times for {n} {name}{' and BW' if name == 'B' else ''} actions: "
                    f"each runs it once ({again[name]}, not run {name} again).")
    return ""


def _w_results_problem(wrong: list | None) -> str:
    """What is wrong with what a run's W calls computed (``wrong``:
    :meth:`zbpp_lite.course.bench.Lab._w_wrong`'s; None: not recorded), or "": each W call's result is
    its own microbatch's weight gradient."""
    if not wrong:
        return ""
    s, j, off = wrong[0]
    return (f"the W run as stage {s}'s W of microbatch {j} did not return that microbatch's weight gradient "
            f"(relative difference {off:.1e}; {len(wrong)} W calls so): each W must read its own "
            "microbatch's x and dz.")


def _moved_problem(moved: dict | None) -> str:
    """What is wrong with what a run sent and returned (``moved``:
    :meth:`zbpp_lite.course.bench.Lab.moved`'s; None: not recorded), or "": gradients that come out right
    while a rank returns another rank's stage, or while what crosses the ranks is not the stage boundaries'
    values, were computed somewhere else than the schedule says."""
    if not moved:
        return ""
    if moved["stray"]:
        r, stage = moved["stray"][0]
        return f"rank {r} returned gradients for stage {stage}, which it does not hold."
    if moved["wrong"] and moved.get("scale") is not None:
        first, n = moved["wrong"][0][0], len(moved["wrong"])
        return (f"every value that differs from what crosses the stage boundary ({n}, the first {first}) is "
                f"{moved['scale']:g} times it: what is sent must be the loss's own gradient, so start the "
                "last stage's B from 1/m rather than rescale at the end.")
    if moved["wrong"]:
        (kind, stage, j), off = moved["wrong"][0]
        what = "output" if kind == "F" else "input gradient"
        return (f"the value sent under {(kind, stage, j)} is not stage {stage}'s {what} for microbatch {j} "
                f"(relative difference {off:.1e}): the gradients came from work done elsewhere.")
    if moved["missing"]:
        kind, stage, j = moved["missing"][0]
        return (f"{(kind, stage, j)} never crossed to the rank that needs it ({len(moved['missing'])} values "
                "that cross ranks were never sent): the gradients came from work done elsewhere.")
    return ""


def _w_problem(timeline: Any, calls: list | None) -> str:
    """What is wrong with when a run called the learner's ``W`` (``calls``: (rank, seconds since the start)
    of each call; None: not recorded): each W and BW event of a rank must hold exactly one call made by that
    rank, or a W computed during its B and only added later would pass as deferred. "" where right."""
    if calls is None:
        return ""
    windows = sorted((e.rank, e.start, e.end) for e in timeline.events if e.action.kind in ("W", "BW"))
    if len(calls) != len(windows):
        unseen = (" (the check follows your W through module names, default arguments and closures, not "
                  "through a dict, a class or your own jax.jit: call W by name; lab.run_compiled jits it "
                  "for you)") if not calls else ""
        return (f"your W ran {len(calls)} times for {len(windows)} W and BW actions: each computes its "
                f"weight gradient with one call of W, when it runs{unseen}.")
    held = [0] * len(windows)
    for rank, t in calls:
        inside = [k for k, (r, a, b) in enumerate(windows) if r == rank and a <= t <= b]
        if not inside:
            return (f"rank {rank} called W at {t * 1e3:.1f} ms, outside its W and BW actions: a weight "
                    "gradient is computed when the schedule runs its W, not during B.")
        held[inside[0]] += 1
    if max(held) > 1:
        return "one W or BW action called your W twice, another not at all."
    return ""


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


STEP = dict(lr=1.0, max_norm=0.02)
"""Exercise 8.3's optimizer: plain SGD with learning rate ``lr``, the gradient clipped to global norm
``max_norm`` (below the norm of :data:`BUILD_CASE`'s gradient, 0.09, and of each stage's, about 0.045, so
the clipping acts, with another scale for a stage clipped alone)."""

STEP_TOLERANCE = 1e-3
"""Relative tolerance on a step (new - old parameters, to its largest magnitude, about 1e-4): float32
parameters of up to 0.3 are rounded to about 3e-8."""

STEP_RUNS = {"one stage per rank": ((0, 1, 2, 3), STEP["max_norm"], STEP["lr"]),
             "V placement": ((0, 1, 1, 0), STEP["max_norm"], 0.5),
             "a global norm under max_norm": ((0, 1, 2, 3), 1.0, STEP["lr"])}
"""Exercise 8.3's runs: name -> (placement of :data:`BUILD_CASE`'s 4 stages, stage -> rank; the ``max_norm``
and ``lr`` :data:`STEP` holds during the run). The last's 1.0 is above the gradient's norm, 0.09: no
clipping. On the V placement both uses of :data:`TIED` are on rank 0, and the learning rate is not 1: a step
that leaves it out fails there."""

TIED = ((0, 0), (3, 1))
"""Exercise 8.3's tie, (stage, layer) of each use: stage 0's first A and stage 3's last A are one (d, d)
matrix, as a language model's embedding and head often are (Press and Wolf, arXiv 1608.05859). Its gradient
is the sum of its two uses' gradients; each use's rank holds one of them."""


def optimizer_step(result: Any) -> Verdict:
    """Exercise 8.3: ``optimizer_step(rank, grads, params, all_sum)`` written by the learner, run on one
    thread per rank by lesson 8's ``lab.try_step``; ``result`` is ``{"error", "runs": {name: {"params",
    "want", "untied", "twice", "per_stage", "unclipped", "scaled", "no_lr", "calls"}}}`` (per stage the step,
    new - old, as NumPy leaves; None: a stage not returned; "calls": each rank's all_sum calls).
    Right when every stage's new parameters equal SGD on the whole model, the :data:`TIED` matrix's gradient
    the sum of its two uses', with the gradient clipped to the global norm :data:`STEP` ``["max_norm"]``,
    within :data:`STEP_TOLERANCE` (arXiv 2401.10241, section 4: the global norm needs every rank's gradient),
    and no rank called ``all_sum`` more than twice. A norm from the squares of each use instead of their
    sum's is 2% off in the scale here (the uses' gradients are given sharing a direction), and one leaving
    stage 0's biases out 8% (each bias's gradient is given twice its matrix's norm:
    :meth:`~zbpp_lite.course.bench.Lab.try_step`)."""
    hint = ("clipping bounds the length of the whole model's gradient, which no rank holds alone, and the "
            "tied matrix is one parameter: what must each rank contribute, in which order, and when must "
            "clipping leave a gradient as it is?")
    problem = _run_problem("8.3", result, "runs", "lab.try_step(optimizer_step)", "optimizer_step",
                           "your step", hint)
    if problem is not None:
        return problem

    def off(got, want):
        return max((_rel_diff(a, b) for g, w in zip(got, want) for a, b in zip(g or (), w)), default=0.0)

    near = lambda got, want: off(got, want) <= STEP_TOLERANCE  # noqa: E731
    (s0, l0), (s1, l1) = TIED
    wrong = {
        "untied": ("the tied matrix's two copies took different steps: each its own use's gradient.",
                   "a tied matrix is one parameter: its gradient is what both uses contribute. Which ranks "
                   "hold a use, and how do they learn each other's?"),
        "twice": ("the tied matrix's gradient was counted once per use in the global norm.",
                  "the norm is over parameters, and the tied matrix is one: which rank should count it?"),
        "uses": ("the global norm added each use's squares, not the squares of the tied matrix's gradient.",
                 "the tied matrix is one parameter with one gradient, the sum of the uses': square that "
                 "sum, not each use, and count it once."),
        "per_stage": ("each stage was clipped by its own norm.",
                      "the norm that clipping bounds is the whole model's, not a stage's: what do the "
                      "other ranks hold of it?"),
        "unclipped": ("the step was not clipped.", hint),
        "scaled": ("the gradient's norm was already under max_norm, yet your step scaled it.",
                   "clipping is a limit, not a target: what should it do to a gradient already within it?"),
        "no_lr": ("the step left out the learning rate, ex.STEP[\"lr\"] (not 1 in this run).",
                  "SGD moves each parameter by the learning rate times its clipped gradient."),
    }
    for name in STEP_RUNS:
        run = result["runs"].get(name)
        if run is None:
            return Verdict("8.3", False, f"no run with {name}.", hint)
        got = run["params"]
        missing = [s for s, g in enumerate(got) if g is None or len(g) != len(run["want"][s])]
        if missing:
            return Verdict("8.3", False, f"{name}: no new parameters for stage(s) {missing}.",
                           "return {stage: new [(A, c), ...]} for every stage in this rank's grads.")
        if near(got, run["want"]):
            most = max(run.get("calls", [2]))
            if most > 2:
                return Verdict("8.3", False, f"{name}: the step is right, but a rank called all_sum "
                               f"{most} times.", "each call waits for every rank: what can a rank add up on "
                               "its own before a call, and which sum must come first?")
            continue
        if _rel_diff(got[s0][2 * l0], got[s1][2 * l1]) > STEP_TOLERANCE:
            return Verdict("8.3", False, f"{name}: {wrong['untied'][0]}", wrong["untied"][1])
        for key, (what, why) in wrong.items():
            if key in run and near(got, run[key]):
                return Verdict("8.3", False, f"{name}: {what}", why)
        return Verdict("8.3", False, f"{name}: the new parameters differ from clipped SGD of the whole "
                       "model.", hint)
    return Verdict("8.3", True, "with one stage per rank and with two stages per rank, the tied matrix took "
                   "one step from both uses' gradients, and every stage took the step of the whole model, "
                   "clipped by the global norm (and left as it was when that norm was under max_norm).")


BLOCKING_CASES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v")
"""Exercise 8.4's schedules, each on 4 ranks with 8 microbatches (ZB-V: two stages a rank, the V)."""


def _stuck(schedule: Schedule) -> list[str] | None:
    """Where each rank waits forever if a send blocks until the receiver's matching take (a rendezvous, as
    MPI's ``MPI_Ssend``), each rank walking its list as lesson 8's loop does (take the input, run, send to
    the next stage's rank, its own too: the loop puts into its own inbox where the V turns, a send no
    later take of its own can meet); stepped while any rank can move. None when every rank finishes, else
    per rank what it is blocked at, as text."""
    S, placement, lists = schedule.num_stages, schedule.placement, []
    for row in schedule.actions:
        ops = []   # ("take", key, text), ("run", None, text), ("send", key, text, to rank); key: what moves
        for a in row:
            kind, j = "F" if a.kind == "F" else "B", a.microbatch
            source, to = producer_stage(kind, a.stage), consumer_stage(kind, a.stage)
            if a.kind != "W" and 0 <= source < S:
                ops.append(("take", (kind, source, j), f"{kind}{j} from rank {placement[source]}"))
            ops.append(("run", None, a.text))
            if a.kind != "W" and 0 <= to < S:
                ops.append(("send", (kind, a.stage, j), f"{kind}{j} to rank {placement[to]}", placement[to]))
        lists.append(ops)
    at = [0] * len(lists)
    now = lambda r: lists[r][at[r]] if at[r] < len(lists[r]) else None  # noqa: E731
    moved = True
    while moved:
        moved = False
        for r in range(len(lists)):
            op = now(r)
            if op is not None and op[0] == "run":
                at[r], moved = at[r] + 1, True
            elif op is not None and op[0] == "send":
                taker = now(op[3])
                if taker is not None and taker[:2] == ("take", op[1]):
                    at[r], at[op[3]], moved = at[r] + 1, at[op[3]] + 1, True
    if all(now(r) is None for r in range(len(lists))):
        return None
    return [f"rank {r} " + ("done" if now(r) is None else f"{now(r)[0]}s {now(r)[2]}")
            for r in range(len(lists))]


def blocking_sends(answer: Any) -> Verdict:
    """Exercise 8.4 (predicted): the schedules of :data:`BLOCKING_CASES` (4 ranks, 8 microbatches) that would
    wait forever if a send blocked until the receiver's matching take (:func:`_stuck`), given as a set (or
    list) of their names. Any set of those names is a real attempt, which unlocks the reveal."""
    hint = ("walk two neighbouring ranks of each schedule: is there a moment when each is sending to the "
            "other, so that neither reaches its take?")
    if _unanswered(answer):
        return Verdict("8.4", False, "no answer yet: replace ... with the names of the schedules that would "
                       "wait forever.")
    names = _settled(answer)
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or \
            not all(isinstance(n, str) for n in names):
        return Verdict("8.4", False, f"expected a set of names such as {{'gpipe'}}, got {_shown(answer)}.",
                       hint, attempt=False)
    unknown = sorted(set(names) - set(BLOCKING_CASES))
    if unknown:
        return Verdict("8.4", False, f"{unknown[0]!r} is not one of {', '.join(BLOCKING_CASES)}.", hint,
                       attempt=False)
    stuck = {n for n in BLOCKING_CASES if _stuck(build_schedule(n, 4, 8)) is not None}
    if set(names) != stuck:
        return Verdict("8.4", False, "at least one schedule is on the wrong side.", hint)
    return Verdict("8.4", True, "GPipe alone finishes: each rank sends only down, then only up, so every "
                   "send meets the take next in its receiver's list. In 1F1B, ZB-H1 and ZB-H2 the last rank "
                   "sends B0 up while the rank before it sends its next F down; in ZB-V the last rank, where "
                   "the V turns, sends F0 to itself and waits for a take of its own that comes later in its "
                   "list. Hence sends that never wait (PyTorch's isend, our inbox).")


def reveal_blocking() -> None:
    """Exercise 8.4's reveal: for each schedule of :data:`BLOCKING_CASES`, whether it finishes with blocking
    sends, or what each rank waits at forever (:func:`_stuck`)."""
    for name in BLOCKING_CASES:
        stuck = _stuck(build_schedule(name, 4, 8))
        print(f"{name}: " + ("finishes" if stuck is None else "waits forever: " + "; ".join(stuck)))


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "8.1": stage_split, "8.2": pipeline_run, "8.3": optimizer_step, "8.4": blocking_sends
}
"""Lesson 8's exercises by id -> check."""

REVEALS: dict[str, Callable[[Any], Any]] = {"8.4": lambda answer: reveal_blocking()}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "BUILD_CASE", "BUILD_TOLERANCE", "stage_split", "PIPELINE_RUNS",
    "gradient_problem",
    "pipeline_run", "STEP", "STEP_TOLERANCE", "STEP_RUNS", "TIED", "optimizer_step", "BLOCKING_CASES",
    "blocking_sends", "reveal_blocking", "EXERCISES", "REVEALS"
]
