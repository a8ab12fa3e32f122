"""``stepscope demo``: train a small model on CPU over gloo ranks, one slow, and report it.

The demo (and torch) is imported when the command runs, so building the parser stays light.
"""

from __future__ import annotations

import argparse

from stepscope.cli.options import Subparsers


def add_parser(subparsers: Subparsers) -> None:
    d = subparsers.add_parser(
        "demo", help="train a small model on CPU over gloo ranks and report it")
    d.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    d.add_argument("--ranks", type=int, default=4, help="number of ranks (default: 4)")
    d.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    d.add_argument("--slow-rank", type=int, default=1, help="rank made slow on purpose")
    d.add_argument(
        "--no-fixed", action="store_true",
        help="skip the second run (slow rank fixed, in OUT-fixed) and its `stepscope compare`",
    )
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stepscope.demo import run_demo

    return run_demo(
        out_dir=args.out, ranks=args.ranks, steps=args.steps, slow_rank=args.slow_rank,
        fixed=not args.no_fixed,
    )
