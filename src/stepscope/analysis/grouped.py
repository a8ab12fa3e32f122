"""Order statistics over many groups at once, on fixed-dtype numpy columns.

The vectorised form of :func:`stepscope.common.robust.median` and ``mad`` (that module stays
pure Python for the recording side): groups of equal size are stacked into one matrix and
partitioned along its rows (``np.partition``, linear time), so thousands of (rank, phase)
series or (step, phase) cells cost a few numpy calls, not one Python sort each. Same
definitions: the median of an even count is the mean of the two middle values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def group_order(group: Any, n_groups: int) -> tuple[Any, Any, Any]:
    """Rows of each group id ``0..n_groups-1`` made contiguous: (row order, start of each
    group in that order, count of each group)."""
    g = np.asarray(group, dtype=np.int64)
    if len(g) and (int(g.min()) < 0 or int(g.max()) >= n_groups):
        raise ValueError(f"group ids must lie in 0..{n_groups - 1}, got {int(g.min())}..{int(g.max())}")
    # A stable sort of small integers is a radix sort in numpy (linear).
    key = g.astype(np.uint16) if n_groups <= 1 << 16 else g
    order = np.argsort(key, kind="stable")
    counts = np.bincount(g, minlength=n_groups).astype(np.int64)
    return order, starts_of(counts), counts


def starts_of(counts: Any) -> Any:
    """Start offsets of contiguous groups of these sizes."""
    starts = np.zeros(len(counts), dtype=np.int64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=starts[1:])
    return starts


def order_stats(values: Any, starts: Any, counts: Any,
                positions: Callable[[int], list[int]]) -> list[Any]:
    """Order statistics of contiguous groups: for a group of size L, the values at sorted
    positions ``positions(L)`` (one output array per position; NaN where a position lies
    outside 0..L-1 or the group is empty)."""
    v = np.asarray(values, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    n_out = len(positions(1))
    out = [np.full(len(counts), np.nan) for _ in range(n_out)]
    for size in np.unique(counts).tolist():
        if size <= 0:
            continue
        pos = positions(int(size))
        valid = sorted({p for p in pos if 0 <= p < size})
        if not valid:
            continue
        sel = np.flatnonzero(counts == size)
        mat = v[starts[sel, None] + np.arange(size)]  # one group per row
        mat.partition(valid, axis=1)
        for i, p in enumerate(pos):
            if 0 <= p < size:
                out[i][sel] = mat[:, p]
    return out


def _middle(size: int) -> list[int]:
    return [(size - 1) // 2, size // 2]


def medians_contiguous(values: Any, starts: Any, counts: Any) -> Any:
    """Median of each contiguous group (NaN for an empty group)."""
    lo, hi = order_stats(values, starts, counts, _middle)
    return 0.5 * (lo + hi)


def medians(group: Any, values: Any, n_groups: int) -> Any:
    """Median of ``values`` per group id (NaN for an empty group)."""
    order, starts, counts = group_order(group, n_groups)
    return medians_contiguous(np.asarray(values, dtype=np.float64)[order], starts, counts)


def mads_contiguous(values: Any, starts: Any, counts: Any) -> Any:
    """Median absolute deviation from each contiguous group's median (NaN when empty)."""
    v = np.asarray(values, dtype=np.float64)
    center = medians_contiguous(v, starts, counts)
    return medians_contiguous(np.abs(v - np.repeat(center, counts)), starts, counts)
