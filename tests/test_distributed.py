"""The executor across processes on JAX's distributed runtime (loopback): the unpartitioned
model's loss and gradients with 2 processes (each schedule's gradients in one process are
tests/test_executor.py's and tests/test_spmd.py's; here, one of each kind of traffic, and a tied GPT whose
copies sit in both processes trains with the one-process run's losses); and failure, not hang:
a dying process and a port in use give a clear error naming the process within bounded time,
with every child ended; a failed gradient check ends every process with status 1; the coordinator keeps
one step's results however many steps run. Each test starts its own children and ends only those."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from zbpp_lite.cli import CliError
from zbpp_lite.cli.launch import launch

TINY = ["--ranks", "2", "--microbatches", "4", "--steps", "1", "--d", "16", "--heads", "2", "--blocks", "4", "--batch", "8"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


# MPMD: zb-v (split backwards, W held back; a V: stages hand over on a rank and send both ways, so it
# carries every transfer a looped schedule's would and more), dualpipe-v (overlapped pairs); SPMD (one
# program over both processes): zb-v. A looped zb-h2 (MPMD) and zb-h1 (SPMD) ran here too: the same
# transfers, one direction fewer, at 15 s of CPU each; their gradients in one process are
# tests/test_executor.py's and tests/test_spmd.py's. (SPMD refuses DualPipeV's overlapped pairs:
# tests/test_spmd.py.)
@pytest.mark.parametrize("executor, name", [("mpmd", "zb-v"), ("mpmd", "dualpipe-v"), ("spmd", "zb-v")])
def test_two_processes_match_the_unpartitioned_model(name, executor, tmp_path, untimed_children):
    out = tmp_path / "run.json"
    lines: list[str] = []
    spmd = ["--spmd"] if executor == "spmd" else []
    status, failures = launch(["--schedule", name, *TINY, *spmd, "--json", str(out)], processes=2, timeout=60, deadline=180,
                              echo=lines.append)
    assert status == 0, failures
    run = json.loads(out.read_text())
    assert run["processes"] == 2
    assert run["grad_max_rel_error"] <= 1e-5
    assert run["loss_error"] <= 1e-5 * run["steps"][0]["loss"]
    if executor == "mpmd":
        assert any("process 1" in line for line in lines)  # rank 1 really ran in the other process
    else:
        assert run["executor"] == "spmd" and run["lockstep_ticks"] > 0


GPT_TINY = ["--model", "gpt", "--ranks", "2", "--microbatches", "4", "--steps", "3", "--d", "16", "--heads", "2",
            "--blocks", "2", "--context", "16", "--batch", "8", "--eval-every", "0"]

_LATE_PROCESS = """
import runpy, sys, time
from zbpp_lite.runtime.cluster import join_settings
from zbpp_lite.training import train
step, calls = train.train_step, []
def train_step(*args):  # process 1 comes to step 2 4 s late (as after a slow compile or an evaluation)
    calls.append(1)
    if join_settings()["process_id"] == 1 and len(calls) == 3:
        time.sleep(4.0)
    return step(*args)
train.train_step = train_step
sys.argv = ["launch_child", *sys.argv[1:]]
runpy.run_module("zbpp_lite.cli.launch_child", run_name="__main__")
"""


def test_a_tie_across_processes_trains_as_one_parameter(tmp_path, untimed_children):
    """The GPT under zb-h1 at p = 2 over 2 processes: the token embedding on process 0, the head tied to it
    on process 1. Each sends its copy's gradient through the coordinator's store, so step 0's gradients
    (both copies) equal jax.grad's of the unpartitioned model and every step's loss equals the one-process
    run's (threads, same flags): the copies stay one parameter through AdamW. Process 1 comes to step 2
    4 s late: the processes start a step together, so step 2's measured timeline holds no such wait
    (its makespan was 4 s and more: rank 0's warm-up F's ran, then it waited for rank 1)."""
    import jax

    from zbpp_lite.cli import parse_args
    from zbpp_lite.cli.train import check_sizes, model_config, resolve_schedule, run_config
    from zbpp_lite.training.train import TrainOptions, train

    out = tmp_path / "run.json"
    (status, lines, err), _ = _two_children(_LATE_PROCESS, ["--schedule", "zb-h1", *GPT_TINY, "--json", str(out)])
    assert status == 0, err[-2000:]
    assert "rank 1 on process 1" in lines
    run = json.loads(out.read_text())
    assert run["grad_max_rel_error"] <= 1e-5 and run["loss_error"] <= 1e-5 * run["steps"][0]["loss"]
    assert run["steps"][2]["seconds"] > 3.5 and run["steps"][2]["makespan"] < 2.0  # the wait: outside
    args = parse_args(["train", "--schedule", "zb-h1", *GPT_TINY])
    blocks = check_sizes(args, resolve_schedule(args))
    one = train("zb-h1", 2, 4, steps=3, model=model_config(args, blocks), run=run_config(args, check_grads=False),
                options=TrainOptions(devices=jax.devices()[:2]))  # the check ran in the processes
    assert [s["loss"] for s in run["steps"]] == pytest.approx(one.losses, rel=0, abs=1e-6)


def test_a_clipped_post_validated_launch_equals_the_same_run_in_one_process(tmp_path, untimed_children):
    """--max-grad-norm with --post-validation over 2 processes: each process's rank threads step their own
    stages (on the partial norm, validated, rolled back where wrong, the norm's messages through the
    coordinator's store), then each process gathers the other's stages. So every step's loss and global
    norm, and the test loss (process 0 evaluates all stages), equal the one-process run's (threads, same
    flags): without the gather, process 0 would evaluate stage 1 as it was before the first step."""
    import jax

    from zbpp_lite.cli import parse_args
    from zbpp_lite.cli.train import check_sizes, model_config, resolve_schedule, run_config
    from zbpp_lite.training.train import TrainOptions, train

    out, lines = tmp_path / "run.json", []
    flags = ["--schedule", "zb-h1", *TINY[:6], "--steps", "3", *TINY[8:], "--max-grad-norm", "0.05", "--post-validation"]
    status, failures = launch([*flags, "--json", str(out)], processes=2, timeout=60, deadline=240, echo=lines.append)
    assert status == 0, failures
    assert any("process 1" in line for line in lines)
    run = json.loads(out.read_text())
    args = parse_args(["train", *flags])
    blocks = check_sizes(args, resolve_schedule(args))
    one = train("zb-h1", 2, 4, steps=3, model=model_config(args, blocks),
                run=run_config(args, max_grad_norm=0.05, post_validation=True, check_grads=False),
                options=TrainOptions(devices=jax.devices()[:2]))
    assert [s["loss"] for s in run["steps"]] == pytest.approx(one.losses, rel=0, abs=1e-6)
    guards, expected = run["config"]["guard_reports"], one.config["guard_reports"]
    assert [g["global_norm"] for g in guards] == pytest.approx([g["global_norm"] for g in expected], rel=1e-6)
    assert all(g["clipped"] for g in guards)  # 0.05: every step
    # post-validation: every rank rolls back (lesson 3); each process names its own ranks, gathered
    assert [g["rolled_back"] for g in guards] == [g["rolled_back"] for g in expected] == [[0, 1]] * 3
    assert run["test_loss"] == pytest.approx(one.test_loss, rel=0, abs=1e-6)


def test_a_dying_process_is_named_and_every_child_ends(untimed_children, monkeypatch):
    pids: list[int] = []
    t0 = time.monotonic()
    monkeypatch.setenv("ZBPP_TEST_CRASH_PROCESS", "1")  # the children inherit the environment
    status, failures = launch(["--schedule", "1f1b", *TINY], processes=2, timeout=20, deadline=120, echo=lambda s: None,
                              on_start=pids.extend)
    assert status == 1 and len(pids) == 2
    assert any(f.startswith("process 1 exited with status 3") for f in failures), failures
    assert time.monotonic() - t0 < 60
    assert not any(_alive(pid) for pid in pids)


def test_a_port_in_use_is_refused_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(CliError, match=f"port {port}.*in use"):
            launch(["--schedule", "1f1b", *TINY], processes=2, port=port)


def test_more_processes_than_ranks_is_refused_before_starting(capsys):
    from zbpp_lite.cli import main

    assert main(["launch", "--processes", "3", "--", "train", "--schedule", "1f1b", *TINY]) == 2
    assert "3 processes for 2 ranks" in capsys.readouterr().err


def test_flags_launch_cannot_honour_are_refused_before_starting(capsys):
    from zbpp_lite.cli import main

    assert main(["launch", "--processes", "2", "--", "train", "--schedule", "1f1b", *TINY, "--ranks-as", "threads"]) == 2
    assert "--ranks-as threads is not supported there" in capsys.readouterr().err
    assert main(["launch", "--processes", "2", "--", "train", "--schedule", "1f1b", *TINY, "--platform", "cpu"]) == 2
    assert "--platform is not supported there" in capsys.readouterr().err


def test_the_launch_and_join_supervisors_do_not_import_jax():
    """The supervisors only start and watch processes: the children import JAX, they need not."""
    import subprocess
    import sys
    code = "import sys, zbpp_lite.cli.launch, zbpp_lite.cli.join; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


_MANY_STEPS = """
import sys
import zbpp_lite as zb
from zbpp_lite.runtime.cluster import free_port
from zbpp_lite.runtime.distributed import _client, initialize, process_executor
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.training.data import load_digits
from zbpp_lite.training.model import ModelConfig, build_parts

initialize(f"127.0.0.1:{free_port()}", 1, 0, timeout=30, transfer_address=f"127.0.0.1:{free_port()}")
schedule = zb.build_schedule("1f1b", 2, 2)
model = StagedModel(build_parts(ModelConfig(d=8, heads=2, blocks=2)), 2)
executor = process_executor(model, schedule, timeout=30)
x, y = load_digits().batch(0, 4)
counts = []
for k in range(int(sys.argv[1])):
    executor.run(model.params, x, y)
    counts.append(sum(key.startswith("zbpp/step") for key, _ in _client().key_value_dir_get_bytes("zbpp/")))
print("keys", counts[9], counts[-1])
"""


def test_the_coordinator_keeps_one_steps_results_however_many_steps_run(tmp_path, untimed_children):
    """Each step's results go through the coordinator's key-value store; those every process has read are
    deleted, so the store (process 0's memory) stays flat over many steps instead of growing by the
    model's gradient bytes a step."""
    import subprocess
    import sys

    from zbpp_lite.runtime.devices import cpu_device_flags

    env = {**os.environ, "XLA_FLAGS": cpu_device_flags(2, current=os.environ["XLA_FLAGS"])}
    done = subprocess.run([sys.executable, "-c", _MANY_STEPS, "40"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    after_10, after_40 = (int(v) for v in done.stdout.split("keys")[1].split())
    assert after_10 == after_40 <= 2, done.stdout  # one step's results (one per process) and no more


_WRONG_GRADIENTS = """
import runpy, sys
from zbpp_lite.training import train
train.check_step = lambda *args: (2.5, 0.0)  # step 0's gradients as far off as two seeds' would be
sys.argv = ["launch_child", *sys.argv[1:]]
runpy.run_module("zbpp_lite.cli.launch_child", run_name="__main__")
"""


def _two_children(code: str, train_args: list[str]) -> list[tuple[int, str, str]]:
    """``code`` (a launch child with a patch) run as processes 0 and 1 of one run on ``train_args``:
    (exit status, stdout, stderr) of each; both ended however the test goes."""
    import subprocess
    import sys

    from zbpp_lite.runtime.cluster import child_env, free_port

    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", code, *train_args], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=child_env({"coordinator": coordinator, "num_processes": 2, "process_id": q,
                                             "transfer_address": f"127.0.0.1:{free_port()}", "timeout": 120}, 1))
             for q in (0, 1)]
    try:
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, results)]


def test_a_failed_gradient_check_makes_every_process_exit_non_zero(untimed_children):
    results = _two_children(_WRONG_GRADIENTS, ["--schedule", "1f1b", *TINY])
    for q, (status, out, err) in enumerate(results):
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 1 and len(errors) == 1, err[-2000:]
        assert errors[0].startswith(f"error: process {q}: the gradient check failed") and "2.50e+00" in errors[0]
    assert "max relative error 2.50e+00, loss difference 0.00e+00 (tolerance 0.001, relative)" in results[0][1]
