"""``stepscope trace``: analyze Kineto traces and print, dump or write the result.

numpy, msgspec and the analysis are imported when the command runs (with the cyclic
collector paused), so building the parser stays light.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

from stepscope.cli.options import Subparsers
from stepscope.common.errors import AnalysisError
from stepscope.common.escape import term


def add_parser(subparsers: Subparsers) -> None:
    t = subparsers.add_parser("trace", help="analyze torch.profiler (Kineto) traces")
    t.add_argument("path", help="a trace file (.json/.json.gz) or a directory of them")
    t.add_argument("--json", action="store_true", help="print one JSON document")
    t.add_argument("--markdown", metavar="FILE", help="write summary.md")
    t.add_argument("--max-inflated-mb", type=float, default=None, metavar="MB",
                   help="stop reading a trace file after this many MB of JSON (after gzip "
                        "inflation); default 4096")
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The trace analysis does no BLAS work: one OpenBLAS thread instead of one per core cuts
    # numpy's import by ~0.04 s of CPU (0.13 -> 0.09 s, 2 cores); a user's setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # The cyclic collector's passes over what the imports (numpy, msgspec, the analysis)
    # build freed nearly nothing and cost ~0.01 s of CPU; the analysis pauses it anyway.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        rc = trace_command(args.path, as_json=args.json, markdown=args.markdown,
                           max_inflated_mb=args.max_inflated_mb)
        skip_exit_collection()
        return rc
    finally:
        if was_enabled:
            gc.enable()


def _keep_freed_memory() -> None:
    """Have glibc keep freed memory for reuse instead of handing it back to the kernel.

    The analysis frees its read buffers, slices and decoded events block after block; with
    glibc's defaults each buffer of 128 KiB or more is a fresh ``mmap`` and the heap is
    trimmed and grown again, so the same memory is faulted in over and over (15.8k page
    faults on a 54 MB trace, 5.8k with this; 0.30 -> 0.26 s of CPU for the analysis). Only
    a process started as the ``stepscope`` command is tuned: never the library's ``analyze``,
    nor a process (a test, a notebook) that calls the command's ``main`` in-process.
    """
    if not _started_as_command():
        return
    import ctypes  # numpy imports it too: no extra start-up

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune, same results
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest; the dynamic threshold stops
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


def skip_exit_collection() -> None:
    """When this process is the ``stepscope`` command, skip the interpreter's collections at exit.

    Finalizing walks every object numpy, msgspec and the analysis left for reference cycles
    (~0.016 s of CPU after a 54 MB trace, and as much after a 2.5 KB one: it is the imports'
    objects) and frees nothing the kernel would not take back at exit anyway; the output is
    already written by then. ``gc.freeze`` moves them out of the collector's reach (and of the
    collections that shutting threads down could start). A process that calls ``main``
    in-process (a test, a notebook) is left as it is.
    """
    if _started_as_command():
        gc.freeze()


def _started_as_command() -> bool:
    """True when this process is the ``stepscope`` command (``stepscope`` or ``python -m``)."""
    main_mod = sys.modules.get("__main__")
    spec = getattr(main_mod, "__spec__", None)
    return (getattr(spec, "name", None) == "stepscope.__main__"
            or Path(str(getattr(main_mod, "__file__", ""))).stem == "stepscope")


def trace_command(path: str, as_json: bool = False, markdown: str | None = None,
                  max_inflated_mb: float | None = None) -> int:
    """Analyse `path` (a trace file or a directory of per-rank traces).

    Returns 0 on success, 2 when the input cannot be analysed at all (message on stderr).
    """
    from stepscope.analysis.trace import MAX_INFLATED_BYTES, analyze_trace
    from stepscope.report.progress import input_bytes, progress

    cap = MAX_INFLATED_BYTES if max_inflated_mb is None else int(max_inflated_mb * (1 << 20))
    if cap <= 0:
        print(f"stepscope trace: --max-inflated-mb must be positive, got {max_inflated_mb}",
              file=sys.stderr)
        return 2
    _keep_freed_memory()
    try:
        with progress(input_bytes(path) or None, "stepscope trace: reading", unit="bytes",
                      track_reads=True, done_desc="stepscope trace: analysing"):
            doc = analyze_trace(path, max_bytes=cap).to_dict()
    except AnalysisError as e:
        print(f"stepscope trace: {term(e)}", file=sys.stderr)
        return 2
    if all(r["events_seen"] == 0 for r in doc["ranks"]):
        reasons = "; ".join(w for r in doc["ranks"] for w in r["warnings"])
        print(f"stepscope trace: no trace events could be read from {term(path)}: {term(reasons)}",
              file=sys.stderr)
        return 2
    if markdown:
        from stepscope.report.trace_markdown import write_markdown

        try:
            write_markdown(doc, markdown)
        except OSError as e:
            print(f"stepscope trace: cannot write {term(markdown)}: {term(e)}", file=sys.stderr)
            return 2
    if as_json:
        from stepscope.common.escape import write_json

        write_json(doc, sys.stdout, indent=1)
    else:
        from stepscope.report.trace_terminal import render_trace_terminal

        render_trace_terminal(doc)
    return 0

