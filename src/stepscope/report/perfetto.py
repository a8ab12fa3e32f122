"""The Perfetto (Chrome trace-event JSON) rendering: every rank a process, phases as slices,
one time base."""

from __future__ import annotations

import json
from typing import Any

from stepscope.common.escape import finite, shown
from stepscope.common.figures import Timeline


def write_perfetto(doc: dict[str, Any], timeline: Timeline, path: str) -> int:
    """Stream a Chrome trace-event JSON to ``path``; returns the number of slices written.

    Times are microseconds on the aligned timeline (per-host clock offsets removed), so
    one step's slices line up across ranks. Each rank is a process (pid = rank) with one
    thread holding its step slices and the phases nested inside them.
    """
    host_of = {r: h for h, rs in doc["run"]["hosts"].items() for r in rs}
    slow = {s["rank"]: s for s in doc["stragglers"]}
    n = 0
    with open(path, "w") as fh:
        fh.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        first = True

        def emit(ev: dict[str, Any]) -> None:
            nonlocal first
            ev = shown(ev)  # names from the run: control and format characters written out
            try:
                text = json.dumps(ev, separators=(",", ":"), allow_nan=False)
            except ValueError:  # NaN/inf from a bad record: null keeps the file valid JSON
                text = json.dumps(finite(ev), separators=(",", ":"), allow_nan=False)
            fh.write(("" if first else ",\n") + text)
            first = False

        for rank in doc["run"]["rank_ids"]:
            label = f"rank {rank} ({host_of.get(rank, '?')})"
            if rank in slow:
                label += f" — straggler: {slow[rank]['phase']}"
            emit({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}})
            emit({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                  "args": {"sort_index": rank}})
            emit({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "steps"}})
        for rank, step, t, dur, name, parent in timeline.slices:
            ev: dict[str, Any] = {
                "ph": "X", "pid": int(rank), "tid": 0, "ts": round(t * 1000.0, 3),
                "dur": round(max(dur, 0.0) * 1000.0, 3),
                "name": f"step {step}" if name is None else name,
                "cat": "step" if name is None else "phase",
                "args": {"step": int(step)} | ({"parent": parent} if parent else {}),
            }
            emit(ev)
            n += 1
        for w, start_ms in zip(doc["windows"], timeline.window_start_ms, strict=True):
            emit({"ph": "i", "s": "g", "name": f"slow window {w['start_step']}–{w['end_step']}: "
                  f"{w['phase']} {w['slowdown']}×", "pid": 0, "tid": 0,
                  "ts": round(start_ms * 1000.0, 3)})
        fh.write("\n]}\n")
    return n
