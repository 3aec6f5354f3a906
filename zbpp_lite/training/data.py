"""scikit-learn's bundled handwritten digits as sequences of 8 row tokens, batched as the PyTorch
benchmark (``shared/peers/torch_pp_bench.py``) batches them.

1,797 images, each 8 row tokens of 8 pixels / 16 (float32 in [0, 1]); labels int32 in 0..9. Step k
uses ``perm[(k * batch + arange(batch)) % n]``, ``perm = np.random.default_rng(seed).permutation(n)``.
``holdout`` > 0 (ours): the test set is the last ``round(holdout * 1797)`` of
``default_rng(seed + 1).permutation(1797)``, training the rest in order; ``holdout=0``: the PyTorch
script's batches, tested on all samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_SAMPLES = 1797


def load_digit_tokens() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits: ``x`` (1797, 8, 8) float32 in [0, 1] (rows as tokens), ``y`` (1797,) int32."""
    from sklearn.datasets import load_digits  # lazy: scikit-learn takes seconds to import, needed once

    digits = load_digits()
    return (digits.images / 16.0).astype(np.float32), digits.target.astype(np.int32)


def batch_indices(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """Sample indices of training step ``step``: ``perm[(step * batch + arange(batch)) % n]``."""
    perm = np.random.default_rng(seed).permutation(n)
    return perm[(step * batch + np.arange(batch)) % n]


@dataclass(frozen=True)
class Digits:
    """Training samples ``train_x`` (n, 8, 8) float32, ``train_y`` (n,) int32; ``test_x``, ``test_y``
    held out (all samples when ``holdout`` is 0); ``seed`` of the batch order (+1: of the split)."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    holdout: float
    seed: int

    def batch(self, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The global batch of training step ``step``: inputs (b, 8, 8) and labels (b,)."""
        idx = batch_indices(len(self.train_y), batch_size, step, self.seed)
        return self.train_x[idx], self.train_y[idx]


def load_digits(holdout: float = 0.0, seed: int = 0) -> Digits:
    """The digits with ``holdout`` of them held out for testing (see the module docstring).

    Raises:
        ValueError: ``holdout`` outside [0, 1) or one that leaves no test or no training sample.
    """
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    x, y = load_digit_tokens()
    n_test = round(holdout * NUM_SAMPLES)
    if holdout > 0 and not 0 < n_test < NUM_SAMPLES:
        raise ValueError(f"holdout {holdout} leaves {n_test} test samples of {NUM_SAMPLES}; "
                         "choose a larger or smaller fraction")
    if n_test == 0:
        return Digits(x, y, x, y, holdout, seed)
    test = np.sort(np.random.default_rng(seed + 1).permutation(NUM_SAMPLES)[NUM_SAMPLES - n_test :])
    train = np.setdiff1d(np.arange(NUM_SAMPLES), test)
    return Digits(x[train], y[train], x[test], y[test], holdout, seed)
