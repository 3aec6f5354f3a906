"""One process per pipeline rank, joined by pipes: PyTorch's pipelining set-up for our executor.

Used by ``bench_vs_torch.py`` (``NAME@procs``) and ``bench_postval.py`` (``--procs``). Each rank
runs in its own spawned process, pinned to its own core before JAX starts (so XLA's threads serve
that rank only), with one CPU device and a
:class:`~zbpp_lite.runtime.executor.PipelineExecutor` for its rank only (``ranks=[r], remote=...``).
Between two ranks (:func:`connect`): arrays (activations, input gradients) are written into a
shared-memory ring per direction by the sending rank's own thread, and only a small notice (where
the array lies, its shape and dtype) goes through the pair's pipe; an optimizer's host values go
through the pipe as they are. A receiver thread per pipe copies the array out of the ring and
hands it to the executor. The parent talks to each rank through a control pipe.

Measured on this project's 2-core machine (``bench_vs_torch.py``'s job, 1f1b, 128 KiB
activations), where a rank waits for the other's output, the time from the producing action's
end to the consumer's start: median 1.09 and 0.93 ms, against 1.29 and 1.14 ms with pickled
arrays written by a sender thread per pipe (two runs each, taking turns; p90 1.5 against
1.9-2.1 ms). What remains is mostly waking the idle rank (0.2 ms for any message on this
virtual machine) and the first JAX call after a rank sat idle (``jax.device_put`` of the
activation: 0.3 ms after 5 ms or more of idling, 0.06 ms when warm).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, NamedTuple

import numpy as np

RING_BYTES = 8 << 20
"""Shared memory per direction between two ranks: room for 64 of the job's activations, where a
step has at most 8 in flight each way (the sender waits if the receiver falls that far behind)."""
_HEADER = 64  # the ring's first bytes: how far the receiver has read (uint64)


def spawn(target: Callable, num_ranks: int, pin_ranks: bool, *args) -> tuple[list, list]:
    """Start ``target(rank, core, peers, control, *args)`` in one spawned process per rank.

    ``core`` is the allowed core the rank is to pin itself to (None without ``pin_ranks``),
    ``peers`` maps every other rank to this rank's end of their link (a pipe and the names of
    the two shared-memory rings, this rank's outgoing one first), ``control`` is the rank's end
    of its control pipe. Returns (processes, the parent's ends of the control pipes); the rings
    live until :func:`finish`.
    """
    import multiprocessing as mp
    from multiprocessing.shared_memory import SharedMemory

    ctx = mp.get_context("spawn")
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    peers: list[dict] = [{} for _ in range(num_ranks)]
    for a in range(num_ranks):
        for b in range(a + 1, num_ranks):
            ab, ba = SharedMemory(create=True, size=RING_BYTES), SharedMemory(create=True, size=RING_BYTES)
            _RINGS.extend((ab, ba))
            end_a, end_b = ctx.Pipe()
            peers[a][b], peers[b][a] = (end_a, ab.name, ba.name), (end_b, ba.name, ab.name)
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
    """Build this rank's executor(s) with a ``remote`` that sends to the other ranks, and start one
    receiver thread per link that hands what arrives to the right executor's ``deliver``.

    ``executor_for(remote)`` builds the executor; or a dict ``{name: executor_for}`` builds
    several (one per schedule, run in turns: each message carries its executor's name, so one
    arriving early for the next schedule's step never reaches the wrong executor). ``remote``
    runs in the rank's own thread and never waits for the other rank: an array is copied into the
    shared-memory ring (:class:`_Ring`) and a notice written to the pipe (a few hundred bytes,
    which the pipe's buffer takes at once); other values are pickled through the pipe. Returns
    the executor, or the dict ``{name: executor}``; :func:`disconnect` ends the receivers.
    """
    import jax

    single = callable(executor_for)
    factories = {None: executor_for} if single else dict(executor_for)
    links = {to: _Link(*link) for to, link in peers.items()}
    _LINKS[id(peers)] = links

    def remote_for(name):
        def remote(to: int, key, value, step: int) -> None:
            if isinstance(value, list) and key[0] in ("F", "B"):  # a pytree activation's leaves
                value = [np.asarray(leaf) for leaf in value]
            links[to].send(name, key, np.asarray(value) if isinstance(value, jax.Array) else value, step, to)

        return remote

    executors = {name: build(remote_for(name)) for name, build in factories.items()}

    def receive(link: "_Link") -> None:
        _favour_this_thread()
        while (message := link.receive()) is not None:
            name, *rest = message
            executors[name].deliver(*rest)

    for link in links.values():
        threading.Thread(target=receive, args=(link,), daemon=True).start()
    return executors[None] if single else executors


def disconnect(peers: dict) -> None:
    """Tell the other ranks' receivers that this rank sends nothing more."""
    for link in _LINKS.pop(id(peers)).values():
        link.close()


def _favour_this_thread() -> None:
    """Give this (mostly sleeping) communication thread a higher priority than the rank's compute
    on the one core the process is pinned to, so a message is taken in at once instead of after
    the compute thread's time slice (Linux; needs the right to lower a nice value: as root, or
    with CAP_SYS_NICE; otherwise nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
    except (AttributeError, OSError):
        pass


class _Ring:
    """One direction's shared-memory ring: one writer (the sending rank), one reader (the other
    rank's receiver thread). Arrays are written at 64-byte-aligned places in turn; the reader
    stores in the header how far it has read, and the writer never overwrites what is unread."""

    def __init__(self, name: str):
        from multiprocessing.shared_memory import SharedMemory

        self.shm = SharedMemory(name=name)  # the parent created it and removes it (finish)
        self.capacity = self.shm.size - _HEADER
        self.read_upto = np.ndarray((1,), np.uint64, self.shm.buf, 0)  # bytes the reader is done with
        self.head = 0  # the writer's count of bytes written (wasted tails included)

    def write(self, value: "np.ndarray") -> tuple:
        size = -(-value.nbytes // 64) * 64
        if size > self.capacity:
            raise ValueError(f"an array of {value.nbytes} bytes does not fit the {self.capacity}-byte ring")
        at = self.head % self.capacity
        if at + size > self.capacity:  # no room before the end: start again at the beginning
            self.head += self.capacity - at
            at = 0
        end = self.head + size
        while end - int(self.read_upto[0]) > self.capacity:  # the reader is a whole ring behind
            time.sleep(1e-4)
        np.ndarray(value.shape, value.dtype, self.shm.buf, _HEADER + at)[...] = value
        self.head = end
        return at, value.shape, value.dtype.str, end

    def read(self, at: int, shape: tuple, dtype: str, end: int) -> "np.ndarray":
        value = np.ndarray(shape, np.dtype(dtype), self.shm.buf, _HEADER + at).copy()
        self.read_upto[0] = end
        return value

    def close(self) -> None:
        self.read_upto = None
        self.shm.close()


class _Link:
    """This rank's end of the link to one other rank: the pair's pipe, the ring it writes and
    the ring it reads."""

    def __init__(self, conn, out_name: str, in_name: str):
        self.conn, self.out, self.inc = conn, _Ring(out_name), _Ring(in_name)
        self.lock = threading.Lock()  # one writer at a time on the pipe and the outgoing ring

    def send(self, name, key, value, step: int, to: int) -> None:
        with self.lock:
            if isinstance(value, np.ndarray) and value.dtype != object:
                self.conn.send((name, key, _InRing(*self.out.write(value)), step, to))
            elif isinstance(value, list) and value and all(isinstance(v, np.ndarray) and v.dtype != object for v in value):
                self.conn.send((name, key, _InRings(tuple(_InRing(*self.out.write(v)) for v in value)), step, to))
            else:
                self.conn.send((name, key, value, step, to))

    def receive(self):
        message = self.conn.recv()
        if message is not None and isinstance(message[2], _InRing):
            name, key, place, *rest = message
            return (name, key, self.inc.read(*place), *rest)
        if message is not None and isinstance(message[2], _InRings):  # several arrays: a list again
            name, key, places, *rest = message
            return (name, key, [self.inc.read(*place) for place in places.places], *rest)
        return message

    def close(self) -> None:
        with self.lock:
            self.conn.send(None)


class _InRing(NamedTuple):
    """A notice: the array lies in the sender's ring at byte ``at`` (after the header)."""

    at: int
    shape: tuple
    dtype: str
    end: int


class _InRings(NamedTuple):
    """A notice for a list of arrays (the leaves of a pytree activation), each in the ring."""

    places: tuple


_LINKS: dict = {}  # id(peers) -> {other rank: _Link}, this process's links
_RINGS: list = []  # the parent's shared memory, removed by finish


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
    while _RINGS:
        ring = _RINGS.pop()
        ring.close()
        ring.unlink()
