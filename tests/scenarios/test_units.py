"""Units behind trustworthy findings: change points, cost and severity, ties."""

from __future__ import annotations

import random

import pytest

from stepscope.analysis import changepoint, cost
from stepscope.common.waits import last_arriver, most_often_last


def _series(seed: int, n: int = 200, lo: int = 80, hi: int = 140, level: float = 30.0,
            sigma: float = 3.0) -> list[float]:
    rng = random.Random(seed)
    xs = [rng.gauss(0.0, sigma) + (level if lo <= i < hi else 0.0) for i in range(n)]
    for i in range(n):  # scheduling spikes on a busy host, 5% of steps
        if rng.random() < 0.05:
            xs[i] += rng.uniform(10.0, 60.0)
    return xs


@pytest.mark.parametrize("seed", range(8))
def test_window_found_whole_through_a_noisy_stretch(seed: int) -> None:
    xs = _series(seed)
    for i in range(100, 104):  # four steps inside the window dip to the baseline
        xs[i] -= 30.0
    (w,) = changepoint.elevated(xs, bar=15.0)
    assert abs(w.start - 80) <= 2 and abs(w.end - 139) <= 2
    assert w.excess == pytest.approx(30.0, rel=0.1)


@pytest.mark.parametrize("seed", range(8))
def test_clean_noisy_series_has_no_window(seed: int) -> None:
    xs = _series(seed, level=0.0)
    assert changepoint.elevated(xs, bar=7.5) == []


def test_drift_is_not_a_window() -> None:
    # A run that drifts between levels (a busy host): a stretch no higher than another
    # stretch of the same run is not a window.
    xs = [15.0] * 40 + [19.0] * 6 + [15.0] * 10 + [4.0] * 80
    assert changepoint.elevated(xs, bar=12.0) == []
    xs[40:46] = [40.0] * 6  # far above anything else in the run: a window
    assert [(w.start, w.end) for w in changepoint.elevated(xs, bar=12.0)] == [(40, 45)]


def test_scattered_spikes_close_together_are_not_a_window() -> None:
    xs = [1.0] * 60
    for i in (4, 8, 10, 11, 14, 31, 34, 35, 43, 51):
        xs[i] = 8.0
    assert changepoint.elevated(xs, bar=0.5) == []


def test_two_separate_windows_stay_two() -> None:
    xs = [0.0] * 30 + [20.0] * 20 + [0.0] * 30 + [20.0] * 20 + [0.0] * 30
    assert [(w.start, w.end) for w in changepoint.elevated(xs, bar=5.0)] == [(30, 49), (80, 99)]


def test_median_filter_rejects_even_width() -> None:
    with pytest.raises(ValueError, match="odd"):
        changepoint.median_filter([1.0, 2.0], width=4)


def test_price_and_severity_follow_the_share_of_the_job() -> None:
    job = {"total_ms": 10_000.0, "world_size": 4, "median_step_ms": 100.0}
    c = cost.price(job, 30.0, 60, 4, step_ms=130.0)
    assert c["lost_ms"] == 1800.0 and c["gpu_ms"] == 7200.0
    assert c["share_of_wall"] == 0.18 and c["share_of_gpu_hours"] == 0.18
    assert c["what_if_step_ms"] == 100.0
    assert cost.severity(cost.share(c)) == "critical"
    one_rank = cost.price(job, 30.0, 60, 1)  # nobody waits for it: a quarter of the GPU-hours
    assert one_rank["share_of_gpu_hours"] == 0.045
    assert cost.severity(0.02) == "warning" and cost.severity(0.009) == "info"
    assert cost.thresholds()["critical_share"] == cost.CRITICAL_SHARE


def test_ties_name_no_one() -> None:
    assert last_arriver({0: 5.0, 1: 5.0, 2: 9.0}) is None
    assert last_arriver({0: 5.0, 1: 6.0}) == 0
    assert most_often_last({0: 6, 1: 6}) is None
    assert most_often_last({0: 7, 1: 6}) == 0
    assert most_often_last({}) is None
