"""Report memory stays linear in ranks: many ranks, few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any

import pytest
from sqlspy import SqlSpy
from synth_runs import Slow, SynthRun, make_records, write_run

from stepscope.analysis.run import analyze_run

_CHILD = """
import json, resource, sys
from stepscope.analysis.run import analyze_run
doc = analyze_run(sys.argv[1], threads=2, memory_limit="500MB")
print(json.dumps({"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "ranks": doc["run"]["ranks"], "steps": doc["run"]["steps"]}))
"""


def test_many_ranks_few_steps_stays_small(tmp_path: Path) -> None:
    # 2,000 ranks x 4 steps: the old "median of the other ranks" joined every row to its
    # step's full list of values (ranks^2 cells) and peaked above 2 GB here.
    run = write_run(tmp_path / "run", SynthRun(ranks=2000, steps=4, slow=(Slow(7, "forward"),)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(run)], capture_output=True,
                         text=True, env=env, check=True, timeout=600)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ranks"] == 2000 and res["steps"] == 4
    assert res["rss_mb"] < 700, res


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_median_of_the_other_ranks_is_exact(tmp_path: Path, ranks: int) -> None:
    # The three-middle-values form of "median of the others" against a brute force.
    doc = analyze_run(write_run(tmp_path / "run", SynthRun(ranks=ranks, steps=12, seed=ranks)),
                      keep=True)
    data = doc["_data"]
    try:
        rows = data.con.execute("SELECT rank, step, name, own, others FROM own_excess").fetchall()
    finally:
        data.close()
    own: dict[tuple[int, str], dict[int, float]] = {}
    for rank, step, name, o, _ in rows:
        own.setdefault((step, name), {})[rank] = o
    assert rows
    for rank, step, name, _, others in rows:
        rest = [v for r, v in own[(step, name)].items() if r != rank]
        assert others == pytest.approx(median(rest)), (rank, step, name)


def test_median_of_the_others_with_ties_and_ragged_steps() -> None:
    # build_own on hand-made tables: steps with 1..9 ranks, tied values (coarse rounding).
    import random

    import duckdb

    from stepscope.analysis.own import build_own

    rng = random.Random(3)
    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE phases (rank INTEGER, step BIGINT, name VARCHAR, "
                    "parent VARCHAR, ms DOUBLE, path VARCHAR)")
        con.execute("CREATE TABLE steps (rank INTEGER, step BIGINT, residual_ms DOUBLE)")
        con.execute("CREATE TABLE collective_waits (rank INTEGER, step BIGINT, phase VARCHAR, ms DOUBLE, "
                    "wait DOUBLE)")
        ph, st = [], []
        for step in range(40):
            for rank in range(1 + step % 9):
                ph.append((rank, step, "forward", None, float(rng.randint(0, 4)), "forward"))
                st.append((rank, step, round(rng.uniform(0, 1), 1)))
        con.executemany("INSERT INTO phases VALUES (?, ?, ?, ?, ?, ?)", ph)
        con.executemany("INSERT INTO steps VALUES (?, ?, ?)", st)
        build_own(con)
        rows = con.execute("SELECT rank, step, name, own, others, excess FROM own_excess").fetchall()
    finally:
        con.close()
    assert len(rows) == 2 * len(ph)
    vals: dict[tuple[int, str], dict[int, float]] = {}
    for rank, step, name, o, *_ in rows:
        vals.setdefault((step, name), {})[rank] = o
    for rank, step, name, o, others, excess in rows:
        rest = [v for r, v in vals[(step, name)].items() if r != rank]
        if not rest:
            assert others is None and excess is None
            continue
        assert others == pytest.approx(median(rest)), (rank, step, name)
        assert excess == pytest.approx(o - median(rest))


def _series(rng: Any, n: int) -> list[float]:
    """Noise, spikes, level shifts and windows of random size: what gap series look like."""
    kind = rng.randrange(5)
    xs = [rng.gauss(0.0, rng.choice((0.05, 0.2, 1.0))) for _ in range(n)]
    if kind >= 1:  # scattered spikes, sometimes in pairs a few steps apart
        for _ in range(rng.randrange(1, 12)):
            i = rng.randrange(n)
            xs[i] += rng.uniform(0.5, 8.0)
            if rng.random() < 0.5 and i + 3 < n:
                xs[i + rng.randrange(1, 4)] += rng.uniform(0.5, 8.0)
    if kind >= 2:  # a window (or a step up to the end)
        a = rng.randrange(n)
        e = min(n, a + rng.randrange(2, max(3, n // 2)))
        lift = rng.uniform(0.2, 6.0)
        for i in range(a, e if kind < 4 else n):
            xs[i] += lift
    if kind == 3:  # quantised like 0.01 ms rounding: ties in the medians
        xs = [round(x, 2) for x in xs]
    return xs


def test_window_screen_is_a_bound_never_a_guess() -> None:
    # changepoint.may_hold_window lets find_stragglers skip the change-point search on series
    # that cannot hold a window: wherever it says no, the full search must find nothing.
    import random

    import numpy as np

    from stepscope.analysis import changepoint
    from stepscope.common import robust

    rng = random.Random(22)
    said_no = said_yes = found = 0
    for _ in range(1500):
        n = rng.choice((3, 4, 5, 6, 7, 9, 12, 20, 40, 80, 200))
        xs = _series(rng, n)
        base = robust.median(xs)
        assert float(np.median(np.asarray(xs))) == base  # the screen's base is elevated()'s
        for bar in (0.0, 0.1, 0.3, 1.0, 2.5):
            for min_len in (1, 3, 5):
                if changepoint.may_hold_window(np.asarray(xs, dtype=np.float64), bar, base):
                    said_yes += 1
                    # Not vacuous: windows are there to be let through (counted at min_len=1
                    # only; the bound itself is checked at every min_len, below).
                    found += min_len == 1 and bool(changepoint.elevated(xs, bar, min_len=1))
                else:
                    said_no += 1
                    assert changepoint.elevated(xs, bar, min_len=min_len) == [], (xs, bar, min_len)
    # Not vacuous either way: the screen skips most clean series and lets windows through.
    assert said_no > 1000 and said_yes > 1000 and found > 200, (said_no, said_yes, found)


def test_window_screen_passes_the_window_tests_series() -> None:
    # The shapes of the changepoint tests: a window in noise is let through, flat noise is not.
    import random

    import numpy as np

    from stepscope.analysis import changepoint
    from stepscope.common import robust

    rng = random.Random(3)
    flat = [10.0 + rng.uniform(-0.2, 0.2) for _ in range(300)]
    win = [x + (4.0 if 120 <= i < 160 else 0.0) for i, x in enumerate(flat)]
    assert changepoint.elevated(win, 1.0, min_len=5)
    assert changepoint.may_hold_window(np.asarray(win), 1.0, robust.median(win))
    assert not changepoint.may_hold_window(np.asarray(flat), 1.0, robust.median(flat))
    assert not changepoint.may_hold_window(np.asarray(win), -1.0, robust.median(win))


def test_window_screen_keeps_a_four_step_piece_with_high_ends() -> None:
    # The bound's one tight case: a piece of 4 whose two high values sit at its ends, 3 steps
    # apart (median = mean of a low and a high value). A screen asking for high values at most
    # 2 apart would drop this window (found by a random search over 4-step pieces).
    import numpy as np

    from stepscope.analysis import changepoint
    from stepscope.common import robust

    xs = [10.009374263590994, 5.00610450873629, 5.0074130141873185, 10.004345201257047,
          1.0059807908310054, 0.0004985039725818108, 0.004407840032417573,
          0.0005039944228085746, 5.006197665789897]
    wins = changepoint.elevated(xs, 2.0, min_len=1)
    assert [(w.start, w.end) for w in wins] == [(0, 3)]
    assert changepoint.may_hold_window(np.asarray(xs), 2.0, robust.median(xs))


def test_goodput_days_vectorised_equal_day_by_day() -> None:
    # goodput._days names every start's UTC day at once; it must equal _day() per start,
    # including starts within a microsecond of midnight (fromtimestamp rounds to µs).
    import random

    import numpy as np

    from stepscope.analysis import goodput

    rng = random.Random(5)
    day = 86_400 * 10**9
    ns = [rng.randrange(0, 1 << 62) for _ in range(2000)]
    for _ in range(500):  # around midnights: ±2 µs, ±1 s
        mid = rng.randrange(1, (1 << 62) // day) * day
        ns.append(mid + rng.choice((-2000, -500, -1, 0, 1, 499, 500, 501, 2000, -10**9, 10**9)))
    arr = np.asarray(ns, dtype=np.int64)
    names, idx = goodput._days(arr)
    assert names == sorted(set(names))
    assert [names[i] for i in idx.tolist()] == [goodput._day(n) for n in ns]


def test_grouped_order_statistics_match_robust() -> None:
    # analysis/grouped.py is robust.median / robust.mad over many groups at once: ragged
    # sizes (0..9, so several matrices), ties from coarse rounding, groups out of order.
    import random

    import numpy as np

    from stepscope.analysis import grouped
    from stepscope.common import robust

    rng = random.Random(11)
    groups: dict[int, list[float]] = {g: [round(rng.gauss(0, 2), rng.choice((0, 1, 3)))
                                          for _ in range(rng.randrange(10))] for g in range(60)}
    rows = [(g, v) for g, vs in groups.items() for v in vs]
    rng.shuffle(rows)
    gid = np.array([g for g, _ in rows], dtype=np.int64)
    val = np.array([v for _, v in rows], dtype=np.float64)
    med = grouped.medians(gid, val, len(groups))
    order, starts, counts = grouped.group_order(gid, len(groups))
    mad = grouped.mads_contiguous(val[order], starts, counts)
    for g, vs in groups.items():
        if not vs:
            assert np.isnan(med[g]) and np.isnan(mad[g])
            continue
        assert med[g] == robust.median(vs), (g, vs)
        assert mad[g] == pytest.approx(robust.mad(vs), abs=1e-12), (g, vs)
    with pytest.raises(ValueError, match="group ids"):
        grouped.medians(np.array([0, 3]), np.array([1.0, 2.0]), 3)


def test_thresholds_vectorised_match_the_per_series_rule() -> None:
    # The flag threshold over every series at once against the rule written per series
    # (robust sigma of successive differences / sqrt 2, floored), on ragged series.
    import itertools
    import math
    import random

    import numpy as np

    from stepscope.analysis.series import FLOOR_MS, SIGMAS, thresholds_of
    from stepscope.common import robust

    rng = random.Random(5)
    data = {}
    for r in range(40):
        n = rng.choice((1, 2, 3, 4, 17, 50))
        gap = [round(rng.gauss(0, rng.choice((0.01, 0.3, 2.0))), 2) for _ in range(n)]
        data[(r, rng.choice(("forward", "backward")))] = (
            np.arange(n), np.array(gap), np.zeros(n))
    got = thresholds_of(data, median_step=20.0)
    floor = max(FLOOR_MS, 0.02 * 20.0)
    assert set(got) == set(data)
    for key, (_, gap, _) in data.items():
        d = [b - a for a, b in itertools.pairwise(gap.tolist())]
        sig = SIGMAS * robust.MAD_SCALE * robust.mad(d) / math.sqrt(2.0) if len(d) >= 2 else 0.0
        assert got[key] == pytest.approx(max(sig, floor), rel=1e-12), key
    assert any(v > floor for v in got.values())  # the noisy series are above the floor


def test_waits_credit_each_enclosing_phase_exactly() -> None:
    # pw: a collective in 'a/b/c' counts in 'a', 'a/b' and 'a/b/c', never in 'a/bc' or 'ab'
    # (the prefix-expanded join against the prefix-match rule it replaced).
    import duckdb

    from stepscope.analysis.own import build_phase_waits

    paths = ["a", "a/b", "a/b/c", "a/bc", "ab", "ab/c", "x/y", "a/b/c/d"]
    colls = ["a/b/c", "a/b/c", "a/bc", "ab/c", "a", "x/y/z", "q", "a/b/c/d"]
    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE phases (rank INTEGER, step BIGINT, path VARCHAR, "
                    "parent VARCHAR, ms DOUBLE)")
        con.execute("CREATE TABLE collective_waits (rank INTEGER, step BIGINT, phase VARCHAR, ms DOUBLE, "
                    "wait DOUBLE)")
        for rank in range(2):
            for i, p in enumerate(paths):
                parent = p.rsplit("/", 1)[0] if "/" in p else None
                con.execute("INSERT INTO phases VALUES (?, 0, ?, ?, ?)", [rank, p, parent, 10.0 + i])
            for j, c in enumerate(colls):
                con.execute("INSERT INTO collective_waits VALUES (?, 0, ?, ?, ?)",
                            [rank, c, 1.0 + j, 0.5 * j + rank])
            con.execute("INSERT INTO collective_waits VALUES (?, 0, NULL, 7.0, 3.0)", [rank])
        build_phase_waits(con)
        got = {(r, p): (w, n, c) for r, p, w, n, c in con.execute(
            "SELECT rank, path, wait, ncoll, coll_ms FROM phase_waits").fetchall()}
    finally:
        con.close()
    assert len(got) == 2 * len(paths)
    for rank in range(2):
        for p in paths:
            inside = [j for j, c in enumerate(colls) if c == p or c.startswith(p + "/")]
            want = (sum(0.5 * j + rank for j in inside), len(inside), sum(1.0 + j for j in inside))
            assert got[(rank, p)] == pytest.approx(want), (rank, p)
    assert got[(0, "a")][1] == 5 and got[(0, "ab")][1] == 1 and got[(0, "a/bc")][1] == 1


def _doc(run: Path) -> dict[str, Any]:
    doc = analyze_run(run)
    doc["run"].pop("dir", None)
    return doc


def test_blocks_of_steps_give_the_whole_run_report(tmp_path: Path, monkeypatch: Any) -> None:
    # Alignment spreads, host offsets and pw are built a block of steps at a time; with
    # one step per block the report must be the one-block report, key for key.
    from stepscope.analysis import blocks

    run = write_run(tmp_path / "run", SynthRun(
        ranks=6, steps=60, hosts=2, host_offset_ms=3.0, comm_child=True, seed=4,
        slow=(Slow(2, "forward", 12.0, 20, 34), Slow(4, "optimizer", 6.0))))
    whole = _doc(run)
    data = analyze_run(run, keep=True)["_data"]
    try:
        assert len(blocks.step_blocks(data.con)) == 1
        monkeypatch.setattr(blocks, "BLOCK_RECORDS", 6)  # one step (6 ranks) per block
        assert len(blocks.step_blocks(data.con)) == 60
        assert len(blocks.rank_blocks(data.con)) == 6  # one rank (60 records) per block
    finally:
        data.close()
    split = _doc(run)
    assert split == whole
    assert {(s["rank"], s["phase"]) for s in whole["stragglers"]} >= {(2, "forward")}
    assert whole["run"]["alignment"]["offsets_ms"]


def test_step_blocks_cover_every_step_once() -> None:
    import duckdb

    from stepscope.analysis.blocks import rank_blocks, step_blocks

    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE steps AS SELECT r.range AS rank, s.range * 3 AS step "
                    "FROM range(5) r, range(11) s WHERE NOT (s.range = 4 AND r.range > 1)")
        for cap in (1, 4, 5, 7, 10, 12, 1000):
            got = step_blocks(con, cap)
            steps = [s for a, b in got for s in range(a, b + 1, 3)]
            assert steps == list(range(0, 33, 3)), (cap, got)
            sizes = [con.execute(f"SELECT count(*) FROM steps WHERE step BETWEEN {a} AND {b}")
                     .fetchone()[0] for a, b in got]
            assert all(n <= max(cap, 5) for n in sizes), (cap, sizes)
        for cap in (1, 10, 11, 22, 1000):
            got = rank_blocks(con, cap)
            assert [r for a, b in got for r in range(a, b + 1)] == list(range(5)), (cap, got)
        with pytest.raises(ValueError, match="records per block"):
            step_blocks(con, 0)
    finally:
        con.close()


def test_dense_median_of_others_equals_the_grouped_path(tmp_path: Path, monkeypatch: Any) -> None:
    # build_own's ranks x steps matrices against its grouped path on the same run: the same
    # ex table, the same gap series (keys, order, positions, values), the same thresholds.
    import numpy as np

    from stepscope.analysis import own as own_mod
    from stepscope.analysis.series import read_gap_series, thresholds_of

    run = write_run(tmp_path / "run", SynthRun(
        ranks=7, steps=50, seed=9, comm_child=True, slow=(Slow(3, "backward", 9.0, 10, 25),)))
    out = []
    for dense in (True, False):
        if not dense:
            monkeypatch.setattr(own_mod, "_own_dense", lambda *args: None)
        data = analyze_run(run, keep=True)["_data"]
        try:
            steps = [s for (s,) in data.con.execute("SELECT DISTINCT step FROM steps ORDER BY 1")
                     .fetchall()]
            cols = own_mod.build_own(data.con)
            assert (cols.dense is not None) == dense
            ser = read_gap_series(data.con, steps, cols)
            ex = data.con.execute("SELECT * FROM own_excess ORDER BY rank, step, name").fetchall()
        finally:
            data.close()
        out.append((ex, ser, thresholds_of(ser, 20.0)))
    (ex_d, ser_d, thr_d), (ex_g, ser_g, thr_g) = out
    assert ex_d == ex_g and len(ex_d) > 7 * 50
    assert list(ser_d) == list(ser_g)
    # The matrices keep own work and gaps as own_mod.KEEP_DTYPE: the grouped path's values
    # rounded to it (ex, above, is float64 on both paths).
    keep = own_mod.KEEP_DTYPE
    for k in ser_g:
        (pd, gd, od), (pg, gg, og) = ser_d[k], ser_g[k]
        assert np.array_equal(pd, pg), k
        assert np.array_equal(gd, gg.astype(keep)) and np.array_equal(od, og.astype(keep)), k
    assert thr_d.keys() == thr_g.keys()
    assert all(thr_d[k] == pytest.approx(thr_g[k], rel=1e-5, abs=1e-6) for k in thr_g)


def test_thresholds_in_chunks_equal_all_at_once(monkeypatch: Any) -> None:
    import numpy as np

    from stepscope.analysis import series

    rng = np.random.default_rng(2)
    data = {(r, n): (np.arange(k), rng.normal(0, 1 + r, k), np.ones(k))
            for r in range(40) for n, k in (("a", 1), ("b", 2), ("c", 37), ("d", 100))}
    whole = series.thresholds_of(data, 10.0)
    monkeypatch.setattr(series, "_CHUNK", 50)
    assert series.thresholds_of(data, 10.0) == whole
    assert len(set(whole.values())) > 70  # 80 series long enough for a noise, and the floor


def test_goodput_in_chunks_of_rows_equals_one_chunk(tmp_path: Path, monkeypatch: Any) -> None:
    # The event accounting runs over chunks of records in row order: the running sums (and
    # so every GPU-hour figure) are those of one chunk, even with a chunk of 7 records.
    from stepscope.analysis import goodput

    run = write_run(tmp_path / "run", SynthRun(ranks=5, steps=40, every=2, seed=6,
                                               slow=(Slow(1, "dataloader", 7.0, 10, 20),)))
    whole = _doc(run)["goodput"]
    monkeypatch.setattr(goodput, "_CHUNK_ROWS", 7)
    assert _doc(run)["goodput"] == whole
    assert whole["gpu_hours"] > 0 and whole["lost_gpu_hours"]["stragglers"] > 0


def test_goodput_a_block_of_ranks_at_a_time_equals_every_rank_at_once(
        tmp_path: Path, monkeypatch: Any) -> None:
    # Goodput's rows wait in DuckDB and are accounted whole ranks a block at a time, blocks in
    # rank order: every figure (runs, days, sums in row order) is that of one block, here
    # with one rank per block (a relaunch and a resume: tests/unit/analysis/test_store.py).
    from stepscope.analysis import goodput

    run = write_run(tmp_path / "run", SynthRun(ranks=5, steps=40, every=2, seed=8,
                                               slow=(Slow(3, "h2d", 6.0, 5, 30),)))
    whole = _doc(run)["goodput"]
    blocks_read: list[tuple[int, int]] = []
    real = goodput._block_rows

    def spy(con: Any, block: tuple[int, int], *rest: Any) -> Any:
        blocks_read.append(block)
        return real(con, block, *rest)

    monkeypatch.setattr(goodput, "BLOCK_ROWS", 1)
    monkeypatch.setattr(goodput, "_block_rows", spy)
    assert _doc(run)["goodput"] == whole
    assert blocks_read == [(r, r) for r in range(5)]
    assert whole["gpu_hours"] > 0 and whole["lost_gpu_hours"]["stragglers"] > 0


def test_phase_stats_exact_quantiles_a_block_of_ranks_at_a_time(tmp_path: Path,
                                                                 monkeypatch: Any) -> None:
    # The exact per-(phase, rank) quantiles hold every value of a group at once: over the
    # whole run at 10^8 samples DuckDB spilled ~34 GB. Each statement must read one block of
    # ranks, and the blocks together give the one-statement numbers.
    from stepscope.analysis import blocks
    from stepscope.analysis.stats import create_phase_samples, phase_stats

    run = write_run(tmp_path / "run", SynthRun(ranks=5, steps=30, seed=3, comm_child=True,
                                               slow=(Slow(1, "forward", 9.0),)))
    data = analyze_run(run, keep=True)["_data"]
    try:
        create_phase_samples(data.con)
        whole = phase_stats(data.con, 10**9)

        spy = SqlSpy(data.con)
        sqls = spy.sqls
        monkeypatch.setattr(blocks, "BLOCK_RECORDS", 30)  # one rank (30 records) per block
        split = phase_stats(spy, 10**9)
    finally:
        data.close()
    assert split == whole
    per_rank = [s for s in sqls if "GROUP BY name, rank" in s]
    assert len(per_rank) == 5 and all("rank BETWEEN" in s for s in per_rank), per_rank
    assert [p["rank"] for p in whole["forward"]["per_rank"]] == [0, 1, 2, 3, 4]


def test_rank_stats_exact_quantiles_a_block_of_ranks_at_a_time(tmp_path: Path,
                                                                monkeypatch: Any) -> None:
    # Per rank, the exact step/own/wait quantiles hold every step of the rank: over the whole
    # run at 10^8 samples (10^7 steps) DuckDB ran out of memory at a 1 GB limit.
    from stepscope.analysis import blocks
    from stepscope.analysis.stats import rank_stats

    run = write_run(tmp_path / "run", SynthRun(ranks=5, steps=30, seed=4,
                                               slow=(Slow(3, "backward", 7.0),)))
    data = analyze_run(run, keep=True)["_data"]
    try:
        whole = rank_stats(data.con, data.hosts)
        spy = SqlSpy(data.con)
        sqls = spy.sqls
        monkeypatch.setattr(blocks, "BLOCK_RECORDS", 30)  # one rank (30 records) per block
        split = rank_stats(spy, data.hosts)
    finally:
        data.close()
    assert split == whole
    assert [r["rank"] for r in whole] == [0, 1, 2, 3, 4]
    per_rank = [s for s in sqls if "step_waits w" in s]
    assert len(per_rank) == 5 and all("rank BETWEEN" in s for s in per_rank), per_rank


def _pw_rows(run: Path, unique: bool | None, monkeypatch: Any) -> list[Any]:
    from stepscope.analysis import own as own_mod

    if unique is not None:
        monkeypatch.setattr(own_mod, "phase_keys_unique", lambda con: unique)
    data = analyze_run(run, keep=True)["_data"]
    try:
        return [tuple(r) for r in data.con.execute(
            "SELECT * FROM phase_waits ORDER BY rank, step, path").fetchall()]
    finally:
        data.close()
        monkeypatch.undo()


def test_pw_without_group_by_when_phase_paths_are_keys(tmp_path: Path, monkeypatch: Any) -> None:
    # pw groups every phase row by (rank, step, path) only to fold a record that lists a
    # path twice; with none (load's phase_dups), a plain join gives the same table.
    from stepscope.analysis.load import phase_keys_unique

    run = write_run(tmp_path / "run", SynthRun(ranks=4, steps=20, seed=5, comm_child=True,
                                               slow=(Slow(2, "backward", 6.0),)))
    data = analyze_run(run, keep=True)["_data"]
    try:
        assert data.con.execute("SELECT n FROM duplicate_paths").fetchone()[0] == 0
        assert phase_keys_unique(data.con)
    finally:
        data.close()
    plain, grouped = _pw_rows(run, True, monkeypatch), _pw_rows(run, False, monkeypatch)
    assert plain == grouped and len(plain) == 4 * 20 * 6
    assert any(r[5] > 0 for r in plain)  # waits credited to phases (backward, allreduce)

    # One record listing "forward" twice: not a key any more, the grouped path folds it.
    run = write_run(tmp_path / "dup", SynthRun(ranks=4, steps=20, seed=5, comm_child=True,
                                               slow=(Slow(2, "backward", 6.0),)))
    f = run / "rank1.jsonl"
    lines = f.read_text().splitlines()
    rec = json.loads(lines[3])
    rec["phases"].append(next(p for p in rec["phases"] if p["name"] == "forward"))
    lines[3] = json.dumps(rec)
    f.write_text("\n".join(lines) + "\n")
    data = analyze_run(run, keep=True)["_data"]
    try:
        assert data.con.execute("SELECT n FROM duplicate_paths").fetchone()[0] == 1
        assert not phase_keys_unique(data.con)
        n, keys = data.con.execute(
            "SELECT count(*), count(DISTINCT (rank, step, path)) FROM phase_waits").fetchone()
        assert n == keys == 4 * 20 * 6
    finally:
        data.close()


def test_phase_waits_whole_run_medians_one_path_at_a_time(tmp_path: Path) -> None:
    # phase_waits' run-wide exact medians of the waits held every pw row at once (10^8
    # values: out of memory at a 1 GB limit); one path per statement holds one path's.
    from stepscope.analysis.own import phase_waits

    run = write_run(tmp_path / "run", SynthRun(ranks=4, steps=20, seed=8, comm_child=True,
                                               slow=(Slow(3, "backward", 5.0),)))
    doc = analyze_run(run, keep=True)
    data = doc["_data"]
    try:
        spy = SqlSpy(data.con)
        sqls = spy.sqls
        phases = {k: {**v, "per_rank": [dict(p) for p in v["per_rank"]]}
                  for k, v in doc["phases"].items()}
        for ph in phases.values():
            for t in (ph, *ph["per_rank"]):
                t.pop("wait_ms", None)
        phase_waits(spy, phases)
    finally:
        data.close()
    medians = [s for s in sqls if "median(wait)" in s and "FROM phases" in s]
    assert medians and all("list_contains([$p], anc)" in s or "rank BETWEEN" in s
                           for s in medians), medians
    assert phases == doc["phases"]  # the report's numbers, recomputed the same
    assert any(ph["wait_ms"] > 0 for ph in phases.values())


def test_memory_creep_a_block_of_ranks_at_a_time(tmp_path: Path, monkeypatch: Any) -> None:
    # memory_creep reads each rank's memory series: every record as Python tuples at once was
    # the 10^8 report's peak (~0.85 GB). One rank per block must find the same leaks.
    from stepscope.analysis import blocks
    from stepscope.analysis.resource_use import analyze_resources

    recs = make_records(SynthRun(ranks=5, steps=40, seed=5))
    for rank, rows in recs.items():
        for rec in rows:  # ranks 1 and 4 leak 4 and 6 MB a step; the others hold steady
            rec["memory"] = {"rss_mb": 2000.0 + {1: 4.0, 4: 6.0}.get(rank, 0.0) * rec["step"]
                             + (rec["step"] % 3) * 0.5}
    root = tmp_path / "run"
    root.mkdir()
    for rank, rows in recs.items():
        (root / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = analyze_run(root, keep=True)["_data"]
    try:
        whole = analyze_resources(data.con)["memory"]["creep"]
        spy = SqlSpy(data.con)
        sqls = spy.sqls
        monkeypatch.setattr(blocks, "BLOCK_RECORDS", 40)  # one rank (40 records) per block
        split = analyze_resources(spy)["memory"]["creep"]
    finally:
        data.close()
    assert [c["rank"] for c in whole] == [1, 4]
    assert split == whole
    series = [s for s in sqls if "rss_mb FROM step_resources" in s]
    assert len(series) == 5 and all("rank BETWEEN" in s for s in series), series


def test_resources_read_only_the_sections_present(tmp_path: Path) -> None:
    # res has twenty columns, at 10^8 samples all NULL (no throughput, memory or device
    # sections): the memory series of every rank were still read into Python, and the
    # medians taken, for nothing (~6 s on one core). Only the columns that hold a value.
    from stepscope.analysis.resource_use import analyze_resources

    bare = write_run(tmp_path / "bare", SynthRun(ranks=3, steps=20, seed=6))
    data = analyze_run(bare, keep=True)["_data"]
    try:
        spy = SqlSpy(data.con)
        got = analyze_resources(spy)
    finally:
        data.close()
    assert got["throughput"] == {"tokens_per_s": None, "samples_per_s": None, "tflops": None,
                                 "mfu": None}
    assert got["device"] is None and got["memory"]["creep"] == []
    assert [r["rank"] for r in got["memory"]["per_rank"]] == [0, 1, 2]
    assert all(v is None for r in got["memory"]["per_rank"] for k, v in r.items() if k != "rank")
    reads = [s for s in spy.sqls if "FROM step_resources" in s]
    assert len(reads) == 2, reads  # which columns hold values; the ranks
    assert not [s for s in reads if "median(" in s or "max(" in s or "rank BETWEEN" in s], reads

    recs = make_records(SynthRun(ranks=3, steps=20, seed=6))
    for rows in recs.values():
        for rec in rows:  # memory only: RSS, no allocator or device samples
            rec["memory"] = {"rss_mb": 1000.0 + rec["step"] % 2}
    root = tmp_path / "mem"
    root.mkdir()
    for rank, rows in recs.items():
        (root / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = analyze_run(root, keep=True)["_data"]
    try:
        spy = SqlSpy(data.con)
        got = analyze_resources(spy)
    finally:
        data.close()
    assert got["memory"]["rss_mb"] == 1001.0 and got["memory"]["allocated_mb"] is None
    assert [r["rss_mb"] for r in got["memory"]["per_rank"]] == [1001.0] * 3
    assert got["device"] is None and got["throughput"]["tokens_per_s"] is None
    series = [s for s in spy.sqls if "rank BETWEEN" in s and "FROM step_resources" in s]
    assert series and all(
        s.startswith("SELECT rank, step, rss_mb FROM step_resources") for s in series), series


def test_own_work_one_read_of_phases_per_top_level_phase(tmp_path: Path) -> None:
    # build_own's dense path reads each top-level phase's rows of phases once, the whole run
    # at once, and its collectives' waits from cin once: no own table, no read per block of
    # steps (a block's rows are not contiguous in phases: at 10^8 samples each of the 41
    # blocks' reads scanned 703 of 834 row groups, 22 s CPU).
    import numpy as np

    from stepscope.analysis import own as own_mod

    run = write_run(tmp_path / "run", SynthRun(ranks=5, steps=24, seed=7, comm_child=True,
                                               slow=(Slow(2, "forward", 8.0, 5, 12),)))
    data = analyze_run(run, keep=True)["_data"]
    try:
        tops = [t for (t,) in data.con.execute(
            "SELECT DISTINCT path FROM phases WHERE parent IS NULL").fetchall()]
        spy = SqlSpy(data.con)
        cols = own_mod.build_own(spy)
        assert cols.dense is not None
        assert all(m.dtype == own_mod.KEEP_DTYPE for m in (*cols.dense.own, *cols.dense.excess))
        reads = [s for s in spy.sqls if "FROM phases WHERE path = $p AND parent IS NULL" in s]
        waits = [s for s in spy.sqls if "FROM phase_collectives WHERE anc = $p" in s]
        assert len(reads) == len(waits) == len(tops) >= 4, spy.sqls
        assert not any("WHERE step BETWEEN" in s for s in spy.sqls), spy.sqls
        assert not any("TABLE own_work" in s or "FROM own_work" in s for s in spy.sqls), spy.sqls
        ex = data.con.execute("SELECT count(*), count(excess) FROM own_excess").fetchone()
        assert ex[0] == 5 * 24 * (len(tops) + 1) and ex[1] == ex[0]
        assert all(int(np.count_nonzero(~np.isnan(m))) == 5 * 24 for m in cols.dense.own)
    finally:
        data.close()


@pytest.mark.parametrize(("rank_ids", "steps"), [((3, 4, 5, 6), (10, 11, 12, 13)),
                                                  ((0, 2, 5, 9), (10, 11, 12, 14))])
@pytest.mark.parametrize("unique", [True, False])
def test_dense_own_on_hand_made_tables_equals_the_grouped_path(
        rank_ids: tuple[int, ...], steps: tuple[int, ...], unique: bool, monkeypatch: Any) -> None:
    # The dense path's join of phases and cin on the matrices (rank and step ids made
    # cells in SQL when consecutive, by search when not), against the grouped path's SQL:
    # collectives on some ranks only (the timing rule), one of a (rank, step) with no row
    # of its phase, one on a step of no record, a NULL ms (its waits more than none), a
    # NULL sum of waits.
    import duckdb
    import numpy as np

    from stepscope.analysis import own as own_mod

    rng = np.random.default_rng(len(rank_ids) + rank_ids[1] + unique)
    vals = rng.uniform(0, 10, size=(len(rank_ids), len(steps), 5)).round(3)
    step_rows, phase_rows, cw_rows = [], [], []
    for i, r in enumerate(rank_ids):
        for j, st in enumerate(steps):
            step_rows.append((r, st, vals[i, j, 3]))
            for k, (path, parent) in enumerate([("fwd", None), ("bwd", None), ("bwd/sync", "bwd")]):
                if (path, r, st) == ("fwd", rank_ids[1], 11):
                    continue  # no fwd row: its collective below joins nothing
                ms = None if (path, i, j) == ("bwd", 2, 2) else float(vals[i, j, k])
                phase_rows.append((r, st, path, parent, ms))
            if (i != 1 or j == 3) and (i, j) != (3, 3):  # some ranks untimed in bwd
                wait = (None if (i, j) == (0, 3) else -1.0 if (i, j) == (2, 2)
                        else float(vals[i, j, 4] / 4))
                cw_rows.append((r, st, "bwd/sync", wait, 0.5))
            if i == 0:
                cw_rows.append((r, st, None, 0.25, 0.3))
    cw_rows += [(rank_ids[1], 11, "fwd", 1.5, 1.0), (rank_ids[3], 99 if 13 in steps else 13, "bwd", 1.5, 1.0)]
    out = []
    for dense in (True, False):
        con = duckdb.connect()
        con.execute("CREATE TABLE phases (rank INT, step BIGINT, path VARCHAR, parent VARCHAR, "
                    "ms DOUBLE)")
        con.execute("CREATE TABLE collective_waits (rank INT, step BIGINT, phase VARCHAR, wait DOUBLE, "
                    "ms DOUBLE)")
        con.execute("CREATE TABLE steps (rank INT, step BIGINT, residual_ms DOUBLE)")
        if unique:
            con.execute("CREATE TABLE duplicate_paths AS SELECT 0 AS n")
        con.executemany("INSERT INTO steps VALUES (?, ?, ?)", step_rows)
        con.executemany("INSERT INTO phases VALUES (?, ?, ?, ?, ?)", phase_rows)
        con.executemany("INSERT INTO collective_waits VALUES (?, ?, ?, ?, ?)", cw_rows)
        if not dense:
            monkeypatch.setattr(own_mod, "_own_dense", lambda *args: None)
        cols = own_mod.build_own(con)
        assert (cols.dense is not None) == dense
        out.append(con.execute("SELECT * FROM own_excess ORDER BY rank, step, name").fetchall())
        con.close()
    assert out[0] == out[1] and len(out[0]) > 40
    assert any(row[2] == "bwd" and row[3] == 0.0 for row in out[0])  # greatest(NULL, 0.0)


def test_pw_is_a_view_not_a_table_of_every_phase_row(tmp_path: Path) -> None:
    # pw (every phase row with the collectives inside it) was written as a table: 10^8 rows
    # to the run's database file at scale, read back whole by phase_waits once per path.
    # Its readers select their block or path from both sides of the join instead.
    from stepscope.analysis.own import build_own, phase_waits

    run = write_run(tmp_path / "run", SynthRun(ranks=4, steps=20, seed=9, comm_child=True,
                                               slow=(Slow(1, "backward", 6.0),)))
    doc = analyze_run(run, keep=True)
    data = doc["_data"]
    try:
        kind = data.con.execute("SELECT table_type FROM information_schema.tables "
                                "WHERE table_name = 'phase_waits'").fetchone()[0]
        spy = SqlSpy(data.con)
        build_own(spy)
        phases = {k: {**v, "per_rank": [dict(p) for p in v["per_rank"]]}
                  for k, v in doc["phases"].items()}
        phase_waits(spy, phases)
        inside = {a for (a,) in data.con.execute("SELECT DISTINCT anc FROM phase_collectives").fetchall()}
        known = {p for (p,) in data.con.execute("SELECT path FROM wait_medians").fetchall()}
    finally:
        data.close()
    assert kind == "VIEW"
    assert not any("FROM phase_waits" in s or "JOIN phase_waits" in s for s in spy.sqls), spy.sqls
    # Run-wide medians of the waits only for the paths a collective lies inside (less the
    # top-level ones build_own took); the other paths' rows (wait 0 throughout) come from
    # one statement over phases.
    per_path = [s for s in spy.sqls if "list_contains([$p], anc)" in s]
    assert known and known <= inside and len(per_path) == len(inside - known), per_path
    assert len(inside) < len(doc["phases"]) - 1
    assert phases == doc["phases"]
    assert any(ph["wait_ms"] > 0 for ph in phases.values())


def _phase_waits_with_and_without(run: Path, remove: str, peek: str | None = None) -> tuple[
        dict[str, Any], list[Any], list[tuple[dict[str, Any], list[str]]]]:
    """The report of ``run``; the rows ``peek`` selects from its tables first; ``phase_waits``
    run again (:func:`_phase_waits_again`) with its tables as they are, then after the
    statement ``remove`` (a table it may take its figures from dropped or emptied)."""
    doc = analyze_run(run, keep=True)
    data = doc["_data"]
    try:
        rows = data.con.execute(peek).fetchall() if peek else []
        out = [_phase_waits_again(data.con, doc)]
        data.con.execute(remove)
        out.append(_phase_waits_again(data.con, doc))
    finally:
        data.close()
    return doc, rows, out


def _phase_waits_again(con: Any, doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``phase_waits`` run again on a copy of the report's phases without the fields it
    adds, through a statement spy: (the phases it gives, its statements)."""
    from stepscope.analysis.own import phase_waits

    spy = SqlSpy(con)
    phases = {k: {**v, "per_rank": [dict(p) for p in v["per_rank"]]}
              for k, v in doc["phases"].items()}
    for ph in phases.values():
        for t in (ph, *ph["per_rank"]):
            for k in ("wait_ms", "own_share", "work_share"):
                t.pop(k, None)
    phase_waits(spy, phases)
    return phases, spy.sqls


def test_phase_waits_takes_plain_paths_sums_from_phase_stats(tmp_path: Path) -> None:
    # A path with no collective inside has no wait: its shares are phase sums that
    # phase_stats' scans already took (table phase_sums); phase_waits scanned every phase
    # row again for them. Without that table it scans them itself: the same numbers.
    run = write_run(tmp_path / "run", SynthRun(ranks=5, steps=20, seed=11, comm_child=True,
                                               slow=(Slow(2, "forward", 5.0),)))
    doc, _, ((shared, sqls), (scanned, sqls2)) = _phase_waits_with_and_without(
        run, "DROP TABLE phase_sums")
    assert shared == doc["phases"] and scanned == doc["phases"]
    assert any("FROM phase_sums" in s for s in sqls)
    assert not any("FROM phases WHERE" in s and "NOT list_contains($inside" in s for s in sqls)
    assert any("FROM phases WHERE" in s and "NOT list_contains($inside" in s for s in sqls2)
    assert any(ph.get("own_share") for ph in shared.values())


def test_phase_waits_takes_top_level_medians_from_build_own(tmp_path: Path) -> None:
    # A top-level phase with collectives inside: build_own's dense path joined its rows
    # already and took the run-wide median wait (table wait_medians); phase_waits' own
    # statement joined every row again (at 10^8 samples it spilled to disk, 4.6 s CPU).
    # Its sums come from the per-rank rows. Without the table: the SQL, the same numbers.
    from stepscope.analysis.own import WAIT_MEDIANS

    run = write_run(tmp_path / "run", SynthRun(ranks=5, steps=20, seed=12, comm_child=True,
                                               slow=(Slow(2, "backward", 5.0),)))
    doc, rows, ((shared, sqls), (scanned, sqls2)) = _phase_waits_with_and_without(
        run, f"DELETE FROM {WAIT_MEDIANS}", peek=f"SELECT path, median FROM {WAIT_MEDIANS}")
    known = dict(rows)
    wide, wide2 = ([s for s in q if "list_contains([$p], anc)" in s] for q in (sqls, sqls2))
    assert "backward" in known and known["backward"] > 0
    assert shared == doc["phases"] and scanned == doc["phases"]
    assert len(wide2) == len(wide) + len(known)
    assert shared["backward"]["own_share"] and shared["backward"]["wait_ms"] > 0


def test_goodput_rows_read_a_block_of_ranks_at_a_time_without_a_row_number(
        tmp_path: Path, monkeypatch: Any) -> None:
    # gp_rows numbered every record with a window (one sort of the run), then was staged
    # as a table of every record; each block of ranks is now joined with its split and
    # sorted as it is read, with no table of the run's rows. Same figures as one block
    # (compared run-wide by benchmarks/analysis_scale.py --equivalence).
    from stepscope.analysis import goodput

    run = write_run(tmp_path / "run", SynthRun(ranks=4, steps=30, every=2, seed=6,
                                               slow=(Slow(1, "h2d", 5.0, 4, 20),)))
    sqls: list[str] = []
    real = goodput._block_rows

    def spy(con: Any, block: tuple[int, int], plan: Any) -> Any:
        sqls.append(plan.select(block))
        return real(con, block, plan)

    monkeypatch.setattr(goodput, "_block_rows", spy)
    whole = _doc(run)["goodput"]
    monkeypatch.setattr(goodput, "BLOCK_ROWS", 1)
    assert _doc(run)["goodput"] == whole and whole["gpu_hours"] > 0
    assert sqls and not any("OVER" in s or "row_number" in s for s in sqls), sqls
    assert all("rank BETWEEN" in s for s in sqls)


def test_waits_one_pass_over_the_collectives(tmp_path: Path) -> None:
    # cw was built from a table of every collective with its matched flag (one window pass)
    # and a second window over the matched rows for the wait: one statement gives both, and
    # it matches by a group-by joined back, with no window over every collective
    # (tests/unit/common/test_waits.py checks the grouped form against the window's rows).
    from stepscope.analysis.align import Alignment
    from stepscope.analysis.collwaits import build_waits

    run = write_run(tmp_path / "run", SynthRun(ranks=4, steps=20, seed=12, comm_child=True,
                                               slow=(Slow(1, "backward", 6.0),)))
    doc = analyze_run(run, keep=True)
    data = doc["_data"]
    a = doc["run"]["alignment"]
    try:
        before = data.con.execute("SELECT * FROM collective_waits ORDER BY ALL").fetchall()
        spy = SqlSpy(data.con)
        build_waits(spy, len(data.ranks),
                    Alignment(a["sync_phase"], a["arrival"], a["aligned"], a["method"]))
        after = data.con.execute("SELECT * FROM collective_waits ORDER BY ALL").fetchall()
    finally:
        data.close()
    assert after == before and any(r[-1] > 0 for r in before)
    made = [s for s in spy.sqls if "CREATE OR REPLACE TABLE collective_waits" in s]
    assert len(made) == 1 and "OVER" not in made[0], made
    assert not any("TABLE cm" in s for s in spy.sqls)


def test_goodput_takes_exposed_comm_from_the_waits_table(tmp_path: Path) -> None:
    # exposed_comm per (rank, step) was a second group-by over every collective (cw), beside
    # the one that builds the waits' table: wait.comm_ms is that sum, taken once. Without
    # the column goodput groups cw itself: the same figures.
    from stepscope.analysis import goodput

    run = write_run(tmp_path / "run", SynthRun(ranks=4, steps=24, seed=13, comm_child=True,
                                               slow=(Slow(2, "backward", 5.0),)))
    doc = analyze_run(run, keep=True)
    data = doc["_data"]
    try:
        con = data.con
        shared_sql = goodput._split_sql(con)
        shared = con.execute(f"SELECT * FROM ({shared_sql}) ORDER BY ALL").fetchall()
        con.execute("ALTER TABLE step_waits DROP COLUMN comm_ms")
        own_sql = goodput._split_sql(con)
        grouped = con.execute(f"SELECT * FROM ({own_sql}) ORDER BY ALL").fetchall()
        again = goodput.compute_goodput(con, run, None)
    finally:
        data.close()
    assert "FROM collective_waits" not in shared_sql and "FROM collective_waits" in own_sql
    assert shared == grouped and any(r[2] > 0 for r in shared)
    assert again == doc["goodput"]


def test_host_blocks_hold_whole_hosts_and_cover_every_record_once() -> None:
    # align's spreads are per (step, host): each block must hold every rank of its hosts
    # (hosts whose ranks interleave share a range) and the blocks every record once; a
    # range over the cap is cut by steps.
    import duckdb

    from stepscope.analysis.blocks import WHOLE, host_blocks

    con = duckdb.connect()
    con.execute("CREATE TABLE steps AS SELECT r AS rank, s AS step FROM range(10) a(r), "
                "range(5) b(s)")
    hosts = {"a": [0, 1, 2], "b": [3, 5], "c": [4], "d": [6, 7, 8, 9]}

    def check(cap: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        out = host_blocks(con, hosts, cap)
        seen = [(r, s) for (r0, r1), (s0, s1) in out for r in range(10) for s in range(5)
                if r0 <= r <= r1 and s0 <= s <= s1]
        assert sorted(seen) == [(r, s) for r in range(10) for s in range(5)]
        for (r0, r1), _ in out:
            for rs in hosts.values():
                inside = [r0 <= r <= r1 for r in rs]
                assert all(inside) or not any(inside), (out, rs)
        return out

    assert check(100) == [((0, 9), WHOLE)]
    assert [r for r, _ in check(30)] == [(0, 5), (6, 9)]
    cut = check(10)  # every span over the cap: one step a block
    assert [r for r, _ in cut] == [(0, 2)] * 5 + [(3, 5)] * 5 + [(6, 9)] * 5
    assert {s for _, s in cut} == {(s, s) for s in range(5)}


def test_cin_takes_cw_rows_as_they_are_when_they_are_its_keys(tmp_path: Path,
                                                               monkeypatch: Any) -> None:
    # DDP's grad_sync phases the only collectives: each row of cw is its own (rank, step,
    # anc) group, so cin is cw's rows without a group-by; the same table and report.
    from stepscope.analysis import own as own_mod

    recs = make_records(SynthRun(ranks=4, steps=20, seed=7, slow=(Slow(2, "backward", 6.0),)))
    for r, rows in recs.items():
        for i, rec in enumerate(rows):
            bw = next(p for p in rec["phases"] if p["name"] == "backward")
            rec["phases"].append({**bw, "name": "grad_sync", "parent": "backward",
                                  "ms": 1.0 + ((r + i) % 3) * 0.5})
            rec["phases"][-1].pop("path", None)
    run = tmp_path / "run"
    run.mkdir()
    for r, rows in recs.items():
        (run / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    real = own_mod._waits_are_phase_collective_keys

    def analyze_trace(keyed: bool) -> tuple[Any, ...]:
        seen: list[bool] = []
        with monkeypatch.context() as m:
            m.setattr(own_mod, "_waits_are_phase_collective_keys",
                      lambda con: seen.append(real(con) if keyed else False) or seen[-1])
            doc = analyze_run(run, keep=True)
        data = doc.pop("_data")
        try:
            cin = data.con.execute("SELECT * FROM phase_collectives ORDER BY ALL").fetchall()
            types = data.con.execute("DESCRIBE phase_collectives").fetchall()
        finally:
            data.close()
        return seen, doc, cin, types

    seen, doc, cin, types = analyze_trace(True)
    seen_g, doc_g, cin_g, types_g = analyze_trace(False)
    assert seen == [True] and seen_g == [False]
    assert len(cin) == 4 * 20 and any(row[3] > 0 for row in cin)  # waits in backward
    assert (cin, types) == (cin_g, types_g)
    assert json.dumps(doc, sort_keys=True, default=str) == json.dumps(doc_g, sort_keys=True,
                                                                        default=str)
