"""What crosses a process boundary is parsed, never unpickled: zbpp_lite.runtime.wire round trips
JSON values and NumPy arrays bit for bit, refuses what it cannot send, rejects malformed bytes,
and distributed._exchange (the step's losses, gradients and events) goes through it."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from zbpp_lite.runtime import wire


def test_round_trip_keeps_values_dtypes_shapes_and_bits():
    rng = np.random.default_rng(0)
    value = {
        "losses": [[0, 2.5], [3, float("nan")]],
        "grads": [[1, [rng.standard_normal((3, 4)).astype(np.float32), np.arange(5, dtype=np.int64), np.zeros((0, 2), np.float16)]]],
        "events": [[0, "1F3", 0.001, 0.002]],
        "flag": True, "none": None, "scalar": np.float32(1.5), "t": (1, 2),
    }
    back = wire.decode(wire.encode(value))
    g = back["grads"][0][1]
    for a, b in zip(g, value["grads"][0][1]):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert back["losses"][0] == [0, 2.5] and np.isnan(back["losses"][1][1])
    assert back["events"] == [[0, "1F3", 0.001, 0.002]]
    assert back["flag"] is True and back["none"] is None and back["t"] == [1, 2]
    assert back["scalar"].dtype == np.float32 and back["scalar"].shape == () and float(back["scalar"]) == 1.5


def test_a_big_endian_array_comes_back_equal():
    a = np.arange(6, dtype=">f8").reshape(2, 3)
    b = wire.decode(wire.encode(a))
    assert np.array_equal(a, b) and b.dtype == a.dtype


@pytest.mark.parametrize("bad, what", [
    (np.array([object()], dtype=object), "dtype object"),
    ({1: 2}, "keys must be str"),
    ({"$array": 0}, "keys must be str"),
    ({"x": {1, 2}}, "is a set"),
    (np.array(["a"]), "dtype <U1"),
])
def test_what_cannot_be_sent_is_refused_on_encoding(bad, what):
    with pytest.raises(TypeError, match=what):
        wire.encode(bad)


def test_malformed_messages_are_rejected_not_executed():
    good = wire.encode({"a": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="not a zbpp message"):
        wire.decode(pickle.dumps({"a": 1}))  # a pickle is never loaded
    with pytest.raises(ValueError, match="claims 12 bytes"):
        wire.decode(good[:-4])
    with pytest.raises(ValueError, match="left over"):
        wire.decode(good + b"\0")
    forged = good.replace(b'"<f4"', b'"|O8"')
    with pytest.raises(ValueError, match="only bool and numeric"):
        wire.decode(forged)


class _FakeStore:
    """The distributed runtime's key-value client, in memory (the bytes calls _exchange uses)."""

    def __init__(self):
        self.data = {}

    def key_value_set_bytes(self, key, value):
        assert isinstance(value, bytes)
        self.data[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.data:
            raise RuntimeError(f"DEADLINE_EXCEEDED {key}")
        return self.data[key]


def test_exchange_sends_json_and_arrays_not_pickles(monkeypatch):
    from zbpp_lite.runtime import distributed

    store = _FakeStore()
    monkeypatch.setattr(distributed, "_client", lambda: store)
    other = {"losses": [[1, 0.5]], "grads": [[1, [np.full((2, 2), 3.0, np.float32)]]], "events": []}
    store.data["p/1"] = wire.encode(other)
    mine = {"losses": [[0, 0.25]], "grads": [[0, [np.ones(3, np.float32)]]], "events": [[0, "0F0", 0.0, 1e-3]]}
    shares = distributed._exchange("p", mine, 0, 2, timeout=1)
    assert store.data["p/0"].startswith(wire.MAGIC)
    assert shares[0]["events"] == [[0, "0F0", 0.0, 1e-3]] and np.array_equal(shares[1]["grads"][0][1][0], other["grads"][0][1][0])
    store.data["p/1"] = pickle.dumps(other)
    with pytest.raises(ValueError, match="message of process 1 for p is malformed"):
        distributed._exchange("p", mine, 0, 2, timeout=1)
    del store.data["p/1"]
    with pytest.raises(TimeoutError, match="process 1 published no results"):
        distributed._exchange("p", mine, 0, 2, timeout=1)


def test_message_keys_are_named_records_that_cross_as_json_objects():
    """Inbox keys are records, not tagged tuples: an activation or input gradient is a Transfer
    (kind, stage, microbatch, attempt), an optimizer's message an OptimizerMessage (tag, sender);
    each crosses a process as a JSON object and comes back as the same record."""
    from zbpp_lite.runtime.transport import OptimizerMessage, Transfer, from_wire, message_key, to_wire
    from zbpp_lite.schedules.ir import Action, Key, deps, produces

    t, n = Transfer("F", 2, 5, 1), OptimizerMessage("FULL", 3)
    assert (t.consumer, t.key, Transfer("B", 2, 5).consumer) == (3, Key("F", 2, 5), 1)
    for key in (t, n, Transfer("B", 0, 7)):
        back = from_wire(wire.decode(wire.encode(to_wire(key))))
        assert back == key and type(back) is type(key)
    assert message_key(("B", 1, 2)) == Transfer("B", 1, 2, 0) and message_key(("NORM", 0)) == OptimizerMessage("NORM", 0)
    for bad in (("F",), ("FULL", 1, 0), ("F", 1.5, 0), 3, {"kind": "F"}):
        with pytest.raises(ValueError, match="not a message key"):
            from_wire(bad) if isinstance(bad, dict) else message_key(bad)
    # deps and produces give Keys, equal to the plain tuples they always were
    assert deps(Action("B", 1, 2), 4) == (("F", 1, 2), ("B", 2, 2)) and deps(Action("B", 1, 2), 4)[1].stage == 2
    assert produces(Action("BW", 0, 1)) == (Key("B", 0, 1), Key("W", 0, 1))
