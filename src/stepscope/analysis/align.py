"""Putting ranks on one timeline: the synchronising phase and per-host clock offsets.

View ``aligned_steps`` (rank, step, host, t, step_ms) holds each step's start on the aligned timeline.
Only the fallback for records without any collective timing (:func:`timeline_wait`) compares
clocks across ranks; the wait rule (:mod:`stepscope.common.waits`) never does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepscope.analysis.blocks import host_blocks

#: A phase nested in the sync phase with one of these names times the collective itself;
#: its start is then the rank's arrival (timeline fallback only).
_COMM_NAME = re.compile(r"all_?reduce|allgather|reduce_scatter|collective|comm|grad_sync|sync|wait",
                        re.IGNORECASE)


@dataclass
class Alignment:
    """How ranks were put on one timeline and where they synchronise."""

    sync_phase: str | None
    arrival: str | None  # phase whose start is the arrival at the collective
    aligned: bool
    method: str
    offsets_ms: dict[str, float] = field(default_factory=dict)
    end_spread_ms: float | None = None


def _candidates(con: Any, n_ranks: int) -> list[str]:
    rows = con.execute(
        f"""SELECT name FROM phases WHERE parent IS NULL GROUP BY name
            HAVING count(DISTINCT rank) = {n_ranks}"""
    ).fetchall()
    return [r[0] for r in rows]


def _in_block(table: str) -> str:
    """The block's condition on ``table``'s rows, put on both sides of a join (``p``: phases,
    ``s``: steps) so that each side's scan skips the row groups outside it: bound parameters
    ``$first_rank``, ``$last_rank``, ``$first_step``, ``$last_step`` (:func:`block_params`),
    never text."""
    return " AND ".join(f"{table}.{c} BETWEEN $first_{c} AND $last_{c}" for c in ("rank", "step"))


def block_params(ranks: tuple[int, int], steps: tuple[int, int]) -> dict[str, int]:
    """The bound parameters of a :data:`BlockRows` statement's block: ranks and steps (first,
    last) of the block."""
    return {"first_rank": int(ranks[0]), "last_rank": int(ranks[1]),
            "first_step": int(steps[0]), "last_step": int(steps[1])}


#: Appends to table ``table`` (made by the caller) the rows of ``select`` run with the bound
#: parameters ``params`` over every block of the run: ``select`` reads ``phases p`` and
#: ``steps s`` (only ``s``'s rank, step, t0 and host) and limits both to the block by the
#: parameters of :func:`block_params`, which the runner adds. Each block holds every rank of
#: its steps (a block of whole steps, or of whole hosts), so a group by step and host is
#: complete in one block, and the union is the whole-run statement's rows: on the run's
#: connection (:func:`insert_by_host_blocks`) or as tasks on a cluster
#: (:mod:`stepscope.analysis.dask_engine`). Names travel as parameters, never in the text.
BlockRows = Callable[[str, str, dict[str, Any]], None]

#: Each step row of the block with its host's position in ``$hosts`` (every host name of
#: ``steps``): joining and grouping by that number, not by the name, keeps strings out of the
#: statements' hash tables (about half their CPU); each step row's host is matched once,
#: against a table of the run's hosts.
_BLOCK_STEPS = f"""(SELECT s.rank, s.step, s.t0, host_ids.host_id
                     FROM steps s JOIN (SELECT unnest($hosts::VARCHAR[]) AS host,
                                               generate_subscripts($hosts::VARCHAR[], 1) AS host_id)
                          host_ids USING (host)
                     WHERE {_in_block("s")}) s"""

#: The per-(phase, step, host) spread of the candidate phases' ends (``$names``: their names;
#: ``$hosts``: the run's host names).
SYNC_SPREADS = f"""SELECT p.name, max(s.t0 + p.e) - min(s.t0 + p.e) AS spread
                   FROM phases p JOIN {_BLOCK_STEPS} USING (rank, step)
                   WHERE p.parent IS NULL AND list_contains($names::VARCHAR[], p.name)
                     AND {_in_block("p")}
                   GROUP BY p.name, p.step, s.host_id HAVING count(*) > 1"""
#: Each rank's end of the synchronising phase (``$sync``) on its host's clock, the host by its
#: position in ``$hosts`` (from 1).
SYNC_ENDS = f"""SELECT s.host_id, p.step, s.t0 + p.e AS end_t
                FROM phases p JOIN {_BLOCK_STEPS} USING (rank, step)
                WHERE p.name = $sync::VARCHAR AND p.parent IS NULL AND {_in_block("p")}"""


def insert_by_host_blocks(con: Any, hosts: dict[str, list[int]]) -> BlockRows:
    """:data:`BlockRows` on ``con``: a block of whole hosts at a time (analysis/blocks.py)."""

    def insert(table: str, select: str, params: dict[str, Any]) -> None:
        for ranks, steps in host_blocks(con, hosts):
            con.execute(f"INSERT INTO {table} {select}", {**params, **block_params(ranks, steps)})

    return insert


def align(con: Any, hosts: dict[str, list[int]], n_ranks: int, median_step: float,
          block_rows: BlockRows | None = None) -> Alignment:
    """Pick the synchronising phase, estimate per-host clock offsets, make view ``aligned_steps``.

    ``aligned_steps`` (rank, step, host, t, step_ms) has ``t`` = step start on the aligned timeline.
    ``block_rows``: where the per-step rows (:data:`SYNC_SPREADS`, :data:`SYNC_ENDS`) are
    computed (default: on ``con``, :func:`insert_by_host_blocks`).
    """
    fill = insert_by_host_blocks(con, hosts) if block_rows is None else block_rows
    cands = _candidates(con, n_ranks) if n_ranks > 1 else []
    multi_host = len(hosts) > 1
    shared = any(len(rs) > 1 for rs in hosts.values())
    spreads: dict[str, float] = {}
    if cands and shared:
        # Clocks on one host are directly comparable: measure end alignment there only.
        # Per step and host, a block of steps or whole hosts at a time; the median over all
        # of them at the end.
        con.execute("CREATE OR REPLACE TEMP TABLE sync_spreads (name VARCHAR, spread DOUBLE)")
        fill("sync_spreads", SYNC_SPREADS, {"names": cands, "hosts": sorted(hosts)})
        for name, spread in con.execute(
                "SELECT name, median(spread) FROM sync_spreads GROUP BY 1").fetchall():
            spreads[name] = float(spread)
        con.execute("DROP TABLE sync_spreads")
    sync: str | None = None
    if spreads:
        best = min(spreads, key=lambda n: spreads[n])
        sync = best
        if "backward" in spreads and spreads["backward"] <= 1.5 * spreads[best] + 0.2:
            sync = "backward"
        # Scheduling jitter spreads even a real collective's end by a few ms (a rank wakes
        # late from the wait), so the bar is loose; ranks that never synchronise drift apart
        # by far more than half a step.
        tol = max(1.0, 0.5 * median_step)
        if spreads[sync] > tol:
            sync = None
    elif "backward" in cands:
        # One rank per host: alignment cannot be measured before offsets are known, so
        # trust the DDP convention that the collective ends backward.
        sync = "backward"

    offsets: dict[str, float] = {h: 0.0 for h in hosts}
    method = "single host: start_unix_ns compared directly" if not multi_host else ""
    if multi_host and sync is not None:
        con.execute("CREATE OR REPLACE TEMP TABLE sync_ends (host_id BIGINT, step BIGINT, end_t DOUBLE)")
        names = sorted(hosts)
        fill("sync_ends", SYNC_ENDS, {"sync": sync, "hosts": names})
        rows = con.execute(
            """WITH med AS (SELECT step, median(end_t) AS m FROM sync_ends GROUP BY 1)
               SELECT host_id, median(end_t - m) FROM sync_ends JOIN med USING (step) GROUP BY 1
               ORDER BY 1"""
        ).fetchall()
        con.execute("DROP TABLE sync_ends")
        offsets = {names[i - 1]: float(o) for i, o in rows}
        method = (f"{len(hosts)} hosts: per-host clock offsets estimated from the common end "
                  f"of '{sync}' (median over steps)")
    elif multi_host:
        method = (f"{len(hosts)} hosts and no synchronising phase: clocks compared as "
                  "recorded (offsets unknown)")
    con.execute("CREATE OR REPLACE TABLE host_offsets (host VARCHAR, off DOUBLE)")
    if offsets:
        # One statement: executemany runs one INSERT per host (seconds at 10^3 hosts).
        con.execute("INSERT INTO host_offsets SELECT unnest(?::VARCHAR[]), unnest(?::DOUBLE[])",
                    [list(offsets), list(offsets.values())])
    # A view: only the timeline fallback and the Perfetto export read it (the table was
    # 10^7 rows written at 10^8 phase samples, ~1.4 s CPU, for no reader on most runs).
    con.execute(
        """CREATE OR REPLACE VIEW aligned_steps AS
           SELECT s.rank, s.step, s.host, s.t0 - coalesce(h.off, 0.0) AS t, s.step_ms
           FROM steps s LEFT JOIN host_offsets h USING (host)"""
    )
    arrival = sync
    if sync is not None:
        child = con.execute(
            f"""SELECT name FROM phases WHERE parent = $sync GROUP BY name
                HAVING count(DISTINCT rank) = {n_ranks} ORDER BY count(*) DESC""", {"sync": sync}
        ).fetchall()
        for (name,) in child:
            if _COMM_NAME.search(name):
                arrival = name
                break
    spread = spreads.get(sync) if sync else None
    return Alignment(sync, arrival, sync is not None, method, offsets, spread)


def build_timeline_waits(con: Any, al: Alignment) -> None:
    """Table ``timeline_waits`` (rank, step, wait_ms): arrival gaps on the aligned timeline.

    Only a fallback for records without any collective timing (no ``collectives`` section,
    no ``grad_sync`` phase): it compares clocks across ranks, which the wait rule never does.
    """
    if al.sync_phase is None:
        con.execute(
            "CREATE OR REPLACE TABLE timeline_waits AS SELECT rank, step, CAST(0 AS DOUBLE) AS wait_ms "
            "FROM aligned_steps"
        )
        return
    nested = al.arrival != al.sync_phase
    parent = "p.parent = $sync" if nested else "p.parent IS NULL"
    con.execute(
        f"""CREATE OR REPLACE TABLE arrivals AS
            SELECT aligned_steps.rank, aligned_steps.step, aligned_steps.t + p.s AS a, p.e - p.s AS dur
            FROM aligned_steps JOIN phases p USING (rank, step)
            WHERE p.name = $arrival AND {parent}""",
        {"arrival": al.arrival, **({"sync": al.sync_phase} if nested else {})}
    )
    con.execute(
        """CREATE OR REPLACE TABLE timeline_waits AS
           WITH last AS (SELECT step, max(a) AS l FROM arrivals GROUP BY 1)
           SELECT aligned_steps.rank, aligned_steps.step,
                  CAST(coalesce(least(greatest(last.l - arrivals.a, 0.0),
                                      greatest(arrivals.dur, 0.0)), 0.0) AS DOUBLE)
                      AS wait_ms
           FROM aligned_steps LEFT JOIN arrivals USING (rank, step) LEFT JOIN last USING (step)"""
    )
    con.execute("DROP TABLE arrivals")
