"""``stepscope report``: analyze a run directory and render it (terminal, JSON, md, HTML).

Heavy imports (DuckDB, the analysis, rich) wait until the command runs, so building the
parser (``stepscope --help``, every other command) never pays for them.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from stepscope.cli.options import Subparsers, add_duckdb_options
from stepscope.common.errors import AnalysisError
from stepscope.common.escape import term

if TYPE_CHECKING:
    from stepscope.analysis.run import AnalyzedRun
    from stepscope.common.figures import PlotData


#: The engines ``report --engine`` runs the analysis on.
ENGINES = ("duckdb", "dask")


def add_parser(subparsers: Subparsers) -> None:
    r = subparsers.add_parser("report", help="cross-rank report of a run directory")
    r.add_argument("run_dir")
    r.add_argument("--json", action="store_true", help="print one JSON document")
    r.add_argument("--markdown", metavar="FILE", help="write a markdown summary")
    r.add_argument("--html", metavar="FILE", help="write a self-contained HTML page")
    r.add_argument("--run", metavar="ID", default=None,
                   help="the run to show where several launches wrote into RUN_DIR (an id or a "
                        "unique prefix; default: the newest)")
    add_duckdb_options(r)
    r.add_argument("--engine", choices=ENGINES, default="duckdb",
                   help="duckdb: this machine (default); dask: the per-rank-block work as tasks "
                        "on a Dask cluster (pip install 'stepscope[dask]')")
    r.add_argument("--dask-address", metavar="ADDR", default=None,
                   help="the Dask scheduler for --engine dask (default: a local cluster)")
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.dask_address is not None and args.engine != "dask":
        print("stepscope report: --dask-address needs --engine dask", file=sys.stderr)
        return 2
    return report_command(
        args.run_dir, as_json=args.json, markdown=args.markdown, html=args.html,
        threads=args.threads, memory_limit=args.memory_limit, run_id=args.run,
        engine=args.engine, dask_address=args.dask_address,
    )


def analyze_run_dir(run_dir: str, threads: int | None = None,
                    memory_limit: str | None = None, run_id: str | None = None,
                    engine: str = "duckdb", dask_address: str | None = None) -> AnalyzedRun:
    """The analysed run, kept open, with every input problem turned into :class:`AnalysisError`.

    ``engine``: ``duckdb`` (this machine) or ``dask`` (the per-rank-block work on the Dask
    cluster at ``dask_address``, or a local one); the document is the same."""
    import duckdb

    from stepscope.analysis.run import open_analyzed_run

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    try:
        if engine == "dask":
            # Only here: Dask is an optional, heavy dependency.
            from stepscope.analysis import dask_engine

            with dask_engine.cluster(dask_address) as client:
                return open_analyzed_run(run_dir, threads=threads, memory_limit=memory_limit,
                                         run_id=run_id, phase_rank_rows=dask_engine.runner(client),
                                         step_block_rows=dask_engine.step_runner(client),
                                         series_screen=dask_engine.series_runner(client),
                                         own_blocks=dask_engine.own_runner(client))
        return open_analyzed_run(run_dir, threads=threads, memory_limit=memory_limit,
                                 run_id=run_id)
    except (duckdb.Error, OSError, UnicodeError) as exc:
        # DuckDB/IO errors on user files are input problems, reported as one line.
        raise AnalysisError(f"{run_dir}: cannot read run ({type(exc).__name__}: {exc})") from exc
    except MemoryError:
        raise AnalysisError(f"{run_dir}: out of memory analysing the run") from None


def report_command(run_dir: str, as_json: bool, markdown: str | None, html: str | None,
                   threads: int | None = None, memory_limit: str | None = None,
                   run_id: str | None = None, engine: str = "duckdb",
                   dask_address: str | None = None) -> int:
    """Run ``stepscope report``; returns the exit code (0 ok, 2 unusable input)."""
    from stepscope.report.progress import input_bytes, progress

    try:
        # Progress on stderr only when it is a terminal: bytes of rank files read, then analysis.
        with progress(input_bytes(run_dir, "rank*") or None, "reading rank files", unit="bytes",
                      track_reads=True, done_desc="analysing (DuckDB)"):
            analyzed = analyze_run_dir(run_dir, threads=threads, memory_limit=memory_limit,
                                       run_id=run_id, engine=engine, dask_address=dask_address)
    except AnalysisError as exc:
        print(f"stepscope report: {term(exc)}", file=sys.stderr)
        return 2
    draws = bool(markdown or html)  # the figures need the loaded run; the rest the document
    if not draws:
        analyzed.close()
    try:
        return _render(analyzed, as_json=as_json, markdown=markdown, html=html)
    finally:
        if draws:
            analyzed.close()


def _render(analyzed: AnalyzedRun, as_json: bool, markdown: str | None, html: str | None) -> int:
    from stepscope.report import plots
    from stepscope.report.progress import progress

    doc = analyzed.doc
    made: list[PlotData] = []

    def figures() -> PlotData:
        """The figures' data, made once, when the first output that draws them is written."""
        if not made:
            from stepscope.analysis.heatmaps import plot_data

            made.append(plot_data(doc, analyzed.data))
        return made[0]

    # With --json stdout carries only the document; notes go to stderr.
    note = sys.stderr if as_json else sys.stdout
    try:
        if as_json:
            from stepscope.report.render import write_report_json

            write_report_json(doc, sys.stdout)
            for s in doc["run"]["skipped"]:
                print(f"stepscope report: skipped: {term(s)}", file=sys.stderr)
        else:
            from stepscope.report.terminal import render_terminal

            render_terminal(doc)
        if markdown:
            from stepscope.report.markdown import write_markdown

            with progress(None, "writing markdown and plots"):
                written = write_markdown(
                    doc, markdown, figures() if plots.have_matplotlib() else None)
            print(f"wrote {term(', '.join(written))}", file=note)
        if html:
            from stepscope.report.html import write_html

            with progress(None, "writing HTML"):
                page = write_html(doc, html, figures())
            print(f"wrote {term(page)}", file=note)
    except OSError as exc:
        print(f"stepscope report: cannot write output ({term(exc)})", file=sys.stderr)
        return 2
    return 0
