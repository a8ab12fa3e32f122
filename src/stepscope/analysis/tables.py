"""Every DuckDB table and view the analysis makes on a run's connection: its name, columns
and meaning, in the order the stages make them.

The stages talk through these relations: the loader (:mod:`stepscope.analysis.load`) builds
``steps``, ``phases`` and the records' other sections; the alignment, the wait rule and the
own-work stage build theirs on top. A name is a table on one path and a view on another
where the cheaper one differs (:mod:`stepscope.analysis.relations`); its columns are the
same either way. ``tests/unit/analysis/test_tables.py`` reads the sources and runs the analysis to check
that every relation made is declared here, with these columns.

Example::

    from stepscope.analysis.tables import TABLES
    print(TABLES["collective_waits"].meaning)
"""

from __future__ import annotations

from dataclasses import dataclass

from stepscope.analysis.record_files import COLUMNS

#: Names the stages also pass around as values (every statement that creates a relation
#: names it literally, so that reading the SQL shows which one it makes).
WAIT_MEDIANS = "wait_medians"
PHASE_SUMS = "phase_sums"
CELL_MIDDLES = "cell_middles"
DENSE_MIDDLES = "dense_middles"
TIMED_CELLS = "timed_cells"

_COLLECTIVE_ROW = ("rank", "step", "phase", "op", "pg", "pg_size", "count", "bytes", "ms",
                   "seq_first", "seq_last", "hidden_ms")
_RECORD = tuple(COLUMNS)  # a record line's typed fields
_FIELDS = tuple(c for c in _RECORD if c != "phases")  # the same but the phase list
_MIDDLES = ("step", "name", "n", "p", "m", "q")


@dataclass(frozen=True)
class Table:
    """One relation on the analysis connection.

    ``columns``: its columns (any order); ``optional``: columns only some sources give it
    (the Parquet store's ``tagged``); ``meaning``: one line, what a row is.
    """

    name: str
    columns: tuple[str, ...]
    meaning: str
    optional: tuple[str, ...] = ()


_DECLARED = (
    # -- loading (analysis/load.py, analysis/resource_use.py) --
    Table("record_lines", (*_RECORD, "filename"),
          "one row per line of the rank files read as JSON (all of them, or the torn tails the "
          "Parquet store lacks), typed, phase lists included; a corrupt line is all NULL but "
          "its filename"),
    Table("raw_records", (*_FIELDS, "filename", "rec", "listed", "lists_ok"),
          "one row per line of the rank files (or the Parquet store), typed, without its phase "
          "list: rec its id, listed whether it has a list, lists_ok whether every element is "
          "plausible; a corrupt line is all NULL but its filename", optional=("tagged",)),
    Table("raw_phases", ("rec", "rank", "step", "name", "parent", "ms", "s", "calls", "e", "path",
                         "ok"),
          "one row per element of the phase list of each raw record with the required fields "
          "(one row, not ok, for a record without a list), as phases has them; rec the "
          "record's id, ok whether its list is present and the element plausible"),
    Table("kept_records", (*_FIELDS, "rec"),
          "the records loading keeps (valid, readable, plausible, timed) without their phase "
          "lists; with duplicates, one per (rank, step)"),
    Table("timed_records", ("rank", "run_id", "step", "start_unix_ns", "step_ms"),
          "every timed record of the rank JSONL files, re-done duplicates included: goodput's rows"),
    Table("common_steps", ("step",), "the steps every rank recorded"),
    Table("steps", ("rank", "step", "host", "t0", "step_ms", "residual_ms", "h2d_hidden_ms"),
          "one row per analysed step and rank; t0 in ms since the run's earliest start"),
    Table("phases", ("rank", "step", "name", "parent", "ms", "s", "calls", "e", "path"),
          "one row per phase of a step; s and e offsets in ms from the step start, path the key"),
    Table("duplicate_paths", ("n",),
          "one row: how many (rank, step, path) have more than one row in phases"),
    Table("step_resources",
          ("rank", "step", "tokens", "samples", "tokens_per_s", "samples_per_s", "tflops", "mfu",
           "peak_allocated_mb", "peak_reserved_mb", "allocated_mb", "rss_mb", "workers_rss_mb",
           "alloc_retries", "ooms", "util_pct", "sm_clock_mhz", "power_w", "temp_c", "runq_ms"),
          "each step's throughput, FLOPs, memory and device sections and run-queue wait, flat"),
    Table("collectives", (*_COLLECTIVE_ROW[:9], "max_ms", "seq_first", "seq_last", "recv_bytes",
                          "recv_max_bytes", "exposed_ms", "hidden_ms"),
          "the records' collectives sections: one row per (rank, step, phase, op, group); "
          "exposed_ms and hidden_ms NULL in records made before the split"),
    Table("lost_steps", ("key", "n"), "steps the recorder counted as lost, by reason"),
    Table("unseen_collectives", ("rank", "step", "path", "n"),
          "collectives issued where they could not be timed, per phase path"),
    # -- goodput (analysis/goodput.py) --
    Table("rank_run_step_order", ("rank", "run_id", "by_step"),
          "per rank and run: whether every step index occurs once (goodput orders its steps "
          "by index) or a step was done again (ordered by wall clock)"),
    Table("timed_records_reread", ("rank", "run_id", "step", "start_unix_ns", "step_ms"),
          "timed_records read again from the rank files when loading did not keep it"),
    # -- phase statistics (analysis/stats.py) --
    Table("phase_samples", ("rank", "step", "name", "parent", "ms"),
          "phases by path plus each step's residual and hidden H2D time: what the statistics scan"),
    Table(PHASE_SUMS, ("name", "rank", "ms", "top", "pos"),
          "each sample name's sum per rank (rank NULL: the run), whether top level, positive sum"),
    # -- alignment (analysis/align.py) --
    Table("sync_spreads", ("name", "spread"),
          "how far apart one host's ranks end a candidate synchronising phase, per step"),
    Table("sync_ends", ("host_id", "step", "end_t"),
          "when each host's ranks end the synchronising phase, on the raw timeline (host_id: "
          "the host's place in the run's sorted host names, from 1)"),
    Table("host_offsets", ("host", "off"), "each host's estimated clock offset in ms"),
    Table("aligned_steps", ("rank", "step", "host", "t", "step_ms"),
          "each step's start on the aligned timeline (host offsets taken off)"),
    Table("arrivals", ("rank", "step", "a", "dur"),
          "each rank's arrival at the synchronising collective on the aligned timeline"),
    Table("timeline_waits", ("rank", "step", "wait_ms"),
          "arrival gaps on the aligned timeline: the wait where no collective was timed"),
    # -- waits (analysis/collwaits.py, analysis/pipeline.py) --
    Table("collective_calls", _COLLECTIVE_ROW,
          "recorded collectives and DDP's grad_sync phases, one row per (rank, step, phase, op, "
          "group); ms the exposed time (the step's stream waited), hidden_ms the rest"),
    Table("group_ranks", ("pg", "n", "size", "seen"),
          "per process group: ranks expected in each instance, its size, ranks that recorded it"),
    Table("p2p_blame", ("step", "pg", "rank", "t", "matched", "late"),
          "each end of a point-to-point link per step: its time and how late it made the other"),
    Table("p2p_waits", (*_COLLECTIVE_ROW, "matched", "seq_shift", "wait"),
          "the point-to-point rows of collective_calls with their wait (all their time)"),
    Table("collective_waits", (*_COLLECTIVE_ROW, "matched", "seq_shift", "wait"),
          "every collective call with whether it matched across its group and its wait"),
    Table("step_waits", ("rank", "step", "wait_ms", "comm_ms", "step_ms", "residual_ms"),
          "each rank's total wait per step, the rest of its time in collectives, and the step's "
          "step_ms and residual_ms (steps' own: its readers need no join back)"),
    # -- own work (analysis/own.py) --
    Table("phase_collectives", ("rank", "step", "anc", "wait", "n", "ms"),
          "the waits, count and time of the collectives inside each phase path, at any depth"),
    Table("phase_waits", ("rank", "step", "path", "parent", "ms", "wait", "ncoll", "coll_ms"),
          "every phase path with the waits and time of the collectives inside it"),
    Table(WAIT_MEDIANS, ("path", "median"),
          "the run-wide median wait of each top-level phase with collectives inside"),
    Table("own_work", ("rank", "step", "name", "own", "wait"),
          "each top-level phase's and the residual's time less its waits (the grouped path)"),
    Table(CELL_MIDDLES, _MIDDLES,
          "per (step, phase): the middle order statistics of own_work's values"),
    Table(DENSE_MIDDLES, _MIDDLES,
          "the same middle order statistics, taken from the own-work matrices"),
    Table(TIMED_CELLS, ("step", "name"),
          "the (step, phase) cells where some rank has a collective timing"),
    Table("own_excess", ("rank", "step", "name", "own", "wait", "others", "excess"),
          "own work per top-level phase and residual, the other ranks' median, and the gap"),
    Table("residual_work", ("rank", "step", "wait", "own", "work"),
          "the residual's waits, own time and work outside every collective"),
    # -- stragglers (analysis/stragglers.py) --
    Table("flagged_steps", ("step",), "the steps on which a straggler was slow"),
    # -- the Parquet store's compaction, on its own connection (analysis/store.py) --
    Table("parsed_lines", (*_RECORD, "filename", "tagged"),
          "one rank block's new lines, parsed once: its records and flat phase rows are "
          "written from it"),
    # -- a rank block's task of the Dask engine, on its own connection (analysis/dask_engine.py) --
    Table("task_step_rows", ("rank", "step", "residual_ms", "h2d_hidden_ms"),
          "the block's ranks' rows of steps, sent by the client (arrays)"),
    Table("task_common_steps", ("step",), "common_steps, sent by the client (arrays)"),
    Table("task_phase_rows", ("rank", "step", "parent", "ms", "path"),
          "the block's phase rows, sent by the client where the store has no flat copy (arrays)"),
    Table("task_own_rows", ("rank", "step", "residual_ms", "anc_id", "wait", "n", "ms"),
          "a step block's own-work task's rows of steps, phase_collectives or collective_waits "
          "outside any phase, sent by the client (arrays)",
          optional=("residual_ms", "anc_id", "wait", "n", "ms")),
    # -- the Dask engine's client, gathering step-block tasks (analysis/dask_engine.py) --
    Table("task_block_rows", ("name", "spread", "host", "step", "end_t"),
          "one alignment statement's rows from every step-block task (arrays), appended to its "
          "table: align.SYNC_SPREADS gives (name, spread), align.SYNC_ENDS (host, step, end_t)",
          optional=("name", "spread", "host", "step", "end_t")),
)

#: Every relation the analysis makes, by name.
TABLES: dict[str, Table] = {t.name: t for t in _DECLARED}
