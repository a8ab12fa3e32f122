"""Change points in a per-step series: where a slow stretch starts and ends, found whole.

A rank slowed for a stretch of steps shows as a level shift in its own-work series (or its
gap to the other ranks). Flagging single steps against a threshold splits such a stretch
wherever one step dips under the bar and shortens it where its edges are noisy; here the
series is first median-filtered (isolated spikes and dips of up to two steps vanish, edges
stay where they are), then cut by binary segmentation (each cut the one that removes the
most squared error, while that gain beats a penalty scaled to the series' own noise). Each
piece gets a level (the median of the raw values in it), and consecutive pieces above the
baseline by more than a bar merge into one window, so a noisy stretch inside a window
neither splits nor hides it.

Prefix sums and each candidate split's gain in numpy (O(n log n) per series); the same
floating-point operations in the same order as the scalar definition, so results are
exactly those of the pure-Python form (`tests/unit/analysis/test_changepoint.py`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepscope.common import robust

#: Width of the median filter (odd): removes runs of up to ``FILTER // 2`` outlying steps.
FILTER = 5
#: Smallest piece binary segmentation may cut off.
MIN_PIECE = 3
#: Penalty per cut, in units of noise variance times log(n) (BIC-like, generous).
PENALTY = 4.0
#: Chance, anywhere in the run, of a cluster of spikes as dense as a window (scattered
#: scheduling hiccups on a busy host sit close together now and then).
ALPHA = 0.01
#: Cuts at most (a run has few regimes; the rest is noise).
MAX_CUTS = 32


@dataclass(frozen=True)
class Window:
    """Indices ``[start, end]`` (inclusive) of an elevated stretch and its excess over baseline."""

    start: int
    end: int
    excess: float

    @property
    def length(self) -> int:
        return self.end - self.start + 1


def median_filter(xs: Sequence[float], width: int = FILTER) -> list[float]:
    """Running median over ``width`` samples (shrinking at the ends)."""
    if width < 1 or width % 2 == 0:
        raise ValueError(f"median filter width must be a positive odd number, got {width!r}")
    h = width // 2
    n = len(xs)
    if n <= 2 * h:
        return [robust.median(xs[max(0, i - h):min(n, i + h + 1)]) for i in range(n)]
    # Interior: odd windows, so the median is one of the values (exact); the shrinking
    # ends (even counts among them) keep the scalar definition.
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(xs, dtype=np.float64), width)
    inner = np.median(windows, axis=1)
    head = [robust.median(xs[0:i + h + 1]) for i in range(h)]
    tail = [robust.median(xs[i - h:n]) for i in range(n - h, n)]
    mid: list[float] = inner.tolist()
    return head + mid + tail


def noise(xs: Sequence[float]) -> float:
    """Step-to-step noise: robust sigma of successive differences over sqrt 2.

    A level shift moves two differences only, so a window does not inflate it.
    """
    d = [float(b) - float(a) for a, b in itertools.pairwise(xs)]
    return robust.robust_sigma(d) / math.sqrt(2.0) if len(d) >= 2 else 0.0


def cuts(xs: Sequence[float], penalty: float, min_piece: int = MIN_PIECE,
         max_cuts: int = MAX_CUTS) -> list[int]:
    """Binary segmentation under squared error: sorted indices where a new piece begins."""
    n = len(xs)
    x = np.asarray(xs, dtype=np.float64)
    # cumsum adds in order, like a running Python sum: the same prefix sums bit for bit.
    s1 = np.concatenate(([0.0], np.cumsum(x)))
    s2 = np.concatenate(([0.0], np.cumsum(x * x)))

    def sse(a: int, b: int) -> float:
        m = b - a
        if m <= 0:
            return 0.0
        t = float(s1[b] - s1[a])
        return float(s2[b] - s2[a]) - t * t / m

    def best_split(a: int, b: int) -> tuple[float, int]:
        if b - a < 2 * min_piece:
            return (-1.0, -1)
        whole = sse(a, b)
        ts = np.arange(a + min_piece, b - min_piece + 1)
        ml, mr = ts - a, b - ts
        tl, tr = s1[ts] - s1[a], s1[b] - s1[ts]
        with np.errstate(divide="ignore", invalid="ignore"):
            left = np.where(ml > 0, (s2[ts] - s2[a]) - tl * tl / ml, 0.0)
            right = np.where(mr > 0, (s2[b] - s2[ts]) - tr * tr / mr, 0.0)
        gain = whole - left - right
        i = len(gain) - 1 - int(np.argmax(gain[::-1]))  # ties: the last split, as max() on (gain, t)
        return (float(gain[i]), int(ts[i]))

    out: list[int] = []
    todo = {(0, n): best_split(0, n)}
    while todo and len(out) < max_cuts:
        (a, b), (gain, at) = max(todo.items(), key=lambda kv: kv[1][0])
        if at < 0 or gain <= penalty:
            break
        del todo[(a, b)]
        todo[(a, at)] = best_split(a, at)
        todo[(at, b)] = best_split(at, b)
        out.append(at)
    return sorted(out)


def elevated(xs: Sequence[float], bar: float, *, baseline: float | None = None,
             min_len: int = 5, max_gap: int = 2) -> list[Window]:
    """Stretches of ``xs`` whose level sits more than ``bar`` above ``baseline``.

    ``baseline`` defaults to the median of ``xs``. Pieces come from :func:`cuts` on the
    median-filtered series; elevated pieces separated by at most ``max_gap`` steps of lower
    ones merge (one noisy stretch does not split a window); each window's ends are then
    trimmed to where its level holds (:func:`_trim_to_level`), and windows shorter than
    ``min_len`` after that are dropped. A window's ``excess`` is the median of its (trimmed)
    raw values minus the baseline.
    """
    n = len(xs)
    if n < min_len or bar < 0:
        return []
    raw = [float(x) for x in xs]
    base = robust.median(raw) if baseline is None else float(baseline)
    f = median_filter(raw)
    sigma = max(noise(f), 1e-6 * (abs(base) + 1.0))
    bounds = [0, *cuts(f, PENALTY * sigma * sigma * math.log(max(n, 2))), n]
    pieces = [(a, b - 1) for a, b in itertools.pairwise(bounds)]
    hot = [(a, e) for a, e in pieces if robust.median(raw[a:e + 1]) - base > bar]
    merged: list[list[int]] = []
    for a, e in hot:
        if merged and a - merged[-1][1] - 1 <= max_gap:
            merged[-1][1] = e
        else:
            merged.append([a, e])
    # A dip shorter than a tenth of the stretch around it is noise inside one window, not
    # the end of one and the start of another: bridge until nothing changes.
    changed = True
    while changed:
        changed = False
        for i in range(len(merged) - 1):
            (a0, e0), (a1, e1) = merged[i], merged[i + 1]
            if a1 - e0 - 1 <= 0.1 * (e1 - a0 + 1):
                merged[i:i + 2] = [[a0, e1]]
                changed = True
                break
    if baseline is None and merged:
        # The baseline is the level outside the windows (a long window lifts the whole median).
        inside = {i for a, e in merged for i in range(a, e + 1)}
        rest = [x for i, x in enumerate(raw) if i not in inside]
        if len(rest) >= min_len:
            base = robust.median(rest)
    # Trimmed once the baseline is known: a window's height is measured from it.
    merged = [_trim_to_level(raw, f, a, e, base, bar) for a, e in merged]
    inside = {i for a, e in merged for i in range(a, e + 1)}
    rest = [x for i, x in enumerate(raw) if i not in inside]
    out = []
    for a, e in merged:
        level = robust.median(raw[a:e + 1]) - base
        if e - a + 1 < min_len or level <= bar:
            continue
        # A window must stand out from every other stretch of its length in the same run: on
        # a busy machine the whole run drifts between levels, and a stretch no higher than
        # the run's own drift is noise, however far above the median it sits.
        drift = rolling_max_median(rest, e - a + 1) - base
        if level - drift < 0.5 * bar:
            continue
        # And it must be denser in high steps than the run's scattered spikes make likely.
        k = sum(1 for x in raw[a:e + 1] if x - base > bar)
        k_out = sum(1 for x in raw if x - base > bar) - k
        if not unlikely_by_chance(k, e - a + 1, k_out, n - (e - a + 1), n):
            continue
        out.append(Window(a, e, level))
    return out


def _trim_to_level(raw: Sequence[float], f: Sequence[float], a: int, e: int, base: float,
                  bar: float) -> list[int]:
    """``[a, e]`` without the end steps where the window's level does not hold.

    An end step is out when both its raw value and its filtered one (``f``) sit at or under
    half the window's height over ``base``: the median of its raw values minus ``base``, or
    ``bar`` if that is more. Pieces merged across gaps, and the filter's smear, can carry a
    window on through steps a little above the bar but far under its level (a rank 30 ms slow
    on steps 30-59 kept a few ms above the others on steps 60-66); its excess and its steps
    are priced, so its ends stop where the level does.
    """
    half = 0.5 * max(bar, robust.median(raw[a:e + 1]) - base)
    while e > a and raw[e] - base <= half and f[e] - base <= half:
        e -= 1
    while a < e and raw[a] - base <= half and f[a] - base <= half:
        a += 1
    return [a, e]


def elevated_any_length(xs: Sequence[float], bar: float, *, min_len: int = 5) -> list[Window]:
    """:func:`elevated`, also where a slow stretch covers more than half of ``xs``.

    Such a stretch lifts the median into itself, and measured from there nothing stands out
    (every rank 6 ms slower on steps 40-159 of 200 was missed). The faster stretches then
    stand *below* the median by the same rule (``elevated`` on the negated series, the same
    bar, so a series with none keeps its answer); their level is the baseline the slow
    stretch is measured from.
    """
    found = elevated(xs, bar, min_len=min_len)
    if found:
        return found
    low = elevated([-float(x) for x in xs], bar, min_len=min_len)
    if not low:
        return []
    base = robust.median([float(xs[i]) for w in low for i in range(w.start, w.end + 1)])
    return elevated(xs, bar, baseline=base, min_len=min_len)


def may_hold_window(xs: np.ndarray[Any, np.dtype[np.float64]], bar: float,
                    base: float) -> bool:
    """False only when :func:`elevated` (``baseline=None``, so ``base`` is the median of
    ``xs``) is sure to find no window: a cheap bound, checked before the full search.

    Every window grows from a *hot* piece, one whose median sits more than ``bar`` above the
    median of the series. Pieces are at least ``MIN_PIECE`` (3) steps long (a series too short
    to cut is one piece, whose median is the baseline itself). A median of ``L >= 3`` values
    above ``base + bar`` needs ``ceil(L/2)`` of them above it (the middle value, or for an even
    count the upper middle, since a rounded mean never exceeds its larger term); with every
    two high values at least 4 steps apart, at most ``ceil(L/4) < ceil(L/2)`` fit. So a hot
    piece needs two high values at most 3 steps apart; none means no hot piece, nothing to
    merge, no window (trimming a window's ends only shrinks or drops what was merged).
    ``x - base > bar`` is the comparison ``elevated`` makes, in the same floating-point
    operations.
    """
    return bool(may_hold_windows(np.asarray(xs)[None, :], np.array([bar]), np.array([base]))[0])


def may_hold_windows(x: np.ndarray[Any, Any], bar: np.ndarray[Any, Any],
                     base: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """:func:`may_hold_window` of every row of the 2-D ``x``, with its row's ``bar`` and
    ``base``: a bool per row. The comparison runs in ``x``'s dtype, as ``elevated``'s does
    on a series of that dtype (a Python float against a NumPy array takes the array's)."""
    rows, n = x.shape
    if n < MIN_PIECE:
        return np.zeros(rows, dtype=bool)
    hi = (x - base.astype(x.dtype)[:, None]) > bar.astype(x.dtype)[:, None]
    out = np.zeros(rows, dtype=bool)
    for d in (1, 2, 3):  # two high values at most 3 steps apart
        if d < n:
            out |= (hi[:, :-d] & hi[:, d:]).any(axis=1)
    return out & (bar >= 0)


def unlikely_by_chance(k: int, span: int, k_out: int, n_out: int, n: int,
                       alpha: float = ALPHA) -> bool:
    """Is ``k`` high steps in ``span`` more than the spike rate outside explains?

    A busy host deschedules a rank now and then; the rate of high steps outside the window
    (at least one per run, so a clean series is not infinitely strict) gives the chance of so
    dense a cluster anywhere in the run: binomial tail times the window positions.
    """
    p = min(0.99, max(k_out, 1) / max(n_out, 1))
    tail = sum(math.comb(span, j) * p**j * (1.0 - p) ** (span - j) for j in range(k, span + 1))
    return tail * max(1, n - span + 1) < alpha


def rolling_max_median(xs: Sequence[float], width: int) -> float:
    """The highest median of ``width`` consecutive values (``-inf`` when there are fewer)."""
    if width < 1 or len(xs) < width:
        return -math.inf
    stride = max(1, width // 8)  # neighbours overlap by 7/8: enough, and O(n log w) overall
    return max(robust.median(xs[i:i + width]) for i in range(0, len(xs) - width + 1, stride))
