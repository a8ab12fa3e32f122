"""Loading a run directory's rank files into DuckDB tables, noting what was skipped.

A run directory holds ``rank{R}.jsonl`` and/or ``rank{R}.sqlite`` files (see
:mod:`stepscope.recording.schema`). DuckDB reads the JSONL files itself (out of core, in parallel);
SQLite files are converted to JSONL first through Python's ``sqlite3`` because DuckDB's
sqlite extension needs a network download. The result is the tables of one connection
(each declared, with its columns, in :mod:`stepscope.analysis.tables`): ``steps`` (one row per
sampled step), ``phases`` (one row per phase; ``path`` "forward/h2d" is the key), the
records' ``collectives``, ``unseen_collectives``, ``lost_steps``, ``step_resources`` and
``duplicate_paths``, and ``timed_records`` for goodput.

:func:`_build` runs the validation stages in order; each takes and returns plain values.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stepscope.analysis import blocks
from stepscope.analysis import store as st
from stepscope.analysis.blocks import in_block, rank_blocks, step_blocks
from stepscope.analysis.launches import RunSpan, choose, runs_in, runs_note, sql_filter
from stepscope.analysis.record_files import (
    COLUMNS,
    MAX_LINE_BYTES,
    MAX_MS,
    MAX_RANKS,
    MAX_START_NS,
    PLAUSIBLE,
    PLAUSIBLE_SCALARS,
    RECORD_FIELDS,
    VALID,
    VALID_SCALARS,
    drop_long_lines,
    flat_phases_sql,
    json_reader,
    long_lines_note,
    no_lines,
    rank_files,
)
from stepscope.analysis.relations import drop, exists
from stepscope.analysis.resource_use import TIMED_FILTER, create_resource_table
from stepscope.common.errors import AnalysisError
from stepscope.common.safefs import UnsafePath
from stepscope.recording.schema import READABLE_SCHEMAS, SQLITE_TABLE, row_to_record

#: The columns of table ``kept_records``: each record's but ``phases`` (their rows are in
#: ``raw_phases``), and its id ``rec``.
_REC_COLUMNS = ", ".join([*(c for c in COLUMNS if c != "phases"), "rec"])
#: The duplicate-path count runs over blocks of ``BLOCK_RECORDS / DUP_BLOCK_SHARE`` records.
DUP_BLOCK_SHARE = 32
#: The same, over the store's flat copy of the phase lists (blocks of steps).
FLAT_DUP_BLOCK_SHARE = 1

#: Whether loading first assumes every phase list present and plausible and checks that
#: while it builds ``phases`` (one decoding of the lists fewer), loading again with the
#: checks up front where the assumption fails. False: the checks up front always (tests).
CHECK_LISTS_IN_PHASES = True
#: The message of the error the ``phases`` statement raises where the assumption fails.
_RECHECK = "stepscope: a phase list is missing or implausible; load again, checking first"
#: Tables (and the view ``kept_records``) that loading builds before ``phases``.
_EARLY = ("kept_records", "timed_records", "common_steps", "steps", "phases")


class _Recheck(Exception):
    """The records are not all as the faster loading assumes: load with the checks first."""
#: A step's start on the run's timeline: when the GPU ran it (CUDA clock, plausible), else when
#: the host entered it. Ranks whose GPUs lag their hosts by different amounts line up by the
#: former; the host time would shift each rank by its own lag.
_START = (f"(CASE WHEN gpu_start_unix_ns >= 0 AND gpu_start_unix_ns < {MAX_START_NS} "
          "THEN gpu_start_unix_ns ELSE start_unix_ns END)")


@dataclass(frozen=True)
class FlatPhases:
    """Where table ``phases`` is a view of the store's flat copy of the phase lists: its
    files (each in its rank block's directory) and the SQL condition on ``step`` of the
    steps it keeps (it may name table ``common_steps``)."""

    files: tuple[str, ...]
    keep: str


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
    #: What was done to the Parquet store (dropped and rebuilt): said, but nothing was lost.
    store_notes: list[str] = field(default_factory=list)
    #: Every run in the directory (oldest first) and what the report says of the others.
    runs: list[RunSpan] = field(default_factory=list)
    runs_note: str | None = None
    #: Set where ``phases`` is a view of the store's flat copy (readers of a block of ranks
    #: can read its files themselves); None where ``phases`` is a table on ``con``.
    flat_phases: FlatPhases | None = None
    _tmp: Any = None  # keeps the temporary directory (converted SQLite, spill files) alive

    def close(self) -> None:
        self.con.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def _connect(tmp: str, threads: int | None, memory_limit: str | None) -> Any:
    import duckdb

    # A database file (in the temp dir) rather than :memory: lets DuckDB evict table pages
    # to disk, so runs far larger than the memory limit still analyze.
    con = duckdb.connect(str(Path(tmp) / "run.duckdb"))
    con.execute(f"SET temp_directory = '{tmp}'")
    con.execute("SET preserve_insertion_order = false")  # lets big scans stream in parallel
    # DuckDB draws a progress bar on stdout for queries over 2 s: it would land in the
    # report (``report --json > file``).
    con.execute("SET enable_progress_bar = false")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    if memory_limit:
        con.execute(f"SET memory_limit = '{memory_limit}'")
    return con


def _sqlite_to_jsonl(path: Path, tmp: Path, skipped: list[str]) -> Path | None:
    out = tmp / (path.stem + ".from-sqlite.jsonl")
    bad = 0
    try:
        con = sqlite3.connect(f"file:{os.fspath(path)}?mode=ro", uri=True)
        try:
            # Columns by name: files from other stepscope versions have other column sets.
            names = [r[1] for r in con.execute(f"PRAGMA table_info({SQLITE_TABLE})")]
            cols = ", ".join(f'"{n}"' for n in names)
            cur = con.execute(f"SELECT {cols} FROM {SQLITE_TABLE} ORDER BY step")
            with open(out, "w") as fh:
                for row in cur:
                    try:  # a nested column that is not JSON costs that record only
                        fh.write(json.dumps(row_to_record(names, row)) + "\n")
                    except (ValueError, TypeError):
                        bad += 1
        finally:
            con.close()
    except sqlite3.Error as exc:
        skipped.append(f"{path.name}: unreadable SQLite file ({exc}); skipped")
        return None
    if bad:
        skipped.append(f"{path.name}: {bad} record(s) with a column that is not valid JSON skipped")
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
    store: bool = True,
    run_id: str | None = None,
) -> RunData:
    """Load every rank file of ``run_dir``; raise :class:`AnalysisError` if nothing is usable.

    A directory that several launches wrote into holds several runs: the records of
    ``run_id`` (an id or a unique prefix of one) are loaded, by default the newest run's
    (:mod:`stepscope.analysis.launches`).

    Corrupt lines, a torn last line, other schema versions, duplicate steps, missing ranks
    and steps recorded on only some ranks are dropped and described in ``RunData.skipped``.

    With ``store`` (the default) the rank JSONL files are first compacted into the run's
    Parquet copy (:mod:`stepscope.analysis.store`; only new lines are parsed) and analysed
    from it. ``run_dir`` may also be a Parquet store elsewhere: its directory, a glob, or
    a URL DuckDB reads (``s3://bucket/run``).
    """
    loc = os.fspath(run_dir)
    # An existing directory is a run (or a store), whatever characters its name holds.
    if st.is_remote(loc) or (st.is_glob(loc) and not Path(loc).is_dir()) or st.is_store_dir(Path(loc)):
        return _load_parquet(loc, threads, memory_limit, [], run_id=run_id)
    root = Path(run_dir)
    if not root.exists():
        raise AnalysisError(f"{root}: no such run directory")
    if not root.is_dir():
        raise AnalysisError(f"{root}: not a directory (expected a run directory of rank files)")
    found, outside = rank_files(root)
    jsonl = [p for p in found if p.suffix == ".jsonl"]
    sqlite_files = [p for p in found if p.suffix == ".sqlite"]
    if not jsonl and not sqlite_files:
        raise AnalysisError(f"{root}: no rank*.jsonl or rank*.sqlite files (is this a run directory?)")
    skipped: list[str] = [f"{p.name}: links outside the run directory; not read" for p in outside]
    store_notes: list[str] = []
    if store and jsonl and not sqlite_files:
        try:
            res = st.compact(root, threads=threads, memory_limit=memory_limit)
        except MemoryError:
            # Python's own memory ran out (a run of ~10^6 rank files): one line, not a traceback.
            raise AnalysisError(f"{root}: out of memory compacting {len(jsonl):,} rank files "
                                "into the Parquet store") from None
        except UnsafePath as exc:  # a link where the store would be: not followed
            store_notes.append(f"{st.STORE_DIR}/: {exc}; the rank files were read directly")
        except OSError:
            pass  # a read-only run directory: analyze the JSONL directly, as before
        except Exception as exc:
            # duckdb.IOException is no OSError: a directory DuckDB cannot create there (a
            # name it refuses) also means "analyze the JSONL directly".
            if type(exc).__name__ != "IOException":
                raise
        else:
            notes = []
            for name, fs in sorted(res.files.items()):
                if fs.dropped:
                    notes.append(long_lines_note(name, fs.dropped))
            notes += [f"{p.name}: empty file" for p in jsonl if p.stat().st_size == 0]
            try:
                data = _load_parquet(str(res.store), threads, memory_limit, skipped + notes,
                                     root, {n: fs.offset for n, fs in res.files.items() if fs.torn},
                                     {n: fs.lines for n, fs in res.files.items()}, run_id)
                data.store_notes = [res.note] if res.note else []
                return data
            except AnalysisError:
                raise
            except Exception as exc:
                # The store is a cache of the JSONL: a part DuckDB cannot read (damaged
                # after the checks) is dropped and the rank files are read directly.
                if "duckdb" not in type(exc).__module__:
                    raise
                with contextlib.suppress(OSError):  # read-only: the rank files are read anyway
                    st.drop_store(root)
                store_notes = [f"{st.STORE_DIR}/: unreadable ({str(exc).splitlines()[0][:200]});"
                               " dropped; the rank files were read directly"]

    tmpdir = tempfile.TemporaryDirectory(prefix="stepscope-")
    try:
        sources = [drop_long_lines(p, Path(tmpdir.name), skipped)[0]
                   for p in jsonl if p.stat().st_size > 0]
        skipped += [f"{p.name}: empty file" for p in jsonl if p.stat().st_size == 0]
        for p in sqlite_files:
            conv = _sqlite_to_jsonl(p, Path(tmpdir.name), skipped)
            if conv is not None and conv.stat().st_size > 0:
                sources.append(conv)
        if not sources:
            raise AnalysisError(f"{root}: no records in any rank file")
        con = _connect(tmpdir.name, threads, memory_limit)
        con.execute(f"CREATE TABLE record_lines AS SELECT * FROM {json_reader(sources)}")
        _create_raw(con, [], [], "rowid")
        data = _build_tables(con, root, skipped, run_id=run_id)
        data._tmp = tmpdir
        data.store_notes = store_notes
        return data
    except BaseException:
        tmpdir.cleanup()
        raise


def _load_parquet(location: str, threads: int | None, memory_limit: str | None,
                  skipped: list[str], root: Path | None = None,
                  torn: dict[str, int] | None = None,
                  lines: dict[str, int] | None = None, run_id: str | None = None) -> RunData:
    """Load from a Parquet store; ``torn`` maps files whose last line is not yet in the
    store to the store's offset in them: those tails are read as JSON too, so the result
    equals reading the JSONL files directly (a whole record that only lacks its newline
    is kept; a torn one is noted)."""
    tmpdir = tempfile.TemporaryDirectory(prefix="stepscope-")
    try:
        con = _connect(tmpdir.name, threads, memory_limit)
        source = location
        if root is not None:
            # DuckDB globs its path: a run directory named "a[1]" would be a character class.
            # A link with a plain name in the temporary directory reads the same files.
            link = Path(tmpdir.name) / "store"
            link.symlink_to(Path(location).resolve(), target_is_directory=True)
            source = str(link)
        parts = [f"SELECT * FROM {st.parquet_source(source)}"]
        if root is not None and not any((Path(location) / st.RECORDS).rglob("*.parquet")):
            parts = []  # only torn tails so far (or nothing at all)
        flat = st.flat_phases_files(con, source) if parts else []
        tails: list[Path] = []
        for name, offset in sorted((torn or {}).items()):
            assert root is not None
            tail = Path(tmpdir.name) / name
            with open(root / name, "rb") as fh:
                fh.seek(offset)
                rest = fh.read(MAX_LINE_BYTES + 1)
            if rest and b"\n" not in rest and len(rest) <= MAX_LINE_BYTES:
                tail.write_bytes(rest)
                tails.append(tail)
        if not parts and not tails:
            raise AnalysisError(f"{root}: no records in any rank file")
        if tails:
            con.execute("CREATE TABLE record_lines AS SELECT * REPLACE (regexp_replace("
                        f"filename, '^.*/', '') AS filename) FROM {json_reader(tails)}")
        try:
            # Views, not copies: Parquet is typed and columnar, so each statement below
            # reads only the columns it names (a table here would hold every record twice).
            # The tails' records get ids below the store's (which count from 0).
            _create_raw(con, parts, flat, "-1 - rowid" if tails else None)
            con.execute("SELECT 1 FROM raw_records LIMIT 1").fetchall()
        except Exception as exc:  # duckdb.IOException: no files match the glob
            if root is None and "No files found" in str(exc):
                raise AnalysisError(f"{location}: no Parquet records ({st.parquet_glob(location)})"
                                    ) from exc
            raise
        if parts and root is None and (not flat or "lists_ok" not in {
                d[0] for d in con.execute("SELECT * FROM raw_records LIMIT 0").description}):
            raise AnalysisError(
                f"{location}: no flat phase rows beside the records ({st.PHASES}/; a store "
                "another stepscope version wrote? compact the run directory again)")
        # ``phases`` may be a view of the store's flat copy where that holds the rows of
        # every record read and no others (no JSON tails; not a glob or file of some parts).
        exact = root is not None or not (st.is_glob(location) or location.endswith(".parquet"))
        data = _build_tables(con, root or Path(location), skipped, set(torn or ()), lines,
                             light=root is not None,
                             flat=None if tails or not exact else flat or None,
                             run_id=run_id, exact=exact)
        if data.flat_phases is not None and root is not None:
            # The files by their own paths, not through the link (readers elsewhere).
            real = str(Path(location).resolve())
            data.flat_phases = replace(data.flat_phases, files=tuple(
                real + f[len(source):] if f.startswith(source) else f
                for f in data.flat_phases.files))
        data._tmp = tmpdir
        return data
    except BaseException:
        tmpdir.cleanup()
        raise


def _create_raw(con: Any, records: list[str], flat: list[str], lines_rec: str | None) -> None:
    """Views ``raw_records`` (the records' fields, :data:`RECORD_FIELDS`, and their ids
    ``rec``) and ``raw_phases`` (their phase lists' rows, :func:`flat_phases_sql`): the
    store's (``records``: queries of its records; ``flat``: its flat phases files) and those
    of table ``record_lines`` (the lines parsed here), each record's id ``lines_rec`` (an
    expression of its ``rowid``; None: no such table)."""
    rec_parts, phase_parts = list(records), []
    if flat:
        phase_parts.append(f"SELECT * FROM {st.files_source(flat)}")
    if lines_rec is not None:
        rec_parts.append(f"SELECT {lines_rec} AS rec, {RECORD_FIELDS} FROM record_lines")
        phase_parts.append(flat_phases_sql(f"(SELECT {lines_rec} AS rec, * FROM record_lines)"))
    if not phase_parts:
        phase_parts.append(flat_phases_sql(no_lines()))
    con.execute(f"CREATE VIEW raw_records AS {' UNION ALL BY NAME '.join(rec_parts)}")
    con.execute(f"CREATE VIEW raw_phases AS {' UNION ALL BY NAME '.join(phase_parts)}")


def _display_name(fname: str) -> str:
    return Path(fname).name.replace(".bounded.jsonl", "").replace(".from-sqlite.jsonl", ".sqlite")


def _build_tables(con: Any, root: Path, skipped: list[str], torn: set[str] | None = None,
                  lines: dict[str, int] | None = None, light: bool = True,
                  flat: list[str] | None = None, run_id: str | None = None,
                  exact: bool = True) -> RunData:
    """Validate table ``raw_records`` (one row per line, corrupt lines all NULL) into the tables.

    ``torn``: names of the files that do not end in a newline, when ``raw_records.filename`` holds
    names rather than paths (the Parquet store); otherwise each file is looked at.
    ``lines``: for the store, lines per file stored through its combined file, whose corrupt
    lines are rows without a file name (``tagged`` rows are those lines' good ones).
    ``light``: also keep table ``timed_records`` (goodput's rows), when ``raw_records`` came from rank files.
    ``flat``: the files of the store's flat copy of ``raw_records``'s phase lists
    (:func:`flat_phases_sql`), if it has one.

    First with the phase lists assumed present and plausible (checked while ``phases`` is
    built), and where that fails (or the records are not all kept: duplicates, steps not on
    every rank, untimed, implausible or unreadable records) again with every check up front:
    the same tables and notes either way.

    ``run_id``: the run whose records are kept where ``raw_records`` holds several (by default the
    newest; ``_build``'s ``only`` is the condition on its records); corrupt lines are counted
    over every run's lines.

    ``exact``: ``raw_phases`` holds the rows of ``raw_records``'s records only (False: of
    others too, which are then left out by their ``rec``).
    """
    runs = runs_in(con, "raw_records", "rank IS NOT NULL AND step IS NOT NULL AND start_unix_ns IS NOT NULL")
    run = choose(runs, run_id, root)
    only = sql_filter(run, runs)
    # Rows of other records than those kept are left out by their ids (``_keep_records``).
    only = only if exact else f"{only} AND rec IS NOT NULL"
    if only != "TRUE":
        flat = None  # the flat rows hold every run's records: the kept records' rows are read
    if CHECK_LISTS_IN_PHASES:
        n_notes = len(skipped)
        try:
            data = _build(con, root, skipped, torn, lines, light, lists_checked_later=True,
                          flat=flat, only=only)
        except _Recheck:
            del skipped[n_notes:]
            for name in _EARLY:
                drop(con, name)
        else:
            return _with_runs(data, run, runs)
    data = _build(con, root, skipped, torn, lines, light, lists_checked_later=False, only=only)
    return _with_runs(data, run, runs)


def _with_runs(data: RunData, run: RunSpan | None, runs: list[RunSpan]) -> RunData:
    if len(runs) == 1:  # its ranks are the ranks analysed (runs_in counts them for several)
        runs = [replace(runs[0], ranks=len(data.ranks))]
        run = runs[0]
    data.runs = runs
    data.runs_note = runs_note(run, runs, data.run_dir) if run is not None else None
    return data


@dataclass
class _Census:
    """What one pass over ``raw_records`` found: lines and good lines per file, good records
    per schema version, implausible records per file, and the SQL condition of a valid one."""

    per_file: dict[str, tuple[int, int]]
    schemas: dict[int, int]
    implausible: dict[str, int]
    valid: str


_READABLE_IN = f"schema IN {tuple(READABLE_SCHEMAS)}"


def _build(con: Any, root: Path, skipped: list[str], torn: set[str] | None,
           lines: dict[str, int] | None, light: bool, lists_checked_later: bool,
           flat: list[str] | None = None, only: str = "TRUE") -> RunData:
    """:func:`_build_tables`; ``lists_checked_later``: raise :class:`_Recheck` where the
    records are not all kept, and check the phase lists in the ``phases`` statement (or,
    with ``flat``, on the flat copy's rows, which ``phases`` is then a view of).

    The stages, in order: count the lines and records (:func:`_census`), note what is
    skipped (:func:`_note_lines`, :func:`_kept_condition`), keep the records
    (:func:`_keep_records`), read the run's ranks and clock (:func:`_run_meta`), keep the
    steps every rank has (:func:`_common_steps`), build ``steps`` and ``phases``
    (:func:`_build_steps_and_phases`), count repeated paths
    (:func:`_count_duplicate_paths`) and build the records' other sections
    (:func:`_build_sections`)."""
    census = _census(con, lines, lists_checked_later)
    _note_lines(census.per_file, lines, torn, skipped)
    kept = _kept_condition(root, census, skipped, only)
    rec_kind, rows = _keep_records(con, kept, light, lists_checked_later, skipped, only)
    ranks, meta, world_size = _run_meta(con, root, skipped)
    keep = _common_steps(con, len(ranks), skipped)
    keep, flat_view = _build_steps_and_phases(con, int(meta[1]), keep, rows,
                                              st.files_source(flat) if flat else None,
                                              lists_checked_later)
    _build_sections(con, keep, rec_kind, _count_duplicate_paths(con, flat_view))
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
        flat_phases=FlatPhases(tuple(flat), keep) if flat and flat_view else None,
    )


def _census(con: Any, lines: dict[str, int] | None, lists_checked_later: bool) -> _Census:
    """One pass over ``raw_records``; raises :class:`_Recheck` (with ``lists_checked_later``)
    where not every record would be kept."""
    valid = VALID
    readable_in = _READABLE_IN
    # One pass over the records answers the three questions the checks ask: lines per
    # file (and how many are good), records per schema version, and implausible records
    # per file. It is the only statement that evaluates the plausibility rule over every
    # record's phase list: when it finds none implausible, the rule is TRUE for every
    # kept record and the statements below leave it out (no second evaluation per phase).
    # It also counts the records whose only missing field is the phase list: with none, the
    # statements below test the scalar fields only, and reading ``kept_records`` (or anything but
    # ``phases``) never decodes the lists (at 10^8 samples each decoding costs ~8 s CPU).
    # With ``lists_checked_later`` the pass reads no phase list (decoding them is most of its
    # cost): it assumes every list present and plausible, which the ``phases`` statement
    # checks on every element it unnests; its last column then counts untimed records.
    valid_scalars = VALID_SCALARS
    lines_col = "count(*)" if lines is None else "count(*) FILTER (WHERE NOT coalesce(tagged, FALSE))"
    if lists_checked_later:
        groups = con.execute(
            f"""SELECT filename, schema, {lines_col}, count(*) FILTER (WHERE {valid_scalars}),
                       count(*) FILTER (WHERE {valid_scalars} AND {readable_in}
                                        AND NOT coalesce({PLAUSIBLE_SCALARS}, FALSE)),
                       count(*) FILTER (WHERE {valid_scalars} AND NOT ({TIMED_FILTER}))
                FROM raw_records GROUP BY 1, 2"""
        ).fetchall()
        # Only when every record is kept does ``phases`` unnest (and so check) every list.
        if any(g[4] or g[5] or (g[3] and g[1] not in READABLE_SCHEMAS) for g in groups):
            raise _Recheck
    else:
        groups = con.execute(
            f"""SELECT filename, schema, {lines_col}, count(*) FILTER (WHERE {valid}),
                       count(*) FILTER (WHERE {valid} AND {readable_in}
                                        AND NOT coalesce({PLAUSIBLE}, FALSE)),
                       count(*) FILTER (WHERE {valid_scalars} AND NOT listed)
                FROM raw_records GROUP BY 1, 2"""
        ).fetchall()
    per_file: dict[str, tuple[int, int]] = {}
    schemas: dict[int, int] = {}
    implausible: dict[str, int] = {}
    if lists_checked_later or not any(g[5] for g in groups):
        valid = valid_scalars  # the same records: every one with those fields has its list
    for fname, ver, n_lines, n_good, n_bad, _ in groups:
        if fname is not None:
            u, g = per_file.get(str(fname), (0, 0))
            per_file[str(fname)] = (u + int(n_lines), g + int(n_good))
        if n_good:
            schemas[int(ver)] = schemas.get(int(ver), 0) + int(n_good)
        if n_bad:
            implausible[str(fname)] = implausible.get(str(fname), 0) + int(n_bad)
    return _Census(per_file, schemas, implausible, valid)


def _note_lines(per_file: dict[str, tuple[int, int]], lines: dict[str, int] | None,
                torn: set[str] | None, skipped: list[str]) -> None:
    """Note each file's corrupt lines and torn last line."""
    if lines is None:
        counts = [(f, u, g) for f, (u, g) in sorted(per_file.items())]
    else:
        counts = [(f, per_file.get(f, (0, 0))[0] + lines.get(f, 0), per_file.get(f, (0, 0))[1])
                  for f in sorted(set(per_file) | {f for f, n in lines.items() if n})]
    for fname, total, good in counts:
        bad = total - good
        if not bad:
            continue
        name = _display_name(fname)
        if name in torn if torn is not None else not _ends_with_newline(Path(fname)):
            bad -= 1
            skipped.append(f"{name}: truncated last line skipped (process killed mid-write?)")
        if bad:
            skipped.append(f"{name}: {bad} corrupt or incomplete line(s) of {total} skipped")


def _kept_condition(root: Path, census: _Census, skipped: list[str], only: str = "TRUE") -> str:
    """The SQL condition of a kept record; notes records of other schema versions and
    implausible ones; raises :class:`AnalysisError` where no record is readable."""
    schemas, implausible = census.schemas, census.implausible
    if not schemas:
        raise AnalysisError(f"{root}: no valid step records (every line was corrupt)")
    readable = " and ".join(str(v) for v in READABLE_SCHEMAS)
    if not set(READABLE_SCHEMAS) & set(schemas):
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

    for fname, n in sorted(implausible.items()):
        skipped.append(
            f"{_display_name(fname)}: {n} record(s) with implausible values skipped (rank outside "
            f"0..{MAX_RANKS - 1} or not below world_size, a time that is negative, not finite or "
            f"over {MAX_MS:.0e} ms, or start_unix_ns outside 0..2^62)"
        )
    plausible = f"coalesce({PLAUSIBLE}, FALSE)" if implausible else "TRUE"
    return f"{census.valid} AND {_READABLE_IN} AND {plausible} AND {TIMED_FILTER} AND {only}"


def _keep_records(con: Any, kept: str, light: bool, lists_checked_later: bool,
                  skipped: list[str], only: str = "TRUE") -> tuple[str, str]:
    """``kept_records`` (and ``timed_records`` with ``light``); returns its kind (VIEW or
    TABLE) and the SQL condition of the rows of ``raw_phases`` that are its records'."""
    # ``kept_records``: the records' columns (their phase lists are rows of ``raw_phases``).
    # A view: each statement reading it reads only the
    # columns it names (a table was a copy of every column of every record: ~8 s CPU at
    # 10^7 records); a table only when duplicates must be dropped.
    con.execute(f"CREATE VIEW kept_records AS SELECT {_REC_COLUMNS} FROM raw_records WHERE {kept}")
    rec_kind = "VIEW"
    if light:
        # Goodput's rows (analysis/goodput.py): every timed record of the rank JSONL files,
        # re-done duplicates included, kept here so it never re-reads the files. Converted
        # SQLite files are no rank JSONL (goodput then uses the analysed steps).
        con.execute(
            f"""CREATE TABLE timed_records AS
                SELECT rank, coalesce(run_id, '') AS run_id, step, start_unix_ns, step_ms
                FROM raw_records
                WHERE rank IS NOT NULL AND step IS NOT NULL AND start_unix_ns IS NOT NULL
                  AND step_ms IS NOT NULL AND isfinite(step_ms) AND step_ms >= 0
                  AND {TIMED_FILTER} AND start_unix_ns >= 0 AND start_unix_ns < {MAX_START_NS}
                  AND step_ms <= {MAX_MS} AND filename IS NOT NULL
                  AND NOT ends_with(filename, '.from-sqlite.jsonl') AND {only}"""
        )
    n_rec, n_pairs = con.execute(
        "SELECT count(*), (SELECT count(*) FROM (SELECT DISTINCT rank, step FROM kept_records)) "
        "FROM kept_records"
    ).fetchone()
    # With the lists checked later every record with the required scalars is kept (else
    # _Recheck), and ``raw_phases`` holds rows of those records only.
    rows = "TRUE" if lists_checked_later and only == "TRUE" else "rec IN (SELECT rec FROM kept_records)"
    if lists_checked_later and n_pairs < n_rec:
        raise _Recheck
    if n_pairs < n_rec:
        skipped.append(f"{n_rec - n_pairs} duplicate (rank, step) record(s) skipped")
        con.execute("DROP VIEW kept_records")
        rec_kind = "TABLE"
        con.execute(
            f"""CREATE TABLE kept_records AS SELECT {_REC_COLUMNS} FROM raw_records WHERE {kept}
               QUALIFY row_number() OVER (PARTITION BY rank, step ORDER BY start_unix_ns, rec) = 1"""
        )
    return rec_kind, rows


def _run_meta(con: Any, root: Path, skipped: list[str]) -> tuple[list[int], Any, int]:
    """The ranks present, the row (max world_size, earliest start, a run id, the clock,
    run ids) and the world size; notes missing ranks and mixed run ids."""
    ranks = [int(r) for (r,) in con.execute("SELECT DISTINCT rank FROM kept_records ORDER BY 1").fetchall()]
    if not ranks:
        raise AnalysisError(f"{root}: no plausible step records (see the skipped lines)")
    meta = con.execute(
        f"""SELECT max(world_size), min({_START}), any_value(run_id),
                  mode(clock), count(DISTINCT run_id) FROM kept_records"""
    ).fetchone()
    world_size = int(meta[0]) if meta[0] is not None else len(ranks)
    world_size = max(world_size, max(ranks) + 1)
    if meta[4] and meta[4] > 1:
        skipped.append(f"records come from {meta[4]} different run_ids; analysed together")
    # Never materialise range(world_size): the ranks present are bounded by the files, and
    # only the first few missing ones are named.
    if world_size > len(ranks):
        present = set(ranks)
        missing = [r for r in range(min(world_size, len(ranks) + 17)) if r not in present][:17]
        skipped.append(
            f"no records for rank(s) {_fmt_ranks(missing, world_size - len(ranks))} of world size "
            f"{world_size} (file missing or empty); analysed {len(ranks)} rank(s)"
        )
    return ranks, meta, world_size


def _common_steps(con: Any, n_ranks: int, skipped: list[str]) -> str:
    """``common_steps``; returns the condition on ``step`` of the steps analysed."""
    # Cross-rank comparison needs the same steps on every rank; keep the common ones.
    con.execute(
        f"""CREATE TABLE common_steps AS SELECT step FROM kept_records GROUP BY step
            HAVING count(*) = {n_ranks}"""
    )
    n_common, n_all = con.execute(
        "SELECT (SELECT count(*) FROM common_steps), (SELECT count(DISTINCT step) FROM kept_records)"
    ).fetchone()
    keep = "TRUE"
    if n_common < n_all:
        if n_common >= 3:
            keep = "step IN (SELECT step FROM common_steps)"
            per_rank = con.execute(
                """SELECT rank, count(*) FILTER (WHERE step NOT IN (SELECT step FROM common_steps))
                   FROM kept_records GROUP BY 1 HAVING count(*) FILTER (
                       WHERE step NOT IN (SELECT step FROM common_steps)) > 0 ORDER BY 1"""
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
    return keep


def _build_steps_and_phases(con: Any, t_min: int, keep: str, rows: str, flat: str | None,
                            lists_checked_later: bool) -> tuple[str, bool]:
    """``steps`` and ``phases`` (the rows ``rows`` of ``raw_phases``, the kept records');
    returns the steps' condition and whether ``phases`` is a view of the store's flat copy."""
    con.execute(
        f"""CREATE TABLE steps AS SELECT CAST(rank AS INTEGER) AS rank, step,
               coalesce(hostname, 'unknown') AS host,
               CAST({_START} - {t_min} AS DOUBLE) / 1e6 AS t0,
               step_ms, coalesce(residual_ms, 0.0) AS residual_ms, h2d_hidden_ms
            FROM kept_records WHERE {keep}"""
    )
    if flat is not None and rows == "TRUE":
        # Every record with the required fields is kept (else _Recheck above): the flat
        # copy's rows are the table's, once no list is missing or implausible. A view: the
        # table cost more than any stage reading it (10^8 rows decoded from the lists and
        # written, ~45 s CPU); the copy is ordered by step within each rank block, so the
        # readers' blocks of steps (or ranks) read only their row groups (or files).
        if con.execute(f"SELECT count(*) FROM {flat} WHERE NOT coalesce(ok, FALSE)").fetchone()[0]:
            raise _Recheck
        create_flat_phases_view(con, flat, keep)
        return keep, True
    # The check the grouped pass left out: a record without its list, or an element outside
    # the plausibility rule (named or not, so it comes before the name filter), stops the
    # statement. Steps not on every rank (a live job's last step) are read too, so that
    # every kept record's list is checked, and their rows deleted after.
    named, taken = "name IS NOT NULL", f"{rows} AND {keep}"
    if lists_checked_later:
        named = f"CASE WHEN NOT coalesce(ok, FALSE) THEN error('{_RECHECK}') ELSE {named} END"
        taken = rows
    try:
        con.execute(
            f"""CREATE TABLE phases AS
                SELECT rank, step, name, parent, ms, s, calls, e, path FROM raw_phases
                WHERE {taken} AND {named}"""
        )
    except Exception as exc:  # duckdb.InvalidInputException from error(): load again
        if _RECHECK not in str(exc):
            raise
        raise _Recheck from exc
    if lists_checked_later and keep != "TRUE":
        con.execute(f"DELETE FROM phases WHERE NOT ({keep})")
    return keep, False


def create_flat_phases_view(con: Any, flat: str, keep: str) -> None:
    """View ``phases`` over the flat copy's rows of table expression ``flat``, of the steps
    ``keep`` (an SQL condition on ``step``) keeps."""
    con.execute(f"""CREATE VIEW phases AS
                    SELECT rank, step, name, parent, ms, s, calls, e, path FROM {flat}
                    WHERE name IS NOT NULL AND {keep}""")


def _count_duplicate_paths(con: Any, flat_view: bool) -> int:
    """How many (rank, step, path) have more than one row in ``phases``."""
    # Records that list one phase path twice (hostile or corrupt): with none, (rank, step,
    # path) is a key of ``phases`` and analysis/own.py's phase_waits needs no group-by over every row.
    # Counted on the unnested rows a block of ranks at a time (a per-record list expression
    # cost 5x the CPU; one group-by over every row would hold every key). Ranks, not steps:
    # the rows are stored in the records' order (rank by rank), so a block's rows lie in few
    # row groups and the others are skipped by their rank range.
    # Each block is first grouped by record (rank, step), not by key: a record's paths are
    # distinct exactly when its rows set as many bits as it has rows, one bit per distinct
    # path of the run (a path not among them, or NULL, sets none: counted again). A tenth
    # of the keys of a group-by of (rank, step, path), a quarter of its CPU at 10^8 rows
    # (11 s -> 4 s CPU). Only a block with such a record is counted by the keys themselves;
    # every block is where the run has more than 64 paths.
    # Small blocks (:data:`DUP_BLOCK_SHARE`): a hash table of ~3*10^5 keys stays in cache;
    # one of 10^7 took twice the CPU.
    # The flat copy is ordered by step within each rank block: blocks of steps there, of
    # :data:`blocks.BLOCK_RECORDS` records (blocks of 1/32 read each row group ~7 times:
    # 20 s CPU at 10^8 rows; of 1/4, 3.9 s CPU against 3.5 s with the records' check).
    n_dups = 0
    by, blocks_of, share = (("step", step_blocks, FLAT_DUP_BLOCK_SHARE) if flat_view
                            else ("rank", rank_blocks, DUP_BLOCK_SHARE))
    paths = [p for (p,) in con.execute(
        "SELECT DISTINCT path FROM phases WHERE path IS NOT NULL LIMIT 65").fetchall()]
    bit = "1::UBIGINT << (list_position(?::VARCHAR[], path) - 1)" if len(paths) <= 64 else None
    for b in blocks_of(con, max(1, blocks.BLOCK_RECORDS // share)):
        blk = in_block(by, b)
        if bit is None or int(con.execute(
                f"""SELECT count(*) FROM (SELECT rank, step FROM phases WHERE {blk}
                    GROUP BY ALL HAVING count(*) <> bit_count(bit_or({bit})))""",
                [paths]).fetchone()[0]):
            n_dups += int(con.execute(
                f"""SELECT count(*) FROM (SELECT rank, step, path FROM phases
                    WHERE {blk} GROUP BY ALL HAVING count(*) > 1)""").fetchone()[0])
    return n_dups


def _build_sections(con: Any, keep: str, rec_kind: str, n_dups: int) -> None:
    """``duplicate_paths``, ``step_resources``, ``collectives``, ``lost_steps`` and
    ``unseen_collectives`` from the kept records; drops ``kept_records`` and ``raw_records``."""
    con.execute(f"CREATE TABLE duplicate_paths AS SELECT {n_dups} AS n")
    create_resource_table(con, keep)  # [metrics] table step_resources
    con.execute(
        f"""CREATE TABLE collectives AS
            SELECT CAST(rank AS INTEGER) AS rank, step, c.phase AS phase, c.op AS op,
                   coalesce(c.pg, 'default') AS pg, c.pg_size AS pg_size,
                   coalesce(c.count, 1) AS count, c.bytes AS bytes, c.ms AS ms,
                   c.max_ms AS max_ms, c.seq_first AS seq_first, c.seq_last AS seq_last,
                   c.recv_bytes AS recv_bytes, c.recv_max_bytes AS recv_max_bytes,
                   c.exposed_ms AS exposed_ms, c.hidden_ms AS hidden_ms
            FROM (SELECT rank, step, unnest(collectives) AS c FROM kept_records
                  WHERE {keep} AND collectives IS NOT NULL)
            WHERE c.op IS NOT NULL AND c.ms IS NOT NULL AND c.ms >= 0"""
    )
    # [hostile] steps the recorder counted as lost (records' "dropped"), by reason.
    con.execute(
        """CREATE TABLE lost_steps AS SELECT key, sum(try_cast(value::VARCHAR AS BIGINT)) AS n
           FROM kept_records, json_each(kept_records.dropped)
           WHERE json_type(kept_records.dropped) = 'OBJECT' GROUP BY 1"""
    )
    # Collectives issued where they cannot be timed (common/unseen.py UNSEEN).
    con.execute(
        f"""CREATE TABLE unseen_collectives AS
            SELECT CAST(rank AS INTEGER) AS rank, step, substr(k, 8) AS path,
                   CAST(json_extract(counters, '$."' || k || '"') AS DOUBLE) AS n
            FROM (SELECT rank, step, counters, unnest(json_keys(counters)) AS k FROM kept_records
                  WHERE {keep} AND counters IS NOT NULL)
            WHERE starts_with(k, 'unseen_')"""
    )
    con.execute(f"DROP {rec_kind} kept_records")
    for name in ("raw_phases", "raw_records", "record_lines"):
        drop(con, name)


def phase_keys_unique(con: Any) -> bool:
    """Whether no record lists a phase path twice (table ``duplicate_paths``, made by the load);
    tables made by hand have none: not known, so no."""
    if not exists(con, "duplicate_paths"):
        return False
    return int(con.execute("SELECT n FROM duplicate_paths").fetchone()[0]) == 0


def _fmt_ranks(ranks: list[int], total: int | None = None) -> str:
    total = len(ranks) if total is None else total
    shown = ", ".join(str(r) for r in ranks[:16])
    return shown + (f", … (+{total - 16})" if total > 16 else "")
