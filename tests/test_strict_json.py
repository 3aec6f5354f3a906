"""Strict JSON: every JSON file and message of the package parses in a strict parser (issue 31, part 4).

Python's json writes NaN and Infinity unless told not to; they are not JSON (RFC 8259, section 6),
so Node's JSON.parse refuses the whole file. ``strict`` below is such a parser.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np
import pytest

from zbpp_lite.schedules import strict_json

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zbpp_lite"


def strict(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_a_nan_loss_is_written_as_null_listed_and_called_a_divergence(tmp_path):
    path = tmp_path / "r.json"
    line = strict_json.write(path, {"steps": [{"loss": 2.3}, {"loss": math.nan}], "test_loss": math.inf, "n": 3})
    data = strict(path.read_text())
    assert data["steps"][1]["loss"] is None and data["test_loss"] is None and data["n"] == 3
    assert data["nonfinite"] == ["steps[1].loss", "test_loss"]
    assert line.startswith(f"wrote {path}; not finite") and "steps[1].loss, test_loss" in line
    assert "diverged" in line


def test_finite_output_is_unchanged_and_says_nothing_more(tmp_path):
    path = tmp_path / "r.json"
    assert strict_json.write(path, {"a": (1.0, 2)}) == f"wrote {path}"
    assert strict(path.read_text()) == {"a": [1.0, 2]}
    assert strict_json.dumps([math.nan, -math.inf, np.float64("nan")]) == "[null, null, null]"


def test_no_module_writes_json_but_through_strict_json():
    # one writer: json.dump / json.dumps anywhere else may write NaN again
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{i}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "strict_json.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bjson\.dumps?\(", line)
    ]
    assert found == []


def test_the_wire_header_is_strict_json_and_nan_still_crosses():
    from zbpp_lite.runtime import wire

    data = wire.encode({"loss": math.nan, "up": math.inf, "down": -math.inf, "x": 1.5})
    (n,) = __import__("struct").unpack("<Q", data[4:12])
    strict(data[12 : 12 + n].decode())
    back = wire.decode(data)
    assert math.isnan(back["loss"]) and back["up"] == math.inf and back["down"] == -math.inf and back["x"] == 1.5
    with pytest.raises(TypeError, match=r"\$float"):
        wire.encode({"$float": "nan"})


def test_train_with_a_diverging_loss_writes_strict_json_and_says_it_diverged(tmp_path, capsys):
    # the repro: --lr 1e30 makes the loss NaN; the file must still parse (Node's JSON.parse)
    from zbpp_lite.cli import main

    path = tmp_path / "r.json"
    argv = ["train", "--threads", "--d", "8", "--heads", "1", "--blocks", "2", "--steps", "3", "--lr", "1e30",
            "--ranks", "2", "--microbatches", "2", "--batch", "4", "--json", str(path), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    data = strict(path.read_text())
    assert any(s["loss"] is None for s in data["steps"]) and data["test_loss"] is None
    assert "test_loss" in data["nonfinite"] and "the run diverged" in out
