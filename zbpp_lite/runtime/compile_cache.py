"""A persistent XLA compilation cache shared by every process of a run, and by the next run.

A run compiles the same stage programs several times (profile, each rank process, ``compare``): 34 s into
an empty cache, 7 s from a full one on the 2-core machine. :func:`use_compile_cache` switches JAX's
"Persistent compilation cache" on through the environment, so children inherit it; the command line's
default, never switched on by the package's functions.

``ZBPP_LITE_COMPILE_CACHE``: ``0`` / ``off`` / ``no`` / ``false`` turns it off, else the directory
(default ``$XDG_CACHE_HOME/zbpp_lite/xla``, else ``~/.cache/zbpp_lite/xla``); a set
``JAX_COMPILATION_CACHE_DIR`` is kept. Deleting the directory is always safe.

Layer 2 (runtime); imports no JAX.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_SWITCH = "ZBPP_LITE_COMPILE_CACHE"
OFF_WORDS = ("0", "off", "no", "false")

# JAX's own settings, read from the environment when JAX is imported (a child process) or set with
# jax.config.update (this process, when JAX is already imported). Every program is cached, however
# small or quick to compile: a stage's W compiles in well under JAX's default threshold of 1 s.
# Each: (value, type); JAX's config name is the variable's in lower case.
_THRESHOLDS = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": ("0", float),
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": ("-1", int),
}


def default_cache_dir(environ: dict[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/zbpp_lite/xla``, or ``~/.cache/zbpp_lite/xla`` when XDG_CACHE_HOME is unset."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zbpp_lite" / "xla"


def use_compile_cache(environ: dict[str, str] | None = None) -> str | None:
    """Switch on JAX's persistent compilation cache for this process and every process it starts.

    Sets ``JAX_COMPILATION_CACHE_DIR`` and JAX's thresholds (0 s, no minimum size) in ``environ`` unless
    the directory is set there; also ``jax.config.update`` if JAX is imported (effective before the
    first compile).

    Args:
        environ: the environment to read and update (tests pass a dict).

    Returns:
        The cache directory (str), or None when switched off or the directory cannot be created.
    """
    env = os.environ if environ is None else environ
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return env["JAX_COMPILATION_CACHE_DIR"]
    choice = env.get(ENV_SWITCH, "").strip()
    if choice.lower() in OFF_WORDS:
        return None
    directory = Path(choice).expanduser() if choice else default_cache_dir(env)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    env["JAX_COMPILATION_CACHE_DIR"] = str(directory)
    for name, (value, _) in _THRESHOLDS.items():
        env.setdefault(name, value)
    if environ is None and "jax" in sys.modules:
        jax = sys.modules["jax"]  # already imported: apply to this process too (never import it here)
        jax.config.update("jax_compilation_cache_dir", env["JAX_COMPILATION_CACHE_DIR"])
        for name, (_, kind) in _THRESHOLDS.items():
            jax.config.update(name.lower(), kind(env[name]))
    return str(directory)
