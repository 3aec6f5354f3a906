"""``train --coordinator HOST:PORT --num-processes N --process-id I``: this host's process of a multi-host
run on JAX's distributed runtime; with none of these flags on a cluster JAX detects
(:func:`zbpp_lite.runtime.cluster.detect_cluster`), ``jax.distributed.initialize()`` finds them.

A small supervisor: checks the flags, trains in one child (``python -m zbpp_lite.cli.launch_child`` with
the ``ZBPP_*`` environment, as ``launch``), relays its output. A fatal coordination error in JAX's C++
runtime becomes one line naming the cause (:func:`~zbpp_lite.runtime.cluster.explain_runtime_failure`),
exit 1. The child dies with the supervisor (``PR_SET_PDEATHSIG``). Waits are bounded by ``--timeout``
(registration, first answer, each transfer) and ``--heartbeat``; ``ZBPP_VERBOSE=1`` relays all stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import threading

from ..runtime.cluster import JOIN_ENV, child_env, detect_cluster, explain_runtime_failure, parse_address
from ..runtime.processes import end_process, exit_reason, sigint_ignored_by_children
from . import CliError

JOIN_FLAGS = tuple(JOIN_ENV)
PER_PROCESS = (*JOIN_FLAGS, "json", "progress", "help")
"""The train options each process of a run sets for itself (where it joins, what it writes, its progress
bar); every other one must be the same on all (:func:`agreed_settings`)."""
_XLA_LOG = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|\s+@\s|\*\*\* )")


def add_join_arguments(p: argparse.ArgumentParser) -> None:
    """The multi-host flags of ``train``."""
    g = p.add_argument_group("several hosts (JAX's distributed runtime; docs/OPERATIONS.md 'Several hosts')")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address and a free port on it; every process gives the same")
    g.add_argument("--num-processes", type=int, metavar="N",
                   help="processes in the run, N >= 1 (the same on every process)")
    g.add_argument("--process-id", type=int, metavar="I",
                   help="this process's index in 0..N-1 (0 hosts the coordinator)")
    g.add_argument("--transfer-address", metavar="HOST:PORT",
                   help="where this process listens for cross-host array transfers (default: its address "
                        "towards the coordinator, a free port)")
    g.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds any one wait may last (default 60)")
    g.add_argument("--heartbeat", type=float, default=10.0, metavar="S",
                   help="seconds without a heartbeat before a process counts as lost and the others end "
                        "(default 10)")


def wants_join(args) -> bool:
    """A join flag is given, or a detected cluster has more than one process."""
    return any(getattr(args, k, None) is not None for k in JOIN_FLAGS[:4]) or detect_cluster() is not None


def check_join_arguments(args, num_ranks: int) -> None:
    """CliError naming a bad join flag and what is wanted (flags, or a cluster JAX detects)."""
    given = {k: getattr(args, k) for k in ("coordinator", "num_processes", "process_id")}
    if any(v is not None for v in given.values()):
        missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
        if missing:
            raise CliError("several hosts need --coordinator HOST:PORT, --num-processes N and --process-id "
                           f"I together; missing {', '.join(missing)}")
    elif detect_cluster() is None:
        raise CliError("--transfer-address needs --coordinator, --num-processes and --process-id (or a "
                       "cluster JAX detects: SLURM, MPI, TPU, Kubernetes)")
    try:
        if args.coordinator is not None:
            parse_address(args.coordinator, "--coordinator")
        if args.transfer_address is not None:
            parse_address(args.transfer_address, "--transfer-address")
    except ValueError as e:
        raise CliError(str(e)) from None
    n, i = args.num_processes, args.process_id
    if n is not None and n < 1:
        raise CliError(f"--num-processes must be >= 1, got {n}")
    if i is not None and not 0 <= i < n:
        raise CliError(f"--process-id must be in 0..{n - 1} for --num-processes {n}, got {i}")
    check_process_count(n, num_ranks, "--num-processes")
    if not args.timeout > 0 or not args.heartbeat > 0:
        raise CliError(f"--timeout and --heartbeat must be > 0 seconds, got {args.timeout} and "
                       f"{args.heartbeat}")


def _options(parser: argparse.ArgumentParser):
    """Each option of ``parser`` (argparse keeps no public list of them) with its long form."""
    for action in parser._actions:
        if action.option_strings:
            yield action, max(action.option_strings, key=len)


def agreed_settings(args, parser: argparse.ArgumentParser) -> dict:
    """``{"--flag": value}`` of every train option but :data:`PER_PROCESS`: what the processes of one run
    must agree on (the roll call compares them before any compute,
    :func:`~zbpp_lite.runtime.distributed.roll_call`). A ``--schedule-csv`` counts by its content."""
    settings = {}
    for action, flag in _options(parser):
        if action.dest not in PER_PROCESS:
            settings[flag] = getattr(args, action.dest, action.default)
    csv = settings.get("--schedule-csv")
    if csv:
        with open(csv, "rb") as f:
            settings["--schedule-csv"] = f"a file with sha256 {hashlib.sha256(f.read()).hexdigest()[:16]}"
    return settings


def train_argv(args, parser: argparse.ArgumentParser) -> list[str]:
    """``args``' non-default train flags as a command line for the child (join flags go in the env)."""
    argv: list[str] = []
    for action, flag in _options(parser):
        if action.dest in JOIN_FLAGS + ("help",):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return argv


def check_process_count(n: int | None, num_ranks: int, flag: str) -> None:
    """CliError when ``n`` processes are more than the ranks (a process would hold none)."""
    if n is not None and n > num_ranks:
        raise CliError(f"{n} processes for {num_ranks} ranks: every process must hold a rank; use "
                       f"{flag} <= {num_ranks} or more --ranks")


def start_child(train_args: list[str], env: dict, keep: int, show_err=None, show_out=None, **popen):
    """``python -m zbpp_lite.cli.launch_child TRAIN_ARGS`` with ``env``, stderr piped (stdout too where
    ``popen`` says): threads keep the last ``keep`` lines in a tail and pass each to ``show_err`` /
    ``show_out``. Returns (the process, its tail, the reader threads)."""
    with sigint_ignored_by_children():  # Ctrl-C: the supervisor says so once and ends the child
        child = subprocess.Popen([sys.executable, "-m", "zbpp_lite.cli.launch_child", *train_args], env=env,
                                 stderr=subprocess.PIPE, text=True, **popen)
    tail: list[str] = []

    def relay(stream, show) -> None:
        for line in iter(stream.readline, ""):
            tail.append(line.rstrip("\n"))
            del tail[:-keep]
            if show is not None:
                show(line.rstrip("\n"))

    readers = [threading.Thread(target=relay, args=(stream, show), daemon=True)
               for stream, show in ((child.stdout, show_out), (child.stderr, show_err)) if stream is not None]
    for reader in readers:
        reader.start()
    return child, tail, readers


def last_line(lines: list[str]) -> str:
    """The last of ``lines`` that mentions an error, else the last; XLA's log lines skipped."""
    lines = [x.strip() for x in lines if x.strip() and not _XLA_LOG.match(x)]
    return ([x for x in lines if "error" in x.lower()] or lines or ["(no output)"])[-1][:400]


def run_joined(args, schedule, parser: argparse.ArgumentParser, on_start=None) -> int:
    """Run this process under supervision; returns 0, or 1 with one ``error:`` line on stderr.
    ``on_start`` gets the worker's pid; CliError for bad join flags (train flags: ``check_launchable``)."""
    check_join_arguments(args, schedule.num_ranks)
    n, told = args.num_processes, []
    verbose = os.environ.get("ZBPP_VERBOSE") == "1"

    def show(line: str) -> None:
        if line.startswith("error:"):
            told.append(line)
        if verbose or line.startswith("error:"):
            print(line, file=sys.stderr, flush=True)

    env = child_env(vars(args), -(-schedule.num_ranks // n) if n is not None else None)
    child, kept, readers = start_child(train_argv(args, parser), env, 400, show_err=show)
    if on_start is not None:
        on_start(child.pid)
    try:
        status = child.wait()
    except BaseException:  # Ctrl-C or a signal: the worker goes too
        end_process(child)
        raise
    readers[0].join(timeout=5)
    if status == 0:
        return 0
    if not told:
        line = explain_runtime_failure("\n".join(kept), args.process_id, args.coordinator, n, args.timeout,
                                       args.transfer_address)
        if line is None:
            who = args.process_id if args.process_id is not None else "?"
            line = f"process {who}: {exit_reason(status)}: {last_line(kept)}"
        print(f"error: {line}", file=sys.stderr, flush=True)
    return 1
