"""Test set-up shared by all test modules.

JAX fixes its devices when its backend starts, so the 4 simulated single-threaded CPU devices the
executor tests run on are asked for here, before any test module imports JAX. Flags already in
XLA_FLAGS are kept (zbpp_lite.runtime.devices does not import JAX).

The tests compile many small stage functions and time none of them, so XLA's CPU backend is also
asked to compile fast (no LLVM optimisation, no fusion emitters): about 8x less compile time, the
same HLO (and the same cost analysis), slower code. XLA aborts on a flag it does not know, so the
flags are tried in a subprocess: both, else the first alone, else none.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from zbpp_lite.runtime.compile_cache import use_compile_cache
from zbpp_lite.runtime.devices import cpu_device_flags

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    try:
        done = subprocess.run(probe, env={**os.environ, "XLA_FLAGS": flags}, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


_plain = cpu_device_flags(4)
_flags = _plain
if "xla_backend_optimization_level" not in _flags:
    # both flags where this XLA knows them; the first alone where it knows only that one (JAX 0.12's
    # XLA has no fusion emitters flag: without this fallback the newest-JAX leg compiled fully optimised)
    for fast in (FAST_COMPILE_FLAGS, FAST_COMPILE_FLAGS.split()[0]):
        if _xla_accepts(f"{fast} {_flags}"):
            _flags = f"{fast} {_flags}"
            break
os.environ["XLA_FLAGS"] = _flags
UNTIMED_CHILD_FLAGS = _flags.replace(_plain, "").strip()
"""The fast-compile flags (or nothing where this JAX rejects them), for child processes that time
nothing (the multi-process parity tests set them as XLA_FLAGS before ``launch`` adds its own)."""

# One persistent compilation cache for this test session and every process it starts (CLI
# subprocesses, rank processes, notebook kernels), as the command line has for a user; a fresh
# directory, so no test reads programs compiled outside this session.
_cache_dir = tempfile.mkdtemp(prefix="zbpp_lite_xla_cache_")
atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ["ZBPP_LITE_COMPILE_CACHE"] = _cache_dir
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
use_compile_cache()

# Start this process's backend with those flags, then hand child processes (CLI subprocesses, rank
# processes) the plain device flags: some of them time real runs and must not run unoptimised code.
import jax  # noqa: E402

jax.devices()
os.environ["XLA_FLAGS"] = _plain


class _FastNotebookKernels:
    """nbval's notebook kernels (started in a lesson's first cell's set-up) compile fast too: a lesson
    prints its measured times but asserts none of them (its asserts are values, gradients to 1e-5,
    memory in bytes and simulated timelines), and compiling takes most of the time of lessons 1, 2 and
    6 with XLA's optimisations on (146 s for the three run alone, 86 s without). A plugin, not a hook
    of this file: this file's hooks see only the items under tests/."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        notebook = item.path.suffix == ".ipynb"
        if notebook:
            os.environ["XLA_FLAGS"] = _flags
        try:
            yield
        finally:
            if notebook:
                os.environ["XLA_FLAGS"] = _plain


def pytest_configure(config):
    config.pluginmanager.register(_FastNotebookKernels(), "zbpp_fast_notebook_kernels")


@pytest.fixture
def untimed_children(monkeypatch):
    """Child processes (ranks, helpers, CLI runs) compile fast: XLA's optimisations off, as in this
    process. For tests that assert no timing: the same HLO, and their values are the same to 1e-5."""
    monkeypatch.setenv("XLA_FLAGS", UNTIMED_CHILD_FLAGS)
