"""The columnar copy of a run: rank JSONL files compacted into a Parquet dataset.

While a job runs, every rank appends JSON lines (crash-safe). ``stepscope compact RUN`` -
and ``stepscope report`` on every read - copies the lines added since the last compaction
into Parquet, so the analysis scans typed columns instead of parsing JSON, and re-reads
parse only what is new.

Layout (a hive-partitioned Parquet dataset any engine reads)::

    RUN/parquet/records/rank_block=K/part_<uuid>.parquet   K = rank // 256
    RUN/parquet/phases/rank_block=K/part_<uuid>.parquet    the records' phase lists, flat
    RUN/parquet/_state.json                                 byte offset consumed per file

One row per JSON line, with the fixed typed schema of :data:`stepscope.analysis.record_files.COLUMNS`
but the phase list (:data:`~stepscope.analysis.record_files.RECORD_FIELDS`: whether it is
present and plausible instead), plus ``filename`` (the rank file it came from) and ``rec``
(the record's id, unique in the store); a corrupt line is a row of NULLs (so the report
can still say how many were skipped). Only whole lines are consumed: a torn last
line stays in the JSONL until its newline arrives. A file that shrank, vanished or begins
with other bytes than the ones stored (a run directory rewritten by a new run, even one
that wrote more) triggers a full rebuild.

``phases`` holds one row per element of the records' phase lists, as the analysis'
``phases`` table has them (:func:`stepscope.analysis.record_files.flat_phases_sql`), with its
record's ``rec``, ordered by step within each file and written from the same parse as the
records: the only copy of the lists. The analysis reads them in place where it keeps every
record, and the rows of the records it keeps otherwise.

The analysis reads the dataset through :func:`parquet_source`, a ``read_parquet`` over a
glob, so the same SQL runs on a copy in object storage (``s3://``, ``gs://``, ``hf://``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepscope.analysis.record_files import (
    MAX_LINE_BYTES,
    RECORD_FIELDS,
    VALID_SCALARS,
    drop_long_lines,
    flat_phases_sql,
    json_reader,
    rank_files,
)
from stepscope.common import safefs
from stepscope.common.errors import AnalysisError

STORE_DIR = "parquet"
RECORDS = "records"
STATE = "_state.json"
STATE_VERSION = 8  # 3: gpu_start_unix_ns and phases[].host_ms columns; 4: each file's head;
#                    5: the flat phases dataset; 6: each file's tail, the parts written;
#                    7: collectives[].exposed_ms and hidden_ms; 8: the phase lists only in
#                    the flat dataset, joined to their records by ``rec``
#: The flat copy of the records' phase lists (beside :data:`RECORDS`).
PHASES = "phases"
#: The key a regular line is tagged with (its rank file) in the combined file.
TAG = "_stepscope_file"
#: The combined files' names begin so (one per rank block: ``_combined.K.jsonl``).
COMBINED_PREFIX = "_combined."
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")
_PIECE = 64 << 20
#: A rank file read whole at least this large is parsed where it lies: copying it into a
#: combined file costs more CPU than DuckDB's set-up per file (~2 ms).
_IN_PLACE_BYTES = 512 << 10
#: How much of a rank file's beginning identifies it: its first record (run id, start time).
_HEAD = 4096
_WRITING = "_writing"
#: Largest state file read (a 10^5-rank run's is a few tens of MB).
_MAX_STATE_BYTES = 1 << 30
#: Ranks per partition directory: a report that needs some ranks reads only their blocks,
#: and a 10,000-rank run has 40 directories, not 10,000.
RANK_BLOCK = 256
_REMOTE = ("s3://", "s3a://", "gs://", "gcs://", "hf://", "http://", "https://", "az://",
           "abfss://", "r2://", "file://")


@dataclass
class FileState:
    """How much of one rank file is in the store."""

    offset: int = 0  # bytes consumed (always at a line boundary)
    dropped: int = 0  # lines over the length cap, dropped so far
    torn: bool = False  # bytes after ``offset`` without a final newline
    lines: int = 0  # lines stored through the combined file (tagged with this file's name)
    head: str = ""  # digest of the file's first min(offset, _HEAD) bytes: the same file?
    tail: str = ""  # digest of the _HEAD bytes before ``offset``: not rewritten since?


@dataclass
class CompactResult:
    """What one compaction did; ``files`` is the state per rank file after it."""

    store: Path
    new_bytes: int
    new_files: int
    rebuilt: bool
    files: dict[str, FileState] = field(default_factory=dict)
    #: Why the store was dropped and rebuilt from the JSONL ("" when it was not, or when
    #: it simply did not exist yet): one note for the report.
    note: str = ""


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


def files_source(files: list[str]) -> str:
    """The ``read_parquet`` of the listed Parquet files (paths or URLs), as they are."""
    listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    return f"read_parquet([{listed}], hive_partitioning=false)"


def flat_phases_files(con: Any, location: str) -> list[str]:
    """The flat phases files of a run (a run directory, its store or a URL; for a glob or a
    file of the records dataset, those of the same rank blocks: they may hold other records'
    rows too; none for a store without them), sorted, each under its rank block's directory
    (``phases/rank_block=K/``), as listed now: files that a later compaction adds are not
    read (they have no rows in the tables built before). Read with :func:`files_source`."""
    if is_glob(location) or location.endswith(".parquet"):
        # The records' glob with their dataset's directory for the flat one's.
        head, sep, tail = parquet_glob(location).rpartition(f"/{RECORDS}/")
        if not sep:
            return []
        if not is_glob(tail):  # one records file: its rank block's flat files
            tail = (tail.rpartition("/")[0] + "/*.parquet").lstrip("/")
        return _listed(con, f"{head}/{PHASES}/{tail}")
    for state in (Path(location) / STATE, Path(location) / STORE_DIR / STATE):
        # A local store another stepscope version compacted last: its flat copy (if any) may
        # lack that compaction's records.
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(state.read_text())
            if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
                return []
    return _listed(con, f"{location.rstrip('/')}/**/{PHASES}/*/*.parquet")


def _listed(con: Any, pattern: str) -> list[str]:
    """The files glob ``pattern`` matches, sorted."""
    quoted = pattern.replace("'", "''")
    try:
        return [str(f) for (f,) in con.execute(
            f"SELECT file FROM glob('{quoted}') ORDER BY 1").fetchall()]
    except Exception:  # duckdb.IOException (a URL that cannot be listed): no flat copy
        return []


def write_lines(con: Any, store: Path, lines: str, block: int | None,
                first_rec: int) -> tuple[list[Path], int]:
    """Write the parsed lines of table ``lines`` (:data:`COLUMNS` with ``filename`` and
    ``tagged``) into ``store``: their records and the flat rows of their phase lists, each
    record's id ``rec`` its ``rowid`` plus ``first_rec``. Returns the new parts and how many
    records were written.

    Where every record has a rank of rank block ``block`` (the rule: file ``rank{R}.jsonl``
    holds rank R's records), they are written straight into its directory; else (a corrupt
    line, a rank file holding another rank's records) they are partitioned by their ranks.
    A partitioned write costs about twice the CPU of a plain one.
    """
    import uuid

    n, misfits = con.execute(
        f"""SELECT count(*), count(*) FILTER (
                WHERE (rank // {RANK_BLOCK}) IS DISTINCT FROM {-1 if block is None else block})
            FROM {lines}""").fetchone()
    misfits = misfits or block is None
    rec = f"rowid + {int(first_rec)}"
    fields = f"SELECT {rec} AS rec, {RECORD_FIELDS} FROM {lines}"
    new: list[Path] = []
    if not misfits:
        dest = safefs.safe_dir(store / RECORDS / f"rank_block={block}", store)
        new.append(dest / f"part_{uuid.uuid4()}.parquet")
        con.execute(f"COPY ({fields}) TO '{_quoted(new[-1])}' (FORMAT parquet)")
    else:
        before = set((store / RECORDS).glob("*/*.parquet"))
        con.execute(
            f"""COPY (SELECT *, rank // {RANK_BLOCK} AS rank_block FROM ({fields}))
                TO '{_quoted(store / RECORDS)}' (FORMAT parquet, PARTITION_BY (rank_block),
                                                 FILENAME_PATTERN 'part_{{uuid}}', APPEND)""")
        new += sorted(set((store / RECORDS).glob("*/*.parquet")) - before)
    # The flat rows straight from the parse, one file per rank block, ordered by step: the
    # analysis reads blocks of steps (a step range per row group) and blocks of ranks (a
    # rank block's files). One sort per block (its rows fit in memory).
    blocks = [int(k) for (k,) in con.execute(
        f"""SELECT DISTINCT rank // {RANK_BLOCK} FROM {lines} WHERE {VALID_SCALARS}
            ORDER BY 1""").fetchall()] if misfits else [block]
    for k in blocks:
        dest = safefs.safe_dir(store / PHASES / f"rank_block={k}", store)
        new.append(dest / f"part_{uuid.uuid4()}.parquet")
        mine = "" if not misfits else f" WHERE rank // {RANK_BLOCK} = {k}"
        con.execute(
            f"""COPY (SELECT * FROM ({flat_phases_sql(
                    f"(SELECT {rec} AS rec, * FROM {lines}{mine})")}) ORDER BY step, rank)
                TO '{_quoted(new[-1])}' (FORMAT parquet)""")
    return new, int(n)


def _quoted(path: Path) -> str:
    return str(path).replace("'", "''")


def read_state(store: Path) -> dict[str, FileState]:
    """The offsets per rank file the store holds (empty: none, or a state not to trust)."""
    return _read_state(store)[0]


def _read_state(store: Path) -> tuple[dict[str, FileState], dict[str, list[Any]], int]:
    """``(files, parts, records)``: the state per rank file, the Parquet parts the
    compactions wrote (path in the store: [size, digest of its footer]) and how many
    records they hold (the next record's ``rec``)."""
    try:
        fd = safefs.open_regular(store / STATE)
        with os.fdopen(fd, "rb") as fh:
            doc = json.loads(fh.read(_MAX_STATE_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}, {}, 0
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
        return {}, {}, 0
    files, parts, records = doc.get("files"), doc.get("parts"), doc.get("records")
    if (not isinstance(files, dict) or not isinstance(parts, dict)
            or not isinstance(records, int) or records < 0):
        return {}, {}, 0
    out: dict[str, FileState] = {}
    for name, st in files.items():
        try:
            out[str(name)] = FileState(int(st["offset"]), int(st["dropped"]), bool(st["torn"]),
                                       int(st["lines"]), str(st["head"]), str(st["tail"]))
        except (KeyError, TypeError, ValueError):
            return {}, {}, 0  # a damaged state file: rebuild rather than trust part of it
    return out, {str(k): v for k, v in parts.items()}, records


def _digest(fh: Any, start: int, end: int) -> str:
    """A digest of bytes ``[start, end)`` of the open file ``fh`` ("" for none)."""
    if end <= start:
        return ""
    fh.seek(start)
    return hashlib.blake2b(fh.read(end - start), digest_size=16).hexdigest()


def _marks(path: Path, offset: int) -> tuple[str, str]:
    """``(head, tail)``: digests of the first and the last ``_HEAD`` bytes before ``offset``
    of ``path`` (a file rewritten since, even one grown past ``offset``, differs in one)."""
    try:
        with open(path, "rb") as fh:
            return _digest(fh, 0, min(offset, _HEAD)), _digest(fh, max(0, offset - _HEAD), offset)
    except OSError:
        return "", ""


def _write_state(store: Path, files: dict[str, FileState], parts: dict[str, list[Any]],
                 records: int) -> None:
    doc = {"version": STATE_VERSION, "rank_block": RANK_BLOCK, "records": records,
           "files": {n: {"offset": s.offset, "dropped": s.dropped, "torn": s.torn,
                         "lines": s.lines, "head": s.head, "tail": s.tail}
                     for n, s in sorted(files.items())},
           "parts": dict(sorted(parts.items()))}
    safefs.write_atomic(store / STATE, json.dumps(doc, indent=1).encode())


@contextlib.contextmanager
def _locked(store: Path) -> Iterator[None]:
    """One compaction at a time per store (two reports started together)."""
    import fcntl

    lock = store / "_lock"
    try:
        fd = safefs.open_regular(lock, os.O_RDWR | os.O_CREAT)
    except OSError:
        # A link (or a hardlinked file) planted at the lock's name: removed, not followed.
        lock.unlink(missing_ok=True)
        fd = safefs.open_regular(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "r+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _footer(path: Path) -> list[Any] | None:
    """``[size, digest of the last _HEAD bytes]`` of a Parquet part that is a plain file
    with Parquet's magic at both ends; ``None`` for a link, a hardlink or anything else."""
    try:
        fd = safefs.open_regular(path)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 12 or fh.read(4) != b"PAR1":
            return None
        fh.seek(size - 8)
        end = fh.read(8)
        if end[4:] != b"PAR1" or int.from_bytes(end[:4], "little") > size - 12:
            return None
        return [size, _digest(fh, max(0, size - _HEAD), size)]


def _parts_on_disk(store: Path) -> tuple[dict[str, Path], str]:
    """The Parquet parts under the store's datasets, and why the layout is unsafe ("" if not)."""
    found: dict[str, Path] = {}
    for dataset in (RECORDS, PHASES):
        top = store / dataset
        if not os.path.lexists(top):
            continue
        if top.is_symlink() or not top.is_dir():
            return found, f"{dataset}/ is a link or not a directory"
        for block in os.scandir(top):
            if block.is_symlink() or not block.is_dir(follow_symlinks=False):
                return found, f"{dataset}/{block.name} is a link or not a directory"
            for ent in os.scandir(block.path):
                found[f"{dataset}/{block.name}/{ent.name}"] = Path(ent.path)
    return found, ""


def _store_problem(store: Path, parts: dict[str, list[Any]]) -> str:
    """Why the store's parts cannot be trusted ("" when they are the ones the state lists).

    A part that is a link or hardlink, unreadable (truncated, garbage), not written by a
    compaction of this run (copied in from another run) or missing, or a state rewound
    (restored from a backup: parts it does not list) each mean: rebuild from the JSONL.
    """
    on_disk, unsafe = _parts_on_disk(store)
    if unsafe:
        return unsafe
    for rel, path in sorted(on_disk.items()):
        footer = _footer(path)
        if footer is None:
            return f"{rel} is not a readable Parquet file (or is a link)"
        if rel not in parts:
            return f"{rel} was not written by this run's compaction (copied in, or a state rewound)"
        if parts[rel] != footer:
            return f"{rel} is not the part this run's compaction wrote"
    missing = sorted(set(parts) - set(on_disk))
    if missing:
        return f"{missing[0]} is missing"
    return ""


def drop_store(root: Path) -> None:
    """Drop a run's store (the next compaction rebuilds it from the rank files)."""
    store = root / STORE_DIR
    if store.is_symlink() or not store.is_dir():
        return
    with _locked(store):
        _clear(store)
        (store / STATE).unlink(missing_ok=True)


def _clear(store: Path) -> None:
    """Remove the store's datasets (a link in their place is removed, not followed)."""
    for dataset in (RECORDS, PHASES):
        top = store / dataset
        if top.is_symlink() or (os.path.lexists(top) and not top.is_dir()):
            top.unlink()
        else:
            shutil.rmtree(top, ignore_errors=True)


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
    root = Path(run_dir)
    files = [p for p in rank_files(root)[0] if p.suffix == ".jsonl"]
    if not files:
        raise AnalysisError(f"{root}: no rank*.jsonl files to compact")
    store = safefs.safe_dir(root / STORE_DIR, root)  # UnsafePath (an OSError): a link
    with _locked(store):
        return _compact_locked(root, store, files, threads, memory_limit)


def _compact_locked(root: Path, store: Path, files: list[Path], threads: int | None,
                    memory_limit: str | None) -> CompactResult:
    state, parts, n_records = _read_state(store)
    names = {p.name: p for p in files}
    sizes = {p.name: p.stat().st_size for p in files}
    rebuilt = False
    # A compaction that died between writing Parquet and saving offsets left rows the
    # state does not know about: rebuild rather than count them twice.
    why = ""
    if os.path.lexists(store / _WRITING):
        why = "a compaction was interrupted"
    elif not state and (os.path.lexists(store / RECORDS) or os.path.lexists(store / PHASES)):
        why = f"{STATE} is missing, damaged or from another version"
    else:
        why = next((f"{n} was rewritten, truncated or removed since it was stored"
                    for n, s in state.items()
                    if n not in names or sizes[n] < s.offset
                    or _marks(names[n], s.offset) != (s.head, s.tail)), "")
        why = why or _store_problem(store, parts)
    if why:
        _clear(store)
        (store / _WRITING).unlink(missing_ok=True)
        state, parts, n_records, rebuilt = {}, {}, 0, True
    # Only a store whose parts were dropped gets a note (a state from another version is
    # an upgrade, not damage).
    note = (f"{STORE_DIR}/: {why}; dropped and rebuilt from the rank files"
            if why and "another version" not in why else "")
    before = {n: dataclasses.replace(fs) for n, fs in state.items()}
    new_bytes = 0
    new_files = 0
    with tempfile.TemporaryDirectory(prefix="stepscope-compact-") as tmp:
        # Regular lines of every file go into a combined file per rank block, each tagged
        # with its rank file: DuckDB's typed JSON reader pays a set-up cost per file that
        # dominates a run of 10^4 small files. Irregular files (a line not starting with
        # "{", an overlong line) keep a chunk file of their own, read as before. A large
        # file read whole is parsed where it lies (:func:`_in_place`): no copy at all.
        chunks: dict[int | None, list[Path]] = {}
        in_place: dict[Path, int] = {}  # rank files parsed where they lie: bytes to read
        for name, path in sorted(names.items()):
            st = state.setdefault(name, FileState())
            size = sizes[name]
            if size == st.offset:
                continue
            block = _block_of(name)
            combined = Path(tmp) / f"{COMBINED_PREFIX}{'x' if block is None else block}.jsonl"
            with open(path, "rb") as fh:
                cut = _last_newline(fh, st.offset, size)
                st.torn = size > cut
                if cut == st.offset:
                    continue
                listed = chunks.setdefault(block, [])
                own = None
                if _in_place(path, st.offset, cut, size, Path(tmp)):
                    in_place[path] = cut
                    listed.append(path)
                else:
                    own = _take_lines(fh, name, st, cut, combined, Path(tmp))
            if combined.exists() and combined not in listed:
                listed.insert(0, combined)
            if own is not None:
                bounded, dropped = drop_long_lines(own, Path(tmp), [])
                st.dropped += dropped
                listed.append(bounded)
            new_bytes += cut - st.offset
            new_files += 1
            st.head, st.tail = _marks(path, cut)
            st.offset = cut
        if chunks:
            safefs.write_atomic(store / _WRITING, b"")
            written, n_records = _write_parquet(store, chunks, in_place, threads,
                                                memory_limit, Path(tmp), n_records)
            for rel in written:
                footer = _footer(store / rel)
                if footer is None:
                    raise safefs.UnsafePath(f"{store / rel}: not the part just written")
                parts[rel] = footer
        if chunks or rebuilt or state != before:
            _write_state(store, state, parts, n_records)
        (store / _WRITING).unlink(missing_ok=True)
    return CompactResult(store, new_bytes, new_files, rebuilt, state, note)


def _block_of(name: str) -> int | None:
    """The rank block of a rank file's records by its name (``rank{R}.jsonl``), or None."""
    m = _RANK_FILE.fullmatch(name)
    return int(m.group(1)) // RANK_BLOCK if m else None


def _regular(data: bytes) -> bool:
    """Whether every line of ``data`` (whole lines) starts with "{" and is at most
    :data:`MAX_LINE_BYTES` long: such lines are tagged into the combined file."""
    n_lines = data.count(b"\n")
    if not (data.startswith(b"{") and data.count(b"\n{") == n_lines - 1
            and len(data) <= MAX_LINE_BYTES * max(1, n_lines)):
        return False
    # The longest line, without splitting ``data`` into lines (a copy of every line): from
    # each line start, the last newline within the longest line's reach ends every line
    # that starts before it.
    pos, end = 0, len(data)
    while pos < end:
        nl = data.rfind(b"\n", pos, pos + MAX_LINE_BYTES + 1)
        if nl < 0:
            return end - pos <= MAX_LINE_BYTES
        pos = nl + 1
    return True


def _in_place(path: Path, offset: int, cut: int, size: int, tmp: Path) -> bool:
    """Whether rank file ``path`` is parsed where it lies rather than copied: read whole
    (nothing stored yet, no torn last line), large enough that copying it costs more than
    DuckDB's set-up per file, a name DuckDB reads as it is (no glob, URL or ``~``), and
    no line over :data:`MAX_LINE_BYTES` (those are dropped from a copy)."""
    text = str(path)
    if (offset or cut != size or size < _IN_PLACE_BYTES or is_glob(text) or is_remote(text)
            or text.startswith(("~", "file:"))):
        return False
    bounded, dropped = drop_long_lines(path, tmp, [])
    if bounded != path:
        bounded.unlink()
    return not dropped


def _take_lines(fh: Any, name: str, st: FileState, cut: int, combined: Path,
                tmp: Path) -> Path | None:
    """Copy bytes ``[st.offset, cut)`` of the open rank file ``fh``: regular pieces into
    ``combined`` (each line tagged with ``name``), the rest into a chunk file of the file's
    own, which is returned (None when every piece was regular)."""
    tag = b'{"' + TAG.encode() + b'":' + json.dumps(name).encode() + b","
    own: Path | None = None
    fh.seek(st.offset)
    left = cut - st.offset
    with open(combined, "ab") as out:
        while left > 0:
            data = fh.read(min(left, _PIECE))
            if len(data) < left:  # end the piece at a line end
                data = data[: data.rfind(b"\n") + 1] or data
                fh.seek(st.offset + (cut - st.offset - left) + len(data))
            left -= len(data)
            if own is None and _regular(data):
                # The first "{" has no newline before it: the tag goes in front of it.
                out.write(tag)
                out.write(memoryview(data.replace(b"\n{", b"\n" + tag))[1:])
                st.lines += data.count(b"\n")
            else:
                if own is None:
                    own = tmp / name
                with open(own, "ab") as dst:
                    dst.write(data)
    if not combined.stat().st_size:
        combined.unlink()
    return own


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _copied(path: Path, end: int, tmp: Path) -> Path:
    """A copy of bytes ``[0, end)`` of rank file ``path`` in ``tmp`` (under its name)."""
    out = tmp / path.name
    with open(path, "rb") as src, open(out, "wb") as dst:
        _copy_range(src, dst, 0, end)
    return out


def _write_parquet(store: Path, chunks: dict[int | None, list[Path]], in_place: dict[Path, int],
                   threads: int | None, memory_limit: str | None, tmp: Path,
                   first_rec: int) -> tuple[list[str], int]:
    """Write the chunks' records and their flat phases; the new parts' paths in the store
    and the next record's id.

    ``chunks``: the files to parse by the rank block their names say (None: unknown);
    ``in_place``: those that are rank files, read whole, and the size read of each.
    """
    import duckdb

    con = duckdb.connect()
    try:
        con.execute("SET preserve_insertion_order = false")
        con.execute("SET enable_progress_bar = false")  # it would draw on stdout
        con.execute(f"SET temp_directory = '{_quoted(tmp)}'")
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        if memory_limit:
            con.execute(f"SET memory_limit = '{memory_limit}'")
        safefs.safe_dir(store / RECORDS, store)
        new: list[Path] = []
        for block, files in sorted(chunks.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            _parse(con, files, in_place, tmp)
            parts, n = write_lines(con, store, "parsed_lines", block, first_rec)
            con.execute("DROP TABLE parsed_lines")
            new += parts
            first_rec += n
    finally:
        con.close()
    return [f.relative_to(store).as_posix() for f in new], first_rec


def _parse(con: Any, files: list[Path], in_place: dict[Path, int], tmp: Path) -> None:
    """Parse ``files`` once into table ``parsed_lines`` (what :func:`write_lines` writes).

    A rank file read in place (``in_place``) that grew meanwhile (a live job) may have been
    read past its last whole line: its lines are then copied out and parsed again.
    """
    def parse(sources: list[Path]) -> None:
        con.execute(
            f"""CREATE OR REPLACE TEMP TABLE parsed_lines AS
                SELECT * EXCLUDE ({TAG}) REPLACE (
                       CASE WHEN filename LIKE '%/{COMBINED_PREFIX}%' THEN {TAG}
                            ELSE replace(regexp_replace(filename, '^.*/', ''),
                                         '.bounded.jsonl', '') END AS filename),
                   filename LIKE '%/{COMBINED_PREFIX}%' AS tagged
                FROM {json_reader(sources, extra={TAG: "VARCHAR"})}""")

    parse(files)
    if any(f in in_place and _size(f) != in_place[f] for f in files):
        parse([_copied(f, in_place[f], tmp) if f in in_place else f for f in files])
