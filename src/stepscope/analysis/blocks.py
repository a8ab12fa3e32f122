"""Blocks of steps: the per-step statements run over a few steps at a time.

The alignment spreads, the waits inside each phase path (``phase_waits``) and the own-work tables
are per step: a step's values depend only on that step's rows of every rank. Grouping or
joining the whole run at once makes DuckDB hold a hash table over every (rank, step, path)
(10^8 rows: out of memory at a 3 GB limit); over a block of steps it holds that block's.
Each block's rows are appended to the same table, so the tables (and every number taken
from them) are the ones the whole-run statement builds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stepscope.analysis.relations import exists

#: Records (rank, step) per block: about ten times as many phase rows.
BLOCK_RECORDS = 1_000_000
#: Every step (a block for tables without ``steps``).
WHOLE = (-(1 << 62), 1 << 62)


def step_blocks(con: Any, records: int | None = None) -> list[tuple[int, int]]:
    """Consecutive (first, last) step ranges of table ``steps`` covering every step, each
    with at most ``records`` (default :data:`BLOCK_RECORDS`) records, but one step at least."""
    return _blocks(con, "step", records)


def _blocks(con: Any, col: str, records: int | None) -> list[tuple[int, int]]:
    cap = BLOCK_RECORDS if records is None else int(records)
    if cap < 1:
        raise ValueError(f"records per block must be >= 1, got {records!r}")
    if not exists(con, "steps"):
        return [WHOLE]  # tables made by hand (tests): one block, every step
    rows = con.execute(f"SELECT {col}, count(*) FROM steps GROUP BY 1 ORDER BY 1").fetchall()
    return pack(rows, cap) or [WHOLE]


def pack(counts: Iterable[tuple[int, int]], cap: int) -> list[tuple[int, int]]:
    """Consecutive (first, last) key ranges over ``counts`` ((key, rows), keys ascending),
    each with at most ``cap`` rows but one key at least."""
    out: list[tuple[int, int]] = []
    first = last = 0
    n = -1  # no block open
    for key, k in counts:
        if n >= 0 and n + int(k) > cap:
            out.append((first, last))
            n = -1
        if n < 0:
            first, n = int(key), 0
        last, n = int(key), n + int(k)
    if n >= 0:
        out.append((first, last))
    return out


def rank_blocks(con: Any, records: int | None = None) -> list[tuple[int, int]]:
    """Consecutive (first, last) rank ranges of table ``steps``, each with at most
    ``records`` records (one rank at least): for aggregates per rank over every step (an
    exact median per (phase, rank) holds all of its values at once)."""
    return _blocks(con, "rank", records)


def in_block(col: str, block: tuple[int, int]) -> str:
    """SQL condition: ``col`` inside the block's steps."""
    return f"{col} BETWEEN {int(block[0])} AND {int(block[1])}"


def host_blocks(con: Any, hosts: dict[str, list[int]],
                records: int | None = None) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(ranks, steps) blocks of table ``steps``, each a (first, last) rank range holding
    every rank of its hosts and a (first, last) step range, covering every record with at
    most ``records`` (default :data:`BLOCK_RECORDS`) records a block where one host's steps
    allow: for values per (step, host) over its ranks.

    Rank ranges, not steps alone: the rows are stored rank by rank (analysis/load.py), so a
    rank range reads its own row groups and skips the rest, where every step block read
    nearly every row group. Ranges of hosts whose ranks interleave merge into one; one
    larger than the cap is cut into the run's step blocks."""
    cap = BLOCK_RECORDS if records is None else int(records)
    if cap < 1:
        raise ValueError(f"records per block must be >= 1, got {records!r}")
    if not exists(con, "steps"):
        return [(WHOLE, WHOLE)]
    per_rank = con.execute("SELECT rank, count(*) FROM steps GROUP BY 1 ORDER BY 1").fetchall()
    # Each host's rank interval; overlapping intervals merged (sorted by first rank).
    spans: list[list[int]] = []
    for lo, hi in sorted((min(rs), max(rs)) for rs in hosts.values() if rs):
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    # Ranks no host names (none, from load_run) are spans of their own.
    counts: list[tuple[int, int]] = []  # (span's first rank, its records)
    i = 0
    for rank, k in per_rank:
        while i < len(spans) and spans[i][1] < rank:
            i += 1
        if i < len(spans) and spans[i][0] <= rank:
            first = spans[i][0]
        else:
            first = int(rank)
            spans.insert(i, [first, first])
        if counts and counts[-1][0] == first:
            counts[-1] = (first, counts[-1][1] + int(k))
        else:
            counts.append((first, int(k)))
    last_of = {s[0]: s[1] for s in spans}
    size = dict(counts)
    out: list[tuple[tuple[int, int], tuple[int, int]]] = []
    by_step: list[tuple[int, int]] = []
    for first, last in pack(counts, cap):
        ranks = (first, last_of[last])
        if first == last and size[first] > cap:  # one span over the cap: cut by steps
            by_step = by_step or step_blocks(con, cap)
            out.extend((ranks, b) for b in by_step)
        else:
            out.append((ranks, WHOLE))
    return out or [(WHOLE, WHOLE)]
