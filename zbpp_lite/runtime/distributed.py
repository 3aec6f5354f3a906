"""The executor across processes (MPMD on JAX's multi-controller runtime): a transport.

Each process starts JAX's distributed runtime (:func:`initialize`) and runs the ranks whose devices it owns
(:func:`process_executor`: a :class:`~zbpp_lite.runtime.executor.PipelineExecutor` over
:class:`_CrossProcess`). Between processes values move by ``jax.device_put`` onto the other process's
device (cross-host transfer over sockets, one explicit port per process: port 0 hung the receiver).

JAX pairs a sender's cross-host ``device_put`` with the receiver's, in issue order, both directions
together (from two threads they mismatched). So each process issues all its transfers from one thread in
:func:`transfer_plan`'s order (the lowered program's :func:`~zbpp_lite.schedules.validate.execution_order`,
the same everywhere),
which cannot deadlock; a receiver posts its half once the key-value store says the value exists, on its
:func:`staging_device`. Tied parameters' partial gradient sums (host values, one per tie and rank after
its last action) go through the key-value store instead, beside the transfers. The processes start each
:meth:`~zbpp_lite.runtime.executor.PipelineExecutor.run_steps` call together (a roll call in the store),
so the measured timeline counts no wait for a process still busy between steps, and its events, from that
common start, line up across processes. After the step, results go through the key-value store so every
process returns the whole :class:`~zbpp_lite.runtime.executor.StepResult`; process 0 deletes a step's keys
once every process has read them, so the store holds one step's however many run. Every wait has a timeout and
errors name the process and rank (:mod:`zbpp_lite.cli.launch` ends every child when one fails). The
listeners bind the addresses given (README "Several hosts: trust").
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from contextlib import suppress
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax._src import distributed as _dist  # the key-value client: no public name yet

from . import wire
from .cluster import (address_towards, free_port, join_settings, listen_address, parse_address,
                      wait_for_coordinator)
from .executor import PipelineExecutor
from .processes import one_line
from .stages import StagedModel, refuse_pytree_activations
from .step import TieSum
from .transport import Aborted, Inbox, OptimizerMessage, Threads, Transfer
from ..schedules import strict_json
from ..schedules.ir import Action, Schedule
from ..schedules.program import Program, Send, consumer_stage, lower
from ..schedules.timeline import Event, Timeline
from ..schedules.validate import execution_order


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout: float | None = None,
               transfer_address: str | None = None, heartbeat: float | None = None,
               settings: dict | None = None) -> tuple[int, int]:
    """Start JAX's distributed runtime for this process; returns (process index, process count).

    Args:
        coordinator: ``"HOST:PORT"`` of process 0's coordination service.
        num_processes, process_id: N and this process's index in 0..N-1.
        transfer_address: ``"HOST:PORT"`` to listen on for transfers (default
            :func:`~zbpp_lite.runtime.cluster.address_towards` the coordinator and a free port).
        timeout: seconds for registration, the coordinator's first answer, each transfer, the roll call
            (default 60).
        heartbeat: seconds without a heartbeat before JAX declares a process lost (default
            ``max(timeout, 10)``).
        settings: what every process must be given alike, compared with process 0's at the roll call
            (:func:`roll_call`).

    Arguments default to the ``ZBPP_*`` environment (:func:`~zbpp_lite.runtime.cluster.join_settings`);
    with no coordinator JAX detects the cluster. Must run before JAX starts its backend; checks the
    coordinator first, the process count and ``settings`` after (:func:`roll_call`). Sets gloo
    collectives on CPU.

    Raises:
        RuntimeError: one line naming this process and the cause (coordinator unreachable, port not free,
            process count or a setting differing from process 0's, runtime not starting). Failures inside
            JAX end the process from C++; :mod:`zbpp_lite.cli.join` names their cause.
    """
    env = join_settings()
    coordinator = coordinator or env["coordinator"]
    num_processes = num_processes if num_processes is not None else env["num_processes"]
    process_id = process_id if process_id is not None else env["process_id"]
    timeout = timeout or env["timeout"] or 60.0
    transfer_address = transfer_address or env["transfer_address"]
    heartbeat = heartbeat or env["heartbeat"] or max(timeout, 10)
    me = f"process {process_id if process_id is not None else '?'}"
    if transfer_address:
        parse_address(transfer_address, "the transfer address")
    bind = None
    if coordinator:
        c_host, c_port = parse_address(coordinator, "--coordinator")
        if process_id == 0:
            bind = listen_address(c_host, c_port, f"{me}: the coordinator port")
        else:
            wait_for_coordinator(c_host, c_port, timeout, process_id)
    _start_runtime(coordinator, num_processes, process_id, timeout, int(max(heartbeat, 1)), me, bind)
    state = _dist.global_state
    process_id = state.process_id if process_id is None else process_id
    num_processes = state.num_processes if num_processes is None else num_processes
    if not transfer_address:  # a detected cluster: the address towards the coordinator it found
        mine = address_towards(parse_address(state.coordinator_address, "the coordinator address")[0])
        transfer_address = f"{mine}:{free_port(mine)}"
    _listen_for_transfers(transfer_address)
    roll_call(process_id, num_processes, timeout, transfer_address, settings)
    return process_id, num_processes


def _listen_for_transfers(transfer_address: str) -> None:
    """JAX's transfer listeners on ``transfer_address`` and, for the bulk data, on free ports of its host
    (JAX's default: 4 on every interface)."""
    jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
    host = parse_address(transfer_address, "the transfer address")[0]
    host = f"[{host}]" if ":" in host else host
    with suppress(AttributeError, KeyError):  # a JAX without the option: its own default
        jax.config.update("jax_cross_host_transport_addresses", ",".join([f"{host}:0"] * 4))


def _start_runtime(coordinator, num_processes, process_id, timeout: float, heartbeat: int, me: str,
                   bind: str | None = None) -> None:
    """``jax.distributed.initialize`` with this package's timeouts, its coordinator listening on ``bind``
    (``HOST:PORT``; None: JAX's default, every interface); its failure in one line."""
    jax.config.update("jax_cross_host_transfer_timeout_seconds", int(max(timeout, 1)))
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # pragma: no cover - a JAX without the option
        pass
    options = {"initialization_timeout": int(max(timeout, 1)), "heartbeat_timeout_seconds": heartbeat,
               "shutdown_timeout_seconds": int(max(timeout, 1)), "coordinator_bind_address": bind}
    try:
        try:
            jax.distributed.initialize(coordinator, num_processes, process_id, **options)
        except TypeError as e:  # an older JAX without the shutdown timeout: its own default then
            if "shutdown_timeout_seconds" not in str(e):
                raise
            del options["shutdown_timeout_seconds"]
            jax.distributed.initialize(coordinator, num_processes, process_id, **options)
    except Exception as e:  # noqa: BLE001 - re-raised with the process named
        raise RuntimeError(f"{me} of {num_processes}: JAX's distributed runtime did not start "
                           f"(coordinator {coordinator}): {one_line(e)}") from e


def roll_call(process: int, num_processes: int, timeout: float, transfer_address: str = "",
              settings: dict | None = None) -> list[dict]:
    """Every process's ``{"process", "num_processes", "host", "transfer_address", "settings"}`` in process
    order, through the key-value store, checked against process 0's before JAX's backend starts.

    ``settings``: ``{name: value}`` (JSON values) every process must be given alike, named as the user
    gave them (``{"--microbatches": 4, ...}``); processes that disagree would compute with different
    models or programs and fail late or, worse, not at all.

    Raises:
        RuntimeError: one line: a process count or a setting that differs from process 0's (a setting
            named with both values, in the same line on every process), or a process that did not
            answer within ``timeout`` seconds (named)."""
    mine = {"process": process, "num_processes": num_processes, "host": socket.gethostname(),
            "transfer_address": transfer_address, "settings": dict(settings or {})}
    first: dict = {}  # process 0's settings

    def check(q: int, entry: dict) -> None:
        if entry.get("num_processes") != num_processes:
            raise RuntimeError(f"process {process}: mismatched process counts: this process was started "
                               f"with --num-processes {num_processes}, process {q} (on {entry.get('host')}) "
                               f"with {entry.get('num_processes')}; give every process the same N")
        theirs = entry.get("settings") or {}
        if q == 0:
            first.update(theirs)
            return
        for name in [*first, *(k for k in theirs if k not in first)]:
            if name not in first or name not in theirs or first[name] != theirs[name]:
                raise RuntimeError(f"process {process}: {name}: process 0 has {_shown(first, name)}, process "
                                   f"{q} has {_shown(theirs, name)}; give every process of a run the same")

    try:
        return _exchange("zbpp/roll", mine, process, num_processes, timeout, check)
    except (RuntimeError, TimeoutError, ValueError) as e:
        _client().key_value_set(f"zbpp/roll/checked/{process}", "1")
        if process == 0:
            # process 0 hosts the service: leaving at once would end the others with "lost the
            # coordinator" before they name the mismatch themselves; wait (bounded) for their verdicts
            for q in range(1, num_processes):
                with suppress(Exception):  # that process is not there: nothing to wait for
                    _client().blocking_key_value_get(f"zbpp/roll/checked/{q}", int(min(timeout, 5.0) * 1000))
            time.sleep(1.0)  # their one line is printed after their verdict
        raise RuntimeError(str(e)) from None


def _shown(settings: dict, name: str) -> str:
    """A setting's value as the roll call's error names it."""
    if name not in settings:
        return "no such setting (another version of zbpp_lite?)"
    value = settings[name]
    if value is None:
        return "none"
    return strict_json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def pipeline_devices(num_ranks: int) -> list:
    """One global device per rank: rank r on process ``r * N // p``, on its local devices in order (with
    several processes the last is kept for :func:`staging_device`).

    Raises:
        ValueError: more processes than ranks (a process would hold no rank), or a process with
            fewer devices than the ranks it must hold.
    """
    n = jax.process_count()
    spare = 1 if n > 1 else 0  # each process's last device receives transfers (staging_device)
    if n > num_ranks:
        raise ValueError(f"{n} processes but only {num_ranks} ranks: every process needs at least one rank; "
                         "use --processes <= --ranks")
    devices = []
    for r in range(num_ranks):
        proc = r * n // num_ranks
        local = [d for d in jax.devices() if d.process_index == proc]
        local = local[: len(local) - spare]
        index = sum(1 for q in range(r) if q * n // num_ranks == proc)
        if index >= len(local):
            raise ValueError(f"process {proc} has {len(local)} device(s) but must hold {index + 1} or more "
                             "ranks; raise --devices-per-process")
        devices.append(local[index])
    return devices


def staging_device(process: int):
    """The last local device of ``process``, never a rank's, receives its transfers: a waiting receive on
    a rank's device would block that rank (and could deadlock two processes)."""
    return [d for d in jax.devices() if d.process_index == process][-1]


def transfer_plan(program: Program, owner: Sequence[int]) -> list[tuple[Send, int]]:
    """The program's sends between processes as (send, sending rank), in the program's
    :func:`execution_order`, the same on every process (see the module docstring). ``owner[rank]`` is each
    rank's process."""
    rows = program.instructions
    return [(rows[rank][i], rank) for rank, i in execution_order(program)
            if type(rows[rank][i]) is Send and owner[rank] != owner[rows[rank][i].peer]]


class _CrossProcess(Threads):
    """The transport across processes: a value for a rank of this process into its inbox, one for another
    process's into the step's outbox, which the transfer thread (:meth:`start`) drains in
    :func:`transfer_plan`'s order, putting what it receives into the inboxes; an
    :class:`~zbpp_lite.runtime.transport.OptimizerMessage` for another process's rank (a tied parameter's
    partial gradient sum, ``TIE{t}``: the program's ``TIE``) goes through the key-value store in
    :mod:`~zbpp_lite.runtime.wire`'s format; :meth:`finish` gathers the results. ``devices``: one global
    device per rank; ``inputs()``: every stage's input shapes."""

    def __init__(self, model: StagedModel, schedule: Schedule, devices: Sequence[Any], timeout: float,
                 inputs: Callable[[], list] = list):
        super().__init__()
        self.process, self.num_processes = jax.process_index(), jax.process_count()
        self.owner = [d.process_index for d in devices]
        self.local = {r for r, q in enumerate(self.owner) if q == self.process}
        self.model, self.schedule, self.devices, self.timeout = model, schedule, list(devices), timeout
        self.inputs = inputs
        self.plan = transfer_plan(lower(schedule), self.owner)
        self.staging = {q: staging_device(q) for q in range(self.num_processes)}
        self.where = f"process {self.process}: "
        self.outboxes: dict = {}  # step number -> Inbox of what local ranks send to other processes
        self.sent: list = []  # (value, moved) of sends that may still read their buffers
        self.failure: BaseException | None = None  # why the transfer thread stopped
        self.origin = 0.0  # time.perf_counter() as the steps started together (:meth:`start`)
        self.finished = -1  # the number of the last step :meth:`finish` gathered

    def send(self, step: int, rank: int, key, value) -> None:
        if rank in self.local:
            super().send(step, rank, key, value)
        elif type(key) is OptimizerMessage:  # a host value (a tied copy's gradient sum): through the store
            _client().key_value_set_bytes(_message_name(step, key, rank), wire.encode(value))
        else:
            self.outboxes[step].put(key.key, value)

    def recv(self, step: int, rank: int, key, timeout: float):
        if type(key) is OptimizerMessage and self.owner[key.sender] != self.process:
            self._fetch(step, rank, key, timeout)
        try:
            return super().recv(step, rank, key, timeout)
        except Aborted:
            if self.failure is not None:
                raise self.failure from None
            raise

    def _fetch(self, step: int, rank: int, key: OptimizerMessage, timeout: float) -> None:
        """A thread that puts what another process published for ``rank`` under ``key`` (:meth:`send`) into
        the rank's inbox once the store has it; not there within ``timeout``: the inbox's wait names it; a
        failing store or a malformed message: this process's failure."""
        name = _message_name(step, key, rank)

        def fetch():
            try:
                data = _client().blocking_key_value_get_bytes(name, int(timeout * 1000))
                Threads.send(self, step, rank, key, wire.decode(data))
            except Exception as e:  # noqa: BLE001 - named in one line, not lost in a thread
                if "DEADLINE_EXCEEDED" not in str(e):
                    self.failure = RuntimeError(f"receiving {name} failed: {one_line(e)}")
                    self.abort()

        threading.Thread(target=fetch, name=f"fetch-{name}", daemon=True).start()

    def start(self, steps: Sequence[int]) -> list:
        """The thread that issues this process's transfers of ``steps`` in plan order."""
        super().start(steps)
        shapes = self.inputs()
        refuse_pytree_activations(self.model, shapes[0], "the cross-process transport (JAX's distributed "
                                  "runtime)")
        self.outboxes = {step: Inbox(self._abort, threading.Condition()) for step in steps}
        self.failure = None
        # every process starts the steps together: work between steps (the first AdamW update compiles,
        # an evaluation) takes each process its own time, and a rank that started first would wait for
        # the others inside the measured timeline; leaving this roll call is also the steps' common origin
        _exchange(f"zbpp/step{steps[0]}/go", None, self.process, self.num_processes, self.timeout)
        self.origin = time.perf_counter()

        def move():
            send = None
            try:
                for step in steps:
                    for send, rank in self.plan:
                        if self._abort.is_set():
                            return
                        if rank in self.local:
                            self._send(step, send, rank)
                        elif send.peer in self.local:
                            self._receive(step, send, rank, shapes)
            except Aborted:  # the step was aborted elsewhere: stop quietly
                return
            except BaseException as exc:  # noqa: BLE001
                self.failure = RuntimeError(f"moving {send} between processes failed: {exc}")
                self.abort()

        return [threading.Thread(target=move, name=f"transfers-of-process-{self.process}", daemon=True)]

    def _send(self, step: int, send: Send, rank: int) -> None:
        try:
            value = self.outboxes[step].take(send.key, self.timeout)
        except TimeoutError:
            raise TimeoutError(f"rank {rank} produced no {send} within {self.timeout:g} s") from None
        _client().key_value_set(f"zbpp/step{step}/ready/{send}", "1")  # the receiver may post its half
        moved = jax.device_put(value, jax.sharding.SingleDeviceSharding(self.staging[self.owner[send.peer]]))
        jax.block_until_ready(moved)
        self.sent.append((value, moved))  # the send may still read the buffer: kept to the step's end

    def _receive(self, step: int, send: Send, rank: int, shapes: list) -> None:
        try:
            _client().blocking_key_value_get(f"zbpp/step{step}/ready/{send}", int(self.timeout * 1000))
        except Exception as e:  # noqa: BLE001
            raise TimeoutError(f"rank {rank} on process {self.owner[rank]} did not produce {send} within "
                               f"{self.timeout:g} s ({one_line(e)})") from None
        single = jax.sharding.SingleDeviceSharding
        kind, stage, _ = send.key
        shape = shapes[consumer_stage(kind, stage) if kind == "F" else stage]
        placeholder = jax.make_array_from_single_device_arrays(
            tuple(shape.shape), single(self.devices[rank]), [], dtype=shape.dtype)
        moved = jax.device_put(placeholder, single(self.staging[self.process])).addressable_data(0)
        super().send(step, send.peer, Transfer(*send.key), moved)

    def gather(self, value: Any) -> list:
        """Every process's ``value`` (:func:`_exchange`'s kinds), in process order, through the key-value
        store: a clipped run's stages and rolled-back ranks after a step (stepped in the rank threads, so each
        process holds only its own), the model's bytes a step. Every process calls it once after each
        :meth:`finish`; its keys are under that step's prefix, so :func:`_forget_before` deletes them with the
        step's results. Raises as :func:`_exchange`."""
        return _exchange(f"zbpp/step{self.finished}/gather", value, self.process, self.num_processes,
                         self.timeout)

    def finish(self, results: list) -> list:
        """Every process's losses, gradients, events and tie sums, through the key-value store."""
        if self.failure is not None:
            raise self.failure
        S, m, tree = self.model.num_stages, self.schedule.num_microbatches, jax.tree_util
        stage_params = self.model.stage_params
        local = [s for s in range(S) if self.owner[self.schedule.placement[s]] == self.process]
        whole = []
        for number, result in zip(self.outboxes, results):
            late = result.started_at - self.origin  # this process's first action after the common origin
            mine = {
                "losses": [[j, v] for j, v in enumerate(result.microbatch_losses)],
                "grads": [[s, [np.asarray(g) for g in tree.tree_leaves(stage_params(result.grads, s))]]
                          for s in local],
                "events": [[e.rank, str(e.action), e.start + late, e.end + late]
                           for e in result.timeline.events],
                "ties": [[t.rank, t.tie, list(t.ranks), t.nbytes, t.start + late, t.end + late]
                         for t in result.tie_sums],
            }
            shares = _exchange(f"zbpp/step{number}", mine, self.process, self.num_processes,
                               self.timeout)
            if self.process == 0:
                _forget_before(number)
            self.finished = number
            losses_by_mb, grads, events, ties = {}, [None] * S, [], []
            for share in shares:
                losses_by_mb.update((int(j), v) for j, v in share["losses"])
                for s, g in share["grads"]:
                    template = tree.tree_structure(stage_params(self.model.params, s))
                    grads[s] = tree.tree_unflatten(template, g)
                events += [Event(r, Action.from_str(a), t0, t1) for r, a, t0, t1 in share["events"]]
                ties += [TieSum(r, t, tuple(q), n, t0, t1) for r, t, q, n, t0, t1 in share["ties"]]
            begin = min(e.start for e in events)  # from the first action of any process, as in one process
            events = [e._replace(start=e.start - begin, end=e.end - begin) for e in events]
            ties = [dataclasses.replace(t, start=t.start - begin, end=t.end - begin) for t in ties]
            losses = tuple(losses_by_mb[j] for j in range(m))
            timeline = Timeline.from_events(events, self.schedule.num_ranks, num_stages=S, source="measured")
            whole.append(dataclasses.replace(
                result, loss=float(np.mean(np.asarray(losses, np.float64))), microbatch_losses=losses,
                grads=self.model.join_stage_params(grads), timeline=timeline, started_at=0.0,
                tie_sums=tuple(sorted(ties, key=lambda t: (t.tie, t.rank)))))
        self.sent = []  # every process has its values now: the sent buffers may go
        return whole


def process_executor(model: StagedModel, schedule: Schedule, devices: Sequence[Any] | None = None,
                     timeout: float = 60.0) -> PipelineExecutor:
    """The :class:`~zbpp_lite.runtime.executor.PipelineExecutor` of this process in a
    multi-process run: the ranks whose devices it owns, over :class:`_CrossProcess`.

    Args:
        model, schedule, timeout: as the executor's.
        devices: one global device per rank (default :func:`pipeline_devices`).

    Every process calls ``run`` / ``run_steps`` with the same arguments; each returns the whole
    :class:`~zbpp_lite.runtime.executor.StepResult` (``started_at`` 0.0: clocks differ).

    Raises:
        RuntimeError: (from ``run``) an action failed or a transfer did not complete; the message
            names the process and the rank. TimeoutError: a rank waited past ``timeout``.
            ValueError: stages that pass pytrees (one array per transfer).
    """
    devices = list(devices) if devices is not None else pipeline_devices(schedule.num_ranks)
    ranks = [r for r, d in enumerate(devices) if d.process_index == jax.process_index()]
    transport = _CrossProcess(model, schedule, devices, timeout)
    executor = PipelineExecutor(model, schedule, devices, timeout, ranks=ranks, transport=transport)
    transport.inputs = lambda: executor.input_shapes
    return executor


def _client():
    """The distributed runtime's key-value client."""
    if _dist.global_state.client is None:
        raise RuntimeError("JAX's distributed runtime is not started; call "
                           "zbpp_lite.runtime.distributed.initialize() first")
    return _dist.global_state.client


def _message_name(step: int, key: OptimizerMessage, rank: int) -> str:
    """The key-value store's name of ``key`` sent to ``rank`` in step number ``step``: under the step's
    prefix, so :func:`_forget_before` deletes it with the step's results."""
    return f"zbpp/step{step}/message/{key.tag}/{key.sender}/{rank}"


def _forget_before(number: int) -> None:
    """Delete the key-value store's keys of steps before ``number`` and step ``number``'s transfer notices,
    start roll call and messages, once process 0 holds every process's results of step ``number``: each
    process published those after its transfers and messages of the step ended and after reading every
    result (and, clipped, every :meth:`_CrossProcess.gather` share) of the step before, so no process reads
    these keys again. The store then keeps one step's results,
    however many steps run."""
    client = _client()
    for done in ("ready", "go", "message"):
        client.key_value_delete(f"zbpp/step{number}/{done}")
    if number > 0:
        client.key_value_delete(f"zbpp/step{number - 1}")


def _exchange(prefix: str, value: Any, process: int, num_processes: int, timeout: float,
              check: Callable[[int, Any], None] | None = None) -> list:
    """Every process's ``value`` (JSON values, tuples, NumPy arrays; str keys) in process order, through
    the key-value store in :mod:`zbpp_lite.runtime.wire`'s format; ``check(q, value)`` may raise for
    process q's before the next is awaited.

    Raises:
        TimeoutError: a process published nothing within ``timeout`` seconds (named).
        TypeError: ``value`` holds something :func:`~zbpp_lite.runtime.wire.encode` refuses.
        ValueError: a malformed message (named by its process)."""
    client = _client()
    client.key_value_set_bytes(f"{prefix}/{process}", wire.encode(value))
    out = []
    for q in range(num_processes):
        try:
            data = client.blocking_key_value_get_bytes(f"{prefix}/{q}", int(timeout * 1000))
        except Exception as e:  # noqa: BLE001
            raise TimeoutError(f"process {process}: process {q} published no results for {prefix} "
                               f"within {timeout:g} s ({one_line(e)})") from None
        try:
            out.append(wire.decode(data))
        except ValueError as e:
            raise ValueError(f"process {process}: the message of process {q} for {prefix} is malformed: "
                             f"{e}") from None
        if check is not None:
            check(q, out[-1])
    return out
