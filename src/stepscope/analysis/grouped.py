"""Order statistics over many groups at once, on fixed-dtype numpy columns.

The vectorised form of :func:`stepscope.common.robust.median` and ``mad`` (that module stays
pure Python for the recording side): one sort of the whole column instead of one Python
sort per group, so thousands of (rank, phase) series or (step, phase) cells cost one pass.
Same definitions: the median of an even count is the mean of the two middle values.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def sort_groups(group: Any, values: Any, n_groups: int) -> tuple[Any, Any, Any]:
    """``values`` sorted within each group id ``0..n_groups-1``: (sorted values, start of each
    group in them, count of each group)."""
    g = np.asarray(group, dtype=np.int64)
    v = np.asarray(values, dtype=np.float64)
    if len(g) and (int(g.min()) < 0 or int(g.max()) >= n_groups):
        raise ValueError(f"group ids must lie in 0..{n_groups - 1}, got {int(g.min())}..{int(g.max())}")
    order = np.lexsort((v, g))
    counts = np.bincount(g, minlength=n_groups).astype(np.int64)
    starts = np.zeros(n_groups, dtype=np.int64)
    if n_groups > 1:
        np.cumsum(counts[:-1], out=starts[1:])
    return v[order], starts, counts


def medians(group: Any, values: Any, n_groups: int) -> Any:
    """Median of ``values`` per group (NaN for an empty group)."""
    v, starts, counts = sort_groups(group, values, n_groups)
    out = np.full(n_groups, np.nan)
    ok = counts > 0
    lo = starts[ok] + (counts[ok] - 1) // 2
    hi = starts[ok] + counts[ok] // 2
    out[ok] = 0.5 * (v[lo] + v[hi])
    return out


def mads(group: Any, values: Any, n_groups: int) -> Any:
    """Median absolute deviation from each group's median (NaN for an empty group)."""
    g = np.asarray(group, dtype=np.int64)
    v = np.asarray(values, dtype=np.float64)
    center = medians(g, v, n_groups)
    return medians(g, np.abs(v - center[g]), n_groups)
