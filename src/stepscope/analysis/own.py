"""Each rank's own work per phase and step, and the median of the *other* ranks' at that step.

Relations built on the run's connection (after :func:`stepscope.analysis.collwaits.build_waits`
made ``cw``):

``pw`` (rank, step, path, parent, ms, wait, ncoll, coll_ms): every phase path with the
       waits and the time of the collectives inside it at any depth (a view over ``phases``
       and table ``cin``; readers select their block or path with :func:`pw_select`).
``ex`` (rank, step, name, own, wait, others, excess): top-level phases and ``residual``;
       ``own`` is the phase time less its waits, ``others`` the median own work of the other
       ranks at that step, ``excess`` the gap (a view over the own-work rows and each
       (step, name) cell's middle values on the dense path; a table on the row-wise path).

:func:`phase_waits` adds each phase's wait and own/work shares to the report from them.

Shape: hash joins and group-bys only, no window sorts. A collective is credited to its
phase and each ancestor by expanding its path into its prefixes (one equi-join, instead of a
prefix-match join). The median of the others per (step, phase) needs only the two or three
middle order statistics of that cell (taken in numpy, one sort of the column): which one a
rank gets depends only on whether its own value lies below, at or above them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stepscope.analysis import blocks, grouped
from stepscope.analysis.blocks import in_block, rank_blocks, step_blocks
from stepscope.analysis.stats import H2D_HIDDEN, PHASE_SUMS, RESIDUAL


def build_pw(con: Any) -> None:
    """View ``pw``: each phase path with the waits, count and time of collectives inside it
    (table ``cin``: the collectives' sums per rank, step and enclosing path)."""
    # A collective in 'a/b/c' is inside phases 'a', 'a/b' and 'a/b/c': its path and every
    # prefix ending before a '/' (exactly the paths p with phase = p or phase LIKE p || '/%').
    # The list expression only for paths with a '/' (a lambda per row of cw was a quarter of
    # this stage at 10^8 samples, where every collective sits in a top-level phase).
    con.execute(
        """CREATE OR REPLACE TEMP TABLE cin AS
           SELECT rank, step, anc, sum(wait) AS wait, count(*) AS n, sum(ms) AS ms FROM (
               SELECT rank, step, wait, ms, phase AS anc FROM cw WHERE phase IS NOT NULL
               UNION ALL
               SELECT rank, step, wait, ms,
                      unnest(list_transform(
                          list_filter(range(2, length(phase) + 1),
                                      lambda i: substr(phase, i, 1) = '/'),
                          lambda i: substr(phase, 1, i - 1))) AS anc
               FROM cw WHERE contains(phase, '/'))
           GROUP BY 1, 2, 3"""
    )
    # A view, not a table: every phase row with its collectives is 10^8 rows at scale,
    # written to disk and read back whole by each reader. The readers select a block of
    # steps or ranks, or one path (:func:`pw_select`), from both sides of the join.
    con.execute(f"CREATE OR REPLACE TEMP VIEW pw AS {pw_select(con)}")


def pw_select(con: Any, keys: str = "TRUE", paths: str | None = None, top: bool = False) -> str:
    """SQL for ``pw``'s rows: ``keys`` a condition on ``rank``/``step`` (both tables have
    them), ``paths`` an SQL list of VARCHAR the path is one of, ``top`` top-level phases only."""
    cp = f"list_contains({paths}, path)" if paths is not None else "TRUE"
    cc = f"list_contains({paths}, anc)" if paths is not None else "TRUE"
    top_p = "parent IS NULL" if top else "TRUE"
    src = f"""FROM (SELECT rank, step, path, parent, ms FROM phases
                  WHERE {keys} AND {cp} AND {top_p}) p
              LEFT JOIN (SELECT rank, step, anc, wait, n, ms FROM cin WHERE {keys} AND {cc}) c
                ON c.rank = p.rank AND c.step = p.step AND c.anc = p.path"""
    if _phase_keys_unique(con):
        # (rank, step, path) is a key of phases and cin: a group-by would group single
        # rows, so a plain join gives the same rows and values.
        return f"""SELECT p.rank, p.step, p.path, p.parent, p.ms,
                          CAST(coalesce(c.wait, 0.0) AS DOUBLE) AS wait,
                          CAST(coalesce(c.n, 0) AS BIGINT) AS ncoll,
                          CAST(coalesce(c.ms, 0.0) AS DOUBLE) AS coll_ms
                   {src}"""
    return f"""SELECT p.rank, p.step, p.path, any_value(p.parent) AS parent,
                      any_value(p.ms) AS ms,
                      CAST(coalesce(sum(c.wait), 0.0) AS DOUBLE) AS wait,
                      CAST(coalesce(sum(c.n), 0) AS BIGINT) AS ncoll,
                      CAST(coalesce(sum(c.ms), 0.0) AS DOUBLE) AS coll_ms
               {src}
               GROUP BY 1, 2, 3"""


def _has_table(con: Any, name: str) -> bool:
    return bool(con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?",
                            [name]).fetchone()[0])


def _phase_keys_unique(con: Any) -> bool:
    """Whether no record lists a phase path twice (table ``phase_dups`` from analysis/load.py;
    tables made by hand have none: not known, so no)."""
    if not con.execute("SELECT count(*) FROM information_schema.tables "
                       "WHERE table_name = 'phase_dups'").fetchone()[0]:
        return False
    return int(con.execute("SELECT n FROM phase_dups").fetchone()[0]) == 0


@dataclass
class DenseOwn:
    """Own work and its gap to the other ranks as one ranks × steps matrix per phase (NaN:
    no row, or no gap); row ``i`` is rank ``ranks[i]``, column ``j`` step ``steps[j]``."""

    ranks: Any
    steps: Any
    own: list[Any]
    excess: list[Any]


@dataclass
class OwnColumns:
    """The rows of ``ex`` with an excess, as numpy columns (row order unspecified):
    ``nid`` indexes ``names``. With ``dense`` set the columns are empty and the same rows
    are the matrices' non-NaN cells."""

    names: list[str]
    rank: Any
    nid: Any
    step: Any
    own: Any
    excess: Any
    dense: DenseOwn | None = None


def build_own(con: Any) -> OwnColumns:
    """``pw`` (waits inside each phase path) and ``ex`` (own work vs the other ranks).

    ``ex`` (rank, step, name, own, wait, others, excess): top-level phases and residual;
    ``others`` is the median own work of the *other* ranks at that step, ``excess`` the gap.
    Returns ex's rows that have an excess as numpy columns (the gap series' source).
    """
    build_pw(con)
    dense = _own_dense(con)
    if dense is not None:  # ex a view over the matrices' middle values, no own table
        return dense
    con.execute(f"CREATE OR REPLACE TEMP TABLE own AS {_own_sql(con, None)}")
    cols = _middles(con)
    _drop_ex(con)
    con.execute(f"CREATE TABLE ex AS {_ex_sql('SELECT * FROM own', 'mid')}")
    con.execute("DROP TABLE own")
    con.execute("DROP TABLE mid")
    return cols


def _own_sql(con: Any, timed: str | None) -> str:
    """The rows of own work: top-level phases of ``pw`` less their waits, and residual less
    the waits outside any phase. ``timed``: a table of the (step, name) cells where some rank
    has a collective timing (None: found here)."""
    cells = ("(SELECT step, name FROM top GROUP BY 1, 2 HAVING max(ncoll) > 0)"
             if timed is None else timed)
    return f"""WITH top AS (SELECT rank, step, path AS name, greatest(ms - wait, 0.0) AS own,
                                   wait, ncoll FROM ({pw_select(con, top=True)}))
            SELECT top.rank, top.step, top.name, top.own, top.wait
            FROM top LEFT JOIN {cells} timed ON timed.step = top.step AND timed.name = top.name
            -- A rank with no collective timing in a phase where others have some: its
            -- waits are unknown, so its own work there is not compared.
            WHERE top.ncoll > 0 OR timed.step IS NULL
            UNION ALL
            SELECT s.rank, s.step, '{RESIDUAL}', greatest(s.residual_ms - coalesce(r.w, 0.0), 0.0),
                   coalesce(r.w, 0.0)
            FROM steps s LEFT JOIN (SELECT rank, step, sum(wait) AS w FROM cw
                                    WHERE phase IS NULL GROUP BY 1, 2) r USING (rank, step)"""


def _ex_sql(own: str, mid: str) -> str:
    """``ex``'s rows from the own-work rows ``own`` and their cells' middle values ``mid``
    (:func:`_middles`). Removing a rank's value from its cell leaves a median that depends
    only on where that value lies against the cell's middle values (ties give the same
    multiset either way): :func:`_others`' rule."""
    return f"""SELECT rank, step, name, own, wait, others, own - others AS excess FROM (
               SELECT o.rank, o.step, o.name, o.own, o.wait,
                      CASE WHEN m.n < 2 THEN NULL
                           WHEN m.n % 2 = 0 THEN CASE WHEN o.own > m.p THEN m.p ELSE m.q END
                           WHEN o.own < m.m THEN 0.5 * (m.m + m.q)
                           WHEN o.own > m.m THEN 0.5 * (m.p + m.m)
                           ELSE 0.5 * (m.p + m.q)
                      END AS others
               FROM ({own}) o JOIN {mid} m USING (step, name))"""


def _drop_ex(con: Any) -> None:
    """Drop ``ex``, a table (grouped path) or a view (dense path), wherever it is."""
    for cat, schema, kind in con.execute(
            "SELECT table_catalog, table_schema, table_type FROM information_schema.tables "
            "WHERE table_name = 'ex'").fetchall():
        con.execute(f"DROP {'VIEW' if kind == 'VIEW' else 'TABLE'} \"{cat}\".\"{schema}\".ex")


def _middles(con: Any) -> OwnColumns:
    """Table ``mid`` (step, name, n, p, m, q): per (step, name) cell of ``own`` with n values
    sorted as S, for even n: p = S[n/2 - 1], q = S[n/2]; for odd n (c = (n - 1) / 2):
    p = S[c - 1], m = S[c], q = S[c + 1] (NULL where the cell is too small)."""
    names = [str(n) for (n,) in con.execute("SELECT DISTINCT name FROM own ORDER BY 1").fetchall()]
    cols = con.execute(
        "SELECT rank, step, list_position($names, name) - 1 AS nid, own FROM own",
        {"names": names}).fetchnumpy()
    n_names = max(len(names), 1)
    ustep = np.asarray([s for (s,) in con.execute("SELECT DISTINCT step FROM own ORDER BY 1").fetchall()],
                       dtype=np.int64)
    step = np.asarray(cols["step"], dtype=np.int64)
    nid = np.asarray(cols["nid"], dtype=np.int64)
    own = np.asarray(cols["own"], dtype=np.float64)
    rank = np.asarray(cols["rank"], dtype=np.int64)
    del cols
    gid = np.searchsorted(ustep, step) * n_names + nid
    order, starts_all, counts_all = grouped.group_order(gid, len(ustep) * n_names)
    has = np.flatnonzero(counts_all > 0)
    starts, counts = starts_all[has], counts_all[has]

    def positions(n: int) -> list[int]:  # p, m, q of the docstring (-1: none)
        at = _positions_of(np.int64(n))
        return [int(at[2 * k]) if at[2 * k + 1] else -1 for k in range(3)]

    pa, ma, qa = grouped.order_stats(own[order], starts, counts, positions)
    del order
    _write_mid(con, ustep[has // n_names], [names[int(i)] for i in (has % n_names).tolist()],
               counts, pa, ma, qa)
    cell = np.full(len(counts_all), -1, dtype=np.int64)
    cell[has] = np.arange(len(has))
    at = cell[gid]
    del gid, cell
    n = counts[at]
    others = _others(own, n, pa[at], ma[at], qa[at])
    keep = n >= 2
    return OwnColumns(names, rank[keep], nid[keep], step[keep], own[keep],
                      own[keep] - others[keep])


def _positions_of(n: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
    """:func:`_middles`' p, m, q positions for cell sizes ``n`` (an array), each with where it
    lies inside its cell."""
    c = (n - 1) // 2
    even = n % 2 == 0
    big = n >= 3
    return (np.where(even, c, c - 1), even | big, c, ~even, c + 1, even | big)


def _others(own: Any, n: Any, pv: Any, mv: Any, qv: Any) -> Any:
    """The median of the other values of each value's cell, from the cell's size ``n`` and its
    p, m, q (:func:`_middles`): the same rule as ex's SQL, on numpy columns or matrices."""
    with np.errstate(invalid="ignore"):
        return np.where(
            n % 2 == 0, np.where(own > pv, pv, qv),
            np.where(own < mv, 0.5 * (mv + qv),
                     np.where(own > mv, 0.5 * (pv + mv), 0.5 * (pv + qv))))


def median_of_others(cell: Any, values: Any, n_cells: int) -> Any:
    """For each value, the median of the *other* values of its cell (cell ids
    ``0..n_cells-1``; NaN where the cell holds it alone): the cell's middle order statistics
    and :func:`_others`, the rule ``ex`` is built by, for any cells (ranks at a step)."""
    v = np.asarray(values, dtype=np.float64)
    cell = np.asarray(cell, dtype=np.int64)
    order, starts, counts = grouped.group_order(cell, n_cells)

    def positions(n: int) -> list[int]:  # p, m, q of _middles (-1: none)
        at = _positions_of(np.int64(n))
        return [int(at[2 * k]) if at[2 * k + 1] else -1 for k in range(3)]

    pa, ma, qa = grouped.order_stats(v[order], starts, counts, positions)
    n = counts[cell]
    return np.where(n >= 2, _others(v, n, pa[cell], ma[cell], qa[cell]), np.nan)


def _write_mid(con: Any, step: Any, name: list[str], n: Any, p: Any, m: Any, q: Any,
               table: str = "mid") -> None:
    """Table ``mid`` (step, name, n, p, m, q) from columns; NaN order statistics are NULL."""
    pq = ([None if x != x else float(x) for x in a.tolist()] for a in (p, m, q))  # x != x: NaN
    con.execute(f"CREATE OR REPLACE TEMP TABLE {table} (step BIGINT, name VARCHAR, n BIGINT, "
                "p DOUBLE, m DOUBLE, q DOUBLE)")
    con.execute(
        f"INSERT INTO {table} SELECT unnest(?::BIGINT[]), unnest(?::VARCHAR[]), unnest(?::BIGINT[]), "
        "unnest(?::DOUBLE[]), unnest(?::DOUBLE[]), unnest(?::DOUBLE[])",
        [np.asarray(step).tolist(), name, np.asarray(n).tolist(), *pq])


def _own_dense(con: Any) -> OwnColumns | None:
    """The own-work and gap matrices (one ranks × steps matrix per phase), a block of steps
    at a time, and ``ex`` as a view, when every (rank, step, phase) has at most one row and
    the matrices are not much larger than the rows; None otherwise (the grouped path).

    Each block's top-level rows of ``pw`` and residual rows are read once (rank, step,
    phase id, own, timing); the rows :func:`build_own`'s ``own`` table keeps are those with
    a collective timing, or in a (step, phase) cell where no rank has one. A sort down each
    step's column of a phase's block gives the cell's middle values, :func:`_others` the
    median of the other ranks. ``ex`` is not written: it is the view :func:`_ex_sql` over
    the own-work rows and the cells' middle values (table ``ex_mid``) and timed cells
    (``ex_timed``), the grouped path's statement (10^8 rows written to the database file
    cost more than the rest of this stage; its readers filter a phase, a rank or residual).
    Memory: the own-work and gap matrices kept for the series (8 bytes per (rank, step,
    phase)) plus one block's rows."""
    names = sorted({str(n) for (n,) in con.execute(  # pw's paths are phases'
        "SELECT DISTINCT path FROM phases WHERE parent IS NULL").fetchall()})
    n_steps_rows = int(con.execute("SELECT count(*) FROM steps").fetchone()[0])
    if n_steps_rows:
        if RESIDUAL in names:
            return None  # a user phase named residual shares the residual's cells
        names = sorted([*names, RESIDUAL])
    n_top = int(con.execute(  # pw has phases' rows when (rank, step, path) is their key
        "SELECT count(*) FROM phases WHERE parent IS NULL" if _phase_keys_unique(con)
        else f"SELECT count(*) FROM ({pw_select(con, top=True)})").fetchone()[0])
    ranks = np.asarray([r for (r,) in con.execute(
        "SELECT DISTINCT rank FROM steps ORDER BY 1").fetchall()], dtype=np.int64)
    ustep = np.asarray([s for (s,) in con.execute(
        "SELECT DISTINCT step FROM steps ORDER BY 1").fetchall()], dtype=np.int64)
    n_r, n_s, n_n = len(ranks), len(ustep), len(names)
    n_rows = n_top + n_steps_rows  # own's rows at most (the timing rule keeps some fewer)
    if not n_rows or not n_r or n_r * n_s * n_n > 2 * n_rows + 1_000_000:
        return None  # sparse (ranks on different steps): the grouped path holds only rows
    owns = [np.full((n_r, n_s), np.nan, dtype=KEEP_DTYPE) for _ in names]
    gaps = [np.full((n_r, n_s), np.nan, dtype=KEEP_DTYPE) for _ in names]
    res_id = names.index(RESIDUAL) if RESIDUAL in names else -1
    mids: list[tuple[Any, ...]] = []  # (step, name id, n, p, m, q) of each block and phase
    timed_cells: list[tuple[Any, Any]] = []  # (step, name id) with a collective timing
    for b in step_blocks(con, max(1, blocks.BLOCK_RECORDS // _READ_SHARE)):
        blk = in_block("step", b)
        top = con.execute(
            f"""SELECT rank, step, list_position($names, path) - 1 AS nid,
                       greatest(ms - wait, 0.0) AS own, ncoll > 0 AS timed
                FROM ({pw_select(con, blk, top=True)})""", {"names": names}).fetchnumpy()
        res = con.execute(
            f"""SELECT s.rank, s.step, greatest(s.residual_ms - coalesce(r.w, 0.0), 0.0) AS own
                FROM (SELECT rank, step, residual_ms FROM steps WHERE {blk}) s
                LEFT JOIN (SELECT rank, step, sum(wait) AS w FROM cw
                           WHERE phase IS NULL AND {blk} GROUP BY 1, 2) r USING (rank, step)"""
        ).fetchnumpy()
        rank = np.concatenate([np.asarray(top["rank"], dtype=np.int64),
                               np.asarray(res["rank"], dtype=np.int64)])
        step = np.concatenate([np.asarray(top["step"], dtype=np.int64),
                               np.asarray(res["step"], dtype=np.int64)])
        nid = np.concatenate([np.asarray(top["nid"], dtype=np.int64),
                              np.full(len(res["rank"]), res_id, dtype=np.int64)])
        own = np.concatenate([np.asarray(top["own"], dtype=np.float64),
                              np.asarray(res["own"], dtype=np.float64)])
        timed = np.concatenate([np.asarray(top["timed"], dtype=bool),
                                np.ones(len(res["rank"]), dtype=bool)])
        del top, res
        if np.isnan(own).any():
            return None
        ri = np.searchsorted(ranks, rank)
        c0 = int(np.searchsorted(ustep, b[0], side="left"))
        c1 = int(np.searchsorted(ustep, b[1], side="right"))
        ci = np.searchsorted(ustep, step)
        if len(rank) and (int(ri.max()) >= n_r or int(ci.max()) >= n_s
                          or not np.array_equal(ranks[ri], rank)
                          or not np.array_equal(ustep[ci], step)):
            return None  # a phase row of a (rank, step) steps does not hold
        del rank, step
        w = c1 - c0
        ci -= c0
        # A rank with no collective timing in a phase where others have some at that step:
        # its waits are unknown, so its own work there is not compared (not in ex).
        cell = nid * w + ci
        any_timed = np.zeros(n_n * w, dtype=bool)
        any_timed[cell[np.flatnonzero(timed & (nid != res_id))]] = True
        keep = timed | ~any_timed[cell]
        at_timed = np.flatnonzero(any_timed)
        timed_cells.append((ustep[c0:c1][at_timed % w], at_timed // w))
        del cell, any_timed, timed
        if not keep.all():
            ri, ci, nid, own = ri[keep], ci[keep], nid[keep], own[keep]
        del keep
        for k in range(n_n):
            at = np.flatnonzero(nid == k)
            got = _dense_block(ri[at], ci[at], own[at], owns[k][:, c0:c1], gaps[k][:, c0:c1])
            if got is None:
                return None
            has, *stats = got
            mids.append((ustep[c0:c1][has], np.full(len(has), k, dtype=np.int64), *stats))
    cat = [np.concatenate([m[i] for m in mids]) if mids else np.zeros(0) for i in range(6)]
    _write_mid(con, cat[0], [names[int(i)] for i in cat[1].tolist()], cat[2], cat[3], cat[4],
               cat[5], table="ex_mid")
    t_step = np.concatenate([t[0] for t in timed_cells]) if timed_cells else np.zeros(0, np.int64)
    t_nid = np.concatenate([t[1] for t in timed_cells]) if timed_cells else np.zeros(0, np.int64)
    con.execute("CREATE OR REPLACE TEMP TABLE ex_timed AS SELECT unnest(?::BIGINT[]) AS step, "
                "unnest(?::VARCHAR[]) AS name",
                [t_step.tolist(), [names[int(i)] for i in t_nid.tolist()]])
    _drop_ex(con)
    con.execute(f"CREATE TEMP VIEW ex AS {_ex_sql(_own_sql(con, 'ex_timed'), 'ex_mid')}")
    empty = np.zeros(0, dtype=np.int64)
    return OwnColumns(names, empty, empty, empty, np.zeros(0), np.zeros(0),
                      DenseOwn(ranks, ustep, owns, gaps))


def _dense_block(ri: Any, ci: Any, own: Any, keep_own: Any, keep_gap: Any) -> tuple[Any, ...] | None:
    """One phase's block of steps: store its own work and gap in the run's matrices (views,
    :data:`KEEP_DTYPE`); return the columns that hold a value and their cells' n, p, m, q
    (:func:`_middles`); None when a (rank, step) has two rows."""
    n_r = keep_own.shape[0]
    mat = np.full(keep_own.shape, np.nan)
    mat[ri, ci] = own
    present = ~np.isnan(mat)
    n = np.count_nonzero(present, axis=0)
    if int(n.sum()) != len(own):
        return None  # a (rank, step) twice in one phase: the grouped path counts both
    srt = np.sort(mat, axis=0)  # NaN (no row) last: each column's n values first
    cols_at = np.arange(mat.shape[1])
    stats = []
    pos = _positions_of(n)
    for k in range(3):
        at, ok = pos[2 * k], pos[2 * k + 1]
        vals = srt[np.clip(at, 0, max(n_r - 1, 0)), cols_at]
        stats.append(np.where(ok, vals, np.nan))
    del srt
    pv, mv, qv = stats
    others = _others(mat, n, pv, mv, qv)
    with np.errstate(invalid="ignore"):
        gap = np.where(present & (n >= 2), mat - others, np.nan)
    keep_own[...] = mat
    keep_gap[...] = gap
    has = np.flatnonzero(n > 0)
    return has, n[has], pv[has], mv[has], qv[has]


#: The own-work and gap matrices kept for the series (ex's view computes in float64).
KEEP_DTYPE = np.float32
#: :func:`_own_dense` reads blocks of this share of blocks.BLOCK_RECORDS: a block's rows of
#: every top-level phase, their copies and indices (~80 bytes a row) stay ~100 MB at 10^8.
_READ_SHARE = 4


def phase_waits(con: Any, phases: dict[str, Any]) -> None:
    """Add ``wait_ms`` (median wait inside, per step), ``own_share`` and ``work_share``.

    ``own_share`` is the phase's share of step time once its waits are taken out;
    ``work_share`` takes out all collective time inside it (waits and transfers), so a
    ``dataloader`` that gathers across ranks is judged on its own data time.
    """
    total = con.execute("SELECT sum(step_ms) FROM steps").fetchone()[0] or 0.0
    # Residual work: untimed time minus every collective issued outside a phase (waits and
    # transfers: a pipeline's send/recv is communication, not host overhead).
    con.execute(
        """CREATE OR REPLACE TEMP TABLE rx AS
           SELECT ex.rank, ex.step, ex.wait, ex.own,
                  greatest(ex.own + ex.wait - coalesce(c.ms, 0.0), 0.0) AS work
           FROM ex LEFT JOIN (SELECT rank, step, sum(ms) AS ms FROM cw WHERE phase IS NULL
                              GROUP BY 1, 2) c USING (rank, step)
           WHERE ex.name = 'residual'"""
    )
    rank_step = dict(con.execute("SELECT rank, sum(step_ms) FROM steps GROUP BY 1").fetchall())
    # A path that no collective lies inside has wait and coll_ms 0 on every row: its row is
    # phases' own sums, all such paths in one statement, with no join and no median. Only
    # where (rank, step, path) is phases' key: else pw folds repeated paths (any_value).
    unique = _phase_keys_unique(con)
    inside = [str(a) for (a,) in con.execute("SELECT DISTINCT anc FROM cin ORDER BY 1").fetchall()]
    paths = [str(p) for (p,) in con.execute("SELECT DISTINCT path FROM phases ORDER BY 1").fetchall()]
    plain = ("""SELECT path, {rank}, CAST(0.0 AS DOUBLE), sum(ms), bool_and(parent IS NULL),
                       sum(greatest(ms, 0.0))
                FROM phases WHERE {keys} AND NOT list_contains($inside::VARCHAR[], path)
                GROUP BY {by}""")
    if _has_table(con, PHASE_SUMS) and not {RESIDUAL, H2D_HIDDEN} & set(paths):
        # The same sums, from phase_stats' scans of the same rows (stats.PHASE_SUMS).
        plain = (f"""SELECT name, {{rank}}, CAST(0.0 AS DOUBLE), ms, top, pos FROM {PHASE_SUMS}
                     WHERE {{keys}} AND rank IS {{null}} NULL
                       AND NOT list_contains($inside::VARCHAR[], name)
                       AND NOT list_contains(['{RESIDUAL}', '{H2D_HIDDEN}'], name)""")
    # Over the whole run, one path at a time: an exact median holds every value of its
    # group, and every path at once (10^8 values) ran out of memory at a 1 GB limit.
    rows: list[Any] = []
    for path in paths:
        if unique and path not in inside:
            continue
        rows += con.execute(
            f"""SELECT path, NULL AS rank, median(wait), sum(ms - wait), bool_and(parent IS NULL),
                       sum(greatest(ms - coll_ms, 0.0))
                FROM ({pw_select(con, paths='[$p]')}) GROUP BY 1""", {"p": path}
        ).fetchall()
    if unique:
        rows += con.execute(plain.format(rank="NULL", keys="TRUE", by="1", null=""),
                            {"inside": inside}).fetchall()
    rows += con.execute(  # after pw's rows, as before: a user phase named residual loses
        f"""SELECT '{RESIDUAL}', NULL, median(wait), sum(own), TRUE, sum(work) FROM rx"""
    ).fetchall()
    # Per rank, a block of ranks at a time: an exact median holds every value of its group.
    for b in rank_blocks(con):
        blk = in_block("rank", b)
        pw_rows = (f"""SELECT path, rank, median(wait), sum(ms - wait), bool_and(parent IS NULL),
                              sum(greatest(ms - coll_ms, 0.0))
                       FROM ({pw_select(con, blk, '$inside::VARCHAR[]' if unique else None)})
                       GROUP BY 1, 2""")
        if unique:
            pw_rows += f" UNION ALL {plain.format(rank='rank', keys=blk, by='1, 2', null='NOT')}"
        rows += con.execute(
            f"""{pw_rows}
                UNION ALL SELECT '{RESIDUAL}', rank, median(wait), sum(own), TRUE, sum(work)
                FROM rx WHERE {blk} GROUP BY 2""", {"inside": inside} if unique else {}
        ).fetchall()
    # Index the per-rank entries once: searching per_rank for each row is ranks^2.
    per_rank: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for pname, ph in phases.items():
        for p in ph["per_rank"]:
            per_rank.setdefault((pname, int(p["rank"])), []).append(p)
    for path, rank, wmed, own_sum, top, work_sum in rows:
        ph = phases.get(str(path))
        if ph is None:
            continue
        targets = [ph] if rank is None else per_rank.get((str(path), int(rank)), [])
        denom = total if rank is None else (rank_step.get(rank) or 0.0)
        for t in targets:
            t["wait_ms"] = round(float(wmed or 0.0), 3)
            t["own_share"] = round(float(own_sum) / denom, 4) if top and denom else None
            t["work_share"] = round(float(work_sum) / denom, 4) if top and denom else None
