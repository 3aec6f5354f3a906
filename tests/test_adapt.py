"""The adapt path on real (simulated CPU) devices, tiny model: any partition and any re-planned
schedule keep the unpartitioned model's loss and gradients; the parts profile feeds the
rebalancer; the ``adapt`` command checks its arguments and writes before / after and the changes."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite.cli import main
from zbpp_lite.training.data import load_digit_tokens
from zbpp_lite.runtime.executor import PipelineExecutor
from zbpp_lite.analysis.profiling.parts import profile_parts
from zbpp_lite.training.model import ModelConfig, build_parts
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.analysis.rebalance import best_partition, imbalanced_parts
from zbpp_lite.analysis.replan import replan
from zbpp_lite.training.reference import max_relative_error

DEVICES = jax.devices()
CONFIG = ModelConfig(d=8, heads=2, blocks=6)
X, Y = load_digit_tokens()


def test_every_partition_and_a_replanned_schedule_keep_the_unpartitioned_gradients():
    """The imbalanced 2 / 4 split and the rebalanced 3 / 3 split, each run with ZB-H1 and with
    zb-auto planned for a 2x slower last stage: the loss and every gradient are the
    unpartitioned model's."""
    m = 4
    x, y = X[: 2 * m], Y[: 2 * m]
    reference_model = StagedModel(build_parts(CONFIG), 2)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference_model.loss))(reference_model.params, x, y)
    auto = replan(zb.Costs(f=[1, 2], b=[1, 2], w=[1, 2]), 2, m).schedule
    for parts in (imbalanced_parts(6, 2, 2.0), ((0, 1, 2, 3), (4, 5, 6, 7))):
        model = StagedModel(build_parts(CONFIG), 2, parts=parts)
        assert model.parts == [list(p) for p in parts]
        for schedule in (zb.build_schedule("zb-h1", 2, m), auto):
            result = PipelineExecutor(model, schedule, DEVICES[:2]).run(model.params, x, y)
            assert abs(result.loss - float(ref_loss)) < 1e-5
            assert max_relative_error(result.grads, ref_grads) < 1e-5


def test_a_partition_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="parts must split"):
        StagedModel(build_parts(CONFIG), 2, parts=[[0, 1, 3], [2, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="parts must split"):
        StagedModel(build_parts(CONFIG), 3, parts=[[0, 1, 2, 3], [4, 5, 6, 7]])


def test_profiled_part_costs_feed_the_rebalancer():
    model = StagedModel(build_parts(CONFIG), 2)
    costs = profile_parts(model, X[:4], Y[:4], DEVICES[0], repeats=3)
    assert costs.num_parts == CONFIG.blocks + 2
    assert all(v > 0 for v in (*costs.f, *costs.b, *costs.w))
    parts = best_partition(costs, 2)
    StagedModel(build_parts(CONFIG), 2, parts=parts)  # a partition the model accepts
    with pytest.raises(ValueError, match="repeats"):
        profile_parts(model, X[:4], Y[:4], repeats=0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--imbalance", "0.5"], "--imbalance must be >= 1"),
        (["--ranks", "1"], "--ranks must be >= 2"),
        (["--steps", "1"], "--steps and --profile-steps must be >= 2"),
        (["--imbalance", "2", "--blocks", "2"], "blocks"),
        (["--batch", "30"], "does not divide"),
    ],
)
def test_the_adapt_command_refuses_bad_arguments_before_running(args, message, capsys):
    assert main(["adapt", "--microbatches", "4", *args]) == 2
    assert message in capsys.readouterr().err


def test_the_adapt_command_profiles_replans_and_keeps_the_gradients(tmp_path, capsys):
    """Rank threads, tiny model, imbalance 2, every adaptation forced on (gain thresholds 0, a check every step):
    the JSON holds before and after with measured makespan and bubble rate, the changes made,
    and gradients equal to the unpartitioned model's at the first step of every plan."""
    out = tmp_path / "runs" / "adapt.json"  # a folder made before the run (cli.prepare_outputs)
    code = main([
        "adapt", "--ranks", "2", "--microbatches", "2", "--steps", "3", "--profile-steps", "2",
        "--imbalance", "2", "--d", "8", "--heads", "2", "--batch", "8",
        "--every", "1", "--threshold", "0", "--patience", "1", "--min-gain", "0", "--json", str(out), "--threads",
    ])
    assert code == 0
    text = capsys.readouterr().out
    assert "idle time by cause" in text and "after / before measured makespan" in text
    data = json.loads(out.read_text())
    for phase in ("before", "after"):
        assert data[phase]["makespan"] > 0 and 0 <= data[phase]["bubble_rate"] < 1
        assert data[phase]["grad_max_rel_error"] < 1e-5 and data[phase]["loss_error"] < 1e-5
    assert data["before"]["parts"] == [[0, 1, 2], [3, 4, 5, 6, 7]] and data["before"]["schedule"] == "zb-h1"
    assert len(data["before"]["steps"]) == 2 and len(data["after"]["steps"]) == 3
    kinds = [c["kind"] for c in data["changes"]]
    assert kinds[:2] == ["rebalance", "replan"]
    rebalance = data["changes"][0]
    assert data["after"]["parts"] == (rebalance["to"] if rebalance["adopted"] else rebalance["from"])
    assert "note: ranks run as threads of one process (--threads)" in text
    assert len(data["online_checks"]) == 3
    assert data["online_checks"][0]["decision"] == "reference"  # the first window is what drift is measured from
    assert all(c["decision"] == "steady" for c in data["online_checks"][1:])  # one step a window: never significant
    switched = sum(c["decision"] == "switched" for c in data["online_checks"])
    assert kinds.count("online-replan") == switched
    assert set(data["before"]["attribution"]["by_cause"]) >= {"warm-up", "cool-down", "imbalance", "communication"}
    assert np.isclose(data["makespan_ratio"], data["after"]["makespan"] / data["before"]["makespan"])


def test_adapt_settings_route_names_to_the_options_the_model_and_the_run():
    """``adapt(ranks=2, d=128, ...)``, as the notebook calls it: every setting lands in its config,
    ``seed`` in both the model's and the run's, the blocks default to :func:`default_blocks`."""
    from zbpp_lite.training.adapt import AdaptOptions, adapt_settings, default_blocks

    options, model, run = adapt_settings(ranks=3, steps=12, imbalance=2.0, d=128, batch=96, seed=5)
    assert (options.ranks, options.steps, options.imbalance) == (3, 12, 2.0)
    assert (model.d, model.seed, model.blocks) == (128, 5, default_blocks(3, 2.0))
    assert (run.batch, run.seed) == (96, 5)
    assert adapt_settings(blocks=None)[1].blocks == default_blocks(2, 2.0)
    with pytest.raises(TypeError, match="unknown setting"):
        adapt_settings(replan=False)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        AdaptOptions(ranks=1)
    with pytest.raises(ValueError, match="confidence must lie in"):
        AdaptOptions(confidence=1.0)
