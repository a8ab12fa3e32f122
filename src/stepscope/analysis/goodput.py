"""Goodput: how much of the GPU time a job held went into productive steps, and where the rest went.

Every rank holds one device for as long as it runs, so a rank's wall time is device time,
reported in GPU-hours. Each recorded step of each rank is split into::

    stragglers     waiting in collectives for a later rank (the wait rule, common/waits.py)
    exposed_comm   the rest of the time in collectives (the transfer itself, on the step's path)
    input_stalls   exposed ``dataloader`` time (top level) plus every ``h2d`` phase
    host_overhead  the step's residual: time inside the step that no phase accounts for
    warmup         on the warm-up steps the report names, the excess over the rank's median step
    productive     what is left: forward, backward, optimizer and user phases doing work

and the time between steps goes to::

    outside_steps  gaps between one step's end and the next step's start on the same rank
                   (evaluation, checkpointing, logging; time not spent in training steps)
    restarts       per rank, the gap between the end of one run segment and the start of the
                   next (a relaunch: a new run id, or the step index going back), plus the
                   steps re-done after resuming from an earlier checkpoint

Runs are segments of one rank's records in start-time order; a run directory is one job, so
segments with the same or different run ids are runs of that job. With ``every_n_steps`` > 1
an unrecorded step between two recorded ones is estimated as the recorded one before it (its
time split the same way), and only the rest of the gap is ``outside_steps``.

Figures are per run (``runs``), per UTC day of the step start (``days``) and for the whole
directory. A category measures time, not cause: the straggler's own slow work is in its
``productive`` or ``input_stalls``; what the job lost to it is the others' wait.
"""

from __future__ import annotations

import datetime as _dt
from collections import defaultdict
from pathlib import Path
from typing import Any

from stepscope.analysis.load import MAX_MS, MAX_START_NS
from stepscope.analysis.resources import TIMED_FILTER
from stepscope.common import robust

#: Loss categories, in report order.
CATEGORIES: tuple[str, ...] = (
    "stragglers", "exposed_comm", "input_stalls", "host_overhead", "warmup", "outside_steps",
    "restarts",
)
MS_PER_HOUR = 3_600_000.0
#: Step-index gaps above this are not treated as sampling (an unrecorded stretch is gap time).
MAX_SAMPLING_GAP = 1000


def _light_rows(con: Any, run_dir: Path) -> list[tuple[int, str, int, int, float]]:
    """(rank, run_id, step, start_unix_ns, step_ms) of every timed record, duplicates included."""
    import tempfile

    from stepscope.analysis.load import MAX_LINE_BYTES, drop_long_lines, rank_files

    if con.execute("SELECT count(*) FROM information_schema.tables "
                   "WHERE table_name = 'light'").fetchone()[0]:
        return _rows(con, "light")  # kept by load_run from the lines it read
    if not run_dir.is_dir():
        return []  # a Parquet store elsewhere (a glob, a URL): no rank files to re-read
    # The files the analysis read (inside the run, no links out), with its line cap: a
    # larger maximum_object_size makes DuckDB allocate buffers of twice that per thread.
    files = sorted(p for p in rank_files(run_dir)[0] if p.suffix == ".jsonl")
    if not files:
        return []
    # Records are KBs: a 1 MiB object cap keeps DuckDB's read buffers small (it allocates
    # twice the cap per thread); a larger record retries with the analysis' own line cap.
    for cap in (1 << 20, MAX_LINE_BYTES):
        try:
            return _read_light(con, files, cap)
        except Exception as exc:
            if "maximum_object_size" not in str(exc):
                raise
    # A line over the cap (the analysis skipped it too): read copies without such lines.
    with tempfile.TemporaryDirectory(prefix="stepscope-") as tmp:
        kept = [drop_long_lines(p, Path(tmp), [])[0] for p in files]
        return _read_light(con, kept, MAX_LINE_BYTES)


def _read_light(con: Any, files: list[Path], max_line: int) -> list[tuple[int, str, int, int, float]]:
    lst = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in files) + "]"
    cols = ("{rank: 'BIGINT', run_id: 'VARCHAR', step: 'BIGINT', start_unix_ns: 'BIGINT', "
            "step_ms: 'DOUBLE', untimed: 'BOOLEAN'}")
    return _rows(con, f"""(SELECT rank, coalesce(run_id, '') AS run_id, step, start_unix_ns, step_ms
        FROM read_json({lst}, format='newline_delimited', columns={cols}, ignore_errors=true,
                       maximum_object_size={max_line + 2})
        WHERE rank IS NOT NULL AND step IS NOT NULL AND start_unix_ns IS NOT NULL
          AND step_ms IS NOT NULL AND isfinite(step_ms) AND step_ms >= 0 AND {TIMED_FILTER}
          AND start_unix_ns >= 0 AND start_unix_ns < {MAX_START_NS} AND step_ms <= {MAX_MS})""")


def _rows(con: Any, source: str) -> list[tuple[int, str, int, int, float]]:
    rows = con.execute(
        f"""SELECT rank, run_id, step, start_unix_ns, step_ms FROM {source}
            -- only what the analysis kept (plausible, timed), re-done duplicates included
            WHERE (rank, step) IN (SELECT (rank, step) FROM steps)
            ORDER BY rank, start_unix_ns, step"""
    ).fetchall()
    return [(int(r), str(i), int(s), int(t), float(m)) for r, i, s, t, m in rows]


def _split(con: Any) -> dict[tuple[int, int], tuple[float, float, float, float]]:
    """Per (rank, step) of the analysed records: (stragglers, exposed_comm, input, host) ms."""
    has_cw = bool(con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'cw'").fetchone()[0])
    comm = ("SELECT rank, step, sum(greatest(ms - wait, 0.0)) AS comm FROM cw GROUP BY 1, 2"
            if has_cw else "SELECT rank, step, 0.0 AS comm FROM steps WHERE false")
    has_wait = bool(con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'wait'").fetchone()[0])
    wait = ("SELECT rank, step, wait_ms FROM wait" if has_wait
            else "SELECT rank, step, 0.0 AS wait_ms FROM steps WHERE false")
    rows = con.execute(
        f"""WITH i AS (SELECT rank, step, sum(ms) AS input FROM phases
                      WHERE (parent IS NULL AND name = 'dataloader') OR name = 'h2d' GROUP BY 1, 2)
            SELECT s.rank, s.step, coalesce(w.wait_ms, 0.0), coalesce(c.comm, 0.0),
                   coalesce(i.input, 0.0), greatest(s.residual_ms, 0.0)
            FROM steps s LEFT JOIN ({wait}) w USING (rank, step)
                 LEFT JOIN ({comm}) c USING (rank, step) LEFT JOIN i USING (rank, step)"""
    ).fetchall()
    return {(int(r), int(s)): (float(w), float(c), float(i), float(h)) for r, s, w, c, i, h in rows}


def _empty() -> dict[str, float]:
    return {"total": 0.0, "productive": 0.0, **{k: 0.0 for k in CATEGORIES}}


def _day(ns: int) -> str:
    return _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc).strftime("%Y-%m-%d")


def compute_goodput(con: Any, run_dir: str | Path, warmup: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report's ``goodput`` section from a loaded run (after attribution built ``wait``/``cw``).

    ``None`` when there is no record to account for.
    """
    root = Path(run_dir)
    split = _split(con)
    rows = _light_rows(con, root)
    if not rows:  # SQLite-only run: the analysed steps, without restarts or days
        rows = [(int(r), "", int(s), int(t0 * 1e6), float(ms)) for r, s, t0, ms in con.execute(
            "SELECT rank, step, t0, step_ms FROM steps ORDER BY rank, t0, step").fetchall()]
        dated = False
    else:
        dated = True
    if not rows:
        return None
    w_first, w_last = ((int(warmup["start_step"]), int(warmup["end_step"]))
                       if warmup and "start_step" in warmup else (1, 0))
    # Each rank's typical step outside the warm-up: the warm-up loss is the excess over it.
    by_rank: dict[int, list[float]] = defaultdict(list)
    for rank, _, step, _, ms in rows:
        if not w_first <= step <= w_last:
            by_rank[rank].append(ms)
    typical = {r: robust.median(v) for r, v in by_rank.items()}

    totals = _empty()
    runs: dict[tuple[int, str], dict[str, Any]] = {}  # keyed by (segment ordinal, run id)
    days: dict[str, dict[str, float]] = defaultdict(_empty)
    ranks_per_run: dict[tuple[int, str], set[int]] = defaultdict(set)

    def add(bucket_run: dict[str, Any], day: str, cat: str, ms: float) -> None:
        if ms <= 0.0:
            return
        for d in (totals, bucket_run["ms"], days[day]):
            d[cat] += ms
            d["total"] += ms

    i = 0
    while i < len(rows):
        rank = rows[i][0]
        j = i
        while j < len(rows) and rows[j][0] == rank:
            j += 1
        seg = 0
        seen_max = -1
        prev: tuple[int, str, int, int, float] | None = None
        prev_run: dict[str, Any] = {}
        prev_day = ""
        for k in range(i, j):
            cur = rows[k]
            _, run_id, step, start_ns, step_ms = cur
            new_seg = prev is not None and (run_id != prev[1] or step <= prev[2])
            if new_seg:
                seg += 1
            key = (seg, run_id)
            run = runs.setdefault(key, {"run_id": run_id or None, "start_ns": start_ns,
                                        "end_ns": start_ns, "ms": _empty()})
            ranks_per_run[key].add(rank)
            run["start_ns"] = min(run["start_ns"], start_ns)
            run["end_ns"] = max(run["end_ns"], start_ns + int(step_ms * 1e6))
            day = _day(start_ns) if dated else "undated"
            if prev is not None:
                prev_end = prev[3] + prev[4] * 1e6
                gap_ms = max(0.0, (start_ns - prev_end) / 1e6)
                if new_seg:
                    # The relaunch: from the last step of the old segment to this one's start.
                    add(run, day, "restarts", gap_ms)
                else:
                    missing = step - prev[2] - 1
                    est = 0.0
                    if 0 < missing <= MAX_SAMPLING_GAP:
                        est = min(gap_ms, missing * prev[4])
                        _step(add, prev_run, prev_day, prev[0], prev[2], est, prev[4], split,
                              typical, w_first, w_last)
                    add(run, day, "outside_steps", gap_ms - est)
            if step <= seen_max:
                add(run, day, "restarts", step_ms)  # re-done after resuming from a checkpoint
            else:
                _step(add, run, day, rank, step, step_ms, step_ms, split, typical, w_first, w_last)
            seen_max = max(seen_max, step)
            prev, prev_run, prev_day = cur, run, day
        i = j

    def finish(ms: dict[str, float]) -> dict[str, Any]:
        total = ms["total"]
        return {
            "gpu_hours": _h(total),
            "productive_gpu_hours": _h(ms["productive"]),
            "goodput": round(ms["productive"] / total, 4) if total > 0 else None,
            "lost_gpu_hours": {k: _h(ms[k]) for k in CATEGORIES},
        }

    run_list = []
    for key in sorted(runs, key=lambda k: (runs[k]["start_ns"], k)):
        r = runs[key]
        run_list.append({
            "run_id": r["run_id"],
            "segment": key[0],
            "ranks": len(ranks_per_run[key]),
            "start_unix": round(r["start_ns"] / 1e9, 3) if dated else None,
            "end_unix": round(r["end_ns"] / 1e9, 3) if dated else None,
            **finish(r["ms"]),
        })
    return {
        "unit": "GPU-hours (one device per rank)",
        **finish(totals),
        "categories": list(CATEGORIES),
        "runs": run_list,
        "days": [{"day": d, **finish(days[d])} for d in sorted(days)],
        "warmup_steps": [w_first, w_last] if w_first <= w_last else None,
    }


def _step(add: Any, run: dict[str, Any], day: str, rank: int, step: int, ms: float, ref_ms: float,
          split: dict[tuple[int, int], tuple[float, float, float, float]],
          typical: dict[int, float], w_first: int, w_last: int) -> None:
    """Split ``ms`` of device time like the recorded (rank, step) of ``ref_ms`` is split.

    ``ms == ref_ms`` for a recorded step; less or more for unrecorded steps estimated from it.
    """
    if ms <= 0.0 or ref_ms <= 0.0:
        return
    warm = 0.0
    if w_first <= step <= w_last and rank in typical:
        warm = max(0.0, ref_ms - typical[rank])
    vals: dict[str, float] = {}
    parts = split.get((rank, step))
    if parts is not None:
        known = sum(parts)
        body = ref_ms - warm
        # The parts cannot exceed the step; on warm-up steps they share what the excess leaves.
        scale = min(1.0, body / known) if known > 0 else 1.0
        if warm > 0:
            scale = min(scale, body / ref_ms)
        vals = dict(zip(("stragglers", "exposed_comm", "input_stalls", "host_overhead"),
                        (p * scale for p in parts), strict=True))
    vals["warmup"] = warm
    vals["productive"] = max(0.0, ref_ms - sum(vals.values()))
    f = ms / ref_ms
    for cat, v in vals.items():
        add(run, day, cat, v * f)


def _h(ms: float) -> float:
    return float(f"{ms / MS_PER_HOUR:.6g}")
