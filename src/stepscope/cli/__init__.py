"""The ``stepscope`` command line: parses arguments and calls analysis/report functions.

Each subcommand's handler imports its implementation lazily, so ``stepscope --help`` stays
fast and the recording side never pulls in DuckDB or rich.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn


def _cmd_demo(args: argparse.Namespace) -> int:
    from stepscope.demo import run_demo

    return run_demo(
        out_dir=args.out, ranks=args.ranks, steps=args.steps, slow_rank=args.slow_rank,
        fixed=not args.no_fixed,
    )


def _cmd_report(args: argparse.Namespace) -> int:
    from stepscope.report.render import report_command

    return report_command(
        args.run_dir, as_json=args.json, markdown=args.markdown, html=args.html,
        threads=args.threads, memory_limit=args.memory_limit,
    )


def _cmd_compact(args: argparse.Namespace) -> int:
    from stepscope.cli.compact_cmd import compact_command

    return compact_command(args.run_dir, as_json=args.json, threads=args.threads,
                           memory_limit=args.memory_limit)


#: Most DuckDB threads a command accepts (DuckDB starts every one it is given).
MAX_THREADS = 1024


def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads; got {text!r}") from None
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_THREADS} threads; got {n}")
    return n


def _memory_limit(text: str) -> str:
    """A DuckDB memory size (``2GB``, ``512MiB``): checked here, as it goes into SQL."""
    import re

    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*([KMGT]i?B|B|bytes)?\s*", text, re.IGNORECASE):
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB or 512MiB; got {text!r}")
    return text.strip()


class _Parser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _duckdb_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_threads, default=None, metavar="N",
                   help="DuckDB threads (default: all cores)")
    p.add_argument("--memory-limit", type=_memory_limit, default=None, metavar="SIZE",
                   help="DuckDB memory limit, e.g. 2GB (it spills to disk beyond it)")


def _cmd_export(args: argparse.Namespace) -> int:
    from stepscope.report.perfetto import export_command

    return export_command(args.run_dir, perfetto=args.perfetto)


def _cmd_trace(args: argparse.Namespace) -> int:
    import os

    # The trace analysis does no BLAS work: one OpenBLAS thread instead of one per core cuts
    # numpy's import by ~0.04 s of CPU (0.13 -> 0.09 s, 2 cores); a user's setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import gc

    # The cyclic collector's passes over what the imports (numpy, msgspec, the analysis)
    # build freed nearly nothing and cost ~0.01 s of CPU; the analysis pauses it anyway.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        from stepscope.cli.trace_cmd import skip_exit_collection, trace_command

        rc = trace_command(args.path, as_json=args.json, markdown=args.markdown,
                           max_inflated_mb=args.max_inflated_mb)
        skip_exit_collection()
        return rc
    finally:
        if was_enabled:
            gc.enable()


def _cmd_status(args: argparse.Namespace) -> int:
    from stepscope.report.status_view import status_command

    return status_command(args.run_dir, as_json=args.json, stalled_after_s=args.stalled_after,
                          trust_flight_dumps=args.trust_flight_dumps)


def _cmd_compare(args: argparse.Namespace) -> int:
    from stepscope.report.compare_view import compare_command

    return compare_command(
        args.run_a, args.run_b, as_json=args.json, markdown=args.markdown, steps=args.steps,
        fail_if_slower=args.fail_if_slower,
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="stepscope", description="Why is my PyTorch training step slow?"
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="train a small model on CPU over gloo ranks and report it")
    d.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    d.add_argument("--ranks", type=int, default=4, help="number of ranks (default: 4)")
    d.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    d.add_argument("--slow-rank", type=int, default=1, help="rank made slow on purpose")
    d.add_argument(
        "--no-fixed", action="store_true",
        help="skip the second run (slow rank fixed, in OUT-fixed) and its `stepscope compare`",
    )
    d.set_defaults(func=_cmd_demo)

    r = sub.add_parser("report", help="cross-rank report of a run directory")
    r.add_argument("run_dir")
    r.add_argument("--json", action="store_true", help="print one JSON document")
    r.add_argument("--markdown", metavar="FILE", help="write a markdown summary")
    r.add_argument("--html", metavar="FILE", help="write a self-contained HTML page")
    _duckdb_options(r)
    r.set_defaults(func=_cmd_report)

    k = sub.add_parser("compact", help="copy a run's new JSONL lines into its Parquet store")
    k.add_argument("run_dir")
    k.add_argument("--json", action="store_true", help="print what was done as JSON")
    _duckdb_options(k)
    k.set_defaults(func=_cmd_compact)

    e = sub.add_parser("export", help="export a run directory")
    e.add_argument("run_dir")
    e.add_argument("--perfetto", metavar="FILE", required=True, help="Chrome/Perfetto trace JSON")
    e.set_defaults(func=_cmd_export)

    t = sub.add_parser("trace", help="analyze torch.profiler (Kineto) traces")
    t.add_argument("path", help="a trace file (.json/.json.gz) or a directory of them")
    t.add_argument("--json", action="store_true", help="print one JSON document")
    t.add_argument("--markdown", metavar="FILE", help="write summary.md")
    t.add_argument("--max-inflated-mb", type=float, default=None, metavar="MB",
                   help="stop reading a trace file after this many MB of JSON (after gzip "
                        "inflation); default 4096")
    t.set_defaults(func=_cmd_trace)

    s = sub.add_parser("status", help="which rank is stuck, dead or crashed, from the heartbeats")
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
    s.set_defaults(func=_cmd_status)

    c = sub.add_parser("compare", help="did B get faster than A? step and phases, with a CI")
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
    c.set_defaults(func=_cmd_compare)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
