"""Analysis scale benchmark: synthetic runs of many ranks, analysed out of core by DuckDB.

Generates ``rank{R}.jsonl`` files with one slow
rank, runs ``analyze_run`` in a child process per size and prints one JSON line per size:
phase samples, records, seconds, peak RSS, and whether the slow rank was found.

    python benchmarks/analysis_scale.py --sizes 64x1000 512x1000 4096x1000 --threads 2
    python benchmarks/analysis_scale.py --sizes 10000x3 --memory-limit 1GB

``seconds`` is the first read (compaction into the run's Parquet store included);
``reread_seconds`` a second read, when the store is up to date. ``--no-store`` times the
direct JSONL path instead. ``--profile`` adds per-query timings (the slowest statements of
the re-read, or of the first read with ``--no-store``) and the compaction's own time.
``--dir D --keep`` generates each size once under ``D`` and reuses it on later runs (its
Parquet store is removed first, so ``seconds`` stays a first read).

    PYTHONPATH=BASE/src python benchmarks/analysis_scale.py --reread DATA/512x2000
    python benchmarks/analysis_scale.py --write-store 4096x2500 --dir DATA
    python benchmarks/analysis_scale.py --equivalence BASE/src RUN [RUN ...]
    python benchmarks/analysis_scale.py --parsers DATA/2000x833 --reps 5

``--parsers`` times, interleaved on the first rank block of RUN's files, the CPU of the
store's JSON parse and flattening (DuckDB) beside msgspec decoding into column lists and,
where pyarrow is installed, ``pyarrow.json.read_json`` with an explicit schema (threaded and
not); one JSON line per parser (median, min and max CPU seconds of this process).

``--reread`` times one re-read of a run whose store is up to date with whichever ``stepscope`` is on the
path (run it once per build, alternating, to compare builds on the same store).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = (("dataloader", 2.0), ("h2d", 1.0), ("forward", 6.0), ("backward", 9.0), ("optimizer", 3.0))


def generate(root: Path, ranks: int, steps: int, slow_rank: int) -> float:
    """Write DDP-shaped records: rank ``slow_rank`` has +8 ms dataloader, others wait."""
    import random

    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    names = [n for n, _ in PHASES]
    for r in range(ranks):
        rng = random.Random(r)  # reproducible files without a per-line hash
        slow = 8.0 if r == slow_rank else 0.0
        lines = []
        for step in range(steps):
            ms = [base + rng.uniform(-0.2, 0.2) for _, base in PHASES]
            ms[0] += slow
            ms[3] += 8.0 - slow  # backward waits for the slow rank in its all-reduce
            at, parts = 0.0, []
            for name, v in zip(names, ms, strict=True):
                parts.append(f'{{"name": "{name}", "parent": null, "ms": {v:.4f}, "calls": 1, '
                             f'"start_ms": {at:.4f}, "end_ms": {at + v:.4f}}}')
                at += v
            lines.append(
                f'{{"schema": 1, "run_id": "bench", "rank": {r}, "world_size": {ranks}, '
                f'"hostname": "node-{r // 8}", "step": {step}, '
                f'"start_unix_ns": {1763000000000000000 + step * 40000000}, "clock": "cpu", '
                f'"step_ms": {sum(ms) + 0.3:.4f}, "phases": [{", ".join(parts)}], '
                f'"residual_ms": 0.3}}\n')
        (root / f"rank{r}.jsonl").write_text("".join(lines))
    return time.perf_counter() - t0


#: Ten phase paths per step (three nested), DDP-shaped: the all-reduce is ``backward/grad_sync``.
STORE_PHASES = (("dataloader", None, 2.0), ("h2d", None, 1.0), ("forward", None, 6.0),
                ("attention", "forward", 2.5), ("mlp", "forward", 3.0), ("backward", None, 9.0),
                ("recompute", "backward", 2.0), ("grad_sync", "backward", 1.0),
                ("optimizer", None, 3.0), ("clip", "optimizer", 0.5))


def write_store(root: Path, ranks: int, steps: int, slow_rank: int, threads: int) -> float:
    """Write ``root/parquet/records/rank_block=K/*.parquet`` directly (DuckDB ``COPY``), with
    the columns compaction writes: the same records ``generate`` would put in JSONL, but ten
    phases per step, without the 11 GB of JSON a 10^8-sample run would take to write and
    parse. Rank ``slow_rank`` has +8 ms dataloader; the others wait in ``grad_sync``."""
    import duckdb

    from stepscope.analysis import store as st

    t0 = time.perf_counter()
    out = root / st.STORE_DIR / st.RECORDS
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root / st.STORE_DIR / st.PHASES, ignore_errors=True)
    out.mkdir(parents=True)
    con = duckdb.connect()
    con.execute(f"SET threads = {int(threads)}")
    con.execute("SET preserve_insertion_order = false")
    con.execute("SET enable_progress_bar = false")
    jitter = ", ".join(
        f"{base} + 0.4 * (random() - 0.5)"
        + (f" + CASE WHEN rank = {slow_rank} THEN 8.0 ELSE 0.0 END" if name == "dataloader" else "")
        + (f" + CASE WHEN rank = {slow_rank} THEN 0.0 ELSE 8.0 END" if name == "grad_sync" else "")
        + f" AS v{i}"
        for i, (name, _, base) in enumerate(STORE_PHASES))
    # Offsets: top-level phases one after another; children from their parent's start on.
    starts: list[str] = []
    top_at = "0.0"
    child_at: dict[str, str] = {}
    idx = {name: i for i, (name, parent, _) in enumerate(STORE_PHASES) if parent is None}
    for i, (name, parent, _) in enumerate(STORE_PHASES):
        if parent is None:
            starts.append(top_at)
            child_at[name] = top_at
            top_at = f"({top_at} + v{i})"
        else:
            starts.append(child_at[parent])
            child_at[parent] = f"({child_at[parent]} + v{i})"
    # A parent lasts at least as long as its children: its time is the children's sum plus its own.
    ms = [f"v{i}" for i in range(len(STORE_PHASES))]
    for i, (_, parent, _) in enumerate(STORE_PHASES):
        if parent is not None:
            ms[idx[parent]] += f" + v{i}"
    phases = ", ".join(
        f"{{'name': '{name}', 'parent': {'NULL' if parent is None else repr(parent)}, "
        f"'ms': {ms[i]}, 'calls': 1, 'start_ms': {starts[i]}, "
        f"'end_ms': {starts[i]} + {ms[i]}, "
        f"'path': '{name if parent is None else parent + '/' + name}', 'host_ms': NULL}}"
        for i, (name, parent, _) in enumerate(STORE_PHASES))
    step_ms = " + ".join(ms[i] for i, (_, parent, _) in enumerate(STORE_PHASES) if parent is None)
    from stepscope.analysis.record_files import COLUMNS

    given = {
        "schema": "1", "run_id": "'bench'", "rank": "rank", "world_size": str(ranks),
        "hostname": "'node-' || (rank // 8)", "step": "step",
        "start_unix_ns": "1763000000000000000 + step * 40000000", "clock": "'cpu'",
        "step_ms": "step_ms", "phases": "phases", "residual_ms": "0.3"}
    select = ", ".join(f"CAST({given.get(c, 'NULL')} AS {t}) AS {c}" for c, t in COLUMNS.items())
    first_rec = 0
    for block in range(0, (ranks + st.RANK_BLOCK - 1) // st.RANK_BLOCK):
        lo, hi = block * st.RANK_BLOCK, min(ranks, (block + 1) * st.RANK_BLOCK)
        con.execute(
            f"""CREATE OR REPLACE TEMP TABLE generated_lines AS
                WITH g AS (SELECT r.range AS rank, s.range AS step, {jitter}
                           FROM range({lo}, {hi}) r, range(0, {steps}) s),
                p AS (SELECT rank, step, [{phases}] AS phases, {step_ms} + 0.3 AS step_ms FROM g)
                SELECT {select},
                       'rank' || rank || '.jsonl' AS filename, TRUE AS tagged
                FROM p"""
        )
        first_rec += st.write_lines(con, root / st.STORE_DIR, "generated_lines", block,
                                    first_rec)[1]
    con.close()
    return time.perf_counter() - t0


#: The stages being timed (``--reread --profile``), innermost last: each statement is
#: logged with the one it ran in.
_STAGE: list[str] = []


class _Timed:
    """A DuckDB connection that times each statement (``--profile``), its fetches included (a
    query's result is produced as it is fetched); ``stmts`` (when given) gets [stage, wall s,
    CPU s, statement] of each in order."""

    def __init__(self, con: Any, log: list[list[Any]],
                 stmts: list[list[Any]] | None = None) -> None:
        self._con, self._log, self._stmts = con, log, stmts

    def execute(self, sql: str, *args: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = self._con.execute(sql, *args)
        wall, text = time.perf_counter() - t0, " ".join(sql.split())[:160]
        logged = [wall, text]
        self._log.append(logged)
        row = None
        if self._stmts is not None:
            row = [_STAGE[-1] if _STAGE else "-", wall, time.process_time() - c0, text]
            self._stmts.append(row)
        return _Fetched(out, logged, row)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)


class _Fetched:
    """A statement's result whose ``fetch*`` calls add their wall and CPU time to the
    statement's entries of :class:`_Timed`."""

    def __init__(self, result: Any, logged: list[Any], row: list[Any] | None) -> None:
        self._result, self._logged, self._row = result, logged, row

    def __getattr__(self, name: str) -> Any:
        got = getattr(self._result, name)
        if not name.startswith("fetch"):
            return got

        def fetch(*a: Any, **k: Any) -> Any:
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return got(*a, **k)
            finally:
                wall = time.perf_counter() - t0
                self._logged[0] += wall
                if self._row is not None:
                    self._row[1] += wall
                    self._row[2] += time.process_time() - c0

        return fetch


def _child(run_dir: str, threads: int, memory_limit: str, store: bool, profile: bool) -> None:
    from stepscope.analysis import load
    from stepscope.analysis import store as st
    from stepscope.analysis.run import analyze_run

    log: list[list[Any]] = []
    compact_s: list[float] = []
    if profile:
        connect, compact = load._connect, st.compact

        def timed_connect(*a: Any) -> Any:
            return _Timed(connect(*a), log)

        def timed_compact(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return compact(*a, **k)
            finally:
                compact_s.append(round(time.perf_counter() - t, 2))

        load._connect = timed_connect  # type: ignore[assignment]
        st.compact = timed_compact

    def cpu() -> float:  # this process' CPU time: on a shared machine, wall time is not ours
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    t0, c0 = time.perf_counter(), cpu()
    doc = analyze_run(run_dir, threads=threads, memory_limit=memory_limit, store=store)
    first, first_cpu = time.perf_counter() - t0, cpu() - c0
    again = again_cpu = None
    if store:  # the Parquet copy is now up to date: a re-read parses no JSON
        log.clear()
        t1, c1 = time.perf_counter(), cpu()
        doc = analyze_run(run_dir, threads=threads, memory_limit=memory_limit, store=store)
        again, again_cpu = round(time.perf_counter() - t1, 2), round(cpu() - c1, 2)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    if profile:
        total = sum(t for t, _ in log)
        print(json.dumps({"compact_seconds": compact_s, "query_seconds": round(total, 2),
                          "queries": len(log)}), file=sys.stderr)
        for t, sql in sorted(log, reverse=True)[:15]:
            print(f"{t:8.2f}s  {sql}", file=sys.stderr)
    print(json.dumps({
        "seconds": round(first, 2),
        "cpu_seconds": round(first_cpu, 2),
        "reread_seconds": again,
        "reread_cpu_seconds": again_cpu,
        "peak_rss_mb": round(peak_mb, 1),
        "phase_samples": doc["run"]["phase_samples"],
        "records": doc["run"]["records"],
        "stragglers": [(s["rank"], s["phase"]) for s in doc["stragglers"][:3]],
    }))


def _excess_table(con: Any) -> str:
    """The own-work gap table a tree's ``build_own`` made (``ex`` in trees before the rename)."""
    names = {n for (n,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    return "own_excess" if "own_excess" in names else "ex"


def median_of_others(base_src: str, ranks: int = 512, steps: int = 2000, reps: int = 2) -> None:
    """``build_own`` of this tree vs the one under ``base_src``, interleaved in one process on
    the same table (ties from 0.01 ms rounding); prints CPU seconds and whether every row's
    ``others``/``excess`` is identical."""
    import importlib.util

    import duckdb

    from stepscope.analysis.relations import drop

    def load(path: str, name: str) -> Any:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    here = Path(__file__).resolve().parents[1] / "src/stepscope/analysis/own.py"
    mods = {"base": load(str(Path(base_src) / "stepscope/analysis/own.py"), "_base_own"),
            "this": load(str(here), "_this_own")}
    con = duckdb.connect()
    con.execute("SET threads = 2")
    con.execute(f"""CREATE TABLE phases AS SELECT (i % {ranks})::INTEGER AS rank,
        (i // {ranks})::BIGINT AS step, n.name, NULL::VARCHAR AS parent,
        round(random() * 10, 2) AS ms, n.name AS path
        FROM range({ranks * steps}) t(i), (VALUES ('forward'), ('backward'), ('optimizer')) n(name)""")
    con.execute("CREATE TABLE steps AS SELECT DISTINCT rank, step, 0.3::DOUBLE AS residual_ms "
                "FROM phases")
    con.execute("CREATE TABLE collective_waits (rank INTEGER, step BIGINT, phase VARCHAR, ms DOUBLE, "
                "wait DOUBLE)")
    con.execute("CREATE VIEW cw AS SELECT * FROM collective_waits")  # the base tree's name
    rows: dict[str, Any] = {}
    for _ in range(reps):
        for name, mod in mods.items():
            for old in ("ex", "own_excess"):  # either tree's result: read only the one made now
                drop(con, old)
            c0 = time.process_time()
            mod.build_own(con)
            print(json.dumps({"build_own": name, "cpu_s": round(time.process_time() - c0, 2)}),
                  flush=True)
            rows[name] = con.execute(
                f"SELECT rank, step, name, others, excess FROM {_excess_table(con)} ORDER BY 1, 2, 3"
            ).fetchall()
    print(json.dumps({"rows": len(rows["this"]), "identical": rows["this"] == rows["base"]}))


_DOC = """
import json, sys
from stepscope.analysis.run import analyze_run
doc = analyze_run(sys.argv[1], threads=2, memory_limit="1GB")
doc["run"].pop("dir", None)
print(json.dumps(doc, sort_keys=True, default=str))
"""


def _differences(a: Any, b: Any, path: str, out: list[str],
                 small: list[str] | None = None) -> None:
    """Where two report documents differ beyond rounding (1e-6 relative, 1.5e-3 absolute);
    ``small`` collects the numbers that differ within it."""
    import math

    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in one")
            else:
                _differences(a[k], b[k], f"{path}/{k}", out, small)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _differences(x, y, f"{path}[{i}]", out, small)
    elif (isinstance(a, float) or isinstance(b, float)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        if not math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1.5e-3):
            out.append(f"{path}: {a} vs {b}")
        elif a != b and small is not None:
            small.append(f"{path}: {a} vs {b}")
    elif a != b:
        out.append(f"{path}: {a!r} vs {b!r}")


def equivalence(base_src: str, runs: list[str]) -> int:
    """The report of each run by this tree and by the one under ``base_src``, each in a fresh
    process on its own copy of the run (without its Parquet store: each tree compacts the
    rank files itself): one JSON line per run saying identical, equal within rounding, or
    where not."""
    from stepscope.analysis.store import STORE_DIR

    this = str(Path(__file__).resolve().parents[1] / "src")
    bad = 0
    for run in runs:
        docs = []
        with tempfile.TemporaryDirectory(prefix="equivalence-") as tmp:
            copy = Path(tmp) / Path(run).name  # the same path for both: notes name it
            for src in (this, base_src):
                env = {**os.environ, "PYTHONPATH": src}
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(run, copy, ignore=shutil.ignore_patterns(STORE_DIR))
                out = subprocess.run([sys.executable, "-c", _DOC, str(copy)],
                                     capture_output=True, text=True, env=env, check=True)
                docs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        diffs: list[str] = []
        small: list[str] = []
        _differences(docs[0], docs[1], "", diffs, small)
        bad += bool(diffs)
        print(json.dumps({"run": run, "identical": docs[0] == docs[1], "within_rounding": not diffs,
                          "stragglers": len(docs[0]["stragglers"]), "windows": len(docs[0]["windows"]),
                          "differences": diffs[:10], "rounding": small[:5]}), flush=True)
    return 1 if bad else 0


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


#: The stages ``--reread --profile`` times: (module, function), each wrapped where it is called.
_STAGES = (
    ("stepscope.analysis.run", "load_run"), ("stepscope.analysis.run", "create_phase_samples"),
    ("stepscope.analysis.stragglers", "align"), ("stepscope.analysis.stragglers", "build_waits"),
    ("stepscope.analysis.stragglers", "build_own"), ("stepscope.analysis.stragglers", "read_gap_series"),
    ("stepscope.analysis.stragglers", "screen_series"),
    ("stepscope.analysis.stragglers", "find_stragglers"),
    ("stepscope.analysis.stragglers", "find_windows"),
    ("stepscope.analysis.stragglers", "collectives_section"),
    ("stepscope.analysis.run", "split_host_busy"), ("stepscope.analysis.run", "phase_stats"),
    ("stepscope.analysis.run", "phase_waits"), ("stepscope.analysis.run", "rank_stats"),
    ("stepscope.analysis.run", "analyze_resources"), ("stepscope.analysis.run", "diagnose"),
    ("stepscope.analysis.run", "compute_goodput"),
    ("stepscope.analysis.run", "add_coverage_sections"),
)


def _profile_stages() -> list[dict[str, Any]]:
    """Wrap each stage of :data:`_STAGES`: wall, CPU, RSS before/after and the process' peak."""
    import importlib

    rows: list[dict[str, Any]] = []
    for mod_name, fn_name in _STAGES:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, fn_name, None)
        if fn is None:
            continue

        def timed(*a: Any, _fn: Any = fn, _name: str = fn_name, **k: Any) -> Any:
            r0, t0, c0 = _rss_mb(), time.perf_counter(), time.process_time()
            _STAGE.append(_name)
            try:
                return _fn(*a, **k)
            finally:
                _STAGE.pop()
                rows.append({"stage": _name, "wall_s": round(time.perf_counter() - t0, 2),
                             "cpu_s": round(time.process_time() - c0, 2),
                             "rss_before_mb": round(r0), "rss_after_mb": round(_rss_mb()),
                             "peak_so_far_mb": round(
                                 resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

        setattr(mod, fn_name, timed)
    return rows


def reread(run_dir: str, threads: int, memory_limit: str, profile: bool = False) -> None:
    """One ``analyze_run`` of ``run_dir`` in this process: wall, CPU, peak RSS, load.

    ``profile``: also one line per stage (wall, CPU, RSS around it, peak so far) on stderr
    as each ends (nested stages before the stage that called them), the slowest statements,
    and every statement of the loading stage in order (wall, CPU)."""
    import stepscope
    from stepscope.analysis.run import analyze_run

    log: list[list[Any]] = []
    stmts: list[list[Any]] = []
    if profile:
        _profile_stages()
        from stepscope.analysis import load

        connect = load._connect

        def timed_connect(*a: Any) -> Any:
            return _Timed(connect(*a), log, stmts)

        load._connect = timed_connect  # type: ignore[assignment]
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    doc = analyze_run(run_dir, threads=threads, memory_limit=memory_limit)
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    for t, sql in sorted(log, reverse=True)[:15]:  # the slowest statements (--profile)
        print(f"{t:8.2f}s  {sql}", file=sys.stderr)
    by_stage: dict[str, list[tuple[float, float, str]]] = {}
    for stage, w, c, sql in stmts:
        by_stage.setdefault(stage, []).append((w, c, sql))
    for stage, rows in by_stage.items():  # per stage: its statements' total, its slowest
        if stage == "load_run" or sum(r[0] for r in rows) < 1.0:
            continue
        print(f"{stage}: {len(rows)} statements, {sum(r[0] for r in rows):.2f} s wall, "
              f"{sum(r[1] for r in rows):.2f} s CPU; slowest:", file=sys.stderr)
        for w, c, sql in sorted(rows, reverse=True)[:6]:
            print(f"{w:8.2f}s {c:8.2f}s  {sql[:120]}", file=sys.stderr)
    loading = [s for s in stmts if s[0] == "load_run"]
    if loading:
        print(f"loading: {len(loading)} statements, {sum(s[1] for s in loading):.2f} s wall, "
              f"{sum(s[2] for s in loading):.2f} s CPU (wall / CPU each, in order)", file=sys.stderr)
        for _, w, c, sql in loading:
            print(f"{w:8.2f}s {c:8.2f}s  {sql[:120]}", file=sys.stderr)
    print(json.dumps({
        "stepscope": str(Path(stepscope.__file__).parents[1]),
        "wall_seconds": round(wall, 2),
        "cpu_seconds": round(ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime, 2),
        "peak_rss_mb": round(ru.ru_maxrss / 1024.0, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "phase_samples": doc["run"]["phase_samples"],
        "stragglers": [(s["rank"], s["phase"]) for s in doc["stragglers"][:3]],
    }), flush=True)


def _parse_duckdb(files: list[Path], threads: int) -> int:
    """The store's parse of one rank block: typed lines, their records and flat rows."""
    import duckdb

    from stepscope.analysis.record_files import RECORD_FIELDS, flat_phases_sql, json_reader

    con = duckdb.connect()
    try:
        con.execute(f"SET threads = {int(threads)}")
        con.execute("SET preserve_insertion_order = false")
        con.execute(f"CREATE TEMP TABLE parsed_lines AS SELECT * FROM {json_reader(files)}")
        con.execute("CREATE TEMP TABLE flat AS "
                    + flat_phases_sql("(SELECT rowid AS rec, * FROM parsed_lines)"))
        con.execute(f"CREATE TEMP TABLE recs AS SELECT rowid AS rec, {RECORD_FIELDS} FROM parsed_lines")
        (n,) = con.execute("SELECT count(*) FROM recs").fetchone() or (0,)
        return int(n)
    finally:
        con.close()


def _parse_msgspec(files: list[Path]) -> int:
    """Each file decoded by msgspec into typed records, then into column lists and the
    flat rows of their phase lists (what a Parquet writer would take)."""
    import msgspec

    # defstruct, not class bodies: their annotations would be strings here, unresolvable.
    text, num, whole, raw = str | None, float | None, int | None, msgspec.Raw | None
    Phase: Any = msgspec.defstruct("Phase", [
        ("name", text, None), ("parent", text, None), ("ms", num, None), ("calls", whole, None),
        ("start_ms", num, None), ("end_ms", num, None), ("path", text, None),
        ("host_ms", num, None)])
    Line: Any = msgspec.defstruct("Line", [
        ("schema", whole, None), ("run_id", text, None), ("rank", whole, None),
        ("world_size", whole, None), ("hostname", text, None), ("step", whole, None),
        ("start_unix_ns", whole, None), ("gpu_start_unix_ns", whole, None), ("clock", text, None),
        ("step_ms", num, None), ("phases", list[Phase] | None, None),
        ("residual_ms", num, None), ("h2d_hidden_ms", num, None), ("collectives", raw, None),
        ("dropped", raw, None), ("counters", raw, None)])

    one, many = msgspec.json.Decoder(Line), msgspec.json.Decoder(list[Line])
    names = [n for n in Line.__struct_fields__ if n != "phases"]
    cols: dict[str, list[Any]] = {n: [] for n in names}
    flat: dict[str, list[Any]] = {n: [] for n in ("rec", *Phase.__struct_fields__)}
    rec = 0
    for f in files:
        data = f.read_bytes()
        try:
            lines = many.decode(b"[" + data.rstrip(b"\n").replace(b"\n", b",") + b"]")
        except msgspec.DecodeError:  # a malformed line: decode line by line, skip it
            lines = []
            for piece in data.splitlines():
                with contextlib.suppress(msgspec.DecodeError):
                    lines.append(one.decode(piece))
        for n in names:
            cols[n].extend([getattr(x, n) for x in lines])
        for x in lines:
            for ph in x.phases or ():
                flat["rec"].append(rec)
                for n in Phase.__struct_fields__:
                    flat[n].append(getattr(ph, n))
            rec += 1
    return rec


def _parse_pyarrow(files: list[Path], threads: bool, block_size: int) -> int:
    """Each file read by ``pyarrow.json.read_json`` with an explicit schema (the scalar
    columns and the phase list), the phase lists flattened with their rows' rank and step."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    phase = pa.struct([("name", pa.string()), ("parent", pa.string()), ("ms", pa.float64()),
                       ("calls", pa.int64()), ("start_ms", pa.float64()), ("end_ms", pa.float64()),
                       ("path", pa.string()), ("host_ms", pa.float64())])
    schema = pa.schema([("schema", pa.int64()), ("run_id", pa.string()), ("rank", pa.int64()),
                        ("world_size", pa.int64()), ("hostname", pa.string()), ("step", pa.int64()),
                        ("start_unix_ns", pa.int64()), ("gpu_start_unix_ns", pa.int64()),
                        ("clock", pa.string()), ("step_ms", pa.float64()),
                        ("phases", pa.list_(phase)), ("residual_ms", pa.float64()),
                        ("h2d_hidden_ms", pa.float64())])
    ro = pj.ReadOptions(use_threads=threads, block_size=block_size)
    po = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    t = pa.concat_tables([pj.read_json(str(f), read_options=ro, parse_options=po)
                          for f in files]).combine_chunks()
    lists = t.column("phases").combine_chunks()
    parent = pc.list_parent_indices(lists)
    pc.list_flatten(lists)
    pc.take(t.column("rank"), parent)
    pc.take(t.column("step"), parent)
    return int(t.num_rows)


def compare_parsers(run_dir: str, threads: int, reps: int) -> None:
    """Time each parser on the first rank block of ``run_dir``, interleaved ``reps`` times."""
    import importlib.util
    import statistics

    from stepscope.analysis.store import RANK_BLOCK

    files = sorted(Path(run_dir).glob("rank*.jsonl"),
                   key=lambda f: int(f.stem[4:]) if f.stem[4:].isdigit() else -1)
    files = [f for f in files if f.stem[4:].isdigit() and int(f.stem[4:]) < RANK_BLOCK]
    if not files:
        raise SystemExit(f"{run_dir}: no rank files of the first rank block")
    parsers: dict[str, Any] = {
        "duckdb": lambda: _parse_duckdb(files, threads), "msgspec": lambda: _parse_msgspec(files)}
    if importlib.util.find_spec("pyarrow") is not None:
        parsers["pyarrow_threads"] = lambda: _parse_pyarrow(files, True, 8 << 20)
        parsers["pyarrow_one_thread"] = lambda: _parse_pyarrow(files, False, 8 << 20)

    def cpu() -> float:  # this process and all its threads
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    spent: dict[str, list[float]] = {name: [] for name in parsers}
    records: dict[str, int] = {}
    for name, fn in parsers.items():  # warm-up: imports and first allocations are not timed
        records[name] = fn()
    for _ in range(reps):
        for name, fn in parsers.items():
            c0 = cpu()
            fn()
            spent[name].append(cpu() - c0)
    for name, cs in spent.items():
        med = statistics.median(cs)
        print(json.dumps({"parser": name, "files": len(files), "records": records[name],
                          "jsonl_mb": round(sum(f.stat().st_size for f in files) / 2**20, 1),
                          "cpu_s_median": round(med, 3), "cpu_s_min": round(min(cs), 3),
                          "cpu_s_max": round(max(cs), 3), "reps": reps,
                          "us_per_record": round(med / max(records[name], 1) * 1e6, 2),
                          "threads": threads, "load_avg_1m": round(os.getloadavg()[0], 2)}),
              flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["64x1000", "512x1000", "4096x1000"],
                   help="RANKSxSTEPS per run (5 phases per step)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory-limit", default="1GB")
    p.add_argument("--dir", default=None, help="where to generate (default: a temp dir)")
    p.add_argument("--no-store", action="store_true",
                   help="analyze the JSONL directly (the path before the Parquet store)")
    p.add_argument("--profile", action="store_true",
                   help="print per-query timings (slowest first) and the compaction time; "
                        "with --reread, per-stage wall, CPU and RSS")
    p.add_argument("--keep", action="store_true",
                   help="keep (and reuse) the generated runs under --dir")
    p.add_argument("--median-of-others", metavar="BASE_SRC",
                   help="time build_own against the one in BASE_SRC (another checkout's src/)")
    p.add_argument("--reread", metavar="RUN",
                   help="time one re-read of RUN (store kept) with the stepscope on the path")
    p.add_argument("--write-store", metavar="RANKSxSTEPS",
                   help="write DIR/RANKSxSTEPS/parquet directly (10 phases per step, no JSONL); "
                        "time its re-read with --reread DIR/RANKSxSTEPS/parquet")
    p.add_argument("--equivalence", nargs="+", metavar=("BASE_SRC", "RUN"),
                   help="compare this tree's report of each RUN with BASE_SRC's (fresh processes)")
    p.add_argument("--parsers", metavar="RUN",
                   help="time the store's JSON parse beside msgspec and pyarrow on RUN's first rank block")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each parser (--parsers)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.equivalence:
        if len(args.equivalence) < 2:
            p.error("--equivalence needs BASE_SRC and at least one RUN")
        return equivalence(args.equivalence[0], args.equivalence[1:])
    if args.write_store:
        if not args.dir:
            p.error("--write-store needs --dir")
        ranks, steps = (int(x) for x in args.write_store.lower().split("x"))
        secs = write_store(Path(args.dir) / args.write_store, ranks, steps, ranks // 3, args.threads)
        print(json.dumps({"store": str(Path(args.dir) / args.write_store / "parquet"),
                          "phase_samples": ranks * steps * len(STORE_PHASES),
                          "seconds": round(secs, 1)}))
        return 0
    if args.parsers:
        compare_parsers(args.parsers, args.threads, max(1, args.reps))
        return 0
    if args.reread:
        reread(args.reread, args.threads, args.memory_limit, args.profile)
        return 0
    if args.median_of_others:
        median_of_others(args.median_of_others)
        return 0
    if args.child:
        _child(args.child, args.threads, args.memory_limit, not args.no_store, args.profile)
        return 0
    if args.keep and not args.dir:
        p.error("--keep needs --dir")
    base = Path(args.dir or tempfile.mkdtemp(prefix="stepscope-scale-"))
    for size in args.sizes:
        ranks, steps = (int(x) for x in size.lower().split("x"))
        if ranks < 2 or steps < 3:
            p.error(f"size {size!r}: need at least 2 ranks and 3 steps")
        run = base / size
        done = run / "_generated"
        if args.keep and done.exists():
            gen_s = 0.0
            shutil.rmtree(run / "parquet", ignore_errors=True)
        else:
            shutil.rmtree(run, ignore_errors=True)
            gen_s = generate(run, ranks, steps, slow_rank=ranks // 3)
            done.touch()
        size_mb = sum(f.stat().st_size for f in run.glob("*.jsonl")) / 2**20
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(run), "--threads", str(args.threads),
             "--memory-limit", args.memory_limit] + (["--no-store"] if args.no_store else [])
            + (["--profile"] if args.profile else []),
            capture_output=True, text=True, check=False,
        )
        if args.profile:
            sys.stderr.write(out.stderr)
        if out.returncode != 0:
            print(json.dumps({"size": size, "error": out.stderr.strip()[-500:]}))
            continue
        res = json.loads(out.stdout.strip().splitlines()[-1])
        # Too few steps to call a straggler (a sustained excess) is not a miss: null then.
        res["found_slow_rank"] = ([ranks // 3, "dataloader"] in [list(s) for s in res["stragglers"]]
                                  if steps >= 10 else None)
        res["rows_per_s"] = round(res["phase_samples"] / max(res["seconds"], 1e-9))
        print(json.dumps({"size": size, "ranks": ranks, "steps": steps, "jsonl_mb": round(size_mb, 1),
                          "gen_s": round(gen_s, 1), "threads": args.threads,
                          "memory_limit": args.memory_limit, "store": not args.no_store,
                          "load_avg_1m": round(os.getloadavg()[0], 2), **res}),
              flush=True)
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
