"""Is a measured gain real? Paired step-by-step ratios and a distribution-free interval (pure Python).

Two plans taking turns step by step meet the machine's drift alike, so the ratio of their step-k
makespans cancels most of it. :func:`paired_gain` gives the median ratio with a sign-test interval
(order statistics, no assumption on the noise's shape). A gain counts when the whole interval lies
below 1; an A/A control (the same plan twice) measures the run's noise.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(low, high, coverage)`` for the median of ``values``: the k-th smallest and largest, k the
    largest with 2 * P[Binomial(n, 1/2) < k] <= 1 - confidence. Fewer than 6 values cannot reach 95%:
    then k = 1 and ``coverage`` says what they give.

    Raises:
        ValueError: no values, a value that is not finite, or ``confidence`` outside (0, 1).
    """
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("a median interval needs at least one value")
    if not all(math.isfinite(v) for v in xs):
        raise ValueError(f"values must be finite, got {xs}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    n = len(xs)
    below = [math.comb(n, i) / 2**n for i in range(n + 1)]
    k, tail = 1, below[0]  # tail = P[B <= k - 1]
    while k < (n + 1) // 2 and 2 * (tail + below[k]) <= 1 - confidence:
        tail += below[k]
        k += 1
    return xs[k - 1], xs[n - k], 1 - 2 * tail


@dataclass(frozen=True)
class PairedGain:
    """``after`` vs ``before`` step by step: ``ratios`` after_k / before_k, ``ratio`` their median,
    ``low`` .. ``high`` its :func:`median_interval` with ``coverage``; ``confidence`` the one asked."""

    ratios: tuple[float, ...]
    ratio: float
    low: float
    high: float
    coverage: float
    confidence: float = 0.95

    @property
    def gain(self) -> float:
        """1 - ratio: the fraction of ``before``'s makespan saved (negative: slower)."""
        return 1.0 - self.ratio

    @property
    def faster(self) -> bool:
        """The whole interval lies below 1 at the confidence asked for."""
        return self.high < 1.0 and self.coverage >= self.confidence

    @property
    def slower(self) -> bool:
        """The whole interval lies above 1 (and it reaches the confidence asked for)."""
        return self.low > 1.0 and self.coverage >= self.confidence

    @property
    def deviation(self) -> float:
        """The farthest an end of the interval lies from 1 (for an A/A control: the run's noise)."""
        return max(abs(1.0 - self.low), abs(self.high - 1.0))

    def text(self) -> str:
        """E.g. ``0.812 (interval 0.790 .. 0.840, 98%; 19 steps)``."""
        return (f"{self.ratio:.3f} (interval {self.low:.3f} .. {self.high:.3f}, {self.coverage:.0%}; "
                f"{len(self.ratios)} steps)")

    def to_json(self) -> dict:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "coverage": self.coverage,
                "gain": self.gain, "ratios": list(self.ratios)}


def paired_gain(before: Sequence[float], after: Sequence[float], confidence: float = 0.95) -> PairedGain:
    """Compare two plans' per-step figures (seconds), step k with step k.

    Raises:
        ValueError: different lengths, no steps, or a figure that is not positive.
    """
    if len(before) != len(after):
        raise ValueError(f"paired steps need as many 'before' as 'after' figures, got {len(before)} and "
                         f"{len(after)}")
    if not before:
        raise ValueError("paired steps need at least one step")
    if not all(b > 0 and a > 0 for b, a in zip(before, after)):
        raise ValueError("paired figures must be positive (seconds)")
    ratios = tuple(a / b for b, a in zip(before, after))
    low, high, coverage = median_interval(ratios, confidence)
    return PairedGain(ratios, statistics.median(ratios), low, high, coverage, confidence)


def beats_noise(candidate: PairedGain, control: PairedGain | None = None) -> bool:
    """``candidate`` is :attr:`~PairedGain.faster` and, with an A/A ``control``, gains more than its
    :attr:`~PairedGain.deviation`."""
    return candidate.faster and (control is None or candidate.gain > control.deviation)
