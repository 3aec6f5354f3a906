"""Devices for a pipeline: real accelerators when there are enough, else simulated CPU devices.

JAX fixes its device list when its backend starts (the first ``jax.devices()`` or computation),
so simulated CPU devices must be asked for before that: :func:`ensure_devices` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the trick of the uvadlc JAX tutorials'
``simulate_CPU_devices``), and by default makes every CPU device single-threaded
(``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``) so that a rank's
action time is its own work, not a share of a thread pool the ranks fight over. With N ranks on
fewer than N cores the ranks still share cores, and their timings show it.

Importing this module does not import JAX.
"""

from __future__ import annotations

import os
import re
import sys

COUNT_FLAG = "--xla_force_host_platform_device_count"
SINGLE_THREAD_FLAGS = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")


def cpu_device_flags(num_devices: int, single_threaded: bool = True, current: str | None = None) -> str:
    """``XLA_FLAGS`` asking for at least ``num_devices`` CPU devices, other flags kept.

    ``current`` defaults to the environment's ``XLA_FLAGS``; a device count already there is
    raised to ``num_devices`` if smaller, never lowered.
    """
    flags = (os.environ.get("XLA_FLAGS", "") if current is None else current).split()
    count = num_devices
    kept = []
    for flag in flags:
        match = re.fullmatch(re.escape(COUNT_FLAG) + r"=(\d+)", flag)
        if match:
            count = max(count, int(match.group(1)))
        else:
            kept.append(flag)
    if single_threaded:
        kept += [f for f in SINGLE_THREAD_FLAGS if f.split("=")[0] not in {k.split("=")[0] for k in kept}]
    # XLA stops reading flags at the first word without a leading dash: those go last.
    dashed = [f for f in kept if f.startswith("-")]
    return " ".join([*dashed, f"{COUNT_FLAG}={count}", *[f for f in kept if not f.startswith("-")]])


def backend_started() -> bool:
    """Whether JAX has already started its backends (after which the device list is fixed)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return started() if started is not None else bool(getattr(xla_bridge, "_backends", {}))


def ensure_devices(num_devices: int, single_threaded: bool = True) -> list:
    """``num_devices`` JAX devices for the ranks of a pipeline.

    The default backend's devices (TPU, GPU) when it has at least ``num_devices`` of them;
    otherwise CPU devices, simulated ones if JAX has not started yet (see the module docstring).

    Raises:
        ValueError: ``num_devices`` below 1.
        RuntimeError: JAX has already started with too few devices; the message says how to get
            simulated devices (call this function, or set ``XLA_FLAGS``, before JAX starts).
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    if not backend_started():
        os.environ["XLA_FLAGS"] = cpu_device_flags(num_devices, single_threaded)
    import jax

    devices = jax.devices()
    if len(devices) >= num_devices:
        return list(devices[:num_devices])
    cpus = jax.devices("cpu")
    if len(cpus) >= num_devices:
        return list(cpus[:num_devices])
    raise RuntimeError(too_few_devices_message(num_devices, max(len(devices), len(cpus))))


def too_few_devices_message(needed: int, available: int) -> str:
    """The explanation given when a pipeline needs more devices than JAX has."""
    return (
        f"the pipeline needs {needed} devices (one per rank) but JAX has only {available}. "
        f"For simulated CPU devices, call zbpp_lite.devices.ensure_devices({needed}) before JAX "
        f"starts (in a notebook: restart the kernel and call it in the first cell), or set "
        f"XLA_FLAGS={COUNT_FLAG}={needed} in the environment before starting Python"
    )
