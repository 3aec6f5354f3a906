"""The executor across processes (MPMD on JAX's multi-controller runtime).

Each process starts JAX's distributed runtime (:func:`initialize`), sees every process's devices
(``jax.devices()``) and runs the actions of the ranks whose devices it owns
(:class:`ProcessPipelineExecutor`, the threads of :class:`~zbpp_lite.runtime.executor.PipelineExecutor`
for its own ranks only). Values between ranks of one process move as before; values between
processes move with ``jax.device_put`` onto the other process's device, JAX's cross-host transfer
over sockets (``jax_cross_host_transfer_socket_address``, one explicit port per process: a port of
0 was seen to hang the receiver).

JAX pairs a cross-host ``device_put`` on the sending process with the same call on the receiving
process (a placeholder array on the sender's device, no local data); a sender blocks until its
receiver calls, and the transfers of two processes are matched in the order they are issued
(both directions together: issued from two threads they were seen to mismatch and lose data).
So each process issues all its transfers from one thread, walking :func:`transfer_plan`, the
transfers sorted by where their producing action stands in
:func:`zbpp_lite.schedules.validate.execution_order` (a topological order of the whole schedule, the same on
every process): a transfer waits only on actions earlier in that order, hence on earlier
transfers, so the thread cannot deadlock. A receiver posts its half only once the sender has said
(through the runtime's key-value store) that the value exists, and receives on a device of its own
(:func:`staging_device`). Rank threads never block on a send.

After the step, losses, gradients and measured events are exchanged through the runtime's
key-value store, so every process returns the whole :class:`~zbpp_lite.runtime.executor.StepResult`.
Each process's event times are measured from its own start of the step (clocks are not aligned).

Failure, not hang: every wait has a timeout (the executor's per-input timeout, the transfer
timeout, the runtime's initialisation and heartbeat timeouts); an error names the process and
rank, and :mod:`zbpp_lite.cli.launch` ends every child when one fails. The child's training loop
is :mod:`zbpp_lite.cli.launch_child` (the command line sits above this layer).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence

import numpy as np

from ..schedules.ir import Action, Schedule, parts, produces
from ..schedules.validate import execution_order

ENV_COORDINATOR = "ZBPP_COORDINATOR"
ENV_NUM_PROCESSES = "ZBPP_NUM_PROCESSES"
ENV_PROCESS_ID = "ZBPP_PROCESS_ID"
ENV_TRANSFER_PORT = "ZBPP_TRANSFER_PORT"
ENV_TIMEOUT = "ZBPP_TIMEOUT"
ENV_TRANSFER_ADDRESS = "ZBPP_TRANSFER_ADDRESS"
ENV_HEARTBEAT = "ZBPP_HEARTBEAT"
"""Environment the launcher gives each child; a cluster launcher may leave the first three out
and let ``jax.distributed.initialize()`` detect them (SLURM, Open MPI, TPU pods)."""


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    transfer_port: int | None = None,
    timeout: float = 60.0,
    host: str = "127.0.0.1",
    transfer_address: str | None = None,
    heartbeat: float | None = None,
) -> tuple[int, int]:
    """Start JAX's distributed runtime for this process; returns (process index, process count).

    Args:
        coordinator: ``"HOST:PORT"`` of process 0's coordination service.
        num_processes, process_id: N and this process's index in 0..N-1.
        transfer_port: this process's cross-host transfer port on ``host`` (``launch``'s form).
        transfer_address: ``"HOST:PORT"`` this process listens on for cross-host transfers
            (``jax_cross_host_transfer_socket_address``); wins over ``transfer_port``. Default:
            this host's address towards the coordinator (:func:`~zbpp_lite.runtime.cluster.address_towards`)
            and a free port.
        timeout: seconds registration, the coordinator's first answer, each cross-host transfer,
            and the roll call may take.
        heartbeat: seconds without a heartbeat after which JAX declares a process lost and ends
            the others (default ``max(timeout, 10)``).

    Arguments default to the ``ZBPP_*`` environment (``launch`` and ``train --coordinator`` set
    it); with no coordinator at all, ``jax.distributed.initialize()`` detects the cluster (SLURM,
    Open MPI, Cloud TPU, Kubernetes). Must run before JAX starts its backend. Before registering,
    a process other than 0 waits (``timeout``) for the coordinator to accept connections, and
    process 0 checks it can listen on the port; after registering, every process compares its
    process count with process 0's through the key-value store (the roll call), before the
    backend's own exchange, which would wait on a process that never comes. Sets, on CPU, gloo
    collectives.

    Raises:
        RuntimeError: one line naming this process and the cause: coordinator unreachable, its
            port not free here, a process count differing from process 0's, or the runtime not
            starting. (Registration failures inside JAX end the process from C++ instead; the
            ``train`` supervisor, :mod:`zbpp_lite.cli.join`, names their cause.)
    """
    import jax

    from .cluster import address_towards, check_bindable, free_port, parse_address, wait_for_coordinator

    env = os.environ
    coordinator = coordinator or env.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _int_env(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _int_env(ENV_PROCESS_ID)
    transfer_port = transfer_port if transfer_port is not None else _int_env(ENV_TRANSFER_PORT)
    transfer_address = transfer_address or env.get(ENV_TRANSFER_ADDRESS) or None
    heartbeat = heartbeat if heartbeat is not None else _float_env(ENV_HEARTBEAT)
    heartbeat = int(max(heartbeat if heartbeat else max(timeout, 10), 1))
    me = f"process {process_id if process_id is not None else '?'}"
    if transfer_address:
        parse_address(transfer_address, "the transfer address")
    elif transfer_port:
        transfer_address = f"{host}:{transfer_port}"
    if coordinator:
        c_host, c_port = parse_address(coordinator, "--coordinator")
        if process_id == 0:
            check_bindable("0.0.0.0", c_port, f"{me}: the coordinator port")
        else:
            wait_for_coordinator(c_host, c_port, timeout, process_id)
    jax.config.update("jax_cross_host_transfer_timeout_seconds", int(max(timeout, 1)))
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # pragma: no cover - a JAX without the option
        pass
    try:
        options = {"initialization_timeout": int(max(timeout, 1)), "heartbeat_timeout_seconds": heartbeat,
                   "shutdown_timeout_seconds": int(max(timeout, 1))}
        try:
            jax.distributed.initialize(coordinator, num_processes, process_id, **options)
        except TypeError as e:  # an older JAX without the shutdown timeout: its own default then
            if "shutdown_timeout_seconds" not in str(e):
                raise
            del options["shutdown_timeout_seconds"]
            jax.distributed.initialize(coordinator, num_processes, process_id, **options)
    except Exception as e:  # noqa: BLE001 - re-raised with the process named
        raise RuntimeError(
            f"{me} of {num_processes}: JAX's distributed runtime did not start "
            f"(coordinator {coordinator}): {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from e
    from jax._src import distributed as _dist

    state = _dist.global_state
    process_id = state.process_id if process_id is None else process_id
    num_processes = state.num_processes if num_processes is None else num_processes
    if not transfer_address:  # a detected cluster: the address towards the coordinator it found
        c_host = parse_address(state.coordinator_address, "the coordinator address")[0]
        mine = address_towards(c_host)
        transfer_address = f"{mine}:{free_port(mine)}"
    jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
    roll_call(process_id, num_processes, timeout, transfer_address)
    return process_id, num_processes


def roll_call(process: int, num_processes: int, timeout: float, transfer_address: str = "") -> list[dict]:
    """Every process's ``{"process", "num_processes", "host", "transfer_address"}`` through the
    key-value store, checked against process 0's before JAX's backend starts; returns the list
    in process order.

    Raises:
        RuntimeError: one line: this process's count differs from process 0's, or a process did
            not answer within ``timeout`` seconds (named)."""
    import socket

    from . import wire

    client = _client()
    mine = {"process": process, "num_processes": num_processes, "host": socket.gethostname(), "transfer_address": transfer_address}
    client.key_value_set_bytes(f"zbpp/roll/{process}", wire.encode(mine))
    out, problem = [], None
    for q in range(num_processes):
        try:
            entry = wire.decode(client.blocking_key_value_get_bytes(f"zbpp/roll/{q}", int(timeout * 1000)))
        except Exception as e:  # noqa: BLE001
            problem = (f"process {process}: process {q} did not answer the roll call within {timeout:g} s "
                       f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})")
            break
        if entry.get("num_processes") != num_processes:
            problem = (f"process {process}: mismatched process counts: this process was started with --num-processes "
                       f"{num_processes}, process {q} (on {entry.get('host')}) with {entry.get('num_processes')}; give every process the same N")
            break
        out.append(entry)
    client.key_value_set(f"zbpp/roll/checked/{process}", "1")
    if problem is not None and process == 0:
        # process 0 hosts the service: leaving at once would end the others with "lost the
        # coordinator" before they name the mismatch themselves; wait (bounded) for their verdicts
        for q in range(1, num_processes):
            try:
                client.blocking_key_value_get(f"zbpp/roll/checked/{q}", int(min(timeout, 5.0) * 1000))
            except Exception:  # noqa: BLE001 - that process is not there: nothing to wait for
                pass
        time.sleep(1.0)  # their one line is printed after their verdict
    if problem is not None:
        raise RuntimeError(problem)
    return out


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def _float_env(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else None


def pipeline_devices(num_ranks: int) -> list:
    """One global device per rank, ranks spread evenly over the processes in order: rank r on
    process ``r * N // p`` (N processes), each process's ranks on its local devices in order;
    with several processes each keeps its last device for receiving (:func:`staging_device`).

    Raises:
        ValueError: more processes than ranks (a process would hold no rank), or a process with
            fewer devices than the ranks it must hold.
    """
    import jax

    n = jax.process_count()
    spare = 1 if n > 1 else 0  # each process's last device receives transfers (staging_device)
    if n > num_ranks:
        raise ValueError(f"{n} processes but only {num_ranks} ranks: every process needs at least one rank; use --processes <= --ranks")
    devices = []
    for r in range(num_ranks):
        proc = r * n // num_ranks
        local = [d for d in jax.devices() if d.process_index == proc]
        local = local[: len(local) - spare]
        index = sum(1 for q in range(r) if q * n // num_ranks == proc)
        if index >= len(local):
            raise ValueError(f"process {proc} has {len(local)} device(s) but must hold {index + 1} or more ranks; raise --devices-per-process")
        devices.append(local[index])
    return devices


def staging_device(process: int):
    """The device of ``process`` that receives its cross-process transfers: its last local one,
    never a rank's. A cross-host receive waits in its device's queue until the data comes; on a
    rank's own device it would hold up that rank's computations, and two such waits, one per
    process, each ahead of the send the other needs, never end. The received value then moves
    to the rank's device locally. (On CPU the launcher asks for one more device per process.)"""
    import jax

    return [d for d in jax.devices() if d.process_index == process][-1]


def transfer_plan(schedule: Schedule, owner: Sequence[int]) -> list[tuple[Action, int, int, int, int]]:
    """Cross-process transfers of one step as (producing action, producer rank, consumer stage,
    sending process, receiving process), in :func:`execution_order` order (the same list on every
    process). ``owner[rank]`` is the process of each rank.

    JAX matches a process's cross-host transfers with its peer's in the order they are issued, in
    both directions together, so each process issues its transfers (sends and receives) from one
    thread in this order; a transfer waits only on actions earlier in a topological order, hence
    on earlier transfers, so no process waits on a later one."""
    plan = []
    S = schedule.num_stages
    for rank, step in execution_order(schedule):
        for a in parts(schedule.actions[rank][step]):  # a pair: its forward's, then its backward's
            if a.kind == "F" and a.stage < S - 1:
                consumer = a.stage + 1
            elif a.kind in ("B", "BW") and a.stage > 0:
                consumer = a.stage - 1
            else:
                continue
            src, dst = owner[rank], owner[schedule.placement[consumer]]
            if src != dst:
                plan.append((a, rank, consumer, src, dst))
    return plan


class _Stop(Exception):
    """The step was aborted elsewhere; the transfer thread stops quietly."""


class _Outbox:
    """Values a process's ranks hand to its sender threads, keyed like ``produces``."""

    def __init__(self, abort: threading.Event):
        self.items: dict = {}
        self.cond = threading.Condition()
        self.abort = abort

    def put(self, key, value) -> None:
        with self.cond:
            self.items[key] = value
            self.cond.notify_all()

    def take(self, key, timeout: float):
        deadline = time.perf_counter() + timeout
        with self.cond:
            while key not in self.items:
                left = deadline - time.perf_counter()
                if self.abort.is_set() or left <= 0:
                    return None
                self.cond.wait(min(left, 0.5))
            return self.items.pop(key)


class _CrossProcess:
    """The transport of :class:`ProcessPipelineExecutor` (:mod:`zbpp_lite.runtime.transport`):
    to a rank of this process straight into its inbox (``put``), to a rank of another process
    into the outbox, from which this process's transfer thread moves it in
    :func:`transfer_plan`'s order."""

    def __init__(self, put, owner: Sequence[int], process: int, outbox: _Outbox):
        self.put, self.owner, self.process, self.outbox = put, owner, process, outbox

    def send(self, step, rank: int, key, value) -> None:
        if self.owner[rank] == self.process:
            self.put(step, key, value, rank)
        else:
            self.outbox.put(key.key, value)


def _executor_base():
    from .executor import PipelineExecutor

    return PipelineExecutor


class ProcessPipelineExecutor(_executor_base()):
    """:class:`~zbpp_lite.runtime.executor.PipelineExecutor` for one process of a multi-process run.

    Args:
        model, schedule, timeout: as the executor's.
        devices: one global device per rank (default :func:`pipeline_devices`); this process
            runs the ranks whose devices it owns.

    :meth:`run` has the executor's signature and result; every process must call it with the
    same arguments (same parameters and batch), as multi-controller JAX programs do.

    Raises:
        RuntimeError: (from :meth:`run`) an action failed or a transfer did not complete; the
            message names the process and the rank. TimeoutError: a rank waited past ``timeout``.
    """

    def __init__(self, model, schedule: Schedule, devices: Sequence[Any] | None = None, timeout: float = 60.0):
        import jax

        devices = list(devices) if devices is not None else pipeline_devices(schedule.num_ranks)
        super().__init__(model, schedule, devices, timeout)
        self.process = jax.process_index()
        self.num_processes = jax.process_count()
        self.owner = [d.process_index for d in self.devices]
        self.local_ranks = [r for r in range(schedule.num_ranks) if self.owner[r] == self.process]
        self.plan = transfer_plan(schedule, self.owner)
        self.staging = {q: staging_device(q) for q in range(self.num_processes)}
        self._step_count = 0
        self._outbox: _Outbox | None = None

    # ------------------------------------------------------------------ the step

    def run(self, params, x, labels):
        import jax

        from .executor import StepResult, _Step
        from .transport import Inbox
        from .stages import refuse_pytree_activations
        from ..schedules.timeline import Event, Timeline

        S, m = self.model.num_stages, self.schedule.num_microbatches
        mb = self.microbatch_size(x, labels)
        x, labels = np.asarray(x), np.asarray(labels)
        local = [self.owner[self.schedule.placement[s]] == self.process for s in range(S)]
        stage_params = [jax.device_put(self.model.stage_params(params, s), self.stage_devices[s]) if local[s] else None for s in range(S)]
        leaves = [tuple(jax.tree_util.tree_leaves(p)) if p is not None else None for p in stage_params]
        x_mb, y_mb = x[:mb], labels[:mb]
        inputs = jax.device_put([x[j * mb : (j + 1) * mb] for j in range(m)], self.stage_devices[0]) if local[0] else None
        ys = jax.device_put([labels[j * mb : (j + 1) * mb] for j in range(m)], self.stage_devices[-1]) if local[-1] else None
        refuse_pytree_activations(self.model, x_mb, "ProcessPipelineExecutor (JAX's distributed runtime)")
        shapes = self.model.stage_inputs(x_mb)
        splits = [self.model.split_stage(s, shapes[s], y_mb) if local[s] else None for s in range(S)]
        seed = jax.device_put(np.float32(1.0 / m), self.stage_devices[-1]) if local[-1] else None
        abort = threading.Event()
        step = _Step(
            params=leaves, acc=[None] * S, inputs=inputs, labels=ys, splits=splits, seed=seed,
            inboxes=[Inbox(r, abort) for r in range(self.schedule.num_ranks)],
            t0=0.0, store={}, losses={}, events=[],
        )
        self._outbox = _Outbox(abort)
        self.transport = _CrossProcess(self._put, self.owner, self.process, self._outbox)
        errors: list = []
        movers = self._transfer_threads(step, shapes, abort, errors)
        threads = [
            threading.Thread(target=self._rank_steps, args=(r, [step], None, abort, errors), name=f"zbpp-rank-{r}", daemon=True)
            for r in self.local_ranks
        ]
        step.t0 = time.perf_counter()
        for t in threads + movers:
            t.start()
        for t in threads:
            t.join()
        deadline = time.perf_counter() + self.timeout
        for t in movers:
            t.join(max(0.0, deadline - time.perf_counter()))
        stuck = [t.name for t in movers if t.is_alive()]
        if stuck and not errors:
            errors.append((self.local_ranks[0], None, TimeoutError(f"transfers {', '.join(stuck)} did not finish within {self.timeout:g} s")))
        try:
            self._raise_first(errors)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"process {self.process}: {e}") from e
        # this process's share, then everyone's, through the runtime's key-value store
        mine = {
            "losses": [[j, float(v)] for j, v in step.losses.items()],
            "grads": [[s, [np.asarray(g) for g in step.acc[s]]] for s in range(S) if local[s]],
            "events": [[e.rank, str(e.action), e.start, e.end] for e in step.events],
        }
        shares = _exchange(f"zbpp/step{self._step_count}", mine, self.process, self.num_processes, self.timeout)
        self._step_count += 1
        self._sent = []  # every process has its values now: the sent buffers may go
        losses_by_mb, grads, events = {}, [None] * S, []
        for share in shares:
            losses_by_mb.update((int(j), v) for j, v in share["losses"])
            for s, g in share["grads"]:
                template = self.model.stage_params(self.model.params, s)
                grads[s] = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), g)
            events += [Event(r, Action.from_str(a), t0, t1) for r, a, t0, t1 in share["events"]]
        losses = tuple(losses_by_mb[j] for j in range(m))
        timeline = Timeline.from_events(events, self.schedule.num_ranks, num_stages=S, source="measured")
        return StepResult(float(np.mean(np.asarray(losses, np.float64))), losses, self.model.join_stage_params(grads), timeline)

    # ------------------------------------------------------------------ transfers

    def _ready_key(self, a: Action) -> str:
        return f"zbpp/step{self._step_count}/ready/{a}"

    def _transfer_threads(self, step, shapes, abort: threading.Event, errors: list) -> list:
        import jax

        single = jax.sharding.SingleDeviceSharding
        keep = self._sent = []

        def send(a, rank, consumer, dst):
            value = self._outbox.take(produces(a)[0], self.timeout)
            if value is None:
                if abort.is_set():
                    raise _Stop()
                raise TimeoutError(f"rank {rank} produced no {a} within {self.timeout:g} s")
            _client().key_value_set(self._ready_key(a), "1")  # the receiver may now post its half
            moved = jax.device_put(value, single(self.staging[dst]))
            jax.block_until_ready(moved)
            keep.append((value, moved))  # the send may still read the buffer: keep it to the step's end

        def receive(a, rank, consumer, src):
            try:
                _client().blocking_key_value_get(self._ready_key(a), int(self.timeout * 1000))
            except Exception as e:  # noqa: BLE001
                raise TimeoutError(f"rank {rank} on process {src} did not produce {a} within {self.timeout:g} s ({e})") from None
            shape = shapes[consumer] if a.kind == "F" else shapes[a.stage]
            placeholder = jax.make_array_from_single_device_arrays(tuple(shape.shape), single(self.devices[rank]), [], dtype=shape.dtype)
            moved = jax.device_put(placeholder, single(self.staging[self.process])).addressable_data(0)
            step.inboxes[self.schedule.placement[consumer]].put(produces(a)[0], jax.device_put(moved, self.stage_devices[consumer]))

        def move():
            a = rank = None
            try:
                for a, rank, consumer, src, dst in self.plan:
                    if abort.is_set():
                        return
                    if src == self.process:
                        send(a, rank, consumer, dst)
                    elif dst == self.process:
                        receive(a, rank, consumer, src)
            except _Stop:
                return
            except BaseException as exc:  # noqa: BLE001
                errors.append((rank, a, RuntimeError(f"process {self.process}: moving {a} between processes failed: {exc}")))
                abort.set()
                for inbox in step.inboxes:
                    inbox.wake()

        return [threading.Thread(target=move, name=f"transfers-of-process-{self.process}", daemon=True)]


def _client():
    """The distributed runtime's key-value client (``jax._src.distributed``: no public name yet)."""
    from jax._src import distributed as _dist

    if _dist.global_state.client is None:
        raise RuntimeError("JAX's distributed runtime is not started; call zbpp_lite.runtime.distributed.initialize() first")
    return _dist.global_state.client


def _exchange(prefix: str, value: Any, process: int, num_processes: int, timeout: float) -> list:
    """Every process's ``value``, in process order, through the distributed runtime's key-value
    store, sent as JSON with NumPy arrays as raw bytes (:mod:`zbpp_lite.runtime.wire`: parsed,
    never unpickled). ``value`` holds JSON values, tuples and NumPy arrays; dict keys are str.

    Raises:
        TimeoutError: a process published nothing within ``timeout`` seconds (named).
        TypeError: ``value`` holds something :func:`~zbpp_lite.runtime.wire.encode` refuses.
        ValueError: a malformed message (named by its process)."""
    from . import wire

    client = _client()
    client.key_value_set_bytes(f"{prefix}/{process}", wire.encode(value))
    out = []
    for q in range(num_processes):
        try:
            data = client.blocking_key_value_get_bytes(f"{prefix}/{q}", int(timeout * 1000))
        except Exception as e:  # noqa: BLE001
            raise TimeoutError(f"process {process}: process {q} published no results for {prefix} within {timeout:g} s ({e})") from e
        try:
            out.append(wire.decode(data))
        except ValueError as e:
            raise ValueError(f"process {process}: the message of process {q} for {prefix} is malformed: {e}") from None
    return out
