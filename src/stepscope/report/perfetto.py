"""``stepscope export --perfetto``: every rank as a process, phases as slices, one time base."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from stepscope.common.errors import AnalysisError
from stepscope.common.escape import finite, shown, term

_BATCH = 50_000


def write_perfetto(doc: dict[str, Any], data: Any, path: str) -> int:
    """Stream a Chrome trace-event JSON to ``path``; returns the number of slices written.

    Times are microseconds on the aligned timeline (per-host clock offsets removed), so
    one step's slices line up across ranks. Each rank is a process (pid = rank) with one
    thread holding its step slices and the phases nested inside them.
    """
    con = data.con
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
        # Steps first, then phases, each in time order: parents precede children on a track.
        cur = con.execute(
            """SELECT rank, step, t, step_ms, NULL AS name, NULL AS parent, 0 AS depth FROM aligned_steps
               UNION ALL
               SELECT p.rank, p.step, s.t + p.s, p.e - p.s, p.name, p.parent,
                      CASE WHEN p.parent IS NULL THEN 1 ELSE 2 END
               FROM phases p JOIN aligned_steps s USING (rank, step)
               ORDER BY rank, 3, depth"""
        )
        while rows := cur.fetchmany(_BATCH):
            for rank, step, t, dur, name, parent, _ in rows:
                ev: dict[str, Any] = {
                    "ph": "X", "pid": int(rank), "tid": 0, "ts": round(t * 1000.0, 3),
                    "dur": round(max(dur, 0.0) * 1000.0, 3),
                    "name": f"step {step}" if name is None else name,
                    "cat": "step" if name is None else "phase",
                    "args": {"step": int(step)} | ({"parent": parent} if parent else {}),
                }
                emit(ev)
                n += 1
        for w in doc["windows"]:
            emit({"ph": "i", "s": "g", "name": f"slow window {w['start_step']}–{w['end_step']}: "
                  f"{w['phase']} {w['slowdown']}×", "pid": 0, "tid": 0,
                  "ts": _step_ts(con, w["start_step"])})
        fh.write("\n]}\n")
    return n


def _step_ts(con: Any, step: int) -> float:
    row = con.execute(f"SELECT min(t) FROM aligned_steps WHERE step >= {int(step)}").fetchone()
    return round(float(row[0] or 0.0) * 1000.0, 3)


def export_command(run_dir: str, perfetto: str) -> int:
    """Run ``stepscope export --perfetto FILE``; returns the exit code (0 ok, 2 bad input)."""
    from stepscope.report.render import load_document

    try:
        doc = load_document(run_dir, keep=True)
    except AnalysisError as exc:
        print(f"stepscope export: {term(exc)}", file=sys.stderr)
        return 2
    data = doc["_data"]
    try:
        Path(perfetto).parent.mkdir(parents=True, exist_ok=True)
        n = write_perfetto(doc, data, perfetto)
    except OSError as exc:
        print(f"stepscope export: cannot write {term(perfetto)} ({term(exc)})", file=sys.stderr)
        return 2
    finally:
        data.close()
    for s in doc["run"]["skipped"]:
        print(f"stepscope export: skipped: {term(s)}", file=sys.stderr)
    print(f"wrote {term(perfetto)}: {doc['run']['ranks']} ranks, {n} slices "
          "(open in https://ui.perfetto.dev)")
    return 0
