"""The gap series' noise splits by blocks of whole ranks: the blocks' thresholds merged are
the whole run's, in its order, and a lost block is an error."""

from __future__ import annotations

import numpy as np
import pytest

from stepscope.analysis import series
from stepscope.common.errors import AnalysisError


def _series(ranks: int, steps: int = 40) -> series.Series:
    rng = np.random.default_rng(7)
    pos = np.arange(steps)
    return {(r, name): (pos, rng.normal(0.5 * r, 0.2 + 0.1 * r, steps), rng.normal(5.0, 1.0, steps))
            for r in range(ranks) for name in ("forward", "backward", "residual")}


def test_rank_blocks_hold_whole_ranks_and_merge_to_the_whole_run() -> None:
    data = _series(7)
    blocks = series.rank_blocks_of(data, 3)
    assert [sorted({r for r, _ in b}) for b in blocks] == [[0, 1, 2], [3, 4, 5], [6]]
    # Positions and gaps as they are (the same arrays: positions shared by series are sent
    # once), no own work.
    assert all(len(b[k][2]) == 0 and b[k][1] is data[k][1] and b[k][0] is data[k][0]
               for b in blocks for k in b)
    whole = series.thresholds_of(data, 10.0)
    merged = series.merge_thresholds(data, [series.thresholds_of(b, 10.0) for b in reversed(blocks)])
    assert list(merged.items()) == list(whole.items())
    assert len(set(whole.values())) > 3  # each rank's noise its own, not one floor


def test_a_lost_block_is_an_error() -> None:
    data = _series(4)
    parts = [series.thresholds_of(b, 10.0) for b in series.rank_blocks_of(data, 2)]
    with pytest.raises(AnalysisError, match="6 series missing"):
        series.merge_thresholds(data, parts[:1])
    with pytest.raises(ValueError, match="got 0"):
        series.rank_blocks_of(data, 0)
