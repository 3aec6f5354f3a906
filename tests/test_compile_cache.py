"""The persistent compilation cache: what the command line switches on, and that a later process
reads the programs an earlier one compiled instead of compiling them again."""

import json
import os
import subprocess
import sys
from pathlib import Path

from zbpp_lite.runtime.compile_cache import ENV_SWITCH, default_cache_dir, use_compile_cache

JAX_DIR = "JAX_COMPILATION_CACHE_DIR"


def test_the_default_directory_is_under_the_user_cache_and_every_program_is_cached(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    got = use_compile_cache(env)
    assert got == str(tmp_path / "zbpp_lite" / "xla") == str(default_cache_dir(env))
    assert Path(got).is_dir()
    assert env[JAX_DIR] == got
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"  # a stage's W compiles in < 1 s
    assert env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "-1"


def test_a_cache_the_user_set_is_kept_and_the_switch_turns_it_off_or_moves_it(tmp_path):
    mine = {JAX_DIR: "/somewhere/else", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}
    assert use_compile_cache(mine) == "/somewhere/else"
    assert mine["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "2"  # JAX's own thresholds kept
    for word in ("0", "off", "No", "false"):
        off = {ENV_SWITCH: word, "XDG_CACHE_HOME": str(tmp_path)}
        assert use_compile_cache(off) is None
        assert JAX_DIR not in off
    moved = {ENV_SWITCH: str(tmp_path / "here")}
    assert use_compile_cache(moved) == str(tmp_path / "here")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    assert use_compile_cache({ENV_SWITCH: str(blocked / "xla")}) is None  # no cache, no crash


# A process that switches the cache on, then has a child (which inherits it) compile the F, B, W and
# BW of a small model's two stages and count JAX's cache hits.
_CHILD = r"""
import json, time
start = time.perf_counter()
import jax
from jax import monitoring
hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
from zbpp_lite.analysis.profiling.device import profile_stage_costs
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.training.data import load_digits
from zbpp_lite.training.model import ModelConfig, build_parts
model = StagedModel(build_parts(ModelConfig(d=32, heads=4, blocks=2)), 2)
x, y = load_digits(0.2, 0).batch(0, 8)
profile_stage_costs(model, x, y, repeats=1, fused=True)
print(json.dumps({"hits": len(hits), "seconds": time.perf_counter() - start}))
"""


def _run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (JAX_DIR, ENV_SWITCH)}
    from conftest import UNTIMED_CHILD_FLAGS

    env.update({"XDG_CACHE_HOME": str(tmp_path), "XLA_FLAGS": UNTIMED_CHILD_FLAGS})  # fast compiles
    parent = (
        "import subprocess, sys\n"
        "from zbpp_lite.runtime.compile_cache import use_compile_cache\n"
        "use_compile_cache()\n"
        f"sys.exit(subprocess.run([sys.executable, '-c', {_CHILD!r}]).returncode)\n"
    )
    done = subprocess.run([sys.executable, "-c", parent], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_later_process_reads_the_stage_programs_an_earlier_one_compiled(tmp_path):
    first = _run(tmp_path)
    entries = list((tmp_path / "zbpp_lite" / "xla").iterdir())
    second = _run(tmp_path)
    assert first["hits"] == 0  # an empty cache: everything compiled
    assert len(entries) >= 8  # F, B, W, BW of two stages at least, inherited by the child
    assert second["hits"] >= len(entries) * 0.9  # read back, not compiled
