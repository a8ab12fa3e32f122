"""The run-queue netting and the median of the other ranks: one numpy rule, against brute force."""

from __future__ import annotations

import math
import random
from statistics import median
from typing import Any

import numpy as np


def _brute_net(data: Any, extra: dict[int, dict[int, float]], steps: list[int]) -> Any:
    """series.net_of_runq's rule one value at a time: a rank's extra wait at a step is taken
    out of its positive gaps there (in proportion to each) only when it reaches EXPLAINS of
    their sum; every other value stays gross."""
    from stepscope.analysis.series import EXPLAINS

    total: dict[tuple[int, int], float] = {}
    for (r, _), (pos, gap, _own) in data.items():
        for p, g in zip(pos.tolist(), gap.tolist(), strict=True):
            total[(r, p)] = total.get((r, p), 0.0) + max(g, 0.0)
    out = {}
    for (r, name), (pos, gap, own) in data.items():
        gs, os_ = [], []
        for p, g, o in zip(pos.tolist(), gap.tolist(), own.tolist(), strict=True):
            e = extra.get(r, {}).get(steps[p], 0.0)
            t = total[(r, p)]
            take = min(e, t) * max(g, 0.0) / t if e > 0 and t > 0 and e >= EXPLAINS * t else 0.0
            gs.append(g - take)
            os_.append(max(o - take, 0.0))
        out[(r, name)] = (pos, np.array(gs), np.array(os_))
    return out


def test_net_of_runq_is_the_per_value_rule() -> None:
    from stepscope.analysis.series import net_of_runq

    rng = random.Random(11)
    for trial in range(25):
        steps = sorted(rng.sample(range(200), rng.randint(1, 12)))
        data = {}
        for r in range(rng.randint(1, 7)):
            for name in ("backward", "forward", "residual")[: rng.randint(1, 3)]:
                pos = np.array(sorted(rng.sample(range(len(steps)), rng.randint(0, len(steps)))),
                               dtype=np.int64)
                own = np.array([round(rng.uniform(-0.5, 6.0), 1) for _ in pos])
                gap = np.array([round(rng.uniform(-2.0, 3.0), 2) for _ in pos])
                data[(r, name)] = (pos, gap, own)
        extra = {r: {s: round(rng.uniform(-2.0, 6.0), 1) for s in steps if rng.random() < 0.7}
                 for r in range(7) if rng.random() < 0.8}
        got, want = net_of_runq(data, extra, steps), _brute_net(data, extra, steps)
        assert list(got) == list(want), trial
        for k in want:
            for a, b in zip(got[k], want[k], strict=True):
                assert np.allclose(a, b, rtol=0, atol=1e-12), (trial, k)
    assert net_of_runq({}, {}, [1, 2]) == {}


def test_a_wait_that_does_not_cover_the_gap_leaves_it_gross() -> None:
    """A rank sleeping 25 ms in its optimizer while it also waited 8 ms more than the other
    rank for a CPU: the wait explains nothing there, so the gap stays 25 ms (the old rule
    spread the 8 ms over its phases, most of it on the phase that ran long). Where the extra
    wait covers the gaps (a rank held off the CPU 20 ms, its phases stretched by as much),
    they are taken net of it."""
    from stepscope.analysis.series import net_of_runq

    pos = np.arange(2, dtype=np.int64)
    data = {(1, "optimizer"): (pos, np.array([25.0, 15.0]), np.array([28.0, 18.0])),
            (1, "forward"): (pos, np.array([0.2, 5.0]), np.array([6.0, 11.0])),
            (1, "residual"): (pos, np.array([-0.3, 0.0]), np.array([1.0, 1.0]))}
    net = net_of_runq(data, {1: {10: 8.0, 11: 20.0}}, [10, 11])
    assert net[(1, "optimizer")][1].tolist() == [25.0, 0.0]
    assert net[(1, "forward")][1].tolist() == [0.2, 0.0]
    assert net[(1, "residual")][1].tolist() == [-0.3, 0.0]  # a negative gap is never moved
    assert net[(1, "optimizer")][2].tolist() == [28.0, 3.0]


def test_runq_extra_is_each_rank_less_the_others_median() -> None:
    import duckdb

    from stepscope.analysis.series import runq_extra

    rng = random.Random(4)
    rows = [(r, s, round(rng.uniform(0, 3), 1)) for s in range(30) for r in range(1 + s % 6)]
    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE step_resources (rank INTEGER, step BIGINT, runq_ms DOUBLE)")
        con.executemany("INSERT INTO step_resources VALUES (?, ?, ?)", rows)
        con.execute("INSERT INTO step_resources VALUES (9, 3, NULL), (9, 4, 'nan')")
        got = runq_extra(con)
    finally:
        con.close()
    want: dict[int, dict[int, float]] = {}
    for r, s, v in rows:
        rest = [x for rr, ss, x in rows if ss == s and rr != r]
        if rest:
            want.setdefault(r, {})[s] = v - median(rest)
    assert got == want
    assert not math.isnan(sum(v for per in got.values() for v in per.values()))


def test_one_median_of_others_rule_for_run_queue(monkeypatch: Any) -> None:
    # runq_extra takes the others' median by own.median_of_others (the rule ex is built by),
    # once over every cell: no per-cell Python twin of it.
    import duckdb

    from stepscope.analysis import own, series

    calls: list[int] = []

    def counted(cell: Any, values: Any, n_cells: int) -> Any:
        calls.append(len(values))
        return own.median_of_others(cell, values, n_cells)

    monkeypatch.setattr(series, "median_of_others", counted)
    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE step_resources AS SELECT (i % 3)::INTEGER AS rank, "
                    "(i // 3)::BIGINT AS step, "
                    "(i % 5)::DOUBLE AS runq_ms FROM range(30) t(i)")
        series.runq_extra(con)
    finally:
        con.close()
    assert calls == [30]
    assert not hasattr(series, "_median_without")
