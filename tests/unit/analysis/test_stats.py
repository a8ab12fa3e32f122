"""Run-wide per-phase quantiles: exact where a phase's samples fit the bound, approximate above."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlspy import SqlSpy
from synth_runs import Slow, SynthRun, write_run

from stepscope.analysis import stats
from stepscope.analysis.run import analyze_run


def _stats_three_ways(tmp_path: Path, monkeypatch: Any, bound: int) -> tuple[Any, Any, list[str]]:
    """phase_stats on the exact path, then with the run over the bound (a spy's statements)."""
    run = write_run(tmp_path / "run", SynthRun(ranks=5, steps=30, seed=3, comm_child=True,
                                               slow=(Slow(1, "forward", 9.0),)))
    data = analyze_run(run, keep=True)["_data"]
    try:
        stats.create_phase_samples(data.con)
        exact = stats.phase_stats(data.con, 0)
        spy = SqlSpy(data.con)
        monkeypatch.setattr(stats, "EXACT_QUANTILE_ROWS", bound)
        big = stats.phase_stats(spy, 10**9)
    finally:
        data.close()
    return exact, big, [s for s in spy.sqls if "quantile" in s and "GROUP BY name, rank" not in s]


def test_a_phase_within_the_bound_has_exact_quantiles_in_a_large_run(tmp_path: Path,
                                                                      monkeypatch: Any) -> None:
    # Each phase has 150 samples (5 ranks x 30 steps): with a bound of 300 every phase is
    # exact, at most two phases a statement, so memory stays that of the exact path.
    exact, big, sqls = _stats_three_ways(tmp_path, monkeypatch, 300)
    assert big == exact
    assert len(exact) >= 4
    assert sqls and all("approx_quantile" not in s for s in sqls), sqls
    assert len(sqls) == (len(exact) + 1) // 2


def test_a_phase_over_the_bound_has_approximate_quantiles(tmp_path: Path,
                                                          monkeypatch: Any) -> None:
    exact, big, sqls = _stats_three_ways(tmp_path, monkeypatch, 149)
    assert len(sqls) == 1 and "approx_quantile" in sqls[0], sqls
    # Everything but the quantiles is the same figure.
    for name, ph in exact.items():
        for key in ("share", "samples", "max_ms", "parent"):
            assert big[name][key] == ph[key], (name, key)

