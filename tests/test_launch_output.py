"""What ``launch`` prints: devices named per process, --help in plain text, the step time explained
(issue 31, part 6)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace



def test_a_device_is_named_by_its_process_and_local_index_not_jaxs_global_id(monkeypatch):
    # JAX numbers process 1's first CPU device 2048: "cpu:2048" read like 2048 devices
    import jax

    from zbpp_lite.cli.launch_child import device_name

    fake = [SimpleNamespace(id=i, process_index=i // 2048, platform="cpu") for i in (0, 1, 2048, 2049)]
    monkeypatch.setattr(jax, "devices", lambda *a: fake)
    assert [device_name(d) for d in fake] == ["process 0's cpu 0", "process 0's cpu 1", "process 1's cpu 0",
                                              "process 1's cpu 1"]


def test_launch_help_has_no_restructuredtext_quotes():
    argv = [sys.executable, "-m", "zbpp_lite", "launch", "--help"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "launch --processes N" in out.stdout and "``" not in out.stdout


def test_launch_names_devices_per_process_and_says_what_the_median_step_holds(untimed_children):
    # zb-auto: issue 31, launch planned memory-limited schedules with the default M_W = 7/16 M_B
    argv = [sys.executable, "-m", "zbpp_lite", "launch", "--processes", "2", "--", "train", "--schedule", "zb-auto",
            "--ranks", "2", "--microbatches", "2", "--steps", "2", "--d", "16", "--heads", "2", "--blocks", "4",
            "--batch", "4", "--no-progress"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank 0 on process 0's cpu 0, rank 1 on process 1's cpu 0" in out.stdout and "cpu:" not in out.stdout
    assert "after the first, which compiles: a step's wall time on process 0" in out.stdout
    assert "(their span is the makespan above)" in out.stdout
    assert out.stdout.count("zb-auto: planned with this job's activation memory per stage, M_B [") == 1


def test_a_failed_gradient_check_makes_train_exit_non_zero(capsys, monkeypatch):
    """Step 0's gradients beyond the tolerance the report states: one error line and status 1, not 0."""
    from zbpp_lite.cli import main
    from zbpp_lite.training import train

    monkeypatch.setattr(train, "check_step", lambda *args: (2.5, 0.0))  # gradients as two seeds' would differ
    tiny = ["--ranks", "2", "--microbatches", "2", "--steps", "1", "--d", "8", "--heads", "2", "--blocks", "2", "--batch", "4"]
    assert main(["train", "--schedule", "1f1b", *tiny, "--threads", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "max relative error 2.50e+00, loss difference 0.00e+00 (tolerance 0.001, relative)" in captured.out
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the gradient check failed" in errors[0] and "2.50e+00" in errors[0], captured.err
