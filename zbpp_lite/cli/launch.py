"""``python -m zbpp_lite launch --processes N --devices-per-process K -- train ...``: the train
command across N local processes on JAX's distributed runtime (127.0.0.1, free ports chosen here).

Each child runs ``python -m zbpp_lite.cli.launch_child`` with the train arguments, the ``ZBPP_*``
environment (coordinator, process count and index, transfer port) and K simulated CPU devices. Process 0's
output is relayed. When one fails (died, port in use, a rank stuck) the others are ended and the error
names it, bounded by ``--timeout`` per wait in the children and ``--deadline`` for the run.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

from ..runtime import cluster
from ..runtime.cluster import free_port
from ..runtime.devices import cpu_device_flags
from ..runtime.processes import end_process, exit_reason, failed
from . import CliError, build_parser
from .train import check_launchable, check_sizes, resolve_schedule


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    description = __doc__.split("\n\n")[0].replace("``", "")  # no reStructuredText quotes in --help
    p = subparsers.add_parser("launch", help=help_text, description=description)
    p.add_argument("--processes", "-n", type=int, default=2, help="local processes (default 2)")
    p.add_argument("--devices-per-process", "-k", type=int, default=1,
                   help="simulated CPU devices per process (default 1)")
    p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free "
                                                          "one)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait in a child may last "
                                                               "(default 60)")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds the whole run may last (default "
                                                                 "900)")
    p.add_argument("command_args", nargs=argparse.REMAINDER, help="-- train [train options]")
    return p


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def child_env(process: int, num_processes: int, coordinator_port: int, transfer_port: int, devices: int,
              timeout: float) -> dict:
    """``ZBPP_*`` settings, ``devices`` CPU devices + 1 for transfers
    (:func:`~zbpp_lite.runtime.distributed.staging_device`)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = cpu_device_flags(devices + (num_processes > 1), current=env.get("XLA_FLAGS", ""))
    env.update({cluster.ENV_COORDINATOR: f"127.0.0.1:{coordinator_port}",
                cluster.ENV_NUM_PROCESSES: str(num_processes),
                cluster.ENV_PROCESS_ID: str(process), cluster.ENV_TRANSFER_PORT: str(transfer_port),
                cluster.ENV_TIMEOUT: str(timeout), "PYTHONUNBUFFERED": "1"})
    return env


def _train_args(args) -> list[str]:
    rest = list(args.command_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest or rest[0] != "train":
        raise CliError("launch runs the train command: python -m zbpp_lite launch --processes 2 -- train "
                       "--schedule zb-h1 ...")
    return rest[1:]


def _check(args, train_args: list[str]) -> None:
    """Processes, devices and ranks must fit; checked before any process starts."""
    n, k = args.processes, args.devices_per_process
    if n < 1 or k < 1:
        raise CliError(f"--processes and --devices-per-process must be >= 1, got {n} and {k}")
    targs = build_parser(["train"]).parse_args(["train", *train_args])
    schedule = resolve_schedule(targs)
    check_sizes(targs, schedule)
    check_launchable(targs)
    p = schedule.num_ranks
    if n > p:
        raise CliError(f"{n} processes for {p} ranks: every process must hold a rank; use --processes <= {p}")
    if k < -(-p // n):
        need = -(-p // n)
        raise CliError(f"{p} ranks over {n} processes need {need} devices per process; use "
                       f"--devices-per-process {need}")


def launch(train_args: list[str], processes: int, devices_per_process: int = 1, port: int | None = None,
           timeout: float = 60.0, deadline: float = 900.0, echo=print,
           on_start=None) -> tuple[int, list[str]]:
    """Start the children, relay process 0's output, end all when one fails; ``on_start`` gets their
    pids. Returns (exit status, [a line per failed process]); CliError for a port in use."""
    if port is not None and port_in_use(port):
        raise CliError(f"coordinator port {port} on 127.0.0.1 is in use; choose another --port or leave it "
                       "out "
                       "(a free one is chosen)")
    coordinator = port if port is not None else free_port()
    transfer_ports: list[int] = []
    while len(transfer_ports) < processes:
        q = free_port()
        if q != coordinator and q not in transfer_ports:
            transfer_ports.append(q)
    children, tails, readers = [], [[] for _ in range(processes)], []

    def relay(i: int, stream, to_echo: bool) -> None:
        for line in iter(stream.readline, ""):
            tails[i].append(line.rstrip("\n"))
            del tails[i][:-20]
            if to_echo:
                echo(line.rstrip("\n"))

    for i in range(processes):
        child = subprocess.Popen(
            [sys.executable, "-m", "zbpp_lite.cli.launch_child", *train_args],
            env=child_env(i, processes, coordinator, transfer_ports[i], devices_per_process, timeout),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        children.append(child)
        for stream, show in ((child.stdout, i == 0), (child.stderr, False)):
            readers.append(threading.Thread(target=relay, args=(i, stream, show), daemon=True))
            readers[-1].start()
    if on_start is not None:
        on_start([c.pid for c in children])
    try:
        return _watch(children, tails, deadline)
    finally:
        for c in children:
            end_process(c, group=True)  # each child and its own children (its session), by id
        for t in readers:
            t.join(timeout=2)


def _watch(children: list, tails: list[list[str]], deadline: float) -> tuple[int, list[str]]:
    """Wait until every child has exited 0, one failed, or ``deadline`` seconds passed."""
    end = time.monotonic() + deadline
    while True:
        codes, bad = [c.poll() for c in children], failed(children)
        if bad:
            time.sleep(0.5)  # let the first error's last lines arrive
            return 1, [f"process {i} {exit_reason(code)}: {_last_error(tails[i])}" for i, code in bad]
        if all(c == 0 for c in codes):
            return 0, []
        if time.monotonic() > end:
            running = [i for i, c in enumerate(codes) if c is None]
            return 1, [f"process(es) {running} still running after the {deadline:g} s deadline: "
                       f"{_last_error(tails[running[0]])}"]
        time.sleep(0.1)


def _last_error(lines: list[str]) -> str:
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[-1].strip()[:400]


def run(args) -> int:
    train_args = _train_args(args)
    _check(args, train_args)
    t0 = time.perf_counter()
    status, failures = launch(train_args, args.processes, args.devices_per_process, args.port, args.timeout,
                              args.deadline)
    for line in failures:
        print(f"error: {line}", file=sys.stderr)
    if status == 0:
        print(f"launch: {args.processes} processes finished in {time.perf_counter() - t0:.1f} s")
    return status
