"""The compiled SPMD executor: a whole schedule as one jitted program over a mesh axis ``rank``.

Where :class:`~zbpp_lite.runtime.executor.PipelineExecutor` runs one thread per rank (MPMD), this compiles
a :class:`~zbpp_lite.schedules.ir.Schedule` into one program every rank runs in lockstep (as on TPU pods):
:func:`tick_tables` gives static per-tick tables (:func:`zbpp_lite.schedules.simulate.lockstep_ticks`);
the program is ``lax.scan`` over ticks inside ``shard_map``, each tick a ``lax.switch`` on (kind, stage),
then one message sent with two ``lax.ppermute`` to ranks r+1 and r-1 (1F1B, looped and V placements), or,
with ``overlap``, the previous tick's message sent beside the switch.
Received values wait in per-(chunk, microbatch) buffers; the switch returns only the tick's slot values,
which the tick writes back: branches returning the whole loop state made XLA on a CPU copy it every tick
(``benchmarks/bench_spmd.py --switch``). Stage s is ``StagedModel.stage_fn(s)`` split by
:class:`~zbpp_lite.runtime.split.StageSplit`, so results match the thread executor. Every rank's program
holds every stage's F, B, W, BW; per-stage values live in flat vectors per dtype (:class:`Packing`);
activations need one structure at every boundary (:meth:`SpmdExecutor.boundary`).

JAX issue #40823: a ``lax.switch`` whose index varies over a mesh axis can return wrong gradients for an
input replicated over it, so replicated inputs and loop carries are made varying (:func:`to_varying`).
Sources: Qi et al., arXiv 2401.10241, sections 2-3 and 6 (ZB-V); the V placement, arXiv 2405.15362, section 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .stages import Params, StagedModel, batch_microbatch_size
from .transport import Transfer
from ..schedules.ir import KIND_CODE, Schedule, produces
from ..schedules.simulate import lockstep_ticks
from .split import StageSplit, sum_dtype
from ..schedules.validate import validate

AXIS = "rank"
"""The mesh axis the pipeline runs over: one rank per position."""

NO_BUFFER, ACT_BUFFER, GRAD_BUFFER = 0, 1, 2
"""Where an arriving message goes: nowhere, the activation buffer (F's input), the gradient buffer (B's)."""
SOURCES = ("left", "right", "self")
"""Where a message can come from: rank r-1 (cyclic), rank r+1 (cyclic), the rank itself."""

try:  # JAX >= 0.7: jax.shard_map with varying-axes checking (check_vma)
    _shard_map = jax.shard_map
    _CHECK_ARG = "check_vma"
except AttributeError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map as _shard_map

    _CHECK_ARG = "check_rep"


def shard_map(fn: Any, mesh: Mesh, in_specs: Any, out_specs: Any) -> Any:
    """``fn`` run once per device of ``mesh`` on its shard of each argument (``in_specs``, ``out_specs``:
    :class:`~jax.sharding.PartitionSpec` prefixes), with JAX's check of which values vary over a mesh axis:
    ``jax.shard_map`` (JAX >= 0.7, ``check_vma``) or ``jax.experimental.shard_map`` (``check_rep``)."""
    return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_CHECK_ARG: True})


def _aux(model: StagedModel, stage: int, labels: Any, keys: Any, j: Any) -> Any:
    """Stage ``stage``'s ``aux`` for microbatch ``j`` (:meth:`StagedModel.stage_aux`); ``keys`` None: none."""
    return model.stage_aux(stage, labels[j], None if keys is None else keys[j])


def to_varying(x: Any, axis: str = AXIS) -> Any:
    """Mark every leaf of ``x`` as varying over ``axis`` (#40823): ``lax.pcast`` / ``lax.pvary``, identity
    where JAX has no varying-axes types."""
    if hasattr(lax, "pcast"):
        cast = lambda a: lax.pcast(a, axis, to="varying")  # noqa: E731
    elif hasattr(lax, "pvary"):  # pragma: no cover - JAX 0.6-0.7
        cast = lambda a: lax.pvary(a, axis)  # noqa: E731
    else:  # pragma: no cover - JAX without varying-axes types
        return x
    return jax.tree_util.tree_map(lambda a: a if axis in varying_axes(a) else cast(a), x)


def varying_axes(x: Any) -> frozenset:
    """The mesh axes a traced value varies over (empty outside ``shard_map``)."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


@dataclass(frozen=True)
class TickTables:
    """A schedule's lockstep program as static integer tables (NumPy int32).

    Attributes:
        kind, chunk, microbatch: ``(num_ranks, num_ticks)``: rank r's action in tick t (kind 0 idle, else
            :data:`KIND_CODE`), its chunk (index into ``schedule.stages_of(r)``) and microbatch.
        recv: ``{source: (buffer, chunk, microbatch)}`` per :data:`SOURCES`, tables as above: where the
            message arriving at the end of tick t is stored (:data:`NO_BUFFER`: none).
        overlap: built for a program that sends each tick's message during the next tick
            (:func:`tick_tables`).
    """

    kind: np.ndarray
    chunk: np.ndarray
    microbatch: np.ndarray
    recv: dict
    overlap: bool = False

    @property
    def num_ticks(self) -> int:
        return self.kind.shape[1]


def tick_tables(schedule: Schedule, overlap: bool = False) -> TickTables:
    """The static per-tick tables of ``schedule`` (see :class:`TickTables`). ``overlap``: ticks of
    ``lockstep_ticks(schedule, overlap=True)``, for a program whose tick sends the message the previous
    tick made while its own switch runs; a message from a neighbour then arrives at the end of the tick
    after the one that made it (``"self"``'s still at its own).

    Raises:
        ScheduleError: an invalid schedule.
        ValueError: ranks holding different numbers of stages, a transfer beyond ring neighbours, or an
            F&B pair.
    """
    validate(schedule)
    if schedule.has_pairs:
        raise ValueError("the SPMD executor runs one action per rank per tick and has no overlapped F&B "
                         "pair; run schedule.split_pairs() (each pair as its two actions, the same "
                         "gradients) or the thread executor")
    p, S = schedule.num_ranks, schedule.num_stages
    chunks = [schedule.stages_of(r) for r in range(p)]
    if len({len(c) for c in chunks}) != 1:
        raise ValueError(f"the SPMD executor stacks one set of stages per rank, so every rank must hold the "
                         f"same number of stages; this placement gives {[len(c) for c in chunks]} stages to "
                         f"ranks 0..{p - 1}")
    ticks = lockstep_ticks(schedule, overlap=overlap)
    T = len(ticks)
    kind, chunk, mb = (np.zeros((p, T), np.int32) for _ in range(3))
    recv = {src: tuple(np.zeros((p, T), np.int32) for _ in range(3)) for src in SOURCES}
    for t, row in enumerate(ticks):
        for r, step in enumerate(row):
            if step is None:
                continue
            a = schedule.actions[r][step]
            kind[r, t], chunk[r, t], mb[r, t] = KIND_CODE[a.kind], chunks[r].index(a.stage), a.microbatch
            sent = Transfer(*produces(a)[0])  # an activation for stage s+1, an input gradient for s-1
            consumer, buffer = sent.consumer, ACT_BUFFER if a.kind == "F" else GRAD_BUFFER
            if a.kind == "W" or not 0 <= consumer < S:
                continue
            dst = schedule.placement[consumer]
            if dst == r:
                src = "self"
            elif dst == (r + 1) % p:
                src = "left"  # the consumer receives it from its left neighbour
            elif dst == (r - 1) % p:
                src = "right"
            else:
                raise ValueError(f"{a} on rank {r} sends to stage {consumer} on rank {dst}, not a ring "
                                 "neighbour; the SPMD executor moves values only to rank r+1 or r-1 "
                                 "(placements: one stage per rank, looped, V)")
            buf, ch, j = recv[src]
            at = t + 1 if overlap and src != "self" else t  # its consumer runs two ticks on: t + 1 < T
            buf[dst, at], ch[dst, at], j[dst, at] = buffer, chunks[dst].index(consumer), a.microbatch
    return TickTables(kind, chunk, mb, recv, overlap)


@dataclass(frozen=True)
class Packing:
    """Where each leaf of a per-stage pytree sits in one flat vector per dtype.

    Attributes:
        dtypes: the vectors' dtypes (NumPy dtypes, bfloat16 too; sorted by name).
        sizes: each vector's length, the largest total of that dtype over the stages.
        trees: per stage, the pytree structure.
        slots: per stage, per leaf: ``(vector index, offset, shape)``.

    :meth:`pack` takes NumPy or traced JAX values; :meth:`unpack` is static slices and reshapes.
    """

    dtypes: tuple
    sizes: tuple
    trees: tuple
    slots: tuple

    @classmethod
    def of(cls, per_stage: Sequence[Any]) -> "Packing":
        """The packing of ``per_stage[s]``, pytrees of arrays or ``jax.ShapeDtypeStruct``."""
        leaves = [jax.tree_util.tree_leaves(tree) for tree in per_stage]
        dtypes = tuple(sorted({jnp.dtype(a.dtype) for stage in leaves for a in stage}, key=lambda d: d.name))
        sizes, slots = [0] * len(dtypes), []
        for stage in leaves:
            used, mine = [0] * len(dtypes), []
            for a in stage:
                d = dtypes.index(jnp.dtype(a.dtype))
                mine.append((d, used[d], tuple(a.shape)))
                used[d] += math.prod(a.shape)
            sizes = [max(u, n) for u, n in zip(sizes, used)]
            slots.append(tuple(mine))
        trees = tuple(jax.tree_util.tree_structure(t) for t in per_stage)
        return cls(dtypes, tuple(sizes), trees, tuple(slots))

    def pack(self, stage: int, tree: Any, xp: Any = jnp) -> tuple:
        """``tree`` of ``stage`` as one vector per dtype, zero-padded to :attr:`sizes`."""
        parts: list = [[] for _ in self.dtypes]
        for (d, _, _), a in zip(self.slots[stage], jax.tree_util.tree_leaves(tree), strict=True):
            parts[d].append(xp.ravel(a))
        used = [sum(math.prod(shape) for d_, _, shape in self.slots[stage] if d_ == d)
                for d in range(len(self.dtypes))]
        return tuple(xp.concatenate([*parts[d], xp.zeros((size - used[d],), dtype)]).astype(dtype)
                     for d, (dtype, size) in enumerate(zip(self.dtypes, self.sizes)))

    def unpack(self, stage: int, vectors: Sequence[Any]) -> Any:
        """Inverse of :meth:`pack`: ``stage``'s pytree from its vectors."""
        leaves = [vectors[d][o : o + math.prod(shape)].reshape(shape) for d, o, shape in self.slots[stage]]
        return jax.tree_util.tree_unflatten(self.trees[stage], leaves)

    def zeros(self, prefix: tuple = ()) -> tuple:
        """Empty buffers: one ``prefix + (size,)`` JAX array per dtype."""
        return tuple(jnp.zeros((*prefix, size), dtype) for dtype, size in zip(self.dtypes, self.sizes))


@dataclass(frozen=True)
class SpmdResult:
    """One step of the compiled SPMD executor (before the optimizer).

    Attributes:
        loss: global-batch mean loss, float.
        microbatch_losses: the loss of each microbatch, floats.
        grads: gradient of ``loss`` per model module (as ``StagedModel.params``), NumPy, each leaf in its
            :func:`~zbpp_lite.runtime.split.sum_dtype` (float32 for bfloat16 parameters).
    """

    loss: float
    microbatch_losses: tuple[float, ...]
    grads: Params


@dataclass(frozen=True)
class _Traced:
    """Every stage's split and the packings of ``own``, ``kept`` and B's hand-over ``gout``."""

    splits: tuple
    own: Packing
    kept: Packing
    gout: Packing
    loss: Any  # the last stage's output: the loss, a scalar


class SpmdExecutor:
    """A schedule compiled into one jitted SPMD program over the mesh axis ``rank``.

    Args:
        model: the staged model (``num_stages`` as the schedule's).
        schedule: a valid schedule with equally many stages per rank and ring-neighbour transfers (1f1b,
            zb-h1, zb-h2, interleaved, zb-v, ...).
        devices: one per rank (default ``jax.devices()[:p]``); multi-process: the global devices.
        vary_replicated: the #40823 fix; only tests turn it off.
        overlap: each tick sends the message the previous tick made while its own switch runs (the two
            share no value, so a backend with asynchronous collectives may overlap them), over
            ``tick_tables(schedule, overlap=True)``'s longer tables; ``simulate(..., lockstep=True,
            overlap=True)`` times it.

    :meth:`run` takes ``params``, a global batch ``x`` (b, ...) of any dtype (float32 features, int32
    tokens) and ``labels`` (b, ...), and returns an :class:`SpmdResult`; it compiles once per batch shape.

    Raises:
        ScheduleError: an invalid schedule. ValueError: another number of stages, an unsupported
        placement (:func:`tick_tables`), too few devices; at :meth:`run`, differing boundaries
        (:meth:`boundary`) or a batch that does not divide into microbatches.
    """

    def __init__(self, model: StagedModel, schedule: Schedule, devices: Sequence[Any] | None = None, *,
                 vary_replicated: bool = True, overlap: bool = False):
        if model.num_stages != schedule.num_stages:
            raise ValueError(f"the schedule has {schedule.num_stages} stages but the model is cut into "
                             f"{model.num_stages}")
        self.tables = tick_tables(schedule, overlap)
        p = schedule.num_ranks
        devices = jax.devices()[:p] if devices is None else devices
        if len(devices) != p:
            raise ValueError(f"give one device per rank: the schedule has {p} ranks, got {len(devices)} "
                             "devices")
        self.model, self.schedule, self.vary_replicated = model, schedule, vary_replicated
        stage_params = [model.stage_params(model.params, s) for s in range(model.num_stages)]
        self.mesh = Mesh(np.array(devices), (AXIS,))
        self.stage_of = np.array([schedule.stages_of(r) for r in range(p)], np.int32)  # (p, v): chunk c's
        self.params_packing = Packing.of(stage_params)
        self.grads_packing = Packing.of(jax.tree_util.tree_map(  # the sums: float32 for bfloat16 leaves
            lambda a: jax.ShapeDtypeStruct(np.shape(a), sum_dtype(a.dtype)), stage_params))
        self._compiled: dict = {}

    def pack_params(self, params: Params) -> tuple:
        """Every rank's stages' parameters, one NumPy array ``(p, stages per rank, size)`` per dtype."""
        packing, model = self.params_packing, self.model
        per_stage = [packing.pack(s, jax.tree_util.tree_map(np.asarray, model.stage_params(params, s)), np)
                     for s in range(model.num_stages)]
        return tuple(np.stack([np.stack([per_stage[s][d] for s in row]) for row in self.stage_of])
                     for d in range(len(packing.dtypes)))

    def unpack_grads(self, packed: Sequence[np.ndarray]) -> Params:
        """The gradient sums (:attr:`grads_packing`) as one pytree per model module, each leaf in its
        :func:`~zbpp_lite.runtime.split.sum_dtype` (float32 for bfloat16 parameters)."""
        per_stage: list = [None] * self.model.num_stages
        for r, row in enumerate(self.stage_of):
            for c, s in enumerate(row):
                per_stage[s] = self.grads_packing.unpack(int(s), [np.asarray(a)[r, c] for a in packed])
        return self.model.join_stage_params(per_stage)

    def boundary(self, x_mb: Any) -> Any:
        """What every stage passes to the next for microbatch ``x_mb``, as (a pytree of)
        ``jax.ShapeDtypeStruct``; a float32 scalar for a single stage.

        Raises:
            ValueError: two boundaries with different structures, shapes or dtypes.
        """
        shapes = self.model.stage_inputs(x_mb)[1:]
        if not shapes:
            return jax.ShapeDtypeStruct((), jnp.float32)

        def describe(tree):
            return str(jax.tree_util.tree_map(lambda a: f"{a.dtype}{list(a.shape)}", tree))

        for s, shape in enumerate(shapes[1:], start=2):
            if describe(shape) != describe(shapes[0]):
                raise ValueError(f"the SPMD executor passes one activation structure between all stages, but "
                                 f"stage 1 receives {describe(shapes[0])} and stage {s} receives "
                                 f"{describe(shape)}; cut the model where every stage boundary has one "
                                 "shape, or run it with PipelineExecutor")
        return shapes[0]

    def _trace_stages(self, p_packed: tuple, tokens: Any, labels: Any, keys: Any, x_between: Any) -> _Traced:
        """Every stage's :class:`~zbpp_lite.runtime.split.StageSplit`, traced inside ``shard_map`` on varying
        values (``x_between``: zeros like a stage boundary), and the packings of what they keep."""
        model, S = self.model, self.model.num_stages
        splits, kept_by_stage = [], []
        for s in range(S):
            params = self.params_packing.unpack(s, tuple(b[0] for b in p_packed))
            x, aux = tokens[0] if s == 0 else x_between, _aux(model, s, labels, keys, 0)
            split = StageSplit(model.stage_fn(s), params, x, aux, input_grad=s > 0)
            p_leaves = tuple(jax.tree_util.tree_leaves(params))
            y, own_s, kept_s = jax.eval_shape(split.flat.forward, p_leaves, x, aux, None)
            dy = jax.tree_util.tree_map(lambda a: to_varying(jnp.zeros(a.shape, a.dtype)), y)
            _, gout_s = jax.eval_shape(split.flat.backward_input, p_leaves, own_s, dy, None)  # W reads B's
            splits.append(split)
            kept_by_stage.append((own_s, kept_s, gout_s))
        own, kept, gout = (Packing.of(list(per_stage)) for per_stage in zip(*kept_by_stage))
        return _Traced(tuple(splits), own, kept, gout, y)  # y: the last stage's, the loss

    def _branches(self, traced: _Traced, p_packed: tuple, tokens: Any, labels: Any, keys: Any,
                  zero_msg: Any) -> list:
        """The tick's branches: idle, then F, B, W, BW of every stage at ``1 + (kind - 1) * S + stage``."""
        pk, gk, m = self.params_packing, self.grads_packing, self.schedule.num_microbatches
        seed = to_varying(jnp.full(traced.loss.shape, 1.0 / m, traced.loss.dtype))  # as PipelineExecutor's
        used = {a.kind for row in self.schedule.actions for a in row}
        tmap = jax.tree_util.tree_map

        def outputs(own=None, kept=None, gout=None, grads=None, msg=None, loss=None) -> dict:
            """A branch's results, every field present (zeros if none) and varying, so the types match."""
            return to_varying(dict(
                own=own or traced.own.zeros(), kept=kept or traced.kept.zeros(),
                gout=gout or traced.gout.zeros(), grads=grads or gk.zeros(),
                msg=zero_msg if msg is None else msg,
                loss=jnp.zeros((), jnp.float32) if loss is None else loss.reshape(())))

        def branches_of(s: int, flat):
            first, last = s == 0, s == len(traced.splits) - 1

            def params(c):
                return tuple(jax.tree_util.tree_leaves(pk.unpack(s, tuple(b[c] for b in p_packed))))

            def take(store, packing, c, j):
                return packing.unpack(s, tuple(b[c, j] for b in store))

            def output_grad(state, c, j):
                return seed if last else tmap(lambda b: b[c, j], state["grad"])

            def forward(state, c, j):
                x = tokens[j] if first else tmap(lambda b: b[c, j], state["act"])
                y, own, kept = flat.forward(params(c), x, _aux(self.model, s, labels, keys, j), None)
                return outputs(own=traced.own.pack(s, own), kept=traced.kept.pack(s, kept), msg=zero_msg
                               if last else y, loss=y.astype(jnp.float32) if last else None)

            def backward_input(state, c, j):
                own = take(state["own"], traced.own, c, j)
                dx, gout = flat.backward_input(params(c), own, output_grad(state, c, j), None)
                return outputs(gout=traced.gout.pack(s, gout), msg=zero_msg if first else dx)

            def backward_weight(state, c, j):
                kept, gout = take(state["kept"], traced.kept, c, j), take(state["gout"], traced.gout, c, j)
                return outputs(grads=gk.pack(s, flat.backward_weight(params(c), kept, gout, None)))

            def backward_fused(state, c, j):
                own, kept = take(state["own"], traced.own, c, j), take(state["kept"], traced.kept, c, j)
                dx, grads = flat.backward_fused(params(c), own, kept, output_grad(state, c, j), None)
                return outputs(grads=gk.pack(s, grads), msg=zero_msg if first else dx)

            return {"F": forward, "B": backward_input, "W": backward_weight, "BW": backward_fused}

        def idle(state, c, j):
            return outputs()

        per_stage = [branches_of(s, split.flat) for s, split in enumerate(traced.splits)]
        return [idle] + [per_stage[s][kind] if kind in used else idle
                         for kind in KIND_CODE for s in range(len(per_stage))]

    def _program(self, x_mb: Any, labels_mb: Any):
        """The jitted ``((kind, chunk, microbatch), recv, stage_of, params, tokens, labels, keys) -> (losses,
        gradient sums)`` for microbatches like ``x_mb``, ``labels_mb``; outputs replicated. ``keys``:
        the step's dropout keys (m, 2), or (m, 0) without dropout."""
        m = self.schedule.num_microbatches
        boundary = self.boundary(x_mb)  # refuses differing boundaries before anything is traced
        v = self.stage_of.shape[1]
        tmap = jax.tree_util.tree_map

        def zeros_x(prefix=()):  # zeros shaped like what stages pass on, with leading dimensions prefix
            return tmap(lambda s: jnp.zeros(tuple(prefix) + tuple(s.shape), s.dtype), boundary)

        def rank_program(ticks, recv, stage_of, p_packed, tokens, labels, keys):
            # ticks: kind, chunk, mbs (1, T) each; stage_of (1, v); p_packed: (1, v, size) per dtype;
            # tokens (m, mb, ...)
            kind, chunk, mbs = (a[0] for a in ticks)
            stage_of = stage_of[0]
            recv, p_packed = tmap(lambda a: a[0], recv), tmap(lambda a: a[0], p_packed)
            if self.vary_replicated:  # JAX #40823: replicated inputs made varying before the switch
                tokens, labels, keys = to_varying((tokens, labels, keys))
            keys = keys if keys.shape[1] else None
            zero_msg = to_varying(zeros_x())
            traced = self._trace_stages(p_packed, tokens, labels, keys, zero_msg)
            branches = self._branches(traced, p_packed, tokens, labels, keys, zero_msg)
            slots = lambda packing: packing.zeros((v, m + 1))  # noqa: E731 - slot m: scratch
            carry = {  # received activations and output gradients, what F, B keep, sums, losses
                "act": zeros_x((v, m)), "grad": zeros_x((v, m)), "own": slots(traced.own),
                "kept": slots(traced.kept), "gout": slots(traced.gout), "msg": zero_msg,
                "acc": self.grads_packing.zeros((v,)), "losses": jnp.zeros((m,), jnp.float32),
            }
            carry = to_varying(carry)  # loop carries created inside shard_map: varying too (#40823)
            n = lax.axis_size(AXIS) if hasattr(lax, "axis_size") else self.schedule.num_ranks
            tick = self._tick(branches, stage_of, n)
            st, _ = lax.scan(tick, carry, (kind, chunk, mbs, recv))
            rank = lax.axis_index(AXIS)  # every rank's gradient sums, as (p, v, size) on every rank
            acc = tuple(lax.psum(jnp.zeros((n,) + a.shape, a.dtype).at[rank].set(a), AXIS) for a in st["acc"])
            return lax.psum(st["losses"], AXIS), acc

        in_specs = (P(AXIS),) * 4 + (P(), P(), P())
        return jax.jit(shard_map(rank_program, self.mesh, in_specs, (P(), P())))

    def _tick(self, branches: list, stage_of: Any, n: int):
        """One tick for ``lax.scan``: the switch, its slot values written back, the message passed on."""
        m, S, tmap = self.schedule.num_microbatches, self.model.num_stages, jax.tree_util.tree_map
        to_right, to_left = [(i, (i + 1) % n) for i in range(n)], [(i, (i - 1) % n) for i in range(n)]

        def deliver(st, value, buf, c, j):
            def put(buffer, flag):
                return tmap(lambda b, u: b.at[c, j].set(jnp.where(flag, u, b[c, j])), buffer, value)

            return {**st, "act": put(st["act"], buf == ACT_BUFFER),
                    "grad": put(st["grad"], buf == GRAD_BUFFER)}

        def sent(msg):  # what ranks r - 1 and r + 1 sent
            return {"left": lax.ppermute(msg, AXIS, to_right), "right": lax.ppermute(msg, AXIS, to_left)}

        def tick(st, xs):
            kind_t, c, j, arrivals = xs
            early = sent(st["msg"]) if self.tables.overlap else {}  # the previous tick's, beside the switch
            branch = jnp.where(kind_t == 0, 0, 1 + (kind_t - 1) * S + stage_of[c])
            out = lax.switch(branch, branches, st, c, j)
            scratch = jnp.int32(m)  # F writes own and kept, B gout; other kinds the scratch slot
            j_res = jnp.where(kind_t == KIND_CODE["F"], j, scratch)
            j_gout = jnp.where(kind_t == KIND_CODE["B"], j, scratch)

            def put(store, jj, values):
                return tuple(b.at[c, jj].set(u) for b, u in zip(store, values))

            st = {**st, "own": put(st["own"], j_res, out["own"]), "kept": put(st["kept"], j_res, out["kept"]),
                  "gout": put(st["gout"], j_gout, out["gout"]), "msg": out["msg"],
                  "acc": tuple(a.at[c].add(g) for a, g in zip(st["acc"], out["grads"])),
                  "losses": st["losses"].at[j].add(out["loss"])}
            incoming = {**(early if self.tables.overlap else sent(st["msg"])), "self": st["msg"]}
            for src in SOURCES:
                st = deliver(st, incoming[src], *arrivals[src])
            return st, None

        return tick

    def _global(self, value: Any, spec: P) -> Any:
        """A global array from the same host value on every process."""
        sharding = NamedSharding(self.mesh, spec)
        return jax.tree_util.tree_map(lambda a: jax.make_array_from_callback(
            np.shape(a), sharding, lambda idx, a=np.asarray(a): a[idx]), value)

    def inputs(self, params: Params, x: Any, labels: Any, keys: Any = None) -> tuple:
        """The program's arguments (global arrays) for ``params`` and a batch (``x`` keeps its dtype), and
        the step's dropout ``keys`` (as :meth:`~zbpp_lite.runtime.executor.PipelineExecutor.run`'s)."""
        m = self.schedule.num_microbatches
        # each keeps its dtype, as jax.device_put would give it (float64 -> float32 without x64)
        x, labels = (np.asarray(a, jax.dtypes.canonicalize_dtype(np.asarray(a).dtype)) for a in (x, labels))
        batch_microbatch_size(x, labels, m)  # ValueError: a batch that does not cut into m microbatches
        keys = self.model.step_keys(None if keys is None else [keys], 1, m)[0]
        keys = np.zeros((m, 0), np.uint32) if keys is None else keys
        t = self.tables
        recv = {src: t.recv[src] for src in SOURCES}
        args_sharded = ((t.kind, t.chunk, t.microbatch), recv, self.stage_of, self.pack_params(params))
        args_replicated = (x.reshape((m, -1) + x.shape[1:]), labels.reshape((m, -1) + labels.shape[1:]), keys)
        return self._global(args_sharded, P(AXIS)) + self._global(args_replicated, P())

    def compiled(self, args: tuple):
        """The jitted program for :meth:`inputs`' ``args`` (built on first use per batch shape)."""
        x_mb, labels_mb = (jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in args[-3:-1])
        key = (x_mb.shape, str(x_mb.dtype), labels_mb.shape, str(labels_mb.dtype), args[-1].shape)
        if key not in self._compiled:
            self._compiled[key] = self._program(x_mb, labels_mb)
        return self._compiled[key]

    def run(self, params: Params, x: Any, labels: Any, keys: Any = None, update: None = None) -> SpmdResult:
        """One step: loss and gradients of the global-batch mean loss (seed 1/m, as the MPMD executor);
        each tied copy's gradient is the sum over its copies (``StagedModel.sum_tied``). ``keys``: the
        step's :func:`~zbpp_lite.runtime.stages.dropout_keys` for a model with dropout (ValueError
        without them, :meth:`~zbpp_lite.runtime.stages.StagedModel.step_keys`). ``update``: None, the
        optimizer steps after the run (ValueError otherwise: the program has no rank threads)."""
        if update is not None:
            raise ValueError("the SPMD program steps no optimizer inside it: update the parameters after "
                             "the run (StageAdamW), or use PipelineExecutor for a clipped step")
        args = self.inputs(params, x, labels, keys)
        losses, acc = self.compiled(args)(*args)
        losses, acc = jax.tree_util.tree_map(lambda a: np.asarray(a.addressable_data(0)), (losses, acc))
        # every rank's sums are on every rank (the psum above): tied copies summed here, on the host
        return SpmdResult(float(np.mean(losses.astype(np.float64))), tuple(float(v) for v in losses),
                          self.model.sum_tied(self.unpack_grads(acc)))
