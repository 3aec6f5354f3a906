"""What crosses a process or host boundary: JSON with NumPy arrays as raw bytes beside it, never pickled.

Layout of one message (all integers little-endian)::

    b"ZBW1" | header length (8 bytes) | header: UTF-8 JSON | array bytes, one after another

The header is ``{"value": V, "arrays": [{"dtype": "<f4", "shape": [3, 4], "nbytes": 48}, ...]}``; in
``V`` an array is ``{"$array": i}`` and a non-finite float ``{"$float": "nan"}`` (strict JSON:
:mod:`zbpp_lite.schedules.strict_json`). Values: JSON's own (str dict keys), tuples (sent as lists), NumPy
arrays or scalars of numeric or bool dtype (scalars as 0-d arrays). Anything else (object arrays,
non-str keys, the keys ``"$array"`` / ``"$float"``) raises ``TypeError``; a malformed message raises
``ValueError`` naming what is wrong. Between two ranks of one machine the arrays go through shared memory
instead (``place`` / ``fetch``: :mod:`zbpp_lite.runtime.processes`); the header then holds where each is.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Callable

import numpy as np

from ..schedules import strict_json

MAGIC = b"ZBW1"
_KINDS = "biufc"  # bool, signed and unsigned int, float, complex: no object, string or void dtypes


def encode(value: Any, place: Callable[[np.ndarray], Any] | None = None) -> bytes:
    """``value`` as one message (bytes); ``place(array)``, where given, stores each array elsewhere and
    returns where (JSON), sent instead of its bytes. Raises TypeError naming the part that cannot be sent."""
    arrays: list[np.ndarray] = []

    def walk(v, where: str):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (np.ndarray, np.generic)):
            a = np.asarray(v)  # tobytes() writes C order whatever the strides
            if a.dtype.kind not in _KINDS:
                raise TypeError(f"wire.encode: {where} is an array of dtype {a.dtype}; only bool and numeric "
                                "dtypes cross processes")
            arrays.append(a)
            return {"$array": len(arrays) - 1}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                if not isinstance(k, str) or k in ("$array", "$float"):
                    raise TypeError(f"wire.encode: {where} has the key {k!r}; keys must be str (and not "
                                    "'$array', '$float')")
                out[k] = walk(x, f"{where}[{k!r}]")
            return out
        if hasattr(v, "__array__") and hasattr(v, "dtype"):  # a jax.Array: to host memory
            return walk(np.asarray(v), where)
        raise TypeError(f"wire.encode: {where} is a {type(v).__name__}; send JSON values, tuples and NumPy "
                        "arrays only")

    tree = walk(value, "value")
    specs = [{"dtype": a.dtype.str, "shape": list(a.shape), "nbytes": a.nbytes} for a in arrays]
    if place is not None:
        specs, arrays = [place(a) for a in arrays], []
    header = strict_json.dumps(
        {"value": tree, "arrays": specs}, nonfinite=lambda x: {"$float": repr(x)}, separators=(",", ":"),
    ).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header, *(a.tobytes() for a in arrays)])


def decode(data: bytes, fetch: Callable[[Any], np.ndarray] | None = None) -> Any:
    """The value of one message from :func:`encode`; ``fetch(where)`` reads an array ``place`` stored.
    Raises ValueError naming what is malformed."""
    data = memoryview(bytes(data))
    if len(data) < 12 or bytes(data[:4]) != MAGIC:
        raise ValueError(f"wire.decode: not a zbpp message (want it to start with {MAGIC!r}, got "
                         f"{bytes(data[:4])!r})")
    (n,) = struct.unpack("<Q", data[4:12])
    if 12 + n > len(data):
        raise ValueError(f"wire.decode: header of {n} bytes but only {len(data) - 12} follow")
    try:
        header = json.loads(bytes(data[12 : 12 + n]).decode())
        specs, tree = header["arrays"], header["value"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"wire.decode: header is not the JSON object encode() writes ({e})") from None
    arrays, at = [], 12 + n
    for i, spec in enumerate(specs):
        if fetch is not None:
            arrays.append(fetch(spec))
            continue
        dtype = np.dtype(spec["dtype"])
        shape = tuple(int(d) for d in spec["shape"])
        nbytes = int(spec["nbytes"])
        if dtype.kind not in _KINDS or dtype.hasobject:
            raise ValueError(f"wire.decode: array {i} has dtype {dtype}; only bool and numeric dtypes are "
                             "accepted")
        needs = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if nbytes != needs or at + nbytes > len(data):
            raise ValueError(f"wire.decode: array {i} ({dtype}, shape {shape}) claims {nbytes} bytes; "
                             f"{len(data) - at} remain and the shape needs {needs}")
        arrays.append(np.frombuffer(data[at : at + nbytes], dtype=dtype).reshape(shape).copy())
        at += nbytes
    if at != len(data):
        raise ValueError(f"wire.decode: {len(data) - at} bytes left over after the arrays")

    def walk(v):
        if isinstance(v, dict):
            if set(v) == {"$float"}:
                if v["$float"] not in ("nan", "inf", "-inf"):
                    raise ValueError(f"wire.decode: non-finite float {v['$float']!r}; want 'nan', 'inf' or "
                                     "'-inf'")
                return float(v["$float"])
            if set(v) == {"$array"}:
                i = v["$array"]
                if not isinstance(i, int) or not 0 <= i < len(arrays):
                    raise ValueError(f"wire.decode: array reference {i!r} outside 0..{len(arrays) - 1}")
                return arrays[i]
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(tree)
