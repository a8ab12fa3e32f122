"""Per-rank GPU time breakdown per ProfilerStep (and a CPU summary for CPU-only traces)."""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import Any

import numpy as np

from stepscope.analysis import kernels as K
from stepscope.analysis.trace.comm_keys import CommKey, kernel_key, match_keys
from stepscope.analysis.trace.events import DeviceEvent, ParsedTrace
from stepscope.analysis.trace.intervals import (
    Interval,
    _Measure,
    intersect_arrays,
    merge,
    merge_arrays,
)


@dataclass
class Breakdown:
    """GPU time in one window (a ProfilerStep or the whole trace); all times in µs.

    busy = compute + exposed_comm + exposed_memory, and busy + idle = wall.
    kernel_sum is summed durations (overlapping streams counted twice), reported
    separately on purpose: it is not a share of wall time.
    """

    label: str
    step: int | None
    start_us: float
    wall_us: float
    busy_us: float
    idle_us: float
    compute_us: float
    comm_us: float
    memory_us: float
    exposed_comm_us: float
    exposed_memory_us: float
    comm_compute_overlap_pct: float | None
    idle_host_wait_us: float
    idle_kernel_wait_us: float
    kernel_sum_us: float
    kernel_count: int
    launches: int
    by_category_us: dict[str, float]
    h2d_count: int
    h2d_bytes: int
    flops: float
    tflops: float | None


@dataclass
class CpuStep:
    """One ProfilerStep of a CPU trace (no GPU fields: they are absent, not zero); times in µs."""

    label: str
    step: int
    start_us: float
    wall_us: float
    dataloader_us: float
    collective_us: float
    cpu_ops: int


@dataclass
class RankResult:
    """Everything the analyser found for one rank's trace file."""

    rank: int
    file: str
    rank_source: str
    platform: str
    events_seen: int
    device_events: int
    steps: list[Breakdown]
    total: Breakdown | None
    top_kernels: list[dict[str, Any]]
    copies: dict[str, dict[str, float]]
    unclassified_pct: float | None
    warnings: list[str]
    # Communication in time order (match key, duration µs), for cross-rank matching. The key
    # is (process group, collective, seq) where the trace carries them, else
    # ("", kernel or annotation name, k-th occurrence).
    collectives: list[tuple[tuple[str, str, int], float]] = field(default_factory=list, repr=False)
    # CPU summary (top ops by self/total time, collectives, dataloader), for CPU-only traces.
    cpu: dict[str, Any] | None = None
    skipped_events: int = 0


def _us(ns: int | float) -> float:
    return round(ns / 1000.0, 3)


def analyze_parsed(pt: ParsedTrace, top: int = 15) -> RankResult:
    """Compute the breakdown for one parsed trace."""
    warnings = list(pt.warnings)
    if pt.skipped_events:
        warnings.append(f"{Path(pt.path).name}: skipped {pt.skipped_events} malformed event(s) "
                        f"(first: {pt.first_skip_reason})")
    dev = pt.device_events
    platform = "rocm" if pt.is_rocm else ("cuda" if dev else "cpu")
    if not dev:
        return _cpu_result(pt, platform, warnings, top)

    # Device events by start (a stable sort, as sorted() by start), then int64 columns
    # (exact ns) for the unions per kernel class and the per-window sums.
    n = len(dev)
    start, end = pt.device_times()
    by_start = np.argsort(start, kind="stable")
    ev = list(map(dev.__getitem__, by_start.tolist()))
    t0 = start[by_start]
    t1 = end[by_start]
    dur = t1 - t0
    # Categories as small integer codes (in the order they first appear).
    cat_list, cat_code = _codes([d.category for d in ev])
    mem_code = cat_list.index(K.MEMORY) if K.MEMORY in cat_list else -1
    mem_at = np.flatnonzero(cat_code == mem_code).tolist() if mem_code >= 0 else []
    is_h2d = np.zeros(n, dtype=bool)
    is_h2d[[i for i in mem_at if ev[i].copy_kind == "HtoD"]] = True
    klass = np.array([K.kernel_class(c) for c in cat_list])[cat_code]
    pos = t1 > t0
    b_s, b_e = merge_arrays(t0[pos], t1[pos])
    compute, comm, memory = (merge_arrays(t0[pos & (klass == c)], t1[pos & (klass == c)])
                             for c in (K.COMPUTE, K.COMM, K.MEM))
    overlap = intersect_arrays(*compute, *comm)
    m_busy, m_comp, m_comm, m_mem, m_ov = (
        _Measure(x) for x in ((b_s, b_e), compute, comm, memory, overlap)
    )
    launch, found = _launch_times(ev, pt)
    host_wait, kernel_wait = _idle_split(b_s, b_e, t0, np.where(found, launch, _EARLY))
    m_host, m_kwait = _Measure(host_wait), _Measure(kernel_wait)
    starts = t0.tolist()
    has_launch_info = bool(found.any())
    launch_ts = np.sort(np.where(found, launch, t0)[cat_code != mem_code]).tolist()
    flops_ts = sorted(pt.flops)
    flops_starts = [t for t, _ in flops_ts]
    flops_prefix = [0.0]
    for _, f in flops_ts:
        flops_prefix.append(flops_prefix[-1] + f)

    def window(label: str, step: int | None, w0: int, w1: int) -> Breakdown:
        wall = w1 - w0
        b_busy, b_comp, b_comm = m_busy.within(w0, w1), m_comp.within(w0, w1), m_comm.within(w0, w1)
        b_ov = m_ov.within(w0, w1)
        exposed_comm = b_comm - b_ov
        lo, hi = bisect_left(starts, w0), bisect_left(starts, w1)
        # Time per category in the order each first appears (ties in the sort below keep
        # it), summed in event order as floats (a cumulative sum adds in order).
        cc, dd = cat_code[lo:hi], dur[lo:hi]
        present, first = np.unique(cc, return_index=True)
        cats: dict[str, float] = {
            cat_list[k]: float(np.cumsum(dd[cc == k], dtype=np.float64)[-1])
            for k in present[np.argsort(first, kind="stable")].tolist()}
        kcount = int((cc != mem_code).sum())
        h2d_at = (np.flatnonzero(is_h2d[lo:hi]) + lo).tolist()
        h2d = len(h2d_at)
        h2d_bytes = sum(ev[i].nbytes for i in h2d_at)
        fl = flops_prefix[bisect_left(flops_starts, w1)] - flops_prefix[bisect_left(flops_starts, w0)]
        idle = wall - b_busy
        hw, kw = m_host.within(w0, w1), m_kwait.within(w0, w1)
        return Breakdown(
            label=label, step=step, start_us=_us(w0), wall_us=_us(wall), busy_us=_us(b_busy),
            idle_us=_us(idle), compute_us=_us(b_comp), comm_us=_us(b_comm),
            memory_us=_us(m_mem.within(w0, w1)), exposed_comm_us=_us(exposed_comm),
            exposed_memory_us=_us(b_busy - b_comp - exposed_comm),
            comm_compute_overlap_pct=round(100.0 * b_ov / b_comm, 2) if b_comm else None,
            idle_host_wait_us=_us(hw) if has_launch_info else 0.0,
            idle_kernel_wait_us=_us(kw) if has_launch_info else 0.0,
            kernel_sum_us=_us(sum(cats.values())), kernel_count=kcount,
            launches=bisect_left(launch_ts, w1) - bisect_left(launch_ts, w0),
            by_category_us={c: _us(v) for c, v in sorted(cats.items(), key=lambda x: -x[1])},
            h2d_count=h2d, h2d_bytes=h2d_bytes, flops=fl,
            tflops=round(fl / wall / 1e3, 3) if fl and wall > 0 else None,
        )

    if not has_launch_info:
        warnings.append("no launch correlation in the trace: idle time is not split into host/kernel wait")
    steps: list[Breakdown] = []
    seen_steps: set[int] = set()
    for n, s, e in sorted(pt.steps, key=lambda x: x[1]):
        if n in seen_steps or e <= s:
            continue
        seen_steps.add(n)
        steps.append(window(f"ProfilerStep#{n}", n, s, e))
    if not steps:
        warnings.append("no ProfilerStep markers: reporting the whole trace as one window")
    lo_t = int(b_s[0]) if len(b_s) else min(d.start for d in ev)
    hi_t = int(b_e[-1]) if len(b_s) else max(d.end for d in ev)
    total = window("whole trace", None, lo_t, hi_t)

    # Per kernel name, in the order names first appear: count, total ns (float sums of
    # exact integers) and the category of its last event.
    name_list, code = _codes([d.name for d in ev])
    k = len(name_list)
    counts = np.bincount(code, minlength=k).tolist()
    totals = np.bincount(code, weights=dur, minlength=k).tolist()
    last = np.full(k, -1, dtype=np.int64)
    np.maximum.at(last, code, np.arange(len(ev), dtype=np.int64))
    last_cat = cat_code[last].tolist()
    name_ix = {nm: i for i, nm in enumerate(name_list)}
    names = {nm: [counts[i], totals[i]] for nm, i in name_ix.items()}
    name_cat = {nm: cat_list[last_cat[i]] for nm, i in name_ix.items()}
    # Per copy kind, in the order kinds first appear: count, bytes, and time as a float sum
    # in event order (a cumulative sum adds in order, as a running total did).
    copies: dict[str, dict[str, float]] = {}
    if mem_at:
        kind_list, kind_code = _codes([ev[i].copy_kind for i in mem_at])
        mem_bytes = [ev[i].nbytes for i in mem_at]
        mem_us = dur[mem_at] / 1000.0
        for k, kind in enumerate(kind_list):
            sel = kind_code == k
            copies[kind] = {"count": int(sel.sum()),
                            "bytes": sum(compress(mem_bytes, sel.tolist())),
                            "time_us": float(np.cumsum(mem_us[sel])[-1])}
    for c in copies.values():
        c["time_us"] = round(c["time_us"], 3)
        # bytes per µs is MB/s; /1e3 gives GB/s. Memsets carry no bytes.
        c["gbps"] = round(c["bytes"] / c["time_us"] / 1e3, 3) if c["time_us"] and c["bytes"] else 0.0
    ksum = sum(v[1] for v in names.values())
    top_kernels = [
        {"name": n, "category": name_cat[n], "count": int(v[0]), "total_us": _us(v[1]),
         "mean_us": _us(v[1] / v[0]), "pct_of_kernel_sum": round(100.0 * v[1] / ksum, 2) if ksum else 0.0}
        for n, v in sorted(names.items(), key=lambda x: -x[1][1])[:top]
    ]
    other = sum(v[1] for n, v in names.items() if name_cat[n] == K.OTHER)
    comm_at = (np.flatnonzero(cat_code == cat_list.index(K.COMMUNICATION)).tolist()
               if K.COMMUNICATION in cat_list else [])
    collectives = match_keys(
        [(ev[i].start, ev[i].end, kernel_key(ev[i], pt.comm_seq)) for i in comm_at])
    return RankResult(
        pt.rank, pt.path, pt.rank_source, platform, pt.events_seen, len(ev), steps, total,
        top_kernels, copies, round(100.0 * other / ksum, 2) if ksum else None, warnings,
        collectives, None, pt.skipped_events,
    )


def _codes(values: list[Any]) -> tuple[list[Any], np.ndarray]:
    """The distinct ``values`` in the order they first appear, and each value's index there."""
    distinct = list(dict.fromkeys(values))
    index = {v: i for i, v in enumerate(distinct)}
    return distinct, np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values))


_DATALOADER_RE = re.compile(r"DataLoader|_DataLoaderIter|dataloader", re.IGNORECASE)
# One collective shows as the front-end call (``c10d::allreduce_``, on the calling thread) and
# as the backend's work (``gloo:all_reduce``, on its own thread): each is counted once, from
# the backend's ops where the trace has them (they span the transfer and the wait), else from
# the front-end's.
_BACKEND_COLL_PREFIXES = ("gloo:", "nccl:", "mpi:")
_FRONTEND_COLL_PREFIX = "c10d::"


def _cpu_result(pt: ParsedTrace, platform: str, warnings: list[str], top: int) -> RankResult:
    """A CPU-only trace: step times, top CPU ops by self and total time, collectives, data."""
    name = Path(pt.path).name
    ops = pt.cpu_ops
    if not len(ops) and not pt.steps:
        warnings.append(f"{name}: no GPU events and no CPU ops; nothing to summarise")
        return RankResult(pt.rank, pt.path, pt.rank_source, platform, pt.events_seen, 0, [],
                          None, [], {}, None, warnings, skipped_events=pt.skipped_events)
    warnings.append(f"{name}: no GPU events (CPU-only trace); summarising CPU ops instead")
    order = sorted(range(len(ops)), key=lambda i: (ops.tid[i], ops.start[i], -ops.end[i]))
    child = [0] * len(ops)
    stack: list[int] = []
    cur_tid = None
    for i in order:
        if ops.tid[i] != cur_tid:
            stack, cur_tid = [], ops.tid[i]
        s = ops.start[i]
        while stack and ops.end[stack[-1]] <= s:
            stack.pop()
        if stack:
            p = stack[-1]
            child[p] += min(ops.end[i], ops.end[p]) - s
        stack.append(i)
    agg: dict[int, list[int]] = {}
    backend = any(nm.startswith(_BACKEND_COLL_PREFIXES) for nm in ops.names)
    coll_prefixes = _BACKEND_COLL_PREFIXES if backend else (_FRONTEND_COLL_PREFIX,)
    coll_items: list[tuple[int, int, CommKey | str]] = []
    data_iv: list[Interval] = []
    coll_iv: list[Interval] = []
    for i in range(len(ops)):
        s, e, n = ops.start[i], ops.end[i], ops.name[i]
        a = agg.setdefault(n, [0, 0, 0])
        a[0] += 1
        a[1] += e - s
        a[2] += max(0, e - s - child[i])
        nm = ops.names[n]
        if nm.startswith(coll_prefixes):
            coll_iv.append((s, e))
            if not pt.comm_ops:
                coll_items.append((s, e, nm))
        elif _DATALOADER_RE.search(nm):
            data_iv.append((s, e))
    for s, e, ckey in pt.comm_ops:
        coll_items.append((s, e, ckey))
        coll_iv.append((s, e))

    def row(n: int, a: list[int]) -> dict[str, Any]:
        return {"name": ops.names[n], "count": a[0], "total_us": _us(a[1]), "self_us": _us(a[2]),
                "mean_us": _us(a[1] / a[0])}

    by_self = sorted(agg.items(), key=lambda x: -x[1][2])[:top]
    by_total = sorted(agg.items(), key=lambda x: -x[1][1])[:top]
    colls: dict[str, list[int]] = {}
    for s, e, any_key in coll_items:
        label = any_key if isinstance(any_key, str) else f"{any_key[1]} (pg {any_key[0]})"
        c = colls.setdefault(label, [0, 0])
        c[0] += 1
        c[1] += e - s
    m_data, m_coll = _Measure(merge(data_iv)), _Measure(merge(coll_iv))
    steps: list[CpuStep] = []
    seen: set[int] = set()
    sorted_starts = sorted(ops.start)
    for n, s, e in sorted(pt.steps, key=lambda x: x[1]):
        if n in seen or e <= s:
            continue
        seen.add(n)
        count = bisect_left(sorted_starts, e) - bisect_left(sorted_starts, s)
        steps.append(CpuStep(f"ProfilerStep#{n}", n, _us(s), _us(e - s), _us(m_data.within(s, e)),
                             _us(m_coll.within(s, e)), count))
    if not steps:
        warnings.append(f"{name}: no ProfilerStep markers in this CPU trace: no per-step times; "
                        "op totals cover the whole trace")
    cpu = {
        "top_ops_by_self": [row(n, a) for n, a in by_self],
        "top_ops_by_total": [row(n, a) for n, a in by_total],
        "collectives": [{"name": k, "count": v[0], "total_us": _us(v[1])}
                        for k, v in sorted(colls.items(), key=lambda x: -x[1][1])],
        "collective_us": _us(sum(e - s for s, e in merge(coll_iv))),
        "dataloader_us": _us(sum(e - s for s, e in merge(data_iv))),
        "cpu_ops": len(ops),
    }
    return RankResult(pt.rank, pt.path, pt.rank_source, platform, pt.events_seen, 0,
                      steps, None, [], {}, None, warnings,  # type: ignore[arg-type]
                      match_keys(coll_items), cpu, pt.skipped_events)


_Pair = tuple[np.ndarray, np.ndarray]  # (starts, ends) of a merged interval list


_INT64 = (-(1 << 63), (1 << 63) - 1)
_EARLY = -(1 << 62) - 1  # below every gap start (the first gap starts at -2**62)


def _launch_times(ev: list[DeviceEvent], pt: ParsedTrace) -> tuple[np.ndarray, np.ndarray]:
    """Each event's host launch time (ns) found by its correlation id, and where one was.

    A sorted search over the launch columns; for an id launched twice the later launch
    counts (a stable sort keeps file order among equal ids). Ids past 64 bits (hostile input
    only) take one lookup each in :attr:`ParsedTrace.launches`, times clamped to int64:
    every device time is int64, so a clamped launch compares with them as the exact one does.
    """
    n = len(ev)
    try:
        if pt.launch_odd:
            raise OverflowError
        corr = np.fromiter((d.correlation for d in ev), dtype=np.int64, count=n)
    except OverflowError:
        lo, hi = _INT64
        launches = pt.launches
        got = [launches.get(d.correlation) for d in ev]
        found = np.array([g is not None for g in got], dtype=bool)
        launch = np.fromiter((0 if g is None else max(lo, min(hi, g)) for g in got),
                             dtype=np.int64, count=n)
        return launch, found
    keys, vals = pt.launch_ids, pt.launch_ns
    if not len(keys):
        return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
    order = np.argsort(keys, kind="stable")
    keys, vals = keys[order], vals[order]
    at = np.maximum(np.searchsorted(keys, corr, side="right") - 1, 0)
    found = keys[at] == corr
    return np.where(found, vals[at], 0), found


def _idle_split(b_s: np.ndarray, b_e: np.ndarray, starts: np.ndarray, launch_of: np.ndarray
                ) -> tuple[_Pair, _Pair]:
    """Split every gap in device activity into host wait and kernel wait.

    A gap ends when the next device event starts. If the host launched that event only after
    the gap began, the device had nothing queued: the gap up to the launch is host wait (the
    CPU was late) and the rest is launch latency (kernel wait). If it was launched before the
    gap began, the work was queued but not running (a dependency or sync): kernel wait. The
    time before the first and after the last event counts as host wait: nothing was queued.
    ``(b_s, b_e)`` is the busy union, ``starts`` the events' sorted starts and ``launch_of``
    their launch times (:data:`_EARLY` where unknown: read as launched before any gap); the
    two results are ``(starts, ends)`` arrays.
    """
    lo, hi = _EARLY + 1, 1 << 62
    if not len(b_s):
        return (np.array([lo]), np.array([hi])), (b_s[:0], b_s[:0])
    # The first event starting at each busy start is the one whose start ends the gap.
    launch = launch_of[np.searchsorted(starts, b_s[1:], side="left")]
    prev, s = b_e[:-1], b_s[1:]
    late = launch > prev  # launched after the gap began
    cut = np.minimum(launch, s)
    host_s = np.concatenate(([lo], prev[late], b_e[-1:]))
    host_e = np.concatenate((b_s[:1], cut[late], [hi]))
    kw = ~late | (cut < s)
    kw_s = np.where(late, cut, prev)[kw]
    return (host_s, host_e), (kw_s, s[kw])
