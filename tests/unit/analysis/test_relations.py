"""analysis/relations.py: DuckDB relations by name, tables and views alike."""

from __future__ import annotations

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
