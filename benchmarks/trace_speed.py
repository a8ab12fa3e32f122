"""Trace analysis speed and memory: stepscope's streaming analyser vs HTA on the same trace.

Builds a Kineto-shaped trace of the requested size by repeating the steps of a real trace
(shifted in time, correlation ids renumbered), then runs each tool in a fresh process,
interleaved, and prints one JSON line per run (wall seconds, peak RSS) and a summary line::

    python benchmarks/trace_speed.py --size-mb 300 --hta-python hta-venv/bin/python
    python benchmarks/trace_speed.py --size-mb 54 --no-hta --record benchmarks/results
    python benchmarks/trace_speed.py --size-mb 100 --gzip both --no-hta   # plain vs .json.gz

HTA (PyPI ``HolisticTraceAnalysis``) must live in its own venv; it is not a dependency of stepscope.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The shared real traces sit next to the checkout (../shared/traces) or one level further up
# in a worktree layout; STEPSCOPE_TRACES overrides both.
SHARED = next((p / "shared" / "traces" for p in Path(__file__).resolve().parents[1:4]
               if (p / "shared" / "traces").is_dir()),
              Path(__file__).resolve().parents[2] / "shared" / "traces")
if os.environ.get("STEPSCOPE_TRACES"):
    SHARED = Path(os.environ["STEPSCOPE_TRACES"])
SEED = SHARED / "ns_resolution_trace" / "rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"

# Each child measures itself: wall time of the analysis and the process's peak RSS.
OURS = """
import json, resource, sys, time
def cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
t = time.perf_counter()
from stepscope.analysis.trace import analyze_trace
c_import = cpu()
r = analyze_trace(sys.argv[1], workers=1).ranks[0]
wall = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": wall, "cpu_s": cpu(), "import_cpu_s": c_import,
                  "peak_rss_mb": ru.ru_maxrss / 1024,
                  "busy_us": getattr(r.total, "busy_us", None),  # None: a CPU-only trace
                  "idle_us": getattr(r.total, "idle_us", None)}))
"""
# The same with the package's __init__ skipped: what `stepscope trace` would cost if
# `import stepscope` did not import the recording side (torch, ~1.3 s CPU and ~190 MB).
OURS_BARE = """
import sys, types
pkg = types.ModuleType("stepscope")
pkg.__path__ = [p + "/stepscope" for p in sys.path if p and __import__("os").path.isfile(
    p + "/stepscope/analysis/trace/__init__.py")][:1]
sys.modules["stepscope"] = pkg
""" + OURS

HTA = """
import contextlib, io, json, logging, os, resource, sys, time
def cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
logging.disable(logging.CRITICAL)
os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
t = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
c_import = cpu()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    a = TraceAnalysis(trace_dir=sys.argv[1], include_last_profiler_step=True)
    df = a.get_temporal_breakdown(visualize=False)
wall = time.perf_counter() - t
row = df.iloc[0]
print(json.dumps({"wall_s": wall, "cpu_s": cpu(), "import_cpu_s": c_import,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "busy_us": float(row["kernel_time(us)"] - row["idle_time(us)"]),
                  "idle_us": float(row["idle_time(us)"])}))
"""


def build_trace(out: Path, size_mb: float, seed: Path = SEED) -> int:
    """Write a trace of about `size_mb` MB made of time-shifted copies of `seed`'s events."""
    with gzip.open(seed, "rt") as f:
        doc: dict[str, Any] = json.load(f)
    events = doc.pop("traceEvents")
    body = [e for e in events if e.get("ph") != "M"]
    head = [e for e in events if e.get("ph") == "M"]
    ts = [float(e["ts"]) for e in body if "ts" in e]
    span = max(ts) - min(ts) + 1000.0
    one = len(json.dumps(body))
    copies = max(1, int(size_mb * 1e6 / one))
    with open(out, "w") as f:
        f.write("{\n")
        for k, v in doc.items():
            f.write(f"  {json.dumps(k)}: {json.dumps(v)},\n")
        f.write('  "traceEvents": [\n')
        f.write(",\n".join(json.dumps(e) for e in head))
        for c in range(copies):
            shift = c * span
            for e in body:
                e2 = dict(e)
                if "ts" in e2:
                    e2["ts"] = round(float(e["ts"]) + shift, 3)
                args = e2.get("args")
                if isinstance(args, dict) and "correlation" in args:
                    e2["args"] = {**args, "correlation": args["correlation"] + c * 10_000_000}
                f.write(",\n  " + json.dumps(e2))
        f.write("\n  ]\n}\n")
    return copies


def build_whitespace_trace(out: Path, size_mb: float, seed: Path = SEED) -> int:
    """One copy of `seed`'s events after `size_mb` MB of whitespace: the worst case for a
    gzip reader (whitespace compresses ~1000:1, so each compressed read inflates hugely)."""
    with gzip.open(seed, "rt") as f:
        doc: dict[str, Any] = json.load(f)
    events = doc.pop("traceEvents")
    with open(out, "w") as f:
        f.write('{"traceEvents": [')
        block = " " * (1 << 20)
        for _ in range(int(size_mb * 1e6) >> 20):
            f.write(block)
        f.write(",\n".join(json.dumps(e) for e in events))
        f.write("]}\n")
    return 1


# The environment of every child; --pyc points it at a bytecode cache (see main).
CHILD_ENV: dict[str, str] = dict(os.environ)


def run_cli(python: str, trace_dir: Path, src: str | None = None) -> dict[str, Any]:
    """``stepscope trace --json`` end to end in a fresh process: interpreter start-up, imports,
    the analysis and the JSON it prints, measured from outside by the child's rusage."""
    env = {**CHILD_ENV, "PYTHONPATH": src} if src else CHILD_ENV
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        p = subprocess.Popen([python, "-m", "stepscope", "trace", "--json", str(trace_dir)],
                             stdout=out, stderr=err, env=env)
        _, status, ru = os.wait4(p.pid, 0)  # the child's own rusage, reaped here
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            return {"error": err.read().decode(errors="replace")[-500:]}
        doc = json.loads(out.read())
    total = doc["ranks"][0]["total"] or {}
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "import_cpu_s": 0.0,
            "peak_rss_mb": ru.ru_maxrss / 1024,
            "busy_us": total.get("busy_us"), "idle_us": total.get("idle_us")}


def run(python: str, code: str, trace_dir: Path, src: str | None = None) -> dict[str, Any]:
    if code == "cli":
        return run_cli(python, trace_dir, src)
    env = {**CHILD_ENV, "PYTHONPATH": src} if src else CHILD_ENV
    p = subprocess.run([python, "-c", code, str(trace_dir)], capture_output=True, text=True,
                       check=False, env=env)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-500:]}
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    if any(a == "--record" or a.startswith("--record=") for a in sys.argv[1:]):
        import _results  # benchmarks/_results.py: re-runs this script and writes its record
        return _results.record_run(__file__, sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-mb", type=float, default=300.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hta-python", default=os.environ.get("HTA_PYTHON"), metavar="PYTHON",
                    help="a python with HolisticTraceAnalysis installed (default: $HTA_PYTHON)")
    ap.add_argument("--record", metavar="DIR", help="also write the JSON lines as a record in DIR "
                    "(benchmarks/results)")
    ap.add_argument("--trace", help="use this trace file instead of building one")
    ap.add_argument("--gzip", choices=("no", "yes", "both"), default="no",
                    help="analyze the synthetic trace gzipped (real traces ship as .json.gz), or both ways")
    ap.add_argument("--no-hta", action="store_true", help="time stepscope only")
    ap.add_argument("--bare", action="store_true",
                    help="also time stepscope without running the package __init__ (no torch import)")
    ap.add_argument("--baseline-src", metavar="DIR",
                    help="also time another checkout's src/ (e.g. the previous version) side by side")
    ap.add_argument("--cli", action="store_true",
                    help="also time `stepscope trace --json` end to end (start-up, analysis, "
                         "output; CPU from the child's rusage), and the baseline's with "
                         "--baseline-src")
    ap.add_argument("--pyc", action="store_true",
                    help="let the children use and write bytecode (in a temporary "
                         "PYTHONPYCACHEPREFIX, one untimed run per tool first), as an "
                         "installed package does; without it PYTHONDONTWRITEBYTECODE, where "
                         "set, makes every run compile the sources again")
    ap.add_argument("--whitespace", action="store_true",
                    help="pad one copy of the seed with --size-mb of whitespace instead of repeating it")
    args = ap.parse_args()
    if not args.no_hta and not args.hta_python:
        ap.error("HTA needs --hta-python PYTHON (or $HTA_PYTHON); or pass --no-hta")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        if args.trace:
            src = Path(args.trace)
            (d / src.name).symlink_to(src.resolve())
            size = src.stat().st_size
        else:
            build = build_whitespace_trace if args.whitespace else build_trace
            copies = build(d / "rank0.pt.trace.json", args.size_mb)
            size = (d / "rank0.pt.trace.json").stat().st_size
            print(json.dumps({"trace": "synthetic from ns_resolution_trace", "copies": copies,
                              "size_mb": round(size / 1e6, 1)}), flush=True)
        variants = {"no": [("", d)], "yes": [], "both": [("", d)]}[args.gzip]
        if args.gzip != "no" and not args.trace:
            gz_dir = d / "gz"
            gz_dir.mkdir()
            with open(d / "rank0.pt.trace.json", "rb") as src_f, \
                    gzip.open(gz_dir / "rank0.pt.trace.json.gz", "wb", compresslevel=6) as dst:
                while chunk := src_f.read(1 << 22):
                    dst.write(chunk)
            gz_size = (gz_dir / "rank0.pt.trace.json.gz").stat().st_size
            print(json.dumps({"gzipped_size_mb": round(gz_size / 1e6, 1)}), flush=True)
            variants.append(("-gz", gz_dir))
            if args.gzip == "yes":
                variants = [("-gz", gz_dir)]
        tools: list[tuple[str, str, str, str | None]] = [("stepscope", sys.executable, OURS, None)]
        if args.cli:
            tools.append(("stepscope-cli", sys.executable, "cli", None))
            if args.baseline_src:
                tools.append(("baseline-cli", sys.executable, "cli", args.baseline_src))
        if args.bare:
            tools.append(("stepscope-bare", sys.executable, OURS_BARE, None))
        if args.baseline_src:
            tools.append(("baseline", sys.executable, OURS, args.baseline_src))
        if not args.no_hta:
            tools.append(("hta", args.hta_python, HTA, None))
        if args.pyc:
            CHILD_ENV.pop("PYTHONDONTWRITEBYTECODE", None)
            CHILD_ENV["PYTHONPYCACHEPREFIX"] = str(d / "pycache")
            for _, py, code, tool_src in tools:  # untimed: writes the bytecode
                run(py, code, variants[0][1], tool_src)
        results: dict[str, list[dict[str, Any]]] = {}
        for i in range(args.repeats):  # interleaved, so drift hits every tool alike
            for suffix, where in variants:
                for tool, py, code, tool_src in tools:
                    r = run(py, code, where, tool_src)
                    r.update(tool=tool + suffix, run=i, size_mb=round(size / 1e6, 1))
                    if "wall_s" in r:
                        r["mb_per_s"] = round(size / 1e6 / r["wall_s"], 1)
                        # CPU time is what 2 shared cores measure fairly; "after import"
                        # leaves out the interpreter's and the libraries' start-up.
                        r["cpu_mb_per_s"] = round(size / 1e6 / r["cpu_s"], 1)
                        r["cpu_after_import_mb_per_s"] = round(
                            size / 1e6 / max(1e-9, r["cpu_s"] - r["import_cpu_s"]), 1)
                    print(json.dumps(r), flush=True)
                    results.setdefault(tool + suffix, []).append(r)
    ok = {t: [r for r in rs if "error" not in r] for t, rs in results.items()}
    if ok.get("stepscope-bare"):
        bare = ok["stepscope-bare"]
        print(json.dumps({"summary": "bare", "size_mb": round(size / 1e6, 1),
                          "cpu_s": [round(r["cpu_s"], 2) for r in bare],
                          "cpu_mb_per_s": [round(size / 1e6 / r["cpu_s"], 1) for r in bare],
                          "peak_rss_mb": [round(r["peak_rss_mb"]) for r in bare]}))
    for cli in ("stepscope-cli", "baseline-cli"):
        if ok.get(cli):
            rs = ok[cli]
            print(json.dumps({"summary": cli, "size_mb": round(size / 1e6, 1),
                              "cpu_s": [round(r["cpu_s"], 3) for r in rs],
                              "median_cpu_s": round(statistics.median(r["cpu_s"] for r in rs), 3),
                              "cpu_mb_per_s": round(size / 1e6 / statistics.median(
                                  r["cpu_s"] for r in rs), 1),
                              "peak_rss_mb": round(max(r["peak_rss_mb"] for r in rs))}))
    if ok.get("stepscope") and ok.get("stepscope-gz"):
        plain = statistics.median(r["wall_s"] for r in ok["stepscope"])
        gz = statistics.median(r["wall_s"] for r in ok["stepscope-gz"])
        print(json.dumps({"summary": "gzip", "plain_wall_s": round(plain, 2), "gz_wall_s": round(gz, 2),
                          "gz_over_plain": round(gz / plain, 2)}))
    if ok.get("stepscope") and ok.get("baseline"):
        ours_s = statistics.median(r["wall_s"] for r in ok["stepscope"])
        base_s = statistics.median(r["wall_s"] for r in ok["baseline"])
        ours_c = statistics.median(r["cpu_s"] for r in ok["stepscope"])
        base_c = statistics.median(r["cpu_s"] for r in ok["baseline"])
        print(json.dumps({"summary": "baseline", "size_mb": round(size / 1e6, 1),
                          "stepscope_wall_s": round(ours_s, 2), "baseline_wall_s": round(base_s, 2),
                          "stepscope_mb_per_s": round(size / 1e6 / ours_s, 1),
                          "baseline_mb_per_s": round(size / 1e6 / base_s, 1),
                          "wall_speedup": round(base_s / ours_s, 2), "cpu_speedup": round(base_c / ours_c, 2),
                          "stepscope_cpu_mb_per_s": round(size / 1e6 / ours_c, 1),
                          "stepscope_cpu_after_import_mb_per_s": round(size / 1e6 / statistics.median(
                              r["cpu_s"] - r["import_cpu_s"] for r in ok["stepscope"]), 1),
                          "stepscope_peak_rss_mb": round(max(r["peak_rss_mb"] for r in ok["stepscope"])),
                          "baseline_peak_rss_mb": round(max(r["peak_rss_mb"] for r in ok["baseline"]))}))
    if ok.get("stepscope") and ok.get("hta"):
        ours_s = statistics.median(r["wall_s"] for r in ok["stepscope"])
        hta_s = statistics.median(r["wall_s"] for r in ok["hta"])
        ours_c = statistics.median(r["cpu_s"] for r in ok["stepscope"])
        hta_c = statistics.median(r["cpu_s"] for r in ok["hta"])
        ours_a = statistics.median(r["cpu_s"] - r["import_cpu_s"] for r in ok["stepscope"])
        hta_a = statistics.median(r["cpu_s"] - r["import_cpu_s"] for r in ok["hta"])
        ours_m = max(r["peak_rss_mb"] for r in ok["stepscope"])
        hta_m = max(r["peak_rss_mb"] for r in ok["hta"])
        print(json.dumps({"summary": True, "size_mb": round(size / 1e6, 1),
                          "stepscope_wall_s": round(ours_s, 2), "hta_wall_s": round(hta_s, 2),
                          "speedup": round(hta_s / ours_s, 2),
                          "stepscope_cpu_s": round(ours_c, 2), "hta_cpu_s": round(hta_c, 2),
                          "cpu_ratio": round(hta_c / ours_c, 2),
                          "stepscope_cpu_after_import_s": round(ours_a, 2),
                          "hta_cpu_after_import_s": round(hta_a, 2),
                          "cpu_after_import_ratio": round(hta_a / ours_a, 2),
                          "stepscope_peak_rss_mb": round(ours_m), "hta_peak_rss_mb": round(hta_m),
                          "memory_ratio": round(ours_m / hta_m, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
