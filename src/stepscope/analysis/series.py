"""Each (rank, phase) gap series to the other ranks, its noise, and run-queue wait taken out.

A :data:`Series` maps (rank, phase) to numpy arrays (step positions, gap, own work) in step
order; the flag threshold of each is its robust noise (:func:`thresholds_of`), computed
for every series at once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from stepscope.analysis import grouped
from stepscope.analysis.own import DenseOwn, OwnColumns, median_of_others
from stepscope.analysis.relations import has_column
from stepscope.common import robust
from stepscope.common.errors import AnalysisError

#: Flag threshold: SIGMAS robust sigmas of the rank's own step-to-step variation, floored so
#: near-noiseless data does not flag microseconds.
SIGMAS = robust.SIGMAS
FLOOR_MS = 0.25
FLOOR_FRAC = 0.02  # of the median step


#: One (rank, phase) series: step positions, gap to the other ranks, own work (numpy arrays).
Series = dict[tuple[int, str], tuple[Any, Any, Any]]


def read_gap_series(con: Any, steps: list[int], cols: OwnColumns | None = None) -> Series:
    """Every (rank, phase) gap series of table ``own_excess``, in (rank, phase, step) order.

    Fixed-dtype columns, not Python rows: each series is a slice (a view) of arrays sorted
    once in numpy. ``cols``: own_excess's columns as :func:`build_own` returned them (else read).
    """
    if cols is None:
        names = [str(n) for (n,) in con.execute(
            "SELECT DISTINCT name FROM own_excess WHERE excess IS NOT NULL ORDER BY 1").fetchall()]
        got = con.execute(
            "SELECT rank, list_position($names, name) - 1 AS nid, step, excess, own FROM own_excess "
            "WHERE excess IS NOT NULL", {"names": names}).fetchnumpy()
        cols = OwnColumns(names, np.asarray(got["rank"]), np.asarray(got["nid"]),
                          np.asarray(got["step"]), np.asarray(got["own"]),
                          np.asarray(got["excess"]))
        del got
    names = cols.names
    if cols.dense is not None:
        return _dense_series(cols.dense, names, steps)
    rank_a = np.asarray(cols.rank, dtype=np.int64)
    nid_a = np.asarray(cols.nid, dtype=np.int64)
    pos_a = np.searchsorted(np.asarray(steps, dtype=np.int64), np.asarray(cols.step, dtype=np.int64))
    # One integer key (rank, phase, step position): a single argsort, not a three-key lexsort.
    key_a = rank_a * (len(names) + 1) + nid_a
    order = np.argsort(key_a * (len(steps) + 1) + pos_a)
    rank_a, nid_a, pos_a, key_a = rank_a[order], nid_a[order], pos_a[order], key_a[order]
    ex_a = np.asarray(cols.excess, dtype=np.float64)[order]
    own_a = np.asarray(cols.own, dtype=np.float64)[order]
    del order
    starts = np.flatnonzero(np.r_[True, key_a[1:] != key_a[:-1]]) if len(key_a) else key_a
    bounds = [*starts.tolist(), len(key_a)]
    return {(int(rank_a[i]), names[int(nid_a[i])]): (pos_a[i:j], ex_a[i:j], own_a[i:j])
            for i, j in itertools.pairwise(bounds)}


def _dense_series(d: DenseOwn, names: list[str], steps: list[int]) -> Series:
    """:func:`read_gap_series` from the per-phase matrices: each series is a row (a view) of its
    phase's matrices, less the steps without a gap; same keys in the same order."""
    pos = np.searchsorted(np.asarray(steps, dtype=np.int64), d.steps)
    whole = [~np.isnan(g).any(axis=1) for g in d.excess]  # rows with a gap on every step
    out: Series = {}
    for i, rank in enumerate(d.ranks.tolist()):
        for nid, name in enumerate(names):
            gap, own = d.excess[nid][i], d.own[nid][i]
            if whole[nid][i]:
                out[(rank, name)] = (pos, gap, own)
                continue
            ok = ~np.isnan(gap)
            if ok.any():
                out[(rank, name)] = (pos[ok], gap[ok], own[ok])
    return out


def runq_by_step(con: Any) -> dict[int, dict[int, float]]:
    """``{rank: {step: run-queue wait ms}}`` from ``res.runq_ms``; empty when not recorded."""
    has = has_column(con, "step_resources", "runq_ms")
    out: dict[int, dict[int, float]] = {}
    if not has:
        return out
    for rank, step, ms in con.execute(
        "SELECT rank, step, runq_ms FROM step_resources "
        "WHERE runq_ms IS NOT NULL AND isfinite(runq_ms) AND runq_ms >= 0"
    ).fetchall():
        out.setdefault(int(rank), {})[int(step)] = float(ms)
    return out if len(out) > 1 else {}


#: A rank's extra run-queue wait at a step (its wait for a CPU over the other ranks' median)
#: explains its gaps there when it reaches this share of their sum (the positive ones, every
#: phase and the residual): the rank was held off a CPU about as long as it fell behind.
EXPLAINS = 0.75


def net_of_runq(data: Series, extra: dict[int, dict[int, float]], steps: list[int]) -> Series:
    """Gap and own-work series with run-queue wait taken out only where it explains the gap.

    ``extra``: each rank's run-queue wait per step less the other ranks' median at that step
    (:func:`runq_extra`). At a (rank, step) whose extra wait reaches :data:`EXPLAINS` of the
    rank's positive gaps summed over its phases, the wait is taken out of those gaps (each
    in proportion to its gap, never below zero) and of their own work; every other value is
    kept gross. The wait is never spread by phase length: a phase that sleeps, blocks on I/O
    or waits on its own data is not waiting for a CPU, and a step-level wait put on it by
    weight hid real stragglers (a 25 ms optimizer sleep came out "balanced" in 15 of 23
    runs on a loaded host, with both ranks' waits risen alike). Negative gaps stay as they
    are: run-queue wait explains a gap away, never makes one.
    """
    keys = list(data)
    if not keys:
        return {}
    lens = np.array([len(data[k][0]) for k in keys], dtype=np.int64)
    pos = np.concatenate([np.asarray(data[k][0], dtype=np.int64) for k in keys])
    gap = np.concatenate([np.asarray(data[k][1], dtype=np.float64) for k in keys])
    own = np.concatenate([np.asarray(data[k][2], dtype=np.float64) for k in keys])
    rank_ids = sorted({r for r, _ in keys})
    rank = np.searchsorted(rank_ids, np.repeat([r for r, _ in keys], lens))
    n_s = len(steps)
    rs = rank * n_s + pos
    up = np.maximum(np.nan_to_num(gap, nan=0.0), 0.0)
    total = np.bincount(rs, weights=up, minlength=len(rank_ids) * n_s)[rs]
    steps_a = np.asarray(steps, dtype=np.int64)
    e = np.zeros(len(gap))
    for i, r in enumerate(rank_ids):
        per = extra.get(r)
        if not per:
            continue
        at = np.flatnonzero(rank == i)
        e[at] = [per.get(s, 0.0) for s in steps_a[pos[at]].tolist()]
    explained = (e > 0.0) & (total > 0.0) & (e >= EXPLAINS * total)
    with np.errstate(divide="ignore", invalid="ignore"):
        take = np.where(explained, np.minimum(e, total) * up / total, 0.0)
    net_gap = gap - take
    net_own = np.maximum(own - take, 0.0)
    out: Series = {}
    bounds = [0, *np.cumsum(lens).tolist()]
    for k, (i, j) in zip(keys, itertools.pairwise(bounds), strict=True):
        out[k] = (pos[i:j], net_gap[i:j], net_own[i:j])
    return out


def thresholds_of(data: Series, median_step: float) -> dict[tuple[int, str], float]:
    """Flag threshold per (rank, phase): the rank's own noise in its gap to the others.

    Noise is the robust sigma of successive differences of the gap (divided by sqrt 2), so
    a level shift or a window of slow steps does not inflate it; floored. Every series at
    once (numpy, no per-series loop)."""
    floor = max(FLOOR_MS, FLOOR_FRAC * median_step)
    keys = list(data)
    out: dict[tuple[int, str], float] = {}
    # Series by chunks of about CHUNK values: each series' noise is its own, so the result
    # is the same as all at once, with the concatenated copies bounded (not 8 bytes × 3
    # per sample of the whole run).
    i = 0
    while i < len(keys):
        j, n = i, 0
        while j < len(keys) and (j == i or n + len(data[keys[j]][1]) <= _CHUNK):
            n += len(data[keys[j]][1])
            j += 1
        out.update(_thresholds_of(data, keys[i:j], floor))
        i = j
    return out


#: Gap values per chunk of :func:`thresholds_of`.
_CHUNK = 1 << 22


def _thresholds_of(data: Series, keys: list[tuple[int, str]],
                   floor: float) -> dict[tuple[int, str], float]:
    if not keys:
        return {}
    lens = np.array([len(data[k][1]) for k in keys], dtype=np.int64)
    gap = np.concatenate([np.asarray(data[k][1], dtype=np.float64) for k in keys])
    # Successive differences within each series: every difference but those across series.
    n_d = np.maximum(lens - 1, 0)
    keep = np.ones(max(len(gap) - 1, 0), dtype=bool)
    ends = np.cumsum(lens)[:-1] - 1  # last value of each series but the final one
    keep[ends[(ends >= 0) & (ends < len(keep))]] = False
    d = (gap[1:] - gap[:-1])[keep]
    mad = grouped.mads_contiguous(d, grouped.starts_of(n_d), n_d)
    sig = np.where(n_d >= 2, SIGMAS * (robust.MAD_SCALE * np.nan_to_num(mad) / math.sqrt(2.0)), 0.0)
    return {k: max(float(v), floor) for k, v in zip(keys, sig.tolist(), strict=True)}


def runq_extra(con: Any) -> dict[int, dict[int, float]]:
    """Each rank's run-queue wait per step (``res.runq_ms``) minus the other ranks' median at
    that step: ``{rank: {step: ms}}``; empty when the runs carry none (a GPU run, records
    from before :mod:`stepscope.instrument.sched`)."""
    has = has_column(con, "step_resources", "runq_ms")
    if not has:
        return {}
    got = con.execute(
        "SELECT step, rank, runq_ms FROM step_resources WHERE runq_ms IS NOT NULL AND isfinite(runq_ms)"
    ).fetchnumpy()
    step = np.asarray(got["step"], dtype=np.int64)
    rank = np.asarray(got["rank"], dtype=np.int64)
    ms = np.asarray(got["runq_ms"], dtype=np.float64)
    ustep, cell = np.unique(step, return_inverse=True)
    others = median_of_others(cell, ms, len(ustep))
    out: dict[int, dict[int, float]] = {}
    for r, s, v in zip(rank.tolist(), step.tolist(), (ms - others).tolist(), strict=True):
        if v == v:  # NaN: the rank alone at that step
            out.setdefault(r, {})[s] = v
    return out


def rank_blocks_of(data: Series, ranks: int) -> list[Series]:
    """``data`` cut into blocks of whole ranks (rank // ``ranks``), each in ``data``'s order,
    each series reduced to its step positions and gap (empty own work: the noise and the
    straggler search's screen read nothing else; the positions of series with a gap on
    every step are one array, sent once).

    Each series' noise is its own: :func:`thresholds_of` over every block gives, key by key,
    its value over ``data`` (the per-rank aggregate merges by union)."""
    if ranks < 1:
        raise ValueError(f"ranks per block must be >= 1, got {ranks!r}")
    blocks: dict[int, Series] = {}
    for key, (pos, gap, own) in data.items():
        blocks.setdefault(key[0] // ranks, {})[key] = (pos, gap, own[:0])
    return [blocks[b] for b in sorted(blocks)]


def merge_thresholds(data: Series, parts: Iterable[dict[tuple[int, str], float]]
                     ) -> dict[tuple[int, str], float]:
    """The blocks' thresholds as one dict in ``data``'s order, as :func:`thresholds_of` gives
    it; every series must have its value (a lost block is an error, never a missing flag)."""
    got: dict[tuple[int, str], float] = {}
    for part in parts:
        got.update(part)
    missing = [k for k in data if k not in got]
    if missing or len(got) != len(data):
        raise AnalysisError(f"thresholds of {len(missing)} series missing from the blocks "
                           f"(first {missing[:1]}), {len(got)} given for {len(data)}")
    return {k: got[k] for k in data}
