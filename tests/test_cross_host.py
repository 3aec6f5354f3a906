"""The train command across hosts, each process on its own address: 127.0.0.1 (process 0, the
coordinator) and 127.0.0.2 (process 1), as two hosts would be. They train with the unpartitioned
model's gradients; a killed process ends the other within a bounded time with one line naming it,
and no process is left behind; a missing coordinator, mismatched process counts and a duplicate
process id each end every process within a bounded time with one line naming the cause; so does a
setting that differs between the processes, at the roll call; no port is open on every interface, and
a stranger's message to a transfer port is named as such. Each test starts its own processes (new
sessions) and ends only those."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import signal
import subprocess
import sys
import time

import pytest

from zbpp_lite.runtime.cluster import free_port

TINY = ["--ranks", "2", "--microbatches", "4", "--d", "16", "--heads", "2", "--blocks", "4", "--batch", "8"]
ADDRESS = {0: "127.0.0.1", 1: "127.0.0.2", 2: "127.0.0.3"}


def _loopback_127_0_0_2() -> bool:
    import socket

    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _loopback_127_0_0_2(), reason="this OS does not route 127.0.0.2 to loopback")


def _env() -> dict:
    from conftest import UNTIMED_CHILD_FLAGS

    return {**os.environ, "XLA_FLAGS": UNTIMED_CHILD_FLAGS}  # fast compiles: nothing is timed here


def _start(process: int, count: int, port: int, extra: list[str], timeout: float = 30, heartbeat: float = 10,
           transfer: str | None = None) -> subprocess.Popen:
    host = ADDRESS[process]
    cmd = [sys.executable, "-m", "zbpp_lite", "train", "--schedule", "1f1b", *TINY, *extra,
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(count), "--process-id", str(process),
           "--transfer-address", transfer or f"{host}:{free_port(host)}", "--timeout", str(timeout), "--heartbeat",
           str(heartbeat)]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _group_alive(pgid: int) -> list[int]:
    """Processes of session/group ``pgid`` still running (zombies count as ended)."""
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == pgid and fields[0] != "Z":
                alive.append(int(entry))
    return alive


def _finish(procs: list[subprocess.Popen], seconds: float) -> list[tuple[int, str, str]]:
    """Each process's (status, stdout, stderr) within ``seconds`` in all; any still running is
    killed (with its group) and fails the test."""
    end, out = time.monotonic() + seconds, []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, end - time.monotonic()))
            out.append((p.returncode, o, e))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a process did not end within {seconds:g} s")
    finally:
        for p in procs:
            _kill(p)
    return out


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=10)


def _wildcard_listeners(pgid: int) -> list[str]:
    """The TCP ports that processes of group ``pgid`` listen on on every interface (0.0.0.0 or ::)."""
    inodes = set()
    for pid in _group_alive(pgid):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state, inode = row.split()[1], row.split()[3], row.split()[9]
                host, port = local.split(":")
                if state == "0A" and inode in inodes and set(host) == {"0"}:  # 0A: LISTEN
                    found.append(f"{table.rsplit('/', 1)[1]} port {int(port, 16)}")
    return found


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_two_addresses_train_with_the_unpartitioned_models_gradients(tmp_path):
    port = free_port()
    out = tmp_path / "run.json"
    auto = ["--schedule", "zb-auto", "--steps", "2"]  # issue 31: planned with the job's M_B and M_W, not 7/16
    procs = [_start(0, 2, port, [*auto, "--json", str(out)]), _start(1, 2, port, auto)]
    (s0, o0, e0), (s1, o1, e1) = _finish(procs, 240)
    assert s0 == 0 and s1 == 0, (e0[-2000:], e1[-2000:])
    assert "rank 1 on process 1's" in o0  # rank 1 ran in the other process, the one on 127.0.0.2
    assert "zb-auto: planned with this job's activation memory per stage" in o0
    assert "planned with this job's" not in o1  # said once, by process 0
    run = json.loads(out.read_text())
    assert run["processes"] == 2 and len(run["steps"]) == 2
    assert run["grad_max_rel_error"] <= 1e-5
    assert run["loss_error"] <= 1e-5 * run["steps"][0]["loss"]
    assert not any(_group_alive(p.pid) for p in procs)


def test_a_killed_process_ends_the_other_in_bounded_time_naming_it():
    port, heartbeat = free_port(), 4
    procs = [_start(q, 2, port, ["--steps", "100000"], heartbeat=heartbeat) for q in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        seen = ""
        while "step    1" not in seen:  # mid-run: the pipeline is stepping
            assert procs[0].poll() is None and time.monotonic() < deadline, seen[-2000:]
            seen += procs[0].stdout.readline()
        os.killpg(procs[1].pid, signal.SIGKILL)  # the host of process 1 goes: its supervisor and worker
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=heartbeat + 30)
        after = time.monotonic() - killed
    finally:
        for p in procs:
            _kill(p)
    print(f"process 0 exited {after:.2f} s after process 1 was killed (heartbeat {heartbeat} s)")
    assert procs[0].returncode == 1
    errors = _errors(err)
    assert len(errors) == 1 and errors[0].startswith("error: process 0: lost process 1"), err[-2000:]
    assert after < heartbeat + 20
    time.sleep(0.5)
    assert not _group_alive(procs[0].pid) and not _group_alive(procs[1].pid)  # no orphan


def test_listeners_bind_the_addresses_given_and_a_strangers_message_is_named():
    """No port of the run is open on every interface; a stranger's message that JAX's transfer listener
    cannot take ends that process (JAX aborts in C++, out of our reach) with one line naming the likely cause."""
    port, heartbeat = free_port(), 4
    transfer = f"127.0.0.2:{free_port('127.0.0.2')}"
    procs = [_start(0, 2, port, ["--steps", "100000"], heartbeat=heartbeat),
             _start(1, 2, port, ["--steps", "100000"], heartbeat=heartbeat, transfer=transfer)]
    try:
        deadline, seen = time.monotonic() + 180, ""
        while "step    1" not in seen:  # every listener is up: the pipeline is stepping
            assert procs[0].poll() is None and time.monotonic() < deadline, seen[-2000:]
            seen += procs[0].stdout.readline()
        assert _wildcard_listeners(procs[0].pid) == [] and _wildcard_listeners(procs[1].pid) == []
        host, p = transfer.split(":")
        with socket.create_connection((host, int(p))) as s:
            s.sendall(struct.pack("<Q", 2**63) + b"x" * 64)
        (s0, _, e0), (s1, _, e1) = _finish(procs, heartbeat + 60)
    finally:
        for p in procs:
            _kill(p)
    assert s0 == 1 and s1 == 1
    (line,) = _errors(e1)
    assert line.startswith(f"error: process 1: JAX ended it on a message to its transfer port {transfer} that it could not "
                           "take (socket-server.cc:"), e1[-2000:]
    assert line.endswith("): most likely an unexpected client (a port scanner? another run?) reached that port; these ports "
                         "belong on a trusted cluster network (README 'Several hosts: trust')"), line
    # process 0 ends in one line too: the lost heartbeat or the broken transfer, whichever it meets first
    # (the transfer's end reads "recv() failed" or, met while dispatching, "Connection closed recv() == 0")
    (line0,) = _errors(e0)
    broken = ("lost process 1", "recv() failed", "Connection closed")
    assert line0.startswith("error: process 0: ") and any(b in line0 for b in broken), e0[-2000:]


def test_a_missing_coordinator_is_named_within_the_timeout():
    t0 = time.monotonic()
    (status, _, err), = _finish([_start(1, 2, free_port(), ["--steps", "1"], timeout=3)], 60)
    assert status == 1 and time.monotonic() - t0 < 45
    errors = _errors(err)
    assert len(errors) == 1 and "coordinator 127.0.0.1:" in errors[0] and "unreachable for 3 s" in errors[0], err[-2000:]


def test_mismatched_process_counts_are_named_by_both_processes():
    port = free_port()
    four = ["--ranks", "4", "--steps", "1"]  # 3 processes need 3 ranks or more
    results = _finish([_start(0, 2, port, four, timeout=10), _start(1, 3, port, four, timeout=10)], 90)
    for q, (status, _, err) in enumerate(results):
        errors = _errors(err)
        assert status == 1 and len(errors) == 1, err[-2000:]
        assert errors[0].startswith(f"error: process {q}: mismatched process counts: this process was started with --num-processes {2 + q}")


def test_a_setting_that_differs_is_refused_at_the_roll_call_by_every_process_naming_it():
    """Before any compute: not a crash 33 s in (a slice of the wrong size), nor a silent wrong run."""
    port = free_port()
    t0 = time.monotonic()
    results = _finish([_start(0, 2, port, ["--steps", "1"]), _start(1, 2, port, ["--steps", "1", "--microbatches", "8"])],
                      90)
    took = time.monotonic() - t0
    for q, (status, out, err) in enumerate(results):
        errors = _errors(err)
        assert status == 1 and len(errors) == 1, err[-2000:]
        assert errors[0] == (f"error: process {q}: --microbatches: process 0 has 4, process 1 has 8; give every process "
                             "of a run the same"), errors
        assert "step    0" not in out
    print(f"both processes refused the run {took:.1f} s after starting")


def test_a_duplicate_process_id_is_named_and_every_process_ends():
    port = free_port()
    four = ["--ranks", "4", "--steps", "1"]
    procs = [_start(0, 3, port, four, timeout=5)]
    procs.append(_start(1, 3, port, four, timeout=5))
    time.sleep(1.0)
    procs.append(_start(1, 3, port, four, timeout=5))  # the same id again; process 2 never comes
    t0 = time.monotonic()
    results = _finish(procs, 90)
    assert time.monotonic() - t0 < 60
    lines = [_errors(err) for _, _, err in results]
    assert all(status == 1 for status, _, _ in results) and all(len(x) == 1 for x in lines), lines
    assert sum("duplicate process id" in x[0] for x in lines) >= 1, lines
