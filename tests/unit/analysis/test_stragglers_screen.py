"""The straggler search's screen of each gap series (its threshold, and whether the search
may name a straggler on it) is a bound: the search over the screened series finds what it
finds over every series, in float32 (the dense own-work matrices) and float64 alike."""

from __future__ import annotations

from typing import Any

import duckdb
import numpy as np
import pytest

from stepscope.analysis import stragglers
from stepscope.analysis.series import Series, rank_blocks_of, thresholds_of

STEPS = 200
MEDIAN_STEP = 20.0


def _series(dtype: Any, seed: int) -> Series:
    """Twelve ranks × three phases of gaps: noise, chronic gaps, windows of several lengths,
    gaps flagged on most steps with holes, quantised values (ties), missing steps."""
    rng = np.random.default_rng(seed)
    out: Series = {}
    for rank in range(12):
        for k, name in enumerate(("forward", "backward", "residual")):
            pos = np.arange(STEPS)
            gap = rng.normal(0.0, 0.3 + 0.2 * k, STEPS)
            kind = (rank + k) % 6
            if kind == 1:
                gap += rng.uniform(1.5, 4.0)  # chronic
            elif kind == 2:
                a = int(rng.integers(0, STEPS - 40))
                gap[a:a + int(rng.integers(8, 40))] += rng.uniform(2.0, 8.0)  # a window
            elif kind == 3:
                gap[rng.random(STEPS) < 0.6] += 3.0  # flagged on most steps, with holes
            elif kind == 4:
                gap = np.round(gap, 1)  # ties
            if rank == 5:
                keep = rng.random(STEPS) > 0.1  # steps without a gap
                pos, gap = pos[keep], gap[keep]
            own = 10.0 + gap + rng.normal(0.0, 0.1, len(gap))
            out[(rank, name)] = (pos, gap.astype(dtype), own.astype(dtype))
    return out


@pytest.fixture
def con() -> Any:
    con = duckdb.connect()
    con.execute("CREATE TABLE step_waits (rank INTEGER, step BIGINT, wait_ms DOUBLE)")
    con.execute("CREATE TABLE collective_waits (rank INTEGER, step BIGINT, phase VARCHAR, "
                "wait DOUBLE)")
    yield con
    con.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_screened_search_finds_what_the_whole_search_finds(con: Any, dtype: Any,
                                                               seed: int) -> None:
    data = _series(dtype, seed)
    steps = list(range(STEPS))
    host_of = {r: "h" for r in range(12)}
    screen = stragglers.screen_series(data, MEDIAN_STEP, STEPS)
    assert screen.thresholds == thresholds_of(data, MEDIAN_STEP)
    every = stragglers.SeriesScreen(screen.thresholds, frozenset(data))
    got = stragglers.find_stragglers(con, steps, host_of, screen.thresholds, MEDIAN_STEP,
                                     series=data, screen=screen)
    whole = stragglers.find_stragglers(con, steps, host_of, screen.thresholds, MEDIAN_STEP,
                                       series=data, screen=every)
    assert got == whole
    assert {s["persistence"] for s in whole} == {"chronic", "window"}
    # The screen leaves most series out, and each one it leaves out holds nothing alone.
    left = [k for k in data if k not in screen.candidates]
    assert len(left) > len(data) // 3
    for key in left:
        alone = stragglers.SeriesScreen(screen.thresholds, frozenset([key]))
        assert stragglers.find_stragglers(con, steps, host_of, screen.thresholds, MEDIAN_STEP,
                                          series=data, screen=alone) == [], key


def test_blocks_of_ranks_screen_as_the_whole_run() -> None:
    data = _series(np.float32, 3)
    whole = stragglers.screen_series(data, MEDIAN_STEP, STEPS)
    parts = [stragglers.screen_series(b, MEDIAN_STEP, STEPS)
             for b in reversed(rank_blocks_of(data, 5))]
    merged = stragglers.merge_screens(data, parts)
    assert list(merged.thresholds.items()) == list(whole.thresholds.items())
    assert merged.candidates == whole.candidates and whole.candidates
