"""The per-step record schema (versioned) and a reader tolerant of torn files.

One record is one sampled step on one rank, written as one JSON object per line to
``rank{R}.jsonl`` (or as one row of the SQLite table ``step_time_samples``)::

    {
      "schema": 2,                      # SCHEMA_VERSION (1 is still read: path = parent/name)
      "run_id": "20261122-...",         # same on every rank of a launch
      "rank": 1, "local_rank": 1, "world_size": 4, "hostname": "node-a",
      "device_name": "cpu",             # or "cuda:1" (the device of the step's first mark)
      "step": 17,                       # the training loop's step index
      "start_unix_ns": 1763...,         # host wall clock when the step was entered
      "gpu_start_unix_ns": 1763...,     # CUDA clock only: when the GPU ran the step start (wall)
      "clock": "cpu",                   # "cpu" (perf_counter_ns) or "cuda" (CUDA events)
      "step_ms": 12.5,                  # first phase (or step entry) to step exit
      "phases": [                       # in order of first start; absent phase = did not happen
        {"name": "dataloader", "path": "dataloader", "parent": null, "ms": 3.1, "calls": 1,
         "start_ms": 0.0, "end_ms": 3.1, "host_ms": 3.1},   # host_ms: host-only phases on GPU
        {"name": "forward", "path": "forward", ...},
        {"name": "h2d", "path": "forward/h2d", "parent": "forward", ...}, ...
      ],                                # keyed by path: a name under two parents is two rows
      "residual_ms": 0.4,               # step_ms - sum(ms of phases whose parent is null)
      "side_ms": {"h2d_copy": 2.0},     # spans on other streams, not part of the step sum
      "counters": {"h2d_bytes": 1048576},
      "h2d_hidden_ms": 1.8,             # only when a PrefetchLoader reported its copy
      "collectives": [{"phase": "backward", "op": "all_reduce", "pg": "g0-1", ...}],
                                        # ms = exposed_ms + hidden_ms: time in the collective,
                                        # the part the step's stream waited for, and the part
                                        # that ran beside compute on a side stream (0 on the
                                        # step's stream or the host). Records without them: all
                                        # exposed (the analysis takes exposed_ms, else ms).
      "throughput": {...}, "flops": {...}, "memory": {...}, "device": {...},  # when measured
      "dropped": {"pending_overflow": 0}  # counts since the previous record
    }

``start_ms``/``end_ms`` are offsets from the step start of the phase's first start and last
end, so ``start_unix_ns + start_ms * 1e6`` places a phase on the cross-rank timeline.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepscope.common.errors import StepscopeWarning

SCHEMA_VERSION = 2
#: Schema versions the analysis reads (1 lacks ``path``: it is derived from parent and name).
READABLE_SCHEMAS: tuple[int, ...] = (1, 2)

#: Canonical phase names, in report order. User-named phases follow, then "residual".
CANONICAL_PHASES: tuple[str, ...] = ("dataloader", "h2d", "forward", "backward", "optimizer")

#: Phases stepscope can time automatically (the rest are user-named).
AUTO_PHASES: frozenset[str] = frozenset(CANONICAL_PHASES)

#: Columns of the SQLite table ``step_time_samples``; nested fields are JSON text.
SQLITE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("schema", "INTEGER"),
    ("run_id", "TEXT"),
    ("rank", "INTEGER"),
    ("local_rank", "INTEGER"),
    ("world_size", "INTEGER"),
    ("hostname", "TEXT"),
    ("device_name", "TEXT"),
    ("step", "INTEGER"),
    ("start_unix_ns", "INTEGER"),
    ("gpu_start_unix_ns", "INTEGER"),
    ("clock", "TEXT"),
    ("step_ms", "REAL"),
    ("phases", "TEXT"),
    ("residual_ms", "REAL"),
    ("side_ms", "TEXT"),
    ("counters", "TEXT"),
    ("h2d_hidden_ms", "REAL"),
    ("dropped", "TEXT"),
    ("collectives", "TEXT"),
    ("throughput", "TEXT"),
    ("flops", "TEXT"),
    ("memory", "TEXT"),
    ("device", "TEXT"),
    ("untimed", "INTEGER"),
)
SQLITE_TABLE = "step_time_samples"
_KNOWN_COLUMNS = frozenset(name for name, _ in SQLITE_COLUMNS)
_JSON_COLUMNS = frozenset(
    {"phases", "side_ms", "counters", "dropped", "collectives", "throughput", "flops", "memory", "device"}
)

REQUIRED_KEYS: frozenset[str] = frozenset(
    {"schema", "rank", "step", "start_unix_ns", "clock", "step_ms", "phases"}
)

# Files the listeners write beside the records, read back by the analysis.
#: Each rank's heartbeat, ``rank{R}.status.json``: marks a status file as ours (the reader
#: ignores JSON files without it), its version, and the length exception messages are cut to.
HEARTBEAT_KIND = "stepscope-heartbeat"
HEARTBEAT_SCHEMA = 1
HEARTBEAT_MAX_MESSAGE = 1000
#: The auto-profile's captures, one line per capture (or skipped trigger) in the run directory.
TRIGGERS_FILE = "triggers.jsonl"
TRIGGERS_SCHEMA = 1


def rank_file(out_dir: str | os.PathLike[str], rank: int, sink: str = "jsonl") -> Path:
    """Path of one rank's record file inside a run directory."""
    suffix = {"jsonl": "jsonl", "sqlite": "sqlite"}[sink]
    return Path(out_dir) / f"rank{rank}.{suffix}"


def record_to_row(record: dict[str, Any]) -> tuple[Any, ...]:
    """Flatten a record into a ``step_time_samples`` row (nested fields as JSON text)."""
    return tuple(
        json.dumps(record.get(name))
        if name in _JSON_COLUMNS or isinstance(record.get(name), dict)  # [metrics] device section
        else record.get(name)
        for name, _ in SQLITE_COLUMNS
    )


@dataclass
class ReadReport:
    """What a tolerant read skipped, so callers can say so instead of failing."""

    path: Path
    records: int = 0
    bad_lines: list[int] = field(default_factory=list)
    truncated_tail: bool = False
    schemas: set[int] = field(default_factory=set)


def iter_jsonl(path: str | os.PathLike[str], report: ReadReport | None = None) -> Iterator[dict[str, Any]]:
    """Yield the records of one rank file, skipping torn or corrupt lines.

    A process killed mid-write leaves at most a truncated last line; that is expected and
    counted in ``report.truncated_tail``. Corrupt lines elsewhere are counted in
    ``report.bad_lines`` (1-based line numbers).
    """
    rep = report if report is not None else ReadReport(Path(path))
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")
    last = len(lines) - 1
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict) or not rec.keys() >= REQUIRED_KEYS:
                raise ValueError("not a step record")
        except ValueError:
            # A torn last line is the normal result of a kill mid-write, not corruption.
            if i == last:
                rep.truncated_tail = True
            else:
                rep.bad_lines.append(i + 1)
            continue
        rep.records += 1
        rep.schemas.add(int(rec["schema"]))
        yield rec


def row_to_record(names: list[str], row: tuple[Any, ...] | list[Any]) -> dict[str, Any]:
    """A ``step_time_samples`` row (columns ``names``) as a record; NULLs are left out.

    Raises ``ValueError`` when a nested column is not valid JSON.
    """
    rec: dict[str, Any] = {}
    for name, value in zip(names, row, strict=True):
        if value is None or name not in _KNOWN_COLUMNS:
            continue
        if name == "device" and isinstance(value, str) and not value.startswith("{"):
            rec["device_name"] = value  # schema 1 kept the device's name in this column
            continue
        rec[name] = json.loads(value) if name in _JSON_COLUMNS else value
    if "untimed" in rec:
        rec["untimed"] = bool(rec["untimed"])
    return rec


def read_sqlite(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of one rank's SQLite file, in step order."""
    import sqlite3

    con = sqlite3.connect(f"file:{os.fspath(path)}?mode=ro", uri=True)
    try:
        # Columns by name: files written by other stepscope versions have other column sets.
        present = {r[1] for r in con.execute(f"PRAGMA table_info({SQLITE_TABLE})")}
        names = [name for name, _ in SQLITE_COLUMNS if name in present]
        cols = ", ".join(f'"{name}"' for name in names)
        rows = con.execute(f"SELECT {cols} FROM {SQLITE_TABLE} ORDER BY step").fetchall()
    finally:
        con.close()
    return [row_to_record(names, row) for row in rows]


def read_run(out_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a run directory (JSONL and SQLite rank files), warning on skips.

    Small-run convenience for tests and the demo; the analysis layer reads run
    directories through DuckDB instead.
    """
    out: list[dict[str, Any]] = []
    root = Path(out_dir)
    for path in sorted(root.glob("rank*.jsonl")):
        rep = ReadReport(path)
        out.extend(iter_jsonl(path, rep))
        if rep.bad_lines:
            warnings.warn(f"{path}: skipped corrupt lines {rep.bad_lines[:10]}", StepscopeWarning,
                          stacklevel=2)
    for path in sorted(root.glob("rank*.sqlite")):
        out.extend(read_sqlite(path))
    return out
