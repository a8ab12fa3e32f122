"""The ``stepscope`` command line: one module per command, each wiring analysis -> report.

Every ``cli/<command>_cmd.py`` exposes ``add_parser(subparsers)`` (its arguments, with
``func`` set to its ``run``) and ``run(args) -> int`` (the exit code). The command modules
import the analysis, DuckDB and rich only when they run, so ``stepscope --help`` stays fast
and the recording side never pulls them in.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from stepscope.cli import (
    compact_cmd,
    compare_cmd,
    demo_cmd,
    export_cmd,
    report_cmd,
    status_cmd,
    trace_cmd,
)
from stepscope.cli.options import Parser

#: The commands, in the order ``stepscope --help`` lists them.
COMMANDS = (demo_cmd, report_cmd, compact_cmd, export_cmd, trace_cmd, status_cmd, compare_cmd)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="stepscope", description="Why is my PyTorch training step slow?")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    return rc
