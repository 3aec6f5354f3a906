"""Schedules taking turns, one pinned process per rank (zbpp_lite.training.turns), and the
transport between the processes (zbpp_lite.runtime.processes): the same losses and gradients as
the unpartitioned model, timelines aligned across processes that respect every dependency, and
nothing unpickled on the way."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite.runtime.processes import Channel, RankProcesses
from zbpp_lite.schedules.ir import deps, produces
from zbpp_lite.training.model import ModelConfig
from zbpp_lite.training.train import RunConfig, job_costs
from zbpp_lite.training.turns import schedule_from_json, schedule_to_json, train_in_turns

SMALL = dict(model=ModelConfig(d=16, heads=2, blocks=4), run=RunConfig(batch=8))


@pytest.fixture(scope="module", autouse=True)
def _untimed_children():
    """Every rank process here compiles fast (conftest's untimed_children, for the whole module: the
    run in turns is shared); no test here asserts a timing of the compiled code."""
    from conftest import UNTIMED_CHILD_FLAGS

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", UNTIMED_CHILD_FLAGS)
        yield


UNEVEN = [[0, 1], [2, 3, 4, 5]]  # zb-h1's stages on a cut of its own (the default: [[0, 1, 2], [3, 4, 5]])


@pytest.fixture(scope="module")
def turns():
    """One run in turns that checks several things at once (each launch of the rank processes costs
    seconds of start-up and compiles): 1F1B, ZB-H2, ZB-V and a ZB-H1 on an uneven partition ("uneven")
    take 3 turns, then ZB-H2 goes on 2 steps alone in the same processes (``then``)."""
    import dataclasses

    # zb-v planned with this job's M_B, M_W: with the default M_W train refuses it (its peak would pass the plan's)
    zb_v = zb.build_schedule("zb-v", 2, 4, costs=job_costs(4, 4, SMALL["model"], SMALL["run"]))
    uneven = dataclasses.replace(zb.build_schedule("zb-h1", 2, 4), name="uneven")
    schedules = [zb.build_schedule("1f1b", 2, 4), zb.build_schedule("zb-h2", 2, 4), zb_v, uneven]
    ran, asked = [], []

    def then(seconds):
        asked.append(sorted(seconds))
        assert all(len(v) == 3 for v in seconds.values())
        return "zb-h2", 2

    results = train_in_turns(schedules, 3, on_step=lambda name, k, loss, timeline: ran.append((name, k)),
                             parts={"uneven": UNEVEN}, then=then, **SMALL)
    # there and back: step 1 in reverse, so each schedule's neighbours stay one step away
    names = ["1f1b", "zb-h2", "zb-v", "uneven"]
    assert ran == [(n, 0) for n in names] + [(n, 1) for n in names[::-1]] + [(n, 2) for n in names]
    assert asked == [sorted(names)]
    return schedules, results


def test_every_schedule_trains_the_same_model_to_the_same_losses(turns):
    schedules, results = turns
    assert list(results) == ["1f1b", "zb-h2", "zb-v", "uneven"]
    losses = np.array([r.losses for r in results.values()])
    np.testing.assert_allclose(losses, losses[:1].repeat(4, 0), rtol=1e-6)
    for r in results.values():
        assert r.grad_max_rel_error < 1e-5 and r.loss_error < 1e-5
        assert len(r.timelines) == len(r.step_seconds) == 3 and all(s > 0 for s in r.step_seconds)
        assert 0.0 <= r.test_accuracy <= 1.0


def test_timelines_of_separate_processes_align_and_respect_every_dependency(turns):
    schedules, results = turns
    for s in schedules:
        for t in results[s.name].timelines:
            assert sorted(str(e.action) for e in t.events) == sorted(str(a) for row in s.actions for a in row)
            end = {k: e.end for e in t.events for k in produces(e.action)}
            crossings = 0
            for e in t.events:
                for key in deps(e.action, s.num_stages):
                    assert e.start >= end[key] - 1e-9, f"{e.action} started before {key} ended"
                    producer = next(x for x in t.events if key in produces(x.action))
                    crossings += producer.rank != e.rank
            assert crossings > 0  # values did cross between the processes


def test_the_plan_is_made_from_the_measured_costs(turns):
    _, results = turns
    for r in results.values():
        assert r.simulated.makespan > 0 and r.measured.makespan > 0
        assert r.config["processes"].startswith("one per rank")


def test_turns_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="at least one schedule"):
        train_in_turns([], 3, **SMALL)
    with pytest.raises(ValueError, match="steps must be an integer >= 2"):
        train_in_turns([zb.build_schedule("1f1b", 2, 4)], 1, **SMALL)
    with pytest.raises(ValueError, match="same numbers of ranks and microbatches"):
        train_in_turns([zb.build_schedule("1f1b", 2, 4), zb.build_schedule("zb-h1", 2, 8)], 3, **SMALL)
    with pytest.raises(ValueError, match="distinct names"):
        train_in_turns([zb.build_schedule("1f1b", 2, 4)] * 2, 3, **SMALL)


def test_a_clipped_run_in_processes_equals_the_same_run_in_threads():
    """--max-grad-norm --post-validation through the one train_step in the rank processes: the norm
    crosses between them through their transport (the partial sums along the ranks, the full one back),
    every step is clipped and rolled back on every rank exactly as in threads, and the losses and
    parameters are the threads' run's. (Before, train_in_turns refused clipping.)"""
    import jax

    from zbpp_lite.training.train import TrainOptions, train

    run = RunConfig(batch=8, lr=1e-2, max_grad_norm=0.05, post_validation=True)  # every step clipped
    schedule = zb.build_schedule("zb-h2", 2, 4)
    processes = train_in_turns([schedule], 2, model=SMALL["model"], run=run)["zb-h2"]
    threads = train(schedule, steps=2, model=SMALL["model"], run=run, options=TrainOptions(devices=jax.devices()[:2]))
    guards = [r.config["guard_reports"] for r in (processes, threads)]
    assert all(g["clipped"] and not g["skipped"] for g in guards[0]) and len(guards[0]) == 2
    assert [g["rolled_back"] for g in guards[0]] == [g["rolled_back"] for g in guards[1]] == [[0, 1]] * 2
    np.testing.assert_allclose([g["global_norm"] for g in guards[0]], [g["global_norm"] for g in guards[1]], rtol=1e-5)
    np.testing.assert_allclose(processes.losses, threads.losses, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(processes.params), jax.tree_util.tree_leaves(threads.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert processes.config["post_validation"] is True and processes.grad_max_rel_error < 1e-5


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b", "dualpipe-v"])
def test_a_schedule_crosses_as_json_and_comes_back_the_same(name):
    s = zb.build_schedule(name, 2, 4 if name != "interleaved-1f1b" else 4, **({"stages_per_rank": 2} if name == "interleaved-1f1b" else {}))
    back = schedule_from_json(schedule_to_json(s))
    assert (back.actions, back.placement, back.num_microbatches, back.name) == (s.actions, s.placement, s.num_microbatches, s.name)


# ----------------------------------------------------------------------------- the transport


def echo(rank, peers, control, config):
    """A rank that doubles every array it is sent, and fails on request."""
    while (message := control.recv()) is not None:
        if message.get("fail"):
            raise ValueError(f"rank {rank} was asked to fail")
        control.send({"rank": rank, "twice": message["x"] * 2, "config": config})


def test_rank_processes_talk_json_and_arrays_and_name_a_failing_rank():
    here = f"{pathlib.Path(__file__).resolve()}:echo"
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with RankProcesses(here, 2, {"k": [1, 2.5, None]}, pin=False) as ranks:
        ranks.broadcast({"x": x})
        replies = ranks.gather(timeout=120)
        assert [r["rank"] for r in replies] == [0, 1]
        for r in replies:
            np.testing.assert_array_equal(r["twice"], 2 * x)
            assert r["twice"].dtype == np.float32 and r["config"] == {"k": [1, 2.5, None]}
        ranks.controls[1].send({"fail": True})
        with pytest.raises(RuntimeError, match="rank 0: ValueError: rank 0 was asked to fail|rank 1: ValueError: rank 1 was asked to fail"):
            ranks.controls[0].send({"fail": True})
            ranks.gather(timeout=120)
    assert all(p.poll() is not None for p in ranks.procs)  # nothing left running


def test_bad_entries_and_sizes_are_refused():
    with pytest.raises(ValueError, match="num_ranks must be an integer >= 1"):
        RankProcesses("zbpp_lite.training.turns:rank_main", 0, {})
    with pytest.raises(ValueError, match="module:function"):
        RankProcesses("zbpp_lite.training.turns", 1, {})


def test_a_channel_refuses_what_is_not_data():
    import socket

    a, b = socket.socketpair()
    left, right = Channel(a.detach()), Channel(b.detach())
    left.send({"v": [1, 2], "a": np.ones(3, np.int64)})
    got = right.recv()
    assert got["v"] == [1, 2] and got["a"].tolist() == [1, 1, 1]
    with pytest.raises(TypeError):
        left.send({"f": lambda: 0})


def test_nothing_that_crosses_processes_is_unpickled():
    runtime = pathlib.Path(zb.__file__).parent / "runtime"
    for path in [runtime / "processes.py", runtime / "distributed.py", runtime / "wire.py", runtime / "transport.py",
                 runtime.parent / "training" / "turns.py"]:
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "pickle" not in names | modules, f"{path.name} imports pickle"


def test_a_schedule_may_run_on_its_own_partition(turns):
    """ZB-H1 on an uneven cut, in turns with schedules on the default cut: the same losses and the
    unpartitioned model's gradients (test_every_schedule_trains_the_same_model_to_the_same_losses), each
    with the partition it was given; a partition naming no schedule, or out of order, is refused."""
    _, results = turns
    assert results["1f1b"].config["parts"] == [[0, 1, 2], [3, 4, 5]]
    assert results["uneven"].config["parts"] == UNEVEN
    even = zb.build_schedule("zb-h1", 2, 4)
    with pytest.raises(ValueError, match="not one of the schedules"):
        train_in_turns([even], 2, parts={"odd": UNEVEN}, **SMALL)
    with pytest.raises(ValueError, match="in order"):
        train_in_turns([even], 2, parts={"zb-h1": [[0, 2], [1, 3, 4, 5]]}, **SMALL)


def test_then_goes_on_training_the_chosen_schedule_as_if_it_had_run_alone(turns):
    """``then`` continues one schedule in the comparison's processes: the same losses, step for
    step, as that schedule trained alone for all the steps, and the test accuracy of its final model."""
    schedules, both = turns
    alone = train_in_turns([schedules[1]], 5, **SMALL)["zb-h2"]
    assert both.then is not None
    np.testing.assert_allclose(both.then.losses, alone.losses, rtol=1e-6)
    assert both.then.losses[:3] == both["zb-h2"].losses and len(both.then.step_seconds) == 2
    assert both.then.test_accuracy == pytest.approx(alone.test_accuracy, abs=1e-6)


def test_messages_cross_as_json_and_parse_back_to_their_own_kind():
    """The parent's words and the ranks' answers are named records: sent as wire JSON (arrays as
    raw bytes), parsed back by ``op``; unknown kinds and fields are refused, naming them."""
    from zbpp_lite.runtime import wire
    from zbpp_lite.training.messages import parse
    from zbpp_lite.training.turns import GetParams, Params, Step, Stepped

    step = Step("zb-h1", 3, grads=True)
    assert parse(wire.decode(wire.encode(step.to_wire())), Step, GetParams) == step
    leaves = {"0": [np.arange(4, dtype=np.float32)]}
    back = Params.from_wire(wire.decode(wire.encode(Params(leaves).to_wire())))
    np.testing.assert_array_equal(back.params["0"][0], leaves["0"][0])
    with pytest.raises(ValueError, match="expected a message of kind"):
        parse({"op": "stepped", "seconds": 1.0}, Step, GetParams)
    with pytest.raises(ValueError, match="has no field"):
        Step.from_wire({"op": "step", "schedule": "x", "step": 0, "then": 1})
    with pytest.raises(ValueError, match="Stepped"):
        Stepped.from_wire({"op": "stepped", "seconds": 1.0})



def test_a_killed_rank_is_named_with_its_signal_at_once_while_another_rank_waits():
    """kill -9 of one rank while the parent waits on another (which waits forever for a word)
    is reported within a few seconds, naming the rank and the signal, not after the timeout."""
    import os
    import signal
    import time

    here = f"{pathlib.Path(__file__).resolve()}:echo"
    with RankProcesses(here, 2, {}, pin=False) as ranks:
        ranks.controls[1].send({"x": np.zeros(2)})
        assert ranks.controls[1].recv()["rank"] == 1  # rank 1 is up; rank 0 is sent nothing and waits
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^rank 1's process was killed by signal 9 \(SIGKILL\)$"):
            ranks.gather(timeout=60)
        assert time.monotonic() - t0 < 5
    assert all(p.poll() is not None for p in ranks.procs)  # rank 0, still waiting, was ended too


def test_a_word_to_a_rank_that_has_died_names_it_and_how():
    import os
    import signal

    from zbpp_lite.runtime.processes import RankFailed

    here = f"{pathlib.Path(__file__).resolve()}:echo"
    with RankProcesses(here, 2, {}, pin=False) as ranks:
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        ranks.procs[1].wait(30)
        with pytest.raises(RankFailed, match=r"^rank 1's process was killed by signal 9 \(SIGKILL\)$"):
            ranks.broadcast({"x": np.zeros(2)})
            ranks.gather(timeout=60)


def relay(rank, links, control, config):
    """Rank 0 sends rank 1 an array over their link each time the parent says so; rank 1 only waits."""
    from zbpp_lite.runtime.processes import _Link
    from zbpp_lite.runtime.transport import Transfer

    link = _Link(links["1"]["fd"], links["1"]["out"], links["1"]["in"]) if rank == 0 else None
    while control.recv() is not None:
        for j in range(100):  # the first sends after rank 1 died may still fit the socket's buffer
            link.send("relay", Transfer("F", 0, j), np.zeros(4, np.float32), 0, 1)
        control.send({"sent": True})


def test_a_rank_whose_peer_died_ends_quietly_and_the_parent_names_the_peer(capfd):
    """A send to a killed peer is a consequence, not the cause: the sender tells the parent which peer and
    ends without a traceback, and the parent reports how that peer ended (the race behind a failed CI run,
    where a killed rank's partner printed half a traceback beside the one-line error)."""
    import os
    import signal

    from zbpp_lite.runtime.processes import RankFailed

    here = f"{pathlib.Path(__file__).resolve()}:relay"
    with RankProcesses(here, 2, {}, pin=False) as ranks:
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        ranks.procs[1].wait(30)
        ranks.controls[0].send({"go": True})
        with pytest.raises(RankFailed, match=r"^rank 1's process was killed by signal 9 \(SIGKILL\)$"):
            ranks.gather(timeout=60)
        assert ranks.procs[0].wait(30) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err, err

TINY_JOB = ["--ranks", "2", "--microbatches", "4", "--steps", "100000", "--d", "16", "--heads", "2", "--blocks", "4",
            "--batch", "8"]


def _rank_pids(pid: int) -> dict[int, int]:
    """``{pid: rank}`` of ``pid``'s children that are rank processes (named by the spec in their environment)."""
    import json

    ranks = {}
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for child in map(int, f.read().split()):
            try:
                with open(f"/proc/{child}/environ", "rb") as env:
                    spec = [v for v in env.read().split(b"\0") if v.startswith(b"ZBPP_RANK_SPEC=")]
            except OSError:  # ended meanwhile
                continue
            if spec:
                ranks[child] = json.loads(spec[0].split(b"=", 1)[1])["rank"]
    return ranks


def _start(tmp_path, *args: str):
    """``python -m zbpp_lite ARGS`` started in a session of its own (Ctrl-C reaches a whole process group)."""
    import os
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "zbpp_lite", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _train_in_processes(tmp_path):
    """``train`` with one process per rank, started, and its rank processes' ids once step 1 is
    printed (the ranks are the parent's children, named by the spec in their environment)."""
    parent = _start(tmp_path, "train", "--schedule", "1f1b", *TINY_JOB, "--no-progress")
    seen = []
    for line in parent.stdout:
        seen.append(line)
        if line.startswith("step    1"):
            break
    else:
        pytest.fail(f"train ended before step 1: {parent.wait()} {parent.stderr.read()[-2000:]}")
    assert any(line.startswith("REAL run: one process per rank") for line in seen), seen
    ranks = {rank: pid for pid, rank in _rank_pids(parent.pid).items()}
    assert sorted(ranks) == [0, 1], ranks
    return parent, ranks


def _finish(parent, timeout: float) -> tuple[float, str]:
    import time

    t0 = time.monotonic()
    try:
        _, err = parent.communicate(timeout=timeout)
    except Exception:
        parent.kill()
        parent.communicate()
        raise
    return time.monotonic() - t0, err


def test_train_reports_a_rank_killed_by_signal_9_in_one_line_within_seconds(tmp_path):
    import os
    import signal

    parent, ranks = _train_in_processes(tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    seconds, err = _finish(parent, 60)
    lines = [line for line in err.splitlines() if line.strip()]
    print(f"train reported the killed rank {seconds:.2f} s after kill -9")
    assert parent.returncode == 1 and seconds < 5, (seconds, err[-2000:])
    assert lines == ["error: rank 1's process was killed by signal 9 (SIGKILL)"], err[-2000:]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks.values())  # rank 0 ended too (and reaped)


def test_sigterm_to_train_prints_one_line_ends_the_ranks_and_leaks_no_shared_memory(tmp_path):
    import os
    import signal

    parent, ranks = _train_in_processes(tmp_path)
    os.kill(parent.pid, signal.SIGTERM)
    seconds, err = _finish(parent, 60)
    lines = [line for line in err.splitlines() if line.strip()]
    print(f"train ended {seconds:.2f} s after SIGTERM")
    assert parent.returncode == 128 + signal.SIGTERM and seconds < 10, (seconds, err[-2000:])
    assert lines == ["train: stopped by SIGTERM; every process it started has ended"], err[-2000:]
    assert "leaked shared_memory" not in err and "Traceback" not in err
    assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks.values())


STOPPED = "{}: interrupted (Ctrl-C); every process it started has ended"


def _assert_one_line_and_none_left(parent, pids, command: str) -> None:
    import os
    import signal

    seconds, err = _finish(parent, 60)
    lines = [line for line in err.splitlines() if line.strip()]
    print(f"{command} ended {seconds:.2f} s after Ctrl-C")
    assert parent.returncode == 128 + signal.SIGINT and seconds < 10, (parent.returncode, seconds, err[-3000:])
    assert lines == [STOPPED.format(command)], err[-3000:]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_ctrl_c_on_train_prints_one_line_exits_130_and_ends_the_ranks(tmp_path):
    import os
    import signal

    parent, ranks = _train_in_processes(tmp_path)
    os.killpg(parent.pid, signal.SIGINT)  # as the terminal does: the whole process group
    _assert_one_line_and_none_left(parent, ranks.values(), "train")


def test_ctrl_c_on_train_in_threads_prints_one_line_and_exits_130(tmp_path):
    # the rank threads, left running, aborted the interpreter at exit ("terminate called ...")
    import os
    import signal

    parent = _start(tmp_path, "train", "--schedule", "1f1b", *TINY_JOB, "--no-progress", "--threads")
    for line in parent.stdout:
        if line.startswith("step    3"):
            break
    os.killpg(parent.pid, signal.SIGINT)
    _assert_one_line_and_none_left(parent, [], "train")


def test_ctrl_c_on_compare_prints_one_line_exits_130_and_ends_the_ranks(tmp_path):
    # it printed a traceback from the parent and from every rank process (4 of them, 158 lines)
    import os
    import signal
    import time

    parent = _start(tmp_path, "compare", "--schedules", "1f1b", *TINY_JOB, "--learn-steps", "0",
                    "--out", str(tmp_path / "c.html"))
    deadline = time.monotonic() + 120
    while len(ranks := _rank_pids(parent.pid)) < 2 and parent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(ranks) == 2, (parent.poll(), ranks)
    time.sleep(1.0)
    os.killpg(parent.pid, signal.SIGINT)
    _assert_one_line_and_none_left(parent, ranks, "compare")


SWALLOWED = """
import gc, os, signal, sys, time
from zbpp_lite import cli
from zbpp_lite.cli import plan

def run(args):
    def callback(phase, info):  # as JAX's gc callback: Python prints and drops what it raises
        if phase == "start" and not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10 ** 6):  # the handler runs here, inside the callback
                pass
    fired = []
    gc.callbacks.append(callback)
    end = time.monotonic() + 20
    while time.monotonic() < end:
        gc.collect()
    return 0

plan.run = run
sys.exit(cli.main(["plan"]))
"""


def test_a_ctrl_c_while_the_command_line_is_parsed_prints_one_line_and_exits_130(monkeypatch, capsys):
    # parsing imports every command and JAX (1-2 s); the handlers came after it: a 50-line traceback, or
    # a KeyboardInterrupt swallowed by JAX's gc callback and the whole compare run on to exit 0
    import os
    import signal
    import time

    from zbpp_lite import cli

    parse = cli.build_parser

    def interrupted(argv=None):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)  # the handler runs here
        return parse(argv)

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["compare", "--steps", "2"]) == 130
    assert capsys.readouterr().err.splitlines() == [STOPPED.format("compare")]


def test_a_ctrl_c_that_lands_in_a_gc_callback_still_stops_the_command():
    # about one train --threads run in three kept training: JAX's gc callback swallowed the interrupt
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True, timeout=60)
    assert out.returncode == 130 and time.monotonic() - t0 < 15, (out.returncode, out.stderr[-2000:])
    assert out.stderr.splitlines() == [STOPPED.format("plan")]
