"""Joining a run on several hosts: addresses, cluster detection, the runtime's failures in one line.

Process 0 of 0..N-1 hosts JAX's coordination service at ``HOST:PORT``; each process listens for
cross-host transfers on its own ``HOST:PORT``. Without addresses JAX detects the cluster (Cloud TPU,
SLURM, Open MPI, Kubernetes); :func:`detect_cluster` says which before JAX starts. JAX ends a process on
a fatal coordination error (``LOG(FATAL)``); :func:`explain_runtime_failure` names the cause in one line
(for :mod:`zbpp_lite.cli.join`).

Layer 2 (runtime); no JAX import.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
import time
from typing import Mapping

from .devices import cpu_device_flags

JOIN_ENV = {"coordinator": "ZBPP_COORDINATOR", "num_processes": "ZBPP_NUM_PROCESSES",
            "process_id": "ZBPP_PROCESS_ID", "transfer_address": "ZBPP_TRANSFER_ADDRESS",
            "timeout": "ZBPP_TIMEOUT", "heartbeat": "ZBPP_HEARTBEAT"}
"""The join settings (``train``'s flags' names) -> the variable ``launch`` and ``join`` hand each child."""
_TYPES = {"num_processes": int, "process_id": int, "timeout": float, "heartbeat": float}


def child_env(settings: Mapping, rank_devices: int | None = None) -> dict:
    """This environment with ``settings`` (:data:`JOIN_ENV`'s keys; None: unset) as ``ZBPP_*`` variables
    and, with ``rank_devices``, that many CPU devices plus one receiving transfers when there are several
    processes (:func:`~zbpp_lite.runtime.distributed.staging_device`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key, name in JOIN_ENV.items():
        if settings.get(key) is None:
            env.pop(name, None)
        else:
            env[name] = str(settings[key])
    if rank_devices is not None:
        extra = settings["num_processes"] > 1
        env["XLA_FLAGS"] = cpu_device_flags(rank_devices + extra, current=env.get("XLA_FLAGS", ""))
    return env


def join_settings() -> dict:
    """The settings :func:`child_env` handed this process, typed; None where unset."""
    return {key: _TYPES.get(key, str)(os.environ[name]) if os.environ.get(name) else None
            for key, name in JOIN_ENV.items()}


def parse_address(text: str, what: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(HOST, PORT)``; ``[v6]:PORT`` too.

    Raises:
        ValueError: no port, a port outside 1..65535, or an empty host; the message names ``what``
            (the flag) and the form wanted.
    """
    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT with a port in 1..65535, e.g. 10.0.0.1:4321; got "
                         f"{text!r}")
    return host, int(port)


def detect_cluster(env: Mapping[str, str] | None = None) -> str | None:
    """The multi-process cluster ``jax.distributed.initialize()`` would detect, from the environment
    (the variables of ``jax._src.clusters``, JAX 0.4-0.10): ``"slurm"`` (``SLURM_NTASKS`` > 1),
    ``"ompi"`` (``OMPI_COMM_WORLD_SIZE`` > 1), ``"tpu"`` (``TPU_WORKER_HOSTNAMES`` or
    ``TPU_PROCESS_ADDRESSES``), ``"k8s"`` (``KUBERNETES_SERVICE_HOST`` and ``JOB_COMPLETION_INDEX``),
    ``"jax"`` (``JAX_COORDINATOR_ADDRESS``); else ``None`` (a one-task job too).
    """
    env = os.environ if env is None else env

    def count(name: str) -> int:
        try:
            return int(env.get(name, "0"))
        except ValueError:
            return 0

    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm) and count("SLURM_NTASKS") > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and count("OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    workers = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([w for w in workers.split(",") if w.strip()]) > 1:
        return "tpu"
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        return "k8s"
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "jax"
    return None


def address_towards(host: str, port: int = 9) -> str:
    """This host's address on the route to ``host`` (no packet sent); ``127.0.0.1`` without a route."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bind_error(host: str, port: int) -> OSError | None:
    """Why this host cannot listen on ``host:port`` now (None: it can)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def check_bindable(host: str, port: int, what: str) -> None:
    """Raise RuntimeError in one line when this host cannot listen on ``host:port`` (in use, or
    not an address of this host): ``what`` names the flag."""
    e = _bind_error(host, port)
    if e is not None:
        raise RuntimeError(f"{what} {port} on {host} cannot be listened on here ({e.strerror}): "
                           f"give a free port on one of this host's own addresses")


def listen_address(host: str, port: int, what: str) -> str:
    """``"HOST:PORT"`` to listen on for the address ``host:port`` the other processes are given: that
    address where it is one of this host's own (a name resolved), so no other interface is open; every
    interface (``[::]``) where it is not (e.g. an address a NAT forwards here).

    Raises:
        RuntimeError: one line naming ``what`` and the port, which is in use.
    """
    try:
        ip = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError):
        ip = None
    if ip is not None and ipaddress.ip_address(ip).is_loopback and not _names_loopback(host):
        ip = None  # a name this host maps to loopback (Debian's 127.0.1.1): the others reach it elsewhere
    e = _bind_error(ip, port) if ip is not None else None
    if ip is not None and e is None:
        return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    if e is not None and e.errno != errno.EADDRNOTAVAIL:
        check_bindable(ip, port, what)  # in use, or not allowed: raises, naming it
    check_bindable("0.0.0.0", port, what)
    return f"[::]:{port}"


def _names_loopback(host: str) -> bool:
    """``host`` is a loopback address or ``localhost`` itself (a run on one machine), not a name."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def wait_for_coordinator(host: str, port: int, timeout: float, process: int | None = None) -> float:
    """Wait until a TCP connection to the coordinator ``host:port`` succeeds; returns the seconds
    waited (it may start after this process).

    Raises:
        RuntimeError: none succeeded within ``timeout`` seconds; one line naming the address.
    """
    t0 = time.monotonic()
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(timeout, 0.1))):
                return time.monotonic() - t0
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() - t0 > timeout:
            who = f"process {process}: " if process is not None else ""
            raise RuntimeError(f"{who}coordinator {host}:{port} unreachable for {timeout:g} s ({last}): "
                               f"start process 0 there, or check --coordinator and the firewall")
        time.sleep(0.25)


_UNHEALTHY = re.compile(r"tasks are unhealthy[^\n]*:\s*\n?\s*([\d,\s]+)", re.S)


_TRANSFER_CODE = re.compile(r"((?:socket-server|socket_bulk_transport)\.cc:\d+)\]\s*([^\n]*)")


def explain_runtime_failure(text: str, process: int | None, coordinator: str | None,
                            num_processes: int | None = None, timeout: float | None = None,
                            transfer_address: str | None = None) -> str | None:
    """One line naming why JAX's runtime ended a process (``text``: its stderr; a message its transfer
    listener could not take, lost process or coordinator, duplicate or unexpected process id, registration
    timeout, else the status line), or ``None`` when ``text`` shows no fatal runtime error (JAX 0.4-0.10's
    messages)."""
    if "Terminating process because the JAX distributed service" not in text and "Check failure" not in text \
            and "CoordinationService" not in text:
        return None
    me = f"process {process}" if process is not None else "this process"
    who = f" (coordinator {coordinator})" if coordinator else ""
    transfer = _TRANSFER_CODE.search(text)
    if transfer:
        port = f" {transfer_address}" if transfer_address else ""
        return (f"{me}: JAX ended it on a message to its transfer port{port} that it could not take "
                f"({transfer.group(1)}: {transfer.group(2).strip()[:80]}): most likely an unexpected client "
                "(a port scanner? another run?) reached that port; these ports belong on a trusted cluster "
                "network (README 'Several hosts: trust')")
    lost = _UNHEALTHY.search(text)
    if lost:
        ids = sorted({int(t) for t in re.findall(r"\d+", lost.group(1))} - {process})
        if ids:
            names = ", ".join(f"process {i}" for i in ids)
            return (f"{me}: lost {names} (no heartbeat from it{'s' if len(ids) > 1 else ''}): ending this "
                    "process too")
    if "ALREADY_EXISTS" in text and "RegisterTask" in text or "newer incarnation" in text:
        return (f"{me}: duplicate process id: another process registered as process {process} with the "
                f"coordinator{who}; give every process its own --process-id in 0..N-1")
    unexpected = ("INVALID_ARGUMENT", "Unexpected task", "out of range")
    if "RegisterTask" in text and any(w in text for w in unexpected):
        return (f"{me}: the coordinator{who} does not expect process {process}: --num-processes differs "
                f"between processes (this one says {num_processes}); give every process the same count")
    if "RegisterTask" in text and "DEADLINE_EXCEEDED" in text:
        t = f" within {timeout:g} s" if timeout else ""
        return (f"{me}: not every process registered with the coordinator{who}{t}: a process is missing, "
                f"or was started with another --num-processes ({num_processes} here) or a duplicate "
                "--process-id")
    gone = ("UNAVAILABLE", "Socket closed", "Connection reset", "failed to connect")
    if re.search(r"(Heartbeat|PollForError|GetKeyValue|Barrier)", text) and any(w in text for w in gone):
        if process != 0:
            return (f"{me}: lost process 0, the coordinator{who} (its service stopped answering): ending "
                    "this process too")
    status = re.search(r"absl::Status: ([^\n]+)", text)
    line = status.group(1) if status else next((x for x in text.splitlines() if x.startswith("F")),
                                               text.strip().splitlines()[-1])
    return f"{me}: JAX's distributed runtime ended it: {line.strip()[:300]}"
