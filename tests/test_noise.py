"""Judging measured gains against noise (zbpp_lite.analysis.noise) and significant drift
(zbpp_lite.analysis.replan.significant_drift): the sign-test interval's closed form, paired
ratios, and that noise alone is never called a gain or a drift."""

from __future__ import annotations

import math
import random

import pytest

import zbpp_lite as zb
from zbpp_lite.analysis.noise import beats_noise, median_interval, paired_gain
from zbpp_lite.analysis.replan import OnlineReplanner, replan, significant_drift


def test_the_median_interval_is_the_sign_test_interval():
    """n = 19 at 95%: the 5th smallest and 5th largest value, coverage 1 - 2 P[B(19, 1/2) <= 4]."""
    values = list(range(1, 20))
    random.Random(0).shuffle(values)
    low, high, coverage = median_interval(values, 0.95)
    assert (low, high) == (5, 15)
    assert coverage == pytest.approx(1 - 2 * sum(math.comb(19, i) for i in range(5)) / 2**19)
    assert coverage >= 0.95
    assert median_interval([3.0, 1.0, 2.0], 0.95)[:2] == (1.0, 3.0)  # too few: the extremes, low coverage
    assert median_interval([3.0, 1.0, 2.0], 0.95)[2] < 0.95
    for bad in ([], [1.0, float("nan")]):
        with pytest.raises(ValueError):
            median_interval(bad)
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0], 1.5)


def test_a_real_gain_is_found_and_noise_alone_is_not():
    rng = random.Random(1)
    drift = [1 + 0.5 * math.sin(k / 3) for k in range(30)]  # the machine slows and speeds up: both plans meet it alike
    before = [d * rng.uniform(0.95, 1.05) for d in drift]
    faster = [0.8 * d * rng.uniform(0.95, 1.05) for d in drift]
    same = [d * rng.uniform(0.95, 1.05) for d in drift]
    gain, control = paired_gain(before, faster), paired_gain(before, same)
    assert gain.faster and 0.15 < gain.gain < 0.25 and beats_noise(gain, control)
    assert not control.faster and not control.slower and not beats_noise(control, control)
    assert control.deviation < 0.1
    few = paired_gain(before[:4], faster[:4])  # every step faster, yet 4 steps cannot reach 95%
    assert few.high < 1 and not few.faster
    with pytest.raises(ValueError, match="as many"):
        paired_gain([1.0], [1.0, 2.0])


def test_drift_counts_only_when_significant_and_large():
    rng = random.Random(2)
    p = 2
    noisy = lambda scale: [zb.Costs(f=[scale * rng.uniform(0.8, 1.2) for _ in range(p)], b=[1.0, 1.0], w=[1.0, 1.0])  # noqa: E731
                           for _ in range(12)]
    reference = noisy(1.0)  # 12 paired steps: enough for the 8 tests of 2 stages at 95% together
    assert not significant_drift(reference, noisy(1.0), p, 0.05)[1]        # noise: +-20% per step
    moved, significant = significant_drift(reference, noisy(2.0), p, 0.15)  # T_F doubled
    assert significant and moved > 0.2
    assert not significant_drift(reference, noisy(2.0), p, 0.5)[1]          # significant, but below the threshold
    assert not significant_drift(reference[:3], noisy(2.0)[:3], p, 0.15)[1]  # 3 steps cannot show it


@pytest.mark.parametrize("seed", range(2))
def test_with_a_confidence_the_online_replanner_ignores_noise_even_without_a_threshold(seed):
    """Threshold 0, patience 1, min_gain 0 flip plans on +-20% noise (see test_replan); judged
    against the step-to-step noise (with patience 2), they do not, while a real T_comm drift still re-plans."""
    rng = random.Random(seed)
    mean = zb.Costs()

    def noisy(costs):
        t = costs.table(3)
        j = lambda v: [x * rng.uniform(0.8, 1.2) for x in v]  # noqa: E731
        return zb.Costs(f=j(t.f), b=j(t.b), w=j(t.w), comm=t.comm[0])

    online = OnlineReplanner(replan(mean, 3, 6).schedule, mean, every=10, threshold=0.0, patience=2, min_gain=0.0, confidence=0.95)
    for _ in range(200):
        assert online.observe(zb.simulate(online.schedule, noisy(mean))) is None
    assert online.history[0].decision == "reference"
    assert all(c.decision == "steady" for c in online.history[1:]) and len(online.history) == 20
    drifted = zb.Costs(comm=0.5)
    decisions = [online.observe(zb.simulate(online.schedule, noisy(drifted))) for _ in range(40)]
    assert any(d is not None for d in decisions) or online.history[-1].decision in ("kept", "switched")


def test_the_compare_summary_calls_a_schedule_fastest_only_beyond_the_noise():
    """The main job's headline: the lowest median step is "fastest" only when its steps, paired with
    1f1b's, give a ratio interval wholly below 1; otherwise the ratio, its interval and the verdict."""
    from types import SimpleNamespace

    from zbpp_lite.cli.compare_report import lead

    def run(name, seconds):
        return SimpleNamespace(schedule=SimpleNamespace(name=name), step_seconds=[9.0, *seconds])

    rng = random.Random(0)
    base = [0.1 + 0.02 * rng.random() for _ in range(30)]
    ahead = run("zb-h1", [0.9 * s for s in base])                     # every step 10% faster
    level = run("zb-h1", [s * (0.97 if k % 2 else 1.02) for k, s in enumerate(base)])
    behind = run("zb-h1", [1.05 * s for s in base])
    one_f = run("1f1b", base)
    assert lead(ahead, one_f) == "zb-h1 was fastest"
    assert lead(level, one_f).startswith("zb-h1 had the lowest median step, taking 0.995 [0.970, 1.020]")   # half the steps 0.97, half 1.02
    assert lead(level, one_f).endswith("(no gain beyond the noise)")
    assert lead(behind, one_f).endswith("(slower step by step)")
    assert lead(one_f, one_f) == lead(one_f, None) == "1f1b was fastest"   # 1f1b itself, or no 1f1b run
