"""Is a measured gain real? Paired step-by-step ratios and a distribution-free interval (pure Python).

Two plans that take turns step by step (step k of each on batch k, one right after the other)
meet the machine's drift alike, so the ratio of their step k makespans cancels most of it. Over
n such steps, :func:`paired_gain` gives the median ratio and a distribution-free confidence
interval for it, from order statistics (the sign-test interval: the k-th smallest and k-th
largest ratio, k from the binomial(n, 1/2) distribution, no assumption about the noise's shape).
A gain counts when the whole interval lies below 1; a plan run against an identical copy of
itself in the same run (an A/A control) shows how far apart two identical plans measure: the
run-to-run noise.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of ``values``: ``(low, high,
    coverage)``, the k-th smallest and k-th largest value for the largest k whose interval covers
    the median with probability at least ``confidence`` (2 * P[Binomial(n, 1/2) < k] <= 1 -
    confidence), and that probability. Fewer than 6 values cannot reach 95%: then k = 1 (the
    smallest and largest value) and ``coverage`` says what they give.

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
    """``after`` against ``before``, step by step: ``ratios`` after_k / before_k, ``ratio`` their
    median, ``low`` .. ``high`` its distribution-free interval (:func:`median_interval`) with the
    probability ``coverage`` of holding the true median ratio; ``confidence`` the coverage asked for
    (fewer than 6 steps cannot reach 95%, and then no difference counts)."""

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
        """The whole interval lies below 1 (and it reaches the confidence asked for): ``after`` is
        faster beyond this run's noise."""
        return self.high < 1.0 and self.coverage >= self.confidence

    @property
    def slower(self) -> bool:
        """The whole interval lies above 1 (and it reaches the confidence asked for)."""
        return self.low > 1.0 and self.coverage >= self.confidence

    @property
    def deviation(self) -> float:
        """The farthest an end of the interval lies from 1 (for an A/A control: how far apart two
        identical plans can measure in this run)."""
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
    """Whether ``candidate`` is faster beyond the run's noise: its whole interval lies below 1,
    and, with an A/A ``control`` (the same plan measured twice in the same run), its gain also
    exceeds how far apart the identical plans measured (:attr:`PairedGain.deviation`)."""
    return candidate.faster and (control is None or candidate.gain > control.deviation)
