"""``stepscope compare A B``: did B get faster than A? Step and phases, with a CI; a CI gate.

DuckDB, the analysis and rich are imported when the command runs, so building the parser
stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from stepscope.cli.options import Subparsers
from stepscope.common.errors import AnalysisError
from stepscope.common.escape import term, write_json

#: Fewest compared steps per run for ``--fail-if-slower`` to decide (no bootstrap interval
#: on fewer says anything).
MIN_GATE_STEPS = 5


def add_parser(subparsers: Subparsers) -> None:
    c = subparsers.add_parser("compare",
                              help="did B get faster than A? step and phases, with a CI")
    c.add_argument("run_a")
    c.add_argument("run_b")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.add_argument("--markdown", metavar="FILE", help="write a markdown comparison")
    c.add_argument(
        "--steps", metavar="START:END", default=None,
        help="compare only these step indices (e.g. 100: or 100:500); default drops the warm-up",
    )
    c.add_argument("--fail-if-slower", metavar="PCT", type=float, default=None,
                   help="exit 1 when B (the new run) is more than PCT%% slower than A (the baseline)")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return compare_command(
        args.run_a, args.run_b, as_json=args.json, markdown=args.markdown, steps=args.steps,
        fail_if_slower=args.fail_if_slower,
    )


def _reading(run_a: str, run_b: str) -> Any:
    """Progress on stderr (a terminal only) while both runs' rank files are read."""
    try:
        from stepscope.report.progress import input_bytes, progress
    except ImportError:  # no stepscope.report.progress: read without a progress line
        return contextlib.nullcontext()
    total = (input_bytes(run_a, "rank*") + input_bytes(run_b, "rank*")) or None
    return progress(total, "reading rank files of both runs", unit="bytes", track_reads=True,
                    done_desc="comparing")


def compare_command(
    run_a: str, run_b: str, as_json: bool, markdown: str | None = None, steps: str | None = None,
    fail_if_slower: float | None = None,
) -> int:
    """Run ``stepscope compare``; 0 when the runs compared, 2 when either is unusable, 1 when
    ``fail_if_slower`` is given and B (the new run) is more than that many % slower than A
    (the saved baseline): a CI gate."""
    if fail_if_slower is not None and (not isinstance(fail_if_slower, (int, float))
                                       or not fail_if_slower >= 0 or fail_if_slower == float("inf")):
        print(f"stepscope compare: --fail-if-slower must be a finite percentage >= 0; got "
              f"{fail_if_slower!r}", file=sys.stderr)
        return 2
    import duckdb

    from stepscope.analysis.comparison import compare_runs

    try:
        with _reading(run_a, run_b):
            doc = compare_runs(run_a, run_b, steps=steps)
    except ValueError as exc:  # a bad --steps
        print(f"stepscope compare: {term(exc)}", file=sys.stderr)
        return 2
    except AnalysisError as exc:
        print(f"stepscope compare: {term(exc)}", file=sys.stderr)
        return 2
    except (duckdb.Error, OSError, UnicodeError) as exc:
        print(f"stepscope compare: cannot read runs ({type(exc).__name__}: {term(exc)})", file=sys.stderr)
        return 2
    note = sys.stderr if as_json else sys.stdout
    if as_json:
        write_json(doc, sys.stdout)
        for n in doc["notes"]:
            print(f"stepscope compare: {term(n)}", file=sys.stderr)
    else:
        from stepscope.report.compare_view import render_compare

        render_compare(doc)
    if markdown:
        from stepscope.common.safefs import write_output
        from stepscope.report.compare_view import to_markdown

        try:
            write_output(markdown, to_markdown(doc))  # never through a planted link
        except OSError as exc:
            print(f"stepscope compare: cannot write {term(markdown)} ({term(exc)})", file=sys.stderr)
            return 2
        print(f"wrote {term(markdown)}", file=note)
    if fail_if_slower is not None:
        return _gate(doc, fail_if_slower)
    return 0


def _gate(doc: dict[str, Any], fail_if_slower: float) -> int:
    """``--fail-if-slower``: 1 when B is slower than A by more than the limit, 2 on too few steps."""
    n_a, n_b = int(doc["step"].get("a_samples") or 0), int(doc["step"].get("b_samples") or 0)
    if min(n_a, n_b) < MIN_GATE_STEPS:
        # A gate that passes on two steps would pass anything: say there is too little.
        print(f"stepscope compare: too few steps to gate on (A: {n_a}, B: {n_b}; "
              f"--fail-if-slower needs at least {MIN_GATE_STEPS} on each side)",
              file=sys.stderr)
        return 2
    slower = float(doc.get("slower_pct") or 0.0)
    if slower > fail_if_slower:
        print(f"stepscope compare: B is {slower:.1f}% slower than A (limit "
              f"{fail_if_slower:g}%): {doc['verdict']}", file=sys.stderr)
        return 1
    print(f"stepscope compare: B is within {fail_if_slower:g}% of A "
          f"(slower by {slower:.1f}%)", file=sys.stderr)
    return 0
