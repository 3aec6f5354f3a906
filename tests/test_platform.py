"""``platform``: explicit devices, and per-stage costs profiled on one device for the simulator.

This machine has no accelerator, so the accelerator paths are checked two ways: with no GPU the
request fails with a message naming how many there are; and the profile path runs with one of
the test process's CPU devices standing in for the lone accelerator (``platform_devices`` patched).
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

import zbpp_lite as zb
from zbpp_lite.runtime import devices as devices_mod
from zbpp_lite.analysis.profiling.device import profile_stage_costs, stage_memory_bytes
from zbpp_lite.cli import main
from zbpp_lite.training.data import load_digits
from zbpp_lite.runtime.devices import ensure_devices, platform_devices
from zbpp_lite.training.model import ModelConfig, build_parts
from zbpp_lite.runtime.stages import StagedModel

NO_GPU = not platform_devices("gpu")


# ---------------------------------------------------------------------------- devices


def test_platform_cpu_gives_cpu_devices_and_refuses_more_than_started():
    got = ensure_devices(3, platform="cpu")
    assert [d.platform for d in got] == ["cpu"] * 3 and len(set(got)) == 3
    have = len(jax.devices("cpu"))
    with pytest.raises(RuntimeError, match=f"needs {have + 1} devices .* JAX has only {have}"):
        ensure_devices(have + 1, platform="cpu")


@pytest.mark.skipif(not NO_GPU, reason="a GPU is present")
def test_platform_gpu_without_one_names_zero_and_the_profile_path():
    assert platform_devices("gpu") == []
    with pytest.raises(RuntimeError, match=r"needs 2 gpu devices .* JAX has 0 gpu device\(s\).*profile_stage_costs"):
        ensure_devices(2, platform="gpu")


def test_unknown_platform_lists_the_valid_ones():
    with pytest.raises(ValueError, match="cpu, gpu, tpu"):
        ensure_devices(2, platform="cuda")
    with pytest.raises(ValueError, match="cpu, gpu, tpu"):
        platform_devices("xpu")


# ---------------------------------------------------------------------------- profile


@pytest.fixture(scope="module")
def uneven():
    """Stage 0: embedding + 1 block; stage 1: 5 blocks + head (about 5x the work); 16 samples."""
    model = StagedModel(build_parts(ModelConfig(d=32, heads=4, blocks=6)), 2, parts=[[0, 1], [2, 3, 4, 5, 6, 7]])
    x, y = load_digits(0.2, 0).batch(0, 16)
    return model, profile_stage_costs(model, x, y, jax.devices("cpu")[0], repeats=5)


def test_profiled_costs_are_per_stage_positive_and_w_cheaper_than_f_plus_b(uneven):
    _, costs = uneven
    assert len(costs.f) == len(costs.b) == len(costs.w) == 2
    for s in range(2):
        assert min(costs.f[s], costs.b[s], costs.w[s]) > 0
        assert costs.w[s] < costs.f[s] + costs.b[s]
    assert costs.comm == 0.0


def test_profiled_costs_belong_to_their_stage(uneven):
    # Stage 1 does about five times stage 0's work: a profile that mixed up or averaged stages fails.
    # Timed on a shared CPU at 16 samples, a lone W is mostly dispatch (3.0 against 4.0 ms was seen
    # in CI), so the check is on F and on a whole step's F + B + W, where the work shows (about 6x).
    _, costs = uneven
    light, heavy = costs.f
    assert heavy > 1.5 * light, ("f", light, heavy)
    light, heavy = (costs.f[s] + costs.b[s] + costs.w[s] for s in range(2))
    assert heavy > 1.5 * light, ("f + b + w", light, heavy)
    assert costs.mem_b[1] > 1.5 * costs.mem_b[0] and costs.mem_w[1] > 1.5 * costs.mem_w[0]


def test_gpipe_simulated_from_profiled_costs_has_its_closed_form(uneven):
    # GPipe with T_comm = 0 is two flow shops of m identical jobs: forwards down the stages, then
    # fused backwards up them; each takes sum_s t_s + (m - 1) max_s t_s.
    _, c = uneven
    m = 6
    t = zb.simulate(zb.build_schedule("gpipe", 2, m), c)
    bw = [b + w for b, w in zip(c.b, c.w)]
    expected = sum(c.f) + sum(bw) + (m - 1) * (max(c.f) + max(bw))
    assert t.source == "simulated"
    assert t.makespan == pytest.approx(expected, rel=1e-12)
    busiest = m * max(f + x for f, x in zip(c.f, bw))
    assert t.bubble_rate == pytest.approx((expected - busiest) / expected, rel=1e-9)


def test_fused_profile_times_bw_per_stage_and_gpipe_uses_it(uneven):
    model, plain = uneven
    assert plain.bw is None  # without fused: BW costs T_B + T_W
    x, y = load_digits(0.2, 0).batch(0, 16)
    c = profile_stage_costs(model, x, y, jax.devices("cpu")[0], repeats=3, fused=True)
    assert len(c.bw) == 2 and min(c.bw) > 0
    assert c.bw[1] > 1.5 * c.bw[0]  # the heavy stage's fused backward, not the light one's
    assert (c.mem_b, c.mem_w) == stage_memory_bytes(model, x, y)  # M_B, M_W in bytes: what planners take
    m = 6  # GPipe's closed form as above, with the measured T_BW
    expected = sum(c.f) + sum(c.bw) + (m - 1) * (max(c.f) + max(c.bw))
    assert zb.simulate(zb.build_schedule("gpipe", 2, m), c).makespan == pytest.approx(expected, rel=1e-12)


def test_profile_refuses_bad_arguments(uneven):
    model, _ = uneven
    x, y = load_digits(0.2, 0).batch(0, 16)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        profile_stage_costs(model, x, y, repeats=0)
    with pytest.raises(ValueError, match="16 inputs but 15 labels"):
        profile_stage_costs(model, x, y[:15])


# ---------------------------------------------------------------------------- command line

# the tiny job most command-line tests run (d 16, 2 heads, 4 blocks, microbatches of 2): its stage programs
# compile once into the session's compilation cache (conftest) and every later process reads them
SMALL = ["--ranks", "2", "-m", "2", "--batch", "4", "--d", "16", "--heads", "2", "--blocks", "4", "--steps", "1"]


def test_train_platform_cpu_runs_on_cpu_devices_and_says_so(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["train", "--platform", "cpu", *SMALL, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "REAL run on 2 simulated CPU devices" in text and "PROFILED" not in text
    data = json.loads(out.read_text())
    assert data["config"]["devices"] == [str(d) for d in jax.devices("cpu")[:2]]
    assert "profiled" not in data


def test_train_with_one_accelerator_profiles_on_it_then_runs_on_cpu(tmp_path, capsys, monkeypatch):
    # One CPU device stands in for a lone GPU: too few for 2 ranks, so the profile path runs.
    lone = jax.devices("cpu")[3]
    monkeypatch.setattr(devices_mod, "platform_devices", lambda platform: [lone] if platform == "gpu" else jax.devices(platform))
    out = tmp_path / "run.json"
    assert main(["train", "--platform", "gpu", *SMALL, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    profiled_at = text.index(f"PROFILED on {lone}: simulated pipeline from measured per-stage costs")
    assert profiled_at < text.index("REAL run on 2 simulated CPU devices")
    data = json.loads(out.read_text())
    assert data["profiled"]["device"] == str(lone)
    assert str(lone) not in data["config"]["devices"]
    c = data["profiled"]["costs_seconds"]
    assert len(c["f"]) == len(c["b"]) == len(c["w"]) == 2 and min(c["f"] + c["b"] + c["w"]) > 0
    # what was printed and written is the simulator's answer for exactly those costs
    t = zb.simulate(zb.build_schedule("zb-h1", 2, 2), zb.Costs(**c))
    assert data["profiled"]["simulated"]["makespan"] == pytest.approx(t.makespan, rel=1e-12)
    assert f"makespan {t.makespan * 1e3:.3f} ms, bubble rate {t.bubble_rate:.4f}" in text


@pytest.mark.skipif(not NO_GPU, reason="a GPU is present")
@pytest.mark.parametrize("command", ["train", "compare"])
def test_platform_gpu_without_one_is_a_one_line_error(command):
    done = subprocess.run([sys.executable, "-m", "zbpp_lite", command, "--platform", "gpu", "--ranks", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "0 gpu device(s)" in done.stderr and "--platform cpu" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1



def test_compare_with_one_accelerator_simulates_every_schedule_from_profiled_costs(tmp_path, capsys, monkeypatch):
    lone = jax.devices("cpu")[3]
    monkeypatch.setattr(devices_mod, "platform_devices", lambda platform: [lone] if platform == "gpu" else jax.devices(platform))
    out = tmp_path / "compare.json"
    sizes = [*SMALL[:-1], "2", "--learn-steps", "0"]  # compare times the steps after the first: 2 at least
    args = ["compare", "--platform", "gpu", "--schedules", "gpipe,zb-h1,zb-h1+fuse", *sizes, "--ranks-as", "threads",
            "--out", str(tmp_path / "c.html"), "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    real_at = text.index("REAL runs on 2 simulated CPU devices")
    assert text.index("PROFILED gpipe") < real_at and text.index("PROFILED zb-h1") < real_at
    profiled = json.loads(out.read_text())["profiled"]
    assert [p["schedule"] for p in profiled] == ["gpipe", "zb-h1", "zb-h1+fuse"]  # fused by name too
    for p in profiled:
        t = zb.simulate(zb.build_schedule(p["schedule"], 2, 2), zb.Costs(**p["costs_seconds"]))
        assert p["simulated"]["makespan"] == pytest.approx(t.makespan, rel=1e-12)
    # same stages and microbatch: one profile
    assert profiled[0]["costs_seconds"] == profiled[1]["costs_seconds"] == profiled[2]["costs_seconds"]
