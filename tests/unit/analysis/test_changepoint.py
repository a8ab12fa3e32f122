"""The numpy change-point search gives exactly the scalar definition's answers.

The reference below is the definition the module used before (pure Python prefix sums,
``max`` over ``(gain, split)`` tuples, a running median of up to ``FILTER`` values). Same
floating-point operations in the same order, so cuts, filtered values and windows must be
equal, not close, on series with ties, steps, spikes and integer values.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from stepscope.analysis import changepoint
from stepscope.common import robust


def _ref_median_filter(xs: Sequence[float], width: int = changepoint.FILTER) -> list[float]:
    h = width // 2
    n = len(xs)
    return [robust.median(xs[max(0, i - h):min(n, i + h + 1)]) for i in range(n)]


def _ref_cuts(xs: Sequence[float], penalty: float, min_piece: int = changepoint.MIN_PIECE,
              max_cuts: int = changepoint.MAX_CUTS) -> list[int]:
    n = len(xs)
    s1, s2 = [0.0], [0.0]
    for x in xs:
        s1.append(s1[-1] + float(x))
        s2.append(s2[-1] + float(x) * float(x))

    def sse(a: int, b: int) -> float:
        m = b - a
        if m <= 0:
            return 0.0
        t = s1[b] - s1[a]
        return (s2[b] - s2[a]) - t * t / m

    def best_split(a: int, b: int) -> tuple[float, int]:
        if b - a < 2 * min_piece:
            return (-1.0, -1)
        whole = sse(a, b)
        return max((whole - sse(a, t) - sse(t, b), t) for t in range(a + min_piece, b - min_piece + 1))

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


def _series(rng: random.Random, n: int) -> list[float]:
    kind = rng.choice(["noise", "window", "ties", "ints", "spikes", "flat"])
    base = rng.uniform(1.0, 50.0)
    xs = [base + rng.gauss(0.0, base * 0.05) for _ in range(n)]
    if kind == "window" and n > 10:
        a = rng.randrange(0, n - 5)
        e = min(n, a + rng.randrange(5, max(6, n // 2)))
        for i in range(a, e):
            xs[i] += rng.uniform(2.0, 30.0)
    elif kind == "ties":
        xs = [round(x, 0) for x in xs]
    elif kind == "ints":
        xs = [float(rng.randrange(0, 4)) for _ in range(n)]
    elif kind == "spikes":
        for _ in range(max(1, n // 10)):
            xs[rng.randrange(n)] += rng.uniform(10.0, 100.0)
    elif kind == "flat":
        xs = [base] * n
    return xs


@pytest.mark.parametrize("seed", range(6))
def test_cuts_filter_and_windows_equal_the_scalar_definition(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        n = rng.choice([1, 2, 4, 5, 6, 7, 12, 40, 150, 600])
        xs = _series(rng, n)
        assert changepoint.median_filter(xs) == _ref_median_filter(xs)
        sigma = max(changepoint.noise(xs), 1e-6)
        for pen in (0.0, sigma * sigma * math.log(max(n, 2)), 4.0 * sigma * sigma * math.log(max(n, 2))):
            for mp in (1, 3):
                got_cuts = changepoint.cuts(xs, pen, min_piece=mp)
                assert got_cuts == _ref_cuts(xs, pen, min_piece=mp), (n, pen, mp)
        bar = 3.0 * sigma
        got = changepoint.elevated(xs, bar)
        with monkeypatch.context() as m:
            m.setattr(changepoint, "cuts", _ref_cuts)
            m.setattr(changepoint, "median_filter", _ref_median_filter)
            assert got == changepoint.elevated(xs, bar)


def test_a_window_is_still_found() -> None:
    """Not only equal to the reference: the search finds an injected stretch."""
    rng = random.Random(7)
    xs = [10.0 + rng.gauss(0.0, 0.3) for _ in range(300)]
    for i in range(120, 180):
        xs[i] += 8.0
    [w] = changepoint.elevated(xs, 2.0)
    assert abs(w.start - 120) <= 2 and abs(w.end - 179) <= 2
    assert 7.2 <= w.excess <= 8.8


def test_a_window_ends_where_its_level_stops() -> None:
    """A few steps a little above the bar after a window are not the window.

    +30 on steps 30-59, then 7 steps of +0.4 to +6.6 (a slowed rank's own work settling back
    beside a busy loop): above a 1.0 bar, far under the window's level. The window ends at
    59 and its excess is the +30, not a stretch 7 steps longer.
    """
    rng = random.Random(11)
    xs = [10.0 + rng.gauss(0.0, 0.2) for _ in range(90)]
    for i in range(30, 60):
        xs[i] += 30.0
    for i, d in enumerate([0.4, 3.1, 6.6, 2.2, 4.8, 1.5, 5.3]):
        xs[60 + i] += d
    [w] = changepoint.elevated(xs, 1.0)
    assert (w.start, w.end) == (30, 59)
    assert 29.5 <= w.excess <= 30.5
    # The same at the start: a ramp up to the level is not in the window either.
    [w] = changepoint.elevated([10.0] * 20 + [12.0, 13.0] + [40.0] * 20 + [10.0] * 20, 1.0)
    assert (w.start, w.end) == (22, 41) and w.excess == 30.0
