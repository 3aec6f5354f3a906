"""Bad input gets one line naming what is wrong and what would be right (issue 31, part 4).

A one-character typo in a schedule CSV, NaN or overflowing numbers, NumPy integers, a scalar batch.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite.schedules.ir import Schedule

TYPOS = {  # the repros: stage 1 typed as 1000000, microbatch 0 as 10000000
    "stage": "0F0,0I0,0W0\n1000000F0,1000000I0,1000000W0\n",
    "microbatch": "0F10000000,0I0,0W0\n",
}


@pytest.mark.parametrize("what", sorted(TYPOS))
def test_an_index_far_beyond_the_rows_is_refused_in_one_line_before_anything_is_built(what):
    with pytest.raises(ValueError, match=rf"{what} 10+ is far beyond what the rows hold") as err:
        Schedule.from_csv_text(TYPOS[what])
    assert len(str(err.value)) < 300 and "\n" not in str(err.value)


@pytest.mark.parametrize("what", sorted(TYPOS))
def test_plan_from_csv_with_a_typo_answers_in_one_line(tmp_path, what):
    path = tmp_path / "typo.csv"
    path.write_text(TYPOS[what])
    out = subprocess.run([sys.executable, "-m", "zbpp_lite", "plan", "--from-csv", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "is far beyond what the rows hold" in out.stderr


def test_a_gap_in_the_stage_numbering_is_named_in_one_short_line():
    rows = [["0F0", "0I0", "0W0"], ["5F0", "5I0", "5W0"]]
    with pytest.raises(ValueError, match=r"no rank holds stage\(s\) 1, 2, 3, 4; stages must be numbered 0 .. 5"):
        Schedule.from_rows(rows)
    with pytest.raises(ValueError, match="num_microbatches 9 is more than the 6 action"):
        Schedule.from_rows(rows, num_microbatches=9)


@pytest.mark.parametrize("name", ["zb-auto", "zb-v"])
@pytest.mark.parametrize("limit", [float("nan"), float("inf"), [4.0, float("nan"), 4.0, 4.0]])
def test_a_memory_limit_that_is_not_finite_is_refused(name, limit):
    # NaN was taken as no limit by zb-auto and raised "cannot convert float NaN to integer" in zb-v
    with pytest.raises(ValueError, match=rf"^{name}: memory_limit must be finite"):
        zb.build_schedule(name, 4, 8, memory_limit=limit)


def test_costs_whose_sums_overflow_are_refused_in_one_line():
    with pytest.raises(ValueError, match="the simulated times overflow to infinity"):
        zb.simulate(zb.build_schedule("zb-h1", 4, 8), zb.Costs(f=1e308, comm=1e308))
    out = subprocess.run([sys.executable, "-m", "zbpp_lite", "plan", "--f", "1e308", "--comm", "1e308"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "overflow to infinity" in out.stderr


@pytest.mark.parametrize("name", ["zb-auto", "zb-1p", "zb-v", "v-half"])
def test_planners_whose_times_overflow_say_so_in_one_line(name):
    # the greedy scheduler raised AssertionError("greedy scheduler bug: no rank can move") at 5e307
    with pytest.raises(ValueError, match="^the simulated times overflow to infinity: costs up to 5e"):
        zb.build_schedule(name, 2, 4, costs=zb.Costs(f=5e307, b=5e307, w=5e307))
    out = subprocess.run([sys.executable, "-m", "zbpp_lite", "plan", "-s", name, "-p", "2", "-m", "4", "--f", "5e307",
                          "--b", "5e307", "--w", "5e307"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "overflow to infinity" in out.stderr


def test_numpy_integers_are_sizes_and_bools_and_floats_are_not():
    s = zb.build_schedule("zb-h1", np.int64(2), np.int32(4))
    assert s == zb.build_schedule("zb-h1", 2, 4) and type(s.num_microbatches) is int
    assert zb.build_schedule("interleaved-1f1b", 2, 4, stages_per_rank=np.int64(2)).num_stages == 4
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=rf"zb-h1: num_ranks must be an integer >= 1, got {bad!r}"):
            zb.build_schedule("zb-h1", bad, 4)


def test_a_scalar_batch_is_refused_in_one_line():
    from zbpp_lite.runtime.executor import PipelineExecutor
    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.training.model import ModelConfig, build_parts

    import jax

    model = StagedModel(build_parts(ModelConfig(d=8, heads=1, blocks=2)), 2)
    executor = PipelineExecutor(model, zb.build_schedule("1f1b", 2, 2), jax.devices()[:2])
    with pytest.raises(ValueError, match=r"^x is a scalar; give a batch \(b, \.\.\.\) with b divisible by 2"):
        executor.run(model.params, np.float32(1.0), np.int32(0))


# ------------------------------------------------------------------ outputs, checked before any compute

TINY = ["--ranks", "2", "--microbatches", "2", "--steps", "2", "--d", "16", "--heads", "2", "--blocks", "4", "--batch", "8"]
ADAPT_TINY = ["--ranks", "2", "--microbatches", "2", "--steps", "2", "--profile-steps", "2", "--d", "16", "--heads", "2",
              "--blocks", "4", "--batch", "8", "--no-control", "--no-online"]
UNWRITABLE = {  # what the path is -> (the path under tmp_path, the refusal)
    "a directory": (lambda tmp: str(tmp), "is a directory; give a file's path"),
    "under a file": (lambda tmp: str(tmp / "file" / "out.json"),
                     lambda tmp: f"cannot be written: {str(tmp / 'file')!r} is a file, not a folder"),
    "read-only": (lambda tmp: "/sys/zbpp_lite_out.json", "cannot be written: Permission denied"),
}
WRITERS = [  # (command line before the flag, the flag, what its path is)
    (["train", "--schedule", "1f1b", *TINY], "--json", "a directory"),
    (["train", "--schedule", "1f1b", *TINY], "--json", "read-only"),
    (["compare", "--schedules", "1f1b", *TINY, "--learn-steps", "0"], "--out", "under a file"),
    (["compare", "--schedules", "1f1b", *TINY, "--learn-steps", "0"], "--json", "a directory"),
    (["adapt", *ADAPT_TINY], "--json", "read-only"),
    (["adapt", *ADAPT_TINY], "--html", "a directory"),
    (["plan"], "--trace", "under a file"),
    (["launch", "--", "train", "--schedule", "1f1b", *TINY], "--json", "a directory"),
]


@pytest.mark.parametrize("argv, flag, what", WRITERS, ids=[f"{a[0]} {f} {w}" for a, f, w in WRITERS])
def test_an_output_that_cannot_be_written_is_refused_in_one_line_before_anything_runs(tmp_path, argv, flag, what):
    # train --json, compare --out/--json checked their paths only after the whole run: results printed, no file
    import time

    (tmp_path / "file").write_text("")
    path, message = UNWRITABLE[what][0](tmp_path), UNWRITABLE[what][1]
    message = message(tmp_path) if callable(message) else message
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "zbpp_lite", *argv, flag, path], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    print(f"{argv[0]} {flag} ({what}) refused in {time.monotonic() - t0:.2f} s")
    assert out.returncode == 2 and out.stdout == "", (out.stdout[-500:], out.stderr[-2000:])  # nothing ran
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} {path!r} {message}"), out.stderr[-2000:]


@pytest.mark.parametrize("command, flag", [("plan", "--csv"), ("plan", "--trace"), ("plan", "--from-csv"),
                                           ("train", "--init"), ("train", "--schedule-csv")])
def test_an_empty_path_is_refused_not_skipped(tmp_path, command, flag):
    # --json "$UNSET" ran and wrote nothing, without a word: an empty path counted as no flag (--init '':
    # trained from the model's init, then "[Errno 2] No such file or directory: ''")
    out = subprocess.run([sys.executable, "-m", "zbpp_lite", command, flag, ""], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "" and out.stderr == (
        f"error: {flag} was given an empty path (an unset shell variable?); give a file's path, or leave {flag} "
        "out\n")


def test_two_outputs_naming_one_file_are_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zbpp_lite", "plan", "--csv", "x.json", "--trace", "./x.json"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr == "error: --csv and --trace both name './x.json'; give each its own file\n"


def test_missing_folders_of_the_outputs_are_made_and_the_files_written(tmp_path):
    # plan --trace made its folders, --csv did not; train, compare and adapt failed after the run
    # (adapt's JSON goes into a new folder in tests/test_adapt.py, the same check for every command)
    plan = subprocess.run([sys.executable, "-m", "zbpp_lite", "plan", "--csv", "a/b/s.csv", "--trace", "c/t.json"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert zb.Schedule.from_csv(tmp_path / "a/b/s.csv").actions == zb.build_schedule("zb-h1", 4, 8).actions
    assert (tmp_path / "c/t.json").stat().st_size > 0



# ------------------------------------------------------------------ a flag given is never silently ignored

SIZES = ["--steps", "2", "--d", "16", "--heads", "2", "--batch", "8"]
IGNORED = [  # (command line, the one line it gets); each ran before, the flag silently unused
    (["plan", "--from-csv", "{csv}", "--schedule", "zb-h2"], "--from-csv reads the whole schedule: drop --schedule"),
    (["plan", "--from-csv", "{csv}", "--ranks", "4"], "--ranks 4 disagrees with --from-csv's 2 ranks; give --ranks 2 or drop it"),
    (["plan", "--from-csv", "{csv}", "--memory-limit", "3"], "--from-csv reads the whole schedule: drop --memory-limit"),
    (["plan", "--list", "--ranks", "3"], "--list prints the schedule names only: drop --ranks"),
    (["plan", "-s", "zb-h1", "--bw", "1.5"], "zb-h1 has no fused backward (BW) and plans without costs: drop --bw"),
    (["plan", "-s", "1f1b", "--fb", "2"], "1f1b has no overlapped F&B pair and plans without costs: drop --fb"),
    (["train", "--schedule-csv", "{csv}", "--option", "stages_per_rank=2", *SIZES],
     "--schedule-csv reads the whole schedule: drop --option"),
    (["train", "--schedule-csv", "{csv}", "--microbatches", "8", *SIZES],
     "--microbatches 8 disagrees with --schedule-csv's 4 microbatches"),
    (["train", "--timeout", "5", *SIZES], "--timeout and --heartbeat bound the waits of a run on several hosts"),
    (["train", "--overlap", *SIZES], "--overlap changes the SPMD program's ticks: give --spmd too"),
    (["train", "--spmd", "--threads", *SIZES], "--spmd runs one SPMD program, not a thread or process per rank"),
    (["train", "--spmd", "--ranks-as", "threads", *SIZES], "not a thread or process per rank: drop --ranks-as"),
    (["train", "--ranks-as", "processes", "--steps", "1", *SIZES[2:]], "--ranks-as processes cannot run here: --steps 1"),
    (["train", "--threads", "--ranks-as", "processes", *SIZES], "--threads and --ranks-as processes disagree"),
    (["train", "--context", "64", "--remat", *SIZES], "--remat and --eval-every set the GPT (--model "
                                                       "gpt): drop --context, --remat"),
    (["train", "--model", "gpt", "--spmd", *SIZES], "--model gpt starts from its own init and draws dropout keys"),
    (["launch", "--", "train", "--timeout", "3", *SIZES], "(its own --timeout goes before --): drop --timeout"),
    (["launch", "--", "train", "--threads", *SIZES], "--threads is not supported there"),
    (["launch", "--", "train", "--ranks-as", "threads", *SIZES], "--ranks-as threads is not supported there"),
    (["adapt", *ADAPT_TINY, "--every", "3"], "--no-online: nothing re-plans online, so no drift is checked: drop --every"),
    (["adapt", *ADAPT_TINY, "--no-replan", "--memory-limit", "3"],
     "--no-online --no-replan: zb-auto never plans, so it takes no memory limit: drop --memory-limit"),
    (["adapt", *ADAPT_TINY, "--no-replan", "--no-rebalance", "--min-gain", "0.1"], "no change is tried"),
    (["compare", "--schedules", "1f1b,1f1b", *TINY, "--learn-steps", "0"], "--schedules names ['1f1b'] more than once"),
    (["compare", "--model", "gpt", "--eval-every", "3", *TINY, "--learn-steps", "0"],
     "--eval-every sets the learning run's validation curve, and --learn-steps 0 runs none"),
    (["compare", "--schedules", "1f1b", *TINY[:-4], "--blocks", "0", "--learn-steps", "0"], "--blocks must be >= 1, got 0"),
    (["train", "--seed", "-1", *SIZES], "--seed must be an integer >= 0"),
    (["train", "--model", "gpt", "--remat", "--schedule", "zb-auto", "--threads", "--context", "16", "--blocks", "2",
      "--microbatches", "4", *SIZES], "zb-auto plans W apart from B, and under --remat B recomputes what W needs "
                                      "and holds it until W; train --remat with a schedule that fuses B and W"),
]


@pytest.mark.parametrize("argv, message", IGNORED, ids=[f"{a[0]}: {m[:50]}" for a, m in IGNORED])
def test_a_flag_the_run_would_not_use_or_that_disagrees_is_refused_in_one_line(tmp_path, capsys, argv, message):
    from zbpp_lite.cli import main

    csv = tmp_path / "s.csv"
    zb.build_schedule("1f1b", 2, 4).to_csv(csv)
    assert main([a.format(csv=csv) for a in argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.splitlines()) == 1 and message in out.err, out


def test_flags_that_agree_with_the_csv_are_taken(tmp_path, capsys):
    from zbpp_lite.cli import main

    csv = tmp_path / "s.csv"
    zb.build_schedule("1f1b", 2, 4).to_csv(csv)
    assert main(["plan", "--from-csv", str(csv), "--ranks", "2", "--microbatches", "4"]) == 0
    assert "p = 2 ranks, 2 stages, m = 4 microbatches" in capsys.readouterr().out


def test_compare_blocks_are_what_its_help_says_one_for_every_stage_by_default(capsys):
    # the help read "default: 8; none: 4, or one per stage", and at 8 blocks compare refused the
    # schedules with more stages than that (p > 4)
    from zbpp_lite.cli import main

    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "default: 8, or 2 per rank if more, so every schedule's stages get a block" in " ".join(
        capsys.readouterr().out.split())
    from zbpp_lite.cli import parse_args
    from zbpp_lite.cli.compare import FUSED, _build_one, blocks_of

    args = parse_args(["compare", "--ranks", "5", "--microbatches", "10"])
    assert blocks_of(args) == 10
    for name in [*zb.SCHEDULES, *FUSED]:
        schedule, why = _build_one(name, args, blocks_of(args), zb.Costs())
        assert why is None or "blocks" not in why, (name, why)
    fewer = parse_args(["compare", "--ranks", "5", "--microbatches", "10", "--blocks", "8"])
    assert _build_one("interleaved-1f1b", fewer, blocks_of(fewer), None) == (
        None, "8 blocks cannot fill 10 stages (use --blocks 10)")


def test_compare_runs_the_schedules_its_blocks_fill_and_lists_the_others():
    # at --blocks 2 compare profiled zb-v's 4 stages on 2 blocks before refusing it: a rank process's
    # traceback, then "error: rank 0: ValueError: 2 blocks cannot fill 4 stages", and zb-h1 never ran
    from zbpp_lite.cli import parse_args
    from zbpp_lite.cli.compare import _build

    args = parse_args(["compare", "--ranks", "2", "--microbatches", "4", "--blocks", "2"])
    profiled = []
    schedules, notes = _build(["zb-v", "zb-h1", "zb-auto"], args, 2, lambda S: profiled.append(S) or zb.Costs())
    assert [s.name for s in schedules] == ["zb-h1", "zb-auto"] and profiled == [2]
    assert notes == {"zb-v": "2 blocks cannot fill 4 stages (use --blocks 4)"}


def test_ranks_as_picks_the_mode_and_says_why():
    # the choice between threads and processes is a flag, and the reason printed names it
    from types import SimpleNamespace

    from zbpp_lite.cli import CliError
    from zbpp_lite.cli.train import threads_reason
    from zbpp_lite.runtime.processes import allowed_cores

    cpu, gpu = [SimpleNamespace(platform="cpu")], [SimpleNamespace(platform="gpu")]
    args = SimpleNamespace(steps=2, max_grad_norm=None, threads=False, ranks_as=None)
    ranks = len(allowed_cores())
    assert threads_reason(args, ranks, cpu) is None  # a core per rank: processes
    clipped = SimpleNamespace(**{**vars(args), "max_grad_norm": 1.0})
    assert threads_reason(clipped, ranks, cpu) is None  # clipping runs in processes too (the one train_step)
    assert threads_reason(args, ranks + 1, cpu) == f"{ranks} core(s) for {ranks + 1} ranks"
    assert threads_reason(args, 1, gpu) == "GPU devices, one per rank"
    assert threads_reason(SimpleNamespace(**{**vars(args), "ranks_as": "threads"}), ranks, cpu) == "--ranks-as threads"
    processes = SimpleNamespace(**{**vars(args), "ranks_as": "processes"})
    assert threads_reason(processes, ranks, cpu) is None
    with pytest.raises(CliError, match=r"^--ranks-as processes cannot run here: GPU devices, one per rank; use "):
        threads_reason(processes, 1, gpu)
