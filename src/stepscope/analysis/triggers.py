"""Auto-profile captures of a run: triggers.jsonl read back, linked to windows and summarised."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRIGGERS_FILE = "triggers.jsonl"
#: Steps of slack when matching a capture to a slow window (captures start after detection).
WINDOW_SLACK = 10


def load_triggers(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Triggers recorded by ``auto_profile`` (empty when none), plus what was skipped."""
    path = Path(run_dir) / TRIGGERS_FILE
    if not path.exists():
        return [], []
    out: list[dict[str, Any]] = []
    skipped: list[str] = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            t = json.loads(line)
            if not isinstance(t, dict) or "trigger_step" not in t or "rank" not in t:
                raise ValueError("not a trigger")
        except ValueError:
            skipped.append(f"{path.name}: line {n} is not a trigger record")
            continue
        out.append(t)
    return out, skipped


def summarize_trace(path: Path) -> dict[str, Any]:
    """A one-line view of a captured trace, from the streaming trace analyser."""
    from stepscope.analysis.trace import analyse_parsed, parse_trace

    try:
        result = analyse_parsed(parse_trace(path))
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
            path = root / trace
            if path.exists():
                t["trace_summary"] = summarize_trace(path)
            else:
                skipped.append(f"{TRIGGERS_FILE}: trace {trace} is missing")
    for w in windows:
        w["captures"] = [
            i for i, t in enumerate(triggers)
            if w["start_step"] - WINDOW_SLACK <= int(t["trigger_step"]) <= w["end_step"] + WINDOW_SLACK
        ]
    return triggers, skipped
