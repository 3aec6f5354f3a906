"""The lowered program: a schedule as one instruction list per rank, its transfers written out (pure Python).

A :class:`~zbpp_lite.schedules.ir.Schedule` says what each rank computes; which values cross ranks is
implied by the dependencies (:func:`~zbpp_lite.schedules.ir.deps`). :func:`lower` writes them out, as
PyTorch's pipelining does (``_add_send_recv``, with ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``) and
sail-sg's zero-bubble passes (``add_send_recv_peer_stage``): each rank's list holds its compute entries
(:class:`~zbpp_lite.schedules.ir.Action`, :class:`~zbpp_lite.schedules.ir.Overlap`) and

- :class:`Send`: F's activation or B's input gradient of one stage and microbatch, to the rank holding the
  stage that takes it (:func:`consumer_stage`: the next stage for F, the previous for B; paper arXiv
  2401.10241 section 2, figure 1), placed right after the compute that made it;
- :class:`Recv`: the same value, from the rank that made it, placed right before the first compute that
  needs it (a pair's receives before the pair; several in the order of
  :func:`~zbpp_lite.schedules.ir.deps`).

A send never waits; a receive waits until its send has run. In time a receive is posted, as PyTorch's
``irecv``: only the compute needing the value waits for it to arrive, so a receive placed earlier (as
PyTorch's lowering places them) times the same. With those places the program deadlocks exactly when
the schedule does (:func:`zbpp_lite.validate` checks a program, :func:`zbpp_lite.simulate`
times one, T_comm from each send to its receive).

Where a run steps the optimizer in the rank loop, :func:`lower` with ``optimizer=`` writes its
instructions too (:class:`Optimize` and sends and receives of an :class:`OptimizerMessage`, placed by
:func:`optimizer_instructions`): each rank's gradient norm (``NORM``), the norms exchanged, its stages
stepped (``STEP``) and, with post-validation (arXiv 2401.10241 section 4), the previous step checked
against the full reduction (``VALIDATE``) and undone and redone if wrong (``ROLLBACK``). With
``ties=`` (a model's tied weights) the gradient copies' sums come before them (``TIE``, each copy's rank's
share sent to the others', ``TIE_TOTAL``: :func:`tie_instructions`).

Text form (PyTorch's): a send names the producing stage, ``"0SEND_F3"`` (stage 0's activation of
microbatch 3); a receive the consuming stage, ``"1RECV_F3"`` (stage 1 receives it). PyTorch's
bookkeeping cells (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``) read as nothing. The optimizer's have no
PyTorch form: ``"STEP"``, ``"SEND_PARTIAL0>1"`` (rank 0's partial norm to rank 1), ``"RECV_FULL1<"``
(the full norm rank 1 sent in the previous step).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence, Union

from .ir import (KINDS, Action, Key, Overlap, Schedule, _key, _parse_cell, csv_rows, deps, produces,
    read_csv_file, write_csv)

TRANSFER_KINDS = ("F", "B")
"""Keys that cross ranks: F's activation and B's input gradient (W's weight gradient stays)."""

_COMM = re.compile(r"^\s*(\d+)\s*(SEND|RECV)_(F|B)\s*(\d+)\s*$")


def consumer_stage(kind: str, stage: int) -> int:
    """The stage taking what ``stage`` made: F's activation goes to stage + 1, B's input gradient to
    stage - 1 (arXiv 2401.10241 section 2). The one place this rule is written; a stage outside
    0 .. S-1 means the value goes nowhere (the last stage's F, the first stage's B)."""
    return stage + 1 if kind == "F" else stage - 1


def producer_stage(kind: str, stage: int) -> int:
    """The stage that made what ``stage`` takes: :func:`consumer_stage` read backwards (the previous stage's
    F activation, the next stage's B input gradient); -1 or S: the batch or the loss's seed, made by none."""
    return stage - 1 if kind == "F" else stage + 1


def destination(key: Key, placement: Sequence[int]) -> int | None:
    """The rank ``key``'s value must go to, or None when its consumer is on the producing rank or
    there is none (a W, the last stage's F, the first stage's B)."""
    if key[0] not in TRANSFER_KINDS:
        return None
    stage = consumer_stage(key[0], key[1])
    if not 0 <= stage < len(placement) or placement[stage] == placement[key[1]]:
        return None
    return placement[stage]


class OptimizerMessage(NamedTuple):
    """A host value the optimizer's instructions send (``tag``: "NORM" a rank's squared norm and NaN flag,
    "PARTIAL" the sum over ranks 0 .. ``sender``, "FULL" the sum over all, ``TIE<t>`` the sum of tie t's
    gradient copies on the sender's rank: :func:`tie_message`) from rank ``sender``. ``str()``: the tag,
    then the sender, after a dot where the tag ends in a digit (``NORM1``; ``TIE1.10`` and ``TIE11.0``,
    tie 1 from rank 10 and tie 11 from rank 0, would both read ``TIE110`` glued)."""

    tag: str
    sender: int

    def __str__(self) -> str:
        return f"{self.tag}{'.' if self.tag[-1:].isdigit() else ''}{self.sender}"


def tie_message(tie: int, sender: int) -> "OptimizerMessage":
    """The message carrying rank ``sender``'s sum of tie ``tie``'s gradient copies (tag ``TIE<t>``)."""
    return OptimizerMessage(f"TIE{tie}", sender)


OPTIMIZER_OPS = ("TIE", "TIE_TOTAL", "NORM", "STEP", "VALIDATE", "ROLLBACK")
"""What :class:`Optimize` does, in a step's order (module docstring); ``TIE`` and ``TIE_TOTAL`` sum tied
weights' gradient copies (:func:`tie_instructions`), the others step the optimizer
(:func:`optimizer_instructions`)."""

TIE_OPS = ("TIE", "TIE_TOTAL")
"""The :data:`OPTIMIZER_OPS` that sum tied weights' gradients, written with or without an optimizer."""

POLICIES = ("plain", "synchronous", "post-validation")
"""How the optimizer's step is guarded (:func:`optimizer_instructions`)."""


@dataclass(frozen=True, slots=True)
class Optimize:
    """An optimizer instruction of its rank (:data:`OPTIMIZER_OPS`): ``TIE`` the sum of each tie's copies
    on the rank (its ``TIE<t>`` messages), ``TIE_TOTAL`` every rank's sums added in rank order and written
    into each copy (:func:`tie_instructions`); ``NORM`` the squared norm and NaN
    flag of its stages' gradients (added to the partial reduction received, with post-validation);
    ``STEP`` AdamW on its stages (post-validation: speculatively, unclipped; synchronous: clipped by the
    global norm, skipped on NaN); ``VALIDATE`` the previous step's speculative step checked against the
    full reduction; ``ROLLBACK`` undone and redone clipped if that check failed, and the rank's share of
    this step so far redone if any rank's did (arXiv 2401.10241 section 4). On a timeline its
    ``kind`` is ``op`` and its ``stage`` -1 (no stage: no memory)."""

    op: str

    def __post_init__(self) -> None:
        if self.op not in OPTIMIZER_OPS:
            raise ValueError(f"unknown optimizer instruction {self.op!r}; expected one of {OPTIMIZER_OPS}")

    @property
    def kind(self) -> str:
        return self.op

    @property
    def stage(self) -> int:
        return -1

    def __str__(self) -> str:
        return self.op

    @property
    def text(self) -> str:
        return self.op


@dataclass(frozen=True, slots=True)
class Send:
    """PyTorch's ``SEND_F`` / ``SEND_B``: the rank sends ``key``'s value (kind "F" activation or "B" input
    gradient, of the producing stage and microbatch; or an :class:`OptimizerMessage`) to rank ``peer``;
    never waits."""

    key: Key | OptimizerMessage
    peer: int

    def __str__(self) -> str:
        if type(self.key) is OptimizerMessage:
            return f"SEND_{self.key}>{self.peer}"
        return f"{self.key[1]}SEND_{self.key[0]}{self.key[2]}"

    @property
    def text(self) -> str:
        """Our text form, which is PyTorch's here (``SEND_B``'s B is our B's input gradient)."""
        return str(self)


@dataclass(frozen=True, slots=True)
class Recv:
    """PyTorch's ``RECV_F`` / ``RECV_B``: the rank receives ``key``'s value (the sender's key) from rank
    ``peer``; waits until that send has run. ``str()`` names the consuming stage, as PyTorch does.
    ``earlier``: 1 for a value sent in the previous step (post-validation's full norm; none before the
    first step), else 0."""

    key: Key | OptimizerMessage
    peer: int
    earlier: int = 0

    def __str__(self) -> str:
        if type(self.key) is OptimizerMessage:
            return f"RECV_{self.key}{'<' * self.earlier}"
        kind, stage, microbatch = self.key
        return f"{consumer_stage(kind, stage)}RECV_{kind}{microbatch}"

    @property
    def text(self) -> str:
        """Our text form, which is PyTorch's here (``RECV_B``'s B is our B's input gradient)."""
        return str(self)


Instruction = Union[Action, Overlap, Send, Recv, Optimize]
"""One step of a rank's program: a compute entry, a :class:`Send`, a :class:`Recv` or an
:class:`Optimize`."""

COMMS = (Send, Recv)
"""The transfer instructions' types (``isinstance(x, COMMS)``)."""


@dataclass(frozen=True)
class Program:
    """One instruction list per rank (compute, :class:`Send`, :class:`Recv`), with the schedule's
    placement. Made by :func:`lower` or read from PyTorch's compute+comms CSV (:meth:`from_csv_text`);
    checked by :func:`zbpp_lite.validate`, timed by :func:`zbpp_lite.simulate`.

    Attributes:
        instructions: ``instructions[rank]``, the rank's instructions in order.
        placement: ``placement[stage]``, the rank holding that stage.
        num_microbatches: m.
        name: the schedule's name, or "".
    """

    instructions: tuple[tuple[Instruction, ...], ...]
    placement: tuple[int, ...]
    num_microbatches: int
    name: str = ""

    @property
    def num_ranks(self) -> int:
        """p, the number of ranks."""
        return len(self.instructions)

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.placement)

    def schedule(self) -> Schedule:
        """The compute entries alone, as a :class:`~zbpp_lite.schedules.ir.Schedule`."""
        rows = tuple(tuple(x for x in row if isinstance(x, (Action, Overlap))) for row in self.instructions)
        return Schedule(rows, self.placement, self.num_microbatches, self.name)

    def to_rows(self) -> list[list[str]]:
        """Per-rank instruction strings in PyTorch's notation (``"0F3"``, ``"0SEND_F3"``, ``"1RECV_F3"``)."""
        return [[str(x) for x in row] for row in self.instructions]

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """PyTorch's compute+comms CSV text (one row per rank, no header), also written to ``path``."""
        return write_csv(self.to_rows(), path)

    @classmethod
    def from_rows(cls, rows: Sequence[Iterable[str | Instruction | None]],
            num_microbatches: int | None = None, name: str = "") -> "Program":
        """A program from per-rank cells: compute cells as :meth:`Schedule.from_rows` reads them, and
        ``{stage}SEND_F{j}`` (``F`` or ``B``; the producing stage) and ``{stage}RECV_F{j}`` (the consuming
        stage), their peers read off the placement the compute cells imply. Raises ValueError: as
        :meth:`Schedule.from_rows`, or a transfer naming a stage no rank holds."""
        cells: list[list] = []
        for rank, row in enumerate(rows):
            out: list = []
            for cell in row:
                try:
                    out += _cell(cell)
                except ValueError as e:
                    raise ValueError(f"rank {rank}: {e}") from None
            cells.append(out)
        compute = [[x for x in row if isinstance(x, (Action, Overlap))] for row in cells]
        schedule = Schedule.from_rows(compute, num_microbatches, name)
        program = [[_transfer(x, rank, schedule.placement) if isinstance(x, tuple) else x for x in row]
            for rank, row in enumerate(cells)]
        return cls(tuple(map(tuple, program)), schedule.placement, schedule.num_microbatches, name)

    @classmethod
    def from_csv_text(cls, text: str, num_microbatches: int | None = None) -> "Program":
        """Parse PyTorch's compute+comms CSV text (``tests/artifacts/torch_DualPipeV_comms.csv``); lines
        and errors as :meth:`Schedule.from_csv_text`."""
        if not isinstance(text, str):
            raise TypeError(f"Program.from_csv_text takes CSV text (str), got {type(text).__name__}")
        return cls.from_rows(csv_rows(text, _cell), num_microbatches)

    @classmethod
    def from_csv(cls, path: str | os.PathLike, num_microbatches: int | None = None) -> "Program":
        """Read PyTorch's compute+comms CSV from the UTF-8 file at ``path``; errors as
        :meth:`Schedule.from_csv`."""
        return read_csv_file(path, "Program.from_csv", lambda text: cls.from_csv_text(text, num_microbatches))


def _cell(cell) -> list:
    """One cell -> [a compute entry], [a Send or Recv], [(stage, "SEND"|"RECV", kind, microbatch)] read
    from text (peers need the placement), or [] (idle, bookkeeping)."""
    if isinstance(cell, (*COMMS, Optimize, tuple)):
        return [cell]
    match = _COMM.match(cell) if isinstance(cell, str) else None
    return [match.groups()] if match else _parse_cell(cell)


def _transfer(cell: tuple, rank: int, placement: tuple[int, ...]) -> Send | Recv:
    """``(stage, "SEND"|"RECV", kind, microbatch)`` read from text -> the record, peers from ``placement``."""
    stage, op, kind, microbatch = int(cell[0]), cell[1], cell[2], int(cell[3])
    producer = stage if op == "SEND" else producer_stage(kind, stage)
    consumer = consumer_stage(kind, producer)
    if not (0 <= producer < len(placement) and 0 <= consumer < len(placement)):
        raise ValueError(f"rank {rank}: {stage}{op}_{kind}{microbatch} moves a value between stages "
            f"{producer} and {consumer}, but the stages are 0 .. {len(placement) - 1}")
    key = Key(kind, producer, microbatch)
    return Send(key, placement[consumer]) if op == "SEND" else Recv(key, placement[producer])


class Route(NamedTuple):
    """What an action of one (kind, stage) needs, makes, receives and sends, on any microbatch j (all its
    keys share its microbatch; :func:`routes`).

    needs: (kind, stage, made on this rank?) of each key it needs (``deps``' order);
    makes: (kind, stage) of each key it makes (``produces``' order);
    receives: (kind, stage, sending rank) of each key it needs from another rank;
    sends: (kind, stage, receiving rank) of each key another rank needs."""

    needs: tuple[tuple[str, int, bool], ...]
    makes: tuple[tuple[str, int], ...]
    receives: tuple[tuple[str, int, int], ...]
    sends: tuple[tuple[str, int, int], ...]


def routes(placement: Sequence[int]) -> dict[tuple[str, int], Route]:
    """:class:`Route` of every (kind, stage) under ``placement``, read once from
    :func:`~zbpp_lite.schedules.ir.deps`, :func:`~zbpp_lite.schedules.ir.produces` and
    :func:`destination`, so that lowering and timing look them up instead of recomputing them per action."""
    S = len(placement)
    table = {}
    for kind in KINDS:
        for stage in range(S):
            a, here = Action(kind, stage, 0), placement[stage]
            needs, makes = deps(a, S), produces(a)
            table[kind, stage] = Route(
                tuple((k[0], k[1], placement[k[1]] == here) for k in needs),
                tuple((k[0], k[1]) for k in makes),
                tuple((k[0], k[1], placement[k[1]]) for k in needs if placement[k[1]] != here),
                tuple((k[0], k[1], to) for k in makes if (to := destination(k, placement)) is not None))
    return table


def lower(schedule: Schedule, optimizer: str | None = None, speculative: bool = True,
          ties: Sequence[Sequence[int]] = ()) -> Program:
    """The schedule's program: each rank's entries in order, a :class:`Recv` right before the entry for
    each value it needs from another rank and a :class:`Send` right after it for each value another rank
    needs (module docstring); with ``ties`` (per tied parameter, the ranks holding its copies) their
    gradient sums (:func:`tie_instructions`), and with ``optimizer`` (one of :data:`POLICIES`) the
    optimizer's instructions after them (:func:`optimizer_instructions`). Assumes every action's stage
    exists (:func:`zbpp_lite.validate` first for a schedule of unknown origin); raises KeyError otherwise,
    ValueError for an unknown policy."""
    table = routes(schedule.placement)
    rows = []
    for row in schedule.actions:
        out: list[Instruction] = []
        for entry in row:
            found = [(a.microbatch, table[a.kind, a.stage]) for a in entry.parts] if type(entry) is Overlap \
                else ((entry.microbatch, table[entry.kind, entry.stage]),)
            for j, route in found:
                for kind, stage, src in route.receives:
                    out.append(Recv(_key((kind, stage, j)), src))
            out.append(entry)
            for j, route in found:
                for kind, stage, to in route.sends:
                    out.append(Send(_key((kind, stage, j)), to))
        rows.append(tuple(out))
    program = Program(tuple(rows), schedule.placement, schedule.num_microbatches, schedule.name)
    program = tie_instructions(program, ties) if ties else program
    return program if optimizer is None else optimizer_instructions(program, optimizer, speculative)


def tie_instructions(program: Program, ties: Sequence[Sequence[int]]) -> Program:
    """``program`` with tied weights' gradient sums written out after each rank's last instruction, as
    Megatron-LM all-reduces a shared embedding's gradient once the backward is done: on every rank
    holding a copy of some tie, ``TIE`` (per tie, the sum of its copies there), a :func:`tie_message`
    sent to each other rank holding that tie and theirs received, then ``TIE_TOTAL`` (the sums added in
    rank order, the same on every rank, into each copy). ``ties``: per tie, the ranks holding its copies
    (``StagedModel.tied_leaves`` under the placement). Sends come before receives on every rank, so
    they cannot deadlock. Raises ValueError: a rank outside 0 .. p-1."""
    p = program.num_ranks
    ties = [tuple(sorted(set(ranks))) for ranks in ties]
    if any(not 0 <= r < p for ranks in ties for r in ranks):
        raise ValueError(f"ties name ranks {ties}; the program has ranks 0 .. {p - 1}")
    rows = []
    for r, row in enumerate(program.instructions):
        held = [(t, ranks) for t, ranks in enumerate(ties) if r in ranks]
        if not held:
            rows.append(row)
            continue
        sends = [Send(tie_message(t, r), q) for t, ranks in held for q in ranks if q != r]
        recvs = [Recv(tie_message(t, q), q) for t, ranks in held for q in ranks if q != r]
        rows.append((*row, Optimize("TIE"), *sends, *recvs, Optimize("TIE_TOTAL")))
    return Program(tuple(rows), program.placement, program.num_microbatches, program.name)


def optimizer_instructions(program: Program, policy: str, speculative: bool = True) -> Program:
    """``program`` with the optimizer step of ``policy`` written out (arXiv 2401.10241 section 4), after
    each rank's last instruction unless said otherwise:

    - ``"plain"``: ``STEP``;
    - ``"synchronous"``: ``NORM``, a ``NORM`` message to every other rank, theirs received, ``STEP``
      (clipped by the global norm; every rank waits for the slowest);
    - ``"post-validation"``: the partial reduction received from rank r-1 (not on rank 0), ``NORM``
      added to it, sent on to rank r+1 (the last rank sends the ``FULL`` reduction to every other
      rank), ``STEP`` at once; and, for the previous step, ``FULL`` received (``earlier=1``),
      ``VALIDATE`` and ``ROLLBACK``: first on the last rank (its own reduction) and with
      ``speculative=False``, else before the rank's first backward and its receives, the F's before
      it running speculatively on the unvalidated parameters (earlier where a receive there would wait
      for a send after its sender's check: :func:`_speculation_ends`).

    Raises:
        ValueError: an unknown policy, or a program that already has optimizer instructions.
    """
    if policy not in POLICIES:
        raise ValueError(f"optimizer must be one of {', '.join(POLICIES)}; got {policy!r}")
    if any(type(x) is Optimize and x.op not in TIE_OPS for row in program.instructions for x in row):
        raise ValueError("the program already has optimizer instructions")
    p, last = program.num_ranks, program.num_ranks - 1
    heads = _speculation_ends(program.instructions) if policy == "post-validation" and speculative \
        else [0] * p
    rows = []
    for r, (row, at) in enumerate(zip(program.instructions, heads)):
        others = [q for q in range(p) if q != r]
        if policy == "plain":
            rows.append((*row, Optimize("STEP")))
        elif policy == "synchronous":
            rows.append((*row, Optimize("NORM"), *(Send(OptimizerMessage("NORM", r), q) for q in others),
                         *(Recv(OptimizerMessage("NORM", q), q) for q in others), Optimize("STEP")))
        else:
            head = [Recv(OptimizerMessage("FULL", last), last, earlier=1)] if r < last else []
            tail = [Recv(OptimizerMessage("PARTIAL", r - 1), r - 1)] if r else []
            tail.append(Optimize("NORM"))
            tail += [Send(OptimizerMessage("PARTIAL", r), r + 1)] if r < last else \
                [Send(OptimizerMessage("FULL", r), q) for q in others]
            rows.append((*row[:at], *head, Optimize("VALIDATE"), Optimize("ROLLBACK"), *row[at:], *tail,
                         Optimize("STEP")))
    return Program(tuple(rows), program.placement, program.num_microbatches, program.name)


def _group_start(row: Sequence[Instruction], i: int) -> int:
    """``i`` moved back over the receives right before it (an entry's, placed before it)."""
    while i and type(row[i - 1]) is Recv:
        i -= 1
    return i


def _speculation_ends(rows: Sequence[Sequence[Instruction]]) -> list[int]:
    """Per rank, where post-validation's check goes in its compute and transfers: before its first entry
    with a backward part, the last rank (the full norm's) at 0, and before any receive whose send comes
    after its sender's check, moved earlier until none does (a rollback redoes every rank's work since
    its check, and a send after the check is made only by the redo: a rank waiting for it before its own
    check would wait for ever)."""
    ends = []
    for row in rows[:-1]:
        firsts = [i for i, x in enumerate(row) if isinstance(x, (Action, Overlap)) and any(
            a.kind != "F" for a in (x.parts if type(x) is Overlap else (x,)))]
        ends.append(_group_start(row, firsts[0]) if firsts else len(row))
    ends.append(0)
    sent = {x.key: (r, i) for r, row in enumerate(rows) for i, x in enumerate(row) if type(x) is Send}
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(rows):
            late = [i for i, x in enumerate(row[:ends[r]]) if type(x) is Recv
                    and sent[x.key][1] >= ends[sent[x.key][0]]]
            if late:
                ends[r], moved = _group_start(row, late[0]), True
    return ends


def validation_slice(row: Sequence[Instruction]) -> slice:
    """Where post-validation's check of the previous step sits in a rank's ``row``: its full norm
    received, ``VALIDATE``, ``ROLLBACK`` (an empty slice at 0 if none)."""
    if Optimize("VALIDATE") not in row:
        return slice(0, 0)
    at = row.index(Optimize("VALIDATE"))
    return slice(at - 1 if at and type(row[at - 1]) is Recv and row[at - 1].earlier else at, at + 2)
