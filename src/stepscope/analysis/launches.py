"""Runs in one directory: which launches wrote records there, and which one a report shows.

Every record carries its launch's ``run_id`` (the same on every rank of a launch, a new one
per launch). A second job writing into the same ``out_dir`` appends its own records to the
same rank files; the analysis shows one run at a time — the newest by default, or the one
asked for — and says which others the directory holds. Runs are never merged: their step
indices, ranks and times are unrelated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepscope.common.errors import AnalysisError

#: Runs named in a note or an error, at most.
LISTED = 5


@dataclass(frozen=True)
class RunSpan:
    """One run's records in a directory: its id ('' for records without one), how many,
    on how many ranks, and its first and last step start (wall clock, ns)."""

    run_id: str
    records: int
    ranks: int
    first_start_ns: int
    last_start_ns: int

    def to_dict(self, shown: bool) -> dict[str, Any]:
        return {"run_id": self.run_id or None, "records": self.records, "ranks": self.ranks,
                "start_unix": round(self.first_start_ns / 1e9, 3),
                "last_start_unix": round(self.last_start_ns / 1e9, 3), "shown": shown}


def runs_in(con: Any, table: str, valid: str) -> list[RunSpan]:
    """The runs of the records of ``table`` that satisfy ``valid`` (SQL), oldest first."""
    rows = con.execute(
        f"""SELECT coalesce(run_id, ''), count(*), min(start_unix_ns), max(start_unix_ns)
            FROM {table} WHERE {valid} GROUP BY 1 ORDER BY 3, 1""").fetchall()
    ranks: dict[str, int] = {}
    if len(rows) > 1:  # ranks per run: a second pass, only where there is more than one run
        ranks = {str(r): int(n) for r, n in con.execute(
            f"""SELECT coalesce(run_id, ''), count(DISTINCT rank) FROM {table} WHERE {valid}
                GROUP BY 1""").fetchall()}
    return [RunSpan(str(r[0]), int(r[1]), ranks.get(str(r[0]), 0), int(r[2]), int(r[3]))
            for r in rows]


def choose(runs: list[RunSpan], wanted: str | None, where: object) -> RunSpan | None:
    """The run to show: ``wanted`` (an id, or a unique prefix of one), else the newest (the
    latest first step start). None when there are no runs (nothing to choose from)."""
    if not runs:
        return None
    if wanted is None:
        return max(runs, key=lambda r: (r.first_start_ns, r.run_id))
    exact = [r for r in runs if r.run_id == wanted]
    found = exact or [r for r in runs if r.run_id.startswith(wanted)]
    if len(found) == 1:
        return found[0]
    listed = ", ".join(r.run_id or "(no id)" for r in runs[-LISTED:])
    how = "matches several runs" if found else "is not a run there"
    raise AnalysisError(f"{where}: run {wanted!r} {how}; its runs (newest last): {listed}")


def sql_filter(run: RunSpan | None, runs: list[RunSpan]) -> str:
    """The SQL condition keeping ``run``'s records (TRUE where the directory holds one run)."""
    if run is None or len(runs) < 2:
        return "TRUE"
    return "coalesce(run_id, '') = '" + run.run_id.replace("'", "''") + "'"


def runs_note(run: RunSpan, runs: list[RunSpan], where: object) -> str | None:
    """What the report says when the directory holds other runs than the one it shows."""
    others = [r for r in runs if r is not run]
    if not others:
        return None
    newest = run is max(runs, key=lambda r: (r.first_start_ns, r.run_id))
    listed = ", ".join(f"{r.run_id or '(no id)'} ({r.records} records)" for r in others[-LISTED:])
    more = f" and {len(others) - LISTED} more" if len(others) > LISTED else ""
    return (f"{where} holds {len(runs)} runs; this report shows run {run.run_id or '(no id)'}"
            f"{' (the newest)' if newest else ''}, {run.records} records. Others: {listed}{more}"
            " (stepscope report DIR --run ID shows one)")
