"""The run-queue netting and the median of the other ranks: one numpy rule, against brute force."""

from __future__ import annotations

import math
import random
from statistics import median
from typing import Any

import numpy as np


def _brute_net(data: Any, runq: dict[int, dict[int, float]], steps: list[int]) -> Any:
    """series._net_of_runq's rule one value at a time, with the others' median by brute force."""
    keys = list(data)
    own = {k: {steps[int(p)]: max(float(o), 0.0) for p, o in zip(data[k][0], data[k][2], strict=True)}
           for k in keys}
    base = {k: median(own[k].values()) for k in keys if own[k]}

    def w_of(k: tuple[int, str], o: float) -> float:
        return o * max(1.0, o / base[k]) if base[k] > 1e-9 else o

    tw: dict[tuple[int, int], float] = {}
    for k in keys:
        for st, o in own[k].items():
            tw[(k[0], st)] = tw.get((k[0], st), 0.0) + w_of(k, o)
    net = {k: {st: (max(0.0, o - runq.get(k[0], {}).get(st, 0.0) * w_of(k, o) / tw[(k[0], st)])
                    if tw[(k[0], st)] > 0 else o) for st, o in own[k].items()} for k in keys}
    out = {}
    for k in keys:
        pts = []
        for p, g in zip(data[k][0].tolist(), data[k][1].tolist(), strict=True):
            st = steps[p]
            rest = [net[j][st] for j in keys if j[1] == k[1] and j != k and st in net[j]]
            if rest:
                pts.append((p, min(net[k][st] - median(rest), g), net[k][st]))
        if pts:
            out[k] = tuple(np.array(c) for c in zip(*pts, strict=True))
    return out


def test_net_of_runq_is_the_per_value_rule() -> None:
    from stepscope.analysis.series import _net_of_runq

    rng = random.Random(11)
    for trial in range(25):
        steps = sorted(rng.sample(range(200), rng.randint(1, 12)))
        data = {}
        for r in range(rng.randint(1, 7)):
            for name in ("backward", "forward", "residual")[: rng.randint(1, 3)]:
                pos = np.array(sorted(rng.sample(range(len(steps)), rng.randint(0, len(steps)))),
                               dtype=np.int64)
                # Coarse values: ties in the cells' medians; some negative and zero own work.
                own = np.array([round(rng.uniform(-0.5, 6.0), 1) for _ in pos])
                gap = np.array([round(rng.uniform(-2.0, 3.0), 2) for _ in pos])
                data[(r, name)] = (pos, gap, own)
        runq = {r: {s: round(rng.uniform(0, 2.0), 1) for s in steps if rng.random() < 0.7}
                for r in range(7) if rng.random() < 0.8}
        got, want = _net_of_runq(data, runq, steps), _brute_net(data, runq, steps)
        assert list(got) == list(want), trial
        for k in want:
            for a, b in zip(got[k], want[k], strict=True):
                assert a.tolist() == b.tolist(), (trial, k)
    assert _net_of_runq({}, {}, [1, 2]) == {}


def test_runq_extra_is_each_rank_less_the_others_median() -> None:
    import duckdb

    from stepscope.analysis.series import runq_extra

    rng = random.Random(4)
    rows = [(r, s, round(rng.uniform(0, 3), 1)) for s in range(30) for r in range(1 + s % 6)]
    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE res (rank INTEGER, step BIGINT, runq_ms DOUBLE)")
        con.executemany("INSERT INTO res VALUES (?, ?, ?)", rows)
        con.execute("INSERT INTO res VALUES (9, 3, NULL), (9, 4, 'nan')")
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


def test_one_median_of_others_rule_for_own_work_and_run_queue(monkeypatch: Any) -> None:
    # series' netting and runq_extra take the others' median by own.median_of_others (the
    # rule ex is built by), once over every cell: no per-cell Python twin of it.
    import duckdb

    from stepscope.analysis import own, series

    calls: list[int] = []

    def counted(cell: Any, values: Any, n_cells: int) -> Any:
        calls.append(len(values))
        return own.median_of_others(cell, values, n_cells)

    monkeypatch.setattr(series, "median_of_others", counted)
    pos = np.arange(4, dtype=np.int64)
    data = {(r, "forward"): (pos, np.zeros(4), np.full(4, 1.0 + r)) for r in range(3)}
    net = series._net_of_runq(data, {1: {10: 0.5}}, [10, 11, 12, 13])
    assert calls == [12]
    assert net[(1, "forward")][1].tolist()[0] == min(1.5 - 2.0, 0.0)  # 2 - 0.5 against 1 and 3
    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE res AS SELECT (i % 3)::INTEGER AS rank, (i // 3)::BIGINT AS step, "
                    "(i % 5)::DOUBLE AS runq_ms FROM range(30) t(i)")
        series.runq_extra(con)
    finally:
        con.close()
    assert calls == [12, 30]
    assert not hasattr(series, "_median_without")
