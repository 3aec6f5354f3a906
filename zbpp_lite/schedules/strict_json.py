"""Strict JSON out of the package: a non-finite float (NaN, +-inf) is written as null, and said so.

Python's ``json`` writes ``NaN`` / ``Infinity``, which RFC 8259 section 6 forbids, so ``JSON.parse``, ``jq``
and others refuse the file, just when a diverged run needs reading. Every JSON writer of the package uses
:func:`dumps` or :func:`write` (``allow_nan=False``). In the schedule layer so every layer may import it.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

NONFINITE_KEY = "nonfinite"
"""Key :func:`write` adds to a JSON object: the paths of the values written as null."""


def _null(x: float) -> None:
    return None


def sanitize(value: Any, nonfinite: Callable[[float], Any] = _null) -> tuple[Any, list[str]]:
    """``value`` with each non-finite float ``x`` replaced by ``nonfinite(x)`` (default None); dicts and
    lists copied (tuples become lists).

    Returns:
        (the copy, the replaced values' paths, e.g. ``["loss[2]", "test_loss"]``).
    """
    found: list[str] = []

    def walk(v: Any, where: str) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            found.append(where or "value")
            return nonfinite(v)
        if isinstance(v, dict):
            return {k: walk(x, f"{where}.{k}" if where else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{where}[{i}]") for i, x in enumerate(v)]
        return v

    return walk(value, ""), found


def dumps(value: Any, nonfinite: Callable[[float], Any] = _null, **options: Any) -> str:
    """``json.dumps`` of :func:`sanitize`'s copy with ``allow_nan=False``: strict JSON. Raises TypeError:
    a value JSON cannot hold (as ``json.dumps``)."""
    options.pop("allow_nan", None)
    return json.dumps(sanitize(value, nonfinite)[0], allow_nan=False, **options)


def write(path: str | os.PathLike, value: Any, indent: int | None = 1) -> str:
    """Write ``value`` to ``path`` as strict JSON; a dict gets key ``"nonfinite"`` listing any nulled paths.

    Returns:
        The line to print: ``wrote PATH``, which values were not finite, and whether a loss diverged.
    """
    clean, found = sanitize(value)
    if found and isinstance(clean, dict):
        clean[NONFINITE_KEY] = found
    with open(path, "w") as f:
        json.dump(clean, f, indent=indent, allow_nan=False)
        f.write("\n")
    return f"wrote {os.fspath(path)}" + (f"; {nonfinite_note(found)}" if found else "")


def nonfinite_note(paths: list[str]) -> str:
    """One line on the values written as null (at most five named): the divergence, if a loss."""
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    note = f"not finite (NaN or infinite), written as null: {shown}"
    if any("loss" in p for p in paths):
        note += " -- the run diverged (the loss is not finite; a smaller --lr may help)"
    return note
