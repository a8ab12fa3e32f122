"""DuckDB relations by name, whichever kind they are.

Several analysis steps make a name a table on one path and a view on another (``ex``: the
grouped or the dense own-work path; ``cin``; ``raw`` and the loader's early tables), and
DuckDB's ``DROP TABLE`` does not drop a view, nor ``DROP VIEW`` a table.
"""

from __future__ import annotations

from typing import Any


def drop(con: Any, name: str) -> None:
    """Drop every relation called ``name`` (a table or a view, in any catalog or schema)."""
    for cat, schema, kind in con.execute(
            "SELECT table_catalog, table_schema, table_type FROM information_schema.tables "
            "WHERE table_name = ?", [name]).fetchall():
        con.execute(f"DROP {'VIEW' if kind == 'VIEW' else 'TABLE'} \"{cat}\".\"{schema}\".{name}")
