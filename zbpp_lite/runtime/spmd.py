"""The compiled SPMD executor: a whole schedule as one jitted program over a mesh axis ``stage``.

Where :class:`~zbpp_lite.runtime.executor.PipelineExecutor` runs one Python thread per rank (MPMD: every
rank its own program), this module compiles a :class:`~zbpp_lite.schedules.ir.Schedule` into a
single program that every rank runs in lockstep, the form TPU pods use:

1. :func:`tick_tables` turns the schedule into a static per-tick action table
   (:func:`zbpp_lite.schedules.simulate.lockstep_ticks`): for every tick and rank, the action kind, the
   rank's chunk (which of its stages) and the microbatch, plus what arrives at the end of the tick.
2. The program is ``lax.scan`` over the ticks inside ``shard_map`` over ``stage``: each tick, every
   rank does ``lax.switch`` on its action kind (idle, F, B, W, BW), then its one outgoing message
   (an F's activation or a B's input gradient) travels with two ``lax.ppermute``, to rank r+1 and
   to rank r-1 (cyclic), which covers the 1F1B / zero-bubble placement, the looped placement and
   the V placement (where chunk 1 flows backwards and the turn at rank p-1 stays local).
3. Received values wait in per-(chunk, microbatch) buffers until their action's tick. The switch
   reads the buffers but returns only the tick's slot values, written back outside it (a slot a
   kind does not produce goes to a scratch slot): a switch that passed the whole carry through
   made XLA copy every buffer each tick, 4.3x the MPMD executor's step time where it is now
   1.6x (``benchmarks/bench_spmd.py``, zb-h1, p=2, d=64, 2 simulated CPU devices).

Homogeneous stages. One program needs one stage body, with the parameters of every rank stacked
along ``stage``. The Transformer's stages differ: the embedding sits on the first stage, the head
and the loss on the last. So a stage here is its Transformer blocks (every stage holds the same
number, stacked as ``(p, stages per rank, ...)``), and the embedding and the head are masked
branches: every rank holds a copy (replicated), every F computes both, and a per-(rank, chunk)
flag keeps the embedding only on stage 0 and the loss only on the last stage; their gradients,
zero elsewhere, are summed over ranks at the end. Both are small (Linear(8, d), Linear(d, 10)),
so the masked work costs little. The blocks' backward is split into B and W by
:class:`~zbpp_lite.runtime.split.StageSplit` exactly as in the MPMD executor.

What stages pass on may be one array or a pytree (a tuple ``(hidden, residual)``, a dict): every
buffer of activations and their gradients, and the message each tick sends, then holds one array
per leaf (``tests/test_byo_model.py``).

JAX issue #40823: a ``lax.switch`` / ``lax.cond`` whose index varies over a mesh axis, applied to
an input that is replicated (invariant) over that axis, can return silently wrong gradients,
because the implicit broadcast of the replicated input transposes to a ``psum`` that only some
ranks reach. Every replicated input (embedding and head parameters, inputs, labels) and every
loop carry created inside ``shard_map`` is therefore made varying first with
``lax.pcast(x, "stage", to="varying")`` (``lax.pvary`` in JAX 0.6-0.7; nothing before the
varying-axes type system existed). ``tests/test_spmd.py`` keeps a test that fails without it.

Lockstep costs something: every tick lasts as long as its slowest action (plus the transfer);
:func:`zbpp_lite.simulate` with ``lockstep=True`` predicts it. Buffers hold every microbatch
(m slots per chunk, plus the scratch slot), not only those in flight: simple, and m is small here.

Sources: Qi et al., arXiv 2401.10241, sections 2-3 (F, B, W and the H1 / H2 schedules); the V
placement and ZB-V, arXiv 2405.15362, section 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .stages import Params, StagedModel
from ..schedules.ir import Schedule
from ..schedules.simulate import lockstep_ticks
from .split import StageSplit
from ..schedules.validate import validate

AXIS = "stage"
"""The mesh axis the pipeline runs over: one rank per position."""

KIND_CODE = {"F": 1, "B": 2, "W": 3, "BW": 4}
"""Action kind -> branch index of the tick's ``lax.switch`` (0 is idle)."""
NO_BUFFER, ACT_BUFFER, GRAD_BUFFER = 0, 1, 2
"""Where an arriving message goes: nowhere, the activation buffer (input of a later F), the
gradient buffer (output gradient of a later B or BW)."""
SOURCES = ("left", "right", "self")
"""Where a message can come from: rank r-1 (cyclic), rank r+1 (cyclic), the rank itself."""

try:  # JAX >= 0.7: jax.shard_map with varying-axes checking (check_vma)
    _shard_map = jax.shard_map
    _CHECK_ARG = "check_vma"
except AttributeError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map as _shard_map

    _CHECK_ARG = "check_rep"


def to_varying(x: Any, axis: str = AXIS) -> Any:
    """Mark every leaf of ``x`` as varying over ``axis`` (see the module docstring, #40823).

    ``lax.pcast(x, axis, to="varying")`` in current JAX, ``lax.pvary`` in JAX 0.6-0.7; identity
    where JAX has no varying-axes types (nothing to fix there). Leaves already varying stay as
    they are.
    """
    if hasattr(lax, "pcast"):
        cast = lambda a: lax.pcast(a, axis, to="varying")  # noqa: E731
    elif hasattr(lax, "pvary"):  # pragma: no cover - JAX 0.6-0.7
        cast = lambda a: lax.pvary(a, axis)  # noqa: E731
    else:  # pragma: no cover - JAX without varying-axes types
        return x

    def one(a):
        return a if axis in varying_axes(a) else cast(a)

    return jax.tree_util.tree_map(one, x)


def varying_axes(x: Any) -> frozenset:
    """The mesh axes a traced value varies over: ``aval.vma`` in JAX 0.6-0.9,
    ``aval.manual_axis_type.varying`` from JAX 0.10; empty outside ``shard_map``."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


# ---------------------------------------------------------------------------- static tables


@dataclass(frozen=True)
class TickTables:
    """A schedule's lockstep program as static integer tables (NumPy int32).

    Attributes:
        kind, chunk, microbatch: ``(num_ranks, num_ticks)``: what rank r does in tick t (kind 0
            idle, else :data:`KIND_CODE`), on which of its chunks (index into
            ``schedule.stages_of(r)``) and which microbatch.
        recv: ``{source: (buffer, chunk, microbatch)}`` for each of :data:`SOURCES`, each table
            ``(num_ranks, num_ticks)``: where the message arriving at the end of tick t from that
            source is stored (buffer :data:`NO_BUFFER` when none arrives).
        first, last: ``(num_ranks, stages_per_rank)`` 1 where that chunk is stage 0 / stage S-1.
    """

    kind: np.ndarray
    chunk: np.ndarray
    microbatch: np.ndarray
    recv: dict
    first: np.ndarray
    last: np.ndarray

    @property
    def num_ticks(self) -> int:
        return self.kind.shape[1]


def tick_tables(schedule: Schedule) -> TickTables:
    """The static per-tick tables of ``schedule`` (see :class:`TickTables`).

    Raises:
        ScheduleError: an invalid schedule.
        ValueError: ranks holding different numbers of stages, a transfer between ranks that
            are not neighbours on the ring (only r -> r+1, r -> r-1 and r -> r travel), or an
            overlapped F&B pair (DualPipeV's): a tick runs one action per rank.
    """
    validate(schedule)
    if schedule.has_pairs:
        raise ValueError(
            "the SPMD executor runs one action per rank per tick and has no overlapped F&B pair; run "
            "schedule.split_pairs() (each pair as its two actions, the same gradients) or the thread executor"
        )
    p, S = schedule.num_ranks, schedule.num_stages
    chunks = [schedule.stages_of(r) for r in range(p)]
    if len({len(c) for c in chunks}) != 1:
        raise ValueError(
            f"the SPMD executor stacks one set of stages per rank, so every rank must hold the same number "
            f"of stages; this placement gives {[len(c) for c in chunks]} stages to ranks 0..{p - 1}"
        )
    ticks = lockstep_ticks(schedule)
    T = len(ticks)
    kind, chunk, mb = (np.zeros((p, T), np.int32) for _ in range(3))
    recv = {src: tuple(np.zeros((p, T), np.int32) for _ in range(3)) for src in SOURCES}
    for t, row in enumerate(ticks):
        for r, step in enumerate(row):
            if step is None:
                continue
            a = schedule.actions[r][step]
            kind[r, t], chunk[r, t], mb[r, t] = KIND_CODE[a.kind], chunks[r].index(a.stage), a.microbatch
            if a.kind == "F" and a.stage < S - 1:
                consumer, buffer = a.stage + 1, ACT_BUFFER
            elif a.kind in ("B", "BW") and a.stage > 0:
                consumer, buffer = a.stage - 1, GRAD_BUFFER
            else:
                continue
            dst = schedule.placement[consumer]
            if dst == r:
                src = "self"
            elif dst == (r + 1) % p:
                src = "left"  # the consumer receives it from its left neighbour
            elif dst == (r - 1) % p:
                src = "right"
            else:
                raise ValueError(
                    f"{a} on rank {r} sends to stage {consumer} on rank {dst}, not a ring neighbour; the SPMD "
                    f"executor moves values only to rank r+1 or r-1 (placements: one stage per rank, looped, V)"
                )
            buf, ch, j = recv[src]
            buf[dst, t], ch[dst, t], j[dst, t] = buffer, chunks[dst].index(consumer), a.microbatch
    v = len(chunks[0])
    first = np.array([[int(s == 0) for s in chunks[r]] for r in range(p)], np.int32).reshape(p, v)
    last = np.array([[int(s == S - 1) for s in chunks[r]] for r in range(p)], np.int32).reshape(p, v)
    return TickTables(kind, chunk, mb, recv, first, last)


# ---------------------------------------------------------------------------- the program


@dataclass(frozen=True)
class SpmdResult:
    """One step of the compiled SPMD executor (before the optimizer).

    Attributes:
        loss: global-batch mean loss, float.
        microbatch_losses: the loss of each microbatch, floats.
        grads: gradient of ``loss`` per model module (as ``StagedModel.params``), NumPy float32.
    """

    loss: float
    microbatch_losses: tuple[float, ...]
    grads: Params


class SpmdExecutor:
    """A schedule compiled into one jitted SPMD program over the mesh axis ``stage``.

    Args:
        model: the staged model (its ``num_stages`` must be the schedule's); its modules are
            ``[first, *blocks, last]`` with ``blocks`` a multiple of the number of stages, so every
            stage holds the same blocks (see the module docstring).
        schedule: any valid schedule whose ranks hold equally many stages and whose transfers go
            to ring neighbours (1f1b, zb-h1, zb-h2, interleaved, zb-v, ...).
        devices: one device per rank (default ``jax.devices()[:p]``); in a multi-process run the
            global devices, any process's.
        vary_replicated: make replicated inputs varying before the switch (the #40823 fix). Only
            tests turn it off, to show what goes wrong without it.

    :meth:`run` takes the model's parameters, a global batch ``x`` (b, 8, 8) float32 and labels
    (b,) int, and returns an :class:`SpmdResult`. Compilation happens on the first call for a
    batch shape.

    Raises:
        ScheduleError: an invalid schedule. ValueError: a model with another number of stages,
        stages holding different numbers of blocks, an unsupported placement (see
        :func:`tick_tables`), or too few devices.
    """

    def __init__(self, model: StagedModel, schedule: Schedule, devices: Sequence[Any] | None = None, *, vary_replicated: bool = True):
        if model.num_stages != schedule.num_stages:
            raise ValueError(f"the schedule has {schedule.num_stages} stages but the model is cut into {model.num_stages}")
        self.tables = tick_tables(schedule)
        blocks = [[i for i in part if 0 < i < model.num_parts - 1] for part in model.parts]
        if len({len(b) for b in blocks}) != 1:
            raise ValueError(
                f"the SPMD executor needs the same number of blocks in every stage; {model.num_parts - 2} blocks over "
                f"{model.num_stages} stages give {[len(b) for b in blocks]}: use a multiple of {model.num_stages} blocks"
            )
        p = schedule.num_ranks
        if devices is None:
            devices = jax.devices()[:p]
        if len(devices) != p:
            raise ValueError(f"give one device per rank: the schedule has {p} ranks, got {len(devices)} devices")
        self.model, self.schedule, self.vary_replicated = model, schedule, vary_replicated
        self.mesh = Mesh(np.array(devices), (AXIS,))
        # module indices of the blocks of rank r, chunk c, block k
        self.block_index = [[blocks[s] for s in schedule.stages_of(r)] for r in range(p)]
        self._compiled: dict = {}

    # ------------------------------------------------------------------ parameters

    def stack(self, params: Params) -> list:
        """Block parameters stacked per block position k: a list (one per block of a stage) of
        pytrees whose leaves are ``(p, stages per rank, ...)``."""
        p, v, k = len(self.block_index), len(self.block_index[0]), len(self.block_index[0][0])
        return [
            jax.tree_util.tree_map(
                lambda *leaves: np.stack([np.asarray(a) for a in leaves]).reshape((p, v) + np.shape(leaves[0])),
                *[params[self.block_index[r][c][i]] for r in range(p) for c in range(v)],
            )
            for i in range(k)
        ]

    def unstack(self, stacked: list, first: Any, last: Any) -> Params:
        """Inverse of :meth:`stack` (for gradients), with the first and last module's entries."""
        grads: list = [None] * self.model.num_parts
        grads[0], grads[-1] = first, last
        for r, per_chunk in enumerate(self.block_index):
            for c, indices in enumerate(per_chunk):
                for i, module in enumerate(indices):
                    grads[module] = jax.tree_util.tree_map(lambda a: np.asarray(a)[r, c], stacked[i])
        return grads

    # ------------------------------------------------------------------ build

    def _program(self, mb_shape: tuple, label_shape: tuple):
        model, tables = self.model, self.tables
        m = self.schedule.num_microbatches
        k = len(self.block_index[0][0])

        def embed(p_first, tokens):
            return model.apply_part(0, p_first, tokens)

        def blocks_fn(p_blocks, x, _aux):
            for p_k in p_blocks:
                x = model.apply_part(1, p_k, x)
            return x

        def head_loss(p_last, h, labels):
            return model.loss_fn(model.apply_part(model.num_parts - 1, p_last, h), labels)

        # what stages pass on: one array, or a pytree (a tuple or dict of arrays); every buffer below
        # of activations or their gradients has that structure, one array per leaf
        x_shape = jax.eval_shape(embed, model.params[0], jax.ShapeDtypeStruct(mb_shape, jnp.float32))
        tmap = jax.tree_util.tree_map

        def zeros_x(prefix=()):  # zeros shaped like the activation, with leading dimensions prefix
            return tmap(lambda s: jnp.zeros(tuple(prefix) + tuple(s.shape), s.dtype), x_shape)

        def where_x(flag, a, b):
            return tmap(lambda u, w: jnp.where(flag, u, w), a, b)

        def get_x(buffer, index):
            return tmap(lambda b: b[index], buffer)

        def set_x(buffer, index, value):
            return tmap(lambda b, u: b.at[index].set(u), buffer, value)
        v = tables.first.shape[1]

        def slots(shapes):  # one buffer per leaf: (stages per rank, m + 1, *leaf shape); slot m: scratch
            return tuple(jnp.zeros((v, m + 1) + tuple(s.shape), s.dtype) for s in shapes)

        def rank_program(kind, chunk, mbs, recv, first, last, p_blocks, p_first, p_last, tokens, labels):
            # kind, chunk, mbs (1, T); p_blocks leaves (1, v, ...); tokens (m, mb, 8, 8); labels (m, mb)
            kind, chunk, mbs, first, last = kind[0], chunk[0], mbs[0], first[0], last[0]
            recv = jax.tree_util.tree_map(lambda a: a[0], recv)
            p_blocks = jax.tree_util.tree_map(lambda a: a[0], p_blocks)
            if self.vary_replicated:  # JAX #40823: replicated inputs made varying before the switch
                p_first, p_last, tokens, labels = to_varying((p_first, p_last, tokens, labels))
            zeros_like = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)  # noqa: E731
            # The blocks' F / B / W, traced here, on values varying over the axis: StageSplit
            # replays primitives one by one, so the varying-axes casts must be in its program.
            x_example = to_varying(zeros_x())
            params_example = jax.tree_util.tree_map(lambda a: a[0], p_blocks)
            split = StageSplit(blocks_fn, params_example, x_example, None, input_grad=True)
            _, res_shape, kept_shape = jax.eval_shape(split.forward, params_example, x_example, None)
            _, gout_shape = jax.eval_shape(split.backward_input, res_shape, x_example)
            carry = dict(
                act=zeros_x((v, m)),  # received activations
                grad=zeros_x((v, m)),  # received output gradients
                res=slots(res_shape), kept=slots(kept_shape), gout=slots(gout_shape),
                head_in=zeros_x((m,)),  # last stage's block output
                embed_grad=zeros_x((m,)),  # stage 0's input gradient
                acc=zeros_like(p_blocks), acc_first=zeros_like(p_first), acc_last=zeros_like(p_last),
                losses=jnp.zeros((m,), jnp.float32),
                msg=zeros_x(),
            )
            carry = to_varying(carry)  # loop carries created inside shard_map: varying too (#40823)

            def chunk_params(c):
                return jax.tree_util.tree_map(lambda a: a[c], p_blocks)

            def put(buffers, c, j, values):
                return tuple(b.at[c, j].set(x) for b, x in zip(buffers, values))

            def take(buffers, c, j):
                return tuple(b[c, j] for b in buffers)

            # The switch reads the carry but returns one (chunk, microbatch) slot's new values, which
            # are written back outside it (in-place dynamic updates); a slot a kind does not
            # produce goes to the scratch slot m, so no branch passes a big buffer through (XLA
            # copies a conditional's pass-through outputs: 4x slower, measured).
            zero_msg = to_varying(zeros_x())
            zero_loss = to_varying(jnp.zeros((), jnp.float32))
            zeros_of = lambda shapes: tuple(to_varying(jnp.zeros(sh.shape, sh.dtype)) for sh in shapes)  # noqa: E731

            def outputs(st, c, j, **new):
                out = {"res": None, "kept": None, "gout": None, "head_in": get_x(st["head_in"], j), "embed_grad": get_x(st["embed_grad"], j),
                       "acc": jax.tree_util.tree_map(lambda a: a[c], st["acc"]), "acc_first": st["acc_first"],
                       "acc_last": st["acc_last"], "msg": zero_msg, "loss": zero_loss, **new}
                for name, shapes in (("res", res_shape), ("kept", kept_shape), ("gout", gout_shape)):
                    if out[name] is None:
                        out[name] = zeros_of(shapes)
                return out

            def idle(st, c, j):
                return outputs(st, c, j)

            def forward(st, c, j):
                x_in = where_x(first[c] == 1, embed(p_first, tokens[j]), get_x(st["act"], (c, j)))
                h, res, kept = split.forward(chunk_params(c), x_in, None)
                is_last = last[c] == 1
                loss = head_loss(p_last, h, labels[j])
                return outputs(st, c, j, res=tuple(res), kept=tuple(kept), head_in=where_x(is_last, h, get_x(st["head_in"], j)),
                               loss=jnp.where(is_last, loss, 0.0), msg=h)

            def input_grad(st, c, j):
                dh_head = jax.grad(head_loss, argnums=1)(p_last, get_x(st["head_in"], j), labels[j])
                dy = where_x(last[c] == 1, dh_head, get_x(st["grad"], (c, j)))
                dx, gout = split.backward_input(take(st["res"], c, j), dy)
                return dx, tuple(gout), where_x(first[c] == 1, dx, get_x(st["embed_grad"], j))

            def weight_grad(st, c, j, gout, embed_grad_j):
                acc_c = jax.tree_util.tree_map(lambda a: a[c], st["acc"])
                acc_c = split.backward_weight(chunk_params(c), take(st["kept"], c, j), gout, acc_c)
                _, embed_vjp = jax.vjp(lambda p: embed(p, tokens[j]), p_first)
                (g_first,) = embed_vjp(embed_grad_j)
                g_last = jax.grad(head_loss)(p_last, get_x(st["head_in"], j), labels[j])
                masked_add = lambda flag: lambda a, g: a + jnp.where(flag, g, 0.0)  # noqa: E731
                return dict(acc=acc_c, acc_first=jax.tree_util.tree_map(masked_add(first[c] == 1), st["acc_first"], g_first),
                            acc_last=jax.tree_util.tree_map(masked_add(last[c] == 1), st["acc_last"], g_last))

            def backward_input(st, c, j):
                dx, gout, embed_grad_j = input_grad(st, c, j)
                return outputs(st, c, j, gout=gout, msg=dx, embed_grad=embed_grad_j)

            def backward_weight(st, c, j):
                return outputs(st, c, j, **weight_grad(st, c, j, take(st["gout"], c, j), get_x(st["embed_grad"], j)))

            def backward_fused(st, c, j):
                dx, gout, embed_grad_j = input_grad(st, c, j)
                return outputs(st, c, j, msg=dx, embed_grad=embed_grad_j, **weight_grad(st, c, j, gout, embed_grad_j))

            branches = [idle, forward, backward_input, backward_weight, backward_fused]
            n = lax.axis_size(AXIS) if hasattr(lax, "axis_size") else self.schedule.num_ranks
            to_right = [(i, (i + 1) % n) for i in range(n)]
            to_left = [(i, (i - 1) % n) for i in range(n)]

            def deliver(st, value, buf, c, j):
                act = set_x(st["act"], (c, j), where_x(buf == ACT_BUFFER, value, get_x(st["act"], (c, j))))
                grad = set_x(st["grad"], (c, j), where_x(buf == GRAD_BUFFER, value, get_x(st["grad"], (c, j))))
                return {**st, "act": act, "grad": grad}

            def tick(st, xs):
                kind_t, c, j, arrivals = xs
                out = lax.switch(kind_t, branches, st, c, j)
                scratch = jnp.int32(m)
                j_res = jnp.where(kind_t == KIND_CODE["F"], j, scratch)  # F writes res and kept, B gout
                j_gout = jnp.where(kind_t == KIND_CODE["B"], j, scratch)
                st = {**st, "res": put(st["res"], c, j_res, out["res"]), "kept": put(st["kept"], c, j_res, out["kept"]),
                      "gout": put(st["gout"], c, j_gout, out["gout"]), "head_in": set_x(st["head_in"], j, out["head_in"]),
                      "embed_grad": set_x(st["embed_grad"], j, out["embed_grad"]),
                      "acc": jax.tree_util.tree_map(lambda a, g: a.at[c].set(g), st["acc"], out["acc"]),
                      "acc_first": out["acc_first"], "acc_last": out["acc_last"],
                      "losses": st["losses"].at[j].add(out["loss"]), "msg": out["msg"]}
                incoming = {
                    "left": lax.ppermute(st["msg"], AXIS, to_right),  # what rank r-1 sent
                    "right": lax.ppermute(st["msg"], AXIS, to_left),  # what rank r+1 sent
                    "self": st["msg"],
                }
                for src in SOURCES:
                    st = deliver(st, incoming[src], *arrivals[src])
                return st, None

            st, _ = lax.scan(tick, carry, (kind, chunk, mbs, recv))
            # gather results so every process can read them (replicated outputs)
            losses = lax.psum(st["losses"], AXIS)
            acc_first = lax.psum(st["acc_first"], AXIS)
            acc_last = lax.psum(st["acc_last"], AXIS)
            rank = lax.axis_index(AXIS)  # every rank's block gradients, as (p, v, ...) on every rank
            acc = jax.tree_util.tree_map(
                lambda a: lax.psum(jnp.zeros((n,) + a.shape, a.dtype).at[rank].set(a), AXIS), st["acc"]
            )
            return losses, acc, acc_first, acc_last

        sharded, replicated = P(AXIS), P()
        in_specs = (sharded, sharded, sharded, sharded, sharded, sharded, sharded, replicated, replicated, replicated, replicated)
        out_specs = (replicated, replicated, replicated, replicated)
        body = _shard_map(rank_program, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, **{_CHECK_ARG: True})
        return jax.jit(body), k

    # ------------------------------------------------------------------ run

    def _global(self, value: Any, spec: P) -> Any:
        """A global array from the same host value on every process."""
        sharding = NamedSharding(self.mesh, spec)
        return jax.tree_util.tree_map(
            lambda a: jax.make_array_from_callback(np.shape(a), sharding, lambda idx, a=np.asarray(a): a[idx]), value
        )

    def inputs(self, params: Params, x: Any, labels: Any) -> tuple:
        """The program's arguments (global arrays) for ``params`` and a batch."""
        m = self.schedule.num_microbatches
        x, labels = np.asarray(x, np.float32), np.asarray(labels)
        if x.shape[0] % m or labels.shape[0] != x.shape[0]:
            raise ValueError(f"a batch of {x.shape[0]} inputs and {labels.shape[0]} labels does not divide into {m} microbatches")
        t = self.tables
        host = lambda tree: jax.tree_util.tree_map(np.asarray, tree)  # noqa: E731
        recv = {src: t.recv[src] for src in SOURCES}
        args_sharded = (t.kind, t.chunk, t.microbatch, recv, t.first, t.last, self.stack(params))
        args_replicated = (host(params[0]), host(params[-1]), x.reshape((m, -1) + x.shape[1:]), labels.reshape(m, -1))
        return self._global(args_sharded, P(AXIS)) + self._global(args_replicated, P())

    def run(self, params: Params, x: Any, labels: Any) -> SpmdResult:
        """One step: loss and gradients of the global-batch mean loss (gradients summed over
        microbatches and divided by m, as the MPMD executor). See the class docstring."""
        args = self.inputs(params, x, labels)
        key = (args[-2].shape, args[-1].shape)
        if key not in self._compiled:
            self._compiled[key] = self._program(args[-2].shape[1:], args[-1].shape[1:])
        program, _ = self._compiled[key]
        losses, acc, acc_first, acc_last = program(*args)
        local = lambda tree: jax.tree_util.tree_map(lambda a: np.asarray(a.addressable_data(0)), tree)  # noqa: E731
        losses, acc, acc_first, acc_last = local((losses, acc, acc_first, acc_last))
        m = np.float32(self.schedule.num_microbatches)
        grads = self.unstack(acc, acc_first, acc_last)
        grads = jax.tree_util.tree_map(lambda g: np.asarray(g) / m, grads)
        return SpmdResult(float(np.mean(losses.astype(np.float64))), tuple(float(v) for v in losses), grads)


def run_spmd(schedule: Schedule, model: StagedModel, x: Any, labels: Any, params: Params | None = None,
             devices: Sequence[Any] | None = None) -> SpmdResult:
    """One step of ``schedule`` on ``model`` with the compiled SPMD executor (see
    :class:`SpmdExecutor`); ``params`` default to the model's own."""
    return SpmdExecutor(model, schedule, devices).run(model.params if params is None else params, x, labels)
