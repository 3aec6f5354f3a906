"""Lessons 08 and 09's checks tell a right pipeline from a wrong one.

The lesson's own code runs here: its cells up to "## Exercises" (the model, ``stage_apply`` with its
zero probes, the test bench ``lab``: ``zbpp_lite.course.bench.Lab``, the threads and inboxes it runs on)
and the definitions of its Solutions cells (our F, B, W, ``rank_loop`` and ``optimizer_step``), executed
from ``notebooks/08_build_a_pipeline.md``; lesson 9's the same way, for its rows and SPMD step. The right
builds pass every check; each wrong one below, a mistake a learner makes, fails its check with a hint
that names it: W reading another microbatch's dz, a W computed during its B, a loop that walks its own
order instead of the schedule's, a backward started from 1 instead of 1/m, W's product transposed, B
running the layers again, a B jax.jit cannot compile, a prediction of the bytes B keeps copied from
another pattern, a step clipped stage by stage or not at all or with one all-reduce per stage; a row
counted busy through its last read, or ZB-H1's row counts given for every schedule; an SPMD step with work
outside its switch or a W that reruns F; a V tick
whose first and last test the rank alone, or that stores every arrival in chunk 0.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jupytext
import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite import course as ex

LESSON = Path(__file__).parent.parent / "notebooks" / "08_build_a_pipeline.md"


def _sections(nb) -> tuple[list[str], list[str]]:
    """The code of the cells before "## Exercises", and of those after "## Solutions" up to their check
    (``verdict =``: the definitions)."""
    from IPython.core.inputtransformer2 import TransformerManager

    to_python = TransformerManager().transform_cell  # the set-up cell's %pip (run on Colab only)
    before, solutions, part = [], [], "before"
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            heads = [line for line in cell.source.splitlines() if line.startswith("## ")]
            if "## Exercises" in heads:
                part = "exercises"
            elif "## Solutions" in heads:
                part = "solutions"
            elif heads and part == "solutions":
                part = "after"
        elif cell.cell_type == "code" and part == "before":
            before.append(to_python(cell.source))
        elif cell.cell_type == "code" and part == "solutions":
            solutions.append(to_python(cell.source).split("verdict =")[0])
    return before, solutions


def _namespace(path: Path, name: str) -> dict:
    """A lesson's namespace after its cells before "## Exercises" and its Solutions' definitions."""
    flags = os.environ.get("XLA_FLAGS")
    ns: dict = {"__name__": name}
    before, solutions = _sections(jupytext.read(path))
    try:
        for source in before + solutions:
            exec(compile(source, str(path), "exec"), ns)
    finally:
        if flags is not None:
            os.environ["XLA_FLAGS"] = flags
    return ns


@contextlib.contextmanager
def _replaced(ns: dict, path: Path, name: str, edit):
    """Within the block, ``ns[name]`` is the lesson's Solutions ``def name`` with its source changed by
    ``edit`` (the changed source is yielded); the right one is put back after."""
    _, solutions = _sections(jupytext.read(path))
    source = next(c for c in solutions if f"def {name}" in c)
    wrong = edit(source)
    assert wrong != source
    right = ns[name]
    try:
        exec(compile(wrong, f"{name}_wrong", "exec"), ns)
        yield wrong
    finally:
        ns[name] = right


@pytest.fixture(scope="module")
def lesson():
    """The lesson's namespace after its set-up, scaffolding and Solutions cells."""
    return _namespace(LESSON, "lesson08")


def test_the_right_build_passes_every_check(lesson):
    lab = lesson["lab"]
    assert ex.stage_split(lab.try_stage(lesson["F"], lesson["B"], lesson["W"]))
    assert ex.pipeline_run(lab.try_pipeline(lesson["rank_loop"]))
    assert ex.optimizer_step(lab.try_step(lesson["optimizer_step"]))


def test_w_with_another_microbatchs_output_gradient_fails(lesson):
    """W pairs its microbatch's layer inputs with the dz of the rank's latest B. In
    1F1B W runs right after its own B, so nothing shows; ZB-H1 delays W and the check catches it."""
    F, B, W = lesson["F"], lesson["B"], lesson["W"]
    latest = threading.local()  # one rank per thread, one stage per rank

    def B_noting(saved, dy):
        dx, for_w = B(saved, dy)
        latest.dz = for_w[1]
        return dx, for_w

    def W_wrong(for_w):
        return W((for_w[0], latest.dz))

    lesson.update(B=B_noting, W=W_wrong)
    try:
        verdict = ex.pipeline_run(lesson["lab"].try_pipeline(lesson["rank_loop"]))
    finally:
        lesson.update(F=F, B=B, W=W)
    assert not verdict and verdict.hint
    assert str(verdict).startswith("Exercise 8.2: not yet. zb-h1: the gradients differ"), str(verdict)


def test_a_loop_that_ignores_the_schedule_order_fails(lesson):
    """All F first, then the backwards, then the W's (GPipe's order, which never deadlocks): the
    gradients are right, the order is not the schedule's."""
    rank_loop = lesson["rank_loop"]
    order = {"F": 0, "B": 1, "BW": 1, "W": 2}

    def own_order(rank, actions, *args):
        return rank_loop(rank, sorted(actions, key=lambda a: (order[a.kind], a.microbatch)), *args)

    verdict = ex.pipeline_run(lesson["lab"].try_pipeline(own_order))
    assert not verdict and verdict.hint
    assert "the schedule says" in str(verdict), str(verdict)


def test_a_loop_sending_to_the_neighbour_rank_instead_of_the_placements_fails(lesson):
    """Right on 1F1B and ZB-H1 (stage s on rank s); ZB-V's V keeps stages 1 and 2 on one rank."""
    edit = lambda src: src.replace("placement[s + 1]", "rank + 1").replace("placement[s - 1]", "rank - 1")  # noqa: E731
    with _replaced(lesson, LESSON, "rank_loop", edit) as wrong:
        assert wrong.count("rank + 1") == 1 and wrong.count("rank - 1") == 1
        result = lesson["lab"].try_pipeline(lesson["rank_loop"])
    assert set(result["runs"]) == {"1f1b", "zb-h1", "zb-h2"} and result["error"]   # fails only on ZB-V
    verdict = ex.pipeline_run(result)
    assert not verdict and verdict.hint and "placement" in verdict.hint, str(verdict)
    assert lesson["placement"] == list(range(4))                           # try_pipeline put it back


def test_a_loop_whose_gradients_come_from_elsewhere_fails_on_what_it_sent(lesson):
    """Round 33's evasion: every rank walks its actions in order, waits for its inputs and calls W once per
    W or BW, but sends tokens, not activations, and the gradients are the whole model's jax.grad. With rank
    0 returning every stage's it is refused for the stages it does not hold; with each rank returning its
    own, for what it sent (Lab.moved checks each value crossing the ranks against the stage boundaries');
    sending the true boundary values (round 35), for W calls that compute no microbatch's gradient."""
    import time
    import types

    import jax
    from zbpp_lite.course import bench

    lab, S, zb = lesson["lab"], 4, lesson["zb"]
    whole = jax.grad(bench.mlp_loss)(lab.params, lab.X, lab.Y)
    stage_grads = {s: list(whole[2 * s: 2 * s + 2]) for s in range(S)}
    x = jax.device_put(lab.inputs_mb[0], lab.devices[lab.placement[S - 1]])   # one for_w of the right form,
    for_w = lesson["B"](lesson["F"](S - 1, x, lab.targets_mb[0])[1], 1.0)[1]    # for dummy W calls

    def elsewhere(one_rank_returns_all, true_values=False):
        def rank_loop(rank, actions, inboxes, events, t0):
            placement, saved = lab.placement, {}   # F, B, W: the lesson's, read as its globals (below)
            for a in actions:
                s, j = a.stage, a.microbatch
                if a.kind == "F" and s > 0:
                    inboxes[rank].take(("F", s - 1, j))
                if a.kind in ("B", "BW") and s < S - 1:
                    inboxes[rank].take(("B", s + 1, j))
                start = time.perf_counter()
                dummy = jax.device_put(lab.inputs_mb[0], lab.devices[rank])   # F and B run, on dummies
                if a.kind == "F":
                    saved[s, j] = F(s, dummy, lab.targets_mb[0] if s == S - 1 else None)[1]  # noqa: F821
                if a.kind in ("B", "BW"):
                    B(saved.pop((s, j)), 1.0 / 8 if s == S - 1 else dummy)  # noqa: F821
                if a.kind in ("W", "BW"):
                    W(for_w)  # noqa: F821
                events.append(zb.Event(rank, a, start - t0, time.perf_counter() - t0))
                sent = lab.boundaries() if true_values else {}
                if a.kind == "F" and s < S - 1:
                    inboxes[placement[s + 1]].put(("F", s, j), sent.get(("F", s, j), 0.0))
                if a.kind in ("B", "BW") and s > 0:
                    inboxes[placement[s - 1]].put(("B", s, j), sent.get(("B", s, j), 0.0))
            if one_rank_returns_all:
                return stage_grads if rank == 0 else {}
            return {s: g for s, g in stage_grads.items() if placement[s] == rank}
        return types.FunctionType(rank_loop.__code__, lesson, "rank_loop", None, rank_loop.__closure__)

    for all_on_0, true, word in ((True, False, "rank 0 returned gradients for stage 1"),
                                 (False, False, "the value sent under ('F', 0, 0) is not stage 0's output"),
                                 (False, True, "did not return that microbatch's weight gradient")):
        result = lab.try_pipeline(elsewhere(all_on_0, true))
        assert all(run["grad_error"] <= ex.BUILD_TOLERANCE for run in result["runs"].values())
        verdict = ex.pipeline_run(result)
        assert not verdict and word in verdict.message, str(verdict)
    right = lab.try_pipeline(lesson["rank_loop"])["runs"]["zb-v"]["moved"]
    assert right == {"stray": [], "missing": [], "wrong": [], "scale": None}, right


def test_round_35s_wrong_answers_to_8_1_and_8_3_fail_and_its_right_variants_pass(lesson):
    """Round 35: a B that computes the weight gradients and drops them (XLA's flops leave them out; the
    traced products do not); a loop whose B runs F again, or whose W runs B again (the learner's F, B and W
    are counted per action); a NaN among the gradients; a W computed during B passed through
    functools.partial, all refused. A backward started from 1 and divided by m at the end is refused with
    the factor named; a right loop reading W as a default argument passes."""
    import functools

    lab, ns = lesson["lab"], lesson
    exec(compile("""
def F_all(s, x, target=None):
    f = lambda layers, x, probes: stage_apply(layers, x, probes, target)
    y, pullback, layer_inputs = jax.vjp(f, stage_params[s], x, zero_probes(s, x), has_aux=True)
    return y, (pullback, layer_inputs)

def B_all(saved, dy):
    pullback, layer_inputs = saved
    dlayers, dx, dz = pullback(dy)          # weight gradients computed here, and dropped
    return dx, (layer_inputs, dz)
""", "round35", "exec"), ns)
    verdict = ex.stage_split(lab.try_stage(ns["F_all"], ns["B_all"], ns["W"]))
    assert not verdict and "B runs 4 matrix products where the input gradient takes 2" in verdict.message, str(verdict)
    f_call, b_call = ("out, saved[s, j] = F(s, x, targets_mb[j] if s == S - 1 else None)",
                      "out, for_w[s, j] = B(saved.pop((s, j)), dy)")
    rerun_f = lambda src: src.replace(f_call, "out, _ = F(s, x, targets_mb[j] if s == S - 1 else None); saved[s, j] = x").replace(  # noqa: E731,E501
        b_call, "out, for_w[s, j] = B(F(s, saved.pop((s, j)), targets_mb[j] if s == S - 1 else None)[1], dy)")
    rerun_b = lambda src: src.replace(b_call, "out, _ = B(saved[s, j], dy); for_w[s, j] = (saved.pop((s, j)), dy)").replace(  # noqa: E731,E501
        "g = W(for_w.pop((s, j)))", "g = W(B(*for_w.pop((s, j)))[1])")
    from_one = lambda src: src.replace("jnp.float32(1 / m)", "jnp.float32(1.0)").replace(  # noqa: E731
        "    return grads\n", "    return {s: jax.tree.map(lambda a: a / m, g) for s, g in grads.items()}\n")
    nan_bias = lambda src: src.replace(  # noqa: E731
        "    return grads\n", "    return {s: [(A, c * jnp.nan if s == 1 else c) for A, c in g] for s, g in grads.items()}\n")
    call, later = "B(saved.pop((s, j)), dy)\n", "g = W(for_w.pop((s, j)))\n"
    w_in_b = lambda src: src.replace(call, call + "            for_w[s, j] = W(for_w[s, j])\n").replace(  # noqa: E731
        later, "g = for_w.pop((s, j))\n")
    for edit, word, wrap in ((rerun_f, "your F ran 64 times for 32 F actions", None),
                             (rerun_b, "your B ran 64 times for 32 B and BW actions", None),
                             (from_one, "is 8 times it", None), (nan_bias, "not numbers", None),
                             (w_in_b, "outside its W and BW actions", functools.partial)):
        with _replaced(lesson, LESSON, "rank_loop", edit):
            loop = wrap(ns["rank_loop"]) if wrap else ns["rank_loop"]
            verdict = ex.pipeline_run(lab.try_pipeline(loop))
        assert not verdict and word in verdict.message, (word, str(verdict))
    with_default = lambda src: src.replace("def rank_loop(rank, actions, inboxes, events, t0):",  # noqa: E731
                                           "def rank_loop(rank, actions, inboxes, events, t0, W=W):")
    with _replaced(lesson, LESSON, "rank_loop", with_default):
        assert ex.pipeline_run(lab.try_pipeline(ns["rank_loop"]))


def test_round_36s_right_loops_pass_and_its_wrong_ones_fail(lesson):
    """Round 36, exercise 8.2: right loops in other styles pass (adding later W results into the list the
    first W returned: the check keeps a copy of each; a loop a factory made, reading W from its closure;
    keys naming the receiving stage). A loop keeping each stage's pending W work last in, first out (each
    W computes another microbatch's gradient, the sums alike) is refused, and so is one whose F, B and W
    fail exercise 8.1 (B taking the weight gradients, W passing them on); a loop returning a list gets a
    verdict."""
    lab, ns = lesson["lab"], lesson
    _, solutions = _sections(jupytext.read(LESSON))
    loop = next(c for c in solutions if "def rank_loop" in c)
    acc = "            grads[s] = g if s not in grads else jax.tree.map(jnp.add, grads[s], g)\n"
    in_place = loop.replace(acc, (
        "            if s not in grads:\n"
        "                grads[s] = g\n"
        "            else:\n"
        "                for k, (dA, dc) in enumerate(g):\n"
        "                    A0, c0 = grads[s][k]\n"
        "                    grads[s][k] = (A0 + dA, c0 + dc)\n"))
    factory = ("def make_loop(F, B, W):\n" + "\n".join("    " + line for line in loop.splitlines())
               + "\n    return rank_loop\nrank_loop = make_loop(F, B, W)\n")
    by_receiver = loop.replace('take(("F", s - 1, j))', 'take(("F", s, j))').replace(
        'put(("F", s, j)', 'put(("F", s + 1, j)').replace('take(("B", s + 1, j))', 'take(("B", s, j))').replace(
        'put(("B", s, j)', 'put(("B", s - 1, j)')
    lifo = loop.replace("out, for_w[s, j] = B(saved.pop((s, j)), dy)",
                        "out, fw = B(saved.pop((s, j)), dy); for_w.setdefault(s, []).append(fw)").replace(
        "g = W(for_w.pop((s, j)))", "g = W(for_w[s].pop())")
    as_list = loop.replace("    return grads\n", "    return list(grads.items())\n")
    assert len({in_place, factory, by_receiver, lifo, as_list, loop}) == 6
    wrong_split = (
        "def F(s, x, target=None):\n"
        "    f = lambda layers, x, probes: stage_apply(layers, x, probes, target)\n"
        "    y, pullback, _ = jax.vjp(f, stage_params[s], x, zero_probes(s, x), has_aux=True)\n"
        "    return y, pullback\n"
        "def B(saved, dy):\n"
        "    dlayers, dx, _ = saved(dy)\n"
        "    return dx, dlayers\n"
        "def W(for_w):\n"
        "    return [tuple(pair) for pair in for_w]\n")
    plain = {k: ns[k] for k in ("F", "B", "W")}
    try:
        for source, word in ((in_place, None), (factory, None), (by_receiver, None),
                             (lifo, "did not return that microbatch's weight gradient"),
                             (as_list, "no gradients")):
            exec(compile(source, "round36", "exec"), ns)
            verdict = ex.pipeline_run(lab.try_pipeline(ns["rank_loop"]))
            assert bool(verdict) is (word is None) and (word is None or word in verdict.message), str(verdict)
        exec(compile(loop + wrong_split, "round36", "exec"), ns)
        verdict = ex.pipeline_run(lab.try_pipeline(ns["rank_loop"]))
        assert not verdict and "do not pass exercise 8.1 yet" in verdict.message, str(verdict)
    finally:
        ns.update(plain)
        exec(compile(loop, "round36", "exec"), ns)
    assert ex.pipeline_run(lab.try_pipeline(ns["rank_loop"]))


def test_a_loop_that_computes_w_during_b_fails(lesson):
    """W called right after B, its result held until the W action only adds it: the order of the events
    and the gradients are right, the weight gradient was not deferred, and the check sees when W ran."""
    call, later = "B(saved.pop((s, j)), dy)\n", "g = W(for_w.pop((s, j)))\n"
    edit = lambda src: src.replace(call, call + "            for_w[s, j] = W(for_w[s, j])\n").replace(  # noqa: E731
        later, "g = for_w.pop((s, j))\n")
    with _replaced(lesson, LESSON, "rank_loop", edit) as wrong:
        assert wrong.count("= W(") == 1
        result = lesson["lab"].try_pipeline(lesson["rank_loop"])
    assert all(run["grad_error"] <= ex.BUILD_TOLERANCE for run in result["runs"].values())   # gradients right
    verdict = ex.pipeline_run(result)
    assert not verdict and "outside its W and BW actions" in str(verdict), str(verdict)
    assert str(verdict).startswith("Exercise 8.2: not yet. zb-h1: rank "), str(verdict)  # 1F1B's BW holds both


def test_a_loop_whose_last_stage_starts_from_one_instead_of_one_over_m_fails(lesson):
    """The whole loss is the mean of the m microbatch losses: a backward started from 1 gives every
    gradient m times jax.grad's, and the check names that factor."""
    with _replaced(lesson, LESSON, "rank_loop", lambda src: src.replace("jnp.float32(1 / m)", "jnp.float32(1.0)")):
        verdict = ex.pipeline_run(lesson["lab"].try_pipeline(lesson["rank_loop"]))
    assert not verdict and "8 times jax.grad's" in str(verdict) and "mean" in verdict.hint, str(verdict)


def test_the_gradient_hints_name_the_stage_where_the_backward_goes_wrong():
    run = lambda errors, scale=1.0: {"grad_error": max(errors), "stage_errors": errors, "scale": scale}  # noqa: E731
    assert ex.gradient_problem("9.3", "zb-h1", run([1e-6] * 4), 8) is None
    verdict = ex.gradient_problem("9.3", "zb-h1", run([0.3, 0.2, 1e-6, 1e-6]), 8)
    assert not verdict and "stages 2 to 3 are right, stage 1 is not" in str(verdict), str(verdict)
    assert "1/8" in str(ex.gradient_problem("8.2", "1f1b", run([0.9] * 4, 1 / 8), 8))
    assert "stage(s) [3]" in str(ex.gradient_problem("8.2", "1f1b", run([0.0, 0.0, 0.0, float("inf")]), 8))
    assert "relative difference" in str(ex.gradient_problem("8.2", "1f1b", run([0.3, 1e-6, 0.3, 1e-6]), 8))


def test_a_loop_that_starts_the_clock_before_its_inputs_arrive_fails(lesson):
    """The wait for an input is not part of the action: an event that starts before it is caught."""
    clock, first = "        start = time.perf_counter()\n", "        s, j = a.stage, a.microbatch\n"
    with _replaced(lesson, LESSON, "rank_loop", lambda src: src.replace(clock, "").replace(first, first + clock)) as wrong:
        assert wrong.count(clock) == 1 and wrong.index(clock) < wrong.index("take(")
        verdict = ex.pipeline_run(lesson["lab"].try_pipeline(lesson["rank_loop"]))
    assert not verdict and "started before" in str(verdict), str(verdict)


def test_a_b_jax_jit_cannot_compile_fails_instead_of_escaping_the_flop_count(lesson):
    """A NumPy round trip runs eagerly but not under jax.jit: its flops cannot be counted, so a B that also
    computed the weight gradients would pass unseen; the check refuses it and says why."""
    F, B, W = lesson["F"], lesson["B"], lesson["W"]

    def B_numpy(saved, dy):
        dx, for_w = B(saved, dy)
        return jnp.asarray(np.asarray(dx)), for_w

    verdict = ex.stage_split(lesson["lab"].try_stage(F, B_numpy, W))
    assert not verdict and "jax.jit could not compile B" in str(verdict), str(verdict)
    assert ex.stage_split(lesson["lab"].try_stage(F, B, W))


def test_a_transposed_weight_gradient_and_a_recomputing_b_fail(lesson):
    F, B, W = lesson["F"], lesson["B"], lesson["W"]

    def W_transposed(for_w):
        return [(dA.T, dc) for dA, dc in W(for_w)]

    verdict = ex.stage_split(lesson["lab"].try_stage(F, B, W_transposed))
    assert not verdict and "transpose" in verdict.hint, str(verdict)

    stage_apply, zero_probes = lesson["stage_apply"], lesson["zero_probes"]
    import jax

    def F_keeping_input(s, x, target=None):  # keeps x only, so B must run the layers again
        y, _ = stage_apply(lesson["stage_params"][s], x, zero_probes(s, x), target)
        return y, (s, x, target)

    def B_recomputing(saved, dy):
        s, x, target = saved
        f = lambda x, probes: stage_apply(lesson["stage_params"][s], x, probes, target)  # noqa: E731
        _, pullback, layer_inputs = jax.vjp(f, x, zero_probes(s, x), has_aux=True)
        dx, dz = pullback(dy)
        return dx, (layer_inputs, dz)

    verdict = ex.stage_split(lesson["lab"].try_stage(F_keeping_input, B_recomputing, W))
    assert not verdict and "ran the stage's layers again" in str(verdict), str(verdict)


def test_a_w_that_runs_the_layers_again_outside_stage_apply_fails(lesson):
    """Round 31's hole: B hands W the stage, its input and dy, and W runs the layers again inline (not
    through the counted stage_apply) under jax.vjp with respect to the weights: right gradients, few bytes
    held, refused by W's flops."""
    import jax

    F, B = lesson["F"], lesson["B"]

    def F_also_x(s, x, target=None):
        y, saved = F(s, x, target)
        return y, (saved, s, x, target)

    def B_handing_dy(saved, dy):
        dx, _ = B(saved[0], dy)
        return dx, (*saved[1:], dy)

    def W_again(for_w):
        s, x, target, dy = for_w

        def run(layers):
            h = x
            for A, c in layers:
                h = jnp.tanh(h @ A + c)
            return h if target is None else jnp.mean((h - target) ** 2)
        _, pullback = jax.vjp(run, lesson["stage_params"][s])
        return [tuple(layer) for layer in pullback(dy)[0]]

    verdict = ex.stage_split(lesson["lab"].try_stage(F_also_x, B_handing_dy, W_again))
    assert not verdict and "it runs the layers again" in verdict.message, str(verdict)


def test_a_b_that_runs_the_layers_again_outside_stage_apply_fails(lesson):
    """Round 33's hole: F keeps only its input, and B runs the layers again inline (not through the counted
    stage_apply) under jax.vjp: right gradients; B's flops, with what F kept as B's arguments (XLA folded
    the rerun forward away when they were constants), are 2x the input gradient's."""
    import jax

    W = lesson["W"]

    def F_input_only(s, x, target=None):
        return lesson["F"](s, x, target)[0], (s, x, target)

    def B_again(saved, dy):
        s, x, target = saved

        def run(x, probes):
            inputs, h = [], x
            for (A, c), e in zip(lesson["stage_params"][s], probes):
                inputs.append(h)
                h = jnp.tanh(h @ A + c + e)
            return (h if target is None else jnp.mean((h - target) ** 2)), inputs
        _, pullback, inputs = jax.vjp(run, x, lesson["zero_probes"](s, x), has_aux=True)
        dx, dz = pullback(dy)
        return dx, (inputs, dz)

    verdict = ex.stage_split(lesson["lab"].try_stage(F_input_only, B_again, W))
    assert not verdict and "or runs the layers again" in verdict.message, str(verdict)


def test_a_b_that_also_computes_the_weight_gradients_fails(lesson):
    import jax

    stage_apply, zero_probes = lesson["stage_apply"], lesson["zero_probes"]

    def F_all(s, x, target=None):  # pullback with respect to the parameters too: B does W's products
        f = lambda layers, x, probes: stage_apply(layers, x, probes, target)  # noqa: E731
        y, pullback, _ = jax.vjp(f, lesson["stage_params"][s], x, zero_probes(s, x), has_aux=True)
        return y, pullback

    def B_all(saved, dy):
        dlayers, dx, _ = saved(dy)
        return dx, dlayers

    def W_stashed(for_w):  # returns what B already computed
        return [tuple(pair) for pair in for_w]

    verdict = ex.stage_split(lesson["lab"].try_stage(F_all, B_all, W_stashed))
    assert not verdict and "computes the weight gradients too" in str(verdict), str(verdict)


def test_a_b_handing_w_more_than_x_and_dz_fails(lesson):
    """8.1 counts what W needs, each layer's input and dz: a B that also hands W its pullback (which holds
    every array F kept) passes the gradient checks but must fail, naming the bytes."""
    F, B, W = lesson["F"], lesson["B"], lesson["W"]

    def B_with_pullback(saved, dy):
        dx, for_w = B(saved, dy)
        return dx, (*for_w, saved[0])

    def W_ignoring(for_w):
        return W(for_w[:2])

    verdict = ex.stage_split(lesson["lab"].try_stage(F, B_with_pullback, W_ignoring))
    needs = 2 * 64 * (256 + 256) * 4                                # 2 layers: x and dz, (64, 256) float32
    assert not verdict and f"W needs each layer's input x and dz, {needs:,} bytes" in str(verdict), str(verdict)


def test_a_right_b_that_hands_w_a_python_number_passes(lesson):
    """What B hands W is weighed by its arrays: a layer count beside x and dz holds no bytes (it raised
    AttributeError, blamed on the learner's functions)."""
    F, B = lesson["F"], lesson["B"]

    def B_counting(saved, dy):
        dx, (layer_inputs, dz) = B(saved, dy)
        return dx, (layer_inputs, dz, len(layer_inputs))

    def W_counting(for_w):
        layer_inputs, dz, n = for_w
        return [(layer_inputs[i].T @ dz[i], dz[i].sum(0)) for i in range(n)]

    verdict = ex.stage_split(lesson["lab"].try_stage(F, B_counting, W_counting))
    assert verdict, str(verdict)


def test_blocking_sends_wait_forever_on_every_schedule_but_gpipe():
    """Exercise 8.4: with a send that waits for the receiver's take, GPipe finishes (a rank sends only down,
    then only up), and so does 1F1B with one microbatch (no steady state); 1F1B with two, ZB-H1, ZB-H2 and
    ZB-V wait forever: the last rank sends B0 up while the rank before sends its next F down (ZB-V: the
    last rank puts F0 into its own inbox, where the V turns, and its take comes later in its list). The right set passes; a near miss is a real attempt, told neither which nor how many."""
    from zbpp_lite.course.lesson8 import _stuck

    assert _stuck(zb.build_schedule("gpipe", 4, 8)) is None and _stuck(zb.build_schedule("1f1b", 4, 1)) is None
    assert _stuck(zb.build_schedule("1f1b", 4, 8))[2:] == ["rank 2 sends F1 to rank 3", "rank 3 sends B0 to rank 2"]
    assert _stuck(zb.build_schedule("zb-v", 4, 8))[3] == "rank 3 sends F0 to rank 3"   # to itself, where the V turns
    assert _stuck(zb.build_schedule("1f1b", 4, 2)) is not None
    assert ex.blocking_sends({"1f1b", "zb-h1", "zb-h2", "zb-v"}) and ex.blocking_sends(["zb-v", "1f1b", "zb-h2", "zb-h1"])
    near = ex.blocking_sends({"1f1b", "zb-h1", "zb-h2"})      # ZB-V's V forgotten
    assert not near and near.attempt and near.message == "at least one schedule is on the wrong side.", str(near)
    assert not ex.blocking_sends({"gpipe", "dualpipe"}).attempt


def test_a_step_that_unties_miscounts_or_skips_a_sum_fails_by_name(lesson):
    import jax
    import jax.numpy as jnp

    right, lab = lesson["optimizer_step"], lesson["lab"]
    sq = lambda a: float(jnp.sum(a * a))  # noqa: E731
    leaves = jax.tree_util.tree_leaves

    def sgd(scale, params, grads):
        return {s: jax.tree_util.tree_map(lambda w, g: w - ex.STEP["lr"] * scale * g, params[s], grads[s])
                for s in grads}

    def clipped(norm_sq, params, grads):
        return sgd(min(1.0, ex.STEP["max_norm"] / norm_sq ** 0.5), params, grads)

    def tie(grads, all_sum):   # the right first sum, and the grads with the tied gradient in both uses
        tied = all_sum(sum((grads[s][k][0] for s, k in ex.TIED if s in grads), 0.0))
        return tied, {s: [(tied if (s, k) in ex.TIED else A, c) for k, (A, c) in enumerate(g)] for s, g in grads.items()}

    def untied(rank, grads, params, all_sum):   # stop 60's answer: each use its own gradient
        return clipped(all_sum(sum(sq(a) for g in grads.values() for a in leaves(g))), params, grads)

    def twice(rank, grads, params, all_sum):   # the tied gradient counted by both of its ranks
        _, summed = tie(grads, all_sum)
        return clipped(all_sum(sum(sq(a) for g in summed.values() for a in leaves(g))), params, summed)

    def skips(rank, grads, params, all_sum):   # a rank with no use skips the first sum
        return right(rank, grads, params, all_sum if any(s in grads for s, _ in ex.TIED) else
                     lambda x, calls=[]: calls.append(x) or (x if len(calls) > 1 else all_sum(x)))

    def per_stage(rank, grads, params, all_sum):   # each stage clipped by its own norm
        return {s: clipped(sum(sq(a) for a in leaves(grads[s])), {s: params[s]}, {s: grads[s]})[s] for s in grads}

    def unclipped(rank, grads, params, all_sum):
        _, summed = tie(grads, all_sum)
        all_sum(0.0)
        return sgd(1.0, params, summed)

    def always_scaled(rank, grads, params, all_sum):   # max_norm / norm without min(1, ...): scales up too
        tied, summed = tie(grads, all_sum)
        mine = sum(sq(a) for s, g in summed.items() for k, layer in enumerate(g) for a in layer[(s, k) in ex.TIED:])
        return sgd(ex.STEP["max_norm"] / (all_sum(mine) + sq(tied)) ** 0.5, params, summed)

    def uses(rank, grads, params, all_sum):   # the tie summed for the step, but each use's squares in the norm
        _, summed = tie(grads, all_sum)
        return clipped(all_sum(sum(sq(a) for g in grads.values() for a in leaves(g))), params, summed)

    def no_biases(rank, grads, params, all_sum):   # round 33: stage 0's two biases left out of the norm
        tied, summed = tie(grads, all_sum)
        mine = sum(sq(a) for s, g in summed.items() for k, (A, c) in enumerate(g)
                   for a in (((c,) if s else ()) if (s, k) in ex.TIED else ((A, c) if s else (A,))))
        return clipped(all_sum(mine) + sq(tied), params, summed)

    def three_sums(rank, grads, params, all_sum):   # right values, one more all-reduce
        all_sum(0.0)
        return right(rank, grads, params, all_sum)

    def no_lr(rank, grads, params, all_sum):   # round 45: the learning rate left out (not 1 in one run)
        new = right(rank, grads, params, all_sum)
        return {s: jax.tree_util.tree_map(lambda n, o: o + (n - o) / ex.STEP["lr"], new[s], params[s]) for s in new}

    lab.all_sum_wait = 2.0
    try:
        for answer, word in ((untied, "different steps"), (twice, "once per use"),
                             (skips, "never called it"), (per_stage, "different steps"),
                             (unclipped, "not clipped"), (always_scaled, "already under max_norm"),
                             (uses, "each use's squares"), (no_biases, "differ from clipped SGD"),
                             (three_sums, "called all_sum 3 times"), (no_lr, "learning rate")):
            verdict = ex.optimizer_step(lab.try_step(answer))
            assert not verdict and verdict.hint and word in str(verdict), (answer.__name__, str(verdict))
    finally:
        lab.all_sum_wait = type(lab).all_sum_wait
    assert ex.optimizer_step(lab.try_step(right))


@pytest.mark.parametrize("key", ["8.1", "8.2", "8.3", "8.4"])
@pytest.mark.parametrize("junk", [..., None, "many", [1, "x"], {"cases": []}], ids=["ellipsis", "none", "word", "list", "empty"])
def test_no_answer_or_nonsense_is_not_yet_and_raises_nothing(key, junk):
    verdict = ex.EXERCISES[key](junk)
    assert not verdict.ok
    if junk is ... or junk is None:   # no answer yet: no hint either (course.checks.Verdict)
        assert verdict.message.startswith("no answer yet") and not verdict.hint
    else:
        assert verdict.hint


SPMD_LESSON = Path(__file__).parent.parent / "notebooks" / "09_spmd_pipeline.md"
V_LESSON = Path(__file__).parent.parent / "notebooks" / "10_spmd_v.md"


@pytest.fixture(scope="module")
def spmd_lesson():
    """Lesson 9's namespace after its cells up to "## Exercises" and its Solutions' definitions."""
    return _namespace(SPMD_LESSON, "lesson09")


@pytest.fixture(scope="module")
def v_lesson():
    """Lesson 10's namespace after its cells up to "## Exercises" and its Solutions' definitions."""
    return _namespace(V_LESSON, "lesson10")


def test_the_routing_solution_passes_and_one_without_the_ring_fails_on_the_looped_placement(v_lesson):
    """Exercise 10.2: the Solutions' routing equals the package's recv tables; with rank p - 1's right
    neighbour not rank 0 (no ring), the looped placement's hop back to rank 0 is named."""
    assert ex.routing(v_lesson["routing"])
    with _replaced(v_lesson, V_LESSON, "routing", lambda src: src.replace("(r + 1) % p", "r + 1")):
        verdict = ex.routing(v_lesson["routing"])
    assert not verdict and "interleaved-1f1b" in verdict.message and verdict.hint, str(verdict)


def test_the_v_tick_runs_zb_v_with_jax_grads_gradients_and_wrong_ones_fail(v_lesson):
    """Exercise 10.3: the Solutions' make_v_tick runs ZB-V (two chunks a rank, 16 layers) through the
    lesson's own program_of and vlab with each buffer its busiest stage's rows, and passes. first/last
    testing the rank alone (first[0], last[1]: rank 0 is first and last on both chunks), arrivals all
    stored in chunk 0 (recv's chunk ignored), a tick sending its own message (not the previous tick's) and
    the V's turn stored a tick late too fail with the gradients; every action run each tick and the
    reported one kept (no switch) is refused for that; a body of ``...`` is no answer yet."""
    vlab = v_lesson["vlab"]
    right = ex.spmd_v(vlab.try_v(v_lesson["make_v_tick"]))
    assert right and "ZB-V ran as one SPMD program" in str(right), str(right)
    rank_only = lambda src: src.replace("first[ch]", "first[0]").replace("last[ch]", "last[1]")  # noqa: E731
    chunk_0 = lambda src: src.replace("b, ch, j = arrived", "b, ch, j = arrived[0], 0, arrived[2]")  # noqa: E731
    now = lambda src: src.replace('lax.ppermute(st["msg"]', 'lax.ppermute(out["msg"]').replace(   # noqa: E731
        "        out, ran = lax.switch(k, [idle, forward, backward, weight], st, ch, j)\n", "").replace(
        "        k, ch, j, recv = xs\n", "        k, ch, j, recv = xs\n"
        "        out, ran = lax.switch(k, [idle, forward, backward, weight], st, ch, j)\n")   # sent in its own tick
    late_self = lambda src: src.replace("{**arrived, \"self\": out[\"msg\"]}", "arrived").replace(  # noqa: E731
        "[(i + 1, i) for i in range(p - 1)])}", "[(i + 1, i) for i in range(p - 1)]), \"self\": st[\"msg\"]}")
    for edit in (rank_only, chunk_0, now, late_self):
        with _replaced(v_lesson, V_LESSON, "make_v_tick", edit):
            verdict = ex.spmd_v(vlab.try_v(v_lesson["make_v_tick"]))
        assert not verdict and "zb-v" in verdict.message and verdict.hint, str(verdict)
    switch = "out, ran = lax.switch(k, [idle, forward, backward, weight], st, ch, j)"
    every_branch = lambda src: src.replace(switch, (  # noqa: E731   every action each tick, one kept
        "outs = [b(st, ch, j) for b in (idle, forward, backward, weight)]; out, ran = jax.tree.map("
        "lambda *v: jnp.select([k == i for i in range(4)], v), *outs)"))
    with _replaced(v_lesson, V_LESSON, "make_v_tick", every_branch):   # the right kinds and gradients
        verdict = ex.spmd_v(vlab.try_v(v_lesson["make_v_tick"]))
    assert not verdict and "no lax.switch" in verdict.message, str(verdict)
    stub = lambda A, c, X, Y, first, last: None  # noqa: E731
    assert ex.spmd_v(vlab.try_v(stub)).message.startswith("no answer yet")


def test_zb_h1_for_a_model_with_an_embedding_and_a_head_gives_jax_grads_gradients_and_wrong_ones_fail(v_lesson):
    """Exercise 10.4: the Solutions' own_step (F keeps its pullback with probes where g, W1, W2 and the head
    are applied; B calls it; W multiplies by the probes' gradients; the embedding and head cast to varying;
    their gradients and the loss summed after the scan) gives jax's loss and every gradient leaf, its
    switch's F, B and W running 3 matrix products each (4 in W with g's gradient an einsum, still right).
    A B that runs F again inside jax.vjp gives the same gradients and is refused for its products, and so
    is a W rebuilding the block's activations (5 products, within F's 3 and the 2 allowed, but 2 of them
    summing over a width, not the tokens); a W taking the head's gradient by jax.grad without the head cast to varying puts a psum inside the
    switch's branches: refused before running (it would hang); the loss not over m and a bias gradient
    averaged, not summed, are refused by name; a body of ``...`` is no answer yet."""
    from zbpp_lite.course import bench

    case = ex.OWN_CASE
    right = ex.own_step(bench.try_own_step(v_lesson["own_step"], case))
    assert right and "3, 3 and 3 matrix products" in str(right), str(right)
    as_product = lambda src: src.replace('"g": jnp.sum(xhat * dg, 0)', '"g": jnp.einsum("nd,nd->d", xhat, dg)')  # noqa: E731
    with _replaced(v_lesson, V_LESSON, "own_step", as_product):   # g's gradient as a product: W runs 4
        verdict = ex.own_step(bench.try_own_step(v_lesson["own_step"], case))
    assert verdict and "3, 3 and 4 matrix products" in str(verdict), str(verdict)
    rerun_b = lambda src: src.replace(  # noqa: E731
        '            pullback = jax.tree.unflatten(treedef, [b[j] for b in st["kept"]])\n',
        '            x = jnp.where(first, E[tokens[j]], st["act"][j])\n'
        '            pullback = jax.vjp(lambda x, e: stage(x, e, j)[0], x, probes)[1]\n')
    rerun_w = lambda src: src.replace(  # noqa: E731   W rebuilds a and y from z: 5 products, F's 3 + 2
        '            xhat, z, a, y = (b[j] for b in st["saved"])\n',
        '            xhat, z, a, y = (b[j] for b in st["saved"])\n'
        '            a = jnp.tanh(z @ blk["W1"] + blk["b1"]); y = y + 0 * (a @ blk["W2"])\n')
    no_cast = lambda src: src.replace("E, H, tokens, labels = vary((E, H, tokens, labels))",  # noqa: E731
                                      "E, tokens, labels = vary((E, tokens, labels))").replace(
        "y.T @ dH))", "jax.grad(lambda H: jnp.sum(y @ H * dH))(H)))")   # a gradient for the replicated H
    no_m = lambda src: src.replace("labels[j]) / m, 0.0)", "labels[j]), 0.0)")  # noqa: E731
    wrong_in = lambda src: src.replace('"b1": dW1.sum(0)', '"b1": dW1.mean(0)')  # noqa: E731
    other_order = lambda src: src.replace('zb.build_schedule("zb-h1", p, m)', 'zb.build_schedule("zb-h2", p, m)')  # noqa: E731
    no_loss = lambda src: src.replace('    return loss, {"embed"', '    return None, {"embed"')  # noqa: E731
    for edit, word in ((rerun_b, "B runs 6"), (rerun_w, "2 of W's 5 matrix products sum over a width"),
                       (no_loss, "the loss is nan"),
                       (no_cast, "not run"), (no_m, "loss is"), (wrong_in, "differs"),
                       (other_order, "not ZB-H1's")):
        with _replaced(v_lesson, V_LESSON, "own_step", edit):
            verdict = ex.own_step(bench.try_own_step(v_lesson["own_step"], case))
        assert not verdict and word in verdict.message and verdict.hint, str(verdict)
    for shape, word in (("beside", "outside the tick's switch"), ("cond", "outside the tick's switch"),
                        (3, "W 27"), (5, "branch 5")):   # beside a dummy switch, in a cond, in a branch
        verdict = ex.own_step(bench.try_own_step(_no_pipeline(v_lesson, shape, bench.own_loss, 3), case))
        assert not verdict and word in verdict.message, (shape, str(verdict))
    assert ex.own_step(bench.try_own_step(lambda *args: None, case)).message.startswith("no answer yet")


def _no_pipeline(ns: dict, shape: str | int, loss=None, args: int = 5):
    """A step with jax.grad's gradients from no pipeline: every rank takes the whole model's gradient inside
    one shard_map program, with no switch (``"none"``), beside a switch of four idle branches
    (``"beside"``), inside a two-branch ``lax.cond`` beside that switch (``"cond"``), or inside the switch's
    branch ``shape`` (an int: 0 idle, 1 F, 2 B, 3 W, 5 a sixth), the others giving zeros. ``loss``: the whole model's
    loss on the step's arguments (default 9.4's, :func:`~zbpp_lite.course.bench.head_loss` on 9.4's
    arrays)."""
    import jax
    from jax import lax
    from zbpp_lite.course import bench

    P, mesh, shard_map = ns["P"], ns["mesh"], jax.shard_map
    if loss is None:
        def loss(As, cs, H, X, Y):
            layers = [(As[s, k], cs[s, k]) for s in range(As.shape[0]) for k in range(As.shape[1])]
            return bench.head_loss(layers, H, X.reshape(-1, X.shape[-1]), Y.reshape(-1, Y.shape[-1]))

    def rank_step(*arrays):
        rank = lax.axis_index("rank")
        whole = lambda: jax.value_and_grad(loss, argnums=tuple(range(len(arrays) - 2)))(*arrays)  # noqa: E731
        zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(whole))  # noqa: E731
        if isinstance(shape, int):
            value, grads = lax.switch(rank % 1 + shape, [whole if k == shape else zeros
                                                         for k in range(max(4, shape + 1))])
        else:
            value, grads = lax.cond(rank >= 0, whole, zeros) if shape == "cond" else whole()
            if shape != "none":
                value = value + lax.switch(rank % 1, [lambda: 0.0] * 4)
        mine = [g[rank][None] if i < 2 and args == 5 else g for i, g in enumerate(grads)]
        return (value, *mine)

    out = (P(), P("rank"), P("rank"), P()) if args == 5 else (P(), P())
    return jax.jit(shard_map(rank_step, mesh=mesh, in_specs=(P(),) * args, out_specs=out, check_vma=False))


def test_gpipe_by_hand_passes_and_wrong_ones_are_named(spmd_lesson):
    """Exercise 9.5: the Solutions' gpipe_step (the lesson's forward_ticks, then a scan of m + p - 1 BW ticks,
    the last rank first, each dx sent up) gives the whole model's loss and jax.grad's gradients. A backward
    scan of m ticks, a microbatch not offset by its rank, dx sent down, the loss's gradient not over m, the
    backward taken by jax.value_and_grad, and a body still ``...`` each fail with their own message."""
    lab = spmd_lesson["lab"]
    right = ex.gpipe_step(lab.try_gpipe(spmd_lesson["gpipe_step"]))
    assert right and "11 ticks of F, then 11 of BW" in right.message, str(right)
    up = "[(i + 1, i) for i in range(p - 1)]"
    wrong = [(lambda src: src.replace("lax.scan(backward, start, jnp.arange(m + p - 1))",
                                      "lax.scan(backward, start, jnp.arange(m))"), "run 11 and 8 ticks"),
             (lambda src: src.replace("k = t - (p - 1 - rank)", "k = t"), "stage 2 is not"),
             (lambda src: src.replace(up, "[(i, i + 1) for i in range(p - 1)]"), "stage 2 is not"),
             (lambda src: src.replace("(samples * d * m)", "(samples * d)"), "8 times jax.grad's")]
    for edit, said in wrong:
        with _replaced(spmd_lesson, SPMD_LESSON, "gpipe_step", edit):
            verdict = ex.gpipe_step(lab.try_gpipe(spmd_lesson["gpipe_step"]))
        assert not verdict and said in verdict.message and verdict.hint, (said, str(verdict))
    import jax
    import jax.numpy as jnp
    forward_all = spmd_lesson["forward_all"]

    def by_jax(As, cs, X, Y):   # the backward jax makes, not written by hand
        loss, (dAs, dcs) = jax.value_and_grad(lambda As, cs: jnp.mean((forward_all(As, cs, X) - Y) ** 2),
                                              (0, 1))(As, cs)
        return loss, dAs, dcs
    verdict = ex.gpipe_step(lab.try_gpipe(by_jax))
    assert not verdict and "calls jax's value_and_grad" in verdict.message, str(verdict)
    assert ex.gpipe_step(lab.try_gpipe(lambda As, cs, X, Y: None)).message.startswith("no answer yet")


def test_one_spmd_training_step_with_a_head_gives_the_loss_and_jax_grads_gradients_and_wrong_ones_fail(spmd_lesson):
    """Exercise 9.4: the Solutions' spmd_step (one shard_map program; the last rank's F adds each
    microbatch's loss over m, its B starts from the head's gradient, its W adds to dH; psum makes the loss
    and dH one array; each buffer the rows its busiest rank needs) passes. m rows a buffer (80 rows of
    (samples, d) in its state, over the 34 ZB-H1 needs), the loss not divided by m, the loss returned per rank (out_specs P("rank"), no
    psum), dH added on every rank, tick tables from the package's lockstep_ticks, and a loss taken by a
    second forward outside the program are each refused by name, and (round 35) ZB-H2's tables stacked in
    one array, the loss left None, NaN gradients; a body of ``...`` is no answer yet; F's whole forward
    under lax.cond(last, with the head, without) passes (a cond's costliest branch is what it runs)."""
    lab = spmd_lesson["lab"]
    result = lab.try_step(spmd_lesson["spmd_step"])
    right = ex.spmd_step(result)
    assert right and "one SPMD program ran ZB-H1's step with its head" in str(right), str(right)
    from zbpp_lite.course.bench import state_rows
    rows = state_rows(result["state"], 64, 256, result["sums"])
    assert rows == 1 + 1 + 2 * (4 + 4 + 4) + 1 + 4   # act, grad; ins, outs, dz; the head's output, its gradient
    no_m = lambda src: src.replace(" ** 2) / m", " ** 2)")  # noqa: E731
    per_rank = lambda src: src.replace('lax.psum(st["loss"], "rank")', 'st["loss"][None]').replace(  # noqa: E731
        "out_specs=(P(), ", 'out_specs=(P("rank"), ')
    every_rank = lambda src: src.replace("jnp.where(last, y.T @ dlogits, 0.0)", "y.T @ dlogits")  # noqa: E731
    packaged = lambda src: src.replace(  # noqa: E731
        "ticks = ticks_of([[(a.kind, a.stage, a.microbatch) for a in row] for row in acts])",
        "ticks = lockstep_ticks(zb.build_schedule('zb-h1', p, m))")
    other_order = lambda src: src.replace('build_schedule("zb-h1", p, m)', 'build_schedule("zb-h2", p, m)')  # noqa: E731
    every_f_first = lambda src: src.replace(  # noqa: E731
        ".actions\n", ".actions\n    acts = [sorted(row, key=lambda a: 'FBW'.index(a.kind)) for row in acts]\n", 1)
    stacked = lambda src: other_order(src).replace(  # noqa: E731   round 35: ZB-H2's tables as one array
        "    def rank_step(kind, microbatch, A, c, H, X, Y):\n",
        "    def rank_step(tables, A, c, H, X, Y):\n        kind, microbatch = tables[0], tables[1]\n").replace(
        'in_specs=(P("rank"),) * 4 + (P(),) * 3', 'in_specs=(P(None, "rank"),) + (P("rank"),) * 2 + (P(),) * 3').replace(
        "jax.jit(program)(kind, microbatch, As", "jax.jit(program)(np.stack([kind, microbatch]), As")
    ret = "    return jax.jit(program)(kind, microbatch, As, cs, H, X, Y)"
    unwritten = lambda value: lambda src: src.replace(ret, ret.replace("return", "loss, dAs, dcs, dH =")  # noqa: E731
                                                      + f"\n    return {value}")
    m_rows = lambda src: src.replace('R["outs"] = max(R["outs"], depth["ins"][-1])', "R = dict.fromkeys(R, m)")  # noqa: E731
    for edit, word in ((no_m, "(8 times it)"), (per_rank, "has shape (4,)"), (every_rank, "dH differs"),
                       (m_rows, "holds 80 rows of (samples, d) numbers in all"),
                       (packaged, "the package's lockstep_ticks"), (other_order, "not ZB-H1's"),
                       (every_f_first, "not ZB-H1's"), (stacked, "not ZB-H1's"),
                       (unwritten("None, dAs, dcs, dH"), "the loss is nan"),
                       (unwritten("loss, dAs, dcs * jnp.nan, dH"), "not numbers")):
        with _replaced(spmd_lesson, SPMD_LESSON, "spmd_step", edit):
            verdict = ex.spmd_step(lab.try_step(spmd_lesson["spmd_step"]))
        assert not verdict and word in verdict.message and verdict.hint, str(verdict)

    def beside(As, cs, H, X, Y):              # the gradients from the program, the loss from a forward outside
        _, dAs, dcs, dH = spmd_lesson["spmd_step"](As, cs, H, X, Y)
        h = X
        for s in range(As.shape[0]):
            for k in range(2):
                h = jnp.tanh(h @ As[s, k] + cs[s, k])
        return jnp.mean((h @ H - Y) ** 2), dAs, dcs, dH
    verdict = ex.spmd_step(lab.try_step(beside))
    assert not verdict and "outside the SPMD program" in verdict.message, str(verdict)
    for shape, word in (("none", "no lax.switch"), ("beside", "outside the tick's switch"),
                        ("cond", "outside the tick's switch"), (0, "the idle branch runs"),
                        (1, "F's branch runs"), (3, "W 26"), (5, "branch 5 of the switch runs 26")):
        verdict = ex.spmd_step(lab.try_step(_no_pipeline(spmd_lesson, shape)))
        assert not verdict and word in verdict.message and verdict.hint, (shape, str(verdict))
    assert ex.spmd_step(lab.try_step(lambda As, cs, H, X, Y: None)).message.startswith("no answer yet")
    head_cond = lambda src: src.replace(  # noqa: E731   round 35: F's forward under the lesson's lax.cond
        """            y, ins, outs = stage_F(A, c, jnp.where(first, X[j], st["act"][row("act", j)]))
            logits = y @ H
            loss = jnp.where(last, jnp.mean((logits - Y[j]) ** 2) / m, 0.0)""",
        """            x = jnp.where(first, X[j], st["act"][row("act", j)])
            def with_head(x):
                y, ins, outs = stage_F(A, c, x); logits = y @ H
                return y, ins, outs, logits, jnp.mean((logits - Y[j]) ** 2) / m
            def without(x):
                y, ins, outs = stage_F(A, c, x)
                return y, ins, outs, jnp.zeros_like(y), vary(jnp.zeros(()))
            y, ins, outs, logits, loss = lax.cond(last, with_head, without, x)""")
    with _replaced(spmd_lesson, SPMD_LESSON, "spmd_step", head_cond):   # a cond runs one branch: 3 products
        assert ex.spmd_step(lab.try_step(spmd_lesson["spmd_step"]))
        assert ex.spmd_step(lab.try_step(jax.jit(spmd_lesson["spmd_step"])))   # round 36: tables in its jit
    as_vdot = lambda src: src.replace("jnp.mean((logits - Y[j]) ** 2) / m",  # noqa: E731   round 38: a dot to a
                                      "jnp.vdot(logits - Y[j], logits - Y[j]) / (logits.size * m)")  # number
    with _replaced(spmd_lesson, SPMD_LESSON, "spmd_step", as_vdot):   # is no matrix product: F still 3
        assert ex.spmd_step(lab.try_step(spmd_lesson["spmd_step"]))
    w_tick = '            return made(3, dA=dA, dc=dc, dH=jnp.where(last, y.T @ dlogits, 0.0))'
    end = '        return lax.psum(st["loss"], "rank"), st["dA"][None], st["dc"][None], lax.psum(st["dH"], "rank")'
    deferred = lambda src: src.replace(w_tick, "            return made(3)").replace(end, (  # noqa: E731
        '        dA = jnp.einsum("mkrd,mkre->kde", st["ins"], st["dz"]); dc = st["dz"].sum((0, 2))\n'
        '        dH = jnp.where(last, jnp.einsum("mrd,mre->de", st["outs"][:, 1], st["dlogits"]), 0.0)\n'
        '        return lax.psum(st["loss"], "rank"), dA[None], dc[None], lax.psum(dH, "rank")'))
    with _replaced(spmd_lesson, SPMD_LESSON, "spmd_step", deferred):   # round 36: every W after the scan
        verdict = ex.spmd_step(lab.try_step(spmd_lesson["spmd_step"]))
    assert not verdict and "2 matrix products run outside the tick's switch" in verdict.message, str(verdict)


def test_the_rows_solution_passes_and_a_late_free_row_or_zb_h1s_forms_fail(spmd_lesson):
    """Exercise 9.3: the Solutions' depths (the most values a buffer holds at once) passes; the same with a
    row counted busy through the tick that last reads it is named (the read comes first); ZB-H1's closed
    forms (outs p - r, dz r + 1, ins p) are refused on ZB-H2; one that asks the package is refused; a body
    of ``...`` is no answer yet."""
    assert ex.rows_needed(spmd_lesson["depths"])
    with _replaced(spmd_lesson, SPMD_LESSON, "depths", lambda src: src.replace("w <= t < r", "w <= t <= r")):
        verdict = ex.rows_needed(spmd_lesson["depths"])
    assert not verdict and "the read comes first" in verdict.message, str(verdict)

    def zb_h1_forms(actions, ticks):
        p = len(actions)
        return dict(act=[0] + [1] * (p - 1), grad=[1] * (p - 1) + [0], ins=[p] * p, outs=[p - r for r in range(p)],
                    dz=[r + 1 for r in range(p)])
    verdict = ex.rows_needed(zb_h1_forms)
    assert not verdict and verdict.message.startswith("zb-h2 (p = 4, m = 8): rank 1's act needs 2 rows, you gave 1."), str(verdict)
    verdict = ex.rows_needed(lambda actions, ticks: ex.buffer_depths(zb.build_schedule("zb-h1", len(actions), 8)))
    assert not verdict and "your function called" in verdict.message, str(verdict)
    assert ex.rows_needed(lambda actions, ticks: None).message.startswith("zb-h1 (p = 4, m = 8): expected")
    assert ex.rows_needed(...).message.startswith("no answer yet")


def test_round_45s_whole_model_gradients_beside_a_switch_that_does_nothing_fail(spmd_lesson):
    """Round 45: exercise 9.4 answered by jax.value_and_grad of the whole model on every rank, its products
    written as multiply-and-sum (no matrix product the check counts), beside a scan over ZB-H1's kind table
    of a switch whose branches do nothing, is refused: its F, B and W branches run no matrix product."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from zbpp_lite.runtime.spmd import shard_map, tick_tables

    p, m, mesh = spmd_lesson["p"], spmd_lesson["m"], spmd_lesson["mesh"]
    kind = np.asarray(tick_tables(zb.build_schedule("zb-h1", p, m)).kind)   # before the step: not watched
    mm = lambda a, b: (a[:, :, None] * b[None]).sum(1)  # noqa: E731

    def fake(As, cs, H, X, Y):
        def rank_step(kind, As, cs, H, X, Y):
            def loss_fn(As, cs, H):
                def one(xy):
                    x, y = xy
                    for s in range(p):
                        for k in range(2):
                            x = jnp.tanh(mm(x, As[s, k]) + cs[s, k])
                    return jnp.mean((mm(x, H) - y) ** 2)
                return jnp.mean(lax.map(one, (X, Y)))
            loss, (dAs, dcs, dH) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(As, cs, H)
            lax.scan(lambda c, k: (c, lax.switch(k, [lambda: 0] * 4)), 0, kind[0])
            r = lax.axis_index("rank")
            return loss, dAs[r][None], dcs[r][None], dH
        program = shard_map(rank_step, mesh, (P("rank"),) + (P(),) * 5, (P(), P("rank"), P("rank"), P()))
        return jax.jit(program)(kind, As, cs, H, X, Y)

    verdict = ex.spmd_step(spmd_lesson["lab"].try_step(fake))
    assert not verdict and "run no matrix product" in verdict.message, str(verdict)


def test_the_state_of_a_tick_loop_is_counted_in_rows_whatever_its_layout():
    """Exercise 9.4's measure (round 74 broke the first one with other layouts and loops): the loop over the
    ticks is the scan or while whose body runs a tick's switch, and its state's rows are sizes over
    samples * d, the gradient sums left out; ticks unrolled in Python have no such loop."""
    import jax.numpy as jnp
    from jax import lax

    from zbpp_lite.course.bench import state_rows, tick_state

    def scanned(buf):
        tick = lambda st, k: (lax.switch(k, [lambda s: s + 1.0] * 4, st), k)  # noqa: E731
        small = lax.scan(lambda c, _: (c + 1, None), 0, None, length=2)[0]   # a loop without a switch first
        return lax.scan(tick, buf, jnp.arange(3) % 4)[0] + small

    def looped(buf):
        return lax.fori_loop(0, jnp.int32(3), lambda k, st: lax.switch(k % 4, [lambda s: s + 1.0] * 4, st), buf)

    for shape in ((8, 64, 256), (64, 8, 256), (8, 16384), (4, 2, 64, 256)):
        for step in (scanned, looped):
            state = tick_state(jax.make_jaxpr(step)(jnp.zeros(shape)).jaxpr)
            assert state[-1] == shape and state_rows(state, 64, 256, []) == 8, (shape, step.__name__, state)
    assert state_rows([(2, 256, 256), (8, 64, 256), ()], 64, 256, [(2, 256, 256)]) == 8   # dA's sum left out
    unrolled = lambda buf: [lax.switch(k, [lambda s: s + 1.0] * 4, buf) for k in jnp.arange(3)][-1]  # noqa: E731
    assert tick_state(jax.make_jaxpr(unrolled)(jnp.zeros((8, 64, 256))).jaxpr) is None
