"""The backward split: one stage's F, B, W and fused BW as jitted pure functions.

Qi et al. (arXiv 2401.10241) section 2: the backward of ``y = x W`` is B, ``dx = dy W^T`` (critical path),
and W, ``dW = x^T dy`` (can wait and fill bubbles). A stage ``fn(params, x, aux) -> y`` is traced to a
jaxpr (jit calls inlined); a *weight operation* has an operand that depends on the parameters only and an
output that depends on parameters and activations (a kernel, a LayerNorm scale, a bias).

1. F runs the stage under ``jax.vjp`` w.r.t. the input and a zero "probe" added to each weight operation's
   output; it keeps B's residuals (less the parameters) and W's operands (``x^T`` for a product, ``x_hat``
   for a scale, nothing for a bias), never twice: an operand B holds already is handed over by B.
2. B runs that pullback: ``dx`` (none with ``input_grad=False``) and each weight operation's output gradient.
3. W is the vjp of the weight operations alone on the kept operands (``x^T dy``, ``sum(dy)``,
   ``sum(dy * x_hat)``); nothing is recomputed. BW is B then W in one program (GPipe, 1F1B).
4. In the flat programs (:class:`FlatStage`) B also computes the elementwise weight gradients (bias, scale)
   outside checkpoints; W is the products alone.

What F keeps and what B hands W (:class:`SplitPlan`) is read once, when the split is made, from the jaxpr of
F and its pullback; F, B, W and BW are pure functions of that plan, traced once each, in any order.

Side effects run in F only. ``jax.checkpoint`` bodies are inlined and F evaluates them as a region under
the same policy; W's operands inside are recomputed by B. A ``scan`` over a layer stack is split inside (W
is one batched ``x^T dy`` per layer); other loops stay one weight operation whose W re-runs their vjp. The
``scan`` equation is read on JAX 0.4.35 through 0.12. Cost and memory (section 2.1's M_B, M_W):
``benchmarks/bench_split_cost.py``, ``benchmarks/bench_split_targets.py``, ``tests/test_split.py``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from .memory import nbytes

try:  # JAX >= 0.4.30
    from jax.extend.core import Literal
except ImportError:  # pragma: no cover - older JAX
    from jax.core import Literal

_INLINE = {"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2"}
"""Call primitives inlined so weight operations inside are found (``while`` etc. stay whole)."""
_REMAT = {"checkpoint", "remat", "remat2"}
"""Checkpoints: inlined and remembered as a :class:`_Region` (nested ones belong to the outer one)."""
_OPERAND_FREE = {"add", "sub", "add_any"}
"""Weight operations whose vjp for the parameter side does not read the other operand."""
_IN_B = {"add", "sub", "mul", "add_any"}
"""Elementwise weight operations whose parameter gradient the flat B computes (module docstring, step 4)."""


# ---------------------------------------------------------------------------- flat program


@dataclass(frozen=True)
class _Const:
    value: Any


@dataclass(frozen=True)
class Slot:
    """A value of the stage's program that F or B hands on: the output ``ref`` of a node; with ``transpose``
    ``(rows, k)``, a product's ``x`` as the (k, rows) matrix ``x^T``; with ``loop``, the value ``ref`` of the
    body of the split ``scan`` at node ``loop``, stacked over its iterations."""

    ref: int
    transpose: tuple[int, int] | None = None
    loop: int | None = None


@dataclass
class _Node:
    eqn: Any  # the jaxpr equation (primitive + params)
    ins: tuple  # refs (int) or _Const
    outs: tuple[int, ...]

    def run(self, values: Sequence[Any]) -> list:
        prim = self.eqn.primitive
        params = prim.get_bind_params(self.eqn.params)
        sub = ()
        if isinstance(params, tuple):  # JAX < 0.7 returns (subfuns, params)
            sub, params = params
        with getattr(getattr(self.eqn, "ctx", None), "manager", None) or contextlib.nullcontext():
            out = prim.bind(*sub, *values, **params)
        return list(out) if prim.multiple_results else [out]


@dataclass(frozen=True)
class _Region:
    """Nodes ``start .. end - 1`` of a program: the inlined body of one (outermost) checkpoint."""

    start: int
    end: int
    policy: Any  # the checkpoint's policy (None: save nothing but the region's inputs)
    prevent_cse: bool
    inputs: tuple[int, ...] = ()  # refs the region reads from outside
    outputs: tuple[int, ...] = ()  # refs it defines that are read outside (or are stage outputs)
    probes: tuple[int, ...] = ()  # probed refs it defines
    recomputed: tuple[Slot, ...] = ()  # W's operands it defines that B recomputes


@dataclass
class _Program:
    """A stage's jaxpr as a flat list of nodes over integer refs, with dependence marks."""

    nodes: list[_Node] = field(default_factory=list)
    avals: dict[int, Any] = field(default_factory=dict)
    inputs: list[int] = field(default_factory=list)
    outputs: list = field(default_factory=list)
    regions: list[_Region] = field(default_factory=list)

    def new_ref(self, aval) -> int:
        ref = len(self.avals)
        self.avals[ref] = aval
        return ref


def _flatten(
    prog: _Program, jaxpr, consts: Sequence[Any], ins: Sequence[Any], in_region: bool = False
) -> list:
    env: dict = {}

    def read(v):
        return _Const(v.val) if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = _Const(c)
    for v, r in zip(jaxpr.invars, ins):
        env[v] = r
    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if eqn.primitive.name in _INLINE and inner is not None:
            closed_consts = getattr(inner, "consts", ())
            region = (
                eqn.primitive.name in _REMAT and not in_region
            )  # a nested checkpoint: part of the outer one
            start = len(prog.nodes)
            outs = _flatten(prog, getattr(inner, "jaxpr", inner), closed_consts, args, in_region or region)
            if region and len(prog.nodes) > start:
                prog.regions.append(
                    _Region(
                        start,
                        len(prog.nodes),
                        eqn.params.get("policy"),
                        bool(eqn.params.get("prevent_cse", True)),
                    )
                )
        else:
            outs = [prog.new_ref(v.aval) for v in eqn.outvars]
            prog.nodes.append(_Node(eqn, tuple(args), tuple(outs)))
        for v, r in zip(eqn.outvars, outs):
            env[v] = r
    return [read(v) for v in jaxpr.outvars]


@dataclass(frozen=True)
class _WeightOp:
    node: int  # index into the program's nodes
    weight_inputs: tuple[int, ...]  # operand positions that depend on the parameters only
    kept_inputs: tuple[int, ...]  # operand positions F keeps for W
    probed: tuple[int, ...]  # output refs whose gradient B returns
    matmul: tuple[int, int, int] | None = None  # (rows, k, n) when the op is x (rows, k) @ w (k, n)


def _matmul_shape(
    node: _Node, weight_inputs: tuple[int, ...], kept_inputs: tuple[int, ...], avals
) -> tuple[int, int, int] | None:
    """``(rows, k, n)`` when a weight operation is a plain ``x @ w`` (no batch dims, one dtype), else None."""
    eqn = node.eqn
    if eqn.primitive.name != "dot_general" or weight_inputs != (1,) or kept_inputs != (0,):
        return None
    (lc, rc), (lb, rb) = _param(eqn, "dimension_numbers")
    x, w, out = avals[node.ins[0]], avals[node.ins[1]], avals[node.outs[0]]
    if lb or rb or not lc or not (x.dtype == w.dtype == out.dtype):
        return None
    if tuple(lc) != tuple(range(x.ndim - len(lc), x.ndim)) or tuple(rc) != tuple(range(len(rc))):
        return None
    k = math.prod(w.shape[: len(rc)])
    return math.prod(x.shape[: x.ndim - len(lc)]), k, math.prod(w.shape[len(rc) :])


def _kept_slots(prog: _Program, weight_ops: list, skip: frozenset = frozenset()) -> tuple[Slot, ...]:
    """W's operands of ``weight_ops`` (those at ``skip`` left out), each once: as they are, then a product's
    ``x`` as the (k, rows) matrix ``x^T``: W's ``x^T dy`` is then a plain row-major product, where ``x``
    contracted over its rows makes XLA's CPU backend transpose ``dy`` or take a slower product (1.5-2x on
    this model's W)."""
    kept = [(op, prog.nodes[op.node].ins[k]) for j, op in enumerate(weight_ops) if j not in skip
            for k in op.kept_inputs]
    return tuple(dict.fromkeys(Slot(r) for op, r in kept if op.matmul is None)) + tuple(
        dict.fromkeys(Slot(r, op.matmul[:2]) for op, r in kept if op.matmul is not None)
    )


def _mark_program(
    prog: _Program, on_p: set, on_a: set, split_loop: Callable | None = None
) -> tuple[list, dict]:
    """Mark refs in ``on_p`` / ``on_a`` (updated in place); returns ``(weight_ops, {node index: _Loop})``.
    A node for which ``split_loop(i, node)`` gives a :class:`_Loop` is not a weight op: its body's are."""
    weight_ops, loops = [], {}
    for i, node in enumerate(prog.nodes):
        if not node.outs:
            continue  # a side effect only (jax.debug.print / callback): F runs it, B and W skip it
        refs = [r for r in node.ins if isinstance(r, int)]
        p, a = any(r in on_p for r in refs), any(r in on_a for r in refs)
        if p:
            on_p.update(node.outs)
        if a:
            on_a.update(node.outs)
        if not (p and a):
            continue
        weight = tuple(
            k for k, r in enumerate(node.ins) if isinstance(r, int) and r in on_p and r not in on_a
        )
        if not weight:
            continue  # parameters reach this op only through activations: not a weight op
        loop = split_loop(i, node) if split_loop is not None else None
        if loop is not None:
            loops[i] = loop
            continue
        kept = (
            ()
            if node.eqn.primitive.name in _OPERAND_FREE
            else tuple(k for k, r in enumerate(node.ins) if isinstance(r, int) and r in on_a)
        )
        probed = tuple(r for r in node.outs if jnp.issubdtype(prog.avals[r].dtype, jnp.inexact))
        weight_ops.append(_WeightOp(i, weight, kept, probed, _matmul_shape(node, weight, kept, prog.avals)))
    return weight_ops, loops


def sum_dtype(dtype: Any) -> Any:
    """The dtype a parameter's gradient sums are kept in: float32 for lower-precision floats (bfloat16,
    float16), so a sum over many microbatches rounds like float32, not like its addends; float32 and
    float64 as they are."""
    return jnp.promote_types(dtype, jnp.float32)


def _in_sum_dtype(grads) -> tuple:
    """Each gradient leaf in its :func:`sum_dtype`."""
    return tuple(g.astype(sum_dtype(g.dtype)) for g in grads)


def _op_cotangent(node: _Node, op: _WeightOp, avals: dict, weights: tuple, dys: tuple, others: dict) -> tuple:
    """Vjp of one weight op w.r.t. ``weights`` for ``dys``; ``others``: its other operands by position."""

    def outputs(*weights):
        values = []
        for k, r in enumerate(node.ins):
            if k in op.weight_inputs:
                values.append(weights[op.weight_inputs.index(k)])
            elif k in others:
                values.append(others[k])
            else:
                values.append(jnp.zeros_like(weights[0], shape=avals[r].shape, dtype=avals[r].dtype))
        out = dict(zip(node.outs, node.run(values)))
        return tuple(out[r] for r in op.probed)

    return jax.vjp(outputs, *weights)[1](dys)


@dataclass(frozen=True)
class _Loop:
    """A ``scan`` split inside: probes go in like ``xs``, W's operands come out stacked like ``ys``."""

    body: _Program
    num_consts: int
    num_carry: int
    scan: dict  # lax.scan's length, reverse, unroll
    on_a: frozenset
    weight_ops: tuple
    probe_refs: tuple  # body refs
    slots: tuple[Slot, ...]  # W's operands in the body


def _unsupported(eqn, what: str) -> ValueError:
    """The one-line refusal for an equation whose params the split cannot read."""
    name = eqn.primitive.name
    return ValueError(
        f"the split cannot read JAX {jax.__version__}'s {name!r} equation: {what} "
        f"(its params: {', '.join(sorted(eqn.params))}); "
        f"it reads JAX 0.4.35 through 0.12: use one of those, or write the stage without {name!r}"
    )


def _param(eqn, key: str) -> Any:
    """``eqn.params[key]``, or the one-line refusal naming the primitive and the JAX version."""
    if key not in eqn.params:
        raise _unsupported(eqn, f"no {key!r}")
    return eqn.params[key]


def _scan_counts(eqn) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan``: its params up to JAX 0.11, ``ft_in``'s groups in 0.12.

    Raises:
        ValueError: neither form (one line naming the primitive and the JAX version).
    """
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:
        return int(p["num_consts"]), int(p["num_carry"])
    try:
        consts, carry, xs = p["ft_in"].unpack()
        counts = len(consts), len(carry), len(xs)
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        what = "no num_consts / num_carry, and no ft_in of three groups (consts, carry, xs)"
        raise _unsupported(eqn, what) from e
    if sum(counts) != len(eqn.invars):
        raise _unsupported(eqn, f"ft_in counts {counts} operands, the equation has {len(eqn.invars)}")
    return counts[0], counts[1]


def _split_loop(prog: _Program, node: _Node, on_p: set, on_a: set) -> _Loop | None:
    """The :class:`_Loop` of a ``scan`` with activation carries and no nested loop, else ``None``."""
    eqn = node.eqn
    if eqn.primitive.name != "scan":
        return None
    nc, nk = _scan_counts(eqn)
    closed = _param(eqn, "jaxpr")
    body = _Program()
    body.inputs = [body.new_ref(v.aval) for v in closed.jaxpr.invars]
    body.outputs = _flatten(body, closed.jaxpr, closed.consts, body.inputs, in_region=True)
    if any(n.eqn.primitive.name in ("scan", "while", "cond") for n in body.nodes):
        return None  # a nested loop or branch: not split (W re-runs the scan's vjp)
    outer = [r if isinstance(r, int) else None for r in node.ins]
    if any(r is not None and r in on_p and r not in on_a for r in outer[nc : nc + nk]):
        return None  # a carry that starts from the parameters alone (a learned initial state)
    b_on_p = {b for b, r in zip(body.inputs, outer) if r is not None and r in on_p}
    b_on_a = {b for b, r in zip(body.inputs, outer) if r is not None and r in on_a}
    b_on_a |= set(body.inputs[nc : nc + nk])  # every carry is an activation (one starting from zeros too)
    weight_ops, _ = _mark_program(body, b_on_p, b_on_a)
    if not weight_ops:
        return None
    slots = _kept_slots(body, weight_ops)
    probes = tuple(r for op in weight_ops for r in op.probed)
    scan = {"length": _param(eqn, "length"), "reverse": _param(eqn, "reverse")}
    scan["unroll"] = eqn.params.get("unroll", 1)
    return _Loop(body, nc, nk, scan, frozenset(b_on_a), tuple(weight_ops), probes, slots)


class Handover(NamedTuple):
    """What B hands W (section 2), a pytree of arrays.

    Attributes:
        output_grads: weight operations' output gradients W reads (flat: each distinct one once; pytree
            functions: one per probe, top-level first, then a split ``scan``'s stacked per iteration).
        recomputed: W's operands recomputed in checkpoints (region order), then those held by B (step 1).
        b_grads: B's share of the parameter gradients (step 4); empty in the pytree functions.
    """

    output_grads: tuple
    recomputed: tuple
    b_grads: tuple


@dataclass(frozen=True)
class _FromParams:
    """A residual of F's pullback that is parameter leaf ``index`` itself: B takes it from its parameters
    (a kernel for ``dx = dy W^T``), F does not copy it per microbatch."""

    index: int


@dataclass(frozen=True)
class _Zeros:
    """A residual that is one of F's zero probes or sinks (a checkpoint saves its inputs): B makes it anew."""

    shape: tuple[int, ...]
    dtype: Any


@dataclass(frozen=True)
class _Own:
    """A residual F outputs in ``own``; a typed PRNG key (``key_impl``) leaves as its data, B wraps it."""

    key_impl: Any = None


@dataclass(frozen=True)
class _Held:
    """A W operand that F's own residual number ``own`` holds already (a checkpoint's input, tanh's output):
    F keeps it once, B hands it to W (transposed for a product)."""

    slot: Slot
    own: int


@dataclass(frozen=True)
class SplitPlan:
    """What F keeps and what B hands W, read once from the jaxpr of F and its pullback (section 2).

    Attributes:
        res_tree: the structure of F's pullback (``jax.vjp``'s), whose leaves B gets back.
        residuals: per leaf of the pullback, where B gets it: :class:`_FromParams`, :class:`_Zeros` or
            :class:`_Own` (in ``own``, in this order).
        kept: W's operands F keeps (the rest are recomputed by B or held by B's residuals).
        held: W's operands B's residuals hold, handed to W after those recomputed.
        grad_places: per probe, its output gradient's place among the flat handover's distinct ones (a
            Linear's product and its bias addition share one); None: only B's share reads it.
        distinct: per distinct output gradient, the first probe that has it.
    """

    res_tree: Any
    residuals: tuple[_FromParams | _Zeros | _Own, ...]
    kept: tuple[Slot, ...]
    held: tuple[_Held, ...]
    grad_places: tuple[int | None, ...]
    distinct: tuple[int, ...]


@dataclass(frozen=True)
class FlatStage:
    """A stage's jitted F, B, W and BW over flat tuples (``p = tuple(tree_leaves(params))``; no pytree walk
    per call), what the executor runs. ``x``, ``aux``, ``dy``, ``dx`` as in :class:`StageSplit`.

    - ``forward(p, x, aux, spare=None) -> (y, own, kept)``: ``own`` is B's residuals less the parameters,
      then the operands of B's share of the parameter gradients.
    - ``backward_input(p, own, dy, spare=None) -> (dx, handover)``: a :class:`Handover`.
    - ``backward_weight(p, kept, handover, acc) -> acc + dparams`` (``dparams`` when ``acc`` is None).
    - ``backward_fused(p, own, kept, dy, acc) -> (dx, acc + dparams)``.

    The sums (``acc`` and what W returns) are in each leaf's :func:`sum_dtype`: float32 for bfloat16 or
    float16 parameters.

    ``acc`` is donated (do not reuse it), and so is ``spare``: dead arrays of the outputs' shapes (an earlier
    microbatch's ``own`` or handover) whose memory the outputs reuse, saving the page faults of new
    buffers (a sizeable share of F on the CPU).
    """

    forward: Callable
    backward_input: Callable
    backward_weight: Callable
    backward_fused: Callable


class StageSplit:
    """F, B, W and BW of one stage function, for one set of input shapes.

    Args:
        fn: pure ``fn(params, x, aux) -> y`` over pytrees of arrays; ``aux`` (labels, or None) is not
            differentiated.
        params, x, aux: example arguments (only shapes and dtypes are used).
        input_grad: whether B returns ``dx`` (False for the first stage, whose input is data).

    Pure functions running jitted programs:

    - ``forward(params, x, aux) -> (y, res, kept)``: B's residuals (the parameters B needs among them,
      not copied) and W's operands, tuples of arrays.
    - ``backward_input(res, dy) -> (dx, handover)``: ``dx`` (None without ``input_grad``), :class:`Handover`.
    - ``backward_weight(params, kept, handover, acc) -> acc + dparams`` (``acc``: pytree like ``params``,
      each leaf in its :func:`sum_dtype`, float32 for bfloat16 parameters).
    - ``backward_fused(params, res, kept, dy, acc) -> (dx, acc + dparams)``: B then W.

    ``weight_gradient(params, kept, handover)`` is W without ``acc``; ``flat`` is a :class:`FlatStage`.

    F, B, W and BW are pure functions of :attr:`plan` (a :class:`SplitPlan`, read from the jaxpr when the
    split is made) and their arguments: each is traced once, in any order.

    Raises:
        ValueError: an output that does not depend on the stage input, or a non-float output; W
            given another stage's handover.
    """

    def __init__(self, fn: Callable, params: Any, x: Any, aux: Any = None, *, input_grad: bool = True):
        self.input_grad = input_grad
        flat, self._in_tree = jax.tree_util.tree_flatten((params, x, aux))
        self._params_tree = jax.tree_util.tree_structure(params)
        self._x_tree = jax.tree_util.tree_structure(x)
        n_p, n_x = self._params_tree.num_leaves, len(jax.tree_util.tree_leaves(x))
        closed, out_shape = jax.make_jaxpr(
            lambda *a: fn(*jax.tree_util.tree_unflatten(self._in_tree, a)), return_shape=True
        )(*flat)
        self._out_tree = jax.tree_util.tree_structure(out_shape)
        prog = _Program()
        prog.inputs = [prog.new_ref(v.aval) for v in closed.jaxpr.invars]
        prog.outputs = _flatten(prog, closed.jaxpr, closed.consts, prog.inputs)
        self._prog = prog
        self._param_refs = prog.inputs[:n_p]
        self._x_refs = prog.inputs[n_p : n_p + n_x]
        self._aux_refs = prog.inputs[n_p + n_x :]
        self._mark()
        self.plan = self._read_plan(flat)
        self.flat = FlatStage(
            forward=jax.jit(self._forward_flat, donate_argnums=3, keep_unused=True),
            backward_input=jax.jit(self._backward_input_flat, donate_argnums=3, keep_unused=True),
            backward_weight=jax.jit(self._backward_weight_flat, donate_argnums=3),
            backward_fused=jax.jit(self._backward_fused_flat, donate_argnums=4),
        )
        self.backward_input = jax.jit(self._backward_input)
        self.weight_gradient = jax.jit(self._weight_gradient)
        self.backward_weight = jax.jit(self._backward_weight)
        self.backward_fused = jax.jit(self._backward_fused)

    def forward(self, params, x, aux):
        """F: ``(y, res, kept)``; see the class docstring."""
        p = tuple(jax.tree_util.tree_leaves(params))
        y, own, kept = self.flat.forward(p, x, aux)
        # here W does all the parameter gradients: it keeps the operands the flat B would take
        return y, self._residuals(p, own, jax.tree_util.tree_leaves(x)[0]), kept + self._split_own(own)[1]

    # ------------------------------------------------------------------ analysis

    def _mark(self) -> None:
        prog = self._prog
        on_p = set(self._param_refs)  # depends on the parameters
        on_a = set(self._x_refs) | set(self._aux_refs)  # depends on input or labels
        in_region = {i for reg in prog.regions for i in range(reg.start, reg.end)}
        weight_ops, self._loops = _mark_program(
            prog, on_p, on_a, lambda i, node: None if i in in_region else _split_loop(prog, node, on_p, on_a)
        )
        for r in prog.outputs:
            if not isinstance(r, int) or r not in on_a:
                raise ValueError(
                    "a stage output does not depend on the stage input; every output must come from x"
                )
            if not jnp.issubdtype(prog.avals[r].dtype, jnp.inexact):
                raise ValueError(
                    f"stage outputs must be floating point to be differentiated, got {prog.avals[r].dtype}"
                )
        self._on_a, self._on_p = on_a, on_p
        self.weight_ops = tuple(weight_ops)
        self._mark_b_share(in_region)
        # each top-level probe's weight operation
        self._probe_op = tuple(j for j, op in enumerate(weight_ops) for _ in op.probed)
        self._probe_refs = tuple(r for op in weight_ops for r in op.probed)
        # a split loop's probes and W operands, stacked over its iterations
        loops = self._loops.items()
        self._probe_refs += tuple(Slot(r, loop=i) for i, loop in loops for r in loop.probe_refs)
        self._loop_slots = tuple(replace(slot, loop=i) for i, loop in loops for slot in loop.slots)
        self._mark_regions(_kept_slots(prog, weight_ops, self._b_ops))

    def _mark_b_share(self, in_region: set) -> None:
        """Mark B's share (step 4): elementwise weight ops outside checkpoints, their operands and leaves."""
        prog, weight_ops = self._prog, self.weight_ops
        self._b_ops = frozenset(
            j
            for j, op in enumerate(weight_ops)
            if op.matmul is None
            and op.node not in in_region
            and prog.nodes[op.node].eqn.primitive.name in _IN_B
        )
        self._b_kept_refs = tuple(
            dict.fromkeys(
                prog.nodes[weight_ops[j].node].ins[k]
                for j in sorted(self._b_ops)
                for k in weight_ops[j].kept_inputs
            )
        )
        reached = {
            prog.nodes[weight_ops[j].node].ins[k] for j in self._b_ops for k in weight_ops[j].weight_inputs
        }
        # the parameters those operations read, through parameter-only operations
        for node in reversed(prog.nodes):
            if any(r in reached for r in node.outs):
                reached.update(r for r in node.ins if isinstance(r, int))
        self._b_leaves = tuple(i for i, r in enumerate(self._param_refs) if r in reached)

    def _mark_regions(self, slots: tuple) -> None:
        """Each checkpoint region's inputs, outputs, probes and the W operands (``slots``) B recomputes
        inside it."""
        prog = self._prog
        recomputed: list = []
        regions: list = []
        for reg in prog.regions:
            inside = range(reg.start, reg.end)
            defined = {r for i in inside for r in prog.nodes[i].outs}
            read_outside = {
                r for i, n in enumerate(prog.nodes) if i not in inside for r in n.ins if isinstance(r, int)
            }
            read_outside |= {r for r in prog.outputs if isinstance(r, int)}
            inputs = tuple(
                dict.fromkeys(
                    r for i in inside for r in prog.nodes[i].ins if isinstance(r, int) and r not in defined
                )
            )
            outputs = tuple(r for i in inside for r in prog.nodes[i].outs if r in read_outside)
            probes = tuple(r for r in self._probe_refs if r in defined)
            regions.append(replace(
                reg, inputs=inputs, outputs=outputs, probes=probes,
                recomputed=tuple(slot for slot in slots if slot.ref in defined and slot.ref not in outputs
                                 and jnp.issubdtype(prog.avals[slot.ref].dtype, jnp.inexact)),
            ))
            recomputed += regions[-1].recomputed
        prog.regions = regions
        self._b_slots = tuple(recomputed)  # W's operands B recomputes, in region order
        self._f_slots = (
            tuple(slot for slot in slots if slot not in set(recomputed)) + self._loop_slots
        )  # those F keeps
        self._ticks = sum(1 for reg in prog.regions if reg.recomputed)

    @staticmethod
    def _slot(env, slot: Slot):
        """A W operand's value: ``x``, a product's ``x^T``, or a loop's stacked per iteration."""
        if slot.loop is not None:
            return env[slot]
        return env[slot.ref] if slot.transpose is None else env[slot.ref].reshape(slot.transpose).T

    def _slot_aval(self, slot: Slot):
        a = self._prog.avals[slot.ref]
        return (a.shape if slot.transpose is None else slot.transpose[::-1]), a.dtype

    def _probe_aval(self, key):
        if isinstance(key, int):
            return self._prog.avals[key]
        loop = self._loops[key.loop]
        a = loop.body.avals[key.ref]
        return jax.ShapeDtypeStruct((loop.scan["length"], *a.shape), a.dtype)

    def _run_loop(self, i: int, env: dict, probes: dict) -> None:
        """F of a split loop: the scan, with per-iteration probes in and W's operands out."""
        node, loop = self._prog.nodes[i], self._loops[i]
        ins = [self._read(env, r) for r in node.ins]
        nc, nk = loop.num_consts, loop.num_carry
        consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        stacked = tuple(probes[Slot(r, loop=i)] for r in loop.probe_refs)

        def step(carry, scanned):
            xs_i, probes_i = scanned
            benv = dict(zip(loop.body.inputs, [*consts, *carry, *xs_i]))
            for n in loop.body.nodes:
                self._run_node(n, benv, dict(zip(loop.probe_refs, probes_i)))
            outs = [self._read(benv, r) for r in loop.body.outputs]
            return outs[:nk], (outs[nk:], tuple(self._slot(benv, slot) for slot in loop.slots))

        carry, (ys, kept) = jax.lax.scan(step, init, (xs, stacked), **loop.scan)
        env.update(zip(node.outs, [*carry, *ys]))
        env.update(zip((replace(slot, loop=i) for slot in loop.slots), kept))

    @property
    def weight_primitives(self) -> tuple[str, ...]:
        """Each weight operation's primitive in program order (``dot_general``, ``mul``, ``add``, ...),
        then those inside each split ``scan`` as ``"scan/dot_general"``, ..."""
        top = tuple(self._prog.nodes[op.node].eqn.primitive.name for op in self.weight_ops)
        return top + tuple(
            f"scan/{loop.body.nodes[op.node].eqn.primitive.name}"
            for loop in self._loops.values()
            for op in loop.weight_ops
        )

    # ------------------------------------------------------------------ evaluation

    @staticmethod
    def _run_node(node: _Node, env: dict, probes: dict) -> None:
        outs = node.run([r.value if isinstance(r, _Const) else env[r] for r in node.ins])
        for r, v in zip(node.outs, outs):
            env[r] = v + probes[r] if r in probes else v

    def _evaluate(
        self, p_leaves, x_leaves, aux_leaves, probes: dict[int, Any], sinks: dict | None = None
    ) -> tuple[dict, list]:
        """The stage's values by ref, and one "tick" ``sum(sink * stop_gradient(operand))`` per region with
        W operands (zero in F); its pullback gives ``d tick / d sink = operand``, recomputed by B."""
        prog = self._prog
        env = dict(zip(self._param_refs, p_leaves))
        env.update(zip(self._x_refs, x_leaves))
        env.update(zip(self._aux_refs, aux_leaves))
        regions = {reg.start: reg for reg in prog.regions}
        ticks: list = []
        i = 0
        while i < len(prog.nodes):
            reg = regions.get(i)
            if reg is None:
                if i in self._loops:
                    self._run_loop(i, env, probes)
                else:
                    self._run_node(prog.nodes[i], env, probes)
                i += 1
                continue

            def body(ins, prb, snk, reg=reg):
                local = dict(zip(reg.inputs, ins))
                for node in prog.nodes[reg.start : reg.end]:
                    self._run_node(node, local, dict(zip(reg.probes, prb)))
                tick = sum(
                    (
                        jnp.vdot(s, jax.lax.stop_gradient(self._slot(local, slot))).astype(jnp.float32)
                        for s, slot in zip(snk, reg.recomputed)
                    ),
                    jnp.zeros((), jnp.float32),
                )
                return tuple(local[r] for r in reg.outputs), tick

            snk = tuple(sinks[slot] for slot in reg.recomputed) if reg.recomputed else ()
            outs, tick = jax.checkpoint(body, policy=reg.policy, prevent_cse=reg.prevent_cse)(
                tuple(env[r] for r in reg.inputs), tuple(probes[r] for r in reg.probes), snk
            )
            env.update(zip(reg.outputs, outs))
            if reg.recomputed:
                ticks.append(tick)
            i = reg.end
        return env, ticks

    def _read(self, env, r):
        return r.value if isinstance(r, _Const) else env[r]

    def _f_vjp(self, p_leaves, x, aux) -> tuple:
        """F's ``jax.vjp``: ``(y, pullback, kept, raw, b_kept, made)``: W's operands at ``_f_slots`` as F
        keeps them (``x^T`` for a product) and as they are (None for a loop's), the operands of B's share,
        and the zero probes and sinks F made (a checkpoint saves them among its inputs)."""
        x_leaves, aux_leaves = jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(aux)
        # zeros_like keeps x's varying mesh axes inside shard_map (runtime.spmd); plain zeros elsewhere
        zeros = tuple(
            jnp.zeros_like(x_leaves[0], shape=a.shape, dtype=a.dtype)
            for a in map(self._probe_aval, self._probe_refs)
        )
        sinks = tuple(
            jnp.zeros_like(x_leaves[0], shape=shape, dtype=dtype)
            for shape, dtype in map(self._slot_aval, self._b_slots)
        )

        def run(xs, probes, sinks):
            env, ticks = self._evaluate(
                p_leaves, xs, aux_leaves, dict(zip(self._probe_refs, probes)), dict(zip(self._b_slots, sinks))
            )
            y = [self._read(env, r) for r in self._prog.outputs]
            kept = tuple(self._slot(env, slot) for slot in self._f_slots)  # not those inside a checkpoint
            raw = tuple(None if slot.loop is not None else env[slot.ref] for slot in self._f_slots)
            b_kept = tuple(env[r] for r in self._b_kept_refs)  # the operands of B's share of the gradients
            return (jax.tree_util.tree_unflatten(self._out_tree, y), tuple(ticks)), (kept, raw, b_kept)

        primals = (tuple(x_leaves), zeros, sinks)
        if not self.input_grad:  # x is data: not differentiated
            run, primals = functools.partial(run, primals[0]), primals[1:]
        (y, _), pullback, (kept, raw, b_kept) = jax.vjp(run, *primals, has_aux=True)
        return y, pullback, kept, raw, b_kept, (*zeros, *sinks)

    def _pull(self, pullback, dy) -> tuple:
        """F's pullback at ``dy`` and 1 per tick: ``(dx leaves,)`` with ``input_grad``, then the probes'
        gradients, then W's operands recomputed in checkpoints (the sinks' gradients)."""
        one = jnp.ones_like(jax.tree_util.tree_leaves(dy)[0], shape=(), dtype=jnp.float32)
        return pullback((dy, (one,) * self._ticks))

    def _read_plan(self, flat: Sequence[Any]) -> SplitPlan:
        """The :class:`SplitPlan`: F and B traced once together into a jaxpr (``flat``: the leaves of the
        example ``(params, x, aux)``), whose variables say which residuals are parameters or F's zeros,
        which W operands a residual holds, and which probes' output gradients are one."""
        impls: list = []  # per residual: its PRNG impl where it is a typed key (read off the traced aval)

        def f_then_b(*flat):
            params, x, aux = jax.tree_util.tree_unflatten(self._in_tree, flat)
            y, pullback, _, raw, _, made = self._f_vjp(tuple(jax.tree_util.tree_leaves(params)), x, aux)
            res = jax.tree_util.tree_leaves(pullback)
            impls.extend(jax.random.key_impl(r) if _is_key(r) else None for r in res)
            probe_grads = self._pull(pullback, jax.tree_util.tree_map(jnp.zeros_like, y))[-2]
            return pullback, [v for v in raw if v is not None], made, probe_grads

        closed, shapes = jax.make_jaxpr(f_then_b, return_shape=True)(*flat)
        outs = [object() if isinstance(v, Literal) else v for v in closed.jaxpr.outvars]  # a literal: unique
        n_res, n_raw, n_made = len(impls), len(jax.tree_util.tree_leaves(shapes[1])), len(shapes[2])
        res, raw = outs[:n_res], outs[n_res : n_res + n_raw]
        made, probe_grads = set(outs[n_res + n_raw : n_res + n_raw + n_made]), outs[n_res + n_raw + n_made :]
        param_of = {v: i for i, v in enumerate(closed.jaxpr.invars[: self._params_tree.num_leaves])}
        residuals = tuple(
            _Zeros(tuple(v.aval.shape), v.aval.dtype) if v in made
            else _FromParams(param_of[v]) if v in param_of
            else _Own(impl)
            for v, impl in zip(res, impls, strict=True)
        )
        own_at: dict = {}  # each own residual's variable: its first place in own
        for j, v in enumerate(v for v, src in zip(res, residuals) if isinstance(src, _Own)):
            own_at.setdefault(v, j)
        plain = iter(raw)  # the raw values of the F slots outside loops, in order
        held = tuple(
            _Held(slot, own_at[v]) for slot in self._f_slots if slot.loop is None
            for v in [next(plain)] if v in own_at
        )
        held_slots = {h.slot for h in held}
        owner = self._probe_op + (None,) * (len(probe_grads) - len(self._probe_op))
        first: dict = {}
        places = tuple(None if j in self._b_ops else first.setdefault(v, len(first))
                       for v, j in zip(probe_grads, owner, strict=True))
        distinct = tuple(places.index(i) for i in range(len(first)))
        kept = tuple(slot for slot in self._f_slots if slot not in held_slots)
        return SplitPlan(jax.tree_util.tree_structure(shapes[0]), residuals, kept, held, places, distinct)

    def _forward_flat(self, p_leaves, x, aux, spare=None):
        y, pullback, kept, _, b_kept, _ = self._f_vjp(p_leaves, x, aux)
        plan, res = self.plan, jax.tree_util.tree_leaves(pullback)
        # a typed PRNG key among the residuals (a checkpoint's input that B's recomputed dropout mask draws
        # from) leaves F as its uint32 data, as any other array: B wraps it back
        own = tuple(r if src.key_impl is None else jax.random.key_data(r)
                    for r, src in zip(res, plan.residuals, strict=True) if isinstance(src, _Own))
        keep = set(plan.kept)
        return y, own + b_kept, tuple(v for v, slot in zip(kept, self._f_slots) if slot in keep)

    def _split_own(self, own) -> tuple[tuple, tuple]:
        """F's ``own`` as (B's residuals less the parameters, operands of B's share ``_b_kept_refs``)."""
        n = len(own) - len(self._b_kept_refs)
        return tuple(own[:n]), tuple(own[n:])

    def _residuals(self, p_leaves, own, like=None):
        """B's residuals in pullback order: ``own`` with the parameters put back and zero probes made anew
        (``zeros_like(like)``: inside shard_map, of its axes)."""
        rest, out = iter(self._split_own(own)[0]), []
        for src in self.plan.residuals:
            if isinstance(src, _FromParams):
                out.append(p_leaves[src.index])
            elif isinstance(src, _Zeros):
                out.append(jnp.zeros(src.shape, src.dtype) if like is None
                           else jnp.zeros_like(like, shape=src.shape, dtype=src.dtype))
            else:
                v = next(rest)
                out.append(v if src.key_impl is None else jax.random.wrap_key_data(v, impl=src.key_impl))
        return tuple(out)

    def _backward_input(self, res, dy):
        grads = self._pull(jax.tree_util.tree_unflatten(self.plan.res_tree, list(res)), dy)
        # the probes' gradients, then W's operands recomputed inside checkpoints (the sinks'), then
        # those F left among B's residuals
        own = [r for r, src in zip(res, self.plan.residuals) if isinstance(src, _Own)]
        handed = tuple(self._slot({h.slot.ref: own[h.own]}, h.slot) for h in self.plan.held)
        dx = jax.tree_util.tree_unflatten(self._x_tree, list(grads[0])) if self.input_grad else None
        grads_out, recomputed = grads[-2:]
        return dx, Handover(tuple(grads_out), tuple(recomputed) + handed, ())

    def _weight_gradient(self, params, kept, handover: Handover):
        p_leaves = tuple(jax.tree_util.tree_leaves(params))
        g_leaves = self._weight_gradient_flat(p_leaves, kept, handover.output_grads, handover.recomputed)
        return jax.tree_util.tree_unflatten(self._params_tree, list(g_leaves))

    def _parameter_values(self, p_leaves) -> dict:
        """Every parameter-only and constant value by ref (a broadcast bias, a reshaped kernel)."""
        return self._run_inactive(self._prog.nodes, dict(zip(self._param_refs, p_leaves)), self._on_a)

    def _constants(self) -> dict:
        """The values of operations on constants only (an iota, a mask), by ref."""
        return self._run_inactive(self._prog.nodes, {}, self._on_a | self._on_p)

    def _run_inactive(self, nodes, env: dict, skip: set) -> dict:
        """Run into ``env`` the ``nodes`` none of whose outputs is in ``skip`` (activations; a side effect
        only, a debug print, is F's, once)."""
        for node in nodes:
            if node.outs and not any(r in skip for r in node.outs):
                env.update(zip(node.outs, node.run([self._read(env, r) for r in node.ins])))
        return env

    def _others(self, node: _Node, op: _WeightOp, constants: dict, kept_env: dict) -> dict:
        """A weight operation's operands other than its parameters: constants, kept activations."""
        others = {}
        for k, r in enumerate(node.ins):
            if k in op.weight_inputs:
                continue
            if isinstance(r, _Const) or r not in self._on_a:
                others[k] = self._read(constants, r)
            elif k in op.kept_inputs:
                others[k] = kept_env[r]
        return others

    def _small_grads(self, p_leaves, b_kept, probe_grads) -> tuple:
        """B's share of the parameter gradients (step 4), one per leaf of ``_b_leaves``."""
        ops, grads = sorted(self._b_ops), iter(probe_grads)
        dys = [tuple(next(grads) for _ in op.probed) for op in self.weight_ops]

        def weight_operands(sub):
            full = list(p_leaves)
            for i, v in zip(self._b_leaves, sub):
                full[i] = v
            return self._operands_of(self._parameter_values(full), ops)

        operands, pullback = jax.vjp(weight_operands, tuple(p_leaves[i] for i in self._b_leaves))
        constants, kept_env = self._constants(), dict(zip(self._b_kept_refs, b_kept))
        (g_leaves,) = pullback(
            tuple(self._cotangent(j, w, dys[j], constants, kept_env) for j, w in zip(ops, operands))
        )
        return tuple(g_leaves)

    def _operands_of(self, env: dict, ops) -> tuple:
        """The parameter operands of the weight operations ``ops`` (indices), read from ``env``."""
        nodes = self._prog.nodes
        return tuple(
            tuple(env[nodes[self.weight_ops[j].node].ins[k]] for k in self.weight_ops[j].weight_inputs)
            for j in ops
        )

    def _cotangent(self, j: int, weights, dys, constants: dict, kept_env: dict, kept_t=None) -> tuple:
        """Weight op ``j``'s cotangent: ``x^T dy`` (``kept_t``: ``x^T`` by ref), else its vjp."""
        op = self.weight_ops[j]
        node = self._prog.nodes[op.node]
        if op.matmul is not None and kept_t is not None:
            rows, _, n = op.matmul
            return ((kept_t[node.ins[0]] @ dys[0].reshape(rows, n)).reshape(weights[0].shape),)
        return _op_cotangent(
            node, op, self._prog.avals, weights, dys, self._others(node, op, constants, kept_env)
        )

    def _weight_gradient_flat(self, p_leaves, kept, grads_out, recomputed, in_b=frozenset()):
        """The parameter gradients, one per leaf. ``kept``: ``plan.kept`` (then ``_b_kept_refs`` when W does
        all); ``grads_out``: each probe's gradient; ``recomputed``: ``_b_slots`` then ``plan.held``'s;
        ``in_b``: weight ops (indices) whose gradients B computed, left out."""
        n_f, handed = len(self.plan.kept), self._b_slots + tuple(h.slot for h in self.plan.held)
        if len(grads_out) != len(self._probe_refs) or len(recomputed) != len(handed):
            raise ValueError(
                f"W got {len(grads_out)} output gradients and {len(recomputed)} operands from B; this stage"
                f"'s B hands {len(self._probe_refs)} and {len(handed)}: pass W the Handover of this stage's B"
            )
        operands = dict(zip(self.plan.kept, kept[:n_f])) | dict(zip(handed, recomputed))
        top = {slot: v for slot, v in operands.items() if slot.loop is None}
        kept_env = {slot.ref: v for slot, v in top.items() if slot.transpose is None}
        kept_env |= dict(zip(self._b_kept_refs, kept[n_f:]))
        kept_t = {slot.ref: v for slot, v in top.items() if slot.transpose is not None}
        ops = [j for j in range(len(self.weight_ops)) if j not in in_b]

        def weight_operands(p_leaves):  # parameter-only and constant operations, never activations
            env = self._parameter_values(p_leaves)
            top = self._operands_of(env, ops)
            loops = {i: self._loop_operands(i, env) for i in self._loops}
            return (top, {i: w for i, (w, _) in loops.items()}), {i: c for i, (_, c) in loops.items()}

        (operands_top, operands_loops), pullback, loop_constants = jax.vjp(
            weight_operands, tuple(p_leaves), has_aux=True
        )
        constants = self._constants()
        grads = iter(grads_out)
        dys = [tuple(next(grads) for _ in op.probed) for op in self.weight_ops]
        cotangents = [
            self._cotangent(j, w, dys[j], constants, kept_env, kept_t) for j, w in zip(ops, operands_top)
        ]
        loop_cotangents = {
            i: self._loop_cotangents(i, operands, operands_loops[i], loop_constants[i], grads)
            for i in self._loops
        }
        (g_leaves,) = pullback((tuple(cotangents), loop_cotangents))
        return tuple(g_leaves)

    def _loop_cotangents(self, i: int, operands: dict, weights_by_op, constants: dict, grads) -> tuple:
        """A split loop's cotangents, batched over iterations (``dw_l = x_l^T dy_l``)."""
        loop, cts = self._loops[i], []
        for op, weights in zip(loop.weight_ops, weights_by_op):
            node, dys = loop.body.nodes[op.node], tuple(next(grads) for _ in op.probed)
            if op.matmul is not None:
                rows, k, n = op.matmul
                x_t = operands[Slot(node.ins[0], (rows, k), i)]
                cts.append((jnp.matmul(x_t, dys[0].reshape(len(x_t), rows, n)).reshape(weights[0].shape),))
                continue
            ins = list(enumerate(node.ins))
            stacked = {
                k: operands[Slot(r, loop=i)] for k, r in ins if k in op.kept_inputs and isinstance(r, int)
            }
            stacked |= {
                k: constants[r]
                for k, r in ins
                if isinstance(r, int) and r not in loop.on_a and k not in op.weight_inputs
            }
            literals = {k: r.value for k, r in ins if isinstance(r, _Const)}

            def cotangent(w, d, o, node=node, op=op, lit=literals):
                return _op_cotangent(node, op, loop.body.avals, w, d, o | lit)

            cts.append(jax.vmap(cotangent)(weights, dys, stacked))
        return tuple(cts)

    def _loop_operands(self, i: int, env: dict) -> tuple:
        """A split loop's weight operands stacked per iteration, and the body constants they read."""
        node, loop = self._prog.nodes[i], self._loops[i]
        nc, nk = loop.num_consts, loop.num_carry
        known = [None if isinstance(r, int) and r in self._on_a else self._read(env, r) for r in node.ins]
        consts, xs = known[:nc], known[nc + nk :]
        needed = {
            r
            for op in loop.weight_ops
            for k, r in enumerate(loop.body.nodes[op.node].ins)
            if k not in op.weight_inputs and isinstance(r, int) and r not in loop.on_a
        }

        def per_iteration(xs_i):
            benv = {b: v for b, v in zip(loop.body.inputs[:nc], consts) if v is not None}
            benv |= {b: v for b, v in zip(loop.body.inputs[nc + nk :], xs_i) if v is not None}
            self._run_inactive(loop.body.nodes, benv, loop.on_a)
            weights = tuple(
                tuple(benv[loop.body.nodes[op.node].ins[k]] for k in op.weight_inputs)
                for op in loop.weight_ops
            )
            return weights, {r: benv[r] for r in needed}

        return jax.vmap(per_iteration, axis_size=loop.scan["length"])(xs)

    def _backward_weight(self, params, kept, handover, acc):
        grads = self._weight_gradient(params, kept, handover)
        return jax.tree_util.tree_map(lambda a, g: a + g.astype(sum_dtype(g.dtype)), acc, grads)

    def _backward_fused(self, params, res, kept, dy, acc):
        dx, handover = self._backward_input(res, dy)
        return dx, self._backward_weight(params, kept, handover, acc)

    # flat programs: parameters and gradient sums as tuples of leaves (see FlatStage)

    def _backward_input_flat(self, p_leaves, own, dy, spare=None):
        dx, handover = self._backward_input(
            self._residuals(p_leaves, own, jax.tree_util.tree_leaves(dy)[0]), dy
        )
        probes = handover.output_grads
        small = self._small_grads(p_leaves, self._split_own(own)[1], probes) if self._b_ops else ()
        # W's output gradients, each distinct one once (a Linear's product and its bias addition
        # share one), none of those whose only use was B's share of the parameter gradients
        distinct = tuple(probes[k] for k in self.plan.distinct)
        return dx, Handover(distinct, tuple(handover.recomputed), tuple(small))

    def _backward_weight_flat(self, p_leaves, kept, handover: Handover, acc):
        distinct = handover.output_grads  # each distinct one once: back to one per probe
        grads_out = tuple(None if i is None else distinct[i] for i in self.plan.grad_places)
        grads = list(self._weight_gradient_flat(p_leaves, kept, grads_out, handover.recomputed, self._b_ops))
        for i, g in zip(self._b_leaves, handover.b_grads, strict=True):  # B's share
            grads[i] = grads[i] + g
        grads = _in_sum_dtype(grads)  # summed over microbatches in float32 at least (sum_dtype)
        return grads if acc is None else tuple(a + g for a, g in zip(acc, grads, strict=True))

    def _backward_fused_flat(self, p_leaves, own, kept, dy, acc):
        dx, handover = self._backward_input_flat(p_leaves, own, dy)
        return dx, self._backward_weight_flat(p_leaves, kept, handover, acc)


def _is_key(a: Any) -> bool:
    return jnp.issubdtype(a.dtype, jax.dtypes.prng_key)


def compiled_flops(fn: Callable, *args: Any) -> float:
    """XLA's flop count of ``jax.jit(fn)`` compiled for ``args`` (``cost_analysis()``, dict or list).

    Raises:
        RuntimeError: the backend reports no flop count.
    """
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    if not analysis or "flops" not in analysis:
        raise RuntimeError("this JAX backend's cost analysis reports no 'flops'")
    return float(analysis["flops"])


def forward_kept_bytes(split: StageSplit, params: Any, x: Any, aux: Any = None) -> int:
    """Bytes F keeps per microbatch for B and W (``own`` + ``kept``, shapes only): section 2.1's M_B."""
    p = tuple(jax.tree_util.tree_leaves(params))
    _, own, kept = jax.eval_shape(split.flat.forward, p, x, aux)
    return nbytes((own, kept))


def vjp_residual_bytes(fn: Callable, params: Any, x: Any, aux: Any = None) -> int:
    """Bytes ``jax.vjp`` of ``fn`` w.r.t. ``(params, x)`` keeps less the parameters: the reference for
    :func:`forward_kept_bytes`."""
    closed = jax.make_jaxpr(lambda p, v: jax.vjp(lambda p, v: fn(p, v, aux), p, v)[1])(params, x)
    p_vars = set(closed.jaxpr.invars[: len(jax.tree_util.tree_leaves(params))])
    return nbytes([v.aval for v in closed.jaxpr.outvars if isinstance(v, Literal) or v not in p_vars])
