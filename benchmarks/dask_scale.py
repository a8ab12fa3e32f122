"""Per-task costs of ``stepscope report --engine dask`` and what 10^9 samples would take.

On a Parquet store written by ``analysis_scale.py --write-store`` (ten phase paths per step):

1. the single-machine report (``analyze_run``), timing the per-rank phase rows inside it
   (the part the Dask engine runs as tasks) apart from the rest (loading and every other
   stage, which stay on the client);
2. each rank block's task (:func:`stepscope.analysis.dask_engine.run_rank_block`) run here
   one after another: wall and CPU seconds, samples, bytes sent to it;
3. the whole report with ``--engine dask`` on a local cluster of ``--workers`` processes,
   checked equal to the single-machine document.

Then the projection for 10^9 samples on N workers, each task as large as measured (a rank
block: 256 ranks): the client's part grows with the samples (it is linear in them on one
machine), the tasks' part is ceil(tasks / N) task times::

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


def _single_machine(store: str, threads: int) -> tuple[dict[str, Any], dict[str, float]]:
    from stepscope.analysis.run import open_analyzed_run
    from stepscope.analysis.stats import local_phase_rank_rows

    rows_s: list[float] = []

    def timed_rows(data: Any) -> list[tuple[Any, ...]]:
        t = time.perf_counter()
        try:
            return local_phase_rank_rows(data.con)
        finally:
            rows_s.append(time.perf_counter() - t)

    t0, c0 = time.perf_counter(), _cpu()
    run = open_analyzed_run(store, threads=threads, phase_rank_rows=timed_rows)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    run.close()
    return run.doc, {"wall_s": wall, "cpu_s": cpu, "rank_rows_s": sum(rows_s)}


def _tasks(store: str, threads: int) -> list[dict[str, float]]:
    from stepscope.analysis import dask_engine
    from stepscope.analysis.load import load_run

    data = load_run(store, threads=threads)
    try:
        tasks = dask_engine.plan(data)
        out = []
        for task in tasks:
            sent = sum(int(getattr(a, "nbytes", 0)) for a in task.steps.values())
            t0, c0 = time.perf_counter(), _cpu()
            rows = dask_engine.run_rank_block(task)
            out.append({"ranks": task.ranks[1] - task.ranks[0] + 1, "files": len(task.files),
                        "wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0,
                        "samples": sum(int(r[5]) for r in rows), "sent_mb": sent / 2**20})
        return out
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
        run = open_analyzed_run(store, threads=threads, phase_rank_rows=dask_engine.runner(client))
        wall = time.perf_counter() - t1
    run.close()
    return run.doc, started, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a store from analysis_scale.py --write-store")
    ap.add_argument("--threads", type=int, default=1, help="DuckDB threads on the client")
    ap.add_argument("--workers", type=int, default=2, help="local cluster worker processes")
    ap.add_argument("--record", metavar="DIR", help="also write a record under DIR")
    args = ap.parse_args()
    if args.record:
        return record_run(__file__, sys.argv[1:])
    import logging

    logging.getLogger("distributed").setLevel(logging.WARNING)  # its start-up chatter
    doc, single = _single_machine(args.store, args.threads)
    tasks = _tasks(args.store, args.threads)
    dask_doc, dask_start, dask_wall = _dask(args.store, args.threads, args.workers)
    samples = int(doc["run"]["phase_samples"])
    task_samples = sum(t["samples"] for t in tasks) / len(tasks)
    task_wall = sum(t["wall_s"] for t in tasks) / len(tasks)
    client_s = single["wall_s"] - single["rank_rows_s"]
    scale = TARGET / samples
    n_tasks = math.ceil(TARGET / task_samples)
    projected = {str(n): round(client_s * scale + math.ceil(n_tasks / n) * task_wall, 1)
                 for n in WORKERS}
    print(json.dumps({
        "benchmark": "dask_scale",
        "phase_samples": samples,
        "client_threads": args.threads,
        "single_machine_wall_s": round(single["wall_s"], 2),
        "single_machine_cpu_s": round(single["cpu_s"], 2),
        "rank_rows_on_client_s": round(single["rank_rows_s"], 2),
        "rest_on_client_s": round(client_s, 2),
        "tasks": len(tasks),
        "task_samples": round(task_samples),
        "task_wall_s": round(task_wall, 3),
        "task_cpu_s": round(sum(t["cpu_s"] for t in tasks) / len(tasks), 3),
        "task_sent_mb": round(sum(t["sent_mb"] for t in tasks) / len(tasks), 2),
        "task_us_per_sample": round(1e6 * task_wall / task_samples, 4),
        "dask_workers": args.workers,
        "dask_cluster_start_s": round(dask_start, 2),
        "dask_wall_s": round(dask_wall, 2),
        "same_report": dask_doc == doc,
        "projection_1e9": {
            "single_machine_s": round(single["wall_s"] * scale, 1),
            "client_s": round(client_s * scale, 1),
            "tasks": n_tasks,
            "by_workers_s": projected,
        },
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
