"""A model as a list of modules, cut into pipeline stages: the runtime's view of any model.

:class:`StagedModel` takes a list of Flax NNX modules ``[first, *blocks, last]`` and a loss, cuts
it into ``num_stages`` stages of whole modules (:func:`stage_parts`) and gives each stage's pure
function and its backward split (:class:`~zbpp_lite.runtime.split.StageSplit`). The executor,
SPMD and the profilers work on this class only, so any list of NNX modules whose state is
parameters only runs in a pipeline, not just this project's digits Transformer
(:mod:`zbpp_lite.training.model`). :func:`microbatch_size` cuts a global batch into microbatches.

Layer: runtime (imports the schedules layer and JAX, nothing above).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

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
        ValueError: a batch that does not divide into the microbatches (the message suggests one
            that does).
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


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` (b, classes) float32 against integer ``labels`` (b,)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def stage_parts(num_blocks: int, num_stages: int) -> list[list[int]]:
    """Indices of the parts (0 = first module, 1..N = blocks, N+1 = last module) in each stage.

    Block boundaries at ``round(i * N / S)``, the first module with stage 0, the last with stage
    S-1: the rule of the PyTorch benchmark's ``stage_parts``.

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

    Each part is a Flax NNX module (``module(x) -> y``, parameters only) or a plain function
    with its parameters, a pair ``(fn, params)`` with ``fn(params, x) -> y`` pure and ``params``
    any pytree of floating-point arrays. What passes between parts and stages may be one array or
    a pytree of them (a tuple ``(hidden, residual)``, a dict): every output leaf must depend on
    the stage input and be floating point. This is the "pipeline your own model" path (README;
    notebook 06): e.g. ``StagedModel([embed, (block_fn, block_params), head], 2, my_loss,
    parts=[[0, 1], [2]])``.

    Attributes:
        num_stages: S.
        parts: ``parts[s]`` lists the module indices of stage s (:func:`stage_parts`, or the
            ``parts`` argument: a custom contiguous partition, e.g. from the rebalancer).
        params: the parameters, one ``nnx.State`` per module (a list; pytrees of float32 arrays).

    Stage s is the pure function :meth:`stage_fn` ``(stage_params, x, labels) -> y``: stage 0
    takes the input batch, the last stage returns the scalar ``loss_fn(logits, labels)``, the
    others ignore ``labels``. :meth:`split_stage` gives its F, B, W and BW
    (:class:`~zbpp_lite.runtime.split.StageSplit`); :meth:`loss` is the unpartitioned model on a whole batch.

    Raises:
        ValueError: fewer than two modules, fewer blocks than stages, a module holding state
            other than parameters (batch statistics, RNG counters), or a part that is neither an
            NNX module nor a ``(fn, params)`` pair.
    """

    def __init__(self, modules: Sequence[nnx.Module | tuple[Callable, Any]], num_stages: int,
                 loss_fn: Callable = cross_entropy, parts: Sequence[Sequence[int]] | None = None):
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
        self.graphdefs, self.params = [], []
        for i, module in enumerate(modules):
            if not isinstance(module, nnx.Module):
                graphdef, params = _function_part(i, module)
                self.graphdefs.append(graphdef)
                self.params.append(params)
                continue
            graphdef, params, rest = nnx.split(module, nnx.Param, ...)
            if jax.tree_util.tree_leaves(rest):
                raise ValueError(f"module {i} ({type(module).__name__}) holds state other than parameters; "
                                 "only nnx.Param state is supported")
            self.graphdefs.append(graphdef)
            self.params.append(params)

    @property
    def num_parts(self) -> int:
        return len(self.graphdefs)

    def stage_params(self, params: Params, stage: int) -> list:
        """The entries of a per-module parameter list that belong to ``stage``."""
        return [params[i] for i in self.parts[stage]]

    def join_stage_params(self, per_stage: Sequence[Sequence[Any]]) -> Params:
        """Inverse of :meth:`stage_params` over all stages: per-stage lists -> one per-module list."""
        return [p for stage in per_stage for p in stage]

    def apply_part(self, i: int, params: Any, x: Any) -> Any:
        """Part ``i`` on ``x`` with ``params`` (its entry of :attr:`params`)."""
        graphdef = self.graphdefs[i]
        return graphdef.fn(params, x) if isinstance(graphdef, _Fn) else nnx.merge(graphdef, params)(x)

    def _apply(self, indices: Sequence[int], params: Sequence, x: Any) -> Any:
        for i, p in zip(indices, params):
            x = self.apply_part(i, p, x)
        return x

    def stage_fn(self, stage: int) -> Callable:
        """Pure ``(stage_params, x, labels) -> y`` of one stage; the last stage returns the loss."""
        indices, last = self.parts[stage], stage == self.num_stages - 1

        def fn(stage_params, x, labels):
            y = self._apply(indices, stage_params, x)
            return self.loss_fn(y, labels) if last else y

        return fn

    def stage_inputs(self, x: Any) -> list[Any]:
        """Shape and dtype of every stage's input for a (micro)batch shaped like ``x``: a
        ``jax.ShapeDtypeStruct``, or a pytree of them where a stage passes a tuple or dict on."""
        shapes = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))]
        for s in range(self.num_stages - 1):
            shapes.append(jax.eval_shape(self.stage_fn(s), self.stage_params(self.params, s), shapes[-1],
                                         None))
        return shapes

    def split_stage(self, stage: int, x: Any, labels: Any = None) -> StageSplit:
        """F, B, W and BW of ``stage`` (:class:`~zbpp_lite.runtime.split.StageSplit`) for a stage input
        shaped like ``x`` and, on the last stage, labels shaped like ``labels``.

        Cached by what the stage computes (its modules' structure, first / last, loss, shapes),
        so stages alike (in this model or another) share one set of jitted functions, compiled
        once per device.
        """
        last = stage == self.num_stages - 1
        aux = labels if last else None
        params = self.stage_params(self.params, stage)
        key = (
            tuple(self.graphdefs[i] for i in self.parts[stage]),
            stage == 0,
            self.loss_fn if last else None,
            *[(np.shape(a), str(jnp.result_type(a))) for a in jax.tree_util.tree_leaves((params, x, aux))],
        )
        if key not in _SPLITS:
            _SPLITS[key] = StageSplit(self.stage_fn(stage), params, x, aux, input_grad=stage > 0)
        return _SPLITS[key]

    def logits(self, params: Params, x: jax.Array) -> jax.Array:
        """The unpartitioned model's output (logits) on ``x``."""
        return self._apply(range(self.num_parts), params, x)

    def loss(self, params: Params, x: jax.Array, labels: jax.Array) -> jax.Array:
        """The unpartitioned model's loss on a whole batch (the reference for the pipeline)."""
        return self.loss_fn(self.logits(params, x), labels)


def refuse_pytree_activations(model: StagedModel, x: Any, executor: str) -> None:
    """Raise a one-line ValueError when a stage of ``model`` passes a pytree (a tuple or dict of
    arrays) to the next, for an ``executor`` that moves only single arrays between stages; ``x``
    is a microbatch (an array or a ``jax.ShapeDtypeStruct``)."""
    for s, shape in enumerate(model.stage_inputs(x)[1:]):
        if not isinstance(shape, jax.ShapeDtypeStruct):
            n = len(jax.tree_util.tree_leaves(shape))
            raise ValueError(f"{executor} passes one array between stages, but stage {s} passes a "
                             f"{type(shape).__name__} of {n} arrays (pytree activations); run this model "
                             "with PipelineExecutor (threads, or one process per rank through "
                             "zbpp_lite.runtime.processes) or SpmdExecutor")


class _Fn:
    """A plain-function part's stand-in for a graphdef: hashable by the function itself, so
    :meth:`StagedModel.split_stage`'s cache shares splits between stages running one function."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        self.fn = fn

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Fn) and other.fn is self.fn

    def __hash__(self) -> int:
        return hash(self.fn)

    def __repr__(self) -> str:
        return f"function part {getattr(self.fn, '__name__', self.fn)!r}"


def _function_part(i: int, part: Any) -> tuple[_Fn, Any]:
    """``(fn, params)`` checked: fn callable, params a pytree of floating-point arrays."""
    if not (isinstance(part, tuple) and len(part) == 2 and callable(part[0])):
        raise ValueError(f"part {i} is a {type(part).__name__}; expected an nnx.Module or a pair (fn, "
                         "params) with fn(params, x) -> y")
    fn, params = part
    dtypes = [jnp.asarray(a).dtype for a in jax.tree_util.tree_leaves(params)]
    bad = [d for d in dtypes if not jnp.issubdtype(d, jnp.inexact)]
    if bad:
        raise ValueError(f"part {i}: parameters must be floating-point arrays to be differentiated, got "
                         f"{bad[0]}")
    return _Fn(fn), jax.tree_util.tree_map(jnp.asarray, params)
