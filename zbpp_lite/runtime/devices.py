"""Devices for a pipeline: real accelerators when there are enough, else simulated CPU devices.

JAX fixes its device list when its backend starts, so :func:`ensure_devices` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before that (only the CPU backend reads it).
``platform``: ``"cpu"`` simulated devices, ``"gpu"`` / ``"tpu"`` that platform's, or an error saying how
many there are; with fewer accelerators than ranks, :mod:`zbpp_lite.analysis.profiling.device` times
stages on one and the simulator draws the pipeline.

:data:`SINGLE_THREAD_FLAGS` do NOT make a simulated CPU device single-threaded on JAX 0.10.2 (XLA stops
parsing ``XLA_FLAGS`` at the first word without ``--``, so :func:`cpu_device_flags` puts such words last):
all simulated devices share the process's cores. For one core per rank run one pinned process per rank
(``benchmarks/bench_vs_torch.py``). Importing this module does not import JAX.
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

    ``current`` defaults to the environment's; a device count there is raised, never lowered.
    ``single_threaded`` adds :data:`SINGLE_THREAD_FLAGS` (see the module docstring).
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
    from jax._src import xla_bridge  # lazy: only once JAX is imported (this module must not import it)

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return started() if started is not None else bool(getattr(xla_bridge, "_backends", {}))


def platform_devices(platform: str) -> list:
    """Every JAX device of ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``); ``[]`` when JAX has no such
    backend. Starts JAX's backends (call :func:`ensure_devices` first for simulated CPU devices).

    Raises:
        ValueError: an unknown platform name.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    import jax  # lazy: importing this module must not import JAX (XLA_FLAGS first)

    try:
        return list(jax.devices(platform))
    except RuntimeError:
        return []


def ensure_devices(num_devices: int, single_threaded: bool = True, platform: str | None = None) -> list:
    """``num_devices`` JAX devices for the ranks of a pipeline.

    Args:
        num_devices: ranks, one device each.
        single_threaded: add :data:`SINGLE_THREAD_FLAGS` (see the module docstring).
        platform: ``None``: the default backend's devices if it has ``num_devices``, else CPU.
            ``"cpu"``: (simulated) CPU devices. ``"gpu"`` / ``"tpu"``: that platform's, never a fallback.

    Before JAX starts, ``XLA_FLAGS`` asks for ``num_devices`` CPU devices whatever the platform.

    Returns:
        A list of ``num_devices`` devices.

    Raises:
        ValueError: ``num_devices`` below 1, or an unknown platform.
        RuntimeError: too few devices; the message says how to get simulated CPU devices, or names how
            many ``"gpu"`` / ``"tpu"`` devices there are and points at
            :func:`zbpp_lite.analysis.profiling.device.profile_stage_costs` or ``platform="cpu"``.
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)} (or None for the automatic "
                         f"choice), got {platform!r}")
    if not backend_started():
        os.environ["XLA_FLAGS"] = cpu_device_flags(num_devices, single_threaded)
    import jax  # lazy: after XLA_FLAGS is set

    if platform in ("gpu", "tpu"):
        devices = platform_devices(platform)
        if len(devices) >= num_devices:
            return devices[:num_devices]
        raise RuntimeError(
            f"the pipeline needs {num_devices} {platform} devices (one per rank) but JAX has {len(devices)} "
            f"{platform} device(s). With at least one, profile each stage's F, B, W on it and simulate the "
            f"pipeline from those costs (zbpp_lite.analysis.profiling.device.profile_stage_costs; "
            f"`python -m zbpp_lite train --platform {platform}` does this, then trains on simulated CPU "
            f"devices); or run on simulated CPU devices with platform 'cpu' (--platform cpu)")
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

