"""A DuckDB connection stand-in that lists the statements run on it (for tests that count them)."""

from __future__ import annotations

from typing import Any


class SqlSpy:
    """Wraps a connection: ``execute`` appends each statement to ``sqls`` (whitespace runs
    squashed to one space when ``squash``) and runs it; anything else (``register``,
    ``fetchone`` ...) goes to the connection unlisted."""

    def __init__(self, con: Any, sqls: list[str] | None = None, squash: bool = False) -> None:
        self.con = con
        self.sqls: list[str] = [] if sqls is None else sqls
        self._squash = squash

    def execute(self, sql: str, *a: Any) -> Any:
        self.sqls.append(" ".join(sql.split()) if self._squash else sql)
        return self.con.execute(sql, *a)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.con, name)
