"""The Dask engine of ``stepscope report --engine dask``: a run's work that splits by blocks
of ranks or of steps as tasks on a Dask cluster, the rest of the analysis on the client.

Four kinds of task, each running the single-machine path's own statements or function
over its part of the run only (the statements on a DuckDB connection of its own, one thread):

* **rank-block tasks** (:func:`run_rank_block`): the per-rank phase statistics
  (:func:`stepscope.analysis.stats.phase_rank_rows`: exact quantiles, max, sums and counts per
  (phase, rank)) need only their rank's samples, so each rank block of the store
  (``phases/rank_block=K/``, see :mod:`stepscope.analysis.store`) is one task, reading its
  block's files; it takes its ranks' per-step rows from the client.
* **step-block tasks** (:func:`run_step_block`): the per-step statements across ranks that
  :func:`stepscope.analysis.align.align` hands to a :data:`~stepscope.analysis.align.BlockRows`
  (the spread of each phase's end per step and host, each rank's end of the synchronising
  phase) need every rank of their steps, so each block of whole steps
  (:data:`STEP_BLOCK_RECORDS` records) is one task. It reads every rank block's flat files
  filtered to its steps (each file is ordered by step, so DuckDB skips the other row
  groups); its steps' rows of ``steps`` come from the client. The client appends the rows
  to its table (blocks are disjoint: a union) and takes the same medians as on one machine.
* **own-work tasks** (:func:`run_own_block`): each rank's own work per phase and step and
  the median of the other ranks at that step (:func:`stepscope.analysis.own.own_block`: the
  ranks × steps matrices the gap series are rows of) need every rank of their steps, so each
  step block is one task too, reading its steps of the store's flat files as the
  alignment's do; its steps' rows of ``steps``, ``phase_collectives`` and the waits outside
  any phase (built on the client from the collectives) come from the client, which
  concatenates the blocks' columns in step order.
* **series tasks** (:func:`run_series_block`): the screen of each (rank, phase) gap series
  (:func:`stepscope.analysis.stragglers.screen_series`: its noise, the flag threshold the
  straggler and window search uses, and whether the search may name a straggler on it)
  needs that series alone, so each block of :data:`SERIES_BLOCK_RANKS` whole ranks is one
  task, sent its ranks' series by the client (the rows of the own-work matrices, regrouped
  by rank on the client); the client merges the screens (a union,
  :func:`stepscope.analysis.stragglers.merge_screens`) and judges the few candidates
  across ranks (noise floor, victims).

The client gathers the rows and the analysis goes on as on one machine. Where the store
has no flat copy the report can read (a run with duplicate records, torn tails, several
runs in one directory), the client sends each task its phase rows instead.

Dask is an optional dependency (``pip install 'stepscope[dask]'``), imported here only.
What runs where, and the projected cost at scale: ``docs/report-engines.md``.

Example::

    from stepscope.analysis import dask_engine
    from stepscope.analysis.run import open_analyzed_run

    with dask_engine.cluster(None) as client:  # a local cluster
        run = open_analyzed_run("runs/demo", phase_rank_rows=dask_engine.runner(client),
                                step_block_rows=dask_engine.step_runner(client),
                                series_screen=dask_engine.series_runner(client),
                                own_blocks=dask_engine.own_runner(client))
    run.close()
"""

from __future__ import annotations

import contextlib
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepscope.analysis import store as st
from stepscope.analysis.align import BlockRows, block_params
from stepscope.analysis.blocks import WHOLE, in_block, rank_blocks, step_blocks
from stepscope.analysis.load import RunData, create_flat_phases_view
from stepscope.analysis.own import OwnBlock, OwnBlockRunner, OwnSpec, own_block
from stepscope.analysis.run import OwnBlocksRunner, PhaseRankRunner, StepBlockRunner
from stepscope.analysis.series import Series, rank_blocks_of
from stepscope.analysis.stats import create_phase_samples, local_phase_rank_rows
from stepscope.analysis.stragglers import SeriesRunner, SeriesScreen, merge_screens, screen_series
from stepscope.common.errors import AnalysisError

#: How to install what the engine needs (named in its error).
INSTALL = "pip install 'stepscope[dask]'"
#: Workers of the local cluster started when no scheduler address is given.
LOCAL_WORKERS = 2
#: Seconds to wait for a scheduler at a given address.
CONNECT_TIMEOUT_S = 10.0

#: No dashboard, and the scheduler's HTTP routes on a free port: its default (8787) may be
#: another cluster's.
LOCAL_OPTIONS: dict[str, Any] = {
    "dashboard_address": None, "scheduler_kwargs": {"dashboard": False, "dashboard_address": ":0"}}

_BLOCK_DIR = re.compile(r"rank_block=(\d+)$")
#: The per-step columns of ``steps`` that ``phase_samples`` reads, with their types.
_STEP_COLUMNS = "rank INTEGER, step BIGINT, residual_ms DOUBLE, h2d_hidden_ms DOUBLE"
#: The columns of ``phases`` that ``phase_samples`` reads, where the client sends them.
_PHASE_COLUMNS = "rank INTEGER, step BIGINT, parent VARCHAR, ms DOUBLE, path VARCHAR"
#: The columns of ``steps`` a step-block statement reads (:data:`stepscope.analysis.align.BlockRows`).
_BLOCK_STEP_COLUMNS = "rank INTEGER, step BIGINT, t0 DOUBLE, host VARCHAR"
#: The columns of the flat ``phases`` view, where the client sends a step block's rows.
_FLAT_PHASE_COLUMNS = ("rank INTEGER, step BIGINT, name VARCHAR, parent VARCHAR, ms DOUBLE, "
                       "s DOUBLE, calls BIGINT, e DOUBLE, path VARCHAR")
#: Records (rank, step) per step-block task: ~10 phase rows each, a few seconds of one thread.
STEP_BLOCK_RECORDS = 250_000
#: Ranks per series task: a rank block of the store.
SERIES_BLOCK_RANKS = st.RANK_BLOCK


@dataclass(frozen=True)
class RankBlockTask:
    """One task: the ranks ``ranks`` (first, last) of a run.

    ``steps``: those ranks' rows of table ``steps`` (columns of :data:`_STEP_COLUMNS`, as
    arrays); ``files`` and ``keep``: the store's flat phases files of the block and the
    condition on ``step`` that ``phases`` keeps (``common_steps``: that table's steps, where
    ``keep`` names it); ``phases``: the block's phase rows instead, where there are no files.
    """

    ranks: tuple[int, int]
    steps: dict[str, Any]
    files: tuple[str, ...] = ()
    keep: str = "TRUE"
    common_steps: dict[str, Any] | None = None
    phases: dict[str, Any] | None = None


def run_rank_block(task: RankBlockTask) -> list[tuple[Any, ...]]:
    """The per-rank phase rows of ``task``'s ranks, on a DuckDB connection of its own: the
    statements of the single-machine path (:func:`create_phase_samples`,
    :func:`local_phase_rank_rows`) over the block's rows only."""
    con = _task_connection()
    try:
        con.register("task_step_rows", task.steps)
        con.execute(f"CREATE TABLE steps ({_STEP_COLUMNS})")
        con.execute("INSERT INTO steps SELECT * FROM task_step_rows")
        _create_phases(con, task.files, task.keep, task.common_steps, task.phases,
                       _PHASE_COLUMNS)
        create_phase_samples(con)
        return local_phase_rank_rows(con)
    finally:
        con.close()


def _block_of(path: str) -> int | None:
    """K of the ``rank_block=K`` directory that holds ``path`` (a path or a URL)."""
    m = _BLOCK_DIR.search(posixpath.dirname(path.replace("\\", "/")))
    return int(m.group(1)) if m else None


def _steps_of(con: Any, ranks: tuple[int, int]) -> dict[str, Any]:
    return dict(con.execute(
        f"SELECT rank, step, residual_ms, h2d_hidden_ms FROM steps WHERE {in_block('rank', ranks)}"
    ).fetchnumpy())


def plan(data: RunData, rank_block: int = st.RANK_BLOCK) -> list[RankBlockTask]:
    """The tasks of a loaded run: one per rank block of the store's flat copy, reading its
    files; where the run has none (or a rank outside them), one per block of ranks of the
    client's ``steps``, with its phase rows."""
    con = data.con
    flat = data.flat_phases
    by_block: dict[int, list[str]] = {}
    if flat is not None:
        for f in flat.files:
            k = _block_of(f)
            if k is None:
                by_block = {}
                break
            by_block.setdefault(k, []).append(f)
    covered = {r for r in data.ranks if r // rank_block in by_block}
    if flat is not None and by_block and covered == set(data.ranks):
        common = (dict(con.execute("SELECT step FROM common_steps").fetchnumpy())
                  if "common_steps" in flat.keep else None)
        tasks = []
        for k, files in sorted(by_block.items()):
            ranks = (k * rank_block, (k + 1) * rank_block - 1)
            tasks.append(RankBlockTask(ranks, _steps_of(con, ranks), tuple(files), flat.keep,
                                       common))
        return tasks
    return [RankBlockTask(b, _steps_of(con, b), phases=dict(con.execute(
        f"SELECT rank, step, parent, ms, path FROM phases WHERE {in_block('rank', b)}"
    ).fetchnumpy())) for b in rank_blocks(con)]


@dataclass(frozen=True)
class StepBlockTask:
    """One task: the steps ``steps`` (first, last) of every rank of a run.

    ``step_rows``: those steps' rows of table ``steps`` (columns of
    :data:`_BLOCK_STEP_COLUMNS`, as arrays); ``files``, ``keep``, ``common_steps``: the
    store's flat phases files (every rank block's: the task reads their rows of its steps;
    each file is ordered by step, so the others' row groups are skipped) and the condition on
    ``step`` that ``phases`` keeps; ``phases``: the block's phase rows instead, where there
    are no files.
    """

    steps: tuple[int, int]
    step_rows: dict[str, Any]
    files: tuple[str, ...] = ()
    keep: str = "TRUE"
    common_steps: dict[str, Any] | None = None
    phases: dict[str, Any] | None = None


def _task_connection() -> Any:
    import duckdb

    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")  # it would draw on the worker's stdout
    con.execute("SET preserve_insertion_order = false")
    # One thread a task: the cluster runs as many tasks at once as its workers have threads.
    con.execute("SET threads = 1")
    return con


def _create_phases(con: Any, files: tuple[str, ...], keep: str,
                   common_steps: dict[str, Any] | None, phases: dict[str, Any] | None,
                   columns: str) -> None:
    """A task's ``phases``: a view over the store's flat ``files`` kept by ``keep`` (with
    ``common_steps`` as that table where ``keep`` names it), or, where there are no files, a
    table of ``columns`` holding the rows the client sent (``phases``, possibly none)."""
    if files:
        if common_steps is not None:
            con.register("task_common_steps", common_steps)
            con.execute("CREATE TABLE common_steps AS SELECT step FROM task_common_steps")
        create_flat_phases_view(con, st.files_source(list(files)), keep)
        return
    con.execute(f"CREATE TABLE phases ({columns})")
    if phases is not None:
        con.register("task_phase_rows", phases)
        con.execute("INSERT INTO phases SELECT * FROM task_phase_rows")


def run_step_block(task: StepBlockTask, select: str, params: dict[str, Any]) -> dict[str, Any]:
    """The rows of ``select`` (a :data:`stepscope.analysis.align.BlockRows` statement, with its
    bound parameters ``params``) over ``task``'s steps, as arrays, on a DuckDB connection of
    its own."""
    con = _task_connection()
    try:
        con.register("task_step_rows", task.step_rows)
        con.execute("CREATE TABLE steps AS SELECT * FROM task_step_rows")
        block = in_block("step", task.steps)
        _create_phases(con, task.files, f"({task.keep}) AND {block}", task.common_steps,
                       task.phases, _FLAT_PHASE_COLUMNS)
        return dict(con.execute(select, {**params, **block_params(WHOLE, task.steps)}
                                ).fetchnumpy())
    finally:
        con.close()


def plan_steps(data: RunData, records: int | None = None, *,
               step_rows: bool = True) -> list[StepBlockTask]:
    """The step-block tasks of a loaded run: blocks of whole steps of at most ``records``
    (default :data:`STEP_BLOCK_RECORDS`) records, reading the store's flat copy where the
    report reads it, else sent their phase rows; with ``step_rows``, their steps' rows of
    ``steps`` that the alignment's statements read (else none)."""
    con = data.con
    flat = data.flat_phases
    cap = STEP_BLOCK_RECORDS if records is None else records
    common = (dict(con.execute("SELECT step FROM common_steps").fetchnumpy())
              if flat is not None and "common_steps" in flat.keep else None)
    tasks = []
    for b in step_blocks(con, cap):
        rows = (dict(con.execute(f"SELECT rank, step, t0, host FROM steps WHERE {in_block('step', b)}"
                                 ).fetchnumpy()) if step_rows else {})
        if flat is not None:
            tasks.append(StepBlockTask(b, rows, tuple(flat.files), flat.keep, common))
        else:
            cols = ", ".join(c.split()[0] for c in _FLAT_PHASE_COLUMNS.split(", "))
            tasks.append(StepBlockTask(b, rows, phases=dict(con.execute(
                f"SELECT {cols} FROM phases WHERE {in_block('step', b)}").fetchnumpy())))
    return tasks


def step_runner(client: Any) -> StepBlockRunner:
    """What :func:`stepscope.analysis.run.open_analyzed_run` calls for the per-step rows of
    blocks of whole steps: each statement as one task per step block on ``client``'s cluster,
    the rows appended to the client's table (the blocks are disjoint: a union)."""

    def bind(data: RunData) -> BlockRows:
        scattered: list[Any] = []  # each task's data sent once, for every statement

        def insert(table: str, select: str, params: dict[str, Any]) -> None:
            if not scattered:
                scattered.extend(client.scatter(plan_steps(data), hash=False))
            parts = client.gather(client.map(run_step_block, scattered, select=select,
                                             params=params, pure=False))
            if not parts or not any(len(next(iter(p.values()), ())) for p in parts):
                return
            rows = {c: np.ma.concatenate([p[c] for p in parts]) for c in parts[0]}
            data.con.register("task_block_rows", rows)
            try:
                data.con.execute(f"INSERT INTO {table} SELECT * FROM task_block_rows")
            finally:
                data.con.unregister("task_block_rows")

        return insert

    return bind


@dataclass(frozen=True)
class OwnBlockTask:
    """One step block's own-work task: ``block`` (its steps, and the store's files or its
    phase rows, as for the alignment's statements) and, as arrays, its steps' rows of
    ``steps`` (rank, step, residual_ms), of ``phase_collectives`` (rank, step, anc_id, wait,
    n, ms: ``anc_id`` indexes ``paths``, a number per row, not a string) and of
    ``collective_waits`` outside any phase (rank, step, wait)."""

    block: StepBlockTask
    steps: dict[str, Any]
    phase_collectives: dict[str, Any]
    residual_waits: dict[str, Any]
    paths: tuple[str, ...] = ()


def _insert(con: Any, table: str, rows: dict[str, Any], select: str = "*",
            params: dict[str, Any] | None = None) -> None:
    """``rows`` (arrays, possibly none) appended to ``table``."""
    if len(next(iter(rows.values()), ())):
        con.register("task_own_rows", rows)
        con.execute(f"INSERT INTO {table} SELECT {select} FROM task_own_rows", params or {})
        con.unregister("task_own_rows")


def run_own_block(task: OwnBlockTask, spec: OwnSpec) -> OwnBlock | None:
    """The own-work and gap matrices of ``task``'s steps (every rank of ``spec``): the
    single-machine function (:func:`stepscope.analysis.own.own_block`) on a DuckDB
    connection of its own holding only the block's rows."""
    con = _task_connection()
    try:
        con.execute("CREATE TABLE steps (rank INTEGER, step BIGINT, residual_ms DOUBLE)")
        _insert(con, "steps", task.steps)
        con.execute("CREATE TABLE phase_collectives (rank INTEGER, step BIGINT, anc VARCHAR, "
                    "wait DOUBLE, n BIGINT, ms DOUBLE)")
        _insert(con, "phase_collectives", task.phase_collectives,
                "rank, step, list_extract($paths::VARCHAR[], anc_id + 1), wait, n, ms",
                {"paths": list(task.paths)})
        con.execute("CREATE TABLE collective_waits (rank INTEGER, step BIGINT, phase VARCHAR, "
                    "wait DOUBLE)")
        _insert(con, "collective_waits", task.residual_waits, "rank, step, NULL, wait")
        # phases' key as the run's (load.phase_keys_unique): the block's rows alone may differ.
        con.execute(f"CREATE TABLE duplicate_paths AS SELECT {0 if spec.unique else 1} AS n")
        b = task.block
        block = in_block("step", b.steps)
        _create_phases(con, b.files, f"({b.keep}) AND {block}", b.common_steps, b.phases,
                       _FLAT_PHASE_COLUMNS)
        steps = np.asarray(spec.steps, dtype=np.int64)
        mine = steps[(steps >= b.steps[0]) & (steps <= b.steps[1])]
        return own_block(con, OwnSpec(spec.names, spec.unique, spec.ranks, mine))
    finally:
        con.close()


def _by_step(con: Any, select: str,
             params: dict[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
    """The rows of ``select`` ordered by step, as arrays, and their step column (to cut)."""
    rows = dict(con.execute(f"{select} ORDER BY step", params or {}).fetchnumpy())
    return rows, np.asarray(rows["step"], dtype=np.int64)


def _steps_in(rows: tuple[dict[str, Any], Any], steps: tuple[int, int]) -> dict[str, Any]:
    """The rows of ``rows`` (:func:`_by_step`) in steps [first, last], copied (each task is
    sent its own rows only)."""
    cols, at = rows
    i, j = np.searchsorted(at, steps[0], "left"), np.searchsorted(at, steps[1], "right")
    return {c: v[i:j].copy() for c, v in cols.items()}


def plan_own(data: RunData) -> list[OwnBlockTask]:
    """The own-work tasks of a loaded run whose waits are built (``phase_collectives``,
    ``collective_waits``): one per step block of :func:`plan_steps`, with its steps' rows
    of the tables the matrices read (each table read once, in step order, and cut)."""
    con = data.con
    steps = _by_step(con, "SELECT rank, step, residual_ms FROM steps")
    paths = [str(p) for (p,) in con.execute(
        "SELECT DISTINCT anc FROM phase_collectives ORDER BY 1").fetchall()]
    coll = _by_step(con, "SELECT rank, step, CAST(list_position($paths::VARCHAR[], anc) - 1 "
                         "AS INTEGER) AS anc_id, wait, n, ms FROM phase_collectives",
                    {"paths": paths})
    residual = _by_step(con, "SELECT rank, step, wait FROM collective_waits WHERE phase IS NULL")
    return [OwnBlockTask(b, _steps_in(steps, b.steps), _steps_in(coll, b.steps),
                         _steps_in(residual, b.steps), tuple(paths))
            for b in plan_steps(data, step_rows=False)]


def own_runner(client: Any) -> OwnBlocksRunner:
    """What :func:`stepscope.analysis.run.open_analyzed_run` calls for the own-work matrices:
    one task per step block (:func:`plan_steps`) on ``client``'s cluster, each sent its
    steps' rows of the tables the matrices read (built on the client), the blocks gathered
    in step order."""

    def bind(data: RunData) -> OwnBlockRunner:
        def blocks(spec: OwnSpec) -> list[OwnBlock | None]:
            futures = client.map(run_own_block, client.scatter(plan_own(data), hash=False),
                                 spec=spec, pure=False)
            return list(client.gather(futures))

        return blocks

    return bind


def run_series_block(block: Series, median_step: float, n_steps: int) -> SeriesScreen:
    """The screen of each gap series of a block of ranks (its flag threshold, and whether
    the straggler search may name a straggler on it): the single-machine function
    (:func:`stepscope.analysis.stragglers.screen_series`) over the block's series."""
    return screen_series(block, median_step, n_steps)


def series_runner(client: Any) -> SeriesRunner:
    """What :func:`stepscope.analysis.run.open_analyzed_run` calls for the gap series' screen:
    one task per block of :data:`SERIES_BLOCK_RANKS` ranks on ``client``'s cluster, the
    screens merged (thresholds in the series' order)."""

    def screen(data: Series, median_step: float, n_steps: int) -> SeriesScreen:
        blocks = rank_blocks_of(data, SERIES_BLOCK_RANKS)
        if not blocks:
            return SeriesScreen({}, frozenset())
        futures = client.map(run_series_block, client.scatter(blocks, hash=False),
                             median_step=median_step, n_steps=n_steps, pure=False)
        return merge_screens(data, client.gather(futures))

    return screen


def runner(client: Any) -> PhaseRankRunner:
    """What :func:`stepscope.analysis.run.open_analyzed_run` calls for the per-rank phase
    rows: the run's tasks on ``client``'s cluster, their rows gathered."""

    def rows(data: RunData) -> list[tuple[Any, ...]]:
        # Scattered first: each task's rows go to a worker as data, not inside the task graph.
        futures = client.map(run_rank_block, client.scatter(plan(data), hash=False), pure=False)
        out: list[tuple[Any, ...]] = []
        for part in client.gather(futures):
            out += part
        return out

    return rows


@contextlib.contextmanager
def cluster(address: str | None, *, workers: int | None = None,
            processes: bool = True) -> Iterator[Any]:
    """A ``distributed.Client``: of the scheduler at ``address``, or (None) of a local
    cluster of ``workers`` (default :data:`LOCAL_WORKERS`) single-threaded workers, closed
    on exit. Raises
    :class:`AnalysisError` (one line) where Dask is not installed or the scheduler cannot
    be reached."""
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise AnalysisError(f"--engine dask needs Dask distributed ({INSTALL})") from None
    if address is None:
        n = LOCAL_WORKERS if workers is None else workers
        with LocalCluster(n_workers=n, threads_per_worker=1, processes=processes,
                          **LOCAL_OPTIONS) as local, Client(local) as client:
            yield client
        return
    try:
        client = Client(address, timeout=CONNECT_TIMEOUT_S)
    except (OSError, ValueError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AnalysisError(f"cannot reach the Dask scheduler at {address!r} ({first})") from None
    with client:
        try:  # a scheduler without workers would hold the tasks forever
            client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError):
            raise AnalysisError(f"the Dask scheduler at {address!r} has no workers (none joined "
                                f"within {CONNECT_TIMEOUT_S:g} s)") from None
        yield client
