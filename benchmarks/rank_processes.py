"""One process per pipeline rank, joined by pipes: PyTorch's pipelining set-up for our executor.

Used by ``bench_vs_torch.py`` (``NAME@procs``) and ``bench_postval.py`` (``--procs``). Each rank
runs in its own spawned process, pinned to its own core before JAX starts (so XLA's threads serve
that rank only), with one CPU device and a
:class:`~zbpp_lite.executor.PipelineExecutor` for its rank only (``ranks=[r], remote=...``).
Activations, input gradients and an optimizer's messages between ranks travel through a pipe per
pair of ranks (:func:`connect`), written by a sender thread per pipe so that a rank never waits
for the other process to read (a pipe holds 64 KiB; an activation here is 128 KiB); the parent
talks to each rank through a control pipe.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable


def spawn(target: Callable, num_ranks: int, pin_ranks: bool, *args) -> tuple[list, list]:
    """Start ``target(rank, core, peers, control, *args)`` in one spawned process per rank.

    ``core`` is the allowed core the rank is to pin itself to (None without ``pin_ranks``),
    ``peers`` maps every other rank to this rank's end of their pipe, ``control`` is the rank's
    end of its control pipe. Returns (processes, the parent's ends of the control pipes).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    peers: list[dict] = [{} for _ in range(num_ranks)]
    for a in range(num_ranks):
        for b in range(a + 1, num_ranks):
            peers[a][b], peers[b][a] = ctx.Pipe()
    controls = [ctx.Pipe() for _ in range(num_ranks)]
    procs = [
        ctx.Process(target=target, daemon=True,
                    args=(r, allowed[r % len(allowed)] if pin_ranks and allowed else None, peers[r], controls[r][1], *args))
        for r in range(num_ranks)
    ]
    for proc in procs:
        proc.start()
    return procs, [parent for parent, _ in controls]


def pin_to(core: int | None) -> None:
    """Pin this process to ``core`` (before JAX starts its threads); None leaves it free."""
    if core is not None:
        os.sched_setaffinity(0, {core})


def connect(peers: dict, executor_for):
    """Build this rank's executor(s) with a ``remote`` that writes to the pipes, and start one
    receiver thread per pipe that hands what arrives to the right executor's ``deliver``.

    ``executor_for(remote)`` builds the executor; or a dict ``{name: executor_for}`` builds
    several (one per schedule, run in turns: each message carries its executor's name, so one
    arriving early for the next schedule's step never reaches the wrong executor). Arrays travel
    as NumPy arrays, an optimizer's host values as they are. Returns the executor, or the dict
    ``{name: executor}``; :func:`disconnect` ends the receivers.
    """
    import jax
    import numpy as np

    single = callable(executor_for)
    factories = {None: executor_for} if single else dict(executor_for)

    def remote_for(name):
        def remote(to: int, key, value, step: int) -> None:  # never blocks the rank's thread
            _OUTBOXES[id(peers[to])].put((name, key, np.asarray(value) if isinstance(value, jax.Array) else value, step, to))

        return remote

    for conn in peers.values():  # one sender thread per pipe: a pipe write of a large array blocks
        _OUTBOXES[id(conn)] = outbox = queue.SimpleQueue()  # until the other process reads it
        threading.Thread(target=_send_all, args=(conn, outbox), daemon=True).start()

    executors = {name: build(remote_for(name)) for name, build in factories.items()}

    def receive(conn) -> None:
        _favour_this_thread()
        while (message := conn.recv()) is not None:
            name, *rest = message
            executors[name].deliver(*rest)

    for conn in peers.values():
        threading.Thread(target=receive, args=(conn,), daemon=True).start()
    return executors[None] if single else executors


def disconnect(peers: dict) -> None:
    """Tell the other ranks' receivers that this rank sends nothing more (after what is queued)."""
    for conn in peers.values():
        _OUTBOXES.pop(id(conn)).put(None)


def _favour_this_thread() -> None:
    """Give this (mostly sleeping) communication thread a higher priority than the rank's compute
    on the one core the process is pinned to, so a message goes out or in at once instead of
    after the compute thread's time slice (Linux; needs the right to lower a nice value: as root,
    or with CAP_SYS_NICE; otherwise nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
    except (AttributeError, OSError):
        pass


_OUTBOXES: dict = {}  # id(pipe end) -> what this process's ranks still have to send through it


def _send_all(conn, outbox) -> None:
    """The sender thread of one pipe: writes what the ranks queued, in order, until None."""
    _favour_this_thread()
    while True:
        message = outbox.get()
        conn.send(message)
        if message is None:
            return


def finish(procs: list, controls: list, timeout: float = 60.0) -> None:
    """Tell every rank to stop, wait for them, and end any that does not."""
    for control in controls:
        try:
            control.send(None)
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.terminate()
