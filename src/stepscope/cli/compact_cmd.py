"""``stepscope compact``: bring a run's Parquet store up to date and say so.

DuckDB and the store are imported when the command runs, so building the parser stays light.
"""

from __future__ import annotations

import argparse
import sys

from stepscope.cli.options import Subparsers, add_duckdb_options
from stepscope.common.errors import AnalysisError
from stepscope.common.escape import term


def add_parser(subparsers: Subparsers) -> None:
    k = subparsers.add_parser("compact",
                              help="copy a run's new JSONL lines into its Parquet store")
    k.add_argument("run_dir")
    k.add_argument("--json", action="store_true", help="print what was done as JSON")
    add_duckdb_options(k)
    k.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return compact_command(args.run_dir, as_json=args.json, threads=args.threads,
                           memory_limit=args.memory_limit)


def compact_command(run_dir: str, as_json: bool = False, threads: int | None = None,
                    memory_limit: str | None = None) -> int:
    """Returns 0 on success, 2 when the run cannot be compacted (message on stderr)."""
    from pathlib import Path

    import duckdb

    from stepscope.analysis.store import compact

    root = Path(run_dir)
    try:
        if not root.is_dir():
            raise AnalysisError(f"{root}: no such run directory" if not root.exists()
                                else f"{root}: not a directory")
        res = compact(root, threads=threads, memory_limit=memory_limit)
    except (AnalysisError, OSError, duckdb.Error) as exc:
        print(f"stepscope compact: {term(exc)}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"stepscope compact: {term(root)}: out of memory compacting the run", file=sys.stderr)
        return 2
    if as_json:
        from stepscope.common.escape import write_json

        write_json({"store": str(res.store), "new_bytes": res.new_bytes,
                    "new_files": res.new_files, "rebuilt": res.rebuilt,
                    "files": {n: {"offset": f.offset, "torn_tail": f.torn,
                                  "dropped_long_lines": f.dropped}
                              for n, f in sorted(res.files.items())}}, sys.stdout)
        print()
    else:
        what = "rebuilt" if res.rebuilt else "updated"
        print(f"{term(res.store)}: {what}; {res.new_bytes:,} new bytes from {res.new_files} rank "
              f"file(s) ({len(res.files)} tracked)")
    return 0
