"""The CPU floor of parsing rank JSONL: the store's DuckDB ``read_json`` beside other parsers.

Each variant parses the same rank files (every ``rank*.jsonl`` of RUN) into columns a query can
use, in a fresh child process (so its peak RSS is its own), ``--reps`` times; the variants
alternate within each repetition (rotated each time). The CPU is the child's own around the
parse (``getrusage``: all its threads, user + system); imports are not counted. One JSON line
per variant: median and quartiles of CPU s, CPU µs per record and per sample (samples per
record: the phases of the first record + the residual), the child's peak RSS, the 1-minute
load average::

    python benchmarks/analysis_scale.py --sizes 200x833 --dir D --keep
    python benchmarks/parse_floor.py D/200x833 --reps 5 [--record benchmarks/results]

Variants:

- ``duckdb_store``: the store's statement (``record_files.json_reader``: typed columns,
  ``ignore_errors``, ``filename``, the store's ``maximum_object_size``) into a temp table;
- ``duckdb_threads1``: the same with one DuckDB thread;
- ``duckdb_bare``: typed columns, ``format='newline_delimited'``, no ``filename``, no
  ``ignore_errors``, ``records='true'``, ``compression='none'``, default object size;
- ``duckdb_bare_threads1``: the same with one DuckDB thread;
- ``pyarrow`` / ``pyarrow_threads1``: ``pyarrow.json.read_json`` per file with an explicit
  schema (the scalar columns and the phase list; the JSON-object columns are ignored, as
  pyarrow cannot read an object into a string) and 8 MB blocks, then a DuckDB table from the
  Arrow table (only where pyarrow is importable);
- ``msgspec``: a typed ``Struct`` decoder over each file's lines (``array_like`` is not
  possible: lines are objects), into numpy columns for the scalars and the flat phase rows,
  registered with DuckDB (the JSON-object fields are decoded as ``msgspec.Raw``);
- ``msgspec_buffer``: the same, each file decoded at once as one array (line by line only
  where the file has a bad line);
- ``msgspec_decode``: the whole-file decode alone (Structs, no columns): the floor of a
  typed per-record Python parse;
- ``orjson``: ``orjson.loads`` per line into dicts (no columns): a lower bound of any
  per-line Python parse.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("duckdb_store", "duckdb_threads1", "duckdb_bare", "duckdb_bare_threads1",
            "pyarrow", "pyarrow_threads1", "msgspec", "msgspec_buffer", "msgspec_decode", "orjson")


class Phase(msgspec.Struct):
    name: str
    parent: str | None = None
    ms: float | None = None
    calls: int | None = None
    start_ms: float | None = None
    end_ms: float | None = None
    path: str | None = None
    host_ms: float | None = None


class Line(msgspec.Struct):
    schema: int
    rank: int
    step: int
    start_unix_ns: int
    step_ms: float
    phases: list[Phase]
    run_id: str | None = None
    world_size: int | None = None
    hostname: str | None = None
    gpu_start_unix_ns: int | None = None
    clock: str | None = None
    residual_ms: float | None = None
    h2d_hidden_ms: float | None = None
    collectives: msgspec.Raw | None = None  # kept as JSON text, as the store keeps objects
    dropped: msgspec.Raw | None = None
    counters: msgspec.Raw | None = None
    throughput: msgspec.Raw | None = None
    flops: msgspec.Raw | None = None
    memory: msgspec.Raw | None = None
    device: msgspec.Raw | None = None
    untimed: bool | None = None


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _files(run: Path) -> list[Path]:
    return sorted(run.glob("rank*.jsonl"))


def _con(threads: int) -> Any:
    import duckdb

    con = duckdb.connect()
    con.execute("SET preserve_insertion_order = false")  # as the store sets it
    con.execute(f"SET threads = {threads}")
    return con


def _duckdb(files: list[Path], store: bool, threads: int) -> Any:
    from stepscope.analysis.record_files import COLUMNS, json_reader
    from stepscope.analysis.store import COMBINED_PREFIX, TAG

    con = _con(threads)
    if store:  # the store's statement (the parse of a compaction), as it writes it
        sql = f"""CREATE OR REPLACE TEMP TABLE lines AS
            SELECT * EXCLUDE ({TAG}) REPLACE (
                   CASE WHEN filename LIKE '%/{COMBINED_PREFIX}%' THEN {TAG}
                        ELSE replace(regexp_replace(filename, '^.*/', ''),
                                     '.bounded.jsonl', '') END AS filename),
               filename LIKE '%/{COMBINED_PREFIX}%' AS tagged
            FROM {json_reader(files, extra={TAG: "VARCHAR"})}"""
    else:
        cols = "{" + ", ".join(f"{k}: '{v}'" for k, v in COLUMNS.items()) + "}"
        names = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in files) + "]"
        sql = f"""CREATE OR REPLACE TEMP TABLE lines AS SELECT * FROM read_json({names},
            format='newline_delimited', columns={cols}, records='true', compression='none')"""

    def run() -> int:
        con.execute(sql)
        return int(con.execute("SELECT count(*) FROM lines").fetchall()[0][0])
    return run


def _pyarrow(files: list[Path], threads: bool) -> Any:
    import pyarrow as pa
    import pyarrow.json as pj

    phase = pa.struct([("name", pa.string()), ("parent", pa.string()), ("ms", pa.float64()),
                       ("calls", pa.int64()), ("start_ms", pa.float64()),
                       ("end_ms", pa.float64()), ("path", pa.string()),
                       ("host_ms", pa.float64())])
    schema = pa.schema([("schema", pa.int64()), ("run_id", pa.string()), ("rank", pa.int64()),
                        ("world_size", pa.int64()), ("hostname", pa.string()),
                        ("step", pa.int64()), ("start_unix_ns", pa.int64()),
                        ("gpu_start_unix_ns", pa.int64()), ("clock", pa.string()),
                        ("step_ms", pa.float64()), ("phases", pa.list_(phase)),
                        ("residual_ms", pa.float64()), ("h2d_hidden_ms", pa.float64())])
    ro = pj.ReadOptions(use_threads=threads, block_size=8 << 20)
    po = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    con = _con(2 if threads else 1)

    def run() -> int:
        t = pa.concat_tables([pj.read_json(str(f), read_options=ro, parse_options=po)
                              for f in files])
        con.register("lines", t)  # zero copy: DuckDB scans the Arrow buffers
        n = int(con.execute("SELECT count(*) FROM lines").fetchall()[0][0])
        con.unregister("lines")
        return n
    return run


_SCALARS = ("schema", "run_id", "rank", "world_size", "hostname", "step", "start_unix_ns",
            "gpu_start_unix_ns", "clock", "step_ms", "residual_ms", "h2d_hidden_ms")
_PHASE_FIELDS = ("name", "parent", "ms", "calls", "start_ms", "end_ms", "path", "host_ms")


def _decoded(data: bytes, whole: Any, one: Any) -> list[Line]:
    """The records of one file's bytes: one decode of the whole file as an array, else (a bad
    line) line by line, bad lines skipped."""
    body = data[: data.rfind(b"\n") + 1]  # whole lines only
    try:
        return list(whole.decode(b"[" + body.rstrip(b"\n").replace(b"\n", b",") + b"]"))
    except msgspec.DecodeError:
        out = []
        for line in body.splitlines():
            try:
                out.append(one.decode(line))
            except msgspec.DecodeError:
                continue  # a bad line: the store counts it
        return out


def _msgspec(files: list[Path], buffer: bool) -> Any:
    import numpy as np

    one = msgspec.json.Decoder(Line)
    whole = msgspec.json.Decoder(list[Line])
    con = _con(1)

    def run() -> int:
        recs: list[Line] = []
        for f in files:
            data = f.read_bytes()
            if buffer:
                recs += _decoded(data, whole, one)
            else:
                for line in data.splitlines():
                    try:
                        recs.append(one.decode(line))
                    except msgspec.DecodeError:
                        continue  # a bad line: the store counts it
        cols: dict[str, Any] = {c: np.asarray([getattr(r, c) for r in recs]) for c in _SCALARS}
        phases = [p for r in recs for p in r.phases]
        counts = np.fromiter((len(r.phases) for r in recs), dtype=np.int64, count=len(recs))
        flat: dict[str, Any] = {c: np.asarray([getattr(p, c) for p in phases])
                                for c in _PHASE_FIELDS}
        flat["rec"] = np.repeat(np.arange(len(recs)), counts)
        con.register("lines", cols)
        con.register("flat", flat)
        n = int(con.execute("SELECT count(*) FROM lines").fetchall()[0][0])
        con.execute("SELECT count(*) FROM flat").fetchall()
        return n
    return run


def _msgspec_decode(files: list[Path]) -> Any:
    one = msgspec.json.Decoder(Line)
    whole = msgspec.json.Decoder(list[Line])

    def run() -> int:
        return sum(len(_decoded(f.read_bytes(), whole, one)) for f in files)
    return run


def _orjson(files: list[Path]) -> Any:
    import orjson

    def run() -> int:
        n = 0
        for f in files:
            for line in f.read_bytes().splitlines():
                try:
                    orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                n += 1
        return n
    return run


def child(variant: str, run: Path) -> dict[str, Any]:
    """Parse ``run``'s files once with ``variant`` in this process; its CPU, rows and RSS."""
    files = _files(run)
    makers = {
        "duckdb_store": lambda: _duckdb(files, True, 2),
        "duckdb_threads1": lambda: _duckdb(files, True, 1),
        "duckdb_bare": lambda: _duckdb(files, False, 2),
        "duckdb_bare_threads1": lambda: _duckdb(files, False, 1),
        "pyarrow": lambda: _pyarrow(files, True),
        "pyarrow_threads1": lambda: _pyarrow(files, False),
        "msgspec": lambda: _msgspec(files, False),
        "msgspec_buffer": lambda: _msgspec(files, True),
        "msgspec_decode": lambda: _msgspec_decode(files),
        "orjson": lambda: _orjson(files),
    }
    fn = makers[variant]()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c0 = _cpu()
    rows = fn()
    cpu = _cpu() - c0
    return {"cpu_s": cpu, "records": rows, "rss_before_mb": rss0 / 1024,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _available(variant: str) -> bool:
    import importlib.util

    return not variant.startswith("pyarrow") or importlib.util.find_spec("pyarrow") is not None


def _samples_per_record(run: Path) -> int:
    with open(_files(run)[0], "rb") as fh:
        first = json.loads(fh.readline())
    return len(first.get("phases") or []) + 1  # the phases and the residual


def main() -> int:
    if any(a == "--record" or a.startswith("--record=") for a in sys.argv[1:]):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _results  # benchmarks/_results.py: re-runs this script and writes its record
        return _results.record_run(__file__, sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a directory of rank*.jsonl files")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--record", metavar="DIR", help="also write the JSON lines as a record in DIR")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.run)))
        return 0
    files = _files(args.run)
    if not files:
        print(f"{args.run}: no rank*.jsonl files", file=sys.stderr)
        return 2
    variants = [v for v in args.variants if _available(v)]
    per = _samples_per_record(args.run)
    got: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    loads: list[float] = []
    for rep in range(args.reps):
        k = rep % len(variants)
        for v in variants[k:] + variants[:k]:  # rotated: no variant always runs first
            loads.append(os.getloadavg()[0])
            out = subprocess.run([sys.executable, __file__, str(args.run), "--child", v],
                                 capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(f"{v}: {out.stderr.strip()[-400:]}", file=sys.stderr)
                return 1
            got[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    mb = round(sum(f.stat().st_size for f in files) / 2**20, 1)
    for v, runs in got.items():
        cpus = sorted(r["cpu_s"] for r in runs)
        q = statistics.quantiles(cpus, n=4) if len(cpus) > 1 else [cpus[0]] * 3
        recs = runs[0]["records"]
        us = q[1] / max(recs, 1) * 1e6
        print(json.dumps({
            "benchmark": "parse_floor", "variant": v, "files": len(files), "jsonl_mb": mb,
            "records": recs, "samples_per_record": per, "reps": len(runs),
            "cpu_s_median": round(q[1], 3), "cpu_s_q1": round(q[0], 3),
            "cpu_s_q3": round(q[2], 3),
            "cpu_us_per_record": round(us, 2), "cpu_us_per_sample": round(us / per, 3),
            "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 1),
            "rss_before_parse_mb": round(max(r["rss_before_mb"] for r in runs), 1),
            "load_avg_1m": [round(min(loads), 2), round(max(loads), 2)]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
