"""Candidate decoders for a Kineto trace's events, each in a fresh process: CPU time (rusage,
start-up included) and peak RSS, interleaved::

    python benchmarks/trace_decoders.py T54/rank0.pt.trace.json --repeats 3   # T54: trace_speed.build_trace

- ``duckdb``: DuckDB's JSON reader on the whole document (``traceEvents`` as a list of
  structs with the fields the breakdown reads, ``ts``/``dur`` as text for exact ns), unnested
  and fetched as numpy columns.
- ``pyarrow``: pyarrow's JSON reader on the events rewritten as one JSON object per line
  (possible only because the synthetic trace writes one event per line; Kineto itself
  spreads an event over several lines), ``ts``/``dur`` as ``decimal128(22, 3)``.
- ``msgspec-scan``: stepscope's own scan (slices of whole events decoded by msgspec into
  small structs), decode only.
- ``stepscope-parse``: stepscope's whole pass (``events.parse_trace``), what ``trace`` pays
  before the breakdown.

``--args`` instead times, in one process, the forms the fast path could decode ``args``
into, on the slices it cuts (minimum over ``--repeats`` rounds, forms interleaved)::

    python benchmarks/trace_decoders.py T54/rank0.pt.trace.json --args --repeats 7

- ``struct``: this build, ``args`` into the 12-field ``Args``; ``narrow6``: a 6-field struct
  (no collective fields); ``raw``: ``args`` kept as ``msgspec.Raw``; ``none``: not read at all
  (the floor); ``raw+deferred``: ``raw``, then the args of the launches and device events (the
  events whose args are read) joined per slice and decoded into ``Args`` in one call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_PRE = """
import resource, sys, json
def done(n):
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mb": ru.ru_maxrss / 1024,
                      "rows": n}))
path = sys.argv[1]
"""

CODE = {
    "duckdb": _PRE + """
import duckdb
con = duckdb.connect(config={"threads": 1})
cols = ("STRUCT(ph VARCHAR, cat VARCHAR, name VARCHAR, tid VARCHAR, ts VARCHAR, dur VARCHAR, "
        "args STRUCT(correlation BIGINT, stream BIGINT))[]")
q = (f"SELECT e.ph, e.cat, e.name, e.ts, e.dur, e.args.correlation AS corr FROM "
     f"(SELECT unnest(traceEvents) AS e FROM read_json(?, format='unstructured', "
     f"maximum_object_size=4000000000, columns={{traceEvents: '{cols}'}}))")
r = con.execute(q, [path]).fetchnumpy()
done(len(r["ph"]))
""",
    "pyarrow": _PRE + """
import io
import pyarrow as pa, pyarrow.json as pj
data = open(path, "rb").read()
a = data.index(b'"traceEvents": [') + len(b'"traceEvents": [')
body = data[a:data.rindex(b"]")].replace(b",\\n  ", b"\\n").replace(b",\\n", b"\\n")
del data
dec = pa.decimal128(22, 3)
schema = pa.schema([("ph", pa.string()), ("cat", pa.string()), ("name", pa.string()),
                    ("ts", dec), ("dur", dec),
                    ("args", pa.struct([("correlation", pa.int64()), ("stream", pa.int64())]))])
t = pj.read_json(io.BytesIO(body), read_options=pj.ReadOptions(use_threads=False, block_size=1 << 24),
                 parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"))
done(t.num_rows)
""",
    "msgspec-scan": _PRE + """
import gc
gc.disable()
from stepscope.analysis.trace.events import _items
from stepscope.analysis.trace.reader import _open
from stepscope.analysis.trace.scan import EventScan
n = 0
with _open(path, max_depth=None) as r:
    for b in _items(r, EventScan(64)):
        n += len(b)
done(n)
""",
    "stepscope-parse": _PRE + """
import gc
gc.disable()
from stepscope.analysis.trace.events import parse_trace
pt = parse_trace(path)
done(pt.events_seen)
""",
}


def args_forms(path: str, repeats: int) -> None:
    """Decode time of the fast path's slices with ``args`` in each form (see the docstring)."""
    import time
    from decimal import Decimal
    from typing import Any, Union

    import msgspec

    from stepscope.analysis.trace import scan as S

    data = open(path, "rb").read()  # noqa: SIM115 - read once, whole
    lo = data.index(b"[", data.index(b'"traceEvents"')) + 1
    hi = data.rindex(b"]")
    docs, pos = [], lo
    while pos < hi:  # the fast path's cuts: whole events, at most FAST_BYTES each
        c = S._cut(data, pos, min(pos + S.FAST_BYTES, hi))
        if c < 0 or pos + S.FAST_BYTES >= hi:
            docs.append(b"[" + data[pos:hi] + b"]")
            break
        docs.append(b"[" + data[pos:c + 1] + b"]")
        pos = c + 2
    del data

    unset = msgspec.UNSET
    # Built with defstruct: annotations of classes local to a function cannot be resolved.
    narrow = msgspec.defstruct("Narrow", [
        ("correlation", Any, unset), ("stream", Any, unset),
        ("external_id", Any, msgspec.field(default=unset, name="External id")),
        ("nbytes", Any, msgspec.field(default=unset, name="bytes")),
        ("kind", Any, unset), ("flops", Any, unset)], gc=False)

    def span(name: str, fields: list[Any]) -> Any:
        return msgspec.defstruct(name, fields, bases=(S._Fields,), tag_field="ph", tag="X")

    span_narrow = span("SpanNarrow", [("args", Union[narrow, None], None)])  # noqa: UP007
    span_raw = span("SpanRaw", [("args", msgspec.Raw, msgspec.Raw(b"null"))])
    span_none = span("SpanNone", [])

    def dec(one: Any) -> Any:
        return msgspec.json.Decoder(list[Union[(one, *S._MARKS)]],
                                    float_hook=Decimal)

    raw = dec(span_raw)
    joined = msgspec.json.Decoder(list[S.Args], float_hook=Decimal)
    read = {"cuda_runtime", "kernel", "gpu_memcpy", "gpu_memset"}

    def deferred(doc: bytes) -> None:
        items = raw.decode(doc)
        sel = [e.args for e in items if type(e) is span_raw and e.cat in read]
        joined.decode(b"[" + b",".join(sel) + b"]")

    forms: dict[str, Any] = {"struct": S._FAST.decode, "narrow6": dec(span_narrow).decode,
                             "raw": raw.decode, "none": dec(span_none).decode,
                             "raw+deferred": deferred}
    best = {k: float("inf") for k in forms}
    for _ in range(repeats):
        for k, f in forms.items():
            t = time.process_time()
            for doc in docs:
                f(doc)
            best[k] = min(best[k], time.process_time() - t)
    print(json.dumps({"slices": len(docs), "cpu_s_min": {k: round(v, 4) for k, v in best.items()}}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="*", choices=sorted(CODE))
    ap.add_argument("--args", action="store_true",
                    help="time the forms of the fast path's args instead (in-process)")
    args = ap.parse_args()
    if args.args:
        args_forms(args.trace, args.repeats)
        return 0
    names = args.only or list(CODE)
    res: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for i in range(args.repeats):
        for n in names:
            p = subprocess.run([sys.executable, "-c", CODE[n], args.trace], capture_output=True,
                               text=True, check=False)
            if p.returncode != 0:
                print(json.dumps({"decoder": n, "run": i, "error": p.stderr[-300:]}), flush=True)
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r.update(decoder=n, run=i)
            print(json.dumps(r), flush=True)
            res[n].append(r)
    for n, rs in res.items():
        if rs:
            print(json.dumps({"summary": n, "cpu_s_median": round(statistics.median(
                r["cpu_s"] for r in rs), 3), "peak_rss_mb": round(max(r["peak_rss_mb"] for r in rs)),
                "rows": rs[0]["rows"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
