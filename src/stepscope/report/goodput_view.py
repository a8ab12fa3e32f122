"""The goodput part of the terminal report: productive vs lost device time (``doc["goodput"]``),
in GPU-hours on a CUDA clock and CPU-hours (one process per rank) on a CPU clock."""

from __future__ import annotations

from typing import Any

from stepscope.common.escape import md, one_line
from stepscope.common.escape import rich as esc

_LABELS = {
    "stragglers": "waiting for stragglers",
    "exposed_comm": "exposed communication",
    "input_stalls": "input stalls (dataloader, h2d)",
    "host_overhead": "host overhead (step residual)",
    "warmup": "warm-up",
    "outside_steps": "outside steps (eval, checkpoint, gaps)",
    "restarts": "restarts (relaunch gaps, re-done steps)",
}


def _device(doc: dict[str, Any]) -> str:
    """What a rank holds, by the run's clock: a GPU on a CUDA clock, else a CPU process."""
    return "GPU" if str((doc.get("run") or {}).get("clock") or "").startswith("cuda") else "CPU"


def _hours(h: float, dev: str = "GPU") -> str:
    if h >= 1.0:
        return f"{h:,.2f} {dev}-h"
    s = h * 3600.0
    return f"{s:,.1f} {dev}-s" if s >= 0.1 else f"{s * 1000:,.1f} {dev}-ms"


def render_terminal(doc: dict[str, Any], con: Any) -> None:
    """Print the goodput headline and the lost time by category; nothing without a section."""
    gp = doc.get("goodput")
    if not gp or not gp.get("gpu_hours"):
        return
    share, dev = gp["goodput"], _device(doc)
    con.print(f"\n[bold]Goodput[/] {share:.1%} — {_hours(gp['productive_gpu_hours'], dev)} productive "
              f"of {_hours(gp['gpu_hours'], dev)}")
    total = gp["gpu_hours"]
    for cat, h in sorted(gp["lost_gpu_hours"].items(), key=lambda kv: -kv[1]):
        if h <= 0 or h / total < 0.0005:  # under 0.05%: noise, not a loss worth a line
            continue
        con.print(f"  lost to {esc(_LABELS.get(cat, one_line(cat)))}: {_hours(h, dev)} ({h / total:.1%})")
    if len(gp["runs"]) > 1 or len(gp["days"]) > 1:
        con.print(f"  [dim]{len(gp['runs'])} run segment(s) over {len(gp['days'])} day(s); "
                  "per run and per day in --json (goodput.runs, goodput.days)[/]")


def markdown_lines(doc: dict[str, Any]) -> list[str]:
    """The goodput table of the markdown report; no lines without a section."""
    gp = doc.get("goodput")
    if not gp or not gp.get("gpu_hours"):
        return []
    total, dev = gp["gpu_hours"], _device(doc)
    lines = ["## Goodput", "",
             f"{gp['goodput']:.1%} of {_hours(total, dev)} productive "
             f"({_hours(gp['productive_gpu_hours'], dev)}).",
             "", f"| lost to | {dev} time | share |", "|---|---:|---:|"]
    for cat, h in sorted(gp["lost_gpu_hours"].items(), key=lambda kv: -kv[1]):
        if h > 0:
            lines.append(f"| {md(_LABELS.get(cat, cat))} | {_hours(h, dev)} | {h / total:.1%} |")
    return [*lines, ""]
