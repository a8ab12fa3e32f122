"""Per-phase and per-rank summary statistics, computed in DuckDB over the loaded tables."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from stepscope.analysis.blocks import WHOLE, in_block, rank_blocks
from stepscope.analysis.relations import has_column
from stepscope.analysis.tables import PHASE_SUMS
from stepscope.recording.schema import CANONICAL_PHASES

#: The most samples an exact quantile statement holds: a run of more has its run-wide
#: quantiles exact per phase, a batch of phases this size at a time, and approximate
#: (t-digest) for a phase of more samples than this, to keep memory flat.
EXACT_QUANTILE_ROWS = 5_000_000

RESIDUAL = "residual"
H2D_HIDDEN = "h2d_hidden"


def phase_order(names: list[str] | set[str]) -> list[str]:
    """Canonical phases first, then user-named phases alphabetically, then ``residual``.

    Names are paths: a nested phase ("backward/grad_sync") follows its parent, its siblings
    ordered the same way.
    """
    names = set(names)
    canon = {p: i for i, p in enumerate(CANONICAL_PHASES)}
    tail = {RESIDUAL: 1, H2D_HIDDEN: 2}

    def key(path: str) -> tuple[tuple[int, int, str], ...]:
        parts = path.split("/")
        head = parts[0]
        top = (2, tail[head], head) if head in tail and len(parts) == 1 else (
            (0, canon[head], head) if head in canon else (1, 0, head))
        return (top, *((0 if p in canon else 1, canon.get(p, 0), p) for p in parts[1:]))

    return sorted(names, key=key)


def _q(col: str, exact: bool) -> str:
    fn = "quantile_cont" if exact else "approx_quantile"
    return f"{fn}({col}, [0.5, 0.9, 0.99])"


def _r(x: Any, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def create_phase_samples(con: Any) -> None:
    """View ``phase_samples`` (rank, step, name, parent, ms): phases plus residual and h2d_hidden.

    ``name`` is the phase's *path* ("forward/h2d"), so a phase nested under another is a row
    of its own and never mixed with a top-level phase of the same leaf name. A phase absent
    on a step did not happen, so it contributes no row (not a zero).
    """
    # A view: the two statistics queries scan it once each, cheaper than a third full copy
    # of the phase rows.
    con.execute(
        f"""CREATE OR REPLACE VIEW phase_samples AS
            SELECT rank, step, path AS name, parent, ms FROM phases
            UNION ALL SELECT rank, step, '{RESIDUAL}', NULL, residual_ms FROM steps
            UNION ALL SELECT rank, step, '{H2D_HIDDEN}', NULL, h2d_hidden_ms FROM steps
                WHERE h2d_hidden_ms IS NOT NULL"""
    )


#: Rows of :func:`phase_rank_rows` for every rank of a run's connection, however computed:
#: on the connection itself (:func:`local_phase_rank_rows`) or by a block's task elsewhere.
PhaseRankRows = Callable[[Any], Iterable[tuple[Any, ...]]]


def phase_rank_rows(con: Any, block: tuple[int, int] = WHOLE) -> list[tuple[Any, ...]]:
    """Per (phase, rank) of the ranks in ``block``: the quantiles, max, sum, samples, whether
    top level and the sum of positive values, from ``phase_samples`` on ``con``. A rank's
    rows need only its own samples, so any split of the ranks gives the same rows."""
    # Exact per rank: a t-digest state per (phase, rank) group costs more memory than the
    # few thousand values each group holds. An exact quantile holds every value of its group
    # at once, so a block of ranks at a time (analysis/blocks.py): memory is one block's
    # values, not the run's (10^8 samples at once spilled ~34 GB); the groups are the same.
    return [tuple(r) for r in con.execute(
        f"""SELECT name, rank, {_q('ms', True)}, max(ms), sum(ms), count(*),
                   bool_and(parent IS NULL), sum(greatest(ms, 0.0))
            FROM phase_samples WHERE {in_block('rank', block)} GROUP BY name, rank"""
    ).fetchall()]


def local_phase_rank_rows(con: Any) -> list[tuple[Any, ...]]:
    """:func:`phase_rank_rows` of every rank, a block of ranks at a time on ``con``."""
    rows: list[tuple[Any, ...]] = []
    for b in rank_blocks(con):
        rows += phase_rank_rows(con, b)
    return rows


def phase_stats(con: Any, n_rows: int,
                per_rank_rows: PhaseRankRows | None = None) -> dict[str, dict[str, Any]]:
    """Per phase: median/p90/p99/max ms, share of step time, and the same per rank.

    Shares divide a phase's total by the total step time; only top-level phases (and the
    residual) have one, so they add up to 1. ``h2d_hidden`` is copy time a PrefetchLoader
    took off the step (overlapped), so it has no share either. ``per_rank_rows``: where the
    per-rank rows come from (default :func:`local_phase_rank_rows`).
    """
    total_step = con.execute("SELECT sum(step_ms) FROM steps").fetchone()[0] or 0.0
    rank_step = dict(con.execute("SELECT rank, sum(step_ms) FROM steps GROUP BY 1").fetchall())
    overall = _overall_rows(con, n_rows)
    per_rank = list(per_rank_rows(con) if per_rank_rows is not None else local_phase_rank_rows(con))
    per_rank.sort(key=lambda row: (row[0], row[1]))
    _write_sums(con, [(r[0], None, r[4], r[6], r[7]) for r in overall]
                + [(r[0], r[1], r[4], r[6], r[7]) for r in per_rank])
    out: dict[str, dict[str, Any]] = {}
    top: dict[str, bool] = {}
    for name, parent, qs, mx, total, n, is_top, _ in overall:
        top[name] = bool(is_top) and name != H2D_HIDDEN
        out[name] = {
            "parent": None if is_top else parent,
            "median_ms": _r(qs[0]),
            "p90_ms": _r(qs[1]),
            "p99_ms": _r(qs[2]),
            "max_ms": _r(mx),
            "share": _r(total / total_step, 4) if top[name] and total_step else None,
            "samples": int(n),
            "per_rank": [],
        }
    for name, rank, qs, mx, total, n, _, _ in per_rank:
        denom = rank_step.get(rank) or 0.0
        out[name]["per_rank"].append(
            {
                "rank": int(rank),
                "median_ms": _r(qs[0]),
                "p90_ms": _r(qs[1]),
                "p99_ms": _r(qs[2]),
                "max_ms": _r(mx),
                "share": _r(total / denom, 4) if top[name] and denom else None,
                # What the single slowest call is of that share (a one-off: a first batch).
                "max_share": _r(mx / denom, 4) if top[name] and denom else None,
                "samples": int(n),
            }
        )
    return {name: out[name] for name in phase_order(list(out))}


def _overall_rows(con: Any, n_rows: int) -> list[tuple[Any, ...]]:
    """Per phase of the whole run: name, a parent, the quantiles, max, sum, samples, whether
    top level and the sum of positive values (``n_rows``: the samples of ``phase_samples``)."""
    aggs = """max(ms), sum(ms), count(*), bool_and(parent IS NULL), sum(greatest(ms, 0.0))"""
    if n_rows <= EXACT_QUANTILE_ROWS:
        return [tuple(r) for r in con.execute(
            f"SELECT name, any_value(parent), {_q('ms', True)}, {aggs} FROM phase_samples GROUP BY name"
        ).fetchall()]
    # Exact per phase where its group is small enough, a batch of phases of at most
    # EXACT_QUANTILE_ROWS samples at a time (an exact quantile holds its group's values:
    # memory as on the exact path); a t-digest only for a phase above that. A t-digest state
    # of a few large groups costs more CPU than sorting them: at 10^7 samples the run-wide
    # approx_quantile took 1.2 s of CPU, the exact one of the same groups 0.45 s.
    rows = [tuple(r) for r in con.execute(
        f"SELECT name, any_value(parent), {aggs} FROM phase_samples GROUP BY name").fetchall()]
    qs: dict[Any, Any] = {}
    for names, exact in _quantile_batches(sorted(((r[0], int(r[4])) for r in rows),
                                                 key=lambda x: (x[0] is None, str(x[0])))):
        got = con.execute(
            f"""SELECT name, {_q('ms', exact)} FROM phase_samples
                WHERE list_contains($names::VARCHAR[], name) OR (name IS NULL AND $null)
                GROUP BY name""",
            {"names": [n for n in names if n is not None], "null": None in names}).fetchall()
        qs.update((n, q) for n, q in got)
    return [(r[0], r[1], qs[r[0]], *r[2:]) for r in rows]


def _quantile_batches(counts: list[tuple[Any, int]]) -> list[tuple[list[Any], bool]]:
    """Phases (name, samples) in batches for :func:`_overall_rows`: (names, exact), each exact
    batch of at most :data:`EXACT_QUANTILE_ROWS` samples in all; every larger phase in one
    approximate batch."""
    out: list[tuple[list[Any], bool]] = []
    big = [n for n, c in counts if c > EXACT_QUANTILE_ROWS]
    names: list[Any] = []
    held = 0
    for n, c in counts:
        if c > EXACT_QUANTILE_ROWS:
            continue
        if names and held + c > EXACT_QUANTILE_ROWS:
            out.append((names, True))
            names, held = [], 0
        names.append(n)
        held += c
    if names:
        out.append((names, True))
    if big:
        out.append((big, False))
    return out


def _write_sums(con: Any, rows: list[tuple[Any, ...]]) -> None:
    con.execute("CREATE OR REPLACE TEMP TABLE phase_sums (name VARCHAR, rank INTEGER, "
                "ms DOUBLE, top BOOLEAN, pos DOUBLE)")
    if rows:
        cols = list(zip(*rows, strict=True))
        con.execute(
            f"INSERT INTO {PHASE_SUMS} SELECT unnest(?::VARCHAR[]), unnest(?::INTEGER[]), "
            "unnest(?::DOUBLE[]), unnest(?::BOOLEAN[]), unnest(?::DOUBLE[])",
            [list(c) for c in cols])


def rank_stats(con: Any, hosts: dict[str, list[int]], n_rows: int = 0) -> list[dict[str, Any]]:
    """Per rank: step time, own work (step minus estimated wait) and wait, median and p90.

    Needs the ``step_waits`` table (rank, step, wait_ms) built by the straggler analysis.
    """
    host_of = {r: h for h, rs in hosts.items() for r in rs}
    # Exact quantiles per rank hold every step of the rank: a block of ranks at a time, as in
    # phase_stats (10^7 steps at once ran out of memory at a 1 GB DuckDB limit).
    # step_waits holds each step's step_ms where the wait stage made it (no join to steps).
    src, at = (("step_waits w", "w") if has_column(con, "step_waits", "step_ms")
               else ("steps s JOIN step_waits w USING (rank, step)", "s"))
    rows: list[Any] = []
    for b in rank_blocks(con):
        rows += con.execute(
            f"""SELECT {at}.rank, count(*), {_q(f'{at}.step_ms', True)},
                       {_q(f'{at}.step_ms - w.wait_ms', True)}, {_q('w.wait_ms', True)},
                       sum(w.wait_ms), sum({at}.step_ms)
                FROM {src}
                WHERE {in_block(f'{at}.rank', b)} GROUP BY 1 ORDER BY 1"""
        ).fetchall()
    out = []
    for rank, n, sq, oq, wq, wsum, ssum in rows:
        out.append(
            {
                "rank": int(rank),
                "host": host_of.get(int(rank)),
                "steps": int(n),
                "step_ms": {"median": _r(sq[0]), "p90": _r(sq[1])},
                "own_ms": {"median": _r(oq[0]), "p90": _r(oq[1])},
                "wait_ms": {"median": _r(wq[0]), "p90": _r(wq[1])},
                "wait_share": _r(wsum / ssum, 4) if ssum else 0.0,
            }
        )
    return out
