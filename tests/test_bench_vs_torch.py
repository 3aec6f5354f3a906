"""benchmarks/bench_vs_torch.py's rounds (issue 32): PyTorch's runs and ours alternate, each round's
ratios and their median are reported; checked on made-up figures, no run started."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_torch.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_torch", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ours(one: float, auto: float, h1f: float, h2f: float, suffix: str = "@turns") -> dict:
    figures = {"1f1b": one, "zb-auto": auto, "zb-h1+fuse": h1f, "zb-h2+fuse": h2f}
    return {name + suffix: {"median_ms": ms, "min_ms": ms, "losses": [2.3, 2.2]}
            for name, ms in figures.items()}


def test_one_rounds_ratios(bench):
    theirs = {"baseline": {"median_ms": 10.0}, "1F1B": {"median_ms": 50.0},
              "ZBVZeroBubble": {"median_ms": 40.0}, "GPipe": {"error": "failed"}}
    r = bench.round_ratios(theirs, _ours(45.0, 30.0, 44.0, 36.0))
    assert r == pytest.approx({"1f1b / PyTorch's 1F1B": 0.9, "zb-auto / PyTorch's best": 0.75,
                               "zb-h1+fuse / our 1f1b": 44 / 45, "zb-h2+fuse / our 1f1b": 0.8})
    # the fused runs are set against our 1f1b of the same set-up; PyTorch's side skipped: None
    procs = {**_ours(50.0, 31.0, 45.0, 40.0, "@procs"), "1f1b@turns": {"error": "x"}}
    r = bench.round_ratios({}, procs)
    assert r["1f1b / PyTorch's 1F1B"] is None and r["zb-auto / PyTorch's best"] is None
    assert r["zb-h1+fuse / our 1f1b"] == pytest.approx(0.9)
    assert r["zb-h2+fuse / our 1f1b"] == pytest.approx(0.8)


def test_rounds_alternate_and_report_each_ratio_and_the_median(bench, monkeypatch, tmp_path, capsys):
    calls = []
    ones = iter([40.0, 50.0, 45.0])

    def run_torch(args, init, workdir):  # the PyTorch side as it is without torch: skipped
        calls.append("torch")
        return {}

    def run_ours(args, init, workdir):
        calls.append("ours")
        one = next(ones)
        return _ours(one, 30.0, one * 0.9, one * 0.8)

    monkeypatch.setattr(bench, "run_torch", run_torch)
    monkeypatch.setattr(bench, "run_ours", run_ours)
    out = tmp_path / "r.json"
    assert bench.main(["--runs", "turns@procs", "--rounds", "3", "--json", str(out)]) == 0
    assert calls == ["torch", "ours"] * 3  # A B A B A B
    text = capsys.readouterr().out
    row = {x.strip()[:21]: x.split()[-4:] for x in text.splitlines() if " / " in x}
    assert row["zb-h2+fuse / our 1f1b"] == ["0.800"] * 4  # three rounds and their median
    assert row["1f1b / PyTorch's 1F1B"] == ["-"] * 4
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == 3
    assert report["round_ratios"]["zb-h1+fuse / our 1f1b"]["median"] == pytest.approx(0.9)


def test_fewer_than_three_rounds_is_refused_in_one_line(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--rounds", "2"])
    assert e.value.code == 2
    assert "--rounds must be an integer >= 3" in capsys.readouterr().err.strip().splitlines()[-1]
