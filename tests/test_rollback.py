"""AdamW rollback (paper section 4, algorithm 1): a step followed by its rollback restores
parameters, both moments and the count within the stated float32 bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zbpp_lite.training.postval.rollback import AdamWConfig, adamw_rollback, rollback_error_bound


def _tree(key, scale):
    k1, k2 = jax.random.split(key)
    return {"w": scale * jax.random.normal(k1, (17, 9)), "b": scale * jax.random.normal(k2, (9,))}


@pytest.mark.parametrize("steps_before", [0, 1, 7])
@pytest.mark.parametrize("grad_scale", [1e-4, 1.0, 30.0])
def test_step_then_rollback_restores_state_within_the_bound(steps_before, grad_scale):
    cfg = AdamWConfig(learning_rate=1e-2, weight_decay=0.01)
    opt = cfg.optimizer()
    params = _tree(jax.random.PRNGKey(0), 1.0)
    state = opt.init(params)
    for i in range(steps_before):  # build up non-trivial moments
        g = _tree(jax.random.PRNGKey(100 + i), grad_scale)
        upd, state = opt.update(g, state, params)
        params = optax.apply_updates(params, upd)
    g = _tree(jax.random.PRNGKey(7), grad_scale)
    upd, new_state = opt.update(g, state, params)
    new_params = optax.apply_updates(params, upd)

    back_params, back_state = adamw_rollback(new_params, new_state, g, cfg)
    p_bound, mu_bound, nu_bound = rollback_error_bound(new_params, new_state, g, cfg)
    assert int(back_state[0].count) == steps_before
    for got, want, bound in [
        (back_params, params, p_bound),
        (back_state[0].mu, state[0].mu, mu_bound),
        (back_state[0].nu, state[0].nu, nu_bound),
    ]:
        for k in want:
            err = np.abs(np.asarray(got[k]) - np.asarray(want[k]))
            assert np.all(err <= np.asarray(bound[k]) + 1e-30), (k, err.max(), np.asarray(bound[k]).max())
    # the rollback really moved something: the step changed params by far more than the bound
    assert float(jnp.max(jnp.abs(new_params["w"] - params["w"]))) > 1e3 * float(jnp.max(p_bound["w"]))


def test_rollback_refuses_a_foreign_state():
    with pytest.raises(TypeError, match="optax.adamw"):
        adamw_rollback({"w": jnp.ones(2)}, optax.sgd(0.1).init({"w": jnp.ones(2)}), {"w": jnp.ones(2)}, AdamWConfig())


def test_a_plain_step_takes_any_learning_rate_and_only_a_rollback_needs_lr_times_wd_below_one():
    # a diverging run (lr 1e30) is the user's to try; undoing its step would divide by 1 - lr * wd < 0
    cfg = AdamWConfig(learning_rate=1e30, weight_decay=0.01)
    with pytest.raises(ValueError, match=r"learning_rate \* weight_decay < 1"):
        cfg.check_invertible()
    AdamWConfig(learning_rate=1e-2, weight_decay=0.01).check_invertible()
    params = {"w": jnp.ones(3)}
    state = cfg.optimizer().init(params)
    with pytest.raises(ValueError, match=r"learning_rate \* weight_decay < 1"):
        adamw_rollback(params, state, params, cfg)
