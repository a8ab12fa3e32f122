"""Who waited in which collective: tables ``collective_waits`` and ``step_waits``, and the report's
collectives view.

The one wait rule (:mod:`stepscope.common.waits`) applied per (step, phase path, op, group)
to the records' ``collectives`` sections plus every ``grad_sync`` phase (DDP's bucketed
all-reduce); point-to-point links by their two ends (:mod:`stepscope.analysis.pipeline`).
"""

from __future__ import annotations

from typing import Any

from stepscope.analysis.align import Alignment, build_timeline_waits
from stepscope.analysis.blocks import BLOCK_RECORDS, in_block, rank_blocks
from stepscope.analysis.load import phase_keys_unique
from stepscope.analysis.pipeline import IS_P2P, build_p2p_waits
from stepscope.analysis.stats import phase_order
from stepscope.common.waits import sql_wait_grouped

GRAD_SYNC = "grad_sync"
DDP_OP = "ddp_allreduce"
DDP_PG = "ddp"

#: The waits' table is built a block of ranks at a time, blocks of this share of
#: :data:`~stepscope.analysis.blocks.BLOCK_RECORDS` records (~2.5*10^5: in-cache keys).
_WAIT_BLOCK_SHARE = 4

#: Bus-bandwidth factors (NCCL-tests convention), by op, for a group of n ranks.
_BUS_FACTOR: dict[str, Any] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "allreduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}

WAIT_RULE = ("wait = time in a matched collective minus the shortest time any rank of its group "
             "spent in it (per step, phase, op, group); own work = phase time minus the waits "
             "inside it")


def sql_literal(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _grad_sync_keyed(con: Any) -> bool:
    """Whether every ``grad_sync`` row of ``phases`` is the only one of its (rank, step,
    parent) (no record lists a path twice: table ``duplicate_paths`` from analysis/load.py, and
    each such path is its parent's + ``/grad_sync``) and no recorded collective has DDP's op
    and group, so ``collective_calls`` need not group those rows."""
    if not phase_keys_unique(con):
        return False
    # A path is a key; it names its parent only where it is the parent's path + the name (a
    # record's own path may be another: two such paths could share a parent).
    return not con.execute(
        f"""SELECT (SELECT count(*) FROM collectives WHERE op = '{DDP_OP}' AND pg = '{DDP_PG}')
                   + (SELECT count(*) FROM phases WHERE name = '{GRAD_SYNC}'
                      AND path IS DISTINCT FROM (CASE WHEN parent IS NULL THEN name
                                                      ELSE parent || '/' || name END))"""
    ).fetchone()[0]


def build_waits(con: Any, n_ranks: int, al: Alignment,
                info: list[str] | None = None) -> tuple[str, list[str]]:
    """Tables ``collective_waits`` (one row per rank, step, phase, op, pg with its ``wait``) and
    ``step_waits``. A collective's ``ms`` there is its exposed time (all of it on the step's
    stream or the host), its ``hidden_ms`` the time it ran beside compute: the wait rule and
    own work take only the exposed part.

    ``step_waits`` (rank, step, wait_ms, comm_ms) is each rank's total wait per step and the rest
    of its time in collectives. Returns the wait
    source and notes on partitions that could not be matched.
    """
    gs = f"""SELECT rank, step, parent, '{DDP_OP}', '{DDP_PG}', {n_ranks}, calls, NULL, ms,
                    NULL, NULL, 0.0 FROM phases WHERE name = '{GRAD_SYNC}'"""
    # A collective's time taken from its phase is its exposed part (the step's stream waited
    # for it); the part hidden beside compute is kept apart. Records made before the split
    # have no exposed_ms: all their time is exposed, as it was counted then.
    colls = f"""SELECT rank, step, phase, op, pg, coalesce(pg_size, {n_ranks}) AS pg_size, count,
                       bytes, least(coalesce(exposed_ms, ms), ms) AS ms, seq_first, seq_last,
                       greatest(ms - coalesce(exposed_ms, ms), 0.0) AS hidden_ms
                FROM collectives"""

    def grouped(rows: str) -> str:
        return f"""SELECT rank, step, phase, op, pg, max(pg_size) AS pg_size, sum(count) AS count,
                          sum(bytes) AS bytes, sum(ms) AS ms, min(seq_first) AS seq_first,
                          max(seq_last) AS seq_last, sum(hidden_ms) AS hidden_ms
                   FROM ({rows}) GROUP BY 1, 2, 3, 4, 5"""

    if _grad_sync_keyed(con):
        # Each grad_sync phase is its own (rank, step, parent) and no recorded collective
        # shares its op and group: those rows are their own groups, so only the collectives
        # are grouped (a group-by over the 10^7 grad_sync rows at 10^8 phase samples gave
        # back the rows it was given). The union takes the grouped columns' types.
        con.execute(f"CREATE OR REPLACE TABLE collective_calls AS {grouped(colls)} UNION ALL {gs}")
    else:
        con.execute(f"CREATE OR REPLACE TABLE collective_calls AS {grouped(f'{colls} UNION ALL {gs}')}")
    notes: list[str] = []
    n_calls, n_coll = con.execute(
        f"SELECT count(*), count(*) FILTER (WHERE op <> '{DDP_OP}') FROM collective_calls").fetchone()
    # A group is expected on as many ranks as its size, capped by the ranks that ever
    # recorded it (a rank file or a rank's collective timing may be missing).
    con.execute(
        """CREATE OR REPLACE TABLE group_ranks AS
           SELECT pg, least(max(pg_size), count(DISTINCT rank)) AS n, max(pg_size) AS size,
                  count(DISTINCT rank) AS seen FROM collective_calls GROUP BY 1"""
    )
    for pg, size, seen in con.execute(
        "SELECT pg, size, seen FROM group_ranks WHERE seen < size ORDER BY 1").fetchall():
        if pg == DDP_PG and seen == n_ranks:
            continue
        notes.append(
            f"collectives of group {pg!r} (size {size}) recorded on {seen} rank(s) only: waits "
            "are computed among those (under-stated if a missing rank was the late one)")
    build_p2p_waits(con)  # point-to-point links: their two ends, not the group
    # Each instance (step, phase, op, pg) grouped once and joined back to its ranks' rows:
    # whether it matched, whether its sequence numbers differ, and its shortest time, the
    # same values as a window partitioned by it, without sorting every collective.
    con.execute(
        f"""CREATE OR REPLACE TABLE collective_waits AS
            WITH g AS (SELECT step, coalesce(phase, '') AS ph, op, pg, count(*) AS n,
                              min(count) = max(count) AS same_count,
                              min(seq_first) IS DISTINCT FROM max(seq_first) AS seq_shift,
                              min(ms) AS lo
                       FROM collective_calls WHERE NOT {IS_P2P} GROUP BY 1, 2, 3, 4)
            SELECT c.*, g.n = e.n AND g.same_count AS matched, g.seq_shift,
                   CASE WHEN g.n = e.n AND g.same_count THEN {sql_wait_grouped('c.ms', 'g.lo')}
                        ELSE CAST(0.0 AS DOUBLE) END AS wait
            FROM collective_calls c JOIN group_ranks e USING (pg)
                 JOIN g ON c.step = g.step AND coalesce(c.phase, '') = g.ph AND c.op = g.op
                           AND c.pg = g.pg
            WHERE NOT c.{IS_P2P}
            UNION ALL BY NAME SELECT * FROM p2p_waits"""
    )
    con.execute("DROP TABLE p2p_waits")
    bad = con.execute(
        """SELECT count(*), count(DISTINCT step), string_agg(DISTINCT op || '@' || pg, ', ')
            FROM (SELECT DISTINCT step, phase, op, pg FROM collective_waits WHERE NOT matched)"""
    ).fetchone()
    if bad[0]:
        notes.append(
            f"{bad[0]} collective group(s) on {bad[1]} step(s) ({bad[2]}) were not recorded on "
            "every rank of their group or with different call counts (a rank skipped or added "
            "a call): their time is not counted as waiting")
    shifted = con.execute(
        "SELECT count(DISTINCT step) FROM collective_waits WHERE matched AND seq_shift").fetchone()[0]
    if shifted:
        notes.append(
            f"collective sequence numbers differ across ranks on {shifted} step(s) (a rank "
            "issued extra or fewer calls earlier); calls were matched by step and phase")
    source = "collectives" if n_coll else "grad_sync" if n_calls else "none"
    if info is None:
        info = []
    n_gs, n_bw = con.execute(
        f"""SELECT count(*) FILTER (WHERE op = '{DDP_OP}'),
                   count(*) FILTER (WHERE phase = 'backward' OR starts_with(phase, 'backward/'))
            FROM collective_calls"""
    ).fetchone()
    if n_calls and not n_gs and not n_bw and n_ranks > 1 and al.sync_phase == "backward":
        # Collectives recorded elsewhere, but none in backward and no grad_sync phase
        # (e.g. Lightning's callback): DDP's all-reduce still ends backward, unseen. Its
        # wait comes from arrival gaps on the aligned timeline, as for records without
        # collective timing.
        build_timeline_waits(con, al)
        con.execute(
            f"""INSERT INTO collective_waits (rank, step, phase, op, pg, pg_size, count, ms, matched,
                                seq_shift, wait)
                SELECT rank, step, 'backward', 'arrival_gap', 'timeline', {n_ranks}, 1,
                       wait_ms, TRUE, FALSE, wait_ms FROM timeline_waits"""
        )
        con.execute("DROP TABLE timeline_waits")
        source = "collectives+timeline"
        info.append("no grad_sync phase: DDP's all-reduce wait in backward is estimated from "
                    "arrival gaps on the aligned timeline (clocks compared across ranks)")
    if not n_calls and n_ranks > 1 and al.sync_phase is not None:
        # No collective timing at all: fall back to arrival gaps on the aligned timeline.
        build_timeline_waits(con, al)
        con.execute(
            f"""INSERT INTO collective_waits (rank, step, phase, op, pg, pg_size, count, ms, matched,
                                seq_shift, wait)
                SELECT rank, step, {sql_literal(al.sync_phase)}, 'arrival_gap', 'timeline', {n_ranks}, 1,
                       wait_ms, TRUE, FALSE, wait_ms FROM timeline_waits"""
        )
        con.execute("DROP TABLE timeline_waits")
        source = "timeline"
    # The step's step_ms and residual_ms ride along: the readers of step_waits (rank_stats,
    # goodput) need no join back to steps.
    # comm_ms (time in collectives beyond the waits) for goodput's exposed_comm: the same
    # group-by over collective_waits, taken once, then joined to the steps (one row per (rank, step), so
    # grouping before the join gives the same sums and joins far fewer rows).
    # A small block of ranks at a time (collective_waits's and steps' rows lie rank by rank, so each
    # block reads its own row groups): a hash table of ~2.5*10^5 keys stays in cache; one
    # of 10^7 (every (rank, step) at 10^8 phase samples) took 4.2 s CPU, the blocks 2.7.
    for k, b in enumerate(rank_blocks(con, max(1, BLOCK_RECORDS // _WAIT_BLOCK_SHARE))):
        con.execute(
            f"""{'INSERT INTO step_waits' if k else 'CREATE OR REPLACE TABLE step_waits AS'}
                SELECT s.rank, s.step, CAST(coalesce(c.w, 0.0) AS DOUBLE) AS wait_ms,
                       CAST(coalesce(c.x, 0.0) AS DOUBLE) AS comm_ms, s.step_ms, s.residual_ms
                FROM steps s LEFT JOIN (SELECT rank, step, sum(wait) AS w,
                                               sum(greatest(ms - wait, 0.0)) AS x
                                        FROM collective_waits WHERE {in_block('rank', b)} GROUP BY 1, 2) c
                     USING (rank, step)
                WHERE {in_block('s.rank', b)}"""
        )
    return source, notes


def _bus_factor(op: str, n: int) -> float | None:
    if n < 1:
        return None
    for key, f in _BUS_FACTOR.items():
        if op == key or op.startswith(key + "_"):
            return float(f(n))
    return 2.0 * (n - 1) / n if op == DDP_OP else None


def collectives_section(con: Any, source: str, notes: list[str]) -> dict[str, Any]:
    """The report's ``collectives`` view: per op and process group, per step and rank.

    ``bus_gbps`` follows NCCL-tests (algorithm bandwidth = bytes / transfer time, times
    2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all), with
    ``bytes`` the full buffer of a call as recorded and the transfer time the part not spent
    waiting (time in the collective minus wait). None where bytes are unknown (DDP's
    all-reduce) or nothing was matched. ``ms_per_step`` is the whole time in the collective,
    ``hidden_ms_per_step`` the part of it that ran beside compute on a side stream.
    """
    n_steps = con.execute("SELECT count(DISTINCT step) FROM steps").fetchone()[0] or 1
    ops: list[dict[str, Any]] = []
    for (op, pg, size, ranks, calls, nbytes, ms, wait, phases, m_bytes, m_xfer,
         matched, hidden) in con.execute(
        """SELECT op, pg, max(pg_size), count(DISTINCT rank), sum(count), sum(bytes),
                  sum(ms + coalesce(hidden_ms, 0.0)) AS total,
                  sum(wait), list(DISTINCT coalesce(phase, 'residual')),
                  sum(bytes) FILTER (WHERE matched),
                  sum(ms + coalesce(hidden_ms, 0.0) - wait) FILTER (WHERE matched),
                  sum(count) FILTER (WHERE matched), sum(coalesce(hidden_ms, 0.0))
           FROM collective_waits WHERE pg <> 'timeline' GROUP BY 1, 2 ORDER BY total DESC"""
    ).fetchall():
        per = float(ranks * n_steps)
        bus = None
        factor = _bus_factor(str(op), int(size or 0))
        if factor is not None and m_bytes and m_xfer and m_xfer > 0:
            bus = round(factor * float(m_bytes) / float(m_xfer) / 1e6, 3)
        ops.append({
            "op": op, "pg": pg, "pg_size": int(size or 0), "ranks": int(ranks),
            "phases": phase_order(list(phases)),
            "calls_per_step": round(float(calls) / per, 3),
            "bytes_per_step": None if nbytes is None else round(float(nbytes) / per, 1),
            "ms_per_step": round(float(ms) / per, 3),
            "wait_ms_per_step": round(float(wait) / per, 3),
            "wait_share": round(float(wait) / float(ms), 4) if ms else 0.0,
            "hidden_ms_per_step": round(float(hidden) / per, 3),
            "matched_share": round(float(matched or 0) / float(calls), 4) if calls else 0.0,
            "bus_gbps": bus,
        })
    return {"source": source, "wait_rule": WAIT_RULE, "ops": ops, "notes": list(notes)}
