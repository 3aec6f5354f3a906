"""A model as a list of modules, cut into pipeline stages: the runtime's view of any model.

:class:`StagedModel` cuts ``[first, *blocks, last]`` (Flax NNX modules or ``(fn, params)`` pairs) and a
loss into stages of whole modules (:func:`stage_parts`), each a pure function with its backward split
(:class:`~zbpp_lite.runtime.split.StageSplit`). The executors and profilers use only this class, so any
such model runs in a pipeline. :func:`microbatch_size` cuts a global batch into microbatches;
:func:`dropout_keys` gives each microbatch of each step its dropout key.
"""

from __future__ import annotations

import functools
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from .split import StageSplit

Params = list  # one nnx.State of parameters per part, in model order

_SPLITS: dict = {}  # StagedModel.split_stage's cache, shared by every staged model


def microbatch_size(batch: int, num_microbatches: int) -> int:
    """Samples per microbatch of a global batch.

    Raises:
        ValueError: a batch that does not divide into the microbatches (the message suggests one).
    """
    m = num_microbatches
    if batch < 1 or batch % m:
        raise ValueError(f"a batch of {batch} samples does not divide into {m} microbatches; use a "
                         f"multiple of {m} (e.g. {m * max(1, round(batch / m))})")
    return batch // m


def batch_microbatch_size(x: Any, labels: Any, num_microbatches: int) -> int:
    """Samples per microbatch of a batch ``x`` (b, ...) with ``labels`` (b, ...), any dtypes.

    Raises:
        ValueError: a scalar ``x`` or ``labels`` (no batch axis), inputs and labels of different
            lengths, or a batch that does not divide into the microbatches (:func:`microbatch_size`).
    """
    for what, v in (("x", x), ("labels", labels)):
        if not np.shape(v):
            raise ValueError(f"{what} is a scalar; give a batch (b, ...) with b divisible by "
                             f"{num_microbatches} microbatches")
    b = np.shape(x)[0]
    if np.shape(labels)[0] != b:
        raise ValueError(f"the batch has {b} inputs but {np.shape(labels)[0]} labels")
    return microbatch_size(b, num_microbatches)


def dropout_keys(seed: int, step: int, num_microbatches: int) -> np.ndarray:
    """The dropout keys of one step: uint32 ``(m, 2)``, row j ``fold_in(fold_in(key(seed), step), j)``
    (JAX's default threefry2x32 key data; larger rows under another ``jax_default_prng_impl``).

    The one place a run's seed becomes keys: the executors (threads, processes, hosts, SPMD) and the
    reference :meth:`StagedModel.loss` take these rows, so microbatch j of a step draws the same masks
    wherever it runs. Part i draws from ``fold_in(row j, i)`` (:meth:`StagedModel.apply_part`): the
    masks do not depend on how the model is cut into stages.
    """
    step_key = jax.random.fold_in(jax.random.key(seed), step)
    keys = jax.vmap(lambda j: jax.random.fold_in(step_key, j))(jnp.arange(num_microbatches))
    return np.asarray(jax.random.key_data(keys))


class StageAux(NamedTuple):
    """What a stage function takes beside its parameters and input when it draws random numbers.

    Attributes:
        labels: the microbatch's labels on the last stage, else None.
        key: the microbatch's row of :func:`dropout_keys`, uint32 (2,).
    """

    labels: Any
    key: Any


@jax.custom_vjp
def fusion_wall(x: jax.Array) -> jax.Array:
    """The identity, whose gradient XLA:CPU computes once and stores instead of fusing it into its users.

    Between the parts of a deep model with layer norms, the residual stream's gradient is a chain of cheap
    elementwise adds through every block; XLA:CPU's fusion copies cheap producers into each user, and
    each block's layer-norm backward uses it in two reductions, so one program's backward recomputes the
    adds of all blocks above each block: work growing with the square of the depth
    (``docs/XLA_BACKWARD.md``, ``benchmarks/bench_xla_backward.py``). The gradient passes through a
    ``lax.cond`` on one of its own elements (false only for NaN, where both branches agree): XLA does
    not fuse across a conditional. ``optimization_barrier`` would not do: XLA:CPU removes it before
    fusion. F keeps nothing for it. Any shape and dtype; values and gradients are unchanged. Reverse
    mode only (``jax.grad``, ``jax.vjp``), as ``jax.custom_vjp``.
    """
    return x


def _fusion_wall_fwd(x):
    return x, None


def _fusion_wall_bwd(_, g):
    if g.size == 0 or not jnp.issubdtype(g.dtype, jnp.inexact):
        return (g,)
    at_run_time = g.reshape(-1)[0] == g.reshape(-1)[0]
    # (two equal branches would be folded into one before XLA sees a conditional)
    return (jax.lax.cond(at_run_time, lambda g: g, lambda g: g * 1, g),)


fusion_wall.defvjp(_fusion_wall_fwd, _fusion_wall_bwd)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` (b, classes) float32 against integer ``labels`` (b,)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def stage_parts(num_blocks: int, num_stages: int) -> list[list[int]]:
    """Indices of the parts (0 = first module, 1..N = blocks, N+1 = last module) in each stage.

    Block boundaries at ``round(i * N / S)`` (as the PyTorch benchmark's ``stage_parts``).

    Raises:
        ValueError: fewer blocks than stages (a stage would hold no block), or num_stages < 1.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if num_blocks < num_stages:
        raise ValueError(
            f"{num_blocks} blocks cannot fill {num_stages} stages: every stage needs at least one "
            f"block; use a model with >= {num_stages} blocks or a schedule with fewer stages"
        )
    cuts = [round(i * num_blocks / num_stages) for i in range(num_stages + 1)]
    parts = [[1 + b for b in range(cuts[s], cuts[s + 1])] for s in range(num_stages)]
    parts[0].insert(0, 0)
    parts[-1].append(num_blocks + 1)
    return parts


class StagedModel:
    """A model given as a list of parts ``[first, *blocks, last]``, cut into stages.

    Each part is a Flax NNX module (``module(x) -> y``, parameters only) or a pair ``(fn, params)`` with
    pure ``fn(params, x) -> y`` and ``params`` a pytree of float arrays. Between parts flows one array or a
    pytree (tuple, dict) whose leaves are float and depend on the stage input (docs/OPERATIONS.md, lesson 6).

    Dropout: an NNX module may hold RNG streams (``nnx.Dropout(rate, rngs=rngs)``): each call gets them
    made anew from its microbatch's key, the rates and ``deterministic`` flags kept. A pair whose ``fn``
    has a parameter named ``key``, ``fn(params, x, key) -> y``, gets a uint32 (2,) key, or None without
    dropout. The key of (step, microbatch) comes from :func:`dropout_keys`; it enters the stage as an
    input of F, never as a parameter; B and W use F's masks (kept by F, or recomputed in B from the
    key inside a ``jax.checkpoint``). ``deterministic=True`` (or a call without keys) runs without dropout.

    Attributes:
        num_stages: S.
        parts: ``parts[s]``: stage s's module indices (:func:`stage_parts`, or a custom contiguous
            partition via ``parts``).
        params: one ``nnx.State`` per module (a list; pytrees of float arrays, float32 or lower precision);
            the pipelines return their gradients summed in float32 at least
            (:func:`~zbpp_lite.runtime.split.sum_dtype`).
        ties: the tied weights, a tuple of :class:`Tie` (empty: none), found when the model is built.
        random_parts: the parts that draw random numbers (dropout), indices into ``params``.
        deterministic: run without dropout (evaluation); keys given to the executors are then unused.

    :meth:`stage_fn` is stage s's pure ``(stage_params, x, aux) -> y`` (the last returns the scalar
    ``loss_fn(logits, labels)``); :meth:`split_stage` its :class:`~zbpp_lite.runtime.split.StageSplit`;
    :meth:`loss` the unpartitioned model on a whole batch.

    Tied weights: parts that hold the same array object (one dict or array in two ``(fn, params)`` pairs,
    one NNX module or ``nnx.Param`` in two modules; GPT-2's token embedding reused by its head, Press &
    Wolf, arXiv 1608.05859) are one parameter, recorded in :attr:`ties`. :meth:`loss` uses one value for
    all copies and gives every copy the whole gradient; the pipelines sum the copies' gradients after the
    last W (every copy then gets that sum), so an optimizer that updates each copy alike keeps them equal.

    Raises:
        ValueError: fewer than two modules, fewer blocks than stages, a module with state other than
            parameters and RNG streams (batch statistics), an ``nnx.Dropout`` without ``rngs``, a key
            among the parameters, or a part neither an NNX module nor ``(fn, params)``.
    """

    def __init__(self, modules: Sequence[nnx.Module | tuple[Callable, Any]], num_stages: int,
                 loss_fn: Callable = cross_entropy, parts: Sequence[Sequence[int]] | None = None,
                 deterministic: bool = False):
        if len(modules) < 2:
            raise ValueError(f"a staged model needs at least a first and a last module, got {len(modules)} "
                             "module(s)")
        self.num_stages = num_stages
        self.parts = stage_parts(len(modules) - 2, num_stages) if parts is None else [list(p) for p in parts]
        in_order = sum(self.parts, []) == list(range(len(modules)))
        if parts is not None and (len(self.parts) != num_stages or not all(self.parts) or not in_order):
            raise ValueError(f"parts must split modules 0 .. {len(modules) - 1} in order into {num_stages} "
                             f"non-empty stages, got {self.parts}")
        self.loss_fn = loss_fn
        split = [_split_part(i, module) for i, module in enumerate(modules)]
        self.graphdefs, self.params = [g for g, _ in split], [p for _, p in split]
        self.ties = find_ties(modules)
        self.random_parts = tuple(i for i, g in enumerate(self.graphdefs) if _draws_random(g))
        self.deterministic = deterministic

    @property
    def num_parts(self) -> int:
        return len(self.graphdefs)

    def stage_params(self, params: Params, stage: int) -> list:
        """The entries of a per-module parameter list that belong to ``stage``."""
        return [params[i] for i in self.parts[stage]]

    def join_stage_params(self, per_stage: Sequence[Sequence[Any]]) -> Params:
        """Inverse of :meth:`stage_params` over all stages: per-stage lists -> one per-module list."""
        return [p for stage in per_stage for p in stage]

    def apply_part(self, i: int, params: Any, x: Any, key: Any = None) -> Any:
        """Part ``i`` on ``x`` with ``params`` (its entry of :attr:`params`); ``key``: the microbatch's
        row of :func:`dropout_keys` (part i draws from ``fold_in(key, i)``), or None: no dropout."""
        graphdef = self.graphdefs[i]
        key = None if key is None or self.deterministic else jax.random.fold_in(key, i)
        if isinstance(graphdef, _Random):
            return graphdef.merge(params, key)(x)
        if isinstance(graphdef, _Fn):
            return graphdef.fn(params, x, key) if graphdef.takes_key else graphdef.fn(params, x)
        return nnx.merge(graphdef, params)(x)

    def _apply(self, indices: Sequence[int], params: Sequence, x: Any, key: Any = None, *,
               walls: bool = False) -> Any:
        """Parts ``indices`` in turn; ``walls``: on the CPU, a :func:`fusion_wall` on each part's output
        (the unpartitioned model's whole-batch programs; a stage's microbatch programs measure no faster
        with them, ``docs/XLA_BACKWARD.md``)."""
        walls = walls and jax.default_backend() == "cpu"
        for i, p in zip(indices, params):
            x = self.apply_part(i, p, x, key)
            x = jax.tree_util.tree_map(fusion_wall, x) if walls else x
        return x

    def stage_fn(self, stage: int) -> Callable:
        """Pure ``(stage_params, x, aux) -> y`` of one stage; the last stage returns the loss. ``aux``: the
        labels (None but on the last stage), or a :class:`StageAux` with the microbatch's dropout key."""
        indices, last = self.parts[stage], stage == self.num_stages - 1

        def fn(stage_params, x, aux):
            labels, key = aux if isinstance(aux, StageAux) else (aux, None)
            y = self._apply(indices, stage_params, x, key)
            return self.loss_fn(y, labels) if last else y

        return fn

    def stage_aux(self, stage: int, labels: Any, key: Any) -> Any:
        """What stage ``stage``'s function takes as ``aux`` for a microbatch's ``labels`` and dropout ``key``
        (either may be None): a :class:`StageAux` where the stage draws random numbers and a key is given
        (unless :attr:`deterministic`), else the labels on the last stage, None elsewhere."""
        labels = labels if stage == self.num_stages - 1 else None
        if key is None or self.deterministic or not set(self.parts[stage]) & set(self.random_parts):
            return labels
        return StageAux(labels, key)

    def step_keys(self, keys: Sequence[Any] | None, num_steps: int, num_microbatches: int) -> list:
        """Each step's dropout keys checked (uint32 ``(m, 2)`` NumPy, or None where no stage draws them).

        Raises:
            ValueError: a model with dropout given no keys, or keys not one :func:`dropout_keys` per step.
        """
        m = num_microbatches
        if keys is None:
            if self.random_parts and not self.deterministic:
                raise ValueError(f"parts {list(self.random_parts)} use dropout: pass the step's "
                                 f"dropout_keys(seed, step, {m}) as keys (run_steps: one per batch), or "
                                 "build the StagedModel with deterministic=True to run without dropout")
            return [None] * num_steps
        row = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))  # no computation
        shape, dtype = (m, *row.shape), np.dtype(row.dtype)
        keys = [np.asarray(k) for k in keys]
        if len(keys) != num_steps or any(k.shape != shape or k.dtype != dtype for k in keys):
            got = [f"{k.dtype}{list(k.shape)}" for k in keys]
            raise ValueError(f"keys must be one dropout_keys(seed, step, {m}) per step ({num_steps} of "
                             f"{dtype}{list(shape)}), got {got}")
        return keys if self.random_parts and not self.deterministic else [None] * num_steps

    def stage_inputs(self, x: Any) -> list[Any]:
        """Every stage's input for a batch like ``x``, as (a pytree of) ``jax.ShapeDtypeStruct``."""
        shapes = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))]
        for s in range(self.num_stages - 1):
            shapes.append(jax.eval_shape(self.stage_fn(s), self.stage_params(self.params, s), shapes[-1],
                                         None))
        return shapes

    def split_stage(self, stage: int, x: Any, labels: Any = None, key: Any = None) -> StageSplit:
        """The :class:`~zbpp_lite.runtime.split.StageSplit` of ``stage`` for inputs like ``x`` (and
        ``labels`` on the last stage, a dropout ``key`` row where it draws random numbers; as
        :meth:`stage_aux`), cached by what the stage computes so alike stages share one."""
        last = stage == self.num_stages - 1
        aux = self.stage_aux(stage, labels, key)
        params = self.stage_params(self.params, stage)
        key = (
            tuple(self.graphdefs[i] for i in self.parts[stage]),
            stage == 0,
            self.loss_fn if last else None,
            isinstance(aux, StageAux),
            # a part draws from fold_in(key, its index): alike stages at other indices draw other masks
            (tuple(self.parts[stage]), self.deterministic) if isinstance(aux, StageAux) else None,
            *[(np.shape(a), str(jnp.result_type(a))) for a in jax.tree_util.tree_leaves((params, x, aux))],
        )
        if key not in _SPLITS:
            _SPLITS[key] = StageSplit(self.stage_fn(stage), params, x, aux, input_grad=stage > 0)
        return _SPLITS[key]

    def tied_leaves(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per :attr:`ties` entry, each copy as ``(stage, index)``: its place among
        ``tree_leaves(stage_params(params, stage))`` (what the executors hold per stage)."""
        if not self.ties:
            return ()
        stage_of = {i: s for s, indices in enumerate(self.parts) for i in indices}
        counts = [len(jax.tree_util.tree_leaves(p)) for p in self.params]

        def at(part: int, leaf: int) -> tuple[int, int]:
            s = stage_of[part]
            return s, sum(counts[i] for i in self.parts[s] if i < part) + leaf

        return tuple(tuple(at(part, leaf) for part, leaf, _ in tie.copies) for tie in self.ties)

    def _combine_ties(self, params: Params, combine: Callable) -> Params:
        """``params`` with every tie's copies replaced by ``combine([copy, ...])`` (part order)."""
        if not self.ties:
            return params
        leaves = [list(jax.tree_util.tree_leaves(p)) for p in params]
        for tie in self.ties:
            one = combine([leaves[part][leaf] for part, leaf, _ in tie.copies])
            for part, leaf, _ in tie.copies:
                leaves[part][leaf] = one
        tree = jax.tree_util
        return [tree.tree_unflatten(tree.tree_structure(p), v) for p, v in zip(params, leaves)]

    def sum_tied(self, grads: Params) -> Params:
        """``grads`` (one pytree per module) with each tied copy's gradient replaced by the sum over its
        copies, in part order: the tied parameter's gradient, the same in every copy."""
        return self._combine_ties(grads, lambda copies: functools.reduce(operator.add, copies))

    def logits(self, params: Params, x: jax.Array) -> jax.Array:
        """The unpartitioned model's output (logits) on ``x``, without dropout; tied copies are one
        parameter (:meth:`as_one`)."""
        return self._apply(range(self.num_parts), self.as_one(params), x, walls=True)

    def as_one(self, params: Params) -> Params:
        """``params`` with tied copies made one parameter: every use reads the first copy's value and
        passes its gradient to every copy (``jax.grad`` of :meth:`loss` gives each copy the whole
        gradient, as :meth:`sum_tied` of the pipeline's)."""
        return self._combine_ties(params, lambda copies: copies[0] + sum(
            c - jax.lax.stop_gradient(c) for c in copies[1:]))

    def loss(self, params: Params, x: jax.Array, labels: jax.Array, keys: Any = None) -> jax.Array:
        """The unpartitioned model's loss on a whole batch (the reference for the pipeline).

        ``keys``: None (no dropout), or a step's :func:`dropout_keys` (m, 2): the batch is then cut into
        m microbatches, microbatch j masked with ``keys[j]`` as the pipeline masks it, and the loss is the
        mean of the microbatch losses, the pipeline's. Raises ValueError: a batch that does not divide.
        """
        if keys is None:
            return self.loss_fn(self.logits(params, x), labels)
        m, parts, params = len(keys), range(self.num_parts), self.as_one(params)
        b = batch_microbatch_size(x, labels, m)
        rows = [slice(j * b, (j + 1) * b) for j in range(m)]
        return jnp.mean(jnp.stack([self.loss_fn(self._apply(parts, params, x[r], key, walls=True), labels[r])
                                   for r, key in zip(rows, keys)]))


def refuse_pytree_activations(model: StagedModel, x: Any, executor: str) -> None:
    """Raise a one-line ValueError when a stage passes a pytree on, for an ``executor`` that moves single
    arrays; ``x``: a microbatch (array or ``jax.ShapeDtypeStruct``)."""
    for s, shape in enumerate(model.stage_inputs(x)[1:]):
        if not isinstance(shape, jax.ShapeDtypeStruct):
            n = len(jax.tree_util.tree_leaves(shape))
            raise ValueError(f"{executor} passes one array between stages, but stage {s} passes a "
                             f"{type(shape).__name__} of {n} arrays (pytree activations); run this model "
                             "with PipelineExecutor (threads, or one process per rank through "
                             "zbpp_lite.runtime.processes) or SpmdExecutor")


@dataclass(frozen=True)
class Tie:
    """One array held by several parts (tied weights): ``copies`` ``((part, leaf, path), ...)`` in part
    order, ``leaf`` its index among ``tree_leaves(params[part])``, ``path`` its ``jax.tree_util.keystr``."""

    copies: tuple[tuple[int, int, str], ...]

    def describe(self) -> str:
        """E.g. ``parts 0 and 3 share one array (part 0 at ['embedding'], part 3 at ['w']; tied weights)``."""
        parts = list(dict.fromkeys(str(part) for part, _, _ in self.copies))
        where = ", ".join(f"part {part} at {path}" for part, _, path in self.copies)
        if len(parts) == 1:
            return f"part {parts[0]} holds one array in {len(self.copies)} places ({where}; tied weights)"
        return f"parts {', '.join(parts[:-1])} and {parts[-1]} share one array ({where}; tied weights)"


def find_ties(modules: Sequence[Any]) -> tuple[Tie, ...]:
    """The arrays that several parts (or places in one part) hold as the same object, as :class:`Tie`
    records, each once, in order of first use. NNX parts are read through their ``nnx.Param`` state."""
    seen: dict[int, list] = {}
    for i, part in enumerate(modules):
        tree = nnx.state(part, nnx.Param) if isinstance(part, nnx.Module) else part[1]
        for k, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(tree)):
            # arrays, or their shapes (an abstract model, nnx.eval_shape); not Python numbers (small ones
            # are shared)
            if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
                seen.setdefault(id(leaf), []).append((i, k, jax.tree_util.keystr(path)))
    return tuple(Tie(tuple(copies)) for copies in seen.values() if len(copies) > 1)


@dataclass(frozen=True)
class _Fn:
    """A plain-function part's stand-in for a graphdef, equal and hashed by the function (the split cache);
    ``takes_key``: ``fn(params, x, key)``."""

    fn: Callable
    takes_key: bool = False


@dataclass(frozen=True)
class _Random:
    """An NNX module with RNG streams (``nnx.Dropout(rate, rngs=...)``): its graphdef and its RNG state's
    structure (per leaf: shape, and whether a key or a counter), the state made anew from each call's key."""

    graphdef: Any
    tree: Any
    leaves: tuple

    def merge(self, params: Any, key: Any) -> nnx.Module:
        """The module with stream n's key ``fold_in(key, n)`` and counters at 0; ``key`` None: a fixed key,
        the module in evaluation mode (``Module.eval``: dropout off)."""
        data = jax.random.key_data(jax.random.key(0)) if key is None else key
        leaves = []
        for n, (shape, is_key) in enumerate(self.leaves):
            k = jax.random.wrap_key_data(jax.random.fold_in(data, n))
            keys = jax.random.split(k, shape) if shape else k
            leaves.append(keys if is_key else jnp.zeros(shape, jnp.uint32))
        module = nnx.merge(self.graphdef, params, jax.tree_util.tree_unflatten(self.tree, leaves))
        if key is None:
            module.eval()
        return module


def _draws_random(graphdef: Any) -> bool:
    return isinstance(graphdef, _Random) or isinstance(graphdef, _Fn) and graphdef.takes_key


def _takes_key(i: int, fn: Callable) -> bool:
    """Does part ``i``'s ``fn`` take the dropout key, ``fn(params, x, key)``? ValueError: any other third
    argument, or a ``key`` anywhere but third (it would be called without it, or never get a key)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature (a builtin): takes none
        return False
    positional = [n for n, q in parameters.items() if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    required = [n for n in positional if parameters[n].default is parameters[n].empty]
    if positional[2:3] == ["key"] and len(required) <= 3:
        return True
    if len(positional) > 2 or len(required) > 2 or "key" in parameters:
        raise ValueError(f"part {i}: fn({', '.join(parameters)}) is called as fn(params, x), or fn(params, "
                         "x, key) for dropout: take exactly those, the key third and named 'key'")
    return False


def _split_module(i: int, part: nnx.Module) -> tuple[Any, Any]:
    """An NNX module as ``(graphdef or _Random, params)``; see :func:`_split_part`."""
    name = type(part).__name__
    graphdef, params, rng, rest = nnx.split(part, nnx.Param, nnx.RngState, ...)
    if jax.tree_util.tree_leaves(rest):
        raise ValueError(f"module {i} ({name}) holds state other than parameters and RNG streams (batch "
                         "statistics?); use a stateless layer (LayerNorm, not BatchNorm) or a (fn, params) "
                         "part")
    leaves, tree = jax.tree_util.tree_flatten(rng)
    if leaves:
        return _Random(graphdef, tree, tuple((a.shape, jnp.issubdtype(a.dtype, jax.dtypes.prng_key))
                                             for a in leaves)), params
    if any(isinstance(n, nnx.Dropout) and n.rate > 0 and n.deterministic is False
           for _, n in nnx.iter_graph(part)):
        raise ValueError(f"module {i} ({name}) has an nnx.Dropout without rngs; build it with "
                         "nnx.Dropout(rate, rngs=rngs): each microbatch's key (dropout_keys) replaces them")
    return graphdef, params


def _split_part(i: int, part: Any) -> tuple[Any, Any]:
    """Part ``i`` as ``(graphdef, params)``: an NNX module's (parameters only; with RNG streams a
    :class:`_Random`), or ``(fn, params)`` checked (fn callable, params a pytree of floating-point arrays)
    with fn as an :class:`_Fn`."""
    if isinstance(part, nnx.Module):
        return _split_module(i, part)
    if not (isinstance(part, tuple) and len(part) == 2 and callable(part[0])):
        raise ValueError(f"part {i} is a {type(part).__name__}; expected an nnx.Module or a pair (fn, "
                         "params) with fn(params, x) -> y")
    fn, params = part
    dtypes = [jnp.asarray(a).dtype for a in jax.tree_util.tree_leaves(params)]
    bad = [d for d in dtypes if not jnp.issubdtype(d, jnp.inexact)]
    if bad:
        raise ValueError(f"part {i}: parameters must be floating-point arrays to be differentiated, got "
                         f"{bad[0]}; for dropout take the key as an argument, fn(params, x, key), not a "
                         "parameter")
    return _Fn(fn, _takes_key(i, fn)), jax.tree_util.tree_map(jnp.asarray, params)
