"""What every command shares on its command line: the one-line error parser, DuckDB options."""

from __future__ import annotations

import argparse
import re
from typing import NoReturn, TypeAlias

#: Most DuckDB threads a command accepts (DuckDB starts every one it is given).
MAX_THREADS = 1024


class Parser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads; got {text!r}") from None
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_THREADS} threads; got {n}")
    return n


def memory_limit(text: str) -> str:
    """A DuckDB memory size (``2GB``, ``512MiB``): checked here, as it goes into SQL."""
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*([KMGT]i?B|B|bytes)?\s*", text, re.IGNORECASE):
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB or 512MiB; got {text!r}")
    return text.strip()


def add_duckdb_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=threads, default=None, metavar="N",
                   help="DuckDB threads (default: all cores)")
    p.add_argument("--memory-limit", type=memory_limit, default=None, metavar="SIZE",
                   help="DuckDB memory limit, e.g. 2GB (it spills to disk beyond it)")


#: What ``build_parser`` hands each command's ``add_parser``.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
