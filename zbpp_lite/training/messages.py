"""Typed messages between processes: frozen dataclasses sent as JSON through :mod:`zbpp_lite.runtime.wire`
(arrays as raw bytes), never unpickled. A class names its kind in ``op``; :meth:`Message.to_wire` gives
``{"op": ..., field: value}`` and :func:`parse` builds the class back, refusing unknown kinds and fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

M = TypeVar("M", bound="Message")


@dataclass(frozen=True)
class Message:
    """Base of every message; subclasses set ``op`` and declare their fields."""

    op: ClassVar[str] = ""

    def to_wire(self) -> dict:
        """The dict a :class:`~zbpp_lite.runtime.processes.Channel` sends."""
        return {"op": self.op, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_wire(cls: type[M], message: Any) -> M:
        """The message ``message`` (a received dict) holds. Raises ValueError naming what is wrong."""
        return parse(message, cls)


def parse(message: Any, *kinds: type[M]) -> M:
    """The one of ``kinds`` whose ``op`` ``message`` names, built from its fields.

    Raises:
        ValueError: not a dict, an ``op`` none of ``kinds`` has, or fields missing or unknown.
    """
    by_op = {k.op: k for k in kinds}
    op = message.get("op") if isinstance(message, dict) else None
    if op not in by_op:
        raise ValueError(f"expected a message of kind {sorted(by_op)}, got {op!r}")
    kind = by_op[op]
    names = {f.name for f in fields(kind)}
    given = set(message) - {"op"}
    if given - names:
        raise ValueError(f"{kind.__name__} has no field(s) {sorted(given - names)}")
    try:
        return kind(**{k: message[k] for k in given})
    except TypeError as e:  # a required field missing
        raise ValueError(f"{kind.__name__}: {e}") from None
