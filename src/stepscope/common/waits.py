"""Who waited for whom: the one wait rule, used by the report, the live line and traces.

A synchronising collective (an all-reduce, all-gather, reduce-scatter, barrier, DDP's
gradient all-reduce timed as ``grad_sync``) ends at about the same moment on every rank that
takes part, however late each arrived. So the rank that arrived last spent the *least* time
in it, and every other rank's extra time in it is time spent waiting for that rank::

    wait[r] = time_in_collective[r] - min over ranks of time_in_collective

This needs no clock agreement across ranks or hosts: each duration is measured on one rank's
own clock (host or CUDA events). It holds for one collective instance, and for a sum of
matched instances when the same rank is last in each (the usual straggler case); where the
last rank changes from instance to instance, summing first under-states waits, never
inflates them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

K = TypeVar("K")


def waits(durations: Mapping[K, float]) -> dict[K, float]:
    """Each participant's wait in one matched collective: its duration minus the shortest."""
    if not durations:
        return {}
    lo = min(durations.values())
    return {k: max(0.0, float(d) - lo) for k, d in durations.items()}


def last_arriver(durations: Mapping[K, float], tie_tol: float = 0.0) -> K | None:
    """The participant the others waited for: the one with the shortest time in the collective.

    ``None`` when nobody is alone at the minimum (within ``tie_tol``): a tie names no one.
    """
    if not durations:
        return None
    k = min(durations, key=lambda k: durations[k])
    lo = durations[k]
    if sum(1 for d in durations.values() if d - lo <= tie_tol) > 1:
        return None
    return k


def most_often_last(counts: Mapping[K, int]) -> K | None:
    """The participant that arrived last most often; ``None`` on a tie for first place
    (6 times rank 0, 6 times rank 1 names neither)."""
    if not counts:
        return None
    top = max(counts.values())
    leaders = [k for k, n in counts.items() if n == top]
    return leaders[0] if len(leaders) == 1 and top > 0 else None


def sql_wait(ms: str, partition: str) -> str:
    """The same rule as a DuckDB window expression over rows of one matched collective.

    ``partition`` names the columns that identify one collective instance across ranks
    (e.g. ``"step, phase, op, pg"``).
    """
    return f"greatest({ms} - min({ms}) OVER (PARTITION BY {partition}), 0.0)"


def sql_wait_grouped(ms: str, lo: str) -> str:
    """The same rule in SQL over one matched collective's rows joined to its group-by.

    ``lo`` is the instance's ``min(ms)`` taken by a ``GROUP BY`` of the columns that identify
    it and joined back to each rank's row: the same value as :func:`sql_wait`'s window,
    without sorting every row by its instance.
    """
    return f"greatest({ms} - {lo}, 0.0)"
