"""Each rank's own work per phase and step, and the median of the *other* ranks' at that step.

Relations built on the run's connection (after :func:`stepscope.analysis.collwaits.build_waits`
made ``collective_waits``):

``phase_waits`` (rank, step, path, parent, ms, wait, ncoll, coll_ms): every phase path with the
       waits and the time of the collectives inside it at any depth (a view over ``phases``
       and ``phase_collectives``; readers select their block or path with :func:`phase_waits_select`).
``own_excess`` (rank, step, name, own, wait, others, excess): top-level phases and ``residual``;
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepscope.analysis import grouped
from stepscope.analysis.blocks import in_block, rank_blocks
from stepscope.analysis.load import phase_keys_unique
from stepscope.analysis.relations import drop, exists
from stepscope.analysis.stats import H2D_HIDDEN, RESIDUAL
from stepscope.analysis.tables import CELL_MIDDLES, DENSE_MIDDLES, PHASE_SUMS, TIMED_CELLS, WAIT_MEDIANS


def build_phase_waits(con: Any) -> None:
    """View ``phase_waits``: each phase path with the waits, count and time of collectives inside it
    (``phase_collectives``: the collectives' sums per rank, step and enclosing path)."""
    # A collective in 'a/b/c' is inside phases 'a', 'a/b' and 'a/b/c': its path and every
    # prefix ending before a '/' (exactly the paths p with phase = p or phase LIKE p || '/%').
    # The list expression only for paths with a '/' (a lambda per row of collective_waits was a quarter of
    # this stage at 10^8 samples, where every collective sits in a top-level phase).
    rows = """SELECT rank, step, anc, sum(wait) AS wait, count(*) AS n, sum(ms) AS ms FROM (
                  SELECT rank, step, wait, ms, phase AS anc FROM collective_waits WHERE phase IS NOT NULL
                  UNION ALL
                  SELECT rank, step, wait, ms,
                         unnest(list_transform(
                             list_filter(range(2, length(phase) + 1),
                                         lambda i: substr(phase, i, 1) = '/'),
                             lambda i: substr(phase, 1, i - 1))) AS anc
                  FROM collective_waits WHERE contains(phase, '/'))
              GROUP BY 1, 2, 3"""
    drop(con, "phase_collectives")
    if _waits_are_phase_collective_keys(con):
        # The same rows, each its own group: a view over collective_waits's (its readers take
        # a path or a block of it). At 10^8 samples a table of them took the stage's peak RSS
        # from 1.43 to 1.76 GB; the view 1.30 GB, and ~2.5 s CPU less than the group-by.
        con.execute("""CREATE TEMP VIEW phase_collectives AS
                       SELECT rank, step, phase AS anc, CAST(wait AS DOUBLE) AS wait,
                              CAST(1 AS BIGINT) AS n, CAST(ms AS DOUBLE) AS ms
                       FROM collective_waits WHERE phase IS NOT NULL""")
    else:
        con.execute(f"CREATE TEMP TABLE phase_collectives AS {rows}")
    # A view, not a table: every phase row with its collectives is 10^8 rows at scale,
    # written to disk and read back whole by each reader. The readers select a block of
    # steps or ranks, or one path (:func:`phase_waits_select`), from both sides of the join.
    con.execute(f"CREATE OR REPLACE TEMP VIEW phase_waits AS {phase_waits_select(con)}")


def _waits_are_phase_collective_keys(con: Any) -> bool:
    """Whether each row of ``collective_waits`` with a phase is the only one of its (rank, step, phase)
    and no phase is nested, so ``phase_collectives`` is collective_waits's rows as they are.

    collective_waits's rows are one per (rank, step, phase, op, pg) where collwaits built it
    (``collective_calls``
    is grouped by them, the waits join it one to one), but the timeline fallback's. With
    one (op, pg) in all of collective_waits and no nested phase, each row is its own (rank, step, anc)
    group (a group-by of 10^7 single rows at 10^8 phase samples, ~2.7 s CPU, where DDP's
    grad_sync phases are the only collectives). A table made by hand (tests) without op
    and pg: not known, so no."""
    built = {c for (c,) in con.execute(
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_name = 'collective_waits'").fetchall()}
    if not {"op", "pg"} <= built:
        return False
    pairs, nested, timeline = con.execute(
        "SELECT count(DISTINCT (op, pg)), bool_or(contains(phase, '/')), "
        "bool_or(pg = 'timeline') FROM collective_waits").fetchone()
    return int(pairs) <= 1 and not nested and not timeline


def phase_waits_select(con: Any, keys: str = "TRUE", paths: str | None = None, top: bool = False) -> str:
    """SQL for ``phase_waits``'s rows: ``keys`` a condition on ``rank``/``step`` (both tables have
    them), ``paths`` an SQL list of VARCHAR the path is one of, ``top`` top-level phases only."""
    cp = f"list_contains({paths}, path)" if paths is not None else "TRUE"
    cc = f"list_contains({paths}, anc)" if paths is not None else "TRUE"
    top_p = "parent IS NULL" if top else "TRUE"
    src = f"""FROM (SELECT rank, step, path, parent, ms FROM phases
                  WHERE {keys} AND {cp} AND {top_p}) p
              LEFT JOIN (SELECT rank, step, anc, wait, n, ms FROM phase_collectives WHERE {keys} AND {cc}) c
                ON c.rank = p.rank AND c.step = p.step AND c.anc = p.path"""
    if phase_keys_unique(con):
        # (rank, step, path) is a key of phases and phase_collectives: a group-by would group single
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
    """The rows of ``own_excess`` with an excess, as numpy columns (row order unspecified):
    ``nid`` indexes ``names``. With ``dense`` set the columns are empty and the same rows
    are the matrices' non-NaN cells."""

    names: list[str]
    rank: Any
    nid: Any
    step: Any
    own: Any
    excess: Any
    dense: DenseOwn | None = None


def build_own(con: Any, own_blocks: OwnBlockRunner | None = None) -> OwnColumns:
    """``phase_waits`` (waits inside each phase path) and ``own_excess`` (own work vs the other ranks).

    ``own_excess`` (rank, step, name, own, wait, others, excess): top-level phases and residual;
    ``others`` is the median own work of the *other* ranks at that step, ``excess`` the gap.
    Returns own_excess's rows that have an excess as numpy columns (the gap series' source).
    ``own_blocks``: where the own-work matrices are computed (:func:`_own_dense`).
    """
    build_phase_waits(con)
    con.execute("CREATE OR REPLACE TEMP TABLE wait_medians (path VARCHAR, median DOUBLE)")
    dense = _own_dense(con, own_blocks)
    if dense is not None:  # own_excess a view over the matrices' middle values, no own table
        return dense
    con.execute(f"CREATE OR REPLACE TEMP TABLE own_work AS {_own_sql(con, None)}")
    cols = _middles(con)
    drop(con, "own_excess")
    con.execute(f"CREATE TABLE own_excess AS {_own_excess_sql('SELECT * FROM own_work', CELL_MIDDLES)}")
    con.execute("DROP TABLE own_work")
    con.execute("DROP TABLE cell_middles")
    return cols


def _own_sql(con: Any, timed: str | None) -> str:
    """The rows of own work: top-level phases of ``phase_waits`` less their waits, and residual less
    the waits outside any phase. ``timed``: a table of the (step, name) cells where some rank
    has a collective timing (None: found here)."""
    cells = ("(SELECT step, name FROM top GROUP BY 1, 2 HAVING max(ncoll) > 0)"
             if timed is None else timed)
    return f"""WITH top AS (SELECT rank, step, path AS name, greatest(ms - wait, 0.0) AS own,
                                   wait, ncoll FROM ({phase_waits_select(con, top=True)}))
            SELECT top.rank, top.step, top.name, top.own, top.wait
            FROM top LEFT JOIN {cells} timed ON timed.step = top.step AND timed.name = top.name
            -- A rank with no collective timing in a phase where others have some: its
            -- waits are unknown, so its own work there is not compared.
            WHERE top.ncoll > 0 OR timed.step IS NULL
            UNION ALL
            SELECT s.rank, s.step, '{RESIDUAL}', greatest(s.residual_ms - coalesce(r.w, 0.0), 0.0),
                   coalesce(r.w, 0.0)
            FROM steps s LEFT JOIN (SELECT rank, step, sum(wait) AS w FROM collective_waits
                                    WHERE phase IS NULL GROUP BY 1, 2) r USING (rank, step)"""


def _own_excess_sql(own: str, mid: str) -> str:
    """``own_excess``'s rows from the own-work rows ``own`` and their cells' middle values ``mid``
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


def _middles(con: Any) -> OwnColumns:
    """Table ``cell_middles`` (step, name, n, p, m, q): per (step, name) cell of ``own_work`` with n values
    sorted as S, for even n: p = S[n/2 - 1], q = S[n/2]; for odd n (c = (n - 1) / 2):
    p = S[c - 1], m = S[c], q = S[c + 1] (NULL where the cell is too small)."""
    names = [str(n) for (n,) in con.execute("SELECT DISTINCT name FROM own_work ORDER BY 1").fetchall()]
    cols = con.execute(
        "SELECT rank, step, list_position($names, name) - 1 AS nid, own FROM own_work",
        {"names": names}).fetchnumpy()
    n_names = max(len(names), 1)
    ustep = np.asarray([s for (s,) in con.execute(
        "SELECT DISTINCT step FROM own_work ORDER BY 1").fetchall()],
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
    _write_middles(con, ustep[has // n_names], [names[int(i)] for i in (has % n_names).tolist()],
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
    p, m, q (:func:`_middles`): the same rule as own_excess's SQL, on numpy columns or matrices."""
    with np.errstate(invalid="ignore"):
        return np.where(
            n % 2 == 0, np.where(own > pv, pv, qv),
            np.where(own < mv, 0.5 * (mv + qv),
                     np.where(own > mv, 0.5 * (pv + mv), 0.5 * (pv + qv))))


def median_of_others(cell: Any, values: Any, n_cells: int) -> Any:
    """For each value, the median of the *other* values of its cell (cell ids
    ``0..n_cells-1``; NaN where the cell holds it alone): the cell's middle order statistics
    and :func:`_others`, the rule ``own_excess`` is built by, for any cells (ranks at a step)."""
    v = np.asarray(values, dtype=np.float64)
    cell = np.asarray(cell, dtype=np.int64)
    order, starts, counts = grouped.group_order(cell, n_cells)

    def positions(n: int) -> list[int]:  # p, m, q of _middles (-1: none)
        at = _positions_of(np.int64(n))
        return [int(at[2 * k]) if at[2 * k + 1] else -1 for k in range(3)]

    pa, ma, qa = grouped.order_stats(v[order], starts, counts, positions)
    n = counts[cell]
    return np.where(n >= 2, _others(v, n, pa[cell], ma[cell], qa[cell]), np.nan)


def _write_middles(con: Any, step: Any, name: list[str], n: Any, p: Any, m: Any, q: Any,
               dense: bool = False) -> None:
    """Table ``cell_middles`` (``dense_middles`` with ``dense``: the matrices') (step, name, n,
    p, m, q) from columns; NaN order statistics are NULL."""
    pq = ([None if x != x else float(x) for x in a.tolist()] for a in (p, m, q))  # x != x: NaN
    columns = "(step BIGINT, name VARCHAR, n BIGINT, p DOUBLE, m DOUBLE, q DOUBLE)"
    if dense:
        con.execute(f"CREATE OR REPLACE TEMP TABLE dense_middles {columns}")
    else:
        con.execute(f"CREATE OR REPLACE TEMP TABLE cell_middles {columns}")
    table = DENSE_MIDDLES if dense else CELL_MIDDLES
    con.execute(
        f"INSERT INTO {table} SELECT unnest(?::BIGINT[]), unnest(?::VARCHAR[]), unnest(?::BIGINT[]), "
        "unnest(?::DOUBLE[]), unnest(?::DOUBLE[]), unnest(?::DOUBLE[])",
        [np.asarray(step).tolist(), name, np.asarray(n).tolist(), *pq])


def _own_dense(con: Any, own_blocks: OwnBlockRunner | None = None) -> OwnColumns | None:
    """The own-work and gap matrices (one ranks × steps matrix per phase), one phase at a
    time, and ``own_excess`` as a view, when every (rank, step, phase) has at most one row and the
    matrices are not much larger than the rows; None otherwise (the grouped path).

    Each top-level phase's rows of ``phase_waits`` (:func:`_phase_rows`) and the residual rows are
    read once (rank, step, own, timing), the whole run at once: a block of steps is not
    contiguous in ``phases`` (its rows lie in rank order), so each block's read scanned
    nearly the whole table (41 blocks at 10^8 samples: 22 s CPU, against ~1 s a phase).
    The rows :func:`build_own`'s ``own_work`` table keeps are those with a collective timing, or
    in a (step, phase) cell where no rank has one. A sort down each step's column of a
    phase's matrix gives the cell's middle values, :func:`_others` the median of the other
    ranks. ``own_excess`` is not written: it is the view :func:`_own_excess_sql` over the own-work rows and
    the cells' middle values (table ``dense_middles``) and timed cells (``timed_cells``), the grouped
    path's statement (10^8 rows written to the database file cost more than the rest of
    this stage; its readers filter a phase, a rank or residual).
    Memory: the own-work and gap matrices kept for the series (8 bytes per (rank, step,
    phase)) plus one phase's rows and its float64 matrix. ``own_blocks``: computes the
    matrices elsewhere, by blocks of whole steps (default: here, the whole run as one
    block, :func:`own_block`)."""
    names = sorted({str(n) for (n,) in con.execute(  # phase_waits's paths are phases'
        "SELECT DISTINCT path FROM phases WHERE parent IS NULL").fetchall()})
    n_steps_rows = int(con.execute("SELECT count(*) FROM steps").fetchone()[0])
    if n_steps_rows:
        if RESIDUAL in names:
            return None  # a user phase named residual shares the residual's cells
        names = sorted([*names, RESIDUAL])
    unique = phase_keys_unique(con)
    n_top = int(con.execute(  # phase_waits has phases' rows when (rank, step, path) is their key
        "SELECT count(*) FROM phases WHERE parent IS NULL" if unique
        else f"SELECT count(*) FROM ({phase_waits_select(con, top=True)})").fetchone()[0])
    ranks = np.asarray([r for (r,) in con.execute(
        "SELECT DISTINCT rank FROM steps ORDER BY 1").fetchall()], dtype=np.int64)
    ustep = np.asarray([s for (s,) in con.execute(
        "SELECT DISTINCT step FROM steps ORDER BY 1").fetchall()], dtype=np.int64)
    n_r, n_s, n_n = len(ranks), len(ustep), len(names)
    n_rows = n_top + n_steps_rows  # own's rows at most (the timing rule keeps some fewer)
    if not n_rows or not n_r or n_r * n_s * n_n > 2 * n_rows + 1_000_000:
        return None  # sparse (ranks on different steps): the grouped path holds only rows
    spec = OwnSpec(names, unique, ranks, ustep)
    blocks = [own_block(con, spec)] if own_blocks is None else own_blocks(spec)
    if not blocks or any(b is None for b in blocks):
        return None  # a row of no (rank, step) of steps, twice in a cell, or NaN
    got = [b for b in blocks if b is not None]
    owns: list[Any] = [None] * n_n
    gaps: list[Any] = [None] * n_n
    mids: list[tuple[Any, ...]] = []  # (step, name id, n, p, m, q) of each phase
    timed_cells: list[tuple[Any, Any]] = []  # (step, name id) with a collective timing
    medians: dict[str, float] = {}  # run-wide median wait of the phases with collectives
    for k in sorted(range(n_n), key=lambda i: names[i] != RESIDUAL):  # the blocks' order
        if len(got) == 1:  # the whole run: its matrices as they are
            owns[k], gaps[k] = got[0].owns[k], got[0].gaps[k]
        else:
            owns[k] = np.concatenate([b.owns[k] for b in got], axis=1)
            gaps[k] = np.concatenate([b.gaps[k] for b in got], axis=1)
        for b in got:
            mids += b.mids[k]
        timed = [b.timed[k] for b in got if b.timed[k] is not None]
        if timed:
            cells = np.concatenate(timed)
            timed_cells.append((cells, np.full(len(cells), k, np.int64)))
        waits = [b.waits[k] for b in got]
        if any(b.timed[k] is not None for b in got) and all(w is not None for w in waits):
            # A collective inside the phase, and its rows' waits known here (the grouped
            # path takes the median where (rank, step, path) is not phases' key).
            medians[names[k]] = _median_wait([w for w in waits if w is not None])
    del blocks, got
    cat = [np.concatenate([m[i] for m in mids]) if mids else np.zeros(0) for i in range(6)]
    _write_middles(con, cat[0], [names[int(i)] for i in cat[1].tolist()], cat[2], cat[3], cat[4],
               cat[5], dense=True)
    t_step = np.concatenate([t[0] for t in timed_cells]) if timed_cells else np.zeros(0, np.int64)
    t_nid = np.concatenate([t[1] for t in timed_cells]) if timed_cells else np.zeros(0, np.int64)
    con.execute("CREATE OR REPLACE TEMP TABLE timed_cells AS SELECT unnest(?::BIGINT[]) AS step, "
                "unnest(?::VARCHAR[]) AS name",
                [t_step.tolist(), [names[int(i)] for i in t_nid.tolist()]])
    drop(con, "own_excess")
    rows = _own_excess_sql(_own_sql(con, TIMED_CELLS), DENSE_MIDDLES)
    con.execute(f"CREATE TEMP VIEW own_excess AS {rows}")
    con.execute(f"INSERT INTO {WAIT_MEDIANS} SELECT unnest(?::VARCHAR[]), unnest(?::DOUBLE[])",
                [list(medians), list(medians.values())])
    empty = np.zeros(0, dtype=np.int64)
    return OwnColumns(names, empty, empty, empty, np.zeros(0), np.zeros(0),
                      DenseOwn(ranks, ustep, owns, gaps))


@dataclass(frozen=True)
class OwnSpec:
    """What :func:`own_block` computes a block of steps of: the top-level phases and
    residual (``names``, sorted), whether (rank, step, path) is ``phases``' key
    (``unique``), and the run's sorted ranks (matrix rows) and steps."""

    names: list[str]
    unique: bool
    ranks: Any
    steps: Any


@dataclass
class OwnBlock:
    """A block of steps' part of the own-work matrices, per phase (index of
    :attr:`OwnSpec.names`): own work and gap (:data:`KEEP_DTYPE`, ranks × the block's
    steps, NaN: none), the middle values of its step columns (``mids``: (step, name id, n,
    p, m, q) chunks), the steps where some rank has a collective timing (``timed``; None:
    no collective inside the phase) and the waits of its rows (``waits``: their count and
    the non-zero ones, for the run-wide median; None: the residual, or not known here)."""

    owns: list[Any]
    gaps: list[Any]
    mids: list[list[tuple[Any, ...]]]
    timed: list[Any]
    waits: list[Any]


#: Computes :func:`own_block` elsewhere over blocks of whole steps, in step order (the
#: same matrices, cut by columns; None where a block cannot be made dense): an engine
#: that runs it as tasks (:mod:`stepscope.analysis.dask_engine`).
OwnBlockRunner = Callable[[OwnSpec], list["OwnBlock | None"]]


def own_block(con: Any, spec: OwnSpec) -> OwnBlock | None:
    """The own-work and gap matrices of the steps ``spec.steps`` (every row of ``phases``,
    ``steps`` and ``collective_waits`` on ``con`` lies in them), one phase at a time
    (:func:`_own_dense`); None where a row has no cell, two share one, or one is NaN."""
    ranks, ustep, names = spec.ranks, np.asarray(spec.steps, dtype=np.int64), spec.names
    n_r, n_s, n_n = len(ranks), len(ustep), len(names)
    out = OwnBlock([None] * n_n, [None] * n_n, [[] for _ in names], [None] * n_n,
                   [None] * n_n)
    # The residual first: its read (a join of steps) peaks higher than a phase's; the last
    # read meets every earlier phase's kept matrices.
    for k in sorted(range(n_n), key=lambda i: names[i] != RESIDUAL):
        name = names[k]
        got = (_residual_matrix(con, ranks, ustep) if name == RESIDUAL
               else _phase_matrix(con, name, spec.unique, ranks, ustep))
        if got is None:
            return None
        mat, timed, out.waits[k] = got
        if timed is not None:
            # A rank with no collective timing in a phase where others have some at that
            # step: its waits are unknown, so its own work there is not compared (not in own_excess).
            present = ~np.isnan(mat)
            timed &= present
            any_timed = timed.any(axis=0)
            out.timed[k] = ustep[any_timed]
            mat[present & ~timed & any_timed[None, :]] = np.nan
            del present, timed, any_timed
        # Made after the phase's rows are read and gone (the stage's peak is the last
        # phase's read): every cell is written below, a few columns at a time.
        out.owns[k] = np.empty((n_r, n_s), dtype=KEEP_DTYPE)
        out.gaps[k] = np.empty((n_r, n_s), dtype=KEEP_DTYPE)
        width = max(1, _CHUNK_CELLS // max(n_r, 1))  # a few columns at a time: bounded temporaries
        for c0 in range(0, n_s, width):
            c1 = min(c0 + width, n_s)
            has, *stats = _dense_block(mat[:, c0:c1], out.owns[k][:, c0:c1],
                                       out.gaps[k][:, c0:c1])
            out.mids[k].append((ustep[c0:c1][has], np.full(len(has), k, dtype=np.int64), *stats))
        del mat
    return out


def _positions_in(values: Any, keys: Any) -> tuple[Any, Any]:
    """Each value's index in the sorted distinct ``keys`` and whether it is one of them."""
    v = np.asarray(values)
    if not len(keys):
        return np.zeros(len(v), dtype=np.int64), np.zeros(len(v), dtype=bool)
    at = np.searchsorted(keys, v)
    ok = at < len(keys)
    ok[ok] = keys[at[ok]] == v[ok]
    return at, ok


def _fetch_cells(con: Any, cols: str, src: str, params: dict[str, Any], ranks: Any,
                 steps: Any) -> tuple[Any, Any, dict[str, Any]]:
    """``SELECT cols FROM src`` with each row's cell of the flattened ranks × steps matrix
    (table ``steps``' sorted ranks and steps): (cell, whether the row has one, columns).
    Consecutive ranks and steps (the usual run) have it computed in the query: the rows'
    rank and step columns never reach numpy (at 10^8 samples, 200 MB a phase)."""
    n_s = len(steps)
    if (len(ranks) and n_s and int(ranks[-1]) - int(ranks[0]) == len(ranks) - 1
            and int(steps[-1]) - int(steps[0]) == n_s - 1):
        r0, r1, s0, s1 = int(ranks[0]), int(ranks[-1]), int(steps[0]), int(steps[-1])
        cell_type = "INTEGER" if len(ranks) * n_s < 1 << 31 else "BIGINT"  # half the bytes
        got = con.execute(
            f"""SELECT CASE WHEN rank BETWEEN {r0} AND {r1} AND step BETWEEN {s0} AND {s1}
                            THEN CAST((CAST(rank AS BIGINT) - {r0}) * {n_s} + (step - {s0})
                                      AS {cell_type})
                            ELSE -1 END AS cell, {cols} FROM {src}""", params).fetchnumpy()
        cell = got.pop("cell")
        ok = np.ma.filled(cell, -1) >= 0  # NULL rank or step: no cell
        return np.ma.getdata(cell), ok, got
    got = con.execute(f"SELECT rank, step, {cols} FROM {src}", params).fetchnumpy()
    ri, ok_r = _positions_in(np.ma.getdata(got.pop("rank")), ranks)
    ci, ok_s = _positions_in(np.ma.getdata(got.pop("step")), steps)
    ok = ok_r & ok_s
    return np.where(ok, ri * n_s + ci, 0), ok, got


def _scatter(cell: Any, values: Any, shape: tuple[int, int]) -> Any | None:
    """A float64 matrix of ``shape`` with each value at its cell (NaN: no row); None when a
    value is NaN or two share a cell (a NULL counts as 0.0: ``greatest(NULL, 0.0)``)."""
    v = np.ma.filled(values, 0.0).astype(np.float64, copy=False)
    if np.isnan(v).any():
        return None
    mat = np.full(shape, np.nan)
    mat.ravel()[cell] = v
    if int(np.count_nonzero(~np.isnan(mat))) != len(v):
        return None  # a (rank, step) twice in one phase: the grouped path counts both
    return mat


def _phase_matrix(con: Any, name: str, unique: bool, ranks: Any,
                  steps: Any) -> tuple[Any, Any, tuple[int, Any] | None] | None:
    """A top-level phase's rows of ``phase_waits`` as ranks × steps matrices: own work
    (``greatest(ms - wait, 0.0)``, NaN: no row) and timed (``ncoll > 0``; None: none is),
    and its rows' waits (the rows' count and the waits of those joined to a collective:
    every other row's is 0.0; None where it is not known here: the grouped path).

    Where (rank, step, path) is the key of ``phases`` and ``phase_collectives``, ``phase_waits``'s
    join is done on
    the matrix: the phase's collectives' waits are placed in a ranks × steps matrix and
    taken off the phase's. The whole run's join in SQL holds a hash table of every
    (rank, step) of the phase: at 10^8 samples it spilled to disk (~4 s)."""
    shape = (len(ranks), len(steps))
    if not unique:
        cell, ok, cols = _fetch_cells(
            con, "greatest(ms - wait, 0.0) AS own, ncoll > 0 AS timed",
            f"({phase_waits_select(con, paths='[$p]', top=True)})", {"p": name}, ranks, steps)
        if not ok.all():
            return None
        mat = _scatter(cell, cols["own"], shape)
        if mat is None:
            return None
        row_timed = np.zeros(shape, dtype=bool)
        row_timed.ravel()[cell[np.asarray(cols["timed"], dtype=bool)]] = True
        return mat, row_timed, None
    cell, ok, cols = _fetch_cells(con, "ms", "phases WHERE path = $p AND parent IS NULL",
                                  {"p": name}, ranks, steps)
    if not ok.all():
        return None
    null = np.ma.getmaskarray(cols["ms"])
    mat = _scatter(cell, cols["ms"], shape)
    null_at = cell[null] if null.any() else None
    n_rows = len(cell)
    del cell, ok, cols, null
    if mat is None:
        return None
    cell, ok, cols = _fetch_cells(con, "wait", "phase_collectives WHERE anc = $p", {"p": name}, ranks, steps)
    # A collective of a (rank, step) with no row of this phase joins nothing (NaN stays
    # NaN); a NULL sum of waits is coalesced to 0.0.
    cell = cell[ok]
    w = np.ma.filled(cols["wait"], 0.0)[ok]
    del ok, cols
    if np.isnan(w).any():
        return None  # own work NaN: the grouped path's
    timed: Any = None  # no collective inside: wait 0.0, never timed
    # phase_waits's waits of this phase: the joined ones, 0.0 on every other row (for
    # phase_waits' run-wide median; its SQL join of every row spilled to disk, ~4 s at 10^8
    # samples).
    waits = (n_rows, w[~np.isnan(mat.ravel()[cell])])
    if len(w):
        mat.ravel()[cell] -= w  # each cell once: (rank, step, anc) is phase_collectives's key
        timed = np.zeros(shape, dtype=bool)  # count(*) > 0: a row of phase_collectives
        timed.ravel()[cell] = True
    del cell, w
    np.maximum(mat, 0.0, out=mat)  # NaN (no row) stays NaN
    if null_at is not None:
        mat.ravel()[null_at] = 0.0  # greatest(NULL - wait, 0.0) is 0.0
    return mat, timed, waits


def _median_wait(blocks: list[tuple[int, Any]]) -> float:
    """The run-wide median wait of a phase's rows from its blocks' (count of rows, waits
    joined to a collective): every other row's is 0.0. Order-free: the same values in any
    order of blocks give the same median."""
    waits = np.zeros(sum(n for n, _ in blocks))
    at = 0
    for _, w in blocks:
        waits[at:at + len(w)] = w
        at += len(w)
    median = sql_median(waits)
    assert median is not None  # a collective inside: rows to join it
    return median


def sql_median(values: Any) -> float | None:
    """DuckDB's ``median`` of float64 values (none NULL): the middle value, or for an even
    count ``lo * 0.5 + hi * 0.5`` of the two middle ones (its interpolation, bit for bit:
    not ``lo + (hi - lo) * 0.5``, nor ``(lo + hi) / 2``, which overflows)."""
    n = len(values)
    if not n:
        return None
    lo, hi = (n - 1) // 2, n // 2
    part = np.partition(np.asarray(values, dtype=np.float64), [lo, hi])
    a, b = float(part[lo]), float(part[hi])
    return a if lo == hi else a * 0.5 + b * 0.5


def _residual_matrix(con: Any, ranks: Any, steps: Any) -> tuple[Any, None, None] | None:
    """The residual's own work as a ranks × steps matrix (NaN: no row; None: no timing rule,
    every row counts): untimed step time less the waits outside any phase."""
    cell, ok, cols = _fetch_cells(
        con, "greatest(s.residual_ms - coalesce(r.w, 0.0), 0.0) AS own",
        """(SELECT rank, step, residual_ms FROM steps) s
           LEFT JOIN (SELECT rank, step, sum(wait) AS w FROM collective_waits
                      WHERE phase IS NULL GROUP BY 1, 2) r USING (rank, step)""",
        {}, ranks, steps)
    if not ok.all():
        return None
    mat = _scatter(cell, cols["own"], (len(ranks), len(steps)))
    return None if mat is None else (mat, None, None)


def _dense_block(mat: Any, keep_own: Any, keep_gap: Any) -> tuple[Any, ...]:
    """Some columns of one phase's matrix (float64, NaN: no row): store its own work and gap
    in the run's matrices (views, :data:`KEEP_DTYPE`); return the columns that hold a value
    and their cells' n, p, m, q (:func:`_middles`)."""
    n_r = mat.shape[0]
    present = ~np.isnan(mat)
    n = np.count_nonzero(present, axis=0)
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


#: The own-work and gap matrices kept for the series (own_excess's view computes in float64).
KEEP_DTYPE = np.float32
#: :func:`_own_dense` takes a phase's middle values this many matrix cells at a time (a few
#: float64 temporaries of this size: ~16 MB each).
_CHUNK_CELLS = 2_000_000


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
        """CREATE OR REPLACE TEMP TABLE residual_work AS
           SELECT own_excess.rank, own_excess.step, own_excess.wait, own_excess.own,
                  greatest(own_excess.own + own_excess.wait - coalesce(c.ms, 0.0), 0.0) AS work
           FROM own_excess LEFT JOIN (SELECT rank, step, sum(ms) AS ms FROM collective_waits
                                      WHERE phase IS NULL
                              GROUP BY 1, 2) c USING (rank, step)
           WHERE own_excess.name = 'residual'"""
    )
    rank_step = dict(con.execute("SELECT rank, sum(step_ms) FROM steps GROUP BY 1").fetchall())
    # A path that no collective lies inside has wait and coll_ms 0 on every row: its row is
    # phases' own sums, all such paths in one statement, with no join and no median. Only
    # where (rank, step, path) is phases' key: else phase_waits folds repeated paths (any_value).
    unique = phase_keys_unique(con)
    inside = [str(a) for (a,) in con.execute(
        "SELECT DISTINCT anc FROM phase_collectives ORDER BY 1").fetchall()]
    paths = [str(p) for (p,) in con.execute("SELECT DISTINCT path FROM phases ORDER BY 1").fetchall()]
    plain = ("""SELECT path, {rank}, CAST(0.0 AS DOUBLE), sum(ms), bool_and(parent IS NULL),
                       sum(greatest(ms, 0.0))
                FROM phases WHERE {keys} AND NOT list_contains($inside::VARCHAR[], path)
                GROUP BY {by}""")
    if exists(con, PHASE_SUMS) and not {RESIDUAL, H2D_HIDDEN} & set(paths):
        # The same sums, from phase_stats' scans of the same rows (stats.PHASE_SUMS).
        plain = (f"""SELECT name, {{rank}}, CAST(0.0 AS DOUBLE), ms, top, pos FROM {PHASE_SUMS}
                     WHERE {{keys}} AND rank IS {{null}} NULL
                       AND NOT list_contains($inside::VARCHAR[], name)
                       AND NOT list_contains(['{RESIDUAL}', '{H2D_HIDDEN}'], name)""")
    # Over the whole run, one path at a time: an exact median holds every value of its
    # group, and every path at once (10^8 values) ran out of memory at a 1 GB limit. A path
    # whose median build_own took (WAIT_MEDIANS) has its sums from its per-rank rows below.
    known = (dict(con.execute(f"SELECT path, median FROM {WAIT_MEDIANS}").fetchall())
             if unique and exists(con, WAIT_MEDIANS) else {})
    rows: list[Any] = []
    for path in paths:
        if unique and path not in inside:
            continue
        if path in known:
            rows.append(path)  # filled in from its per-rank rows
            continue
        rows += con.execute(
            f"""SELECT path, NULL AS rank, median(wait), sum(ms - wait), bool_and(parent IS NULL),
                       sum(greatest(ms - coll_ms, 0.0))
                FROM ({phase_waits_select(con, paths='[$p]')}) GROUP BY 1""", {"p": path}
        ).fetchall()
    if unique:
        rows += con.execute(plain.format(rank="NULL", keys="TRUE", by="1", null=""),
                            {"inside": inside}).fetchall()
    rows += con.execute(  # after phase_waits's rows, as before: a user phase named residual loses
        f"""SELECT '{RESIDUAL}', NULL, median(wait), sum(own), TRUE, sum(work) FROM residual_work"""
    ).fetchall()
    # Per rank, a block of ranks at a time: an exact median holds every value of its group.
    for b in rank_blocks(con):
        blk = in_block("rank", b)
        pw_rows = (f"""SELECT path, rank, median(wait), sum(ms - wait), bool_and(parent IS NULL),
                              sum(greatest(ms - coll_ms, 0.0))
                       FROM ({phase_waits_select(con, blk, '$inside::VARCHAR[]' if unique else None)})
                       GROUP BY 1, 2""")
        if unique:
            pw_rows += f" UNION ALL {plain.format(rank='rank', keys=blk, by='1, 2', null='NOT')}"
        rows += con.execute(
            f"""{pw_rows}
                UNION ALL SELECT '{RESIDUAL}', rank, median(wait), sum(own), TRUE, sum(work)
                FROM residual_work WHERE {blk} GROUP BY 2""", {"inside": inside} if unique else {}
        ).fetchall()
    rows = [_from_ranks(r, known[r], rows) if isinstance(r, str) else r for r in rows]
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


def _from_ranks(path: str, median: float, rows: list[Any]) -> tuple[Any, ...]:
    """A path's run-wide row of :func:`phase_waits` from its per-rank rows (sums of their
    sums; NULL where every one is) and its run-wide median wait."""
    mine = [r for r in rows if not isinstance(r, str) and r[0] == path and r[1] is not None]

    def total(i: int) -> float | None:
        got = [r[i] for r in mine if r[i] is not None]
        return sum(got) if got else None

    return (path, None, median, total(3), all(bool(r[4]) for r in mine), total(5))
