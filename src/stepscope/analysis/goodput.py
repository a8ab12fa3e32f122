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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stepscope.analysis import blocks
from stepscope.analysis.blocks import in_block
from stepscope.analysis.record_files import (
    MAX_LINE_BYTES,
    MAX_MS,
    MAX_START_NS,
    drop_long_lines,
    rank_files,
)
from stepscope.analysis.relations import exists, has_column
from stepscope.analysis.resource_use import TIMED_FILTER

#: Loss categories, in report order.
CATEGORIES: tuple[str, ...] = (
    "stragglers", "exposed_comm", "input_stalls", "host_overhead", "warmup", "outside_steps",
    "restarts",
)
MS_PER_HOUR = 3_600_000.0
#: Step-index gaps above this are not treated as sampling (an unrecorded stretch is gap time).
MAX_SAMPLING_GAP = 1000


#: Row columns of the accounting, in order: rank, run id code, step, start ns, step ms, and
#: the (rank, step)'s split (stragglers, exposed_comm, input, host) ms.
Rows = dict[str, np.ndarray[Any, Any]]
#: Rows accounted at once (whole ranks, one rank at least): each block's rows are joined
#: with their split and sorted by DuckDB as numpy reads them (its hash tables and sort hold
#: one block's keys, inside its memory limit), and numpy holds one block's columns and
#: per-row arrays (~250 bytes a row), not 10^7 records' (~1.3 GB at 10^8 phase samples).
#: 2^18 rather than 2^20: the joins' hash tables and the sort stay small enough for the
#: caches (2,000 ranks x 833 steps: the stage's CPU 4.5 -> 3.7 s, the same section).
BLOCK_ROWS = 1 << 18


@dataclass
class _Plan:
    """What the accounting reads: ``select`` gives a block of ranks' rows (columns of
    :data:`Rows`, plus those ``order`` names), accounted in ``order``; ``per_rank`` counts
    rows per rank (for the blocks); ``ids``: the run ids by code; ``drop``: the tables to
    drop after."""

    select: Callable[[tuple[int, int]], str]
    params: dict[str, Any]
    order: str
    per_rank: str
    ids: list[str]
    drop: tuple[str, ...] = ()


def _light_rows(con: Any, run_dir: Path) -> _Plan | None:
    """Every timed record (duplicates included) with its split: the plan reading them, or
    None without rank files."""
    import tempfile

    if exists(con, "timed_records"):
        return _rows(con, "timed_records")  # kept by load_run from the lines it read
    if not run_dir.is_dir():
        return None  # a Parquet store elsewhere (a glob, a URL): no rank files to re-read
    # The files the analysis read (inside the run, no links out), with its line cap: a
    # larger maximum_object_size makes DuckDB allocate buffers of twice that per thread.
    files = sorted(p for p in rank_files(run_dir)[0] if p.suffix == ".jsonl")
    if not files:
        return None
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


def _read_light(con: Any, files: list[Path], max_line: int) -> _Plan | None:
    lst = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in files) + "]"
    cols = ("{rank: 'BIGINT', run_id: 'VARCHAR', step: 'BIGINT', start_unix_ns: 'BIGINT', "
            "step_ms: 'DOUBLE', untimed: 'BOOLEAN'}")
    con.execute(f"""CREATE OR REPLACE TEMP TABLE timed_records_reread AS
        SELECT rank, coalesce(run_id, '') AS run_id, step, start_unix_ns, step_ms
        FROM read_json({lst}, format='newline_delimited', columns={cols}, ignore_errors=true,
                       maximum_object_size={max_line + 2})
        WHERE rank IS NOT NULL AND step IS NOT NULL AND start_unix_ns IS NOT NULL
          AND step_ms IS NOT NULL AND isfinite(step_ms) AND step_ms >= 0 AND {TIMED_FILTER}
          AND start_unix_ns >= 0 AND start_unix_ns < {MAX_START_NS} AND step_ms <= {MAX_MS}""")
    plan = _rows(con, "timed_records_reread")
    plan.drop = (*plan.drop, "timed_records_reread")
    return plan


def _rows(con: Any, source: str) -> _Plan:
    """The accounting's rows of ``source`` (each with its split) and the run ids by code.

    A record written twice (the same rank, run, step, start and duration) counts once. The
    order on each rank and run is the step index where every step index occurs once there
    (no step was done again): a wall clock stepped back (NTP) then moves no step and starts
    no segment. Where a step was done again (a relaunch resumed from a checkpoint) the
    order is the wall clock's, so that the relaunch shows as a segment of its own.
    """
    ids = [str(i) for (i,) in con.execute(f"SELECT DISTINCT run_id FROM {source} ORDER BY 1").fetchall()]
    split = _splitter(con)
    # Whether a rank and run steps by index is read from the block's own distinct rows (a
    # block holds whole ranks): one DISTINCT per block, not a second one over the whole run.
    return _Plan(lambda b: f"""WITH l AS MATERIALIZED (
                    SELECT DISTINCT rank, run_id, step, start_unix_ns, step_ms FROM {source}
                    WHERE {in_block('rank', b)}),
                o AS (SELECT rank, run_id, count(*) = count(DISTINCT step) AS by_step
                      FROM l GROUP BY 1, 2)
                SELECT l.rank, list_position($ids, l.run_id) - 1 AS rid, l.step,
                       l.start_unix_ns, l.step_ms, sp.w, sp.c, sp.i, sp.h,
                       CASE WHEN o.by_step THEN l.step ELSE l.start_unix_ns END AS k
                FROM l
                -- only what the analysis kept (plausible, timed), re-done steps included
                JOIN ({split('', b)}) sp USING (rank, step)
                JOIN o USING (rank, run_id)""", {"ids": ids},
                 _order("rank, rid, k, start_unix_ns, step"),
                 f"SELECT rank, count(*) FROM {source} GROUP BY 1 ORDER BY 1", ids)


def _order(order: str) -> str:
    """The accounting order: the columns ``order``, then (rows equal in them) the run id
    and step time. The split is one per (rank, step): rows equal in those are equal in
    every column (sorting by the split too took ~0.1 s more CPU per 10^6 rows)."""
    return f"{order}, rid, step_ms"


def _rank_blocks(con: Any, plan: _Plan) -> list[tuple[int, int]]:
    """Consecutive (first, last) rank ranges of the plan's rows, each of at most
    :data:`BLOCK_ROWS` rows (one rank at least): a rank's rows are accounted together."""
    return blocks.pack(con.execute(plan.per_rank).fetchall(), BLOCK_ROWS)


def _block_rows(con: Any, block: tuple[int, int], plan: _Plan) -> Rows:
    """A block of ranks' rows, in accounting order, as fixed-dtype columns (sorted as they
    are read: a row number over the whole run was two sorts of every record)."""
    return _typed(con.execute(
        f"""SELECT rank, rid, step, start_unix_ns, step_ms, w, c, i, h
            FROM ({plan.select(block)}) ORDER BY {plan.order}""", plan.params).fetchnumpy())


def _typed(cols: dict[str, Any]) -> Rows:
    ints = ("rank", "rid", "step", "start_unix_ns")
    return {k: np.asarray(v, dtype=np.int64 if k in ints else np.float64) for k, v in cols.items()}


def _split_sql(con: Any, extra: str = "", ranks: tuple[int, int] = blocks.WHOLE) -> str:
    """Per (rank, step) of the analysed records of the ranks ``ranks``: w (stragglers), c
    (exposed_comm), i (input), h (host) ms; ``extra``: more columns of ``steps s`` to select
    (a leading comma)."""
    return _splitter(con)(extra, ranks)


def _splitter(con: Any) -> Callable[[str, tuple[int, int]], str]:
    """:func:`_split_sql` for the tables there are now (looked up once, not per block)."""
    has_cw = exists(con, "collective_waits")
    has_wait = exists(con, "step_waits")
    # The waits' table took the same per-(rank, step) sum over collective_waits (collwaits.build_waits).
    wait_comm = has_wait and has_column(con, "step_waits", "comm_ms")
    # ... and each step's residual_ms: then step_waits alone holds every (rank, step) row.
    wait_all = wait_comm and has_column(con, "step_waits", "residual_ms")

    def split(extra: str, ranks: tuple[int, int]) -> str:
        # Each part filtered to the block's ranks: its scan skips other ranks' row groups
        # and its group-by and joins hold the block's keys.
        blk = in_block("rank", ranks)
        comm = (f"SELECT rank, step, sum(greatest(ms - wait, 0.0)) AS comm FROM collective_waits WHERE {blk} "
                "GROUP BY 1, 2" if has_cw else "SELECT rank, step, 0.0 AS comm FROM steps WHERE false")
        wait = (f"SELECT rank, step, wait_ms FROM step_waits WHERE {blk}" if has_wait
                else "SELECT rank, step, 0.0 AS wait_ms FROM steps WHERE false")
        if wait_comm:
            wait, comm_col, comm_join = (
                f"SELECT rank, step, wait_ms, comm_ms FROM step_waits WHERE {blk}", "w.comm_ms", "")
        else:
            comm_col, comm_join = "c.comm", f"LEFT JOIN ({comm}) c USING (rank, step)"
        inputs = f"""WITH i AS (SELECT rank, step, sum(ms) AS input FROM phases
                          WHERE ((parent IS NULL AND name = 'dataloader') OR name = 'h2d')
                            AND {blk} GROUP BY 1, 2)"""
        if wait_all and not extra:  # one row per steps row: no join to steps
            return f"""{inputs}
                SELECT w.rank, w.step, w.wait_ms AS w, w.comm_ms AS c,
                       CAST(coalesce(i.input, 0.0) AS DOUBLE) AS i,
                       CAST(greatest(w.residual_ms, 0.0) AS DOUBLE) AS h
                FROM step_waits w LEFT JOIN i USING (rank, step)
                WHERE {in_block('w.rank', ranks)}"""
        return f"""{inputs}
                SELECT s.rank, s.step, CAST(coalesce(w.wait_ms, 0.0) AS DOUBLE) AS w,
                       CAST(coalesce({comm_col}, 0.0) AS DOUBLE) AS c,
                       CAST(coalesce(i.input, 0.0) AS DOUBLE) AS i,
                       CAST(greatest(s.residual_ms, 0.0) AS DOUBLE) AS h{extra}
                FROM steps s LEFT JOIN ({wait}) w USING (rank, step)
                     {comm_join} LEFT JOIN i USING (rank, step)
                WHERE {in_block('s.rank', ranks)}"""
    return split


def _empty() -> dict[str, float]:
    return {"total": 0.0, "productive": 0.0, **{k: 0.0 for k in CATEGORIES}}


def _day(ns: int) -> str:
    return _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc).strftime("%Y-%m-%d")


def _days(start_ns: np.ndarray[Any, Any]) -> tuple[list[str], np.ndarray[Any, Any]]:
    """The sorted ``_day`` names of the starts and each start's index into them: by day
    number, and by ``_day`` itself within a second of midnight (where rounding to
    microseconds could move the date)."""
    t = start_ns.astype(np.float64) / 1e9
    num = np.floor(t / 86_400.0).astype(np.int64)
    into = t - num.astype(np.float64) * 86_400.0
    near = np.flatnonzero((into < 1.0) | (into > 86_399.0)).tolist()
    epoch = _dt.date(1970, 1, 1)
    nums, idx = np.unique(num, return_inverse=True)
    names = [(epoch + _dt.timedelta(days=int(d))).strftime("%Y-%m-%d") for d in nums.tolist()]
    if not near:
        return names, idx  # day numbers sort as their dates
    exact = {k: _day(int(start_ns[k])) for k in near}
    day_list = sorted(set(names) | set(exact.values()))
    pos = {d: i for i, d in enumerate(day_list)}
    idx = np.asarray([pos[d] for d in names], dtype=np.int64)[idx]
    for k, d in exact.items():
        idx[k] = pos[d]
    # A day only a near-midnight start named by number, then moved, has no start left.
    used = np.bincount(idx, minlength=len(day_list)) > 0
    if not used.all():
        keep = np.flatnonzero(used)
        day_list = [day_list[i] for i in keep.tolist()]
        idx = np.searchsorted(keep, idx)
    return day_list, idx


_CATS = (*CATEGORIES, "productive")
_C = {c: i for i, c in enumerate(_CATS)}
#: What a step's time splits into, in the order the accounting adds them.
_STEP_CATS = tuple(_C[c] for c in ("stragglers", "exposed_comm", "input_stalls", "host_overhead",
                                   "warmup", "productive"))


#: A step's remainder below this share of it is rounding, not productive time.
_ROUNDING = 1e-9

#: Records per chunk of the event accounting: its ~13 event slots stacked with their
#: categories and owners are ~300 bytes a record (2^20 records: ~300 MB on top of the
#: run's columns; 2^16: ~20 MB). On the 512 x 2,000 store the stage's peak RSS went from
#: 1,128 to 824 MB and its CPU from 2.1 to 1.5 s.
_CHUNK_ROWS = 1 << 16


def _seq_sum(acc: float, v: np.ndarray[Any, Any]) -> float:
    """``acc`` plus each value of ``v`` in turn (a running sum: the Python loop's rounding)."""
    if not len(v):
        return acc
    return float(np.cumsum(np.concatenate(([acc], v)))[-1])


def compute_goodput(con: Any, run_dir: str | Path, warmup: dict[str, Any] | None,
                    clock: str = "cpu") -> dict[str, Any] | None:
    """The report's ``goodput`` section from a loaded run (after attribution built ``step_waits``
    and ``collective_waits``).

    ``None`` when there is no record to account for.
    """
    root = Path(run_dir)
    plan = _light_rows(con, root)
    w_first, w_last = ((int(warmup["start_step"]), int(warmup["end_step"]))
                       if warmup and "start_step" in warmup else (1, 0))
    acc = _Accounts()
    dated = plan is not None and _account_all(con, plan, True, w_first, w_last, acc)
    if not dated:  # SQLite-only run: the analysed steps, without restarts or days
        # The split has one row per steps row: its own columns, not a second join to steps.
        split = _splitter(con)
        plan = _Plan(lambda b: f"""SELECT rank, 0 AS rid, step,
                         CAST(trunc(t0 * 1e6) AS BIGINT) AS start_unix_ns, step_ms, w, c, i, h, t0
                     FROM ({split(', s.t0, s.step_ms', b)})""", {}, _order("rank, t0, step"),
                     "SELECT rank, count(*) FROM steps GROUP BY 1 ORDER BY 1", [""])
        if not _account_all(con, plan, False, w_first, w_last, acc):
            return None
    assert plan is not None
    ids = plan.ids

    def finish(a: dict[str, float]) -> dict[str, Any]:
        total = a["total"]
        return {
            "gpu_hours": _h(total),
            "productive_gpu_hours": _h(a["productive"]),
            "goodput": round(a["productive"] / total, 4) if total > 0 else None,
            "lost_gpu_hours": {k: _h(a[k]) for k in CATEGORIES},
        }

    n_ids = len(ids)
    run_list = []
    for code in sorted(acc.runs, key=lambda c: (acc.run_start[c], c // n_ids, ids[c % n_ids])):
        run_list.append({
            "run_id": ids[code % n_ids] or None,
            "segment": code // n_ids,
            "ranks": acc.run_ranks[code],
            "start_unix": round(acc.run_start[code] / 1e9, 3) if dated else None,
            "end_unix": round(acc.run_end[code] / 1e9, 3) if dated else None,
            **finish(acc.runs[code]),
        })
    return {
        # What a rank holds follows its clock: a GPU on a CUDA clock, else a CPU process.
        "unit": ("GPU-hours (one device per rank)" if clock.startswith("cuda")
                 else "CPU-hours (one process per rank)"),
        **finish(acc.totals),
        "categories": list(CATEGORIES),
        "runs": run_list,
        "days": [{"day": d, **finish(acc.days[d])} for d in sorted(acc.days)],
        "warmup_steps": [w_first, w_last] if w_first <= w_last else None,
    }


def _account_all(con: Any, plan: _Plan, dated: bool, w_first: int, w_last: int,
                 acc: _Accounts) -> bool:
    """Account the plan's rows into ``acc``; whether there was any (``acc`` untouched if not)."""
    from concurrent.futures import ThreadPoolExecutor

    n = 0
    try:
        # Whole ranks a block at a time, blocks in rank order: each bucket's running sums
        # see the same values in the same order as with every row at once.
        # The next block is read (by DuckDB, which releases the GIL, on its own threads)
        # while numpy accounts this one: at 10^8 phase samples the stage's ~6 s of numpy
        # ran with the second core idle. One statement at a time on the connection still:
        # the main thread issues none while a read is under way.
        todo = _rank_blocks(con, plan)
        with ThreadPoolExecutor(max_workers=1) as pool:
            ahead = [pool.submit(_block_rows, con, b, plan) for b in todo[:1]]
            for k in range(len(todo)):
                rows = ahead.pop().result()
                if k + 1 < len(todo):
                    ahead.append(pool.submit(_block_rows, con, todo[k + 1], plan))
                if len(rows["rank"]):
                    n += len(rows["rank"])
                    _account(rows, len(plan.ids), dated, w_first, w_last, acc)
                del rows
    finally:
        for table in plan.drop:
            con.execute(f"DROP TABLE IF EXISTS {table}")
    return n > 0


class _Accounts:
    """The running sums of every bucket (the whole directory, each run, each day) and each
    run's first start, last end and rank count, filled a block of ranks at a time."""

    def __init__(self) -> None:
        self.totals = _empty()
        self.runs: dict[int, dict[str, float]] = {}  # by run code: segment * len(ids) + rid
        self.run_start: dict[int, int] = {}
        self.run_end: dict[int, int] = {}
        self.run_ranks: dict[int, int] = {}
        self.days: dict[str, dict[str, float]] = {}


def _account(rows: Rows, n_ids: int, dated: bool, w_first: int, w_last: int,
             acc: _Accounts) -> None:
    """Add whole ranks' rows (accounting order) to the running sums."""
    rank, rid, step = rows["rank"], rows["rid"], rows["step"]
    start, ms = rows["start_unix_ns"], rows["step_ms"]
    n = len(rank)
    # Each rank's typical step outside the warm-up: the warm-up loss is the excess over it.
    firsts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    ends = np.r_[firsts[1:], n]
    in_warm = (step >= w_first) & (step <= w_last)
    typical = np.full(n, np.nan)
    has_typ = np.zeros(n, dtype=bool)
    for a, b in zip(firsts.tolist(), ends.tolist(), strict=True):
        keep = ms[a:b][~in_warm[a:b]]
        if len(keep):
            typical[a:b] = float(np.median(keep))  # robust.median: same middle, same mean
            has_typ[a:b] = True

    # Segments: a new run id, or the step index going back, starts one (per rank).
    has_prev = np.r_[False, rank[1:] == rank[:-1]]
    prev = np.maximum(np.arange(n) - 1, 0)
    new_seg = has_prev & ((rid != rid[prev]) | (step <= step[prev]))
    cum = np.cumsum(new_seg)
    seg = cum - np.repeat(cum[firsts], ends - firsts)
    del cum  # per-record arrays go as soon as they are used: 10^7 records, 80 MB each
    # Steps re-done after resuming: at or under the highest step the rank reached before.
    BIG = np.int64(1) << np.int64(40)
    shifted = step + np.repeat(np.arange(len(firsts), dtype=np.int64), ends - firsts) * BIG
    seen = np.maximum.accumulate(shifted)
    redone = has_prev & (shifted <= seen[prev])
    del shifted, seen
    # Runs are (segment ordinal, run id); days are UTC dates of the step starts.
    code = seg * n_ids + rid
    codes, run_idx = np.unique(code, return_inverse=True)
    del code, seg
    day_list, day_idx = _days(start) if dated else (["undated"], np.zeros(n, dtype=np.int64))

    # The time between steps, on rows with a previous one on the same rank. A step that
    # starts inside the previous one (overlapping records) counts from that one's end: the
    # rank's time is counted once. One that starts before the previous one started (a
    # wall clock stepped back, in step order) has no gap and no overlap: its own duration
    # (the monotonic clock's) stands.
    prev_end = start[prev].astype(np.float64) + ms[prev] * 1e6
    gap = np.where(has_prev, np.maximum(0.0, (start.astype(np.float64) - prev_end) / 1e6), 0.0)
    # From the start difference in integer ns: float64 holds a 2026 timestamp to 256 ns only,
    # and the rounding must not read as overlap.
    inside = has_prev & ~new_seg & (start >= start[prev])
    since = (start - start[prev]).astype(np.float64) / 1e6
    overlap = np.where(inside, np.maximum(0.0, ms[prev] - since), 0.0)
    counted = np.maximum(0.0, ms - overlap)
    missing = step - step[prev] - 1
    sampled = has_prev & ~new_seg & (missing > 0) & (missing <= MAX_SAMPLING_GAP)
    est = np.where(sampled, np.minimum(gap, missing * ms[prev]), 0.0)
    del prev_end, missing

    # Events in the order the accounting adds them, per row: the relaunch gap, the estimate
    # of unrecorded steps (split like the previous row), the rest of the gap, then the step.
    def step_parts(at: np.ndarray[Any, Any], use: np.ndarray[Any, Any],
                   amount: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
        ref = ms[at]
        ok = use & (amount > 0.0) & (ref > 0.0)
        warm = np.where(in_warm[at] & has_typ[at], np.maximum(0.0, ref - typical[at]), 0.0)
        parts = [rows[c][at] for c in ("w", "c", "i", "h")]
        known = ((parts[0] + parts[1]) + parts[2]) + parts[3]
        body = ref - warm
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(known > 0, np.minimum(1.0, body / known), 1.0)
            scale = np.where(warm > 0, np.minimum(scale, body / ref), scale)
            f = amount / ref
        vals = [p * scale for p in parts]
        total = (((vals[0] + vals[1]) + vals[2]) + vals[3]) + warm
        # What the parts leave of the step; below a billionth of it, that is the rounding of
        # their sum (whose last bits vary with DuckDB's parallel summing order), not time.
        rest = ref - total
        vals += [warm, np.where(rest > _ROUNDING * ref, rest, 0.0)]
        return [np.where(ok, v * f, 0.0) for v in vals]

    totals = acc.totals
    run_ms = [acc.runs.setdefault(c, _empty()) for c in codes.tolist()]
    day_ms = [acc.days.setdefault(d, _empty()) for d in day_list]
    # Events a chunk of rows at a time, accumulated in row order: the running sums see the
    # same values in the same order as for all rows at once, without the events of every
    # row stacked together (13 slots x 10^7 records: gigabytes).
    for a in range(0, n, _CHUNK_ROWS):
        b = min(n, a + _CHUNK_ROWS)
        here, pv = np.arange(a, b), prev[a:b]
        slots: list[tuple[np.ndarray[Any, Any], int, np.ndarray[Any, Any]]] = []
        slots.append((np.where(new_seg[a:b], gap[a:b], 0.0), _C["restarts"], here))
        for v, c in zip(step_parts(pv, sampled[a:b], est[a:b]), _STEP_CATS, strict=True):
            slots.append((v, c, pv))
        slots.append((np.where(has_prev[a:b] & ~new_seg[a:b], gap[a:b] - est[a:b], 0.0),
                      _C["outside_steps"], here))
        slots.append((np.where(redone[a:b], counted[a:b], 0.0), _C["restarts"], here))
        for v, c in zip(step_parts(here, ~redone[a:b], counted[a:b]), _STEP_CATS, strict=True):
            slots.append((v, c, here))
        # A slot with no event on any row adds nothing (the restart and sampling slots, mostly).
        slots = [sl for sl in slots if not (sl[0] <= 0.0).all()]
        if not slots:
            continue
        # The chunk's events, a row per record and a column per slot: row-major order is
        # the order they are added in. add() skips what is not above zero: those are
        # zeros here, which leave every running sum as it is (no sum is -0.0).
        val = np.stack([v for v, _, _ in slots], axis=1)
        val[val <= 0.0] = 0.0
        cats = [c for _, c, _ in slots]
        memo: dict[tuple[float, ...], tuple[float, ...]] = {}
        _accumulate(totals, val, cats, memo)
        for accs, idx in ((run_ms, run_idx), (day_ms, day_idx)):
            ix = np.stack([idx[o] for _, _, o in slots], axis=1)
            present = np.flatnonzero(np.bincount(ix[val != 0.0], minlength=len(accs))).tolist()
            for g in present:
                if len(present) == 1:  # one run or one day: every event is its
                    _accumulate(accs[g], val, cats, memo)
                else:
                    _accumulate(accs[g], np.where(ix == g, val, 0.0), cats)

    # Per run: its first start, last end, ranks (the block's ranks are none of another's).
    run_start = np.full(len(codes), np.iinfo(np.int64).max, dtype=np.int64)
    run_end = np.full(len(codes), np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(run_start, run_idx, start)
    np.maximum.at(run_end, run_idx, start + (ms * 1e6).astype(np.int64))
    for g, c in enumerate(codes.tolist()):
        lo, hi = int(run_start[g]), int(run_end[g])
        acc.run_start[c] = min(acc.run_start.get(c, lo), lo)
        acc.run_end[c] = max(acc.run_end.get(c, hi), hi)
        acc.run_ranks[c] = acc.run_ranks.get(c, 0) + len(np.unique(rank[run_idx == g]))


def _accumulate(acc: dict[str, float], val: np.ndarray[Any, Any], cats: list[int],
                memo: dict[tuple[float, ...], tuple[float, ...]] | None = None) -> None:
    """Add a chunk's events (``val``: rows x slots, ``cats``: each slot's category) to one
    bucket: per category and to its total, each a running sum in row-major order. ``memo``
    (for one ``val`` only): the sums from each starting state already added up; the whole
    run, its run and its day start equal and take the same events on a one-run job."""
    keys = ["total", *(_CATS[c] for c in sorted(set(cats)))]
    start = tuple(acc[k] for k in keys)
    done = memo.get(start) if memo is not None else None
    if done is None:
        sums = [_seq_sum(start[0], val.reshape(-1))]
        for k in keys[1:]:
            cols = [j for j, c in enumerate(cats) if _CATS[c] == k]
            sums.append(_seq_sum(acc[k], val[:, cols].reshape(-1)))
        done = tuple(sums)
        if memo is not None:
            memo[start] = done
    for k, v in zip(keys, done, strict=True):
        acc[k] = v


def _h(ms: float) -> float:
    return float(f"{ms / MS_PER_HOUR:.6g}")
