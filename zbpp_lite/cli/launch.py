"""``python -m zbpp_lite launch --processes N --devices-per-process K -- train ...``: the train
command across N local processes on JAX's distributed runtime (127.0.0.1, free ports chosen here).

Each child runs ``python -m zbpp_lite.cli.launch_child`` with the train arguments, the ``ZBPP_*``
environment (coordinator, process count and index, transfer port) and K simulated CPU devices. Process 0's
output is relayed. When one fails (died, port in use, a rank stuck) the others are ended and the error
names it, bounded by ``--timeout`` per wait in the children and ``--deadline`` for the run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from ..runtime.cluster import check_bindable, child_env, explain_runtime_failure, free_port
from ..runtime.processes import end_process, exit_reason, failed
from . import CliError, parse_args, prepare_outputs, refuse_unused
from .join import JOIN_FLAGS, check_process_count, last_line, start_child
from .train import check_launchable, check_sizes, resolve_schedule


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    description = __doc__.split("\n\n")[0].replace("``", "")  # no reStructuredText quotes in --help
    p = subparsers.add_parser("launch", help=help_text, description=description)
    p.add_argument("--processes", "-n", type=int, default=2, help="local processes (default 2)")
    p.add_argument("--devices-per-process", "-k", type=int, default=1,
                   help="simulated CPU devices per process (default 1)")
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds any one wait in a child may last (default 60)")
    p.add_argument("--deadline", type=float, default=900.0,
                   help="seconds the whole run may last (default 900)")
    p.add_argument("command_args", nargs=argparse.REMAINDER, help="-- train [train options]")
    return p


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
    targs = parse_args(["train", *train_args])
    refuse_unused(targs, JOIN_FLAGS, "launch starts its processes and sets their runtime itself (its own "
                  "--timeout goes before --)")
    prepare_outputs(targs)  # process 0 writes train's --json here, after the run
    schedule = resolve_schedule(targs)
    check_sizes(targs, schedule)
    check_launchable(targs)
    p = schedule.num_ranks
    check_process_count(n, p, "--processes")
    if k < (need := -(-p // n)):
        raise CliError(f"{p} ranks over {n} processes need {need} devices per process; use "
                       f"--devices-per-process {need}")


def launch(train_args: list[str], processes: int, devices_per_process: int = 1, port: int | None = None,
           timeout: float = 60.0, deadline: float = 900.0, echo=print,
           on_start=None) -> tuple[int, list[str]]:
    """Start the children, relay process 0's output, end all when one fails; ``on_start`` gets their
    pids. Returns (exit status, [a line per failed process]); CliError for a port in use."""
    if port is not None:
        try:
            check_bindable("127.0.0.1", port, "--port: the coordinator port")
        except RuntimeError as e:
            raise CliError(str(e)) from None
    ports = [port] if port is not None else []
    while len(ports) < processes + 1:  # the coordinator's, then one for each process's transfers
        if (q := free_port()) not in ports:
            ports.append(q)
    children, tails, readers = [], [], []
    for i in range(processes):
        settings = {"coordinator": f"127.0.0.1:{ports[0]}", "num_processes": processes, "process_id": i,
                    "transfer_address": f"127.0.0.1:{ports[i + 1]}", "timeout": timeout}
        child, tail, threads = start_child(train_args, child_env(settings, devices_per_process), 100,
                                           show_out=echo if i == 0 else None, stdout=subprocess.PIPE,
                                           start_new_session=True)
        children.append(child)
        tails.append(tail)
        readers += threads
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
            return 1, [failure_line(i, code, tails[i]) for i, code in bad]
        if all(c == 0 for c in codes):
            return 0, []
        if time.monotonic() > end:
            running = [i for i, c in enumerate(codes) if c is None]
            return 1, [f"process(es) {running} still running after the {deadline:g} s deadline: "
                       f"{last_line(tails[running[0]])}"]
        time.sleep(0.1)


def failure_line(process: int, code: int, tail: list[str]) -> str:
    """Why child ``process`` failed (exit ``code``; ``tail``: its last lines): its own ``error:`` line, else
    the cause of an end in JAX's C++ runtime (:func:`~zbpp_lite.runtime.cluster.explain_runtime_failure`),
    else its last line."""
    told = any(line.startswith("error:") for line in tail)
    explained = None if told else explain_runtime_failure("\n".join(tail), process, None)
    return f"process {process} {exit_reason(code)}: {explained or last_line(tail)}"


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
