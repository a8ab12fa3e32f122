"""The ``stepscope trace`` command: analyze Kineto traces and print, dump or write the result."""

from __future__ import annotations

import sys
from pathlib import Path

from stepscope.common.errors import AnalysisError
from stepscope.common.escape import term


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
        import gc

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
        from stepscope.report.trace_markdown import render_markdown

        # The markdown renderer shows GPU step breakdowns; CPU-only ranks' steps (no GPU
        # fields) are in their `cpu` section.
        md_doc = {**doc, "ranks": [r if r.get("total") is not None else {**r, "steps": []}
                                   for r in doc["ranks"]]}
        try:
            from stepscope.common.safefs import write_output

            write_output(markdown, render_markdown(md_doc))  # never through a planted link
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

