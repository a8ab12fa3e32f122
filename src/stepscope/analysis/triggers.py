"""Auto-profile captures of a run: triggers.jsonl read back, linked to windows and summarised.

The paths in triggers.jsonl come from the run directory's own files, which may have been
edited, truncated or planted. A path is only read when it resolves inside the run directory,
names a regular file (never a FIFO or device: opening one can block forever) and is not
larger than a bound; anything else is skipped with the reason in the report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stepscope.analysis.trace import analyze_parsed, parse_trace
from stepscope.common.safefs import run_file
from stepscope.recording.schema import TRIGGERS_FILE

#: Steps of slack when matching a capture to a slow window (captures start after detection).
WINDOW_SLACK = 10
#: Largest triggers.jsonl read (a real one holds a few lines per capture).
MAX_TRIGGERS_BYTES = 16 << 20
#: Largest captured trace file summarised (on disk, usually gzipped).
MAX_TRACE_BYTES = 2 << 30
_MAX_STEP = 1 << 62


def _plain_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= _MAX_STEP


def load_triggers(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Triggers recorded by ``auto_profile`` (empty when none), plus what was skipped."""
    root = Path(run_dir)
    if not os.path.lexists(root / TRIGGERS_FILE):
        return [], []
    path, why = run_file(root, TRIGGERS_FILE, MAX_TRIGGERS_BYTES)
    if path is None:
        return [], [f"{TRIGGERS_FILE} {why}"]
    out: list[dict[str, Any]] = []
    skipped: list[str] = []
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_TRIGGERS_BYTES + 1)
    except OSError as exc:
        return [], [f"{TRIGGERS_FILE}: unreadable ({exc.strerror})"]
    for n, line in enumerate(data[:MAX_TRIGGERS_BYTES].splitlines(), 1):
        if not line.strip():
            continue
        try:
            t = json.loads(line)
        except ValueError:
            skipped.append(f"{TRIGGERS_FILE}: line {n} is not a trigger record")
            continue
        if not isinstance(t, dict) or not _plain_int(t.get("trigger_step")) or not _plain_int(t.get("rank")):
            skipped.append(f"{TRIGGERS_FILE}: line {n} is not a trigger record "
                           "(trigger_step and rank must be integers)")
            continue
        if t.get("trace") is not None and not isinstance(t["trace"], str):
            skipped.append(f"{TRIGGERS_FILE}: line {n}: trace is not a file name; skipped")
            continue
        out.append(t)
    return out, skipped


def summarize_trace(path: Path) -> dict[str, Any]:
    """A one-line view of a captured trace, from the streaming trace analyser."""

    try:
        result = analyze_parsed(parse_trace(path))
    except Exception as exc:  # a broken capture must not break the run report
        return {"error": f"{type(exc).__name__}: {exc}"}
    summary: dict[str, Any] = {"platform": result.platform, "warnings": result.warnings[:3]}
    total = result.total
    if total is not None and total.wall_us > 0:
        summary.update(
            gpu_busy_pct=round(100.0 * total.busy_us / total.wall_us, 1),
            compute_pct=round(100.0 * total.compute_us / total.wall_us, 1),
            exposed_comm_pct=round(100.0 * total.exposed_comm_us / total.wall_us, 1),
            idle_pct=round(100.0 * total.idle_us / total.wall_us, 1),
            top_kernels=[k.get("name") for k in result.top_kernels[:3]],
        )
    return summary


def link_triggers(
    run_dir: str | Path, windows: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Triggers with their trace summaries; each window gets the indexes of its captures."""
    root = Path(run_dir)
    triggers, skipped = load_triggers(root)
    for t in triggers:
        trace = t.get("trace")
        t["trace_summary"] = None
        if trace:
            path, why = run_file(root, trace, MAX_TRACE_BYTES)
            if path is not None:
                t["trace_summary"] = summarize_trace(path)
            else:
                skipped.append(f"{TRIGGERS_FILE}: trace {str(trace)[:200]!r} {why}")
    for w in windows:
        w["captures"] = [
            i for i, t in enumerate(triggers)
            if w["start_step"] - WINDOW_SLACK <= int(t["trigger_step"]) <= w["end_step"] + WINDOW_SLACK
        ]
    return triggers, skipped
