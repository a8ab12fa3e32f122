"""DuckDB relations by name, whichever kind they are: whether one exists, whether it has a
column, and dropping it.

Several analysis steps make a name a table on one path and a view on another (``own_excess``: the
grouped or the dense own-work path; ``phase_collectives``; ``raw_records`` and the loader's early tables), and
DuckDB's ``DROP TABLE`` does not drop a view, nor ``DROP VIEW`` a table. Others run on tables
made by hand (tests) as well as on the loader's, and ask first whether a table is there.
"""

from __future__ import annotations

from typing import Any


def exists(con: Any, name: str) -> bool:
    """Whether a table or a view called ``name`` exists (in any catalog or schema)."""
    return bool(con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [name]).fetchone()[0])


def has_column(con: Any, table: str, column: str) -> bool:
    """Whether the relation ``table`` exists and has a column ``column``."""
    return bool(con.execute(
        "SELECT count(*) FROM information_schema.columns WHERE table_name = ? AND column_name = ?",
        [table, column]).fetchone()[0])


def drop(con: Any, name: str) -> None:
    """Drop every relation called ``name`` (a table or a view, in any catalog or schema)."""
    for cat, schema, kind in con.execute(
            "SELECT table_catalog, table_schema, table_type FROM information_schema.tables "
            "WHERE table_name = ?", [name]).fetchall():
        con.execute(f"DROP {'VIEW' if kind == 'VIEW' else 'TABLE'} \"{cat}\".\"{schema}\".{name}")
