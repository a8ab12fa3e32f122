"""The ``stepscope trace`` command: analyse Kineto traces and print, dump or write the result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stepscope.errors import AnalysisError


def trace_command(path: str, as_json: bool = False, markdown: str | None = None) -> int:
    """Analyse `path` (a trace file or a directory of per-rank traces).

    Returns 0 on success, 2 when the input cannot be analysed at all (message on stderr).
    """
    from stepscope.analysis.trace import analyse
    from stepscope.report.progress import input_bytes, progress

    try:
        with progress(input_bytes(path) or None, "stepscope trace: reading", unit="bytes",
                      track_reads=True, done_desc="stepscope trace: analysing"):
            doc = analyse(path).to_dict()
    except AnalysisError as e:
        print(f"stepscope trace: {e}", file=sys.stderr)
        return 2
    if all(r["events_seen"] == 0 for r in doc["ranks"]):
        reasons = "; ".join(w for r in doc["ranks"] for w in r["warnings"])
        print(f"stepscope trace: no trace events could be read from {path}: {reasons}",
              file=sys.stderr)
        return 2
    if markdown:
        from stepscope.report.trace_markdown import render_markdown

        try:
            Path(markdown).write_text(render_markdown(doc), encoding="utf-8")
        except OSError as e:
            print(f"stepscope trace: cannot write {markdown}: {e}", file=sys.stderr)
            return 2
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        from stepscope.report.trace_terminal import render_trace_terminal

        render_trace_terminal(doc)
    return 0

