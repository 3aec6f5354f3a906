"""Post-validation (paper section 4): the host-side synchronous reference's refusals and the
synchronisation bubble post-validation removes. That the speculative steps, validated and rolled back,
give the synchronous step's parameters is tests/test_optimizer.py's."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import zbpp_lite as zb
from zbpp_lite.training.postval.optimizer import step_makespans, synchronous_step
from zbpp_lite.training.postval.rollback import AdamWConfig


def test_bad_arguments_are_refused():
    p = [{"w": jnp.ones(2)}]
    s = [AdamWConfig().optimizer().init(p[0])]
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        synchronous_step(p, s, p, AdamWConfig(), 0.0)
    with pytest.raises(ValueError, match="one entry per stage"):
        synchronous_step(p, s, p + p, AdamWConfig(), 1.0)


def test_post_validation_removes_zb_h2s_synchronisation_bubble_in_the_simulator():
    p = 4
    t = zb.simulate(zb.build_schedule("zb-h2", p, 12))
    spans = step_makespans(t, [0.5] * p, reduce_seconds=0.25)
    assert spans["post_validation"] == pytest.approx(t.makespan + 0.5)
    assert spans["synchronous"] == pytest.approx(t.global_span + 0.25 + 0.5)
    assert spans["synchronous"] - spans["post_validation"] == pytest.approx((p - 1) * 1.0 + 0.25)
