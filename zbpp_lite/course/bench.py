"""Lessons 8 and 9's test bench: the lessons' MLP and its ``jax.grad`` reference, and what hands the
learner's F, B, W, loop and optimizer step to :mod:`.lesson8`'s checks, on one thread and one
:class:`~zbpp_lite.runtime.transport.Inbox` per rank (:func:`on_threads`). Imports JAX, so
``course/__init__`` does not import it; the lessons do (``from zbpp_lite.course import bench``).

Source: Qi et al., arXiv 2401.10241, section 2 (F, B, W of a stage) and section 4 (the optimizer step
after the last W).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.split import compiled_flops
from ..runtime.stages import cross_entropy   # exercise 10.4's loss, as bench.cross_entropy
from ..runtime.transport import Aborted, Inbox
from ..schedules.builders import build_schedule
from ..schedules.timeline import Event, Timeline
from .lesson8 import BUILD_CASE, BUILD_TOLERANCE, PIPELINE_RUNS, STEP, STEP_RUNS, TIED, _rel_diff

tmap = jax.tree_util.tree_map


def mlp(case: dict = BUILD_CASE, seed: int = 0) -> tuple:
    """``(params, X, Y)``: ``case["layers"]`` layers ``(A (width, width), c (width,))`` (weight matrix, bias)
    float32, and a global batch ``X``, ``Y`` of ``microbatches * microbatch_size`` rows."""
    L, d, n = case["layers"], case["width"], case["microbatches"] * case["microbatch_size"]
    keys = jax.random.split(jax.random.PRNGKey(seed), L + 2)
    params = [(jax.random.normal(k, (d, d)) / d**0.5, jnp.zeros(d)) for k in keys[:L]]
    return params, jax.random.normal(keys[L], (n, d)), jax.random.normal(keys[L + 1], (n, d))


def mlp_output(params: list, X: jax.Array) -> jax.Array:
    """The whole model on ``X``: ``tanh(h @ A + c)`` per layer."""
    h = X
    for A, c in params:
        h = jnp.tanh(h @ A + c)
    return h


def mlp_loss(params: list, X: jax.Array, Y: jax.Array) -> jax.Array:
    """The whole model on the whole batch (:func:`mlp_output`), then the mean squared error."""
    return jnp.mean((mlp_output(params, X) - Y) ** 2)


def staged_mlp(params: list, num_stages: int):
    """:func:`mlp`'s ``params`` as a :class:`~zbpp_lite.runtime.stages.StagedModel` of ``num_stages`` equal
    stages (the mean squared error on the last), for the package's executors."""
    from ..runtime.stages import StagedModel

    per = len(params) // num_stages
    return StagedModel([(lambda wb, x: jnp.tanh(x @ wb[0] + wb[1]), wb) for wb in params], num_stages,
                       lambda y, t: jnp.mean((y - t) ** 2),
                       parts=[list(range(per * s, per * (s + 1))) for s in range(num_stages)])


def fastest(f: Callable, *args: Any, n: int = 20) -> float:
    """Seconds of the fastest of ``n`` calls ``f(*args)``, each waited for (``jax.block_until_ready``),
    after one untimed call (which compiles)."""
    jax.block_until_ready(f(*args))
    seconds = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        seconds.append(time.perf_counter() - t0)
    return min(seconds)


def try_runs(run: Callable[[str], Any], names: Any) -> dict:
    """``{"error": None or the first error as text, "runs": {name: run(name)}}`` for each of ``names`` in
    turn: the learner's code raising goes to the check, not to the lesson."""
    runs: dict = {}
    try:
        for name in names:
            runs[name] = run(name)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "runs": runs}
    return {"error": None, "runs": runs}


def stage_F(A: jax.Array, c: jax.Array, x: jax.Array) -> tuple:
    """Lesson 9's F of one stage of :func:`mlp` by hand (two layers ``tanh(x @ A[k] + c[k])``): ``A`` (2, d,
    d), ``c`` (2, d), ``x`` (samples, d) -> ``(output (samples, d), ins, outs)``, each layer's input and
    output stacked (2, samples, d): what W and B read later."""
    h = jnp.tanh(x @ A[0] + c[0])
    y = jnp.tanh(h @ A[1] + c[1])
    return y, jnp.stack([x, h]), jnp.stack([h, y])


def stage_B(A: jax.Array, outs: jax.Array, dy: jax.Array) -> tuple:
    """Lesson 9's B (input gradient only): ``dy`` (samples, d) at the stage's output -> ``(dx, dz)``, dz each
    layer's gradient at its pre-activation z, (gradient at tanh(z)) (1 - tanh(z)^2): ``dy`` at layer 1,
    ``dz[1] @ A[1].T`` at layer 0; stacked (2, samples, d) for W."""
    dz1 = dy * (1 - outs[1] ** 2)
    dz0 = (dz1 @ A[1].T) * (1 - outs[0] ** 2)
    return dz0 @ A[0].T, jnp.stack([dz0, dz1])


def stage_W(ins: jax.Array, dz: jax.Array) -> tuple:
    """Lesson 9's W: ``(dA (2, d, d), dc (2, d))`` from the layers' inputs and B's dz, each (2, samples,
    d)."""
    return jnp.einsum("krd,kre->kde", ins, dz), dz.sum(1)


def stacked_mlp(case: dict = BUILD_CASE) -> tuple:
    """Lesson 9's model and batch for ``shard_map``: ``(As, cs, Xm, Ym)``, :func:`mlp`'s layers stacked per
    stage (two layers a stage, ``layers / 2`` stages: As ``(stages, 2, width, width)``, cs ``(stages, 2,
    width)``) and the batch as microbatches ``(microbatches, microbatch_size, width)``; and jax.grad's
    gradients stacked as As, cs."""
    m, n, d = case["microbatches"], case["microbatch_size"], case["width"]
    params, X, Y = mlp(case)
    reference = jax.grad(mlp_loss)(params, X, Y)
    return (*_per_stage(params), X.reshape(m, n, d), Y.reshape(m, n, d)), _per_stage(reference)


def _per_stage(layers: list) -> tuple:
    """:func:`mlp`'s layers ``[(A, c), ...]`` (or their gradients) stacked two a stage: ``(As (stages, 2,
    width, width), cs (stages, 2, width))``."""
    stack = lambda i: jnp.stack([jnp.stack([layers[2 * s + k][i] for k in (0, 1)])  # noqa: E731
                                 for s in range(len(layers) // 2)])
    return stack(0), stack(1)


def head_loss(params: list, H: jax.Array, X: jax.Array, Y: jax.Array) -> jax.Array:
    """:func:`mlp_loss` with a linear head ``H`` after the last layer: ``mean((h @ H - Y) ** 2)``."""
    return jnp.mean((mlp_output(params, X) @ H - Y) ** 2)


class SpmdLab:
    """Lessons 9 and 10's test bench around :func:`program_of` over ``mesh`` (returning ``(dA, dc, ran)``
    per rank, ``(ranks, [chunks,] 2, ...)``): ``program_of``, ``arrays`` = :func:`stacked_mlp` of
    ``case`` (one stage per rank at :data:`BUILD_CASE`, two on the V at :data:`~.lesson10.V_CASE`),
    ``reference`` = ``(dAs, dcs)``, jax.grad's gradients stacked
    as ``As``, ``cs``, and what hands the learner's ``make_tick`` to the checks."""

    def __init__(self, mesh: Any, case: dict = BUILD_CASE):
        self.program_of, self.mesh, self.case = program_of(mesh, case), mesh, case
        self.arrays, self.reference = stacked_mlp(case)

    def tradeoff(self, make_tick: Callable, rows: dict) -> dict:
        """:func:`spmd_tradeoff` of ``make_tick`` with buffers of ``rows[buffer]`` rows."""
        return spmd_tradeoff(lambda name, deeper: self.program_of(
                                 make_tick, name, {b: deeper * n for b, n in rows.items()}, *self.arrays),
                             (stage_F, stage_B, stage_W),
                             *mlp(self.case), list(self.mesh.devices.flat))

    def clipped_step(self, per_rank: Callable) -> tuple:
        """Lesson 8's clipped SGD step (:data:`~zbpp_lite.course.lesson8.STEP`) on jax.grad's gradients,
        twice: ``per_rank(A, c, dA, dc) -> (A, c)`` inside ``shard_map`` (each rank its own stage's
        slices, leading axis 1; the lesson's takes the global norm from one ``lax.psum``) and the package's
        step on the whole model on one device. Returns ``((As, cs) per rank, stacked; the same from the
        whole model)``: exercise 8.3's answer as one program, which lesson 10 asserts."""
        from jax.sharding import PartitionSpec as P

        from ..runtime import spmd

        def step(A, c, dA, dc, norm):
            scale = jnp.minimum(1.0, STEP["max_norm"] / norm) * STEP["lr"]
            return A - scale * dA, c - scale * dc

        (As, cs), (dAs, dcs) = self.arrays[:2], self.reference
        spmd_step = jax.jit(spmd.shard_map(per_rank, self.mesh, (P(spmd.AXIS),) * 4, P(spmd.AXIS)))
        whole = step(As, cs, dAs, dcs, jnp.sqrt(jnp.sum(dAs ** 2) + jnp.sum(dcs ** 2)))
        return spmd_step(As, cs, dAs, dcs), whole

    def run(self, make_tick: Callable, name: str, rows: dict, overlap: bool = False) -> dict:
        """One run of schedule ``name``, buffers of ``rows[buffer]`` rows: :func:`gradient_report` against
        the reference (rank r's chunk c is stage ``stages_of(r)[c]``), ``ran`` (ranks, ticks) and where the
        program runs its products (:func:`work_report`). ``overlap``: :func:`program_of`'s."""
        program, args = self.program_of(make_tick, name, rows, *self.arrays, overlap=overlap)
        dA, dc, ran = program(*args)
        work = work_report(jax.make_jaxpr(program)(*args).jaxpr, self.case)
        schedule = build_schedule(name, self.case["ranks"], self.case["microbatches"])
        order = np.argsort(np.ravel([schedule.stages_of(r) for r in range(schedule.num_ranks)]))
        dA, dc = (np.asarray(a).reshape(-1, *b.shape[1:])[order] for a, b in zip((dA, dc), self.reference))
        return dict(gradient_report(list(zip(dA, dc)), list(zip(*self.reference))), ran=np.asarray(ran),
                    **work)

    def try_v(self, make_tick: Callable) -> dict:
        """Exercise 10.3's result: :func:`try_runs` of ZB-V (:data:`~.lesson10.V_RUNS`, on ``case``'s 2p
        stages), each tick sending what the tick before made (:func:`program_of`'s ``overlap``), with each
        buffer the rows of its busiest stage (:func:`~.lesson9.buffer_depths`), and those rows; ``...``
        while ``make_tick`` returns None (its body still ``...``)."""
        from .lesson9 import buffer_depths
        from .lesson10 import V_RUNS

        if _stub(make_tick):
            return ...
        p, m = self.case["ranks"], self.case["microbatches"]
        rows = {b: max(k) for b, k in buffer_depths(build_schedule(V_RUNS[0], p, m), overlap=True).items()}
        return dict(rows=rows, **try_runs(lambda name: self.run(make_tick, name, rows, overlap=True), V_RUNS))

    def try_gpipe(self, step: Callable) -> Any:
        """Exercise 9.5's result: ``step(As, cs, Xm, Ym) -> (loss, dAs, dcs)``, GPipe's step with its backward
        written by hand, run on ``arrays``: ``{"error": None, "loss": its loss as a NumPy array, "loss_ref":
        the whole model's, "scans": (length, reverse) of each scan its program runs, "shard_maps", "outside":
        as :meth:`try_step` gives them, **gradient_report of dAs, dcs}``, or what :func:`_traced_run` returns
        instead (``"copied"``: tracing it called jax's own differentiation, ``jax.grad``, ``jax.vjp``,
        ``jax.value_and_grad``, ``jax.linearize`` or ``jax.linear_transpose``)."""
        As, cs, Xm, Ym = self.arrays
        params, X, Y = mlp(self.case)
        refused = (jax.grad, jax.vjp, jax.value_and_grad, jax.linearize, jax.linear_transpose)
        program, out, refusal = _traced_run(step, (As, cs, Xm, Ym), 3, refused)
        if program is None:
            return refusal
        arrays, report = _step_arrays(out, *self.reference)
        if arrays is None:
            return report
        shard_maps, outside = _outside(program.jaxpr)
        return dict(error=None, loss=arrays[0], loss_ref=float(mlp_loss(params, X, Y)),
                    scans=scans(program.jaxpr), shard_maps=shard_maps, outside=sorted(set(outside)), **report)

    def try_step(self, step: Callable) -> Any:
        """Exercise 9.4's result: ``step(As, cs, H, Xm, Ym) -> (loss, dAs, dcs, dH)`` run on ``arrays`` (one
        stage a rank) with a linear head ``H`` (width, width) after the last stage (:func:`head_loss`):
        ``{"error": None or text, "loss": its loss as a NumPy array, "loss_ref": the whole model's,
        "dH_error": max |dH - dH_ref| / max |dH_ref| (inf: another shape), "shard_maps": how many shard_map
        calls its program makes, "outside": the primitives it runs outside them (tick tables passed in as
        arrays run none), "products": :func:`branch_products`, "loose": :func:`loose_products`, "order":
        :func:`runs_schedule` for ZB-H1, **:func:`_state_report`, **gradient_report of dAs, dcs}``, or what
        :func:`_traced_run` returns instead (the package's tick tables, ``spmd.tick_tables`` or
        ``lockstep_ticks``, called while the step traces: ``"copied"``)."""
        As, cs, Xm, Ym = self.arrays
        params, X, Y = mlp(self.case)
        d = self.case["width"]
        H = jax.random.normal(jax.random.PRNGKey(7), (d, d)) / d**0.5
        loss_ref, (grads, dH_ref) = jax.value_and_grad(head_loss, argnums=(0, 1))(params, H, X, Y)
        from ..runtime.spmd import tick_tables
        from ..schedules.simulate import lockstep_ticks

        program, out, refused = _traced_run(step, (As, cs, H, Xm, Ym), 4, (tick_tables, lockstep_ticks))
        if program is None:
            return refused
        arrays, report = _step_arrays(out, *_per_stage(grads))
        if arrays is None:
            return report
        loss, dH = arrays[0], arrays[3]
        return dict(error=None, loss=loss, loss_ref=float(loss_ref),
                    dH_error=gradient_report([dH], [dH_ref])["grad_error"],
                    **_state_report(program.jaxpr, self.case, [As.shape[1:], cs.shape[1:], H.shape]),
                    **_program_report(program, self.case), **report)


def _step_arrays(out: tuple, dAs: Any, dcs: Any) -> tuple:
    """A whole step's outputs ``(loss, dAs, dcs, ...)`` as float64 NumPy arrays, and :func:`gradient_report`
    of its dAs, dcs against the reference's, stage by stage (every error inf where dAs has another shape):
    ``(arrays, report)``, or ``(None, {"error": ...})`` where the outputs are not arrays of numbers."""
    try:
        arrays = [np.asarray(a, dtype=np.float64) for a in out]
    except (TypeError, ValueError) as e:   # a ragged list, a dict: no arrays of numbers
        return None, {"error": f"the step returned something other than arrays of numbers ({e})"}
    dA, dc = arrays[1], arrays[2]
    report = gradient_report(list(zip(dA, dc)), list(zip(dAs, dcs))) if dA.shape == np.shape(dAs) else \
        {"grad_error": float("inf"), "stage_errors": [float("inf")], "scale": float("nan")}
    return arrays, report


def own_model(case: dict) -> tuple:
    """Exercise 10.4's model and batch: ``(params, tokens, labels)``. ``params``: ``{"embed": (vocab,
    width), "blocks": {"W1": (ranks, width, hidden), "b1": (ranks, hidden), "W2": (ranks, hidden, width),
    "g": (ranks, width)}, "head": (width, classes)}`` float32, one block a rank (stacked on axis 0);
    ``tokens`` (microbatches, tokens) int32 in [0, vocab), ``labels`` the same shape in [0, classes)."""
    p, m, n = case["ranks"], case["microbatches"], case["tokens"]
    V, d, h, C = case["vocab"], case["width"], case["hidden"], case["classes"]
    k = jax.random.split(jax.random.PRNGKey(3), 7)
    blocks = {"W1": jax.random.normal(k[0], (p, d, h)) / d**0.5, "b1": jnp.zeros((p, h)),
              "W2": jax.random.normal(k[1], (p, h, d)) / h**0.5, "g": jnp.ones((p, d))}
    params = {"embed": jax.random.normal(k[2], (V, d)), "blocks": blocks,
              "head": jax.random.normal(k[3], (d, C)) / d**0.5}
    return (params, jax.random.randint(k[4], (m, n), 0, V, dtype=jnp.int32),
            jax.random.randint(k[5], (m, n), 0, C, dtype=jnp.int32))


def own_block(blk: dict, x: jax.Array) -> jax.Array:
    """One of exercise 10.4's blocks, ``x`` (tokens, width) -> the same shape: ``x + tanh(norm(x) * g @
    W1 + b1) @ W2``, ``norm`` dividing each row by its root mean square."""
    z = x / jnp.sqrt(jnp.mean(x ** 2, axis=-1, keepdims=True) + 1e-6) * blk["g"]
    return x + jnp.tanh(z @ blk["W1"] + blk["b1"]) @ blk["W2"]


def own_loss(params: dict, tokens: jax.Array, labels: jax.Array) -> jax.Array:
    """Exercise 10.4's whole model on the whole batch: embedding, every block in turn, head, and the mean
    cross-entropy over all tokens."""
    x = params["embed"][tokens.reshape(-1)]
    for r in range(params["blocks"]["W1"].shape[0]):
        x = own_block(tmap(lambda a: a[r], params["blocks"]), x)
    return cross_entropy(x @ params["head"], labels.reshape(-1))


def try_own_step(step: Callable, case: dict) -> Any:
    """Exercise 10.4's result: ``step(params, tokens, labels) -> (loss, grads)`` on :func:`own_model`'s
    ``case``: ``{"error": None or text, "loss": its loss, "loss_ref": jax's, "errors": {leaf path: max |g -
    g_ref| / max |g_ref|} (inf: missing or another shape), "shard_maps", "outside": as
    :meth:`SpmdLab.try_step` gives them, "products": :func:`branch_products`, "loose": :func:`loose_products`,
    "order": :func:`runs_schedule` for ZB-H1}``, or what :func:`_traced_run` returns instead (a collective
    inside a branch is refused before the program runs: it would hang)."""
    params, tokens, labels = own_model(case)
    loss_ref, ref = jax.value_and_grad(own_loss)(params, tokens, labels)
    program, out, refused = _traced_run(step, (params, tokens, labels), 2)
    if program is None:
        return refused
    loss, grads = out
    got, want = _by_path(grads), _by_path(ref)           # by leaf path, "['blocks']['W1']"
    report = gradient_report([got.get(name) for name in want], list(want.values()))   # None: missing
    errors = dict(zip(want, report["stage_errors"]))
    return dict(error=None, loss=np.asarray(loss), loss_ref=float(loss_ref), errors=errors,
                **_program_report(program, case))


def _program_report(program: Any, case: dict) -> dict:
    """What exercises 9.4's and 10.4's checks read of a whole step's traced ``program`` (a closed jaxpr) on
    ``case`` (its ``ranks`` and ``microbatches``): ``{"shard_maps", "outside"}`` (:func:`_outside`),
    :func:`work_report`'s three and ``"order"`` (:func:`runs_schedule` for ZB-H1)."""
    shard_maps, outside = _outside(program.jaxpr)
    return dict(shard_maps=shard_maps, outside=sorted(set(outside)), **work_report(program.jaxpr, case),
                order=runs_schedule(program, "zb-h1", case["ranks"], case["microbatches"]))


def work_report(jaxpr: Any, case: dict) -> dict:
    """Where a traced SPMD program (``jaxpr``) runs its matrix products, for the checks that it is a pipeline
    that runs nothing twice (``lesson9._pipeline_problem``): ``"products"`` (:func:`branch_products`),
    ``"loose"`` (:func:`loose_products`) and ``"w_reruns"`` (the W branch's products that sum over anything
    but the microbatch's samples, ``case``'s ``microbatch_size`` or ``tokens``: F's or B's work again; None
    without a switch)."""
    samples = case.get("microbatch_size", case.get("tokens"))
    over_width = branch_products(jaxpr, lambda eqn: _contracted(eqn) != samples)
    return dict(products=branch_products(jaxpr), loose=loose_products(jaxpr),
                w_reruns=over_width and over_width[3])


def _traced_run(step: Callable, args: tuple, outputs: int, refused: tuple = ()) -> tuple:
    """``(program, out, None)``: the learner's ``step(*args)``, traced (its jaxpr) and run; or ``(None, None,
    what the check reads instead)``: ``{"error": ...}`` when it raised, ``{"error": None, "copied": name}``
    when tracing it called one of the ``refused`` functions (the package's form of what the exercise asks
    for), ``{"error": None, "hang": [collectives]}`` without running it when a collective sits inside a
    branch (:func:`collectives_in_branches`), ``...`` when it returned None, ``{"error": None, "shape":
    ...}`` when it returned anything but ``outputs`` values."""
    codes, called = {inspect.unwrap(f).__code__: f.__name__ for f in refused}, []   # jax's API: unwrapped

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            called.append(codes[frame.f_code])

    previous = sys.getprofile()
    try:
        sys.setprofile(watch if codes else previous)
        try:
            program = jax.make_jaxpr(step)(*args)
        finally:
            sys.setprofile(previous)
        if called:
            return None, None, {"error": None, "copied": called[0]}
        hang = collectives_in_branches(program.jaxpr)
        if hang:                                   # it would wait forever: refused before it runs
            return None, None, {"error": None, "hang": sorted(set(hang))}
        out = step(*args)
    except Exception as e:  # noqa: BLE001  (the learner's code raising goes to the check)
        return None, None, {"error": f"{type(e).__name__}: {e}"}
    if out is None:
        return None, None, ...
    if not isinstance(out, (tuple, list)) or len(out) != outputs:
        size = len(out) if hasattr(out, "__len__") else 1
        return None, None, {"error": None, "shape": f"{type(out).__name__} of {size}"}
    return program, out, None


def _by_path(tree: Any) -> dict:
    """``{path: leaf}`` of a pytree, each path as ``jax.tree_util.keystr`` writes it."""
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _runs(eqn: Any) -> int:
    """How many times an equation runs the jaxprs it calls: a ``scan``'s length, else once."""
    return eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1


def runs_schedule(program: Any, name: str, p: int, m: int) -> bool | None:
    """Whether the traced ``program`` (a closed jaxpr) carries ``name``'s kind table (:func:`~zbpp_lite.
    runtime.spmd.tick_tables`): True, it does; False, it carries another table of kind codes, the ticks of
    another order; None, no such table is among its constants (built inside the program: not told). A
    table of kind codes is any (p, ticks) slice of a constant, in any axis order, stacked or not, ints or
    floats: whole numbers 0..4, an F and a B among them, more ticks than ranks."""
    from ..runtime.spmd import tick_tables
    want = np.asarray(tick_tables(build_schedule(name, p, m)).kind)
    kinds = [t for c in _constants(program) for t in _kind_tables(np.asarray(c), p)]
    if any(t.shape == want.shape and (t == want).all() for t in kinds):
        return True
    return False if kinds else None


def _constants(program: Any) -> list:
    """The constants of a closed jaxpr and of every closed jaxpr inside it (a ``jax.jit`` the learner's step
    applies keeps its constants in its own)."""
    found = list(program.consts)

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            for value in eqn.params.values():
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(v, "consts") and hasattr(v, "jaxpr"):
                        found.extend(v.consts)
                        walk(v.jaxpr)
                    elif hasattr(v, "eqns"):
                        walk(v)
    walk(program.jaxpr)
    return found


def _kind_tables(array: np.ndarray, p: int) -> list[np.ndarray]:
    """Every (p, ticks) slice of ``array`` (an axis of length p, another of more than p, the rest fixed)
    that reads as kind codes: whole numbers 0..4 with an F (1) and a B or BW (2 or 4) among them."""
    if array.ndim < 2 or not np.issubdtype(array.dtype, np.number) or array.dtype == bool:
        return []
    found = []
    for a in (k for k in range(array.ndim) if array.shape[k] == p):
        for b in (k for k in range(array.ndim) if k != a and array.shape[k] > p):
            moved = np.moveaxis(array, (a, b), (0, 1)).reshape(p, array.shape[b], -1)
            for k in range(moved.shape[2]):
                t = moved[:, :, k]
                codes = set(np.unique(t).tolist())
                if codes <= {0, 1, 2, 3, 4} and 1 in codes and codes & {2, 4}:
                    found.append(t.astype(np.int64))
    return found


def _products(jaxpr: Any, skip: Callable[[Any], bool] = lambda eqn: False,
              which: Callable[[Any], bool] = lambda eqn: True) -> int:
    """The matrix products (``dot_general`` to an array, those ``which`` accepts) ``jaxpr`` runs, the jaxprs
    it calls counted in (a ``scan``'s body once per iteration: layers stacked under a scan count as many
    products as there are layers; a ``cond``'s costliest branch, the most one run can take), but none
    inside an equation ``skip`` names."""
    total = 0
    for e in jaxpr.eqns:
        if skip(e):
            continue
        inner = [_products(j, skip, which) for j in inner_jaxprs(e)]
        product = e.primitive.name == "dot_general" and e.outvars[0].aval.ndim > 0   # (a dot to a number:
        total += (product and which(e)) + _runs(e) * (                                   # a loss, no layer)
            max(inner, default=0) if e.primitive.name == "cond" else sum(inner))
    return total


def _contracted(eqn: Any) -> int:
    """The size a ``dot_general`` sums over (its contracting axes' sizes multiplied): a weight's gradient
    ``x.T @ dz`` sums over the microbatch's samples, a layer's forward ``x @ A`` or a B's ``dz @ A.T`` over a
    width."""
    shape, axes = eqn.invars[0].aval.shape, eqn.params["dimension_numbers"][0][0]
    return int(np.prod([shape[a] for a in axes]))


def _is_switch(eqn: Any) -> bool:
    """A ``cond`` of four branches or more: a tick's ``lax.switch`` over the kinds (0 idle, 1 F, 2 B, 3 W)."""
    return eqn.primitive.name == "cond" and len(eqn.params["branches"]) >= 4


def _eqns(jaxpr: Any, which: Callable[[Any], bool]) -> list:
    """Every equation ``which`` names in ``jaxpr``, the jaxprs it calls looked into (a found one's too)."""
    return [found for e in jaxpr.eqns for found in
            ([e] if which(e) else []) + [f for j in inner_jaxprs(e) for f in _eqns(j, which)]]


def scans(jaxpr: Any) -> list[tuple[int, bool]]:
    """``(length, reverse)`` of every ``lax.scan`` in ``jaxpr`` (a ``jax.make_jaxpr(...).jaxpr``), the jaxprs
    it calls looked into, in program order: ``reverse`` True for a scan run from its last step back."""
    found = _eqns(jaxpr, lambda e: e.primitive.name == "scan")
    return [(e.params["length"], e.params["reverse"]) for e in found]


def _switches(jaxpr: Any) -> list:
    """Every tick's switch (:func:`_is_switch`) in ``jaxpr``, the jaxprs it calls looked into."""
    return _eqns(jaxpr, _is_switch)


def branch_products(jaxpr: Any, which: Callable[[Any], bool] = lambda eqn: True) -> list[int] | None:
    """The matrix products (``dot_general``, those ``which`` accepts) each branch of a tick's ``lax.switch``
    (a ``cond`` of four branches or more) runs, the jaxprs it calls counted in, the largest over every such
    switch in ``jaxpr``: what each action costs in products (0 idle, 1 F, 2 B, 3 W, 4 BW). A B that runs F
    again inside ``jax.grad`` or ``jax.vjp`` runs F's products and its own. None when ``jaxpr`` has no such
    switch."""
    counts = [[_products(b.jaxpr, which=which) for b in e.params["branches"]] for e in _switches(jaxpr)]
    if not counts:
        return None
    return [max(c[i] for c in counts if i < len(c)) for i in range(max(map(len, counts)))]


def tick_state(jaxpr: Any) -> list | None:
    """The shapes of the state carried by the loop over the ticks: the first ``lax.scan`` or ``while`` in
    ``jaxpr`` (the jaxprs it calls looked into, a ``shard_map``'s body among them: a rank's own shapes) whose
    body runs a tick's switch (:func:`_is_switch`); None without one (the ticks unrolled in Python)."""
    def loop(j: Any) -> Any:
        for e in j.eqns:
            body = {"scan": "jaxpr", "while": "body_jaxpr"}.get(e.primitive.name)
            if body is not None and _switches(getattr(e.params[body], "jaxpr", e.params[body])):
                return e
            found = next((f for f in map(loop, inner_jaxprs(e)) if f is not None), None)
            if found is not None:
                return found
        return None

    e = loop(jaxpr)
    if e is None:
        return None
    if e.primitive.name == "scan":
        if "num_consts" in e.params:
            start, count = e.params["num_consts"], e.params["num_carry"]
        else:   # JAX 0.12 on: ft_in, the flat trees of (consts, carry, xs)
            leaves = lambda ft: sum(map(leaves, ft.elts)) if hasattr(ft, "elts") else 1  # noqa: E731
            start, count = (leaves(ft) for ft in e.params["ft_in"].elts[:2])
        carried = e.invars[start:start + count]
    else:
        carried = e.invars[e.params["cond_nconsts"] + e.params["body_nconsts"]:]
    return [tuple(v.aval.shape) for v in carried]


def _state_report(jaxpr: Any, case: dict, sums: list) -> dict:
    """``{"state": :func:`tick_state`, "sums": the gradient sums' shapes left out (a rank's A, c, H),
    "counted": the state's shapes :func:`state_rows` counts, "rows": its count}`` (the last two None
    without a tick loop) for exercise 9.4's check."""
    state, sums = tick_state(jaxpr), [tuple(s) for s in sums]
    if state is None:
        return dict(state=None, sums=sums, counted=None, rows=None)
    return dict(state=state, sums=sums, counted=_counted(state, sums),
                rows=state_rows(state, case["microbatch_size"], case["width"], sums))


def _counted(shapes: list, sums: list) -> list:
    """The shapes of ``shapes`` that hold activations: neither scalars nor gradient sums (``sums``)."""
    skip = set(map(tuple, sums))
    return [tuple(s) for s in shapes if s and tuple(s) not in skip]


def state_rows(shapes: list, samples: int, d: int, sums: list) -> float:
    """How many rows of ``samples`` x ``d`` numbers a tick loop's state (:func:`tick_state`'s ``shapes``)
    holds, in whatever layout: every carried array's size over samples * d, but the gradient sums (shapes
    in ``sums``, such as dA's, dc's, dH's) and scalars (:func:`_counted`). A buffer (rows, 2, samples, d)
    counts 2 a row."""
    return sum(float(np.prod(s)) for s in _counted(shapes, sums)) / (samples * d)


def loose_products(jaxpr: Any) -> int:
    """The matrix products (``dot_general``) ``jaxpr`` runs outside every tick's ``lax.switch`` (a ``cond`` of
    four branches or more; a two-branch ``cond``'s count), the jaxprs it calls looked into: in a pipeline's
    program, the work no action of the schedule does (a sum after the loop); a whole model's gradient taken
    beside the ticks shows here."""
    return _products(jaxpr, skip=_is_switch)


def inner_jaxprs(eqn: Any) -> list:
    """The jaxprs an equation calls (``jit``'s, ``scan``'s, each of ``cond``'s branches), open."""
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns") or hasattr(v, "jaxpr"):
                found.append(getattr(v, "jaxpr", v))
    return found


def collectives_in_branches(jaxpr: Any, inside: bool = False) -> list[str]:
    """The collectives (``psum``, ``ppermute``, ``all_gather``, ...) ``jaxpr`` runs inside a ``cond``'s
    branch (``lax.switch`` and ``lax.cond`` both lower to one), the jaxprs it calls looked into: in an SPMD
    program whose ranks take different branches, each would wait forever for the ranks that never call it.
    ``jax.grad`` with respect to a replicated value puts one there (its gradient summed over the ranks)."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if inside and name.startswith(("psum", "ppermute", "all_gather", "all_to_all", "pmax", "pmin")):
            found.append(name)
        for sub in inner_jaxprs(eqn):
            found += collectives_in_branches(sub, inside or name == "cond")
    return found


def _outside(jaxpr: Any) -> tuple[int, list]:
    """``(shard_map calls, primitives run outside them)`` in ``jaxpr``, the jaxprs it calls looked into."""
    calls, found = 0, []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            calls += 1
            continue
        inner = inner_jaxprs(eqn)
        if not inner:
            found.append(eqn.primitive.name)
        for sub in inner:
            k, ops = _outside(sub)
            calls, found = calls + k, found + ops
    return calls, found


def spmd_tradeoff(compile_spmd: Callable, stage_fns: tuple, params: list, X: jax.Array, Y: jax.Array,
                  devices: list) -> dict:
    """Lesson 9's trade-off, printed: one F, B, W and BW of stage 1 timed (``stage_fns``: the lesson's
    ``stage_F, stage_B, stage_W`` on ``(A, c, x)``, ``(A, outs, dy)``, ``(ins, dz)``), ZB-H1 and ZB-H2 (the
    zero-bubble schedules the lesson compares) simulated event-driven and lockstep with those times, and
    one step timed of the learner's program (``compile_spmd(name, deeper) -> (program, ((kind, microbatch),
    ..., As, cs, Xm, Ym))``, buffers ``deeper`` times as deep), of the package's MPMD executor on
    :func:`staged_mlp`, and a tick of the program on an all-idle table (the ticks' own cost,
    :func:`idle_tick`) with its buffers as given and 4 times deeper. Returns ``{name: {"event",
    "lockstep": simulated makespans; "mpmd", "spmd": measured steps; "idle", "idle_deeper": measured
    ticks}}`` (s)."""
    from ..runtime.executor import PipelineExecutor
    from ..schedules.costs import Costs
    from ..schedules.simulate import simulate

    stage_F, stage_B, stage_W = stage_fns
    p, m = BUILD_CASE["ranks"], BUILD_CASE["microbatches"]
    As, cs, Xm = compile_spmd("zb-h1", 1)[1][-4:-1]
    A, c, x = As[1], cs[1], Xm[0]
    y, ins, outs = stage_F(A, c, x)
    dz = stage_B(A, outs, y)[1]
    fused = lambda A, o, i, g: stage_W(i, stage_B(A, o, g)[1])  # noqa: E731
    costs = Costs(f=fastest(jax.jit(stage_F), A, c, x), b=fastest(jax.jit(stage_B), A, outs, y),
                  w=fastest(jax.jit(stage_W), ins, dz), bw=fastest(jax.jit(fused), A, outs, ins, y))
    print(f"one action (ms): F {costs.f * 1e3:.2f}, B {costs.b * 1e3:.2f}, W {costs.w * 1e3:.2f}, "
          f"BW {costs.bw * 1e3:.2f}")
    model, figures = staged_mlp(params, p), {}
    for name in ("zb-h1", "zb-h2"):
        schedule = build_schedule(name, p, m)
        mpmd, lock = (simulate(schedule, costs, lockstep=ls).makespan for ls in (False, True))
        program, args = compile_spmd(name, 1)
        executor = PipelineExecutor(model, schedule, devices[:p])
        spmd_s, idle = fastest(program, *args, n=3), idle_tick(program, args)
        idle_deeper = idle_tick(*compile_spmd(name, 4))
        mpmd_s = fastest(lambda: executor.run(model.params, X, Y).loss, n=3)
        print(f"{name:>6}: simulated event-driven {mpmd * 1e3:.1f} ms, lockstep {lock * 1e3:.1f} ms "
              f"(+{lock / mpmd - 1:.0%}); measured step: MPMD executor {mpmd_s * 1e3:.1f} ms, SPMD "
              f"program {spmd_s * 1e3:.1f} ms ({len(args[0][0][0])} ticks); an all-idle tick "
              f"{idle * 1e3:.2f} ms, {idle_deeper * 1e3:.2f} ms with buffers 4 times as deep")
        figures[name] = dict(event=mpmd, lockstep=lock, mpmd=mpmd_s, spmd=spmd_s, idle=idle,
                             idle_deeper=idle_deeper)
    return figures


def switch_costs(rows: tuple = (8, 32), ticks: int = 64) -> dict:
    """What one all-idle tick of a ``lax.scan`` costs, in seconds, on the default device, with a switch
    whose branches take and return the whole loop state, and with one whose branches take the whole state
    and return only what they made (lesson 9's tick): ``{rows: (whole state, made)}``. The state: two
    buffers ``(rows, 2, 64, 256)`` float32 and a ``(256, 256)`` sum; the branches: idle, F writing a row of
    one buffer, B of the other, W adding a product of both to the sum. Each time is :func:`_per_tick` of
    ``ticks``, each step the fastest of 7 runs (``benchmarks/bench_spmd.py --switch``). XLA on a
    CPU copies the whole state through the first switch every tick, so its cost grows with ``rows``."""
    from jax import lax

    S, D = 64, 256
    work = lambda x: jnp.tanh(x) * 1.01  # noqa: E731

    def program(n: int, whole: bool) -> Callable:
        def tick(st, kj):
            k, j = kj
            r = j % n
            if whole:
                branches = [lambda s: s, lambda s: {**s, "ins": s["ins"].at[r].set(work(s["ins"][r]))},
                            lambda s: {**s, "dz": s["dz"].at[r].set(work(s["dz"][r]))},
                            lambda s: {**s, "acc": s["acc"] + s["ins"][r, 0].T @ s["dz"][r, 0]}]
                return lax.switch(k, branches, st), None
            zero = jnp.zeros((D, D))
            made = [lambda a, b: (a, b, zero), lambda a, b: (work(a), b, zero),   # each on the rows it reads
                    lambda a, b: (a, work(b), zero), lambda a, b: (a, b, a[0].T @ b[0])]
            a, b, acc = lax.switch(k, [lambda s, f=f: f(s["ins"][r], s["dz"][r]) for f in made], st)
            return {"ins": st["ins"].at[r].set(a), "dz": st["dz"].at[r].set(b), "acc": st["acc"] + acc}, None

        def run(ks, js):
            st = dict(ins=jnp.zeros((n, 2, S, D)), dz=jnp.zeros((n, 2, S, D)), acc=jnp.zeros((D, D)))
            return lax.scan(tick, st, (ks, js))[0]["acc"][0, 0]
        return jax.jit(run)

    def per_tick(f: Callable) -> float:
        step_of = lambda k: fastest(f, jnp.zeros(k * ticks, jnp.int32), jnp.arange(k * ticks), n=7)  # noqa: E731
        return _per_tick(step_of, ticks)

    return {n: (per_tick(program(n, True)), per_tick(program(n, False))) for n in rows}


def _per_tick(step_of: Callable[[int], float], ticks: int) -> float:
    """Seconds one tick costs, from ``step_of(k)``, the seconds of a step over ``k`` times ``ticks`` ticks:
    the step at k = 3 less the step at k = 1, over 2 ``ticks``, so what a call costs once drops out."""
    once = step_of(1)
    return max(step_of(3) - once, 0.0) / (2 * ticks)


def idle_tick(program: Callable, args: tuple) -> float:
    """Seconds one tick of ``program(tables, *rest)`` costs on an all-idle table (kind 0 everywhere):
    the step over the table repeated 3 times less the step over it once, over twice its ticks, so what
    a call costs once (its start, the buffers' zeros) drops out (:func:`_per_tick`). ``tables``: (ranks,
    ticks) arrays, kind first (or pytrees of them)."""
    (kind, *rest_tables), rest = args[0], args[1:]
    tiled = lambda k: jax.tree.map(lambda a: np.tile(a, (1, k)), (0 * kind, *rest_tables))  # noqa: E731
    return _per_tick(lambda k: fastest(program, tiled(k), *rest, n=5), kind.shape[1])


def gradient_report(mine: list, ref: list) -> dict:
    """How far a pipeline's gradients are from the reference, per stage: ``mine`` and ``ref`` hold one pytree
    of arrays per stage (None in ``mine``: a stage missing). Returns ``{"grad_error": the largest,
    "stage_errors": per stage max |mine - ref| / max |ref| (inf: missing, another shape or a NaN), "scale":
    the least-squares factor c of mine = c ref over every array (nan: a stage missing), "not_finite": the
    stages whose gradients hold a NaN or an infinity}``, as :func:`zbpp_lite.course.lesson8.gradient_problem`
    reads it."""
    errors, dot, norm, not_finite = [], 0.0, 0.0, []
    for got, want in zip(mine, ref):
        b = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(want)]
        try:
            a = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(got)] if got is not None else []
        except (TypeError, ValueError):   # not arrays of numbers (a ragged list, a string)
            a = []
        if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
            errors.append(float("inf"))
            dot = float("nan")
            continue
        errors.append(max(map(_rel_diff, a, b), default=0.0))   # (a NaN: infinitely far off)
        if not all(np.isfinite(x).all() for x in a):
            not_finite.append(len(errors) - 1)
        dot += sum(float(np.sum(x * y)) for x, y in zip(a, b))
        norm += sum(float(np.sum(y * y)) for y in b)
    return {"grad_error": max(errors), "stage_errors": errors, "scale": dot / max(norm, 1e-30),
            "not_finite": not_finite}


def _traced_products(fn: Callable, tree: Any) -> int | None:
    """The matrix products ``fn(tree)`` runs as traced (:func:`_products`), the arrays of ``tree`` its
    inputs: work whose result is dropped still counts, as it does not in XLA's flops; None when it cannot be
    traced."""
    on, arrays = _on_arrays(fn, tree)
    try:
        return _products(jax.make_jaxpr(on)(*arrays).jaxpr)
    except Exception:  # noqa: BLE001  (the learner's B; its flops check says why it cannot run)
        return None


def _flops_on_arrays(fn: Callable, tree: Any) -> tuple[float | None, str | None]:
    """``(XLA's flops of fn(tree), None)``, the arrays of ``tree`` the compiled program's arguments and
    anything else in it (a stage index, a Python number) fixed; or ``(None, why)`` when ``jax.jit`` cannot
    compile it."""
    on, arrays = _on_arrays(fn, tree)
    try:
        return compiled_flops(on, *arrays), None
    except Exception as e:  # noqa: BLE001  (the learner's function failing goes to the check)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _on_arrays(fn: Callable, tree: Any) -> tuple[Callable, list]:
    """``fn`` of ``tree`` as a function of the arrays in it, and those arrays: what is traced or compiled
    takes them as arguments (not constants XLA could fold) and keeps the rest of ``tree`` fixed."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    where = [i for i, a in enumerate(leaves) if isinstance(a, (jax.Array, np.ndarray))]

    def on(*arrays):
        given = list(leaves)
        for i, a in zip(where, arrays):
            given[i] = a
        return fn(jax.tree_util.tree_unflatten(treedef, given))
    return on, [leaves[i] for i in where]


def nbytes(tree: Any, leave_out: Any = ()) -> int:
    """Bytes of the distinct arrays of ``tree`` (each array counted once), those of ``leave_out`` not; a
    leaf that is not an array (a Python number, a string) holds none."""
    skip = {id(a) for a in jax.tree_util.tree_leaves(leave_out)}
    arrays = {id(a): a for a in jax.tree_util.tree_leaves(tree)
              if id(a) not in skip and hasattr(a, "dtype") and hasattr(a, "size")}
    return sum(a.size * a.dtype.itemsize for a in arrays.values())


@contextlib.contextmanager
def _swapped(scope: dict, names: dict):
    """Within the block, ``scope`` (a learner function's module globals) maps each of ``names`` to its
    replacement; the originals are put back after, also on an error."""
    plain = {k: scope[k] for k in names}
    scope.update(names)
    try:
        yield
    finally:
        scope.update(plain)



def _judge_sent(want: dict, sent: dict, placement: list, received: bool = False) -> dict:
    """:meth:`Lab.moved`'s ``missing``, ``wrong`` and ``scale`` for ``sent`` against ``want``, each key
    ``(kind, stage, microbatch)`` naming the stage that sends it (or, ``received``, the stage that gets
    it): F's go to the next stage, B's to the one before."""
    def crosses(k):
        s, to = k[1], k[1] + (1 if k[0] == "F" else -1) * (-1 if received else 1)
        return placement[s] != placement[to]
    missing = [k for k in want if k not in sent and crosses(k)]
    wrong, scales = [], set()
    for key, value in sent.items():
        ref = want.get(key)
        try:
            got = np.asarray(value, dtype=np.float64) if ref is not None else None
        except (TypeError, ValueError):
            got = None
        if got is None or got.shape != ref.shape:
            wrong.append((key, float("inf")))
            continue
        off = _rel_diff(got, ref)   # (a NaN: infinitely far off)
        if not off <= BUILD_TOLERANCE:
            wrong.append((key, off))
            c = float(np.sum(got * ref) / max(np.sum(ref * ref), 1e-300))   # got = c ref, but for c?
            fits = np.max(np.abs(got - c * ref)) <= BUILD_TOLERANCE * abs(c) * np.max(np.abs(ref))
            scales.add(round(c, 3) if fits and np.isfinite(c) else None)
    scale = scales.pop() if len(scales) == 1 and None not in scales else None
    return {"missing": missing, "wrong": wrong, "scale": scale}


@contextlib.contextmanager
def _swapped_references(fn: Any, replace: dict):
    """Within the block, every reference ``fn`` can reach to a key of ``replace`` (by identity) is its value:
    the names of ``fn``'s module bound to it (``W``, or an alias such as ``weight = W``), ``fn``'s default
    arguments (``W=W``) and the cells it closes over (a loop a factory made); all put back after, also on an
    error."""
    new = {id(old): value for old, value in replace.items()}
    scope = getattr(fn, "__globals__", {})
    names = {k: v for k, v in scope.items() if id(v) in new}
    cells = [c for c in (getattr(fn, "__closure__", None) or ()) if id(_cell(c)) in new]
    plain = (getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None),
             [_cell(c) for c in cells])
    scope.update({k: new[id(v)] for k, v in names.items()})
    if plain[0]:
        fn.__defaults__ = tuple(new.get(id(v), v) for v in plain[0])
    if plain[1]:
        fn.__kwdefaults__ = {k: new.get(id(v), v) for k, v in plain[1].items()}
    for c in cells:
        c.cell_contents = new[id(c.cell_contents)]
    try:
        yield
    finally:
        scope.update(names)
        if plain[0]:
            fn.__defaults__ = plain[0]
        if plain[1]:
            fn.__kwdefaults__ = plain[1]
        for c, v in zip(cells, plain[2]):
            c.cell_contents = v


def _unwrapped(fn: Any) -> Any:
    """``fn`` itself under any ``functools.partial``: the function whose module, defaults and closure its
    names are read from."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _cell(cell: Any) -> Any:
    """A closure cell's contents, or None while it is empty."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def on_threads(num_ranks: int, work: Callable[[int, list], Any]) -> list:
    """``[work(rank, inboxes) for each rank]``, one thread per rank and one runtime
    :class:`~zbpp_lite.runtime.transport.Inbox` each (``put(key, value)``; ``take(key, timeout)``); a rank
    that fails makes every waiting ``take`` raise ``Aborted``, and the first error is raised again once all
    have stopped."""
    abort, results, errors = threading.Event(), [None] * num_ranks, []
    inboxes = [Inbox(abort, threading.Condition()) for _ in range(num_ranks)]

    def one(rank: int) -> None:
        try:
            results[rank] = work(rank, inboxes)
        except Exception as e:   # every waiting rank stops; raised below
            errors.append(e)
            abort.set()
    threads = [threading.Thread(target=one, args=(r,)) for r in range(num_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, Aborted)), errors[0])
    return results


class Lab:
    """Lesson 8's model on ``devices`` (4 ranks of :data:`BUILD_CASE`), the lists the learner's code reads
    (``placement``, ``stage_params``, ``inputs_mb``, ``targets_mb``: changed in place, never rebound) and the
    runs that hand the learner's code to the checks, on :func:`on_threads`.

    Args:
        stage_apply: the lesson's ``stage_apply(layers, x, probes, target=None) -> (output, layer inputs)``.
        devices: at least 4 JAX devices.
    """

    def __init__(self, stage_apply: Callable, devices: list):
        c = BUILD_CASE
        self.p, self.m, self.rows, self.S = c["ranks"], c["microbatches"], c["microbatch_size"], c["ranks"]
        self.params, self.X, self.Y = mlp(c)
        self.reference = jax.grad(mlp_loss)(self.params, self.X, self.Y)
        self.devices, self.calls, self._apply = list(devices)[: self.p], {"layers": 0}, stage_apply
        per = c["layers"] // self.S
        self.home = [self.params[per * s: per * (s + 1)] for s in range(self.S)]
        self.placement = list(range(self.S))
        self.stage_params = [jax.device_put(sp, self.devices[s]) for s, sp in enumerate(self.home)]
        rows, m = self.rows, self.m
        cut = lambda A, device: [jax.device_put(A[j * rows: (j + 1) * rows], device) for j in range(m)]  # noqa: E731
        self.inputs_mb, self.targets_mb = cut(self.X, self.devices[0]), cut(self.Y, self.devices[-1])

    def stage_apply(self, layers, x, probes, target=None):
        """The lesson's ``stage_apply``, counted (so a check sees whether B runs the layers again)."""
        self.calls["layers"] += 1
        return self._apply(layers, x, probes, target)

    def zero_probes(self, s: int, x: jax.Array) -> list:
        """One zero ``(rows, output width)`` array per layer of stage ``s``, ``x``'s dtype."""
        return [jnp.zeros((x.shape[0], W.shape[1]), x.dtype) for W, _ in self.stage_params[s]]

    def _place(self, placement: list) -> None:
        self.placement[:] = placement
        self.stage_params[:] = [jax.device_put(sp, self.devices[r]) for sp, r in zip(self.home, placement)]
        self.targets_mb[:] = [jax.device_put(t, self.devices[placement[-1]]) for t in self.targets_mb]

    def error(self, grads: list) -> float:
        """Largest ``|grads - jax.grad| / max |jax.grad|`` over the parameters (inf: a stage missing)."""
        return self.report(grads)["grad_error"]

    def report(self, grads: list) -> dict:
        """:func:`gradient_report` of each stage's gradient sums (``grads``, None where missing) against
        ``jax.grad``'s."""
        per = len(self.reference) // self.S
        return gradient_report(grads, [self.reference[per * s: per * (s + 1)] for s in range(self.S)])

    def threads(self, num_ranks: int, work: Callable[[int, list], Any]) -> list:
        """``work(rank, inboxes)`` on one thread per rank (:func:`on_threads`)."""
        return on_threads(num_ranks, work)

    def run(self, schedule, rank_loop: Callable) -> tuple[list, Timeline]:
        """``rank_loop(rank, actions, inboxes, events, t0)`` on one thread per rank: each stage's gradient
        sums (a list, None where missing) and the measured timeline (seconds since the start)."""
        return self._run(schedule, rank_loop)[:2]

    def _run(self, schedule, rank_loop: Callable) -> tuple[list, Timeline, list | None, dict]:
        """:meth:`run`'s two results; (rank, seconds since the start) of each call of the learner's ``W``
        (the ``W`` of ``rank_loop``'s module, reached through any name, default argument or closure cell
        of it, counted during the run; None: its module has none); and what moved, ``{"sent": {("F" or
        "B", stage, microbatch): value put in any inbox under that key}, "returned": [the stages each rank's
        loop returned gradients for], "calls": {"F", "B", "W": how many times each ran (None: not read)},
        "w_wrong": :meth:`_w_wrong` of the W calls (None: not read)}``."""
        events: list[Event] = []
        loop = _unwrapped(rank_loop)
        scope = getattr(loop, "__globals__", {})
        calls: dict = {"F": [], "B": [], "W": []}
        rank_of, sent = {}, {}
        t0 = time.perf_counter()

        def counted(name, plain):
            def call(*args, **kwargs):
                out = plain(*args, **kwargs)
                kept = jax.tree_util.tree_map(np.array, out) if name == "W" else None   # a copy: the loop may
                calls[name].append((rank_of.get(threading.get_ident(), -1), time.perf_counter() - t0, kept))
                return out                                                           # add into what it got
            return call

        class Watched:   # an inbox whose puts under lesson 8's keys are kept for the check
            def __init__(self, inbox: Inbox):
                self.inbox, self.take = inbox, inbox.take

            def put(self, key, value, *args, **kwargs):
                if (isinstance(key, tuple) and len(key) == 3 and key[0] in ("F", "B")
                        and all(isinstance(k, (int, np.integer)) for k in key[1:])):
                    sent[key[0], int(key[1]), int(key[2])] = value
                self.inbox.put(key, value, *args, **kwargs)

        def work(rank, inboxes):
            rank_of[threading.get_ident()] = rank
            return rank_loop(rank, schedule.actions[rank], [Watched(i) for i in inboxes], events, t0)

        swap = {k: counted(k, scope[k]) for k in calls if callable(scope.get(k))}
        with _swapped_references(loop, {scope[k]: f for k, f in swap.items()}):
            out = self.threads(schedule.num_ranks, work)
        grads = {s: g for part in out if isinstance(part, dict) for s, g in part.items()}
        timeline = Timeline.from_events(events, schedule.num_ranks, num_stages=self.S, source="measured")
        returned = [sorted(part) if isinstance(part, dict) else [] for part in out]
        w_calls = [(r, t) for r, t, _ in calls["W"]] if "W" in swap else None
        return ([grads.get(s) for s in range(self.S)], timeline, w_calls,
                {"sent": sent, "returned": returned,
                 "calls": {k: len(v) if k in swap else None for k, v in calls.items()},
                 "w_wrong": self._w_wrong(timeline, calls["W"]) if "W" in swap else None})

    def _w_wrong(self, timeline: Timeline, w_calls: list) -> list:
        """The W calls made inside a W or BW action (``w_calls``: rank, time, result) whose result is not
        that action's microbatch's weight gradient (:meth:`microbatch_grads`): [(stage, microbatch,
        relative difference)]. With each right and each W action calling W once, the stage's sum is right
        too."""
        windows = [(e.rank, e.start, e.end, e.action.stage, e.action.microbatch) for e in timeline.events
                   if e.action.kind in ("W", "BW")]
        wrong, own = [], self.microbatch_grads()
        for rank, t, result in w_calls:
            inside = [(s, j) for r, a, b, s, j in windows if r == rank and a <= t <= b]
            if len(inside) == 1:
                off = gradient_report([result], [own.get(inside[0])])["grad_error"] if inside[0] in own \
                    else float("inf")
                if not off <= BUILD_TOLERANCE:
                    wrong.append((*inside[0], off))
        return wrong

    def microbatch_grads(self) -> dict:
        """Each stage's weight gradient from each microbatch alone, ``{(stage, microbatch): [(dA, dc), ...]}``
        as NumPy arrays: what that microbatch's W computes (the loss the microbatch losses' mean)."""
        if not hasattr(self, "_microbatch_grads"):
            per, found = len(self.params) // self.S, {}
            for j in range(self.m):
                X, Y = self._microbatch(j)
                g = jax.grad(lambda params: mlp_loss(params, X, Y) / self.m)(self.params)
                for s in range(self.S):
                    found[s, j] = [tuple(map(np.asarray, layer)) for layer in g[per * s: per * (s + 1)]]
            self._microbatch_grads = found
        return self._microbatch_grads

    def boundaries(self) -> dict:
        """What crosses each stage boundary in a right pipeline, by lesson 8's inbox keys: ``("F", s, j)``,
        stage s's output for microbatch j (s < S - 1), and ``("B", s, j)``, the loss's gradient at stage
        s's input (s > 0; the loss the microbatch losses' mean), as NumPy arrays (rows, width)."""
        if not hasattr(self, "_boundaries"):
            found = {}
            for j in range(self.m):
                X, Y = self._microbatch(j)
                for s in range(self.S):
                    X = mlp_output(self.home[s], X)
                    if s < self.S - 1:
                        found["F", s, j] = np.asarray(X)
                    if s > 0:
                        rest = [layer for stage in self.home[s:] for layer in stage]
                        found["B", s, j] = np.asarray(jax.grad(
                            lambda x: mlp_loss(rest, x, Y) / self.m)(found["F", s - 1, j]))
            self._boundaries = found
        return self._boundaries

    def _microbatch(self, j: int) -> tuple[jax.Array, jax.Array]:
        """Microbatch j's rows of the global batch, ``(X, Y)``, on the default device (``inputs_mb`` and
        ``targets_mb`` hold the same rows, placed on the ranks)."""
        rows = slice(j * self.rows, (j + 1) * self.rows)
        return self.X[rows], self.Y[rows]

    def moved(self, placement: list, traffic: dict) -> dict:
        """What a run's ``traffic`` (:meth:`_run`'s) got wrong against :meth:`boundaries`, on ``placement``:
        ``{"stray": [(rank, stage) returned by a rank not holding it], "missing": [keys never sent that
        cross ranks], "wrong": [(key, relative difference) of values sent that differ], "scale": c where
        every value that differs is c times the right one (a backward started from 1, not 1/m), else
        None}``. Keys naming the receiving stage, not the sending one, are read so too."""
        want = self.boundaries()
        stray = [(r, s) for r, stages in enumerate(traffic["returned"]) for s in stages
                 if not isinstance(s, (int, np.integer)) or not 0 <= s < self.S or placement[s] != r]
        shift = lambda k: (k[0], k[1] + (1 if k[0] == "F" else -1), k[2])  # noqa: E731  (the receiver's)
        sent = traffic["sent"]
        judged = [_judge_sent(want, sent, placement),
                  _judge_sent({shift(k): v for k, v in want.items()}, sent, placement, received=True)]
        best = min(judged, key=lambda j: len(j["wrong"]) + len(j["missing"]))
        return {"stray": stray, **best}

    def run_compiled(self, rank_loop: Callable, names: tuple = ("1f1b", "zb-h1")) -> dict:
        """``rank_loop`` with the lesson's ``F``, ``B``, ``W`` (names it reads from its module's globals)
        compiled with ``jax.jit`` (``F``'s stage index static: one program per stage), per schedule run once
        to compile, then three times. Returns ``{name: (largest gradient error, fastest timeline, its plan:
        zb.simulate with the costs measured_costs reads off it)}`` and prints them."""
        from ..analysis.profiling.timelines import measured_costs
        from ..schedules.simulate import simulate

        scope = rank_loop.__globals__
        plain = {k: scope[k] for k in ("F", "B", "W")}
        jitted = dict(F=jax.jit(plain["F"], static_argnums=0), B=jax.jit(plain["B"]), W=jax.jit(plain["W"]))
        with _swapped(scope, jitted):
            runs = {}
            for name in names:
                schedule = build_schedule(name, self.p, self.m)
                self.run(schedule, rank_loop)  # compiles
                tries = [self.run(schedule, rank_loop) for _ in range(3)]
                fastest = min((t for _, t in tries), key=lambda t: t.makespan)
                plan = simulate(schedule, measured_costs(fastest, self.S))
                runs[name] = (max(self.error(g) for g, _ in tries), fastest, plan)
                print(f"{name}: gradients vs jax.grad {runs[name][0]:.1e}; makespan "
                      f"{fastest.makespan * 1e3:.1f} ms measured, {plan.makespan * 1e3:.1f} ms planned "
                      "from its own mean action times")
        return runs

    def _reference_b(self, s, x, dy, target) -> tuple[float, int | None]:
        """XLA's flops and the traced matrix products of the pullback with respect to x and the probes only
        (the B exercise 8.1 asks for)."""
        f = lambda x, e: self._apply(self.stage_params[s], x, e, target)  # noqa: E731
        _, pb, _ = jax.vjp(f, x, self.zero_probes(s, x), has_aux=True)
        call = lambda t: t[0](t[1])  # noqa: E731
        return _flops_on_arrays(call, (pb, dy))[0], _traced_products(call, (pb, dy))

    def try_stage(self, F: Callable, B: Callable, W: Callable) -> dict:
        """Exercise 8.1's result: the learner's F, B, W on one microbatch of stage 1 and of the last stage,
        beside ``jax.vjp`` of the stage, as :func:`zbpp_lite.course.lesson8.stage_split` reads it."""
        cases = []
        try:
            for s in (1, self.S - 1):
                target = self.targets_mb[0] if s == self.S - 1 else None
                x = jax.device_put(jax.random.normal(jax.random.PRNGKey(s), (self.rows, self.X.shape[1])),
                                   self.devices[self.placement[s]])
                full = lambda layers, x: self._apply(layers, x, self.zero_probes(s, x), target)[0]  # noqa: E731
                ref_y, pullback = jax.vjp(full, self.stage_params[s], x)
                dy = (jnp.float32(1 / self.m) if s == self.S - 1
                      else jax.random.normal(jax.random.PRNGKey(10 + s), ref_y.shape))
                ref_dparams, ref_dx = pullback(dy)
                y, saved = _need(F(s, x, target), "F")
                before = self.calls["layers"]
                dx, for_w = _need(B(saved, dy), "B")
                grads = _need(W(for_w), "W")
                recomputed = self.calls["layers"] != before
                ref_b, ref_b_products = self._reference_b(s, x, dy, target)
                b_products = _traced_products(lambda t: B(*t), (saved, dy))   # before XLA drops unused work
                # what F kept is B's arguments, not constants XLA could fold (a forward run again in B
                # would fold away); a B jax.jit cannot compile: its flops are not counted, the check says so
                b, b_error = _flops_on_arrays(lambda t: B(*t), (saved, dy))
                w_flops, w_error = _flops_on_arrays(W, for_w)
                leaves = lambda t: [np.asarray(a) for a in jax.tree_util.tree_leaves(t)]  # noqa: E731
                w_needs = sum(x.shape[0] * sum(A.shape) * x.dtype.itemsize for A, _ in self.stage_params[s])
                w_products = sum(2 * x.shape[0] * A.size for A, _ in self.stage_params[s])   # x.T @ dz
                cases.append(dict(stage=s, y=np.asarray(y), ref_y=np.asarray(ref_y), dx=np.asarray(dx),
                                  for_w_bytes=nbytes(for_w), w_needs_bytes=w_needs,
                                  ref_dx=np.asarray(ref_dx), b_flops=b, ref_b_flops=ref_b, b_error=b_error,
                                  grads=leaves(grads), ref_grads=leaves(ref_dparams), recomputed=recomputed,
                                  w_flops=w_flops, w_products_flops=w_products, w_error=w_error,
                                  b_products=b_products, ref_b_products=ref_b_products))
        except Exception as e:  # noqa: BLE001  (the learner's error goes to the check)
            return {"error": f"{type(e).__name__}: {e}", "cases": cases}
        return {"error": None, "cases": cases}

    def try_pipeline(self, rank_loop: Callable) -> dict:
        """Exercise 8.2's result: the learner's loop on :data:`PIPELINE_RUNS`, the stages placed as each
        schedule says (put back after): ``{"error", "runs": {name: {"timeline", "w_calls" (:meth:`_run`),
        "moved" (:meth:`moved`), "calls" and "w_wrong" (:meth:`_run`'s), and :func:`gradient_report`'s
        "grad_error", "stage_errors", "scale"}}, "stage": :meth:`try_stage` of the F, B and W the loop's
        module holds (absent without them)}``."""
        def one(name):
            schedule = build_schedule(name, dict(PIPELINE_RUNS)[name], self.m)
            self._place(list(schedule.placement))
            grads, timeline, w_calls, traffic = self._run(schedule, rank_loop)
            return {"timeline": timeline, "w_calls": w_calls, "moved": self.moved(self.placement, traffic),
                    "calls": traffic["calls"], "w_wrong": traffic["w_wrong"], **self.report(grads)}

        fbw = [getattr(_unwrapped(rank_loop), "__globals__", {}).get(k) for k in ("F", "B", "W")]
        try:
            result = try_runs(one, [name for name, _ in PIPELINE_RUNS])
        finally:
            self._place(list(range(self.S)))
        if all(map(callable, fbw)):   # the loop's F, B and W as exercise 8.1 judges them
            result["stage"] = self.try_stage(*fbw)
        return result

    def try_step(self, optimizer_step: Callable) -> dict:
        """Exercise 8.3's result: ``optimizer_step(rank, grads, params, all_sum)`` on one thread per rank, the
        stages placed as in :data:`STEP_RUNS`, from ``jax.grad``'s gradients, the two uses of :data:`TIED` one
        matrix, the second use's given the first's added (so the uses' gradients share a direction), each
        bias's rescaled to twice its matrix's norm (so that every leaf counts in the global norm).
        ``{"error", "runs": {name: {"params": the learner's step; SGD of the whole model clipped to the global
        norm: "want" (the tied matrix's gradient the sum of its uses', counted once in the norm), "no_lr" (the
        learning rate left out), "untied"
        (each use its own gradient), "twice" (the sum counted once per use), "uses" (each use's squares in the
        norm, not the sum's), "per_stage" (each stage clipped alone), "unclipped", "scaled" (to max_norm even
        from below); "calls": each rank's all_sum calls}}}``, each per stage new - old parameters (NumPy), as
        :func:`.lesson8.optimizer_step` reads it; ``STEP``'s ``max_norm`` and ``lr`` set as the run says (put
        back after). A rank waiting :attr:`all_sum_wait` s in ``all_sum`` for another raises RuntimeError."""
        leaves, ((s0, l0), (s1, l1)), per = jax.tree_util.tree_leaves, TIED, len(self.home[0])
        params = list(self.params)   # the model with its tie: the second use's A is the first's
        params[per * s1 + l1] = (params[per * s0 + l0][0], params[per * s1 + l1][1])
        grads = jax.grad(mlp_loss)(params, self.X, self.Y)   # each use's gradient
        home = [params[per * s: per * (s + 1)] for s in range(self.S)]
        # each bias's gradient given twice its matrix's norm: jax.grad's are 0.05% of the norm, so a norm
        # leaving a stage's biases out would pass the tolerance; given so, it is 8% off
        given = [[(A, c * float(2 * jnp.linalg.norm(A) / jnp.maximum(jnp.linalg.norm(c), 1e-30)))
                  for A, c in grads[per * s: per * (s + 1)]] for s in range(self.S)]
        # the second use's gradient given the first's added: jax.grad's two are nearly orthogonal, so a norm
        # from each use's squares, not their sum's, would pass (0.07% off); sharing a direction, it is 2% off
        given[s1][l1] = (given[s1][l1][0] + given[s0][l0][0], given[s1][l1][1])
        per_stage = [leaves(g) for g in given]   # A, c, A, c
        tied = per_stage[s0][2 * l0] + per_stage[s1][2 * l1]
        is_tied = lambda s, i: (s, i) in ((s0, 2 * l0), (s1, 2 * l1))  # noqa: E731  (leaf 2l: layer l's A)
        sq = lambda a: float(jnp.sum(a * a))  # noqa: E731
        free = sum(sq(a) for s, g in enumerate(per_stage) for i, a in enumerate(g) if not is_tied(s, i))
        uses = sq(per_stage[s0][2 * l0]) + sq(per_stage[s1][2 * l1])

        def sgd(scales, lr, summed=True):  # each stage's step, new - old parameters
            return [[np.asarray(-lr * k * (tied if summed and is_tied(s, i) else a))
                     for i, a in enumerate(g)] for s, (g, k) in enumerate(zip(per_stage, scales))]

        def one(name):
            placement, max_norm, lr = STEP_RUNS[name]
            clip = lambda total_sq: [min(1.0, max_norm / total_sq**0.5)] * self.S  # noqa: E731
            alone = [min(1.0, max_norm / sum(map(sq, g)) ** 0.5) for g in per_stage]
            expected = dict(want=sgd(clip(free + sq(tied)), lr),
                            untied=sgd(clip(free + uses), lr, summed=False),
                            twice=sgd(clip(free + 2 * sq(tied)), lr), uses=sgd(clip(free + uses), lr),
                            per_stage=sgd(alone, lr, summed=False),
                            unclipped=sgd([1.0] * self.S, lr),
                            scaled=sgd([max_norm / (free + sq(tied)) ** 0.5] * self.S, lr),
                            no_lr=sgd(clip(free + sq(tied)), 1.0))
            ranks = max(placement) + 1
            all_sum_of, calls = _thread_all_sum(ranks, self.all_sum_wait)

            def work(rank, _inboxes):
                mine = [s for s in range(self.S) if placement[s] == rank]
                return _need(optimizer_step(rank, {s: given[s] for s in mine}, {s: home[s] for s in mine},
                                            all_sum_of(rank)), "optimizer_step")

            kept = dict(STEP)
            STEP.update(max_norm=max_norm, lr=lr)
            try:
                new = {s: v for part in self.threads(ranks, work) for s, v in dict(part).items()}
            finally:
                STEP.update(kept)
            got = [None if s not in new else [np.asarray(a, np.float64) - np.asarray(b)
                                              for a, b in zip(leaves(new[s]), leaves(home[s]))]
                   for s in range(self.S)]
            return dict(params=got, calls=calls, **expected)

        return try_runs(one, STEP_RUNS)

    all_sum_wait = 15.0
    """Seconds :meth:`try_step`'s ``all_sum`` waits for every rank before it gives up."""


def _thread_all_sum(ranks: int, wait: float) -> tuple:
    """``(all_sum_of, calls)`` for ``ranks`` threads: ``all_sum_of(rank)`` is that rank's ``all_sum(x)``,
    which returns the sum of the x every rank passes in its call of the same number (a number or an
    array); ``calls[rank]`` counts its calls. A rank waiting ``wait`` s for the others raises RuntimeError."""
    shared, calls = [0.0] * ranks, [0] * ranks
    barrier = threading.Barrier(ranks, timeout=wait)

    def all_sum_of(rank: int) -> Callable:
        def all_sum(value: Any) -> Any:
            calls[rank] += 1
            shared[rank] = value
            try:
                barrier.wait()
                got = sum(shared)
                barrier.wait()
            except threading.BrokenBarrierError:
                raise RuntimeError(
                    f"all_sum waited {wait:g} s for a rank that never called it (calls so far, rank by rank: "
                    f"{calls}): every rank must join every sum, in the same order, adding 0 where it holds "
                    "nothing") from None
            return got
        return all_sum

    return all_sum_of, calls


def _start_state(lead: tuple, rows: dict, samples: int, d: int, A: Any, c: Any,
                 overlap: bool = False) -> dict:
    """A rank's state before its first tick, zeros cast to varying: ``act``, ``grad`` (*lead, rows,
    samples, d); ``ins``, ``outs``, ``dz`` (*lead, rows, 2, samples, d) (``rows[name]`` rows each); ``dA``,
    ``dc`` shaped as A and c. ``lead``: () for one stage a rank, with ``loss`` () as lesson 9's
    ``pipeline_step`` starts its tick; (2,) for the V's two chunks, no loss (lesson 10's tick keeps none).
    ``overlap``: ``msg`` (samples, d) too, the message the tick before made (none before the first)."""
    from ..runtime.spmd import to_varying

    def zeros(name, *layers):
        return jnp.zeros((*lead, rows[name], *layers, samples, d))

    loss = {} if lead else {"loss": jnp.zeros(())}
    msg = {"msg": jnp.zeros((samples, d))} if overlap else {}
    return to_varying(dict(act=zeros("act"), grad=zeros("grad"), ins=zeros("ins", 2), outs=zeros("outs", 2),
                           dz=zeros("dz", 2), dA=jnp.zeros(A.shape), dc=jnp.zeros(c.shape), **loss, **msg))


def program_of(mesh: Any, case: dict = BUILD_CASE) -> Callable:
    """Lessons 9 and 10's program, for :class:`SpmdLab`: ``program_of(make_tick, name, rows, As, cs, Xm,
    Ym, overlap=False) -> (jitted program, args)``, a ``shard_map`` over ``mesh`` whose rank scans
    ``make_tick(A, c, X, Y, first, last)``'s tick over the state of :func:`_start_state` (``rows[name]``
    rows a buffer) and returns ``(dA, dc, ran)`` by rank, as lesson 9's ``pipeline_step`` does, its loss
    left out. The schedule ``name``'s placement (``stages_of``) decides the rest:

    - one stage a rank (``case``'s layers / 2 = ranks stages): A (2, d, d), c (2, d), no chunk axis;
      ``first``, ``last`` traced booleans; the tick gets ``(kind, microbatch)`` of
      :func:`~zbpp_lite.runtime.spmd.tick_tables`;
    - two a rank (ZB-V's, arXiv 2401.10241 section 6: rank r holds stages r and 2p - 1 - r, its chunks 0
      and 1): a chunk axis first on A (2, 2, d, d), c and every buffer; ``first``, ``last`` (2,), per
      chunk; the tick gets ``(kind, chunk, microbatch, recv)``, recv ``{source: (buffer, chunk,
      microbatch)}``.

    ``overlap``: the tables of ``tick_tables(schedule, overlap=True)`` and the state's ``msg`` (lesson 10's
    tick sending during the next one). Every array float32 and varying over the ranks."""
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from ..runtime.spmd import AXIS, shard_map, tick_tables

    p, m, samples, d = (case[k] for k in ("ranks", "microbatches", "microbatch_size", "width"))

    def rank_program(make_tick, rows, last, overlap, rank_tables, held, A, c, X, Y):
        held, A, c = held[0], A[0], c[0]                          # this rank's stage(s), chunk first
        rank_tables = jax.tree.map(lambda a: a[0], rank_tables)   # this rank's row of each table
        state = _start_state(held.shape, rows, samples, d, A, c, overlap)
        state, ran = lax.scan(make_tick(A, c, X, Y, held == 0, held == last), state, rank_tables)
        return state["dA"][None], state["dc"][None], ran[None]

    def program(make_tick, name, rows, As, cs, X, Y, overlap=False):
        schedule = build_schedule(name, p, m)
        held = np.array([schedule.stages_of(r) for r in range(p)])   # (ranks, chunks)
        t = tick_tables(schedule, overlap)
        if held.shape[1] == 1:                                        # one stage a rank: no chunk axis
            held, tables = held[:, 0], (t.kind, t.microbatch)
        else:
            tables = (t.kind, t.chunk, t.microbatch, t.recv)
        run = shard_map(functools.partial(rank_program, make_tick, rows, held.max(), overlap), mesh,
                        (P(AXIS),) * 4 + (P(), P()), P(AXIS))
        return jax.jit(run), (tables, held, As[held], cs[held], X, Y)

    return program


def _stub(make_tick: Callable) -> bool:
    """Whether a learner's ``make_tick`` is still a body of ``...`` (returns None; a real one may refuse the
    None arguments it is probed with)."""
    try:
        return make_tick(*[None] * 6) is None
    except Exception:  # noqa: BLE001
        return False


def _need(value: Any, name: str) -> Any:
    if value is None or value is Ellipsis:
        raise NotImplementedError(f"{name} returned {value!r}: replace its ... with your code")
    return value


def model_claims(devices: list) -> dict:
    """Lesson 10's "Toward a model of your own", the claims its tied-weight cell does not show, run on
    ``devices`` (at least 4: a 2 x 2 mesh for the data axis). Returns ``{"dropout": whether the package's
    masks (runtime.stages.dropout_keys, folded with the part) are the same for the same step, part and
    microbatch, then differ for another microbatch, part and step (four bools, True each); "nnx": the largest
    difference of nnx.merge(*nnx.split(layer)) from the layer; "data": the largest relative difference of two
    pipeline copies' gradient (each weight cast to varying over "data", one lax.pmean) from the whole
    batch's; "data uncast": that gradient over the whole batch's when the weight is passed whole over "data"
    (2: summed over the copies before the pmean)}``."""
    from flax import nnx
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P

    from ..runtime.spmd import shard_map, to_varying as vary
    from ..runtime.stages import dropout_keys

    claims, (n, d) = {}, (8, 16)
    keys = jax.random.split(jax.random.key(2), 6)
    x = jax.random.normal(keys[1], (n, d))

    def mask(step, part, j):
        key = jax.random.fold_in(dropout_keys(7, step, 8)[j], part)   # the step, microbatch j, then the part
        return np.asarray(jax.random.bernoulli(key, 0.9, (n, d)))
    claims["dropout"] = [bool((mask(0, 1, 3) == mask(0, 1, 3)).all())] + \
        [bool((mask(0, 1, 3) != other).any()) for other in (mask(0, 1, 4), mask(0, 2, 3), mask(1, 1, 3))]

    layer = nnx.Linear(d, d, rngs=nnx.Rngs(0))
    claims["nnx"] = float(jnp.max(jnp.abs(nnx.merge(*nnx.split(layer))(x) - layer(x))))

    dp, p, m = 2, 2, 2                                 # 2 copies of a 2-rank pipeline, 2 microbatches each
    As = jax.random.normal(keys[3], (p, d, d)) / d**0.5
    X, Y = (jax.random.normal(k, (dp, m, n, d)) for k in keys[4:])
    grid = Mesh(np.array(devices[:dp * p]).reshape(dp, p), ("data", "rank"))

    def step(cast):                                    # cast: what a weight passed whole over "data" gets
        def per_device(A, X, Y):
            A, X, Y, rank = cast(A[0]), X[0], Y[0], lax.axis_index("rank")

            def copy_loss(A):                          # lesson 9's forward, the loss on the last rank
                def tick(x_in, t):
                    out = jnp.tanh(jnp.where(rank == 0, X[jnp.clip(t, 0, m - 1)], x_in) @ A)
                    out = jnp.where((t >= rank) & (t - rank < m), out, 0.0)
                    return lax.ppermute(out, "rank", [(0, 1)]), out
                _, outs = lax.scan(tick, vary(vary(jnp.zeros((n, d)), "rank"), "data"), jnp.arange(m + p - 1))
                return lax.psum(jnp.where(rank == p - 1, jnp.mean((outs[p - 1:] - Y) ** 2), 0.0), "rank")
            return lax.pmean(jax.grad(copy_loss)(A), "data")[None]   # the copies' gradients, averaged
        return jax.jit(shard_map(per_device, grid, (P("rank"), P("data"), P("data")), P("rank")))(As, X, Y)

    whole_batch = lambda As: mlp_loss([(A, jnp.zeros(d)) for A in As], X.reshape(-1, d), Y.reshape(-1, d))  # noqa: E731
    reference = jax.grad(whole_batch)(As)                # one device, the whole batch, no bias
    claims["data"] = _rel_diff(step(lambda A: vary(A, "data")), reference)
    uncast = step(lambda A: A)
    claims["data uncast"] = float(jnp.sum(uncast * reference) / jnp.sum(reference * reference))
    return claims
