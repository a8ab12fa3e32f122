"""Interval unions, intersections and the measure of a union inside a window (integer ns).

numpy does the work (sorts, running maxima, searches) on int64 arrays: exact for integer
nanoseconds, and a trace's hundreds of thousands of kernels cost milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import numpy as np

Interval = tuple[int, int]


def _arrays(intervals: Iterable[Interval]) -> tuple[np.ndarray, np.ndarray]:
    # fromiter over the flattened pairs: np.array on a list of tuples inspects each tuple
    # (several times slower on a trace's hundred thousand kernels).
    flat = np.fromiter(chain.from_iterable(intervals), dtype=np.int64)
    pairs = flat.reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def merge_arrays(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted disjoint ``(starts, ends)``; touching ones are joined."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    # A new interval begins where a start lies past everything before it.
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], reach[last]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of intervals as a sorted list of disjoint ones."""
    s, e = merge_arrays(*_arrays(intervals))
    return list(zip(s.tolist(), e.tolist(), strict=True))


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists."""
    if not a or not b:
        return []
    s, e = intersect_arrays(*_arrays(a), *_arrays(b))
    return list(zip(s.tolist(), e.tolist(), strict=True))


def intersect_arrays(a_s: np.ndarray, a_e: np.ndarray, b_s: np.ndarray, b_e: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`intersect` on ``(starts, ends)`` arrays of two merged lists."""
    if not len(a_s) or not len(b_s):
        return a_s[:0], a_e[:0]
    # Each piece of the intersection starts at a start of one list inside an interval of
    # the other; with both lists disjoint and sorted, each such start opens one piece.
    lo_a = np.searchsorted(b_e, a_s, side="right")  # first b ending after each a start
    lo_b = np.searchsorted(a_e, b_s, side="right")
    p_s: list[np.ndarray] = []
    p_e: list[np.ndarray] = []
    for starts, ends, o_s, o_e, idx in ((a_s, a_e, b_s, b_e, lo_a), (b_s, b_e, a_s, a_e, lo_b)):
        ok = idx < len(o_s)
        i = np.flatnonzero(ok)
        j = idx[ok]
        inside = o_s[j] <= starts[i]  # this start lies within interval j of the other list
        i, j = i[inside], j[inside]
        s = starts[i]
        e = np.minimum(ends[i], o_e[j])
        keep = s < e
        p_s.append(s[keep])
        p_e.append(e[keep])
    # A piece whose start is a start in both lists was found twice: unique rows, sorted.
    pairs = np.unique(np.stack((np.concatenate(p_s), np.concatenate(p_e)), axis=1), axis=0)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


class _Measure:
    """Length of a merged interval list inside any window, in O(log n) via prefix sums.
    ``merged`` is a list of intervals or a ``(starts, ends)`` pair of int64 arrays."""

    def __init__(self, merged: list[Interval] | tuple[np.ndarray, np.ndarray]) -> None:
        s, e = merged if isinstance(merged, tuple) else _arrays(merged)
        self.prefix = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(e - s)))
        self._s, self._e = s, e

    def within(self, w0: int, w1: int) -> int:
        if w1 <= w0 or not len(self._s):
            return 0
        i = int(np.searchsorted(self._e, w0, side="right"))  # first interval ending after w0
        j = int(np.searchsorted(self._s, w1, side="left"))  # intervals i..j-1 start before w1
        if i >= j:
            return 0
        total: int = int(self.prefix[j]) - int(self.prefix[i])
        total -= max(0, w0 - int(self._s[i]))
        total -= max(0, int(self._e[j - 1]) - w1)
        return total
