"""Robust statistics: the one place median, MAD and outlier thresholds are defined.

Everything that asks "is this value unusually high?" (the live line, auto-profiling,
straggler and window detection, verdicts) uses these, so one rule of thumb holds across the
tool: a value is unusual when it sits more than ``k`` robust sigmas above the median, where a
robust sigma is ``MAD_SCALE * MAD`` (equal to the standard deviation for normal noise but
unmoved by a few outliers), and more than a floor that keeps near-noiseless data from
flagging microseconds.

Pure Python on purpose: the recording side (live view, auto-profile) imports it, and it must
not pull in duckdb or numpy-heavy machinery.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

#: Scales the median absolute deviation to a standard deviation under normal noise.
MAD_SCALE = 1.4826

#: Default distance, in robust sigmas, beyond which a value is called unusual.
SIGMAS = 5.0


def median(values: Iterable[float]) -> float:
    """The median (mean of the two middle values for an even count); 0.0 when empty."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        return 0.0
    mid = n // 2
    return float(v[mid]) if n % 2 else 0.5 * (float(v[mid - 1]) + float(v[mid]))


def mad(values: Sequence[float], center: float | None = None) -> float:
    """Median absolute deviation from ``center`` (the median when omitted)."""
    if not values:
        return 0.0
    c = median(values) if center is None else center
    return median(abs(x - c) for x in values)


def robust_sigma(values: Sequence[float]) -> float:
    """``MAD_SCALE * MAD``: a standard deviation that a few outliers do not move."""
    return MAD_SCALE * mad(values)


def threshold(values: Sequence[float], k: float = SIGMAS, floor: float = 0.0) -> float:
    """Distance above the median past which a value is unusual: ``max(k * sigma, floor)``."""
    return max(k * robust_sigma(values), floor)


def upper_bound(values: Sequence[float], k: float = SIGMAS, floor: float = 0.0) -> float:
    """``median + threshold``: the value above which a new sample is unusual."""
    return median(values) + threshold(values, k, floor)
