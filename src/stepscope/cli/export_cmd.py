"""``stepscope export --perfetto FILE``: the run's timeline as a Chrome/Perfetto trace.

The analysis is imported when the command runs, so building the parser stays light.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepscope.cli.options import Subparsers
from stepscope.common.errors import AnalysisError
from stepscope.common.escape import term


def add_parser(subparsers: Subparsers) -> None:
    e = subparsers.add_parser("export", help="export a run directory")
    e.add_argument("run_dir")
    e.add_argument("--perfetto", metavar="FILE", required=True, help="Chrome/Perfetto trace JSON")
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return export_command(args.run_dir, perfetto=args.perfetto)


def export_command(run_dir: str, perfetto: str) -> int:
    """Run ``stepscope export --perfetto FILE``; returns the exit code (0 ok, 2 bad input)."""
    from stepscope.analysis.timeline import timeline
    from stepscope.cli.report_cmd import analyze_run_dir
    from stepscope.report.perfetto import write_perfetto

    try:
        analyzed = analyze_run_dir(run_dir)
    except AnalysisError as exc:
        print(f"stepscope export: {term(exc)}", file=sys.stderr)
        return 2
    doc = analyzed.doc
    try:
        Path(perfetto).parent.mkdir(parents=True, exist_ok=True)
        n = write_perfetto(doc, timeline(doc, analyzed.data), perfetto)
    except OSError as exc:
        print(f"stepscope export: cannot write {term(perfetto)} ({term(exc)})", file=sys.stderr)
        return 2
    finally:
        analyzed.close()
    for s in doc["run"]["skipped"]:
        print(f"stepscope export: skipped: {term(s)}", file=sys.stderr)
    print(f"wrote {term(perfetto)}: {doc['run']['ranks']} ranks, {n} slices "
          "(open in https://ui.perfetto.dev)")
    return 0
