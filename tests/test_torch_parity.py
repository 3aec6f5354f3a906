"""Loss parity with PyTorch: from PyTorch's initial weights our training gives PyTorch's losses,
step for step, within 1e-4 (issue 9), for the pipeline schedules and the single-device baseline.

Two checks:
- against stored figures (no PyTorch needed): ``tests/artifacts/torch_small_losses.json`` holds
  the losses of PyTorch's baseline and 1F1B runs of a small job and ``torch_small_init.npz`` its
  initial weights; both made with torch 2.13.0 (CPU), from the repository root, by
      python ../shared/peers/torch_pp_bench.py --d 32 --blocks 2 --batch 64 --microbatches 4 \\
          --steps 5 --warmup 0 --schedules baseline,1F1B \\
          --save-init tests/artifacts/torch_small_init.npz --json small.json
  then copying ``config``, ``results[*].train_losses`` and ``results[*].eval_loss`` of
  small.json into the JSON file (its keys say which is which);
- live, against PyTorch itself, when a Python with torch is found (``ZBPP_TORCH_PYTHON``, else
  /work/torchvenv/bin/python) along with the peer script; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

from zbpp_lite.training.model import ModelConfig
from zbpp_lite.training.reference import train_baseline
from zbpp_lite.training.train import RunConfig, TrainOptions, train

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tests" / "artifacts"
PEER_SCRIPT = ROOT.parent / "shared" / "peers" / "torch_pp_bench.py"
DEVICES = jax.devices()
TOLERANCE = 1e-4


def _golden() -> dict:
    with open(ARTIFACTS / "torch_small_losses.json") as f:
        return json.load(f)


def _ours(name: str, cfg: dict, init: Path, steps: int):
    model = ModelConfig(d=cfg["d"], heads=cfg["heads"], blocks=cfg["blocks"], seed=cfg["seed"])
    run = RunConfig(batch=cfg["batch"], lr=cfg["lr"], seed=cfg["seed"], holdout=0.0, init=init, check_grads=False)
    if name == "baseline":
        return train_baseline(steps, model=model, run=run, device=DEVICES[0])
    return train(name, 2, cfg["microbatches"], steps, model=model, run=run, options=TrainOptions(devices=DEVICES[:2]))


@pytest.mark.parametrize("name", ["baseline", "1f1b", "zb-h1", "zb-h2"])
def test_losses_equal_pytorch_step_for_step_from_its_initial_weights(name):
    golden = _golden()
    cfg = golden["config"]
    steps = cfg["warmup"] + cfg["steps"]
    ours = _ours(name, cfg, ARTIFACTS / "torch_small_init.npz", steps)
    for torch_run in ("baseline", "1F1B"):
        expected = golden["losses"][torch_run]
        assert len(expected) == steps
        diff = np.abs(np.asarray(ours.losses) - np.asarray(expected))
        assert diff.max() <= TOLERANCE, f"{name} vs PyTorch {torch_run}: step {int(diff.argmax())} differs by {diff.max():.2e}"
        assert abs(ours.test_loss - golden["eval_loss"][torch_run]) <= TOLERANCE
    assert ours.losses[-1] < ours.losses[0]  # it trains


def _torch_python() -> str:
    return os.environ.get("ZBPP_TORCH_PYTHON") or "/work/torchvenv/bin/python"


def test_losses_equal_a_live_pytorch_run(tmp_path):
    python = _torch_python()
    if not PEER_SCRIPT.exists():
        pytest.skip(f"PyTorch's side of the benchmark is not at {PEER_SCRIPT}")
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True) if Path(python).exists() else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"no PyTorch: {python} cannot import torch (set ZBPP_TORCH_PYTHON to a Python that can)")
    init, out = tmp_path / "init.npz", tmp_path / "torch.json"
    cfg = {"d": 16, "heads": 2, "blocks": 2, "batch": 32, "microbatches": 4, "lr": 1e-3, "seed": 3}
    command = [python, str(PEER_SCRIPT), "--d", "16", "--heads", "2", "--blocks", "2", "--batch", "32",
               "--microbatches", "4", "--seed", "3", "--steps", "3", "--warmup", "0", "--schedules", "baseline",
               "--save-init", str(init), "--json", str(out), "--no-pin"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    expected = json.loads(out.read_text())["results"]["baseline"]["train_losses"]
    for name in ("baseline", "zb-h1"):
        ours = _ours(name, cfg, init, 3)
        np.testing.assert_allclose(ours.losses, expected, rtol=0, atol=TOLERANCE, err_msg=name)


def test_one_executor_per_rank_gives_the_whole_pipelines_loss_and_gradients():
    """PyTorch's set-up, one process per rank, here two executors in one process: each runs its
    own rank's instructions and reaches the other through processes.connect's transport (a socket pair
    and shared-memory rings, NumPy arrays as a pipe carries them)."""
    import zbpp_lite as zb
    from test_byo_model import run_one_process_per_rank
    from zbpp_lite.training.data import load_digit_tokens
    from zbpp_lite.runtime.executor import PipelineExecutor
    from zbpp_lite.training.model import ModelConfig, build_parts
    from zbpp_lite.runtime.stages import StagedModel

    x, y = load_digit_tokens()
    x, y = x[:8], y[:8]
    schedule = zb.build_schedule("zb-v", 2, 4, costs=zb.Costs())  # V placement: two stages per rank
    model = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=4)), schedule.num_stages)
    results = run_one_process_per_rank(model, schedule, lambda executor: executor.run(model.params, x, y))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(model.loss))(model.params, x, y)
    last = schedule.placement[-1]
    assert abs(results[last].loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for s in range(schedule.num_stages):
        mine = results[schedule.placement[s]]
        for i in model.parts[s]:
            for g, ref in zip(jax.tree_util.tree_leaves(mine.grads[i]), jax.tree_util.tree_leaves(ref_grads[i]), strict=True):
                assert np.abs(np.asarray(g) - np.asarray(ref)).max() <= 1e-5 * np.abs(np.asarray(ref)).max()
        assert all(e.rank == schedule.placement[s] for e in mine.timeline.events if e.action.stage == s)
    # aligned by started_at (the clock both share), the two ranks' events form one timeline in
    # which every action starts after what it needs has ended, on the other rank too
    from zbpp_lite.schedules.ir import deps, produces
    from zbpp_lite.schedules.timeline import Event, Timeline

    origin = min(r.started_at for r in results.values())
    merged = Timeline.from_events([Event(e.rank, e.action, e.start + r.started_at - origin, e.end + r.started_at - origin)
                                   for r in results.values() for e in r.timeline.events], 2, source="measured")
    ends = {key: e.end for e in merged.events for key in produces(e.action)}
    crossings = 0
    for e in merged.events:
        for key in deps(e.action, schedule.num_stages):
            assert e.start >= ends[key], (e.action, key)
            crossings += schedule.placement[key[1]] != e.rank
    assert crossings == 2 * 2 * schedule.num_microbatches  # zb-v: 2 of its 3 stage boundaries cross, both ways
    # a message for a rank of another process is refused at once, not at the next step
    from zbpp_lite.runtime.processes import Rings
    from zbpp_lite.runtime.transport import OptimizerMessage, Threads

    with pytest.raises(ValueError, match="a message .* for rank 1, which is not a rank of this process"):
        Rings(None, {1: None}).arrive(OptimizerMessage("FULL", 0), (1.0, True, True), 0, 1)
    with pytest.raises(ValueError, match="needs transport="):
        PipelineExecutor(model, schedule, [DEVICES[0]], ranks=[0])
    with pytest.raises(ValueError, match=r"ranks must be distinct ranks of the schedule \(0..1\)"):
        PipelineExecutor(model, schedule, [DEVICES[0]], ranks=[2], transport=Threads())
