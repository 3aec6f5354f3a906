"""``python -m zbpp_lite.cli.launch_child TRAIN_ARGS``, a child of ``launch`` or multi-host ``train``: starts
JAX's runtime from the ``ZBPP_*`` environment (:func:`zbpp_lite.runtime.distributed.initialize`), trains on
:func:`~zbpp_lite.runtime.distributed.process_executor`; process 0 prints ``train``'s report.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from contextlib import suppress
from typing import Any, Sequence

import jax
import numpy as np

from ..analysis.profiling.timelines import timed_steps
from ..runtime.cluster import JOIN_ENV, join_settings
from ..runtime.distributed import initialize, pipeline_devices, process_executor
from ..runtime.devices import COUNT_FLAG
from ..runtime.processes import one_line
from ..runtime.stages import StagedModel
from ..schedules import strict_json
from ..schedules.ir import Schedule
from ..training.model import build_parts
from ..training.train import train_steps as train_steps_of
from . import parse_args
from .join import agreed_settings
from .train import (check_launchable, check_sizes, check_tolerance, grad_check_status, model_config,
                    plan_with_job_memory, report, resolve_schedule, run_config, train_spmd_command)


def train_process(args) -> int:
    """Start the runtime, train with ``train``'s ``args``, print its report on process 0; exit status."""
    schedule = resolve_schedule(args)
    blocks = check_sizes(args, schedule)
    check_launchable(args)  # launch checked it before starting us; a cluster's launcher did not
    t0 = time.perf_counter()
    process, count = initialize(settings=agreed_settings(args, args._parser))
    if COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):  # a detected cluster set no CPU device count
        with suppress(AttributeError, KeyError, ValueError, RuntimeError):  # JAX >= 0.4.38 has the option
            jax.config.update("jax_num_cpu_devices", -(-schedule.num_ranks // count) + (count > 1))
    if os.environ.get("ZBPP_TEST_CRASH_PROCESS") == str(process):  # tests: a process that dies
        print(f"process {process}: exiting on purpose (ZBPP_TEST_CRASH_PROCESS)", file=sys.stderr, flush=True)
        os._exit(3)
    devices = pipeline_devices(schedule.num_ranks)
    # same shapes on every process, so the same plan; only process 0 says so
    schedule = plan_with_job_memory(args, schedule, blocks, say=print if process == 0 else None)
    startup = time.perf_counter() - t0
    if process == 0:
        print(f"distributed runtime up in {startup:.2f} s: {count} processes; "
              + ", ".join(f"rank {r} on {device_name(d)}" for r, d in enumerate(devices)), flush=True)

    if getattr(args, "spmd", False):  # one SPMD program over a mesh spanning the processes
        status = train_spmd_command(args, schedule, blocks, devices, process)
        if process == 0:
            print(f"startup {startup:.2f} s", flush=True)
        return status

    def on_step(k: int, loss: float, timeline) -> None:
        if process == 0:
            print(f"step {k:4d}  loss {loss:.4f}  makespan {timeline.makespan * 1e3:8.2f} ms  "
                  f"bubble rate {timeline.bubble_rate:.3f}", flush=True)

    result = train_steps(schedule, args, blocks, devices, on_step)
    if process == 0:
        print(report(result, check_tolerance(args)))
        step_ms = [1e3 * s for s in timed_steps(result.step_seconds)]
        print(f"startup {startup:.2f} s; median step {np.median(step_ms):.2f} ms over {len(step_ms)} step(s) "
              f"{'after' if len(result.step_seconds) > 1 else 'including'} the first, which compiles: a "
              "step's wall time on process 0, i.e. the pipeline's actions (their span is the makespan above) "
              "plus waiting for the other processes, gathering the gradients onto one device and the AdamW "
              "update")
        if getattr(args, "json", None):
            data = {**result.to_json(), "startup_seconds": startup, "processes": count}
            print(strict_json.write(args.json, data))
    return grad_check_status(result, check_tolerance(args), process)  # every process alike


def device_name(device) -> str:
    """``process 1's cpu 0`` (JAX says ``cpu:2048``, which reads like a count)."""
    own = sorted((d for d in jax.devices() if d.process_index == device.process_index), key=lambda d: d.id)
    local = next((i for i, d in enumerate(own) if d.id == device.id), device.id)
    return f"process {device.process_index}'s {device.platform} {local}"


def train_steps(schedule: Schedule, args, blocks: int, devices: Sequence[Any], on_step=None):
    """:func:`~zbpp_lite.training.train.train_steps` on a :func:`process_executor`: every process holds
    all parameters and applies the same AdamW update to the gathered gradients (no final gather); clipped
    (``--max-grad-norm``), the rank threads step their own stages and every process gathers the others'
    after each step.
    Returns a :class:`~zbpp_lite.training.train.TrainResult` whose config names the process count."""
    config = model_config(args, blocks)
    model = StagedModel(build_parts(config), schedule.num_stages)
    executor = process_executor(model, schedule, devices, timeout=join_settings()["timeout"] or 60.0)
    run = run_config(args, max_grad_norm=args.max_grad_norm, post_validation=args.post_validation)
    result = train_steps_of(executor, args.steps, config, run, home=jax.local_devices()[0], on_step=on_step)
    result.config["processes"] = jax.process_count()
    return result


def die_with_parent() -> None:
    """Die with the parent (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``): no orphan of ``launch``."""
    with suppress(OSError, AttributeError):  # not Linux: nothing to do
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


if __name__ == "__main__":  # a child of `python -m zbpp_lite launch`: the train command's arguments
    die_with_parent()  # launch's or train's supervisor: never outlive it
    _args = parse_args(["train", *sys.argv[1:]])
    _finished = False
    try:
        _status = train_process(_args)
        _finished = True  # a failed gradient check too: every process got this far
    except BaseException as _e:  # noqa: BLE001 - one clear line on stderr, then out without waiting
        _line = str(_e).strip().splitlines()[0] if str(_e).startswith("process ") else \
            f"process {os.environ.get(JOIN_ENV['process_id'], '?')}: {one_line(_e)}"
        print(f"error: {_line}", file=sys.stderr, flush=True)
        _status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if _finished:
        jax.distributed.shutdown()  # waits for every process: the coordinator leaves last
    os._exit(_status)  # threads blocked in a transfer must not keep a failed process alive
