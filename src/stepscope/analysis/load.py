"""Loading a run directory's rank files into DuckDB tables, noting what was skipped.

A run directory holds ``rank{R}.jsonl`` and/or ``rank{R}.sqlite`` files (see
:mod:`stepscope.records`). DuckDB reads the JSONL files itself (out of core, in parallel);
SQLite files are converted to JSONL first through Python's ``sqlite3`` because DuckDB's
sqlite extension needs a network download. The result is two tables on one connection:

``steps``  (rank, step, host, t0, step_ms, residual_ms, h2d_hidden_ms) — one row per sampled
           step; ``t0`` is the step start in ms since the run's earliest start (raw clock).
``phases`` (rank, step, name, parent, ms, s, calls, e, path) — one row per phase; ``s``/``e`` are
           offsets in ms from the step start; ``path`` ("forward/h2d") is the key (derived
           from name and parent for schema-1 records, whose ``parent`` is a name).
``colls``  (rank, step, phase, op, pg, pg_size, count, bytes, ms, max_ms, seq_first, seq_last) —
           the records' ``collectives`` sections (schema 2), one row per (phase, op, pg).
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepscope.errors import AnalysisError
from stepscope.records import SCHEMA_VERSION, read_sqlite

_PHASE_TYPE = (
    "STRUCT(name VARCHAR, parent VARCHAR, ms DOUBLE, calls BIGINT, start_ms DOUBLE, end_ms DOUBLE,"
    " path VARCHAR)[]"
)
_COLL_TYPE = (
    "STRUCT(phase VARCHAR, op VARCHAR, pg VARCHAR, pg_size BIGINT, count BIGINT, bytes BIGINT,"
    " ms DOUBLE, max_ms DOUBLE, seq_first BIGINT, seq_last BIGINT)[]"
)
#: Schema versions this reader understands (2 adds phase paths and collectives).
READABLE_SCHEMAS = frozenset({1, SCHEMA_VERSION, 2})
_COLUMNS = {
    "schema": "BIGINT",
    "run_id": "VARCHAR",
    "rank": "BIGINT",
    "world_size": "BIGINT",
    "hostname": "VARCHAR",
    "step": "BIGINT",
    "start_unix_ns": "BIGINT",
    "clock": "VARCHAR",
    "step_ms": "DOUBLE",
    "phases": _PHASE_TYPE,
    "residual_ms": "DOUBLE",
    "h2d_hidden_ms": "DOUBLE",
    "collectives": _COLL_TYPE,
}
_REQUIRED = ("schema", "rank", "step", "start_unix_ns", "step_ms", "phases")


@dataclass
class RunData:
    """A loaded run: the DuckDB connection holding ``steps``/``phases`` and what was skipped."""

    con: Any  # duckdb.DuckDBPyConnection; typed loosely so this module imports duckdb lazily
    run_dir: Path
    ranks: list[int]
    hosts: dict[str, list[int]]
    world_size: int
    run_id: str | None
    clock: str
    records: int
    skipped: list[str] = field(default_factory=list)
    _tmp: Any = None  # keeps the temporary directory (converted SQLite, spill files) alive

    def close(self) -> None:
        self.con.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def _connect(tmp: str, threads: int | None, memory_limit: str | None) -> Any:
    import duckdb

    # A database file (in the temp dir) rather than :memory: lets DuckDB evict table pages
    # to disk, so runs far larger than the memory limit still analyse.
    con = duckdb.connect(str(Path(tmp) / "run.duckdb"))
    con.execute(f"SET temp_directory = '{tmp}'")
    con.execute("SET preserve_insertion_order = false")  # lets big scans stream in parallel
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    if memory_limit:
        con.execute(f"SET memory_limit = '{memory_limit}'")
    return con


def _sqlite_to_jsonl(path: Path, tmp: Path, skipped: list[str]) -> Path | None:
    try:
        recs = read_sqlite(path)
    except sqlite3.Error as exc:
        skipped.append(f"{path.name}: unreadable SQLite file ({exc}); skipped")
        return None
    out = tmp / (path.stem + ".from-sqlite.jsonl")
    with open(out, "w") as fh:
        for rec in recs:
            fh.write(json.dumps(rec) + "\n")
    return out


def _ends_with_newline(path: Path) -> bool:
    size = path.stat().st_size
    if size == 0:
        return True
    with open(path, "rb") as fh:
        fh.seek(size - 1)
        return fh.read(1) == b"\n"


def load_run(
    run_dir: str | os.PathLike[str],
    *,
    threads: int | None = None,
    memory_limit: str | None = None,
) -> RunData:
    """Load every rank file of ``run_dir``; raise :class:`AnalysisError` if nothing is usable.

    Corrupt lines, a torn last line, other schema versions, duplicate steps, missing ranks
    and steps recorded on only some ranks are dropped and described in ``RunData.skipped``.
    """
    root = Path(run_dir)
    if not root.exists():
        raise AnalysisError(f"{root}: no such run directory")
    if not root.is_dir():
        raise AnalysisError(f"{root}: not a directory (expected a run directory of rank files)")
    jsonl = sorted(p for p in root.glob("rank*.jsonl") if p.is_file())
    sqlite_files = sorted(p for p in root.glob("rank*.sqlite") if p.is_file())
    if not jsonl and not sqlite_files:
        raise AnalysisError(f"{root}: no rank*.jsonl or rank*.sqlite files (is this a run directory?)")

    tmpdir = tempfile.TemporaryDirectory(prefix="stepscope-")
    skipped: list[str] = []
    try:
        sources = [p for p in jsonl if p.stat().st_size > 0]
        skipped += [f"{p.name}: empty file" for p in jsonl if p.stat().st_size == 0]
        for p in sqlite_files:
            conv = _sqlite_to_jsonl(p, Path(tmpdir.name), skipped)
            if conv is not None and conv.stat().st_size > 0:
                sources.append(conv)
        if not sources:
            raise AnalysisError(f"{root}: no records in any rank file")
        con = _connect(tmpdir.name, threads, memory_limit)
        data = _build_tables(con, root, sources, skipped)
        data._tmp = tmpdir
        return data
    except BaseException:
        tmpdir.cleanup()
        raise


def _build_tables(con: Any, root: Path, sources: list[Path], skipped: list[str]) -> RunData:
    cols = "{" + ", ".join(f"{k}: '{v}'" for k, v in _COLUMNS.items()) + "}"
    files = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in sources) + "]"
    # ignore_errors turns each unparsable line into an all-NULL row, so counting NULL rows
    # per file tells how many lines were corrupt without a second pass over the bytes.
    con.execute(
        f"""CREATE TABLE raw AS SELECT * FROM read_json({files},
            format='newline_delimited', columns={cols}, ignore_errors=true,
            filename=true, maximum_object_size=67108864)"""
    )
    valid = " AND ".join(f"{c} IS NOT NULL" for c in _REQUIRED)
    for fname, total, good in con.execute(
        f"SELECT filename, count(*), count(*) FILTER (WHERE {valid}) FROM raw GROUP BY 1 ORDER BY 1"
    ).fetchall():
        bad = total - good
        if not bad:
            continue
        path = Path(fname)
        name = path.name.replace(".from-sqlite.jsonl", ".sqlite")
        if not _ends_with_newline(path):
            bad -= 1
            skipped.append(f"{name}: truncated last line skipped (process killed mid-write?)")
        if bad:
            skipped.append(f"{name}: {bad} corrupt or incomplete line(s) of {total} skipped")

    schemas = dict(
        con.execute(f"SELECT schema, count(*) FROM raw WHERE {valid} GROUP BY 1").fetchall()
    )
    if not schemas:
        raise AnalysisError(f"{root}: no valid step records (every line was corrupt)")
    readable = ", ".join(str(v) for v in sorted(READABLE_SCHEMAS))
    if not set(schemas) & READABLE_SCHEMAS:
        found = ", ".join(str(s) for s in sorted(schemas))
        raise AnalysisError(
            f"{root}: records use schema version(s) {found}; this stepscope reads schema "
            f"{readable}"
        )
    for ver, n in sorted(schemas.items()):
        if ver not in READABLE_SCHEMAS:
            skipped.append(
                f"{n} record(s) with schema version {ver} skipped (this stepscope reads "
                f"schema {readable}; mixed versions in one run directory)"
            )

    con.execute(
        f"""CREATE TABLE rec AS SELECT * FROM raw
            WHERE {valid} AND schema IN ({readable}) AND step_ms >= 0"""
    )
    con.execute("DROP TABLE raw")
    n_rec, n_pairs = con.execute(
        "SELECT count(*), (SELECT count(*) FROM (SELECT DISTINCT rank, step FROM rec)) FROM rec"
    ).fetchone()
    if n_pairs < n_rec:
        skipped.append(f"{n_rec - n_pairs} duplicate (rank, step) record(s) skipped")
        con.execute(
            """CREATE OR REPLACE TABLE rec AS SELECT * FROM rec
               QUALIFY row_number() OVER (PARTITION BY rank, step ORDER BY start_unix_ns) = 1"""
        )

    ranks = [int(r) for (r,) in con.execute("SELECT DISTINCT rank FROM rec ORDER BY 1").fetchall()]
    meta = con.execute(
        """SELECT max(world_size), min(start_unix_ns), any_value(run_id),
                  mode(clock), count(DISTINCT run_id) FROM rec"""
    ).fetchone()
    world_size = int(meta[0]) if meta[0] is not None else len(ranks)
    world_size = max(world_size, max(ranks) + 1)
    if meta[4] and meta[4] > 1:
        skipped.append(f"records come from {meta[4]} different run_ids; analysed together")
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        skipped.append(
            f"no records for rank(s) {_fmt_ranks(missing)} of world size {world_size} "
            f"(file missing or empty); analysed {len(ranks)} rank(s)"
        )

    # Cross-rank comparison needs the same steps on every rank; keep the common ones.
    n_ranks = len(ranks)
    con.execute(
        f"""CREATE TABLE common AS SELECT step FROM rec GROUP BY step
            HAVING count(*) = {n_ranks}"""
    )
    n_common, n_all = con.execute(
        "SELECT (SELECT count(*) FROM common), (SELECT count(DISTINCT step) FROM rec)"
    ).fetchone()
    keep = "TRUE"
    if n_common < n_all:
        if n_common >= 3:
            keep = "step IN (SELECT step FROM common)"
            per_rank = con.execute(
                """SELECT rank, count(*) FILTER (WHERE step NOT IN (SELECT step FROM common))
                   FROM rec GROUP BY 1 HAVING count(*) FILTER (
                       WHERE step NOT IN (SELECT step FROM common)) > 0 ORDER BY 1"""
            ).fetchall()
            detail = ", ".join(f"rank {r}: {k}" for r, k in per_rank[:8])
            skipped.append(
                f"ranks recorded different step sets; {n_all - n_common} step(s) not present "
                f"on every rank skipped ({detail}); analysed the {n_common} common steps"
            )
        else:
            skipped.append(
                f"ranks share only {n_common} of {n_all} steps; cross-rank comparison is "
                "per step where ranks overlap and may be unreliable"
            )

    t_min = int(meta[1])
    con.execute(
        f"""CREATE TABLE steps AS SELECT CAST(rank AS INTEGER) AS rank, step,
               coalesce(hostname, 'unknown') AS host,
               CAST(start_unix_ns - {t_min} AS DOUBLE) / 1e6 AS t0,
               step_ms, coalesce(residual_ms, 0.0) AS residual_ms, h2d_hidden_ms
            FROM rec WHERE {keep}"""
    )
    con.execute(
        f"""CREATE TABLE phases AS
            SELECT CAST(rank AS INTEGER) AS rank, step, p.name AS name, p.parent AS parent,
                   coalesce(p.ms, 0.0) AS ms, coalesce(p.start_ms, 0.0) AS s,
                   coalesce(p.calls, 1) AS calls,
                   coalesce(p.end_ms, p.start_ms + p.ms, 0.0) AS e,
                   coalesce(p.path, CASE WHEN p.parent IS NULL THEN p.name
                                         ELSE p.parent || '/' || p.name END) AS path
            FROM (SELECT rank, step, unnest(phases) AS p FROM rec WHERE {keep})
            WHERE p.name IS NOT NULL"""
    )
    con.execute(
        f"""CREATE TABLE colls AS
            SELECT CAST(rank AS INTEGER) AS rank, step, c.phase AS phase, c.op AS op,
                   coalesce(c.pg, 'default') AS pg, c.pg_size AS pg_size,
                   coalesce(c.count, 1) AS count, c.bytes AS bytes, c.ms AS ms,
                   c.max_ms AS max_ms, c.seq_first AS seq_first, c.seq_last AS seq_last
            FROM (SELECT rank, step, unnest(collectives) AS c FROM rec
                  WHERE {keep} AND collectives IS NOT NULL)
            WHERE c.op IS NOT NULL AND c.ms IS NOT NULL AND c.ms >= 0"""
    )
    con.execute("DROP TABLE rec")
    hosts: dict[str, list[int]] = {}
    for host, rank in con.execute(
        "SELECT DISTINCT host, rank FROM steps ORDER BY host, rank"
    ).fetchall():
        hosts.setdefault(str(host), []).append(int(rank))
    n_steps = con.execute("SELECT count(*) FROM steps").fetchone()[0]
    if not n_steps:
        raise AnalysisError(f"{root}: no usable step records")
    return RunData(
        con=con,
        run_dir=root,
        ranks=ranks,
        hosts=hosts,
        world_size=world_size,
        run_id=meta[2],
        clock=str(meta[3] or "cpu"),
        records=int(n_steps),
        skipped=skipped,
    )


def _fmt_ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:16])
    return shown + (f", … (+{len(ranks) - 16})" if len(ranks) > 16 else "")
