"""The columnar copy of a run: rank JSONL files compacted into a Parquet dataset.

While a job runs, every rank appends JSON lines (crash-safe). ``stepscope compact RUN`` -
and ``stepscope report`` on every read - copies the lines added since the last compaction
into Parquet, so the analysis scans typed columns instead of parsing JSON, and re-reads
parse only what is new.

Layout (a hive-partitioned Parquet dataset any engine reads)::

    RUN/parquet/records/rank_block=K/part_<uuid>.parquet   K = rank // 256
    RUN/parquet/phases/rank_block=K/part_<uuid>.parquet    the records' phase lists, flat
    RUN/parquet/_state.json                                 byte offset consumed per file

One row per JSON line, with the fixed typed schema of :data:`stepscope.analysis.load.COLUMNS`
plus ``filename`` (the rank file it came from); a corrupt line is a row of NULLs (so the
report can still say how many were skipped). Only whole lines are consumed: a torn last
line stays in the JSONL until its newline arrives. A file that shrank, vanished or begins
with other bytes than the ones stored (a run directory rewritten by a new run, even one
that wrote more) triggers a full rebuild.

``phases`` holds one row per element of the records' phase lists, as the analysis'
``phases`` table has them (:func:`stepscope.analysis.load.flat_phases_sql`), ordered by
step within each file and written with the records of the same compaction: the analysis
reads them in place instead of decoding the lists into a table.

The analysis reads the dataset through :func:`parquet_source`, a ``read_parquet`` over a
glob, so the same SQL runs on a copy in object storage (``s3://``, ``gs://``, ``hf://``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepscope.errors import AnalysisError

STORE_DIR = "parquet"
RECORDS = "records"
STATE = "_state.json"
STATE_VERSION = 5  # 3: gpu_start_unix_ns and phases[].host_ms columns; 4: each file's head;
#                    5: the flat phases dataset
#: The flat copy of the records' phase lists (beside :data:`RECORDS`).
PHASES = "phases"
#: The key a regular line is tagged with (its rank file) in the combined file.
TAG = "_stepscope_file"
COMBINED = "_combined.jsonl"
_PIECE = 64 << 20
#: How much of a rank file's beginning identifies it: its first record (run id, start time).
_HEAD = 4096
_WRITING = "_writing"
#: Ranks per partition directory: a report that needs some ranks reads only their blocks,
#: and a 10,000-rank run has 40 directories, not 10,000.
RANK_BLOCK = 256
_REMOTE = ("s3://", "s3a://", "gs://", "gcs://", "hf://", "http://", "https://", "az://",
           "abfss://", "r2://")


@dataclass
class FileState:
    """How much of one rank file is in the store."""

    offset: int = 0  # bytes consumed (always at a line boundary)
    dropped: int = 0  # lines over the length cap, dropped so far
    torn: bool = False  # bytes after ``offset`` without a final newline
    lines: int = 0  # lines stored through the combined file (tagged with this file's name)
    head: str = ""  # digest of the file's first min(offset, _HEAD) bytes: the same file?


@dataclass
class CompactResult:
    """What one compaction did; ``files`` is the state per rank file after it."""

    store: Path
    new_bytes: int
    new_files: int
    rebuilt: bool
    files: dict[str, FileState] = field(default_factory=dict)


def is_remote(location: str) -> bool:
    """Whether ``location`` is a URL DuckDB reads itself (object storage, HTTP)."""
    return location.lower().startswith(_REMOTE)


def is_glob(location: str) -> bool:
    return any(c in location for c in "*?[")


def is_store_dir(path: Path) -> bool:
    """A local store (the ``parquet`` directory itself, holding ``records/``) without rank files."""
    return (path / RECORDS).is_dir() and not any(path.glob("rank*.jsonl"))


def parquet_glob(location: str) -> str:
    """The glob of a run's Parquet files: a run directory, its store, a URL or a glob.

    ``**`` matches zero or more directories, so ``s3://bucket/run`` finds the files whether
    the whole run directory or only its ``parquet/`` directory was uploaded there.
    """
    if location.endswith(".parquet"):
        return location
    base = location.rstrip("/")
    if is_glob(base):  # a glob of directories: their Parquet files
        return base + "/*.parquet"
    return f"{base}/**/{RECORDS}/*/*.parquet"


def parquet_source(location: str) -> str:
    """The SQL table expression that reads a run's records from its Parquet dataset."""
    glob = parquet_glob(location).replace("'", "''")
    return (f"(SELECT * EXCLUDE (rank_block) FROM read_parquet('{glob}', "
            "hive_partitioning=true, union_by_name=true))")


def flat_phases_source(con: Any, location: str) -> str | None:
    """The ``read_parquet`` of the flat phases files of a run (a run directory, its store or
    a URL; None for a glob or a file, or a store without them), as listed now: files that
    a later compaction adds are not read (they have no rows in the tables built before)."""
    if is_glob(location) or location.endswith(".parquet"):
        return None
    for state in (Path(location) / STATE, Path(location) / STORE_DIR / STATE):
        # A local store another stepscope version compacted last: its flat copy (if any) may
        # lack that compaction's records.
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(state.read_text())
            if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
                return None
    pattern = f"{location.rstrip('/')}/**/{PHASES}/*/*.parquet".replace("'", "''")
    try:
        files = [str(f) for (f,) in con.execute(
            f"SELECT file FROM glob('{pattern}') ORDER BY 1").fetchall()]
    except Exception:  # duckdb.IOException (a URL that cannot be listed): no flat copy
        return None
    if not files:
        return None
    listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    return f"read_parquet([{listed}], hive_partitioning=false)"


def write_phases(con: Any, store: Path, records: list[str]) -> None:
    """Append the flat phases of the records in Parquet files ``records`` (files of the
    store's rank-block directories) to ``store``."""
    import uuid

    from stepscope.analysis.load import flat_phases_sql

    by_block: dict[str, list[str]] = {}
    for f in records:
        by_block.setdefault(Path(f).parent.name, []).append(f)
    # One file per rank block, ordered by step: the analysis reads blocks of steps (a step
    # range per row group) and blocks of ranks (a rank block's files). One sort per block
    # (its rows fit in memory): one sort of every block's rows at once spilled to disk and
    # took 2.4x the CPU at 10^8 rows.
    for block, files in sorted(by_block.items()):
        listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
        dest = store / PHASES / block
        dest.mkdir(parents=True, exist_ok=True)
        out = str(dest / f"part_{uuid.uuid4()}.parquet").replace("'", "''")
        con.execute(
            f"""COPY (SELECT * FROM ({flat_phases_sql(
                    f"read_parquet([{listed}], hive_partitioning=false)")})
                      ORDER BY step, rank)
                TO '{out}' (FORMAT parquet)"""
        )


def read_state(store: Path) -> dict[str, FileState]:
    try:
        doc = json.loads((store / STATE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
        return {}
    files = doc.get("files")
    if not isinstance(files, dict):
        return {}
    out: dict[str, FileState] = {}
    for name, st in files.items():
        try:
            out[str(name)] = FileState(int(st["offset"]), int(st["dropped"]), bool(st["torn"]),
                                       int(st["lines"]), str(st["head"]))
        except (KeyError, TypeError, ValueError):
            return {}  # a damaged state file: rebuild rather than trust part of it
    return out


def _head(path: Path, offset: int) -> str:
    """A digest of the first ``min(offset, _HEAD)`` bytes of ``path`` ("" for none)."""
    if offset <= 0:
        return ""
    try:
        with open(path, "rb") as fh:
            data = fh.read(min(offset, _HEAD))
    except OSError:
        return ""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _write_state(store: Path, files: dict[str, FileState]) -> None:
    doc = {"version": STATE_VERSION, "rank_block": RANK_BLOCK,
           "files": {n: {"offset": s.offset, "dropped": s.dropped, "torn": s.torn,
                         "lines": s.lines, "head": s.head}
                     for n, s in sorted(files.items())}}
    tmp = store / (STATE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, store / STATE)


@contextlib.contextmanager
def _locked(store: Path) -> Iterator[None]:
    """One compaction at a time per store (two reports started together)."""
    import fcntl

    with open(store / "_lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _last_newline(fh: Any, start: int, end: int) -> int:
    """Offset just past the last newline in ``[start, end)``, or ``start`` if none."""
    step = 1 << 20
    pos = end
    while pos > start:
        lo = max(start, pos - step)
        fh.seek(lo)
        buf = fh.read(pos - lo)
        i = buf.rfind(b"\n")
        if i >= 0:
            return int(lo + i + 1)
        pos = lo
    return start


def _copy_range(src: Any, dst: Any, start: int, end: int) -> None:
    src.seek(start)
    left = end - start
    while left > 0:
        buf = src.read(min(left, 8 << 20))
        if not buf:
            break
        dst.write(buf)
        left -= len(buf)


def compact(run_dir: str | os.PathLike[str], *, threads: int | None = None,
            memory_limit: str | None = None) -> CompactResult:
    """Bring ``RUN/parquet`` up to date with the rank JSONL files; return what changed.

    Raises :class:`AnalysisError` when the run directory has no rank files, and
    ``OSError`` when the store cannot be written (the caller may use a temporary one).
    """
    from stepscope.analysis.load import rank_files

    root = Path(run_dir)
    files = [p for p in rank_files(root)[0] if p.suffix == ".jsonl"]
    if not files:
        raise AnalysisError(f"{root}: no rank*.jsonl files to compact")
    store = root / STORE_DIR
    store.mkdir(exist_ok=True)
    with _locked(store):
        return _compact_locked(root, store, files, threads, memory_limit)


def _compact_locked(root: Path, store: Path, files: list[Path], threads: int | None,
                    memory_limit: str | None) -> CompactResult:
    from stepscope.analysis.load import MAX_LINE_BYTES, drop_long_lines

    state = read_state(store)
    names = {p.name: p for p in files}
    sizes = {p.name: p.stat().st_size for p in files}
    rebuilt = False
    # A compaction that died between writing Parquet and saving offsets left rows the
    # state does not know about: rebuild rather than count them twice.
    if (store / _WRITING).exists() or (not state and (store / RECORDS).exists()) or any(
            n not in names or sizes[n] < s.offset or _head(names[n], s.offset) != s.head
            for n, s in state.items()):
        shutil.rmtree(store / RECORDS, ignore_errors=True)
        shutil.rmtree(store / PHASES, ignore_errors=True)
        state, rebuilt = {}, True
    before = {n: dataclasses.replace(fs) for n, fs in state.items()}
    new_bytes = 0
    new_files = 0
    chunks: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="stepscope-compact-") as tmp:
        # Regular lines of every file go into one combined file, each tagged with its rank
        # file: DuckDB's typed JSON reader pays a set-up cost per file that dominates a run
        # of 10^4 small files. Irregular files (a line not starting with "{", an overlong
        # line) keep a chunk file of their own, read as before.
        combined_path = Path(tmp) / COMBINED
        with open(combined_path, "wb") as combined:
            for name, path in sorted(names.items()):
                st = state.setdefault(name, FileState())
                size = sizes[name]
                if size == st.offset:
                    continue
                with open(path, "rb") as fh:
                    cut = _last_newline(fh, st.offset, size)
                    st.torn = size > cut
                    if cut == st.offset:
                        continue
                    tag = b'{"' + TAG.encode() + b'":' + json.dumps(name).encode() + b","
                    own: Path | None = None
                    fh.seek(st.offset)
                    left = cut - st.offset
                    while left > 0:
                        data = fh.read(min(left, _PIECE))
                        if len(data) < left:  # end the piece at a line end
                            data = data[: data.rfind(b"\n") + 1] or data
                            fh.seek(st.offset + (cut - st.offset - left) + len(data))
                        left -= len(data)
                        n_lines = data.count(b"\n")
                        regular = (own is None and data.startswith(b"{")
                                   and data.count(b"\n{") == n_lines - 1
                                   and len(data) <= MAX_LINE_BYTES * max(1, n_lines)
                                   and max(map(len, data.split(b"\n"))) <= MAX_LINE_BYTES)
                        if regular:
                            combined.write(tag + data[1:-1].replace(b"\n{", b"\n" + tag) + b"\n")
                            st.lines += n_lines
                        else:
                            if own is None:
                                own = Path(tmp) / name
                            with open(own, "ab") as out:
                                out.write(data)
                if own is not None:
                    bounded, dropped = drop_long_lines(own, Path(tmp), [])
                    st.dropped += dropped
                    chunks.append(bounded)
                new_bytes += cut - st.offset
                new_files += 1
                if st.offset < _HEAD:  # the head grows with the bytes consumed, up to _HEAD
                    st.head = _head(path, cut)
                st.offset = cut
        if combined_path.stat().st_size:
            chunks.append(combined_path)
        if chunks:
            (store / _WRITING).touch()
            _write_parquet(store, chunks, threads, memory_limit)
        if chunks or rebuilt or state != before:
            _write_state(store, state)
        (store / _WRITING).unlink(missing_ok=True)
    return CompactResult(store, new_bytes, new_files, rebuilt, state)


def _write_parquet(store: Path, chunks: list[Path], threads: int | None,
                   memory_limit: str | None) -> None:
    import duckdb

    from stepscope.analysis.load import json_reader

    con = duckdb.connect()
    try:
        con.execute("SET preserve_insertion_order = false")
        con.execute("SET enable_progress_bar = false")  # it would draw on stdout
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        if memory_limit:
            con.execute(f"SET memory_limit = '{memory_limit}'")
        dest = str(store / RECORDS).replace("'", "''")
        before = set((store / RECORDS).glob("*/*.parquet"))
        con.execute(
            f"""COPY (SELECT * EXCLUDE ({TAG}) REPLACE (
                                 CASE WHEN filename LIKE '%/{COMBINED}' THEN {TAG}
                                      ELSE replace(regexp_replace(filename, '^.*/', ''),
                                                   '.bounded.jsonl', '') END AS filename),
                             filename LIKE '%/{COMBINED}' AS tagged,
                             rank // {RANK_BLOCK} AS rank_block
                      FROM {json_reader(chunks, extra={TAG: "VARCHAR"})})
                TO '{dest}' (FORMAT parquet, PARTITION_BY (rank_block),
                             FILENAME_PATTERN 'part_{{uuid}}', APPEND)"""
        )
        write_phases(con, store, sorted(str(f) for f in
                                        set((store / RECORDS).glob("*/*.parquet")) - before))
    finally:
        con.close()
