"""Devices for a pipeline: real accelerators when there are enough, else simulated CPU devices.

JAX fixes its device list when its backend starts (the first ``jax.devices()`` or computation),
so simulated CPU devices must be asked for before that: :func:`ensure_devices` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the trick of the uvadlc JAX tutorials'
``simulate_CPU_devices``). The count flag only concerns the CPU backend, so it is harmless on a
GPU or TPU machine, where it gives the CPU backend N devices beside the accelerators.

``platform`` picks the devices explicitly: ``"cpu"`` simulated CPU devices, ``"gpu"`` / ``"tpu"``
that platform's devices, or an error saying how many there are. With fewer accelerators than
ranks, :mod:`zbpp_lite.analysis.profiling.device` times each stage's F, B, W on one accelerator and the
simulator draws the pipeline from those costs (``python -m zbpp_lite train --platform gpu`` does
both, then trains for real on simulated CPU devices).

Threads. ``single_threaded`` adds ``--xla_cpu_multi_thread_eigen=false`` and
``intra_op_parallelism_threads=1`` to ``XLA_FLAGS``. On JAX 0.10.2 they do NOT make a simulated
CPU device single-threaded. The dashed flag is an accepted XLA flag that changes nothing
measurable. The other is no XLA flag at all (``--intra_op_parallelism_threads=1`` aborts as an
unknown flag) and is never read: XLA stops parsing ``XLA_FLAGS`` at the first word without
``--`` and silently drops everything after it, which is why :func:`cpu_device_flags` puts such
words last (add flags before them, not after).

Measured on this project's 2-core machine, 10 jitted 2048 x 2048 float32 products on one device:
under ``taskset -c 0,1`` 0.94-0.97 s wall for 1.86-1.89 s of process CPU time (CPU / wall 1.94
with the flags, 1.97 without); under ``taskset -c 0`` 1.9-2.1 s wall, CPU / wall 1.00. Two
devices each running the product in its own thread: 195 ms per product on each, beside 94-98 ms
for one device alone, with and without the flags. So every simulated device of a process runs
its work on every core the process may use, from one shared thread pool: a rank that waits lends
its cores to the others, and ranks running at once slow each other down. The flags are kept
(harmless here; the dashed one may matter to other XLA versions). For one core per rank, run one
process per rank pinned to its core (``taskset``), as ``benchmarks/bench_vs_torch.py`` does.

Importing this module does not import JAX.
"""

from __future__ import annotations

import os
import re
import sys

COUNT_FLAG = "--xla_force_host_platform_device_count"
SINGLE_THREAD_FLAGS = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")
PLATFORMS = ("cpu", "gpu", "tpu")
"""Values of ``platform`` (JAX's platform names; ``"gpu"`` covers CUDA and ROCm)."""


def cpu_device_flags(num_devices: int, single_threaded: bool = True, current: str | None = None) -> str:
    """``XLA_FLAGS`` asking for at least ``num_devices`` CPU devices, other flags kept.

    ``current`` defaults to the environment's ``XLA_FLAGS``; a device count already there is
    raised to ``num_devices`` if smaller, never lowered. ``single_threaded`` adds
    :data:`SINGLE_THREAD_FLAGS`, which on JAX 0.10 do not limit a device's threads (see the
    module docstring).
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


def _check_platform(platform: str | None) -> None:
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)} (or None for the automatic choice), got {platform!r}")


def platform_devices(platform: str) -> list:
    """Every JAX device of ``platform`` (``"cpu"``, ``"gpu"`` or ``"tpu"``); ``[]`` when JAX has
    no such backend (JAX raises RuntimeError for a platform that is absent or fails to start).

    Starts JAX's backends if they have not started: for simulated CPU devices beside the
    accelerator, call :func:`ensure_devices` or set ``XLA_FLAGS`` (:func:`cpu_device_flags`) first.

    Raises:
        ValueError: an unknown platform name.
    """
    if platform is None:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, got None")
    _check_platform(platform)
    import jax

    try:
        return list(jax.devices(platform))
    except RuntimeError:
        return []


def ensure_devices(num_devices: int, single_threaded: bool = True, platform: str | None = None) -> list:
    """``num_devices`` JAX devices for the ranks of a pipeline.

    Args:
        num_devices: ranks, one device each.
        single_threaded: add :data:`SINGLE_THREAD_FLAGS` when setting ``XLA_FLAGS`` (no effect
            on JAX 0.10, see the module docstring).
        platform: ``None``: the default backend's devices (TPU, GPU) when it has at least
            ``num_devices`` of them, else CPU devices. ``"cpu"``: CPU devices (simulated ones).
            ``"gpu"`` / ``"tpu"``: that platform's devices, never a fallback.

    Before JAX starts, ``XLA_FLAGS`` is set to ask for ``num_devices`` CPU devices whatever the
    platform (only the CPU backend reads the count).

    Returns:
        A list of ``num_devices`` devices.

    Raises:
        ValueError: ``num_devices`` below 1, or an unknown platform.
        RuntimeError: too few devices. Without a platform or with ``"cpu"``: JAX has already
            started with too few CPU devices; the message says how to get simulated devices.
            With ``"gpu"`` / ``"tpu"``: the message names how many devices of that platform JAX
            has (0 when the platform is absent) and points at profiling on one accelerator
            (:func:`zbpp_lite.analysis.profiling.device.profile_stage_costs`) or ``platform="cpu"``.
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    _check_platform(platform)
    if not backend_started():
        os.environ["XLA_FLAGS"] = cpu_device_flags(num_devices, single_threaded)
    import jax

    if platform in ("gpu", "tpu"):
        devices = platform_devices(platform)
        if len(devices) >= num_devices:
            return devices[:num_devices]
        raise RuntimeError(too_few_accelerators_message(num_devices, platform, len(devices)))
    if platform is None:
        devices = jax.devices()
        if len(devices) >= num_devices:
            return list(devices[:num_devices])
    cpus = jax.devices("cpu")
    if len(cpus) >= num_devices:
        return list(cpus[:num_devices])
    available = len(cpus) if platform == "cpu" else max(len(devices), len(cpus))
    raise RuntimeError(too_few_devices_message(num_devices, available))


def too_few_devices_message(needed: int, available: int) -> str:
    """The explanation given when a pipeline needs more devices than JAX has."""
    return (
        f"the pipeline needs {needed} devices (one per rank) but JAX has only {available}. "
        f"For simulated CPU devices, call zbpp_lite.runtime.devices.ensure_devices({needed}) before JAX "
        f"starts (in a notebook: restart the kernel and call it in the first cell), or set "
        f"XLA_FLAGS={COUNT_FLAG}={needed} in the environment before starting Python"
    )


def too_few_accelerators_message(needed: int, platform: str, available: int) -> str:
    """The explanation given when ``platform`` has fewer devices than the pipeline's ranks."""
    return (
        f"the pipeline needs {needed} {platform} devices (one per rank) but JAX has {available} "
        f"{platform} device(s). With at least one, profile each stage's F, B, W on it and simulate "
        f"the pipeline from those costs (zbpp_lite.analysis.profiling.device.profile_stage_costs; "
        f"`python -m zbpp_lite train --platform {platform}` does this, then trains on simulated CPU "
        f"devices); or run on simulated CPU devices with platform 'cpu' (--platform cpu)"
    )
