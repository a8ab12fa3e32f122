"""analysis/relations.py: DuckDB relations by name, tables and views alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb

from stepscope.analysis.relations import drop, exists, has_column


def test_exists_has_column_and_drop_treat_a_table_and_a_view_alike() -> None:
    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT 1 AS a, 2.0 AS b")
    con.execute("CREATE VIEW v AS SELECT a FROM t")
    assert exists(con, "t") and exists(con, "v")
    assert not exists(con, "w")
    assert has_column(con, "t", "b") and has_column(con, "v", "a")
    assert not has_column(con, "v", "b")  # the view's own columns, not its source's
    assert not has_column(con, "w", "a")  # no such relation
    assert not exists(con, "t'; DROP TABLE t; --")  # a name is a parameter, never SQL
    assert exists(con, "t")
    drop(con, "v")  # a view: DROP TABLE would have refused it
    assert not exists(con, "v") and exists(con, "t")
    drop(con, "t")
    assert not exists(con, "t")
    drop(con, "t")  # nothing left to drop: no error


def test_drop_removes_a_temporary_relation_and_the_one_it_hid(tmp_path: Path) -> None:
    con = duckdb.connect(str(tmp_path / "run.duckdb"))  # a database file, as the loader's
    con.execute("CREATE TABLE t AS SELECT 1 AS a")
    con.execute("CREATE TEMP VIEW t AS SELECT 2 AS a, 3 AS b")
    assert has_column(con, "t", "b")  # the name a statement would read: the temporary view
    drop(con, "t")
    assert not exists(con, "t")
    assert con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 't'").fetchone() == (0,)
    con.execute("CREATE VIEW u AS SELECT 1 AS a")
    con.execute("CREATE TEMP TABLE u AS SELECT 2 AS a")
    drop(con, "u")
    assert not exists(con, "u")
    assert con.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = 'u'").fetchone() == (0,)


#: Statements a re-read of the small run below runs (141 today): a cap with room for
#: a few more, so that a check or a pass added to every report shows here first.
SMALL_REPORT_STATEMENTS = 150


def test_a_small_report_asks_for_relations_without_a_catalog_query(tmp_path: Path,
                                                                   monkeypatch: Any) -> None:
    # Every statement costs ~1 ms of CPU whatever its size: a report of a few ranks is
    # mostly fixed cost. Asking for a relation by name runs none (it queried
    # information_schema, ~3 ms, some twenty times a report).
    from sqlspy import SqlSpy
    from synth_runs import Slow, SynthRun, write_run

    from stepscope.analysis import load
    from stepscope.analysis.run import analyze_run

    run = write_run(tmp_path / "run", SynthRun(ranks=4, steps=60, hosts=2,
                                               slow=(Slow(1, "forward"),)))
    first = analyze_run(run)  # writes the store: what follows is a re-read
    sqls: list[str] = []
    connect = load._connect
    monkeypatch.setattr(load, "_connect", lambda *a: SqlSpy(connect(*a), sqls, squash=True))
    again = analyze_run(run)
    assert again["stragglers"] == first["stragglers"] and again["stragglers"]
    assert not [s for s in sqls if "information_schema.tables" in s]
    assert 50 < len(sqls) <= SMALL_REPORT_STATEMENTS, len(sqls)
