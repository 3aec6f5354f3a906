"""``python -m zbpp_lite plan``: grid, figures, CSV round trip, trace, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import zbpp_lite as zb


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbpp_lite", "plan", *args], capture_output=True, text=True, timeout=120)


def test_plan_prints_grid_and_the_simulators_figures(tmp_path):
    out = plan("--schedule", "zb-h1", "--ranks", "4", "--microbatches", "8", "--f", "1", "--b", "1", "--w", "1")
    assert out.returncode == 0, out.stderr
    t = zb.simulate(zb.build_schedule("zb-h1", 4, 8))
    assert f"makespan     {t.makespan:.6g}" in out.stdout
    assert f"bubble rate  {t.bubble_rate:.4f}" in out.stdout
    assert sum(line.startswith("rank ") for line in out.stdout.splitlines()) == 4


def test_plan_writes_a_csv_that_plans_back_identically_and_a_trace(tmp_path):
    csv, trace = tmp_path / "s.csv", tmp_path / "t.json"
    first = plan("-s", "zb-h2", "-p", "3", "-m", "6", "--csv", str(csv), "--trace", str(trace))
    again = plan("--from-csv", str(csv))
    assert first.returncode == again.returncode == 0
    figures = lambda out: out.stdout.split("makespan")[1].split("wrote")[0]  # noqa: E731
    assert figures(first) == figures(again)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert len(events) == len(zb.build_schedule("zb-h2", 3, 6))


def test_plan_says_which_m_w_a_memory_limited_plan_assumed_and_its_peak_at_m_w_equal_m_b():
    # issue 39: zb-2p planned with the default M_W promised 8 M_B; the same order at M_W = M_B holds 15
    out = plan("-s", "zb-2p", "-p", "4", "-m", "16")
    assert out.returncode == 0, out.stderr
    assert "assumed      M_W = 0.4375 M_B, planned under 8 8 8 8" in out.stdout
    assert "at M_W = M_B 11 13 14 15  (peak per rank of this order, units of one stage's M_B)" in out.stdout
    heavy = plan("-s", "zb-h1", "-p", "2", "-m", "4", "--mem-w", "1.5")  # a simulation holds M_W > M_B
    assert heavy.returncode == 0 and "peak memory  2.5 3  (per rank, units of one stage's M_B)" in heavy.stdout


def test_plan_walks_the_schedule_once_also_for_the_peak_at_m_w_equal_m_b(monkeypatch, capsys):
    # issue 39 (planning at p = 256): the peak at M_W = M_B was a second validate and simulate; a rank's
    # peak follows its own order, so it needs neither (fails on the old code: 2 execution orders)
    import zbpp_lite.schedules.validate as validate
    from zbpp_lite.cli import main

    calls, order = [], validate.execution_order
    monkeypatch.setattr(validate, "execution_order", lambda *a, **k: calls.append(1) or order(*a, **k))
    assert main(["plan", "-s", "zb-2p", "-p", "4", "-m", "16"]) == 0
    assert "at M_W = M_B 11 13 14 15  (peak per rank" in capsys.readouterr().out
    assert len(calls) == 1


def test_plan_plans_and_simulates_with_the_given_mem_b_and_mem_w():
    # issue 31: plan had no --mem-b / --mem-w, so a memory limit was always planned with M_W = 7/16 M_B
    out = plan("-s", "zb-auto", "-p", "4", "-m", "8", "--mem-b", "2", "--mem-w", "0.25", "--memory-limit", "5")
    assert out.returncode == 0, out.stderr
    costs = zb.Costs(mem_b=2, mem_w=0.25)
    t = zb.simulate(zb.build_schedule("zb-auto", 4, 8, costs=costs, memory_limit=5), costs)
    assert max(t.peak_memory) <= 5
    assert "peak memory  " + " ".join(f"{m:g}" for m in t.peak_memory) + "  (per rank, the unit of --mem-b)" in out.stdout
    assert f"makespan     {t.makespan:.6g}" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["-s", "zb-h3"], "unknown schedule 'zb-h3'; choose one of"),
        (["-p", "0"], "--ranks and --microbatches must be >= 1"),
        (["--from-csv", "/no/such/file.csv"], "schedule CSV '/no/such/file.csv': no such file"),
        (["--from-csv", "run,2.csv"], "'run,2.csv': no such file; to parse CSV text use Schedule.from_csv_text"),
        (["--from-csv", "tests"], "schedule CSV 'tests' is a directory; expected a CSV file"),
        (["-s", "1f1b", "-v", "2"], "drop --stages-per-rank"),
        (["--f", "-1"], "--f must be a finite number >= 0"),
        (["--bw", "nan"], "--bw must be a finite number >= 0"),
        (["--mem-b", "-2"], "--mem-b must be a finite number >= 0"),
        (["-s", "zb-2p", "--mem-b", "1", "--mem-w", "2"], "zb-2p: M_W exceeds M_B on stage(s) [0, 1, 2, 3]"),
    ],
)
def test_bad_arguments_get_one_line_not_a_traceback(args, message):
    out = plan(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_plan_reads_a_csv_with_cr_line_endings_and_blank_lines(tmp_path):
    """A 2-rank CSV with CR-only endings and blank lines plans on 2 ranks, like its clean twin."""
    clean = tmp_path / "clean.csv"
    zb.build_schedule("1f1b", 2, 3).to_csv(clean)
    messy = tmp_path / "messy.csv"
    messy.write_bytes(b"\r" + clean.read_bytes().replace(b"\n", b"\r\r") + b"\r\r")
    a, b = plan("--from-csv", str(clean)), plan("--from-csv", str(messy))
    assert a.returncode == b.returncode == 0, b.stderr
    assert "p = 2 ranks, 2 stages, m = 3 microbatches" in b.stdout
    figures = lambda out: out.stdout.split("makespan")[1]  # noqa: E731
    assert figures(a) == figures(b)


def test_plan_lists_every_registered_name_and_says_each_also_fuses():
    out = plan("--list")
    assert out.returncode == 0
    names = out.stdout.splitlines()
    assert names[:len(zb.SCHEDULES)] == list(zb.SCHEDULES) and "NAME+fuse" in names[-1]
    assert plan("--schedule", names[1] + "+fuse", "--ranks", "2", "--microbatches", "4").returncode == 0


def test_plan_pauses_the_cycle_collector_only_while_it_plans(capsys, monkeypatch):
    # issue 39 item 11: plan pauses gc (millions of acyclic objects at p = 256); the caller's state comes back
    import gc

    from zbpp_lite.cli import main
    from zbpp_lite.cli import plan as plan_cli

    inside = []
    run = plan_cli._run
    monkeypatch.setattr(plan_cli, "_run", lambda args: inside.append(gc.isenabled()) or run(args))
    try:
        assert gc.isenabled()
        assert main(["plan", "-s", "zb-h1", "-p", "4", "-m", "8"]) == 0
        assert gc.isenabled() and "makespan" in capsys.readouterr().out
        assert main(["plan", "-s", "zb-h1", "-p", "0"]) == 2  # refused inside: still restored
        assert gc.isenabled()
        gc.disable()
        assert main(["plan", "-s", "zb-h1", "-p", "4", "-m", "8"]) == 0
        assert not gc.isenabled()  # a caller's paused collector stays paused
    finally:
        gc.enable()
    assert inside == [False, False, False]
