"""The run on one time base: every rank's step slices and the phases inside them, in time
order, on the aligned timeline (per-host clock offsets removed), for a trace viewer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stepscope.analysis.load import RunData
from stepscope.common.figures import Slice, Timeline

#: Rows fetched from DuckDB at a time: the slices stream, they are never all in memory.
BATCH_ROWS = 50_000


def timeline(doc: dict[str, Any], data: RunData) -> Timeline:
    """The timeline of the loaded run ``data``; its slices are read while iterated, so
    ``data`` stays open until they are consumed."""
    con = data.con
    starts = [_first_start_ms(con, w["start_step"]) for w in doc["windows"]]
    return Timeline(slices=_slices(con), window_start_ms=starts)


def _slices(con: Any) -> Iterator[Slice]:
    # Steps first, then phases, each in time order: parents precede children on a track.
    cur = con.execute(
        """SELECT rank, step, t, step_ms, NULL AS name, NULL AS parent, 0 AS depth FROM aligned_steps
           UNION ALL
           SELECT p.rank, p.step, s.t + p.s, p.e - p.s, p.name, p.parent,
                  CASE WHEN p.parent IS NULL THEN 1 ELSE 2 END
           FROM phases p JOIN aligned_steps s USING (rank, step)
           ORDER BY rank, 3, depth"""
    )
    while rows := cur.fetchmany(BATCH_ROWS):
        for rank, step, t, dur, name, parent, _ in rows:
            yield Slice(rank, step, t, dur, name, parent)


def _first_start_ms(con: Any, step: int) -> float:
    row = con.execute(f"SELECT min(t) FROM aligned_steps WHERE step >= {int(step)}").fetchone()
    return float(row[0] or 0.0)
