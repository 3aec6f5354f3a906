"""The schedule IR: actions, per-rank action lists, placement, PyTorch's text/CSV form (pure Python, no JAX).

Terms (arXiv 2401.10241 section 2): F is one stage's forward on one microbatch, B the backward for the input
gradient only, W the backward for the weight gradient only, BW the fused full backward (GPipe, 1F1B).
Two text forms. ``str()`` / ``from_str`` give PyTorch's (``torch.distributed.pipelining``,
``{stage}{code}{microbatch}`` with codes F, I (our B), W and B (our BW): ``"2F0"``, ``"1I3"``, ``"1W3"``,
``"0B1"``), which CSV files and PyTorch read. ``.text`` / ``from_text`` give ours, the kind itself:
``"2F0"``, ``"1B3"``, ``"1W3"``, ``"0BW1"``; grids, validator messages and the course print ours. An
:class:`Overlap` is DualPipe's F&B pair (arXiv 2412.19437 section 3.2.1), PyTorch's
``"(0F7;7B3)OVERLAP_F_B"``, ours ``"0F7&7BW3"``.
"""

from __future__ import annotations

import csv
import functools
import itertools
import io
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence, Union

KINDS = ("F", "B", "W", "BW")
"""Action kinds: forward, backward-input, backward-weight, fused backward."""

# Our kind -> PyTorch pipelining's letter, and back. One table, used by both directions.
TORCH_CODE = {"F": "F", "B": "I", "W": "W", "BW": "B"}
KIND_OF_CODE = {code: kind for kind, code in TORCH_CODE.items()}
KIND_CODE = {"F": 1, "B": 2, "W": 3, "BW": 4}
"""Action kind -> its code in SPMD tick tables, the index of the tick's ``lax.switch`` branch (0: idle)."""

_ACTION_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]+)\s*(\d+)\s*$")
_CODES_OF_FORM = {"PyTorch's": KIND_OF_CODE, "our": {k: k for k in KINDS}}
# PyTorch's lowered (compute_comms) form also holds transfers and bookkeeping, read as nothing.
_TORCH_NON_COMPUTE = re.compile(r"^\s*\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*\s*$")
_TORCH_OVERLAP = re.compile(r"^\s*\((.*)\)\s*OVERLAP_F_B\s*$")


_new = object.__new__


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: ``kind`` ("F", "B" input gradient, "W" weight gradient, "BW" fused
    backward) of global ``stage`` on ``microbatch`` (0-based); ``str()`` / :meth:`from_str` give and parse
    PyTorch's text form. Raises ValueError on an unknown kind or a negative index."""

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and microbatch must be >= 0, got {self.stage}, {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.stage}{TORCH_CODE[self.kind]}{self.microbatch}"

    @property
    def label(self) -> str:
        """Short human label, e.g. ``F3`` or ``BW0`` (kind and microbatch)."""
        return f"{self.kind}{self.microbatch}"

    @property
    def text(self) -> str:
        """Our text form, the kind between stage and microbatch: ``"1B3"`` (B), ``"0BW1"`` (BW)."""
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def unchecked(cls, kind: str, stage: int, microbatch: int) -> "Action":
        """The Action made without ``__init__``'s checks, for a planner's own known-good actions (the greedy
        scheduler makes 786,432 at p = 256, m = 512; this way in 0.4 of the time)."""
        action = _new(cls)
        fields = action.__dict__
        fields["kind"], fields["stage"], fields["microbatch"] = kind, stage, microbatch
        return action

    @classmethod
    def from_str(cls, text: str) -> "Action":
        """Parse PyTorch's text form (``"2F0"``, ``"1I3"``, ``"1W3"``, ``"0B1"``); ValueError otherwise."""
        return cls._parse(text, "PyTorch's")

    @classmethod
    def from_text(cls, text: str) -> "Action":
        """Parse our text form (``"2F0"``, ``"1B3"``, ``"1W3"``, ``"0BW1"``); ValueError otherwise."""
        return cls._parse(text, "our")

    @classmethod
    def _parse(cls, text: str, form: str) -> "Action":
        codes = _CODES_OF_FORM[form]
        match = _ACTION_RE.match(text)
        if not match or match.group(2) not in codes:
            example = "'1I3' for B, '0B1' for BW" if form == "PyTorch's" else "'1B3' for B, '0BW1' for BW"
            raise ValueError(
                f"cannot parse action {text!r} in {form} text form: expected {{stage}}{{code}}{{microbatch}} "
                f"with code one of {sorted(codes)}, e.g. '2F0', {example}"
            )
        return cls(codes[match.group(2)], int(match.group(1)), int(match.group(3)))


@dataclass(frozen=True)
class Overlap:
    """DualPipe's overlapped pair F&B, run as one unit on one rank so one part's compute hides the other's
    communication (arXiv 2412.19437 section 3.2.1). Starts once both inputs are there; lasts T_F&B
    (:attr:`zbpp_lite.Costs.fb`). ``str()`` / :meth:`from_str`: ``"(0F7;7B3)OVERLAP_F_B"``.

    ``forward`` is an F, ``backward`` a B or BW of another stage or microbatch; ValueError otherwise, or when
    the backward needs the pair's own forward.
    """

    forward: Action
    backward: Action

    kind = "F&B"
    """The pair's kind, as costs and figures name it (T_F&B)."""

    def __post_init__(self) -> None:
        f, b = self.forward, self.backward
        pair_kinds = isinstance(f, Action) and isinstance(b, Action) and f.kind == "F"
        if not pair_kinds or b.kind not in ("B", "BW"):
            raise ValueError(f"an overlapped pair is (F; B or BW), got ({f}; {b})")
        if (f.stage, f.microbatch) == (b.stage, b.microbatch):
            raise ValueError(
                f"the pair ({f}; {b}) overlaps a backward with its own forward, which it needs first")

    @property
    def parts(self) -> tuple[Action, Action]:
        """(forward, backward), the order the executor runs them back to back."""
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})OVERLAP_F_B"

    @property
    def text(self) -> str:
        """Our text form: ``"0F7&7BW3"``."""
        return f"{self.forward.text}&{self.backward.text}"

    @property
    def label(self) -> str:
        """Short human label, e.g. ``F7&BW3``."""
        return f"{self.forward.label}&{self.backward.label}"

    @classmethod
    def from_str(cls, text: str) -> "Overlap":
        """Parse ``"(0F7;7B3)OVERLAP_F_B"``; ValueError for other text or parts that are not (F; I or B)."""
        match = _TORCH_OVERLAP.match(text)
        parts = match.group(1).split(";") if match else []
        if len(parts) != 2:
            raise ValueError(f"cannot parse overlapped pair {text!r}: expected "
                "'(<F action>;<backward>)OVERLAP_F_B', e.g. '(0F7;7B3)OVERLAP_F_B'")
        return cls(Action.from_str(parts[0]), Action.from_str(parts[1]))


Entry = Union[Action, Overlap]
"""One entry of a rank's list: an :class:`Action`, or an :class:`Overlap` pair of two."""


def parts(entry: Entry) -> tuple[Action, ...]:
    """The actions an entry runs: (action,) for an Action, (forward, backward) for an Overlap."""
    return entry.parts if isinstance(entry, Overlap) else (entry,)


# ---------------------------------------------------------------------------- placement


def looped_placement(num_ranks: int, num_stages: int) -> tuple[int, ...]:
    """Looped placement: stage s on rank s % p (interleaved 1F1B, Narayanan et al. 2021)."""
    return tuple(s % num_ranks for s in range(num_stages))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """V placement of 2p stages: stage s on rank s if s < p else 2p-1-s (arXiv 2405.15362, sec. 3)."""
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks))


# ---------------------------------------------------------------------------- dependencies

class Key(NamedTuple):
    """What an action produces or needs: kind "F" (activation), "B" (input gradient) or "W" (weight
    gradient) of ``stage`` on ``microbatch``; equal to the tuple ``(kind, stage, microbatch)``."""

    kind: str
    stage: int
    microbatch: int


_key = functools.partial(tuple.__new__, Key)
"""``_key((kind, stage, microbatch))`` is ``Key(kind, stage, microbatch)`` made without the Python-level
``__new__`` of a NamedTuple (one or two per action: planning at large p makes millions)."""


def produces(action: Entry) -> tuple[Key, ...]:
    """Keys an action completes: F -> F, B -> B, W -> W, BW -> B and W; a pair, both parts'."""
    if isinstance(action, Overlap):
        return produces(action.forward) + produces(action.backward)
    if action.kind == "BW":
        return (_key(("B", action.stage, action.microbatch)), _key(("W", action.stage, action.microbatch)))
    return (_key((action.kind, action.stage, action.microbatch)),)


def deps(action: Entry, num_stages: int) -> tuple[Key, ...]:
    """Keys an action needs before it may start (paper section 2, figure 1); shared by the validator,
    simulator, executor and figures.

    F(s, j) needs F(s-1, j); B and BW(s, j) need F(s, j) and B(s+1, j) (the last stage only its own F);
    W(s, j) needs B(s, j). A pair needs what both its parts need.
    """
    if isinstance(action, Overlap):
        return deps(action.forward, num_stages) + deps(action.backward, num_stages)
    s, j = action.stage, action.microbatch
    if action.kind == "F":
        return (_key(("F", s - 1, j)),) if s > 0 else ()
    if action.kind == "W":
        return (_key(("B", s, j)),)
    if s < num_stages - 1:
        return (_key(("F", s, j)), _key(("B", s + 1, j)))
    return (_key(("F", s, j)),)


# ---------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Schedule:
    """One ordered action list per rank, plus the placement stage -> rank (dependencies are checked by
    :func:`zbpp_lite.validate`, not here).

    Attributes:
        actions: ``actions[rank]``, the rank's :class:`Action` and :class:`Overlap` entries
            (:meth:`rank_actions`: the actions alone).
        placement: ``placement[stage]`` is the rank holding that stage; ValueError if outside the ranks.
        num_microbatches: m, microbatches per training step.
        name: the builder's registry name, or "" for hand-written / loaded schedules.
        memory_plan: a memory-limited planner's M_B, M_W and promised peak, a
            :class:`~zbpp_lite.schedules.memory.MemoryPlan` (a module above this one), or None; not
            compared, not in the CSV.
    """

    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]
    num_microbatches: int
    name: str = ""
    memory_plan: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        object.__setattr__(self, "placement", tuple(int(r) for r in self.placement))
        bad = [r for r in self.placement if not 0 <= r < len(self.actions)]
        if bad:
            raise ValueError(
                f"placement names rank(s) {sorted(set(bad))} but the schedule has "
                f"{len(self.actions)} rank(s) (0 .. {len(self.actions) - 1})"
            )

    @property
    def num_ranks(self) -> int:
        """p, the number of pipeline ranks (devices)."""
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        """Number of stages (model chunks), p * stages per rank."""
        return len(self.placement)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages held by ``rank``, in increasing order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def __iter__(self) -> Iterator[tuple[int, Action]]:
        """Yield (rank, action) for every action, rank by rank (a pair as its two parts)."""
        for rank, row in enumerate(self.actions):
            for entry in row:
                for action in parts(entry):
                    yield rank, action

    def __len__(self) -> int:
        """Number of actions (a pair counts as its two)."""
        return sum(len(parts(e)) for row in self.actions for e in row)

    def rank_actions(self, rank: int) -> tuple[Action, ...]:
        """``rank``'s actions in order, each pair as its forward then its backward."""
        row = self.actions[rank]
        if Overlap not in map(type, row):  # no pair: the row itself (p = 256, m = 512: 3,072 actions a rank)
            return row
        return tuple(a for e in row for a in parts(e))

    @property
    def has_pairs(self) -> bool:
        """True when some rank's list holds an overlapped pair (:class:`Overlap`)."""
        return any(Overlap in map(type, row) for row in self.actions)

    def split_pairs(self) -> "Schedule":
        """The same schedule with every pair written as its two consecutive actions."""
        return Schedule(tuple(self.rank_actions(r) for r in range(self.num_ranks)), self.placement,
            self.num_microbatches, self.name, self.memory_plan)

    # ------------------------------------------------------------------ text / CSV form

    def to_rows(self) -> list[list[str]]:
        """Per-rank lists of action strings in PyTorch notation."""
        return [[str(a) for a in row] for row in self.actions]

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """PyTorch's compute-only CSV text (one row per rank, no header), also written to ``path``."""
        return write_csv(self.to_rows(), path)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Iterable[str | Action | Overlap | None]],
        num_microbatches: int | None = None,
        name: str = "",
    ) -> "Schedule":
        """Build a schedule from per-rank action strings; placement inferred from the rows.

        Skips empty cells, ``None`` (idle steps) and PyTorch's lowered transfer/bookkeeping entries
        (``SEND_F``, ``UNSHARD``, ...; :meth:`zbpp_lite.Program.from_rows` keeps the transfers);
        ``(0F7;7B3)OVERLAP_F_B`` becomes an :class:`Overlap`.
        ``num_microbatches`` defaults to one more than the largest microbatch index. Raises
        ValueError: an unparsable action, an index beyond :func:`check_index_range`, a stage on two
        ranks, or a stage no rank holds."""
        actions: list[list[Entry]] = []
        for rank, row in enumerate(rows):
            parsed = []
            for cell in row:
                try:
                    parsed += _parse_cell(cell)
                except ValueError as e:
                    raise ValueError(f"rank {rank}: {e}") from None
            actions.append(parsed)
        check_index_range(actions, num_microbatches)
        placement = infer_placement(actions)
        if num_microbatches is None:
            num_microbatches = 1 + max((a.microbatch for row in actions for e in row for a in parts(e)),
                default=-1)
        return cls(tuple(map(tuple, actions)), placement, num_microbatches, name)

    @classmethod
    def from_csv(cls, path: str | os.PathLike, num_microbatches: int | None = None) -> "Schedule":
        """Read PyTorch's compute-only CSV from the UTF-8 file at ``path`` (a file name, never CSV text:
        see :meth:`from_csv_text`).

        Raises:
            FileNotFoundError: no file at ``path``.
            IsADirectoryError: ``path`` is a directory.
            ValueError: a file that is not UTF-8 text, or a bad row.
            TypeError: ``path`` that is not a ``str`` or ``os.PathLike``.
        """
        return read_csv_file(path, "Schedule.from_csv",
            lambda text: cls.from_csv_text(text, num_microbatches))

    @classmethod
    def from_csv_text(cls, text: str, num_microbatches: int | None = None) -> "Schedule":
        """Parse PyTorch's compute-only CSV text: one row per rank, no header, cells as in :meth:`from_rows`.

        Any line ending is accepted; blank lines are skipped, so the i-th non-blank line is rank i.

        Raises:
            TypeError: ``text`` that is not a ``str`` (for a path use :meth:`from_csv`).
            ValueError: naming the CSV line and rank of an unparsable cell, a malformed line, or a stage on
                two ranks.
        """
        if not isinstance(text, str):
            raise TypeError(f"Schedule.from_csv_text takes CSV text (str), got {type(text).__name__}; for a "
                "file use Schedule.from_csv")
        return cls.from_rows(csv_rows(text), num_microbatches)


def write_csv(rows: Sequence[Sequence[str]], path: str | os.PathLike | None = None) -> str:
    """CSV text of per-rank rows of cells (PyTorch's form: one row per rank, no header), also written to
    ``path``."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in rows:
        writer.writerow(row)
    text = buf.getvalue()
    if path is not None:
        with open(path, "w", newline="") as f:
            f.write(text)
    return text


def read_csv_file(path: str | os.PathLike, reader: str, parse: Callable[[str], Any]) -> Any:
    """``parse`` of the text of the UTF-8 CSV file at ``path``, for ``reader`` (named in errors).

    Raises:
        FileNotFoundError: no file at ``path``.
        IsADirectoryError: ``path`` is a directory.
        ValueError: a file that is not UTF-8 text, or ``parse``'s, the file named.
        TypeError: ``path`` that is not a ``str`` or ``os.PathLike``.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{reader} takes a file path (str or os.PathLike), got {type(path).__name__}")
    name = os.fspath(path)
    if os.path.isdir(name):
        raise IsADirectoryError(f"schedule CSV {name!r} is a directory; expected a CSV file")
    if not os.path.isfile(name):
        hint = "; to parse CSV text use Schedule.from_csv_text" if ("," in name or "\n" in name) else ""
        raise FileNotFoundError(f"schedule CSV {name!r}: no such file{hint}")
    try:
        with open(name, encoding="utf-8-sig", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"schedule CSV {name!r} is not UTF-8 text (byte {e.start}): expected PyTorch's "
            "CSV form") from None
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def csv_rows(text: str, parse_cell: Callable[[str], list] | None = None) -> list[list]:
    """Per rank (the i-th non-blank line is rank i, any line ending), the cells of PyTorch's CSV text,
    each read by ``parse_cell`` (default: compute cells, transfers and idle cells read as nothing).
    Raises ValueError naming the CSV line and rank of an unparsable cell or a malformed line."""
    parse_cell = parse_cell or _parse_cell
    lines = [(n, line) for n, line in enumerate(text.lstrip("\ufeff").splitlines(), start=1) if line.strip()]
    rows: list[list] = []
    for rank, (n, line) in enumerate(lines):
        try:
            cells = next(csv.reader([line], strict=True))
        except csv.Error as e:
            raise ValueError(f"CSV line {n} (rank {rank}): {e}") from None
        parsed: list = []
        for cell in cells:
            try:
                parsed += parse_cell(cell)
            except ValueError as e:
                raise ValueError(f"CSV line {n} (rank {rank}): {e}") from None
        rows.append(parsed)
    return rows


def _parse_cell(cell: str | Entry | None) -> list[Entry]:
    """One CSV cell -> the entry it holds (none for idle steps and transfers)."""
    if cell is None or isinstance(cell, (Action, Overlap)):
        return [] if cell is None else [cell]
    if not cell.strip() or _TORCH_NON_COMPUTE.match(cell):
        return []
    if _TORCH_OVERLAP.match(cell):
        return [Overlap.from_str(cell)]
    return [Action.from_str(cell)]


def check_index_range(actions: Sequence[Sequence[Entry]], num_microbatches: int | None = None) -> None:
    """Refuse stage/microbatch indices (and ``num_microbatches``) not below the rows' action count N.

    A complete schedule has an F of every stage on every microbatch, so larger indices are typos
    (``1000000F0``) that would make the placement or validator walk a million stages. Raises ValueError:
    naming the rank, the action and the largest index the rows allow."""
    count = sum(len(parts(e)) for row in actions for e in row)
    for rank, row in enumerate(actions):
        for a in (a for e in row for a in parts(e)):
            for what, index in (("stage", a.stage), ("microbatch", a.microbatch)):
                if index >= count:
                    raise ValueError(
                        f"rank {rank}, action {a}: {what} {index} is far beyond what the rows hold: "
                        f"they have {count} action(s), so a complete schedule numbers its stages and "
                        f"microbatches at most 0 .. {count - 1} (a typo?)"
                    )
    if num_microbatches is not None and num_microbatches > count:
        raise ValueError(
            f"num_microbatches {num_microbatches} is more than the {count} action(s) the rows hold; "
            f"a complete schedule has an F of every stage for every microbatch, so at most {count}"
        )


def infer_placement(actions: Sequence[Sequence[Entry]]) -> tuple[int, ...]:
    """Placement stage -> rank read off per-rank action lists; ValueError on a stage on two ranks or a gap."""
    owner: dict[int, int] = {}
    for rank, row in enumerate(actions):
        for a in (a for e in row for a in parts(e)):
            if owner.setdefault(a.stage, rank) != rank:
                raise ValueError(
                    f"stage {a.stage} appears on rank {owner[a.stage]} and on rank {rank} "
                    f"(action {a}); every stage must live on exactly one rank"
                )
    num_stages = 1 + max(owner, default=-1)
    if len(owner) < num_stages:
        missing = list(itertools.islice((s for s in range(num_stages) if s not in owner), 8))
        count = num_stages - len(owner)
        shown = ", ".join(map(str, missing)) + (f" and {count - len(missing)} more" if count > len(missing)
            else "")
        raise ValueError(f"no rank holds stage(s) {shown}; stages must be numbered 0 .. {num_stages - 1}")
    return tuple(owner[s] for s in range(num_stages))
