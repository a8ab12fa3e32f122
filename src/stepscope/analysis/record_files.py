"""The rank files as DuckDB reads them: which files, lines of bounded length, the typed
reader of their JSON lines, and the rules a plausible record keeps.

Shared by the loader (:mod:`stepscope.analysis.load`), the Parquet store
(:mod:`stepscope.analysis.store`) and goodput's re-read of the files; it imports neither.
"""

from __future__ import annotations

import os
from pathlib import Path

from stepscope.analysis.resource_use import RESOURCE_COLUMNS

_PHASE_TYPE = (
    "STRUCT(name VARCHAR, parent VARCHAR, ms DOUBLE, calls BIGINT, start_ms DOUBLE, end_ms DOUBLE,"
    " path VARCHAR, host_ms DOUBLE)[]"
)
_COLL_TYPE = (
    "STRUCT(phase VARCHAR, op VARCHAR, pg VARCHAR, pg_size BIGINT, count BIGINT, bytes BIGINT,"
    " ms DOUBLE, max_ms DOUBLE, seq_first BIGINT, seq_last BIGINT, recv_bytes BIGINT,"
    " recv_max_bytes BIGINT, exposed_ms DOUBLE, hidden_ms DOUBLE)[]"
)
#: The typed schema of one record line (also the Parquet store's columns, with ``filename``).
COLUMNS = {
    "schema": "BIGINT",
    "run_id": "VARCHAR",
    "rank": "BIGINT",
    "world_size": "BIGINT",
    "hostname": "VARCHAR",
    "step": "BIGINT",
    "start_unix_ns": "BIGINT",
    # CUDA clock: when the GPU ran the step's start (host time at record less the GPU's lag).
    "gpu_start_unix_ns": "BIGINT",
    "clock": "VARCHAR",
    "step_ms": "DOUBLE",
    "phases": _PHASE_TYPE,
    "residual_ms": "DOUBLE",
    "h2d_hidden_ms": "DOUBLE",
    "collectives": _COLL_TYPE,
    "dropped": "JSON",  # per-record loss counts (writer queue full, unresolved steps)
    "counters": "JSON",
}
COLUMNS.update(RESOURCE_COLUMNS)  # [metrics] throughput/flops/memory/device/untimed
REQUIRED = ("schema", "rank", "step", "start_unix_ns", "step_ms", "phases")

#: Bounds on values taken from the data; a record outside them is implausible (hostile or
#: corrupt) and skipped. No job has a million ranks; no step takes 11 days; a start time
#: past 2^62 ns (year 2116) or before 1970 is not a wall clock; one record is a few KB.
MAX_RANKS = 1_000_000
MAX_MS = 1e9
MAX_START_NS = 1 << 62
MAX_LINE_BYTES = 32 << 20
PLAUSIBLE_SCALARS = f"""rank >= 0 AND rank < {MAX_RANKS}
    AND (world_size IS NULL OR (world_size >= 1 AND world_size <= {MAX_RANKS} AND rank < world_size))
    AND isfinite(step_ms) AND step_ms >= 0 AND step_ms <= {MAX_MS}
    AND start_unix_ns >= 0 AND start_unix_ns < {MAX_START_NS}
    AND (residual_ms IS NULL OR (isfinite(residual_ms) AND abs(residual_ms) <= {MAX_MS}))
    AND (h2d_hidden_ms IS NULL OR (isfinite(h2d_hidden_ms) AND abs(h2d_hidden_ms) <= {MAX_MS}))"""
#: The rule for one element ``p`` of a record's phase list (never NULL, also for a NULL ``p``).
PHASE_PLAUSIBLE = f"""(p.ms IS NULL OR (isfinite(p.ms) AND abs(p.ms) <= {MAX_MS}))
        AND (p.start_ms IS NULL OR (isfinite(p.start_ms) AND abs(p.start_ms) <= {MAX_MS}))
        AND (p.end_ms IS NULL OR (isfinite(p.end_ms) AND abs(p.end_ms) <= {MAX_MS}))"""
#: Whether every element of a record's phase list is plausible (TRUE without a list): the
#: records' column ``lists_ok``, computed where the lines are parsed.
LISTS_PLAUSIBLE = f"coalesce(list_bool_and([{PHASE_PLAUSIBLE} for p in phases]), TRUE)"
#: The rule for a record (of ``raw_records``: its list's rule is its column ``lists_ok``).
PLAUSIBLE = f"""{PLAUSIBLE_SCALARS}
    AND lists_ok"""
#: The columns of ``raw_records`` from a parsed line's (:data:`COLUMNS`): every one but its
#: phase list, whose rows are in ``raw_phases`` (:func:`flat_phases_sql`), and what loading
#: checks of the list: ``listed`` (present) and ``lists_ok`` (every element plausible).
RECORD_FIELDS = f"* EXCLUDE (phases), phases IS NOT NULL AS listed, {LISTS_PLAUSIBLE} AS lists_ok"
#: The columns of ``phases`` from one element ``p`` of a record's list (and the record's
#: ``clock``): the ``phases`` statement's and the store's flat copy's (:func:`flat_phases_sql`).
PHASE_ROW = f"""p.name AS name, p.parent AS parent,
                   -- On a CUDA clock the dataloader's events measure GPU idle; the input
                   -- wait is the host's (host_ms), recorded beside it.
                   CASE WHEN clock = 'cuda' AND p.name = 'dataloader' AND p.parent IS NULL
                             AND p.host_ms >= 0 AND p.host_ms <= {MAX_MS}
                        THEN p.host_ms ELSE coalesce(p.ms, 0.0) END AS ms,
                   coalesce(p.start_ms, 0.0) AS s,
                   coalesce(p.calls, 1) AS calls,
                   coalesce(p.end_ms, p.start_ms + p.ms, 0.0) AS e,
                   coalesce(p.path, CASE WHEN p.parent IS NULL THEN p.name
                                         ELSE p.parent || '/' || p.name END) AS path"""
#: Records with every required field but the phase list: the only ones loading may keep.
VALID_SCALARS = " AND ".join(f"{c} IS NOT NULL" for c in REQUIRED if c != "phases")
#: Records (of ``raw_records``) with every required field, their phase list included.
VALID = f"{VALID_SCALARS} AND listed"


def drop_long_lines(path: Path, tmp: Path, skipped: list[str]) -> tuple[Path, int]:
    """``path``, or a copy without lines longer than :data:`MAX_LINE_BYTES`, and how many
    lines were dropped.

    DuckDB rejects a whole file for one object above its ``maximum_object_size``; a real
    record is a few KB, so a line of many MB is damage. One pass of large reads finds them
    (a line that long must span reads), and only a file that has one is copied.
    """
    chunk = 8 << 20
    since_nl = 0
    long_lines = False
    with open(path, "rb") as fh:
        while data := fh.read(chunk):
            first = data.find(b"\n")
            if first < 0:
                since_nl += len(data)
            else:
                long_lines |= since_nl + first > MAX_LINE_BYTES
                since_nl = len(data) - data.rfind(b"\n") - 1
            if since_nl > MAX_LINE_BYTES:
                long_lines = True
            if long_lines:
                break
    if not long_lines:
        return path, 0
    out = tmp / (path.name + ".bounded.jsonl")
    dropped = 0
    with open(path, "rb") as src, open(out, "wb") as dst:
        buf = b""
        skipping = False
        while data := src.read(chunk):
            buf += data
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                if not skipping and nl <= MAX_LINE_BYTES:
                    dst.write(buf[: nl + 1])
                elif not skipping:
                    dropped += 1
                skipping = False
                buf = buf[nl + 1:]
            if len(buf) > MAX_LINE_BYTES:
                if not skipping:
                    dropped += 1
                skipping, buf = True, b""
        if buf and not skipping:
            dst.write(buf)
    skipped.append(long_lines_note(path.name, dropped))
    return out, dropped


def long_lines_note(name: str, dropped: int) -> str:
    return (f"{name}: {dropped} line(s) longer than {MAX_LINE_BYTES >> 20} MiB skipped "
            "(a record is a few KB)")



def rank_files(root: Path) -> tuple[list[Path], list[Path]]:
    """``(rank*.jsonl and rank*.sqlite files inside root, links pointing outside it)``."""
    inside: list[tuple[bool, str]] = []
    outside: list[tuple[bool, str]] = []
    # One scandir, not a stat and two resolves per file: a run has up to 10^5 rank files.
    # Sorted by name (JSONL first) before any Path is built: 10^4 Path objects cost seconds.
    with os.scandir(root) as it:
        for ent in it:
            name = ent.name
            if not name.startswith("rank") or not name.endswith((".jsonl", ".sqlite")):
                continue
            try:
                if not ent.is_file():
                    continue
                link = ent.is_symlink()
            except OSError:
                continue
            # Only a link can point outside; a plain file listed here is in root.
            out = link and not _inside(root, Path(ent.path))
            (outside if out else inside).append((not name.endswith(".jsonl"), name))
    return [root / n for _, n in sorted(inside)], [root / n for _, n in sorted(outside)]



def json_reader(sources: list[Path], extra: dict[str, str] | None = None) -> str:
    """The ``read_json`` table expression over rank JSONL files, typed by :data:`COLUMNS`."""
    cols = "{" + ", ".join(f"{k}: '{v}'" for k, v in {**COLUMNS, **(extra or {})}.items()) + "}"
    files = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in sources) + "]"
    # ignore_errors turns each unparsable line into an all-NULL row, so counting NULL rows
    # per file tells how many lines were corrupt without a second pass over the bytes.
    return f"""read_json({files}, format='newline_delimited', columns={cols},
               ignore_errors=true, filename=true, maximum_object_size={MAX_LINE_BYTES + 2})"""


def flat_phases_sql(records: str) -> str:
    """The rows of ``raw_phases`` from the parsed lines of table expression ``records`` (with
    :data:`COLUMNS` and a record id ``rec``): every element of each list of a record with
    the required fields, ``ok`` where its list is present and it is plausible (a record
    without a list gets one row, not ``ok``). The Parquet store writes them at compaction;
    loading takes the rows of the records it keeps as ``phases``. The rules are
    :data:`PHASE_ROW`'s and :data:`PHASE_PLAUSIBLE`'s."""
    # rank as ``phases`` has it (a rank past 2^31 is implausible: its record is not kept).
    return f"""SELECT rec, TRY_CAST(rank AS INTEGER) AS rank, step, {PHASE_ROW},
                      listed AND {PHASE_PLAUSIBLE} AS ok
               FROM (SELECT rec, rank, step, clock, phases IS NOT NULL AS listed,
                            unnest(coalesce(phases, [NULL])) AS p
                     FROM {records} WHERE {VALID_SCALARS})"""


def no_lines() -> str:
    """A table expression of no parsed lines: :data:`COLUMNS` and ``rec``, typed."""
    cols = ", ".join(f"NULL::{t} AS {c}" for c, t in COLUMNS.items())
    return f"(SELECT NULL::BIGINT AS rec, {cols} WHERE FALSE)"


def _inside(root: Path, p: Path) -> bool:
    try:
        base = root.resolve(strict=True)
        return base in p.resolve(strict=True).parents
    except (OSError, RuntimeError):
        return False
