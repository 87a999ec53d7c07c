"""Confidence intervals of accuracies measured on a finite number of samples."""

from __future__ import annotations

import math

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def wilson_interval(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion `correct / total`: unlike the normal approximation it stays within
    [0, 1] and is not empty at 0 or `total` correct, where retrieval accuracies often are."""
    if total < 1:
        raise ValueError("an interval needs at least one sample")
    share, spread = correct / total, z * z / total
    centre = (share + spread / 2) / (1 + spread)
    half = z / (1 + spread) * math.sqrt(share * (1 - share) / total + spread / (4 * total))
    return max(0.0, centre - half), min(1.0, centre + half)
