"""Interval unions, intersections and the measure of a union inside a window (integer ns)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

Interval = tuple[int, int]




def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of intervals as a sorted list of disjoint ones."""
    out: list[Interval] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists (two-pointer sweep)."""
    i = j = 0
    out: list[Interval] = []
    while i < len(a) and j < len(b):
        s = max(a[i][0], b[j][0])
        e = min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class _Measure:
    """Length of a merged interval list inside any window, in O(log n) via prefix sums."""

    def __init__(self, merged: list[Interval]) -> None:
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]
        self.prefix = [0]
        for s, e in merged:
            self.prefix.append(self.prefix[-1] + e - s)

    def within(self, w0: int, w1: int) -> int:
        if w1 <= w0 or not self.starts:
            return 0
        i = bisect_right(self.ends, w0)  # first interval ending after w0
        j = bisect_left(self.starts, w1)  # intervals from i to j-1 start before w1
        if i >= j:
            return 0
        total = self.prefix[j] - self.prefix[i]
        total -= max(0, w0 - self.starts[i])
        total -= max(0, self.ends[j - 1] - w1)
        return total
