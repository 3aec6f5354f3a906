"""What ranks send each other, the inbox it waits in, and the transports that carry it.

Records crossing between ranks: :class:`Transfer` ``(kind, stage, microbatch, attempt)``, an activation
("F", for stage s+1) or input gradient ("B", for s-1) as :func:`~zbpp_lite.schedules.ir.produces` names
it (attempt 1 once a speculative warm-up was redone); the program's
:class:`~zbpp_lite.schedules.program.OptimizerMessage` ``(tag, sender)``, a host value from an optimizer
step (e.g. ``("FULL", p-1)``). Across processes a record is JSON (:func:`to_wire` / :func:`from_wire`).
:class:`Inbox` is where a rank's inputs wait.

The rank loop's ``Send`` and ``Recv`` instructions (:mod:`zbpp_lite.schedules.program`) call a
:class:`Transport`: ``send(step, rank, key, value)`` never waits, ``recv(step, rank, key, timeout)`` waits
for the value sent to ``rank`` under ``key`` in step number ``step``. :class:`Threads` carries values
between the ranks of one process (each rank's :class:`Inbox`); ``processes.Rings`` (processes of one
machine) and ``distributed._CrossProcess`` (hosts) subclass it, sending to a rank of another process
their own way and putting what arrives for a local rank into its inbox with :meth:`Threads.send`.

Layer: runtime (no JAX import).
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple, Protocol, Sequence, Union

from ..schedules.ir import Key
from ..schedules.program import OptimizerMessage, consumer_stage


class Transfer(NamedTuple):
    """An activation ("F", s, j: for s+1) or input gradient ("B", s, j: for s-1), from ``attempt``."""

    kind: str
    stage: int
    microbatch: int
    attempt: int = 0

    @property
    def key(self) -> Key:
        return Key(self.kind, self.stage, self.microbatch)

    @property
    def consumer(self) -> int:
        """The stage that takes it (:func:`~zbpp_lite.schedules.program.consumer_stage`)."""
        return consumer_stage(self.kind, self.stage)


InboxKey = Union[Key, OptimizerMessage]


def message_key(key: Any) -> Transfer | OptimizerMessage:
    """``key`` as a record: a record as it is; a sequence ``(kind, stage, microbatch[, attempt])``
    with kind "F" or "B" as a :class:`Transfer`; ``(tag, sender)`` as an :class:`OptimizerMessage`.

    Raises:
        ValueError: anything else, named."""
    if isinstance(key, (Transfer, OptimizerMessage)):
        return key
    try:
        head, *rest = key
    except (TypeError, ValueError):
        raise ValueError(f"not a message key: {key!r}") from None
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in rest)
    if head in ("F", "B") and len(rest) in (2, 3) and ints:
        return Transfer(head, *rest)
    if isinstance(head, str) and head not in ("F", "B") and len(rest) == 1 and ints:
        return OptimizerMessage(head, rest[0])
    raise ValueError(f"not a message key: {key!r}; want (F|B, stage, microbatch[, attempt]) or "
                     "(tag, sender)")


def to_wire(key: Transfer | OptimizerMessage) -> dict:
    """``key`` as a JSON object (:func:`from_wire` reads it back)."""
    return key._asdict()


def from_wire(data: Any) -> Transfer | OptimizerMessage:
    """The record :func:`to_wire` wrote. Raises ValueError for anything else."""
    for record in (Transfer, OptimizerMessage):
        if isinstance(data, dict) and set(data) == set(record._fields):
            return message_key(tuple(data[f] for f in record._fields))
    raise ValueError(f"not a message key on the wire: {data!r}")


class Aborted(Exception):
    """Another rank failed; this one stops waiting."""


class Inbox:
    """What other ranks sent one rank in one step, keyed by :class:`~zbpp_lite.schedules.ir.Key` or
    :class:`OptimizerMessage`, with attempts (a take drops older ones); one condition per rank."""

    def __init__(self, abort: threading.Event, cond: threading.Condition):
        self.abort, self.cond = abort, cond
        self.items: dict[InboxKey, tuple[int, Any]] = {}

    def put(self, key: InboxKey, value: Any, attempt: int = 0) -> None:
        with self.cond:
            if key not in self.items or self.items[key][0] <= attempt:  # never older over newer
                self.items[key] = (attempt, value)
            self.cond.notify_all()

    def take(self, key: InboxKey, timeout: float = 30.0, attempt: int = 0) -> Any:
        """The value sent under ``key`` in ``attempt`` (a later attempt's is read and left for that
        attempt: its sender redid the step after a rollback, which this rank then redoes too);
        raises :class:`Aborted`, or TimeoutError (no message) after ``timeout`` s."""
        deadline = time.perf_counter() + timeout
        with self.cond:
            while True:
                if key in self.items:
                    got, value = self.items[key]
                    if got > attempt:
                        return value
                    del self.items[key]  # taken; or computed before the step was redone: stale
                    if got == attempt:
                        return value
                if self.abort.is_set():
                    raise Aborted()
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError()
                self.cond.wait(min(left, 0.5))


def _split(key: Transfer | OptimizerMessage) -> tuple[InboxKey, int]:
    """An inbox's key and attempt of a message key."""
    return (key.key, key.attempt) if type(key) is Transfer else (key, 0)


class Transport(Protocol):
    """How values cross ranks (module docstring). Step numbers count the executor's steps; a rank is a
    schedule rank. ``where`` names this process in errors ("" for one process)."""

    where: str

    def start(self, steps: Sequence[int]) -> list[threading.Thread]:
        """Before step numbers ``steps`` run: threads to run beside the rank threads (none, mostly)."""

    def send(self, step: int, rank: int, key: Transfer | OptimizerMessage, value: Any) -> None:
        """``value`` under ``key`` for rank ``rank`` in step ``step``; never waits for the receiver."""

    def recv(self, step: int, rank: int, key: Transfer | OptimizerMessage, timeout: float) -> Any:
        """What was sent to ``rank`` under ``key`` in ``step`` (arrays, a pytree's leaves as a list from
        another process; a later attempt's as :meth:`Inbox.take`); raises TimeoutError after ``timeout``
        s, :class:`Aborted` after :meth:`abort`."""

    def abort(self) -> None:
        """Another rank failed: every ``recv`` of the steps started raises :class:`Aborted`."""

    def finish(self, results: list) -> list:
        """The steps' results, as every process sees them."""


class Threads:
    """The :class:`Transport` of ranks that are threads of one process: ``send`` puts into the receiving
    rank's :class:`Inbox` of the step (made when first used, so a value may arrive before its step
    starts), ``recv`` takes from it; a rank's inboxes share one condition."""

    where = ""

    def __init__(self):
        self._boxes: dict[tuple[int, int], Inbox] = {}  # (step, rank) -> inbox
        self._conds: dict[int, threading.Condition] = {}
        self._lock = threading.Lock()
        self._abort = threading.Event()

    def _box(self, step: int, rank: int) -> Inbox:
        box = self._boxes.get((step, rank))
        if box is None:
            with self._lock:
                cond = self._conds.setdefault(rank, threading.Condition())
                box = self._boxes.setdefault((step, rank), Inbox(self._abort, cond))
        return box

    def start(self, steps: Sequence[int]) -> list[threading.Thread]:
        with self._lock:
            self._abort = threading.Event()
            for key in [k for k in self._boxes if k[0] < min(steps)]:  # steps that ended: none reads them
                del self._boxes[key]
            for box in self._boxes.values():
                box.abort = self._abort
        return []

    def send(self, step: int, rank: int, key: Transfer | OptimizerMessage, value: Any) -> None:
        inbox_key, attempt = _split(key)
        self._box(step, rank).put(inbox_key, value, attempt)

    def recv(self, step: int, rank: int, key: Transfer | OptimizerMessage, timeout: float) -> Any:
        inbox_key, attempt = _split(key)
        return self._box(step, rank).take(inbox_key, timeout, attempt)

    def abort(self) -> None:
        self._abort.set()
        for cond in list(self._conds.values()):
            with cond:
                cond.notify_all()

    def finish(self, results: list) -> list:
        return results
