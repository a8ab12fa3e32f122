"""Each (rank, phase) gap series to the other ranks, its noise, and run-queue wait taken out.

A :data:`Series` maps (rank, phase) to numpy arrays (step positions, gap, own work) in step
order; the flag threshold of each is its robust noise (:func:`build_thresholds`), computed
for every series at once.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from stepscope.analysis import grouped
from stepscope.analysis.own import DenseOwn, OwnColumns
from stepscope.common import robust

#: Flag threshold: SIGMAS robust sigmas of the rank's own step-to-step variation, floored so
#: near-noiseless data does not flag microseconds.
SIGMAS = robust.SIGMAS
FLOOR_MS = 0.25
FLOOR_FRAC = 0.02  # of the median step


#: One (rank, phase) series: step positions, gap to the other ranks, own work (numpy arrays).
Series = dict[tuple[int, str], tuple[Any, Any, Any]]


def _series(con: Any, steps: list[int], cols: OwnColumns | None = None) -> Series:
    """Every (rank, phase) gap series of table ``ex``, in (rank, phase, step) order.

    Fixed-dtype columns, not Python rows: each series is a slice (a view) of arrays sorted
    once in numpy. ``cols``: ex's columns as :func:`build_own` returned them (else read).
    """
    if cols is None:
        names = [str(n) for (n,) in con.execute(
            "SELECT DISTINCT name FROM ex WHERE excess IS NOT NULL ORDER BY 1").fetchall()]
        got = con.execute(
            "SELECT rank, list_position($names, name) - 1 AS nid, step, excess, own FROM ex "
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
    """:func:`_series` from the per-phase matrices: each series is a row (a view) of its
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
    has = con.execute(
        """SELECT count(*) FROM information_schema.columns
           WHERE table_name = 'res' AND column_name = 'runq_ms'""").fetchone()[0]
    out: dict[int, dict[int, float]] = {}
    if not has:
        return out
    for rank, step, ms in con.execute(
        "SELECT rank, step, runq_ms FROM res WHERE runq_ms IS NOT NULL AND isfinite(runq_ms) AND runq_ms >= 0"
    ).fetchall():
        out.setdefault(int(rank), {})[int(step)] = float(ms)
    return out if len(out) > 1 else {}


def _net_of_runq(data: Series, runq: dict[int, dict[int, float]], steps: list[int]) -> Series:
    """Gap series and own-work series with each rank's run-queue wait taken out.

    A step's wait is split over the rank's phases by weight own × max(1, own / the rank's
    median own in that phase): preemption falls on the time the thread ran, and most on
    a phase that ran long (one long preemption lands in one phase). Each phase keeps at
    least nothing (never negative).
    """
    rows = [(r, name, steps[int(i)], o) for (r, name), (pos, _, own) in data.items()
            for i, o in zip(pos.tolist(), own.tolist(), strict=True)]
    base: dict[tuple[int, str], float] = {}
    per_key: dict[tuple[int, str], list[float]] = {}
    for rank, name, _, own in rows:
        per_key.setdefault((rank, name), []).append(max(own, 0.0))
    for key, xs in per_key.items():
        base[key] = robust.median(xs)
    weight: dict[tuple[int, int], float] = {}

    def w_of(r: int, name: str, o: float) -> float:
        b = base[(r, name)]
        return o * max(1.0, o / b) if b > 1e-9 else o

    for rank, name, step, own in rows:
        weight[(rank, step)] = weight.get((rank, step), 0.0) + w_of(rank, name, max(own, 0.0))
    net: dict[tuple[int, str], dict[int, float]] = {}
    by_cell: dict[tuple[int, str], list[tuple[float, int]]] = {}
    for rank, name, step, own in rows:
        o = max(own, 0.0)
        tw = weight[(rank, step)]
        q = runq.get(rank, {}).get(step, 0.0)
        v = max(0.0, o - q * w_of(rank, name, o) / tw) if tw > 0 else o
        net.setdefault((rank, name), {})[step] = v
        by_cell.setdefault((step, name), []).append((v, rank))
    others: dict[tuple[int, int, str], float] = {}
    for (st, name), vals in by_cell.items():
        if len(vals) < 2:
            continue
        vals.sort()
        xs = [v for v, _ in vals]
        for k, (_, r) in enumerate(vals):
            others[(r, st, name)] = _median_without(xs, k)
    pos_of = {s: i for i, s in enumerate(steps)}
    # Run-queue wait explains a gap away, never makes one, at each step too: the others' wait
    # for a CPU taken out of them cannot put a rank behind by more than they really waited
    # for it (its raw gap). Time inside a collective is shared: one rank held off the CPU
    # there stretches both ranks' own work alike, and taking it out of that rank alone would
    # make the other look slow (a 2-rank DDP run read a 2 ms gap on steps whose raw gap was
    # 0.04 ms, and a window found whole came out three steps early).
    raw_gap = {(r, name): dict(zip(pos.tolist(), gap.tolist(), strict=True))
               for (r, name), (pos, gap, _) in data.items()}
    out: Series = {}
    for (r, name), per in net.items():
        rg = raw_gap.get((r, name), {})
        pts = [(p, min(per[st] - others[(r, st, name)], rg.get(p, math.inf)), per[st])
               for st in sorted(per, key=lambda x: pos_of[x]) if (r, st, name) in others
               for p in (pos_of[st],)]
        if pts:
            out[(r, name)] = (np.array([p for p, _, _ in pts], dtype=np.int64),
                              np.array([g for _, g, _ in pts], dtype=np.float64),
                              np.array([o for _, _, o in pts], dtype=np.float64))
    return out


def _thresholds(data: Series, median_step: float) -> dict[tuple[int, str], float]:
    """:func:`build_thresholds`' rule, over every series at once (numpy, no per-series loop)."""
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


#: Gap values per chunk of :func:`_thresholds`.
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
    has = con.execute(
        """SELECT count(*) FROM information_schema.columns
           WHERE table_name = 'res' AND column_name = 'runq_ms'""").fetchone()[0]
    if not has:
        return {}
    by_step: dict[int, list[tuple[float, int]]] = {}
    for step, rank, ms in con.execute(
        "SELECT step, rank, runq_ms FROM res WHERE runq_ms IS NOT NULL AND isfinite(runq_ms)"
    ).fetchall():
        by_step.setdefault(int(step), []).append((float(ms), int(rank)))
    out: dict[int, dict[int, float]] = {}
    for step, vals in by_step.items():
        n = len(vals)
        if n < 2:
            continue
        vals.sort()
        xs = [v for v, _ in vals]
        for k, (ms, rank) in enumerate(vals):
            out.setdefault(rank, {})[step] = ms - _median_without(xs, k)
    return out


def _median_without(xs: list[float], k: int) -> float:
    """Median of sorted ``xs`` with position ``k`` left out (the other ranks'), in O(1)."""
    m = len(xs) - 1

    def at(j: int) -> float:
        return xs[j if j < k else j + 1]

    return at(m // 2) if m % 2 else 0.5 * (at(m // 2 - 1) + at(m // 2))


def build_thresholds(con: Any, median_step: float,
                     series: Series | None = None) -> dict[tuple[int, str], float]:
    """Flag threshold per (rank, phase): the rank's own noise in its gap to the others.

    Noise is the robust sigma of successive differences of the gap (divided by sqrt 2), so
    a level shift or a window of slow steps does not inflate it; floored. ``series``: the
    gap series of table ``ex`` (:func:`_series`) when already read.
    """
    if series is None:
        steps = [int(s) for (s,) in con.execute("SELECT DISTINCT step FROM ex ORDER BY 1").fetchall()]
        series = _series(con, steps)
    return _thresholds(series, median_step)
