"""One process per pipeline rank, each pinned to its own core: the cross-process transport.

As threads of one process, a waiting rank lends its core to the others (XLA's shared pool), so bubbles
cost less than on real devices. Here each rank is a process pinned to one core before JAX starts, with one
CPU device and a :class:`~zbpp_lite.runtime.executor.PipelineExecutor` for its rank (``ranks=[r]``, over
the :class:`Rings` transport): PyTorch pipelining's set-up. Nothing is unpickled: ranks start with
:mod:`subprocess` (``python -m zbpp_lite.runtime.processes``) given JSON; between two ranks (:func:`connect`)
an array goes
through a shared-memory ring per direction with a JSON notice on the pair's socket; the parent talks to
each rank over a control socket (:class:`Channel`, :mod:`~zbpp_lite.runtime.wire`). On the CPU a crossing is
several times faster than through :mod:`.distributed` (``benchmarks/bench_transport.py`` measures both).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, suppress
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable

import numpy as np

from ..schedules import strict_json
from . import wire
from .transport import Threads, from_wire, to_wire

RING_BYTES = 8 << 20
"""Shared memory per direction between two ranks: 64 of the peer job's activations (8 in flight per step)."""
_HEADER = 64  # the ring's first bytes: how far the receiver has read (uint64)
ENV_SPEC = "ZBPP_RANK_SPEC"


class Channel(Connection):
    """A message link to one other process over a socket's file descriptor: ``send(obj)`` / ``recv()``
    one :mod:`~zbpp_lite.runtime.wire` message, never pickled (``place`` / ``fetch``: as there); ``recv``
    raises ``EOFError`` once the other end closed."""

    def send(self, obj: Any, place: Callable | None = None) -> None:
        self.send_bytes(wire.encode(obj, place))

    def recv(self, fetch: Callable | None = None) -> Any:
        return wire.decode(self.recv_bytes(), fetch)


def _pair() -> tuple[int, int]:
    a, b = socket.socketpair()
    return a.detach(), b.detach()


def allowed_cores() -> list[int]:
    """The cores this process may run on (``os.sched_getaffinity``, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class RankFailed(RuntimeError):
    """A rank's process failed: its error, or how it ended (exit status, signal), in one line."""


class PeerGone(ConnectionError):
    """A rank's link to rank ``peer`` is closed (a send met a broken pipe): that rank's process has ended.
    A consequence, never the cause: the rank tells the parent which peer, ends without a traceback, and
    the parent reports how the peer ended."""

    def __init__(self, peer: int):
        super().__init__(f"the link to rank {peer} is closed: its process has ended")
        self.peer = peer


def exit_reason(code: int) -> str:
    """How a child ended: "exited with status 3", "was killed by signal 9 (SIGKILL)"."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = f" ({signal.Signals(-code).name})"
    except ValueError:
        name = ""
    return f"was killed by signal {-code}{name}"


def one_line(e: BaseException) -> str:
    """``"ValueError: its message's first line"``."""
    return f"{type(e).__name__}: {str(e).strip()}".splitlines()[0].rstrip(": ")


def failed(procs: list) -> list[tuple[int, int]]:
    """``(index, exit status)`` of every process of ``procs`` that ended with a non-zero status."""
    return [(i, code) for i, code in enumerate(p.poll() for p in procs) if code not in (None, 0)]


def end_process(proc: subprocess.Popen, group: bool = False) -> None:
    """SIGKILL a child we started (JAX catches SIGTERM), its whole session with ``group``."""
    if proc.poll() is None:
        try:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            proc.kill()
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextmanager
def sigint_ignored_by_children():
    """Children started inside ignore SIGINT from their first instruction (an ignored signal stays ignored
    across ``exec``, and Python then installs no KeyboardInterrupt): Ctrl-C reaches the terminal's whole
    process group, and only the parent, which ends its children, should answer it. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class RankProcesses:
    """``num_ranks`` processes, rank r running ``entry(rank, peers, control, config)``.

    Args:
        entry: ``"package.module:function"`` or ``"path/to/file.py:function"``, imported in the child
            after pinning (it may import JAX at its top).
        num_ranks: processes to start, one per rank (>= 1).
        config: JSON-ready settings handed to every rank.
        pin: pin rank r to the r-th allowed core (modulo their number); ``False`` leaves them free.
        env: extra environment variables for the children (e.g. ``XLA_FLAGS``).

    ``controls[r]`` is the parent's :class:`Channel` to rank r. Use as a context manager or call
    :meth:`close`; leaving on an exception ends the ranks at once.

    Raises:
        ValueError: ``num_ranks`` below 1 or an entry without ``:function``.
    """

    def __init__(self, entry: str, num_ranks: int, config: dict, pin: bool = True, env: dict | None = None):
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
        if ":" not in entry:
            raise ValueError(f"entry must be 'module:function' or 'file.py:function', got {entry!r}")
        cores = allowed_cores()
        self.rings: list = []
        self.procs: list[subprocess.Popen] = []
        self.controls: list[Channel] = []
        links: list[dict] = [{} for _ in range(num_ranks)]
        for a in range(num_ranks):
            for b in range(a + 1, num_ranks):
                ab, ba = (SharedMemory(create=True, size=RING_BYTES) for _ in range(2))
                self.rings += [ab, ba]
                fa, fb = _pair()
                links[a][str(b)] = {"fd": fa, "out": ab.name, "in": ba.name}
                links[b][str(a)] = {"fd": fb, "out": ba.name, "in": ab.name}
        try:
            for r in range(num_ranks):
                mine, theirs = _pair()
                spec = {"entry": entry, "rank": r, "core": cores[r % len(cores)] if pin else None,
                        "control": theirs, "links": links[r], "config": config}
                child_env = {**os.environ, **(env or {}), ENV_SPEC: strict_json.dumps(spec)}
                path = os.pathsep.join(p for p in sys.path if p)
                child_env["PYTHONPATH"] = os.pathsep.join(p for p in (child_env.get("PYTHONPATH"), path) if p)
                command = [sys.executable, "-m", "zbpp_lite.runtime.processes"]
                fds = [theirs, *(link["fd"] for link in links[r].values())]
                with sigint_ignored_by_children():
                    self.procs.append(subprocess.Popen(command, env=child_env, pass_fds=fds,
                                                       stdin=subprocess.DEVNULL))
                os.close(theirs)
                self.controls.append(Channel(mine))
        except BaseException:
            self.close()
            raise
        finally:
            for fd in (link["fd"] for mine in links for link in mine.values()):
                with suppress(OSError):
                    os.close(fd)

    def __enter__(self) -> "RankProcesses":
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(timeout=30.0 if kind is None else 0.0)

    def broadcast(self, obj: Any) -> None:
        """``obj`` to every rank. Raises RankFailed for a rank whose process has ended."""
        for r, control in enumerate(self.controls):
            try:
                control.send(obj)
            except OSError:  # its end is closed: the process has gone
                self._ended(r)

    def gather(self, timeout: float = 600.0) -> list:
        """Every rank's next reply, in rank order, checking every 0.1 s for ended processes (:func:`failed`).

        Raises:
            RankFailed: one line: a rank's error, a rank's process that ended (exit status or signal),
                or ranks silent for ``timeout`` seconds.
        """
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < len(self.controls):
            waiting = {self.controls[r]: r for r in range(len(self.controls)) if r not in replies}
            for conn in wait(list(waiting), 0.1):
                replies[waiting[conn]] = self._reply(waiting[conn])
            for r, code in failed(self.procs):
                if r not in replies and self.controls[r].poll(0):
                    self._reply(r)  # its error, when it sent one before it ended
                raise RankFailed(f"rank {r}'s process {exit_reason(code)}")
            if time.monotonic() > deadline and len(replies) < len(self.controls):
                silent = [r for r in range(len(self.controls)) if r not in replies]
                raise RankFailed(f"rank(s) {', '.join(map(str, silent))} sent nothing within {timeout:g} s")
        return [replies[r] for r in range(len(self.controls))]

    def _reply(self, r: int) -> Any:
        try:
            reply = self.controls[r].recv()
        except (EOFError, OSError):  # closed, or reset by a killed process
            self._ended(r)
        if isinstance(reply, dict) and "error" in reply:
            peer = reply.get("peer")
            if isinstance(peer, int) and 0 <= peer < len(self.procs):  # the cause is how the peer ended
                with suppress(subprocess.TimeoutExpired):
                    code = self.procs[peer].wait(2.0)
                    raise RankFailed(f"rank {peer}'s process {exit_reason(code)}")
            raise RankFailed(f"rank {r}: {reply['error']}")
        return reply

    def _ended(self, r: int) -> None:
        """Raise RankFailed for rank ``r``, whose control link is closed: how its process ended."""
        try:
            code = self.procs[r].wait(2.0)
        except subprocess.TimeoutExpired:
            raise RankFailed(f"rank {r}'s process closed its control link but still runs") from None
        raise RankFailed(f"rank {r}'s process {exit_reason(code)}")

    def close(self, timeout: float = 30.0) -> None:
        """Stop every rank (waiting ``timeout`` s each, then SIGKILL) and remove the shared memory."""
        for control in self.controls:
            with suppress(OSError):
                control.send(None)
        for proc in self.procs:
            if timeout > 0:
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout)
            end_process(proc)
        for control in self.controls:
            control.close()
        self.controls = []
        while self.rings:
            ring = self.rings.pop()
            ring.close()
            ring.unlink()


class Rings(Threads):
    """The :class:`~zbpp_lite.runtime.transport.Transport` of one rank per process on this machine: a value
    for a rank of this process goes into its inbox (:class:`~zbpp_lite.runtime.transport.Threads`), one for
    another rank through the pair's link (its array into the shared-memory ring, a JSON notice on the
    socket), never waiting; :func:`connect`'s receiver threads :meth:`arrive` what comes in. ``name``
    tells apart executors run in turns over one set of links."""

    def __init__(self, name: str | None, links: dict):
        super().__init__()
        self.name, self.links = name, links

    def send(self, step: int, rank: int, key, value) -> None:
        link = self.links.get(rank)
        if link is None:
            super().send(step, rank, key, value)
        else:
            link.send(self.name, key, value, step, rank)

    def arrive(self, key, value, step: int, rank: int) -> None:
        """What another process sent this process's rank ``rank``. Raises ValueError: a rank not here."""
        if rank in self.links or not isinstance(rank, int):
            raise ValueError(f"a message {key} for rank {rank}, which is not a rank of this process")
        super().send(step, rank, key, value)


def connect(peers: dict, executor_for):
    """Build this rank's executor(s) over a :class:`Rings` transport reaching the other ranks, and start
    one receiver thread per link handing what arrives to the right transport.

    ``peers``: what the rank's entry was given. ``executor_for(transport)`` builds the executor, or a dict
    ``{name: executor_for}`` several (run in turns; messages carry the name). Returns the executor or
    ``{name: executor}``; :func:`disconnect` ends the receivers.
    """
    single = callable(executor_for)
    factories = {None: executor_for} if single else dict(executor_for)
    links = {int(to): _Link(link["fd"], link["out"], link["in"]) for to, link in peers.items()}
    _LINKS[id(peers)] = links
    transports = {name: Rings(name, links) for name in factories}
    executors = {name: build(transports[name]) for name, build in factories.items()}

    def receive(link: "_Link") -> None:
        with suppress(AttributeError, OSError):  # above the rank's compute (Linux, CAP_SYS_NICE)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        while (message := link.receive()) is not None:
            name, *rest = message
            transports[name].arrive(*rest)

    for link in links.values():
        threading.Thread(target=receive, args=(link,), daemon=True).start()
    return executors[None] if single else executors


def disconnect(peers: dict) -> None:
    """Tell the other ranks' receivers that this rank sends nothing more."""
    for link in _LINKS.pop(id(peers)).values():
        link.close()


class _Ring:
    """One direction's shared-memory ring, one writer and one reader: 64-byte-aligned arrays in turn; the
    header holds how far the reader got, and the writer never overwrites what is unread."""

    def __init__(self, name: str):
        self.shm = SharedMemory(name=name)  # the parent created it and removes it (RankProcesses.close)
        with suppress(Exception):  # Python < 3.13 registers attached memory too, removed when this rank ends
            resource_tracker.unregister(self.shm._name, "shared_memory")  # noqa: SLF001
        self.capacity = self.shm.size - _HEADER
        self.read_upto = np.ndarray((1,), np.uint64, self.shm.buf, 0)  # bytes the reader is done with
        self.head = 0  # the writer's count of bytes written (wasted tails included)

    def write(self, value: np.ndarray) -> list:
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
        return [at, list(value.shape), value.dtype.str, end]

    def read(self, place: list) -> np.ndarray:
        at, shape, dtype, end = place
        value = np.ndarray(tuple(shape), np.dtype(dtype), self.shm.buf, _HEADER + at).copy()
        self.read_upto[0] = end
        return value

    def close(self) -> None:
        self.read_upto = None
        self.shm.close()


class _Link:
    """This rank's end of a link: the pair's socket, the ring it writes and the ring it reads."""

    def __init__(self, fd: int, out: str, inbound: str):
        self.channel = Channel(fd)
        self.out, self.inc = _Ring(out), _Ring(inbound)
        self.lock = threading.Lock()  # one writer at a time on the socket and the outgoing ring

    def send(self, name, key, value, step: int, to: int) -> None:
        """A JSON notice on the socket; the arrays in ``value`` (a JAX one to host memory first) go into
        the ring."""
        with self.lock:
            message = {"name": name, "key": to_wire(key), "step": step, "to": to, "value": value}
            try:
                self.channel.send(message, self.out.write)
            except (BrokenPipeError, ConnectionResetError) as e:
                raise PeerGone(to) from e

    def receive(self):
        try:
            message = self.channel.recv(self.inc.read)
        except (EOFError, OSError):
            return None
        if message is None:
            return None
        return message["name"], from_wire(message["key"]), message["value"], message["step"], message["to"]

    def close(self) -> None:
        with self.lock, suppress(OSError):
            self.channel.send(None)


_LINKS: dict = {}  # id(peers) -> {other rank: _Link}, this process's links


def _load(entry: str) -> Callable:
    where, _, function = entry.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, function)


def _main() -> None:
    spec = json.loads(os.environ.pop(ENV_SPEC))
    if spec["core"] is not None and hasattr(os, "sched_setaffinity"):  # before JAX starts its threads
        os.sched_setaffinity(0, {spec["core"]})
    control = Channel(spec["control"])
    try:
        _load(spec["entry"])(spec["rank"], spec["links"], control, spec["config"])
    except EOFError:  # the parent closed the control link: it has gone, nobody waits for an answer
        print(f"rank {spec['rank']}: the parent process has gone; ending", file=sys.stderr)
        sys.exit(1)
    except BaseException as e:  # the parent hears why, then the traceback goes to stderr
        gone = next((c for c in _chain(e) if isinstance(c, PeerGone)), None)
        with suppress(OSError):
            control.send({"error": one_line(gone or e), **({"peer": gone.peer} if gone else {})})
        if gone is not None:  # a consequence of another rank's end, which the parent reports: no traceback
            sys.exit(1)
        raise


def _chain(e: BaseException):
    """``e`` and the exceptions it was raised from or during, innermost last."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


if __name__ == "__main__":  # the package's own module, not this __main__ copy: one PeerGone, one _LINKS
    from zbpp_lite.runtime.processes import _main as main

    main()
