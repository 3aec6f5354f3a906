"""The backward split: one stage's F, B, W and fused BW as jitted pure functions.

Qi et al., "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241), section 2: the backward of a
layer ``y = x W`` is two computations, the input gradient ``dx = dy W^T`` (B, on the critical
path: the previous stage waits for it) and the weight gradient ``dW = x^T dy`` (W, which can wait
and fill bubbles). This module splits any stage function that way, without help from the model:

1. The stage ``fn(params, x, aux) -> y`` is traced to a jaxpr (nested ``jit`` calls inlined).
2. Every operation is marked by what it depends on: the parameters (P), the activations / input
   / labels (A). A *weight operation* mixes the two: it has an operand that depends on the
   parameters only (a kernel, a LayerNorm scale, a broadcast bias) and an output that depends on
   both. Every path from a parameter to the output crosses exactly one weight operation.
3. F evaluates the stage with a zero "probe" added to each weight operation's output, under
   ``jax.vjp`` with respect to the input and the probes only (the parameters are constants),
   and keeps: B's residuals, and W's operands of the weight operations (``x`` of ``x W``, the
   normalised input of a LayerNorm scale; nothing for bias additions).
4. B runs that pullback: it returns the input gradient and the probes' gradients, which are the
   gradients of every weight operation's output (each layer's output gradient), and computes no
   parameter gradient.
5. W takes the vjp, with respect to the parameters, of the weight operations alone, evaluated on
   the kept operands, with those output gradients as cotangents: ``x^T dy`` for a kernel,
   ``sum(dy)`` for a bias, ``sum(dy * x_hat)`` for a scale. No activation is recomputed; the
   parameter-only operations (reshapes, broadcasts of parameters) are re-derived from the
   parameters, which costs no product.
6. BW is B then W in one jitted function, for GPipe and 1F1B.

``test_split.py`` checks the cost with XLA's own compiled cost analysis: flops(B) + flops(W) is
within 5% of the fused backward ``jax.vjp`` gives, and flops(W) within 5% of the
weight-gradient products alone.

Memory (section 2.1's M_B, M_W): F holds B's residuals and W's operands until B; from B to W the
stage holds W's operands and the output gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

try:  # JAX >= 0.4.30
    from jax.extend.core import Literal
except ImportError:  # pragma: no cover - older JAX
    from jax.core import Literal

_INLINE = {"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2"}
"""Call primitives whose body is inlined, so weight operations inside them are found. Other
primitives with a body (``scan``, ``while``, custom derivatives) stay whole: a loop that mixes
parameters and activations is then one weight operation, and W re-runs that loop's vjp."""
_OPERAND_FREE = {"add", "sub", "add_any"}
"""Weight operations whose vjp for the parameter side does not read the other operand."""


# ---------------------------------------------------------------------------- flat program


@dataclass(frozen=True)
class _Const:
    value: Any


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
        ctx = getattr(getattr(self.eqn, "ctx", None), "manager", None)
        if ctx is None:
            out = prim.bind(*sub, *values, **params)
        else:
            with ctx:
                out = prim.bind(*sub, *values, **params)
        return list(out) if prim.multiple_results else [out]


@dataclass
class _Program:
    """A stage's jaxpr as a flat list of nodes over integer refs, with dependence marks."""

    nodes: list[_Node] = field(default_factory=list)
    avals: dict[int, Any] = field(default_factory=dict)
    inputs: list[int] = field(default_factory=list)
    outputs: list = field(default_factory=list)

    def new_ref(self, aval) -> int:
        ref = len(self.avals)
        self.avals[ref] = aval
        return ref


def _flatten(prog: _Program, jaxpr, consts: Sequence[Any], ins: Sequence[Any]) -> list:
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
            outs = _flatten(prog, getattr(inner, "jaxpr", inner), closed_consts, args)
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


class StageSplit:
    """F, B, W and BW of one stage function, for one set of input shapes.

    Args:
        fn: the stage, a pure ``fn(params, x, aux) -> y`` (any pytrees of arrays; ``aux`` is
            not differentiated, e.g. the labels of the last stage, or ``None``).
        params, x, aux: example arguments (only shapes and dtypes are used).
        input_grad: whether B returns the gradient for ``x`` (False for the first stage, whose
            input is the data).

    The four functions are ``jax.jit``-ed and pure (arrays in, arrays out):

    - ``forward(params, x, aux) -> (y, res, kept)``: the output, B's residuals (a tuple of
      arrays) and W's operands (a tuple of arrays).
    - ``backward_input(res, dy) -> (dx, grads_out)``: the input gradient (``None`` when
      ``input_grad`` is false) and every weight operation's output gradient (a tuple).
    - ``backward_weight(params, kept, grads_out, acc) -> acc + dparams``: the parameter
      gradients, added to the accumulator ``acc`` (same pytree as ``params``).
    - ``backward_fused(params, res, kept, dy, acc) -> (dx, acc + dparams)``: B then W.

    ``weight_gradient(params, kept, grads_out)`` is W without the accumulator.

    Raises:
        ValueError: an output that does not depend on the stage input, or a non-float output.
    """

    def __init__(self, fn: Callable, params: Any, x: Any, aux: Any = None, *, input_grad: bool = True):
        self.input_grad = input_grad
        flat, self._in_tree = jax.tree_util.tree_flatten((params, x, aux))
        self._params_tree = jax.tree_util.tree_structure(params)
        self._x_tree = jax.tree_util.tree_structure(x)
        n_p, n_x = self._params_tree.num_leaves, len(jax.tree_util.tree_leaves(x))
        closed, out_shape = jax.make_jaxpr(lambda *a: fn(*jax.tree_util.tree_unflatten(self._in_tree, a)), return_shape=True)(*flat)
        self._out_tree = jax.tree_util.tree_structure(out_shape)
        prog = _Program()
        prog.inputs = [prog.new_ref(v.aval) for v in closed.jaxpr.invars]
        prog.outputs = _flatten(prog, closed.jaxpr, closed.consts, prog.inputs)
        self._prog = prog
        self._param_refs = prog.inputs[:n_p]
        self._x_refs = prog.inputs[n_p : n_p + n_x]
        self._aux_refs = prog.inputs[n_p + n_x :]
        self._mark()
        self._res_tree = None
        self.forward = jax.jit(self._forward)
        self.backward_input = jax.jit(self._backward_input)
        self.weight_gradient = jax.jit(self._weight_gradient)
        self.backward_weight = jax.jit(self._backward_weight)
        self.backward_fused = jax.jit(self._backward_fused)

    # ------------------------------------------------------------------ analysis

    def _mark(self) -> None:
        prog = self._prog
        on_p = set(self._param_refs)  # depends on the parameters
        on_a = set(self._x_refs) | set(self._aux_refs)  # depends on input or labels
        weight_ops = []
        for i, node in enumerate(prog.nodes):
            refs = [r for r in node.ins if isinstance(r, int)]
            p, a = any(r in on_p for r in refs), any(r in on_a for r in refs)
            if p:
                on_p.update(node.outs)
            if a:
                on_a.update(node.outs)
            if not (p and a):
                continue
            weight = tuple(k for k, r in enumerate(node.ins) if isinstance(r, int) and r in on_p and r not in on_a)
            if not weight:
                continue  # parameters reach this op only through activations: not a weight op
            kept = () if node.eqn.primitive.name in _OPERAND_FREE else tuple(
                k for k, r in enumerate(node.ins) if isinstance(r, int) and r in on_a
            )
            probed = tuple(r for r in node.outs if jnp.issubdtype(prog.avals[r].dtype, jnp.inexact))
            weight_ops.append(_WeightOp(i, weight, kept, probed))
        for r in prog.outputs:
            if not isinstance(r, int) or r not in on_a:
                raise ValueError("a stage output does not depend on the stage input; every output must come from x")
            if not jnp.issubdtype(prog.avals[r].dtype, jnp.inexact):
                raise ValueError(f"stage outputs must be floating point to be differentiated, got {prog.avals[r].dtype}")
        self._on_a = on_a
        self.weight_ops = tuple(weight_ops)
        self._kept_refs = tuple(dict.fromkeys(op_in for op in weight_ops for op_in in (prog.nodes[op.node].ins[k] for k in op.kept_inputs)))
        self._probe_refs = tuple(r for op in weight_ops for r in op.probed)

    @property
    def weight_primitives(self) -> tuple[str, ...]:
        """The primitive of every weight operation, in program order (``dot_general`` for a
        matrix product, ``mul`` for a scale, ``add`` for a bias, ...)."""
        return tuple(self._prog.nodes[op.node].eqn.primitive.name for op in self.weight_ops)

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, p_leaves, x_leaves, aux_leaves, probes: dict[int, Any]) -> dict[int, Any]:
        prog = self._prog
        env = dict(zip(self._param_refs, p_leaves))
        env.update(zip(self._x_refs, x_leaves))
        env.update(zip(self._aux_refs, aux_leaves))
        for node in prog.nodes:
            outs = node.run([r.value if isinstance(r, _Const) else env[r] for r in node.ins])
            for r, v in zip(node.outs, outs):
                env[r] = v + probes[r] if r in probes else v
        return env

    def _read(self, env, r):
        return r.value if isinstance(r, _Const) else env[r]

    def _forward(self, params, x, aux):
        p_leaves, x_leaves, aux_leaves = self._split_leaves(params, x, aux)
        zeros = tuple(jnp.zeros(self._prog.avals[r].shape, self._prog.avals[r].dtype) for r in self._probe_refs)

        def run(xs, probes):
            env = self._evaluate(p_leaves, xs, aux_leaves, dict(zip(self._probe_refs, probes)))
            y = [self._read(env, r) for r in self._prog.outputs]
            return jax.tree_util.tree_unflatten(self._out_tree, y), tuple(env[r] for r in self._kept_refs)

        if self.input_grad:
            y, pullback, kept = jax.vjp(run, tuple(x_leaves), zeros, has_aux=True)
        else:
            y, pullback, kept = jax.vjp(lambda probes: run(tuple(x_leaves), probes), zeros, has_aux=True)
        res, self._res_tree = jax.tree_util.tree_flatten(pullback)
        return y, tuple(res), kept

    def _split_leaves(self, params, x, aux):
        flat = jax.tree_util.tree_leaves((params, x, aux))
        n_p, n_x = len(self._param_refs), len(self._x_refs)
        return flat[:n_p], flat[n_p : n_p + n_x], flat[n_p + n_x :]

    def _backward_input(self, res, dy):
        if self._res_tree is None:
            raise RuntimeError("StageSplit: call forward before backward_input (B replays F's pullback)")
        grads = jax.tree_util.tree_unflatten(self._res_tree, list(res))(dy)
        if self.input_grad:
            dx_leaves, grads_out = grads
            return jax.tree_util.tree_unflatten(self._x_tree, list(dx_leaves)), tuple(grads_out)
        (grads_out,) = grads
        return None, tuple(grads_out)

    def _weight_gradient(self, params, kept, grads_out):
        prog = self._prog
        kept_env = dict(zip(self._kept_refs, kept))

        def weight_outputs(p_leaves):
            env = dict(zip(self._param_refs, p_leaves))
            for node in prog.nodes:  # parameter-only and constant operations, never activations
                if any(r in self._on_a for r in node.outs):
                    continue
                outs = node.run([self._read(env, r) for r in node.ins])
                env.update(zip(node.outs, outs))
            outs = []
            for op in self.weight_ops:
                node = prog.nodes[op.node]
                values = []
                for k, r in enumerate(node.ins):
                    if isinstance(r, _Const) or k in op.weight_inputs or r not in self._on_a:
                        values.append(self._read(env, r))
                    elif k in op.kept_inputs:
                        values.append(kept_env[r])
                    else:  # an operand this op's parameter vjp does not read (bias addition)
                        values.append(jnp.zeros(prog.avals[r].shape, prog.avals[r].dtype))
                out = dict(zip(node.outs, node.run(values)))
                outs.extend(out[r] for r in op.probed)
            return tuple(outs)

        p_leaves = jax.tree_util.tree_leaves(params)
        _, pullback = jax.vjp(weight_outputs, p_leaves)
        (g_leaves,) = pullback(tuple(grads_out))
        return jax.tree_util.tree_unflatten(self._params_tree, g_leaves)

    def _backward_weight(self, params, kept, grads_out, acc):
        grads = self._weight_gradient(params, kept, grads_out)
        return jax.tree_util.tree_map(jnp.add, acc, grads)

    def _backward_fused(self, params, res, kept, dy, acc):
        dx, grads_out = self._backward_input(res, dy)
        return dx, self._backward_weight(params, kept, grads_out, acc)


def compiled_flops(fn: Callable, *args: Any) -> float:
    """XLA's own flop count of ``jax.jit(fn)`` compiled for ``args`` (the backend's cost analysis).

    ``cost_analysis()`` returns a dict in recent JAX and a list with one dict per computation in
    older versions; both are handled.

    Raises:
        RuntimeError: the backend reports no flop count.
    """
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    if not analysis or "flops" not in analysis:
        raise RuntimeError("this JAX backend's cost analysis reports no 'flops'")
    return float(analysis["flops"])
