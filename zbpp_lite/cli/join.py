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
import os
import re
import subprocess
import sys
import threading

from ..runtime import cluster
from ..runtime.cluster import detect_cluster, explain_runtime_failure, parse_address
from ..runtime.devices import cpu_device_flags
from . import CliError

JOIN_FLAGS = ("coordinator", "num_processes", "process_id", "transfer_address", "timeout", "heartbeat")
_XLA_LOG = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|\s+@\s|\*\*\* )")


def add_join_arguments(p: argparse.ArgumentParser) -> None:
    """The multi-host flags of ``train``."""
    g = p.add_argument_group("several hosts (JAX's distributed runtime; see README 'Several hosts')")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address and a free port on it; "
                                                              "every process gives the same")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in the run, N >= 1 (the same on "
                                                                  "every process)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index in 0..N-1 (0 hosts the "
                                                               "coordinator)")
    g.add_argument("--transfer-address", metavar="HOST:PORT",
                   help="where this process listens for cross-host array transfers (default: its address "
                        "towards the coordinator, a free port)")
    g.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds any one wait may last "
                                                                            "(default 60)")
    g.add_argument("--heartbeat", type=float, default=10.0, metavar="S",
                   help="seconds without a heartbeat before a process counts as lost and the others end "
                        "(default 10)")


def wants_join(args) -> bool:
    """A join flag is given, or a detected cluster has more than one process."""
    if any(getattr(args, k, None) is not None for k in JOIN_FLAGS[:4]):
        return True
    return detect_cluster() is not None


def check_join_arguments(args, num_ranks: int) -> str:
    """Returns ``"flags"`` or the detected cluster's name; CliError names a bad flag and what is wanted."""
    given = {k: getattr(args, k) for k in ("coordinator", "num_processes", "process_id")}
    if any(v is not None for v in given.values()):
        missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
        if missing:
            raise CliError("several hosts need --coordinator HOST:PORT, --num-processes N and --process-id "
                           f"I together; missing {', '.join(missing)}")
        mode = "flags"
    else:
        mode = detect_cluster()
        if mode is None:
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
    if n is not None and n > num_ranks:
        raise CliError(f"{n} processes for {num_ranks} ranks: every process must hold a rank; use "
                       f"--num-processes <= {num_ranks} or more --ranks")
    if not args.timeout > 0 or not args.heartbeat > 0:
        raise CliError(f"--timeout and --heartbeat must be > 0 seconds, got {args.timeout} and "
                       f"{args.heartbeat}")
    return mode


def train_argv(args, parser: argparse.ArgumentParser) -> list[str]:
    """``args``' non-default train flags as a command line for the child (join flags go in the env)."""
    argv: list[str] = []
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        if not action.option_strings or action.dest in JOIN_FLAGS + ("help",):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        last = action.option_strings[-1]
        flag = last if last.startswith("--") else action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return argv


def child_env(args, num_ranks: int) -> dict:
    """The ``ZBPP_*`` join settings and, for a known process count, the CPU devices (+1 for transfers)."""

    env = dict(os.environ)
    for name, value in ((cluster.ENV_COORDINATOR, args.coordinator),
                        (cluster.ENV_NUM_PROCESSES, args.num_processes),
                        (cluster.ENV_PROCESS_ID, args.process_id),
                        (cluster.ENV_TRANSFER_ADDRESS, args.transfer_address)):
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    env.update({cluster.ENV_TIMEOUT: str(args.timeout), cluster.ENV_HEARTBEAT: str(args.heartbeat),
                "PYTHONUNBUFFERED": "1"})
    if args.num_processes is not None:
        n = args.num_processes
        env["XLA_FLAGS"] = cpu_device_flags(-(-num_ranks // n) + (n > 1), current=env.get("XLA_FLAGS", ""))
    return env


def run_joined(args, schedule, parser: argparse.ArgumentParser, on_start=None) -> int:
    """Run this process under supervision; returns 0, or 1 with one ``error:`` line on stderr.
    ``on_start`` gets the worker's pid; CliError for bad join flags (train flags: ``check_launchable``)."""
    check_join_arguments(args, schedule.num_ranks)
    child = subprocess.Popen(
        [sys.executable, "-m", "zbpp_lite.cli.launch_child", *train_argv(args, parser)],
        env=child_env(args, schedule.num_ranks), stdout=None, stderr=subprocess.PIPE, text=True,
    )
    if on_start is not None:
        on_start(child.pid)
    kept: list[str] = []
    told: list[str] = []
    verbose = os.environ.get("ZBPP_VERBOSE") == "1"

    def relay() -> None:
        for line in iter(child.stderr.readline, ""):
            kept.append(line)
            del kept[:-400]
            if verbose or line.startswith("error:"):
                if line.startswith("error:"):
                    told.append(line)
                sys.stderr.write(line)
                sys.stderr.flush()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        status = child.wait()
    except BaseException:  # Ctrl-C or a signal: the worker goes too (SIGKILL: JAX catches SIGTERM)
        child.kill()
        child.wait(timeout=10)
        raise
    reader.join(timeout=5)
    if status == 0:
        return 0
    if not told:
        line = explain_runtime_failure("".join(kept), args.process_id, args.coordinator, args.num_processes,
                                       args.timeout)
        if line is None:
            last = [x.strip() for x in kept if x.strip() and not _XLA_LOG.match(x)]
            who = args.process_id if args.process_id is not None else "?"
            line = f"process {who}: exited with status {status}" + (f": {last[-1][:300]}" if last else "")
        print(f"error: {line}", file=sys.stderr, flush=True)
    return 1
