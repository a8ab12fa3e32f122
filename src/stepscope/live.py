"""Rolling per-rank summary of the most recent records (``stepscope.summary()``)."""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepscope.tracer import Tracer

WINDOW = 100


class RecentRecords:
    """Keeps the last ``WINDOW`` resolved records of one tracer (fed at flush cadence)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.records: deque[dict[str, Any]] = deque(maxlen=window)

    def __call__(self, record: dict[str, Any]) -> None:
        self.records.append(record)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step and phase times (ms) and shares of step time over ``records``."""
    if not records:
        return {"steps": 0}
    step_med = median(r["step_ms"] for r in records)
    by_phase: dict[str, list[float]] = {}
    for r in records:
        for p in r["phases"]:
            if p.get("parent") is None:
                by_phase.setdefault(p["name"], []).append(p["ms"])
        by_phase.setdefault("residual", []).append(r.get("residual_ms", 0.0))
    phases = {
        name: {"median_ms": median(v), "share": (sum(v) / len(records)) / step_med if step_med else 0.0}
        for name, v in by_phase.items()
    }
    return {
        "rank": records[-1]["rank"],
        "steps": len(records),
        "last_step": records[-1]["step"],
        "step_ms_median": step_med,
        "step_ms_max": max(r["step_ms"] for r in records),
        "phases": phases,
    }


def local_summary(tracer: Tracer) -> dict[str, Any]:
    recent = getattr(tracer, "_recent", None)
    if recent is None:
        return {"steps": 0}
    return summarize(list(recent.records))
