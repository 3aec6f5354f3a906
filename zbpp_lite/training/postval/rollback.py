"""In-place rollback of an Optax AdamW step (Qi et al., arXiv 2401.10241, section 4, algorithm 1).

Post-validation undoes a wrong speculative step without a copy of the old state: AdamW's update is
invertible given its gradient. optax.adamw(lr, b1, b2, eps, eps_root=0, weight_decay=wd), constant lr,
t the count after the update:

    mu_t = b1 mu + (1 - b1) g            nu_t = b2 nu + (1 - b2) g^2
    u    = (mu_t / (1 - b1^t)) / (sqrt(nu_t / (1 - b2^t)) + eps)
    p_t  = p - lr (u + wd p) = (1 - lr wd) p - lr u

so  mu = (mu_t - (1 - b1) g) / b1,  nu = (nu_t - (1 - b2) g^2) / b2,  p = (p_t + lr u) / (1 - lr wd),
and the count goes back by one. Everything is computed in float32.

Error per entry (float32, u32 = 2^-24 ~ 6e-8; :func:`rollback_error_bound`, checked by the tests):
    |p_rec - p|   <= 4 u32 (|p_t| + lr |u|) / (1 - lr wd)
    |mu_rec - mu| <= 4 u32 (|mu_t| + (1 - b1)|g|) / b1
    |nu_rec - nu| <= 4 u32 (|nu_t| + (1 - b2) g^2) / b2
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

U32 = 2.0**-24
"""float32 unit roundoff."""


@dataclass(frozen=True)
class AdamWConfig:
    """Hyper-parameters of ``optax.adamw`` with a constant learning rate (PyTorch's defaults
    apart from weight_decay, which PyTorch sets to 0.01)."""

    learning_rate: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        """Raises ValueError for settings the step cannot take (the rollback's: :meth:`check_invertible`)."""
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        for name in ("b1", "b2"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1) (the rollback divides by it), "
                                 f"got {getattr(self, name)}")
        if not self.eps > 0 or not self.weight_decay >= 0:
            raise ValueError(f"need eps > 0 and weight_decay >= 0; got eps={self.eps}, "
                             f"weight_decay={self.weight_decay}")

    def check_invertible(self) -> None:
        """Raises ValueError unless learning_rate * weight_decay < 1 (the rollback divides by 1 - lr wd)."""
        if not self.learning_rate * self.weight_decay < 1:
            raise ValueError("a rolled-back step needs learning_rate * weight_decay < 1 (it divides by "
                             "1 - lr * wd); got "
                             f"learning_rate={self.learning_rate}, weight_decay={self.weight_decay}")

    def optimizer(self) -> optax.GradientTransformation:
        """The matching ``optax.adamw``."""
        return optax.adamw(self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps,
                           weight_decay=self.weight_decay)


def _adam_state(opt_state) -> optax.ScaleByAdamState:
    adam = isinstance(opt_state, optax.ScaleByAdamState)
    state = opt_state[0] if isinstance(opt_state, tuple) and not adam else opt_state
    if not isinstance(state, optax.ScaleByAdamState):
        raise TypeError(f"expected the state of optax.adamw (ScaleByAdamState first), "
                        f"got {type(state).__name__}")
    return state


def _update(adam: optax.ScaleByAdamState, c: AdamWConfig):
    """The step's bias-corrected Adam direction u (module docstring), from its moments."""
    t = adam.count.astype(jnp.float32)
    bc1, bc2 = 1 - c.b1**t, 1 - c.b2**t
    return jax.tree.map(lambda m, v: (m / bc1) / (jnp.sqrt(v / bc2) + c.eps), adam.mu, adam.nu)


def adamw_rollback(params, opt_state, grads, config: AdamWConfig):
    """Undo one ``optax.adamw`` step of ``config`` that used ``grads`` (same tree as ``params``, float32):
    ``(params, opt_state)`` after it -> as before it (within :func:`rollback_error_bound`).

    Raises:
        TypeError: a state that is not optax.adamw's.
        ValueError: learning_rate * weight_decay >= 1 (:meth:`AdamWConfig.check_invertible`).
    """
    config.check_invertible()
    adam, c = _adam_state(opt_state), config
    lr, decay = c.learning_rate, 1 - c.learning_rate * c.weight_decay
    old_params = jax.tree.map(lambda p, u: (p + lr * u) / decay, params, _update(adam, c))
    mu = jax.tree.map(lambda m, g: (m - (1 - c.b1) * g) / c.b1, adam.mu, grads)
    # nu >= 0 always; float32 rounding of nu_t - (1 - b2) g^2 can leave a tiny negative value where
    # the step's g^2 dominated nu_t (a heavily clipped redo), and sqrt(negative) would be NaN
    nu = jax.tree.map(lambda v, g: jnp.maximum((v - (1 - c.b2) * g * g) / c.b2, 0.0), adam.nu, grads)
    restored = optax.ScaleByAdamState(count=adam.count - 1, mu=mu, nu=nu)
    bare = isinstance(opt_state, optax.ScaleByAdamState)
    return old_params, restored if bare else (restored, *opt_state[1:])


def rollback_error_bound(params, opt_state, grads, config: AdamWConfig):
    """Per-entry bounds ``(params, mu, nu)`` on the rollback's float32 error (module docstring),
    evaluated at the post-step values."""
    adam, c = _adam_state(opt_state), config
    lr, decay = c.learning_rate, 1 - c.learning_rate * c.weight_decay
    p_bound = jax.tree.map(lambda p, u: 4 * U32 * (jnp.abs(p) + lr * jnp.abs(u)) / decay, params,
                           _update(adam, c))
    mu_bound = jax.tree.map(lambda m, g: 4 * U32 * (jnp.abs(m) + (1 - c.b1) * jnp.abs(g)) / c.b1, adam.mu,
                            grads)
    nu_bound = jax.tree.map(lambda v, g: 4 * U32 * (jnp.abs(v) + (1 - c.b2) * g * g) / c.b2, adam.nu, grads)
    return p_bound, mu_bound, nu_bound
