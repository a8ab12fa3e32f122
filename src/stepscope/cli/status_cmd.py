"""``stepscope status``: which rank is stuck, dead or crashed, from the heartbeats.

The analysis and rich are imported when the command runs, so building the parser stays light.
"""

from __future__ import annotations

import argparse
import sys

from stepscope.cli.options import Subparsers
from stepscope.common.errors import AnalysisError
from stepscope.common.escape import term, write_json


def add_parser(subparsers: Subparsers) -> None:
    s = subparsers.add_parser("status",
                              help="which rank is stuck, dead or crashed, from the heartbeats")
    s.add_argument("run_dir")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    s.add_argument(
        "--stalled-after", type=float, metavar="S", default=None,
        help="call a rank stalled after S s on one step (default: max(5 s, 2 heartbeats, 10 steps))",
    )
    s.add_argument(
        "--trust-flight-dumps", action="store_true",
        help="also read PyTorch's own Flight Recorder dumps in RUN/flight_recorder/ (pickles: "
             "loading one can run code, so only for a run directory you trust)",
    )
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return status_command(args.run_dir, as_json=args.json, stalled_after_s=args.stalled_after,
                          trust_flight_dumps=args.trust_flight_dumps)


def status_command(run_dir: str, as_json: bool, stalled_after_s: float | None = None,
                   trust_flight_dumps: bool = False) -> int:
    """Run ``stepscope status``; 0 when any heartbeat was readable, 2 when none."""
    from stepscope.analysis.hangs import analyze_status

    try:
        doc = analyze_status(run_dir, stalled_after_s=stalled_after_s,
                             trust_flight_dumps=trust_flight_dumps)
    except AnalysisError as exc:
        print(f"stepscope status: {term(exc)}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError, RecursionError, MemoryError) as exc:
        # The heartbeats are checked field by field; this is the last line against a file
        # shape nobody foresaw: the operator gets a one-line answer, not a traceback.
        print(f"stepscope status: {term(run_dir)}: could not read the heartbeats ({term(repr(exc))})",
              file=sys.stderr)
        return 2
    if as_json:
        write_json(doc, sys.stdout)
        for note in doc["notes"]:
            print(f"stepscope status: {term(note)}", file=sys.stderr)
    else:
        from stepscope.report.status_view import render_status

        render_status(doc)
    return 0
