"""What ranks send each other, the inbox it waits in, and the transports that carry it.

Records crossing between ranks: :class:`Transfer` ``(kind, stage, microbatch, attempt)``, an activation
("F", for stage s+1) or input gradient ("B", for s-1) as :func:`~zbpp_lite.schedules.ir.produces` names
it (attempt 1 once a speculative warm-up was redone); :class:`OptimizerMessage` ``(tag, sender)``, a host
value from an optimizer step (e.g. ``("FULL", p-1)``). Across processes a record is JSON
(:func:`to_wire` / :func:`from_wire`). :class:`Inbox` is where a rank's inputs wait.

The rank loop sends through a :class:`Transport`: :class:`Threads` (into the receiver's inbox),
:class:`Carrier` (other processes via ``remote``: :func:`zbpp_lite.runtime.processes.connect`),
``distributed._CrossProcess`` (across hosts). Add one as a :class:`Threads` subclass whose ``send`` gets
``value`` into rank ``rank``'s inbox of ``step`` without waiting for the receiver (plus ``start`` /
``finish`` if it needs threads or a gather).

Layer: runtime (no JAX import).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, NamedTuple, Union

from ..schedules.ir import Key
from ..schedules.program import consumer_stage


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


class OptimizerMessage(NamedTuple):
    """A value an optimizer step in the rank loop sends (``tag``: "NORM", "PARTIAL", "FULL", ...)."""

    tag: str
    sender: int


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


class Interrupted(Exception):
    """A speculative wait cut short: the verdict arrived (``newer`` False) or a sender redoes the step."""

    def __init__(self, newer: bool):
        super().__init__()
        self.newer = newer


class Inbox:
    """What other ranks sent one rank in one step, keyed by :class:`~zbpp_lite.schedules.ir.Key` or
    :class:`OptimizerMessage`, with attempts (a take drops older ones); one condition per rank."""

    def __init__(self, rank: int, abort: threading.Event, cond: threading.Condition | None = None,
                 where: str = ""):
        self.rank, self.abort, self.where = rank, abort, where  # where: e.g. " of step 3", for messages
        self.items: dict[InboxKey, tuple[int, Any]] = {}
        self.cond = cond if cond is not None else threading.Condition()

    def put(self, key: InboxKey, value: Any, attempt: int = 0) -> None:
        with self.cond:
            if key not in self.items or self.items[key][0] <= attempt:  # never older over newer
                self.items[key] = (attempt, value)
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def take(self, key: InboxKey, timeout: float, action: Any, attempt: int = 0,
             interrupt: Callable[[], bool] | None = None) -> Any:
        """The value sent under ``key`` in ``attempt`` (``action`` names the waiter in the timeout's
        message); raises :class:`Interrupted` once ``interrupt()`` is true or a later attempt's is there."""
        deadline = time.perf_counter() + timeout
        with self.cond:
            while True:
                if key in self.items:
                    got, value = self.items[key]
                    if got == attempt:
                        del self.items[key]
                        return value
                    if got < attempt:
                        del self.items[key]  # computed before the step was redone: stale
                    elif interrupt is not None:
                        raise Interrupted(newer=True)
                if interrupt is not None and interrupt():
                    raise Interrupted(newer=False)
                if self.abort.is_set():
                    raise Aborted()
                left = deadline - time.perf_counter()
                if left <= 0:
                    what = (f"{key.tag} from rank {key.sender}" if isinstance(key, OptimizerMessage)
                            else f"{key.kind} of stage {key.stage}, microbatch {key.microbatch}")
                    waiter = getattr(action, "text", action)
                    raise TimeoutError(f"rank {self.rank} waited {timeout:g} s before {waiter}{self.where}: "
                                       f"{what} never arrived")
                self.cond.wait(min(left, 0.5))


class Threads:
    """The transport (module docstring) with every rank a thread of this process: ``put(step, key, value,
    rank)`` fills the receiver's inbox. The executor calls ``send``, ``start`` and ``finish`` and reads
    ``where`` (this process's name in errors); every transport subclasses this."""

    where = ""

    def __init__(self, put: Callable[[Any, Any, Any, int], None]):
        self.put = put

    def send(self, step: Any, rank: int, key: Transfer | OptimizerMessage, value: Any) -> None:
        """``value`` under ``key`` for rank ``rank`` in ``step``; never waits for the receiver."""
        self.put(step, key, value, rank)

    def start(self, steps: list, shapes: list, abort: threading.Event, errors: list) -> list:
        """Threads to run beside the rank threads over ``steps`` (``shapes``: every stage's input)."""
        return []

    def finish(self, results: list) -> list:
        """The step results, as every process sees them."""
        return results


Transport = Threads
"""The interface the executor's ``transport`` argument builds: :class:`Threads` or a subclass."""


class Carrier(Threads):
    """Ranks ``local`` as threads, the others via ``remote(rank, key, value, step_number)`` (a pytree as
    ``leaves(value)``)."""

    def __init__(self, put, local: Any, remote: Callable[[int, Any, Any, int], None],
                 leaves: Callable[[Any], Any]):
        super().__init__(put)
        self.local, self.remote, self.leaves = set(local), remote, leaves

    def send(self, step: Any, rank: int, key: Transfer | OptimizerMessage, value: Any) -> None:
        if rank in self.local:
            self.put(step, key, value, rank)
        else:
            self.remote(rank, key, self.leaves(value) if isinstance(key, Transfer) else value, step.index)
