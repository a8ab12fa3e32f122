"""The waits' tables at scale: built without a window over every collective, same values."""

from __future__ import annotations

import random
import re
from typing import Any

import duckdb
from sqlspy import SqlSpy

from stepscope.analysis.align import Alignment
from stepscope.analysis.collwaits import build_waits
from stepscope.analysis.pipeline import IS_P2P
from stepscope.common.waits import sql_wait


def _tables(seed: int) -> Any:
    """Hand-made ``collectives``/``phases``/``steps`` of 4 ranks: matched instances, a rank that
    skipped a call (unmatched), one with an extra call (different counts), NULL phases,
    shifted sequence numbers and DDP's grad_sync phases."""
    rng = random.Random(seed)
    con = duckdb.connect()
    con.execute("""CREATE TABLE collectives (rank INTEGER, step BIGINT, phase VARCHAR, op VARCHAR,
                   pg VARCHAR, pg_size INTEGER, count BIGINT, bytes BIGINT, ms DOUBLE,
                   max_ms DOUBLE, seq_first BIGINT, seq_last BIGINT,
                   exposed_ms DOUBLE, hidden_ms DOUBLE)""")
    con.execute("""CREATE TABLE phases (rank INTEGER, step BIGINT, name VARCHAR, path VARCHAR,
                   parent VARCHAR, calls BIGINT, ms DOUBLE, s DOUBLE, e DOUBLE)""")
    con.execute("CREATE TABLE steps (rank INTEGER, step BIGINT, step_ms DOUBLE, residual_ms DOUBLE)")
    colls: list[tuple[Any, ...]] = []
    phases: list[tuple[Any, ...]] = []
    for step in range(12):
        for rank in range(4):
            con.execute("INSERT INTO steps VALUES (?, ?, ?, ?)", [rank, step, 100.0, 0.5])
            for phase, op, pg in (("backward", "all_reduce", "dp"), (None, "all_gather", "dp"),
                                  ("forward", "reduce_scatter", "tp")):
                if step == 3 and rank == 2 and op == "all_gather":
                    continue  # skipped on one rank: not matched
                count = 3 if (step == 5 and rank == 1 and op == "reduce_scatter") else 2
                seq = 10 * step + (1 if step == 7 and rank == 0 else 0)
                ms = round(rng.uniform(1.0, 9.0), 3)
                colls.append((rank, step, phase, op, pg, 4, count, 1 << 20, ms, ms, seq, seq + 1))
            gs = round(rng.uniform(2.0, 6.0), 3)
            phases.append((rank, step, "grad_sync", "backward/grad_sync", "backward", 1, gs,
                           0.0, gs))
    # exposed_ms / hidden_ms NULL: records made before the split, all time exposed.
    con.executemany("INSERT INTO collectives VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL)",
                    colls)
    con.executemany("INSERT INTO phases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", phases)
    return con


def _window_cw(con: Any) -> list[Any]:
    """``collective_waits``'s collective rows as the window over each instance gave them (the old form)."""
    part = "step, coalesce(phase, ''), op, pg"
    return con.execute(
        f"""SELECT * EXCLUDE (w_if), CASE WHEN matched THEN w_if ELSE CAST(0.0 AS DOUBLE) END
                                         AS wait
            FROM (SELECT c.*, count(*) OVER w = e.n AND min(c.count) OVER w = max(c.count) OVER w
                                  AS matched,
                         min(c.seq_first) OVER w IS DISTINCT FROM max(c.seq_first) OVER w
                             AS seq_shift,
                         {sql_wait('c.ms', part)} AS w_if
                  FROM collective_calls c JOIN group_ranks e USING (pg) WHERE NOT c.{IS_P2P}
                  WINDOW w AS (PARTITION BY {part}))
            ORDER BY ALL"""
    ).fetchall()


def test_cw_matched_by_a_group_by_joined_back_not_a_window() -> None:
    # At 10^8 phase samples the window partitioned by (step, phase, op, pg) sorted every
    # collective (17 s wall). Each instance is now grouped once and joined back to its
    # ranks' rows: the same matched flags, sequence shifts and waits, row for row.
    con = _tables(seed=1)
    spy = SqlSpy(con)
    al = Alignment(None, None, False, "single host")
    source, notes = build_waits(spy, 4, al)
    assert source == "collectives"
    assert any("not recorded on every rank" in n for n in notes), notes
    assert any("sequence numbers differ" in n for n in notes), notes
    got = con.execute("SELECT * FROM collective_waits ORDER BY ALL").fetchall()
    cols = [d[0] for d in con.execute("SELECT * FROM collective_waits LIMIT 0").description]
    assert got == _window_cw(con)
    assert cols[-3:] == ["matched", "seq_shift", "wait"]
    matched = [r[cols.index("matched")] for r in got]
    assert True in matched and False in matched
    assert any(r[-1] > 0 for r in got)
    assert all(r[-1] == 0.0 for r in got if not r[cols.index("matched")])
    cw_sql = [s for s in spy.sqls if "TABLE collective_waits AS" in s]
    assert len(cw_sql) == 1 and "OVER" not in cw_sql[0], cw_sql


def test_wait_table_grouped_before_the_join_to_steps() -> None:
    # ``wait`` joined every collective row to ``steps`` and then grouped the joined rows;
    # grouping cw by (rank, step) first joins one row per record: the same sums.
    con = _tables(seed=2)
    spy = SqlSpy(con)
    build_waits(spy, 4, Alignment(None, None, False, "single host"))
    got = con.execute("SELECT * FROM step_waits ORDER BY ALL").fetchall()
    want = con.execute(
        """SELECT s.rank, s.step, CAST(coalesce(sum(c.wait), 0.0) AS DOUBLE) AS wait_ms,
                  CAST(coalesce(sum(greatest(c.ms - c.wait, 0.0)), 0.0) AS DOUBLE) AS comm_ms
           FROM steps s LEFT JOIN collective_waits c USING (rank, step) GROUP BY 1, 2 ORDER BY ALL"""
    ).fetchall()
    assert len(got) == 48 and any(r[2] > 0 for r in got)
    assert [r[:2] for r in got] == [r[:2] for r in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g[2] - w[2]) < 1e-9 and abs(g[3] - w[3]) < 1e-9
    # Grouped a block of ranks at a time (collwaits._WAIT_BLOCK_SHARE), each block grouped
    # before its join.
    wait_sql = [" ".join(s.split()) for s in spy.sqls if "TABLE step_waits AS" in s or "INTO step_waits" in s]
    assert sum("TABLE step_waits AS" in s for s in wait_sql) == 1, wait_sql
    assert all(re.search(r"FROM collective_waits WHERE rank BETWEEN -?\d+ AND \d+ GROUP BY 1, 2\) c", s)
               for s in wait_sql), wait_sql


def _old_call(con: Any, n_ranks: int) -> tuple[list[Any], list[Any]]:
    """``collective_calls`` as the one group-by over the collectives and every grad_sync row gave
    it (records made before the exposed/hidden split: nothing hidden)."""
    con.execute(
        f"""CREATE OR REPLACE TABLE call_old AS
            SELECT rank, step, phase, op, pg, max(pg_size) AS pg_size, sum(count) AS count,
                   sum(bytes) AS bytes, sum(ms) AS ms, min(seq_first) AS seq_first,
                   max(seq_last) AS seq_last, sum(hidden_ms) AS hidden_ms
            FROM (SELECT rank, step, phase, op, pg, coalesce(pg_size, {n_ranks}) AS pg_size,
                         count, bytes, ms, seq_first, seq_last, 0.0::DOUBLE AS hidden_ms
                  FROM collectives
                  UNION ALL
                  SELECT rank, step, parent, 'ddp_allreduce', 'ddp', {n_ranks}, calls, NULL, ms,
                         NULL, NULL, 0.0 FROM phases WHERE name = 'grad_sync')
            GROUP BY 1, 2, 3, 4, 5""")
    return (con.execute("SELECT * FROM call_old ORDER BY ALL").fetchall(),
            con.execute("DESCRIBE call_old").fetchall())


def _call_sql(con: Any) -> str:
    spy = SqlSpy(con)
    build_waits(spy, 4, Alignment(None, None, False, "single host"))
    (sql,) = [" ".join(s.split()) for s in spy.sqls if "TABLE collective_calls AS" in s]
    return sql


def test_call_groups_the_collectives_not_every_grad_sync_row() -> None:
    # At 10^8 phase samples ``collective_calls`` grouped the 10^7 grad_sync rows with the collectives,
    # each row its own group. Where (rank, step, path) is a key of ``phases`` (phase_dups 0)
    # and each grad_sync path is its parent's + "/grad_sync", only the collectives are
    # grouped: the same rows and column types.
    con = _tables(seed=3)
    con.execute("CREATE TABLE duplicate_paths AS SELECT 0 AS n")
    sql = _call_sql(con)
    assert sql.index("GROUP BY") < sql.index("UNION ALL"), sql
    got = con.execute("SELECT * FROM collective_calls ORDER BY ALL").fetchall()
    rows, types = _old_call(con, 4)
    assert got == rows and con.execute("DESCRIBE collective_calls").fetchall() == types
    assert sum(1 for r in got if r[3] == "ddp_allreduce") == 48

    # A path that is not its parent's + the name can share a parent with another: grouped.
    con.execute("""INSERT INTO phases VALUES (1, 4, 'grad_sync', 'head/backward/grad_sync',
                   'backward', 1, 2.5, 0.0, 2.5)""")
    sql = _call_sql(con)
    assert sql.index("UNION ALL") < sql.index("GROUP BY"), sql
    got = con.execute("SELECT * FROM collective_calls ORDER BY ALL").fetchall()
    rows, types = _old_call(con, 4)
    assert got == rows and con.execute("DESCRIBE collective_calls").fetchall() == types
    assert sum(1 for r in got if r[3] == "ddp_allreduce") == 48  # the two summed in one row

    # A recorded collective with DDP's op and group, or duplicate paths: grouped together.
    for fix in ("INSERT INTO collectives VALUES (0, 2, 'backward', 'ddp_allreduce', 'ddp', 4, 1, "
                "NULL, 1.0, 1.0, NULL, NULL, NULL, NULL)", "UPDATE duplicate_paths SET n = 1"):
        con = _tables(seed=3)
        con.execute("CREATE TABLE duplicate_paths AS SELECT 0 AS n")
        con.execute(fix)
        sql = _call_sql(con)
        assert sql.index("UNION ALL") < sql.index("GROUP BY"), (fix, sql)
        assert con.execute("SELECT * FROM collective_calls ORDER BY ALL").fetchall() == _old_call(con, 4)[0]
