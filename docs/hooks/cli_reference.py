"""mkdocs hook: writes the CLI reference page from `stepscope.cli.build_parser()`.

The page is generated at every build, so it always matches the parser.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

_SRC = Path(__file__).resolve().parents[2] / "src"


def render() -> str:
    """The CLI reference as markdown: the top-level help, then each command's help."""
    if str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; fix the width
    from stepscope.cli import build_parser

    parser = build_parser()
    out = [
        "# CLI reference",
        "",
        "Generated from the argument parser (`stepscope.cli.build_parser`) at every docs build.",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
    ]
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        out += ["", f"## `stepscope {name}`", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(out) + "\n"


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, "cli.md", content=render()))
    return files
