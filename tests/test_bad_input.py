"""Bad input gets one line naming what is wrong and what would be right (issue 31, part 4).

A one-character typo in a schedule CSV, NaN or overflowing numbers, NumPy integers, a scalar batch.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite.schedules.ir import Schedule

TYPOS = {  # the repros: stage 1 typed as 1000000, microbatch 0 as 10000000
    "stage": "0F0,0I0,0W0\n1000000F0,1000000I0,1000000W0\n",
    "microbatch": "0F10000000,0I0,0W0\n",
}


@pytest.mark.parametrize("what", sorted(TYPOS))
def test_an_index_far_beyond_the_rows_is_refused_in_one_line_before_anything_is_built(what):
    with pytest.raises(ValueError, match=rf"{what} 10+ is far beyond what the rows hold") as err:
        Schedule.from_csv_text(TYPOS[what])
    assert len(str(err.value)) < 300 and "\n" not in str(err.value)


@pytest.mark.parametrize("what", sorted(TYPOS))
def test_plan_from_csv_with_a_typo_answers_in_one_line(tmp_path, what):
    path = tmp_path / "typo.csv"
    path.write_text(TYPOS[what])
    out = subprocess.run([sys.executable, "-m", "zbpp_lite", "plan", "--from-csv", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "is far beyond what the rows hold" in out.stderr


def test_a_gap_in_the_stage_numbering_is_named_in_one_short_line():
    rows = [["0F0", "0I0", "0W0"], ["5F0", "5I0", "5W0"]]
    with pytest.raises(ValueError, match=r"no rank holds stage\(s\) 1, 2, 3, 4; stages must be numbered 0 .. 5"):
        Schedule.from_rows(rows)
    with pytest.raises(ValueError, match="num_microbatches 9 is more than the 6 action"):
        Schedule.from_rows(rows, num_microbatches=9)


@pytest.mark.parametrize("name", ["zb-auto", "zb-v"])
@pytest.mark.parametrize("limit", [float("nan"), float("inf"), [4.0, float("nan"), 4.0, 4.0]])
def test_a_memory_limit_that_is_not_finite_is_refused(name, limit):
    # NaN was taken as no limit by zb-auto and raised "cannot convert float NaN to integer" in zb-v
    with pytest.raises(ValueError, match=rf"^{name}: memory_limit must be finite"):
        zb.build_schedule(name, 4, 8, memory_limit=limit)


def test_costs_whose_sums_overflow_are_refused_in_one_line():
    with pytest.raises(ValueError, match="the simulated times overflow to infinity"):
        zb.simulate(zb.build_schedule("zb-h1", 4, 8), zb.Costs(f=1e308, comm=1e308))
    out = subprocess.run([sys.executable, "-m", "zbpp_lite", "plan", "--f", "1e308", "--comm", "1e308"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "overflow to infinity" in out.stderr


def test_numpy_integers_are_sizes_and_bools_and_floats_are_not():
    s = zb.build_schedule("zb-h1", np.int64(2), np.int32(4))
    assert s == zb.build_schedule("zb-h1", 2, 4) and type(s.num_microbatches) is int
    assert zb.build_schedule("interleaved-1f1b", 2, 4, stages_per_rank=np.int64(2)).num_stages == 4
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=rf"zb-h1: num_ranks must be an integer >= 1, got {bad!r}"):
            zb.build_schedule("zb-h1", bad, 4)


def test_a_scalar_batch_is_refused_in_one_line():
    from zbpp_lite.runtime.executor import PipelineExecutor
    from zbpp_lite.runtime.stages import StagedModel
    from zbpp_lite.training.model import ModelConfig, build_parts

    import jax

    model = StagedModel(build_parts(ModelConfig(d=8, heads=1, blocks=2)), 2)
    executor = PipelineExecutor(model, zb.build_schedule("1f1b", 2, 2), jax.devices()[:2])
    with pytest.raises(ValueError, match=r"^x is a scalar; give a batch \(b, \.\.\.\) with b divisible by 2"):
        executor.run(model.params, np.float32(1.0), np.int32(0))
