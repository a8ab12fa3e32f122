"""``stepscope report``: analyze a run directory and render it (terminal, JSON, md, HTML)."""

from __future__ import annotations

import sys
from typing import Any

from stepscope.common.errors import AnalysisError
from stepscope.common.escape import term, write_json


def load_document(run_dir: str, keep: bool = False, threads: int | None = None,
                  memory_limit: str | None = None) -> dict[str, Any]:
    """``analyze_run`` with every input problem turned into :class:`AnalysisError`."""
    import duckdb

    from stepscope.analysis.run import analyze_run

    try:
        return analyze_run(run_dir, keep=keep, threads=threads, memory_limit=memory_limit)
    except (duckdb.Error, OSError, UnicodeError) as exc:
        # DuckDB/IO errors on user files are input problems, reported as one line.
        raise AnalysisError(f"{run_dir}: cannot read run ({type(exc).__name__}: {exc})") from exc
    except MemoryError:
        raise AnalysisError(f"{run_dir}: out of memory analysing the run") from None


def public(doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON contract: ``doc`` without private (underscore) keys."""
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def report_command(run_dir: str, as_json: bool, markdown: str | None, html: str | None,
                   threads: int | None = None, memory_limit: str | None = None) -> int:
    """Run ``stepscope report``; returns the exit code (0 ok, 2 unusable input)."""
    from stepscope.report.progress import input_bytes, progress

    need_rows = bool(markdown or html)
    try:
        # Progress on stderr only when it is a terminal: bytes of rank files read, then analysis.
        with progress(input_bytes(run_dir, "rank*") or None, "reading rank files", unit="bytes",
                      track_reads=True, done_desc="analysing (DuckDB)"):
            doc = load_document(run_dir, keep=need_rows, threads=threads,
                                memory_limit=memory_limit)
    except AnalysisError as exc:
        print(f"stepscope report: {term(exc)}", file=sys.stderr)
        return 2
    data = doc.get("_data")
    # With --json stdout carries only the document; notes go to stderr.
    note = sys.stderr if as_json else sys.stdout
    try:
        if as_json:
            # Non-finite numbers (NaN/inf from bad records) become null: always valid JSON.
            write_json(public(doc), sys.stdout)
            for s in doc["run"]["skipped"]:
                print(f"stepscope report: skipped: {term(s)}", file=sys.stderr)
        else:
            from stepscope.report.terminal import render_terminal

            render_terminal(doc)
        if markdown:
            from stepscope.report.markdown import write_markdown

            with progress(None, "writing markdown and plots"):
                written = write_markdown(doc, markdown)
            print(f"wrote {term(', '.join(written))}", file=note)
        if html:
            from stepscope.report.html import write_html

            with progress(None, "writing HTML"):
                page = write_html(doc, html)
            print(f"wrote {term(page)}", file=note)
    except OSError as exc:
        print(f"stepscope report: cannot write output ({term(exc)})", file=sys.stderr)
        return 2
    finally:
        if data is not None:
            data.close()
    return 0
