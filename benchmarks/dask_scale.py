"""Per-task costs of ``stepscope report --engine dask`` and what 10^9 samples would take.

On a Parquet store written by ``analysis_scale.py --write-store`` (ten phase paths per step):

1. the single-machine report (``analyze_run``), timing apart the parts the Dask engine runs
   as tasks: the per-rank phase rows, the alignment's per-step statements and the gap
   series' screen per (rank, phase) (noise and straggler candidates) and the own-work
   matrices (own work and the median of the other ranks per step) (wall and CPU seconds of
   this process);
2. each rank block's task (:func:`stepscope.analysis.dask_engine.run_rank_block`), each
   step block's task (:func:`stepscope.analysis.dask_engine.run_step_block`, every statement
   of the report), each step block's own-work task
   (:func:`stepscope.analysis.dask_engine.run_own_block`, on the report's own tables) and each
   series task (:func:`stepscope.analysis.dask_engine.run_series_block`,
   the report's own series) run here one after another: wall and CPU seconds, bytes sent and
   returned; the client's CPU to append the step-block rows to its tables, to plan the
   own-work tasks and concatenate their matrices, and to split the series into blocks and
   merge their screens; and ``--repeat`` paired, interleaved
   repetitions of the series tasks against the same function on the client (CPU medians
   and quartiles);
3. the whole report with ``--engine dask`` on a local cluster of ``--workers`` processes,
   checked equal to the single-machine document.

Then the projection for 10^9 samples on N workers, in CPU seconds (the machine may be
shared; CPU time moves far less with the load than wall time), each task as large as
measured: the client's part grows with the samples (it is linear in them on one machine),
each kind of task adds ceil(tasks / N) task times (no transfer time, no scheduler overhead)::

    python benchmarks/analysis_scale.py --write-store 1024x1000 --dir D
    python benchmarks/dask_scale.py --store D/1024x1000/parquet [--record benchmarks/results]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(Path(__file__).resolve().parent)]

from _results import record_run  # noqa: E402

#: The sample count projected to, and the worker counts.
TARGET = 10**9
WORKERS = (1, 4, 16, 64, 256)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _single_machine(store: str, threads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The default report, with the parts the tasks take over timed apart (wall and CPU
    seconds of this process), and the step-block statements it ran."""
    from stepscope.analysis.align import insert_by_host_blocks
    from stepscope.analysis.own import own_block
    from stepscope.analysis.run import open_analyzed_run
    from stepscope.analysis.stats import local_phase_rank_rows
    from stepscope.analysis.stragglers import screen_series

    parts = {"rank_rows_s": 0.0, "rank_rows_cpu_s": 0.0, "step_rows_s": 0.0,
             "step_rows_cpu_s": 0.0, "series_s": 0.0, "series_cpu_s": 0.0, "own_s": 0.0,
             "own_cpu_s": 0.0, "probe_s": 0.0, "probe_cpu_s": 0.0}
    own: dict[str, Any] = {}  # the own-work tasks run here, beside the report
    statements: list[tuple[str, str, dict[str, Any]]] = []
    series: list[Any] = []  # the gap series, median step and step count the report used

    def timed(key: str, fn: Any, *args: Any) -> Any:
        t, c = time.perf_counter(), _cpu()
        try:
            return fn(*args)
        finally:
            parts[f"{key}_s"] += time.perf_counter() - t
            parts[f"{key}_cpu_s"] += _cpu() - c

    def step_rows(data: Any) -> Any:
        insert = insert_by_host_blocks(data.con, data.hosts)

        def run(table: str, select: str, params: dict[str, Any]) -> None:
            statements.append((table, select, params))
            timed("step_rows", insert, table, select, params)

        return run

    def screen(data: Any, median_step: float, n_steps: int) -> Any:
        if not series:  # the gross series (a run with run-queue wait has a net one too)
            series.extend([data, median_step, n_steps])
        return timed("series", screen_series, data, median_step, n_steps)

    def own_blocks(data: Any) -> Any:
        def run(spec: Any) -> Any:
            whole = timed("own", own_block, data.con, spec)
            # The tasks need the report's own tables, alive only here: timed apart
            # ("probe") and taken out of the report's figures.
            own.update(timed("probe", _own_tasks, data, spec, whole))
            return [whole]

        return run

    t0, c0 = time.perf_counter(), _cpu()
    run = open_analyzed_run(store, threads=threads,
                            phase_rank_rows=lambda data: timed("rank_rows", local_phase_rank_rows,
                                                               data.con),
                            step_block_rows=step_rows, series_screen=screen,
                            own_blocks=own_blocks)
    wall = time.perf_counter() - t0 - parts["probe_s"]
    cpu = _cpu() - c0 - parts["probe_cpu_s"]
    run.close()
    return run.doc, {"wall_s": wall, "cpu_s": cpu, **parts, "statements": statements,
                     "series": series, "own": own}


def _own_tasks(data: Any, spec: Any, whole: Any) -> dict[str, Any]:
    """Each own-work task run here on the report's tables (CPU, wall, pickled bytes sent and
    returned), the client's CPU to plan them and to concatenate their matrices, checked
    equal to the whole run's."""
    import pickle

    import numpy as np

    from stepscope.analysis import dask_engine

    c0 = _cpu()
    tasks = dask_engine.plan_own(data)
    plan_cpu = _cpu() - c0
    out, parts = [], []
    for task in tasks:
        t0, c0 = time.perf_counter(), _cpu()
        part = dask_engine.run_own_block(task, spec)
        out.append({"wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0,
                    "records": len(task.steps["step"]),
                    "sent_mb": len(pickle.dumps(task)) / 2**20,
                    "back_mb": len(pickle.dumps(part)) / 2**20})
        parts.append(part)
    c0 = _cpu()
    for k in range(len(spec.names)):
        for field in ("owns", "gaps"):
            joined = np.concatenate([getattr(p, field)[k] for p in parts], axis=1)
            assert np.array_equal(joined, getattr(whole, field)[k], equal_nan=True)
    concat_cpu = _cpu() - c0
    return {"tasks": out, "plan_cpu_s": plan_cpu, "concat_cpu_s": concat_cpu}


def _series_tasks(data: Any, median_step: float, n_steps: int,
                  repeat: int) -> tuple[list[dict[str, float]], float, dict[str, Any]]:
    """Each series task run here on the report's own gap series (CPU, wall, pickled bytes
    sent and returned); the client's CPU to split the series and merge the screens; and
    ``repeat`` paired repetitions, interleaved: every task in turn against the same function
    over every series on the client."""
    import pickle
    import statistics

    from stepscope.analysis import dask_engine
    from stepscope.analysis.series import rank_blocks_of
    from stepscope.analysis.stragglers import merge_screens, screen_series

    c0 = _cpu()
    blocks = rank_blocks_of(data, dask_engine.SERIES_BLOCK_RANKS)
    split_cpu = _cpu() - c0
    out, parts = [], []
    for block in blocks:
        t0, c0 = time.perf_counter(), _cpu()
        part = dask_engine.run_series_block(block, median_step, n_steps)
        out.append({"wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0,
                    "series": len(block), "sent_mb": len(pickle.dumps(block)) / 2**20,
                    "back_mb": len(pickle.dumps(part)) / 2**20})
        parts.append(part)
    c0 = _cpu()
    merged = merge_screens(data, parts)
    merge_cpu = split_cpu + _cpu() - c0
    assert merged == screen_series(data, median_step, n_steps)
    tasks, client = [], []
    for _ in range(repeat):
        c0 = _cpu()
        for block in blocks:
            dask_engine.run_series_block(block, median_step, n_steps)
        tasks.append(_cpu() - c0)
        c0 = _cpu()
        screen_series(data, median_step, n_steps)
        client.append(_cpu() - c0)

    def spread(xs: list[float]) -> list[float]:
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        return [round(q[0], 3), round(statistics.median(xs), 3), round(q[2], 3)]

    return out, merge_cpu, {"repeat": repeat, "tasks_cpu_q1_median_q3_s": spread(tasks),
                            "client_cpu_q1_median_q3_s": spread(client)}


def _rank_tasks(store: str, threads: int) -> list[dict[str, float]]:
    from stepscope.analysis import dask_engine
    from stepscope.analysis.load import load_run

    data = load_run(store, threads=threads)
    try:
        out = []
        for task in dask_engine.plan(data):
            sent = sum(int(getattr(a, "nbytes", 0)) for a in task.steps.values())
            t0, c0 = time.perf_counter(), _cpu()
            rows = dask_engine.run_rank_block(task)
            out.append({"wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0,
                        "samples": sum(int(r[5]) for r in rows), "sent_mb": sent / 2**20})
        return out
    finally:
        data.close()


def _step_tasks(store: str, threads: int,
                statements: list[tuple[str, str, dict[str, Any]]]) -> tuple[list[dict[str, float]], float]:
    """Each step-block task run here, every statement of the report on it; and the client's
    seconds (CPU) to append the tasks' rows to its tables."""
    import numpy as np

    from stepscope.analysis import dask_engine
    from stepscope.analysis.load import load_run

    data = load_run(store, threads=threads)
    try:
        out = []
        got: dict[str, list[dict[str, Any]]] = {t: [] for t, _, _ in statements}
        for task in dask_engine.plan_steps(data):
            sent = sum(int(getattr(a, "nbytes", 0)) for a in task.step_rows.values())
            t0, c0 = time.perf_counter(), _cpu()
            back = 0
            for table, select, params in statements:
                rows = dask_engine.run_step_block(task, select, params)
                back += sum(int(getattr(a, "nbytes", 0)) for a in rows.values())
                got[table].append(rows)
            out.append({"wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0,
                        "records": len(next(iter(task.step_rows.values()))),
                        "sent_mb": sent / 2**20, "back_mb": back / 2**20})
        c0 = _cpu()
        for table, parts in got.items():
            rows = {c: np.ma.concatenate([p[c] for p in parts]) for c in parts[0]}
            data.con.register("task_block_rows", rows)
            data.con.execute(f"CREATE TEMP TABLE merged_{table} AS SELECT * FROM task_block_rows")
            data.con.unregister("task_block_rows")
        return out, _cpu() - c0
    finally:
        data.close()


def _dask(store: str, threads: int, workers: int) -> tuple[dict[str, Any], float, float]:
    """The report on a local cluster: its document, the cluster's start-up and the report's
    wall seconds."""
    from stepscope.analysis import dask_engine
    from stepscope.analysis.run import open_analyzed_run

    t0 = time.perf_counter()
    with dask_engine.cluster(None, workers=workers) as client:
        started = time.perf_counter() - t0
        t1 = time.perf_counter()
        run = open_analyzed_run(store, threads=threads, phase_rank_rows=dask_engine.runner(client),
                                step_block_rows=dask_engine.step_runner(client),
                                series_screen=dask_engine.series_runner(client),
                                own_blocks=dask_engine.own_runner(client))
        wall = time.perf_counter() - t1
    run.close()
    return run.doc, started, wall


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows) if rows else 0.0


def _task_figures(kind: str, tasks: list[dict[str, float]], cpu_s: float, size: str,
                  back_digits: int | None = 2) -> dict[str, Any]:
    """One task kind's keys of the record: count, mean ``size`` (records, samples or series
    per task), mean wall, ``cpu_s``, mean MB sent and (``back_digits`` not None) back."""
    out: dict[str, Any] = {
        f"{kind}_tasks": len(tasks),
        f"{kind}_task_{size}": round(_mean(tasks, size)),
        f"{kind}_task_wall_s": round(_mean(tasks, "wall_s"), 3),
        f"{kind}_task_cpu_s": round(cpu_s, 3),
        f"{kind}_task_sent_mb": round(_mean(tasks, "sent_mb"), 2),
    }
    if back_digits is not None:
        out[f"{kind}_task_back_mb"] = round(_mean(tasks, "back_mb"), back_digits)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a store from analysis_scale.py --write-store")
    ap.add_argument("--threads", type=int, default=1, help="DuckDB threads on the client")
    ap.add_argument("--workers", type=int, default=2, help="local cluster worker processes")
    ap.add_argument("--repeat", type=int, default=5,
                    help="paired repetitions of the series tasks against the client")
    ap.add_argument("--record", metavar="DIR", help="also write a record under DIR")
    args = ap.parse_args()
    if args.record:
        return record_run(__file__, sys.argv[1:])
    import logging

    logging.getLogger("distributed").setLevel(logging.WARNING)  # its start-up chatter
    doc, single = _single_machine(args.store, args.threads)
    rank = _rank_tasks(args.store, args.threads)
    step, merge_cpu = _step_tasks(args.store, args.threads, single["statements"])
    gaps, median_step, n_steps = single.pop("series")
    series, series_merge_cpu, paired = _series_tasks(gaps, median_step, n_steps, args.repeat)
    dask_doc, dask_start, dask_wall = _dask(args.store, args.threads, args.workers)
    samples = int(doc["run"]["phase_samples"])
    records = int(doc["run"]["records"]) if isinstance(doc["run"].get("records"), int) else None
    rank_samples = _mean(rank, "samples")
    # What stays on the client, in CPU seconds (this process; the load does not inflate
    # them as it does wall seconds): everything but the three kinds of tasks, plus appending
    # the step-block tasks' rows to its tables and splitting and merging the series.
    own = single["own"]
    own_tasks = own.get("tasks", [])
    own_client = own.get("plan_cpu_s", 0.0) + own.get("concat_cpu_s", 0.0)
    client_cpu = (single["cpu_s"] - single["rank_rows_cpu_s"] - single["step_rows_cpu_s"]
                  - single["series_cpu_s"] - single["own_cpu_s"] + merge_cpu + series_merge_cpu
                  + own_client)
    scale = TARGET / samples
    n_rank = math.ceil(TARGET / rank_samples)
    n_step = math.ceil(len(step) * scale)  # tasks of as many records: the same per-step size
    n_series = math.ceil(len(series) * scale)  # blocks of as many ranks and steps
    rank_cpu, step_cpu = _mean(rank, "cpu_s"), _mean(step, "cpu_s")
    series_cpu = _mean(series, "cpu_s")
    n_own = math.ceil(len(own_tasks) * scale)  # the step blocks again
    own_cpu = _mean(own_tasks, "cpu_s")
    projected = {str(n): round(client_cpu * scale + math.ceil(n_rank / n) * rank_cpu
                               + math.ceil(n_step / n) * step_cpu
                               + math.ceil(n_own / n) * own_cpu
                               + math.ceil(n_series / n) * series_cpu, 1) for n in WORKERS}
    print(json.dumps({
        "benchmark": "dask_scale",
        "phase_samples": samples,
        "records": records,
        "client_threads": args.threads,
        "single_machine_wall_s": round(single["wall_s"], 2),
        "single_machine_cpu_s": round(single["cpu_s"], 2),
        "rank_rows_on_client_cpu_s": round(single["rank_rows_cpu_s"], 2),
        "step_rows_on_client_cpu_s": round(single["step_rows_cpu_s"], 2),
        "step_statements": len(single["statements"]),
        "rest_on_client_cpu_s": round(client_cpu, 2),
        "merge_step_rows_cpu_s": round(merge_cpu, 2),
        **_task_figures("rank", rank, rank_cpu, "samples", back_digits=None),
        **_task_figures("step", step, step_cpu, "records"),
        "own_on_client_cpu_s": round(single["own_cpu_s"], 2),
        **_task_figures("own", own_tasks, own_cpu, "records"),
        "own_plan_concat_cpu_s": round(own_client, 3),
        "series_on_client_cpu_s": round(single["series_cpu_s"], 3),
        **_task_figures("series", series, series_cpu, "series", back_digits=3),
        "series_split_merge_cpu_s": round(series_merge_cpu, 3),
        "series_paired": paired,
        "dask_workers": args.workers,
        "dask_cluster_start_s": round(dask_start, 2),
        "dask_wall_s": round(dask_wall, 2),
        "same_report": dask_doc == doc,
        "projection_1e9": {
            "basis": "CPU seconds",
            "single_machine_s": round(single["cpu_s"] * scale, 1),
            "client_s": round(client_cpu * scale, 1),
            "rank_tasks": n_rank,
            "step_tasks": n_step,
            "own_tasks": n_own,
            "series_tasks": n_series,
            "by_workers_s": projected,
        },
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
