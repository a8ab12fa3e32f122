"""Streaming Kineto trace analysis: per-rank, per-step GPU time breakdown from torch.profiler traces."""

from __future__ import annotations

import io
import os
import re
import zlib
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import ijson

from stepscope.analysis import kernels as K
from stepscope.errors import AnalysisError

SCHEMA = "stepscope.trace/1"

# Kineto's categories for work that runs on the device. Older Kineto wrote "Kernel"/"Memcpy".
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
# Host-side API calls whose `correlation` arg ties a launch to the device event it created.
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver", "Runtime", "Driver"}
_STEP_RE = re.compile(r"^ProfilerStep\s*#\s*(\d+)")
_RANK_FROM_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
# Kineto writes distributedInfo before traceEvents; the head of the file is enough to find it.
_HEAD_BYTES = 1 << 20

Interval = tuple[int, int]


@dataclass(slots=True)
class DeviceEvent:
    """One kept device event; times are integer nanoseconds (exact for ns-resolution traces)."""

    start: int
    end: int
    name: str
    category: str
    stream: int
    correlation: int
    nbytes: int
    copy_kind: str


@dataclass
class ParsedTrace:
    """What the streaming pass keeps of one file: device events and the few CPU facts needed."""

    path: str
    rank: int
    rank_source: str
    device_events: list[DeviceEvent] = field(default_factory=list)
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (number, start, end) ns
    launches: dict[int, int] = field(default_factory=dict)  # correlation -> host launch ns
    flops: list[tuple[int, float]] = field(default_factory=list)  # (cpu op start ns, flops)
    events_seen: int = 0
    is_rocm: bool = False
    warnings: list[str] = field(default_factory=list)


def _ns(v: Any) -> int:
    # ijson yields Decimal for non-integers, so µs → ns is exact even at ns resolution where a
    # float64 of epoch microseconds would already be rounded to 0.25 µs.
    return int(v * 1000)


def _open(path: Path) -> BinaryIO:
    # Sniff the gzip magic rather than trust the suffix: people rename files.
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return _TolerantGzip(path)  # type: ignore[return-value]
    return open(path, "rb")  # returned to the caller, who closes it


class _TolerantGzip(io.RawIOBase):
    """A gzip reader that ends quietly at a cut-off stream instead of raising EOFError.

    gzip.GzipFile raises on the read that hits the cut and drops what it decoded in that
    read; decoding with zlib ourselves keeps every byte, so the JSON parser yields every
    complete event and then reports the truncation itself.
    """

    _CHUNK = 1 << 16

    def __init__(self, path: Path) -> None:
        self._raw = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)  # 16+: expect a gzip header
        self._buf = b""
        self.truncated = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        if size == 0:  # ijson probes with read(0) to tell bytes from text
            return b""
        want = size if size > 0 else 1 << 62
        while len(self._buf) < want:
            chunk = self._raw.read(self._CHUNK)
            if not chunk:
                if not self._z.eof:
                    self.truncated = True
                break
            try:
                self._buf += self._z.decompress(chunk)
                # Concatenated gzip members (rare, but legal): start a new decoder.
                while self._z.eof and self._z.unused_data:
                    rest = self._z.unused_data
                    self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    self._buf += self._z.decompress(rest)
            except zlib.error:
                self.truncated = True
                break
        out, self._buf = self._buf[:want], self._buf[want:]
        return out

    def close(self) -> None:
        self._raw.close()
        super().close()


def _read_head_meta(path: Path) -> dict[str, Any]:
    """Top-level keys that precede traceEvents (distributedInfo, deviceProperties, ...)."""
    meta: dict[str, Any] = {}
    try:
        with _open(path) as f:
            head = f.read(_HEAD_BYTES)
        # Close the object just before traceEvents so that parsing the head never builds
        # events (the head may hold a megabyte of them).
        cut = head.find(b'"traceEvents"')
        if cut >= 0:
            head = head[:cut] + b'"traceEvents": []}'
        for key, value in ijson.kvitems(io.BytesIO(head), ""):
            if key != "traceEvents":
                meta[key] = value
    except (ijson.JSONError, OSError, EOFError, zlib.error, ValueError):
        # The head was cut mid-value (expected when traceEvents starts) or is not JSON; the
        # full parse reports real damage.
        pass
    return meta


def _rank_of(path: Path, meta: dict[str, Any]) -> tuple[int, str]:
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return int(info["rank"]), "distributedInfo"
    m = _RANK_FROM_NAME.search(path.name)
    if m:
        return int(m.group(1)), "file name"
    return 0, "default"


def parse_trace(path: str | os.PathLike[str]) -> ParsedTrace:
    """Stream one Kineto trace file, keeping only what the breakdown needs.

    Never raises on damaged input: truncation and bad JSON become warnings and whatever was
    read before the damage is kept.
    """
    p = Path(path)
    meta = _read_head_meta(p)
    rank, source = _rank_of(p, meta)
    out = ParsedTrace(path=str(p), rank=rank, rank_source=source)
    if source == "default":
        out.warnings.append(f"{p.name}: no distributedInfo and no rank in the file name; rank 0")
    props = meta.get("deviceProperties")
    if isinstance(props, list) and any("AMD" in str(d.get("name", "")) for d in props
                                       if isinstance(d, dict)):
        out.is_rocm = True
    try:
        with _open(p) as f:
            _scan_events(ijson.items(f, "traceEvents.item"), out)
    except (ijson.JSONError, EOFError, zlib.error, OSError, ValueError) as e:
        # ijson reports truncation as IncompleteJSONError; gzip as EOFError. Everything yielded
        # before the damage is already in `out`.
        out.warnings.append(
            f"{p.name}: trace is truncated or malformed after {out.events_seen} events "
            f"({type(e).__name__}: {str(e)[:120]}); results are partial"
        )
    return out


def _scan_events(events: Iterable[Any], out: ParsedTrace) -> None:
    dev = out.device_events
    launches = out.launches
    # Kernel names repeat thousands of times and run to hundreds of characters; keep one copy.
    names: dict[str, str] = {}
    for e in events:
        out.events_seen += 1
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        try:
            if cat in _DEVICE_CATS:
                args = e.get("args") or {}
                start = _ns(e["ts"])
                name = str(e.get("name", ""))
                name = names.setdefault(name, name)
                category = K.classify(name, cat)
                kind = ""
                nbytes = 0
                if category == K.MEMORY:
                    kind = K.copy_kind(name, args.get("kind"))
                    nbytes = int(args.get("bytes") or 0)
                stream = args.get("stream", e.get("tid", -1))
                dev.append(DeviceEvent(
                    start, start + _ns(e.get("dur", 0)), name, category,
                    int(stream) if isinstance(stream, int) else -1,
                    int(args.get("correlation", -1)), nbytes, kind,
                ))
            elif cat in _LAUNCH_CATS:
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    launches[int(corr)] = _ns(e["ts"])
                if str(cat).startswith("hip"):
                    out.is_rocm = True
            elif cat == "user_annotation":
                m = _STEP_RE.match(str(e.get("name", "")))
                if m:
                    start = _ns(e["ts"])
                    out.steps.append((int(m.group(1)), start, start + _ns(e.get("dur", 0))))
            elif cat == "cpu_op":
                fl = (e.get("args") or {}).get("flops")
                if fl:
                    out.flops.append((_ns(e["ts"]), float(fl)))
        except (KeyError, TypeError, ValueError, ArithmeticError):
            # One malformed event (missing ts, a string where a number belongs) must not
            # cost the whole file; count it once per file below.
            if not any(w.startswith("skipped malformed") for w in out.warnings):
                out.warnings.append("skipped malformed events (missing or non-numeric ts/dur)")


# ----------------------------------------------------------------------------- intervals


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of intervals as a sorted list of disjoint ones."""
    out: list[Interval] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists (two-pointer sweep)."""
    i = j = 0
    out: list[Interval] = []
    while i < len(a) and j < len(b):
        s = max(a[i][0], b[j][0])
        e = min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class _Measure:
    """Length of a merged interval list inside any window, in O(log n) via prefix sums."""

    def __init__(self, merged: list[Interval]) -> None:
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]
        self.prefix = [0]
        for s, e in merged:
            self.prefix.append(self.prefix[-1] + e - s)

    def within(self, w0: int, w1: int) -> int:
        if w1 <= w0 or not self.starts:
            return 0
        i = bisect_right(self.ends, w0)  # first interval ending after w0
        j = bisect_left(self.starts, w1)  # intervals from i to j-1 start before w1
        if i >= j:
            return 0
        total = self.prefix[j] - self.prefix[i]
        total -= max(0, w0 - self.starts[i])
        total -= max(0, self.ends[j - 1] - w1)
        return total


# ----------------------------------------------------------------------------- breakdown


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
    # Communication kernels in time order (name, duration µs), for cross-rank matching.
    collectives: list[tuple[str, float]] = field(default_factory=list, repr=False)


def _us(ns: int | float) -> float:
    return round(ns / 1000.0, 3)


def analyse_parsed(pt: ParsedTrace, top: int = 15) -> RankResult:
    """Compute the breakdown for one parsed trace."""
    warnings = list(pt.warnings)
    ev = sorted(pt.device_events, key=lambda d: d.start)
    platform = "rocm" if pt.is_rocm else ("cuda" if ev else "cpu")
    if not ev:
        warnings.append(f"{Path(pt.path).name}: no GPU events (CPU-only trace); nothing to break down")
        return RankResult(pt.rank, pt.path, pt.rank_source, platform, pt.events_seen, 0, [],
                          None, [], {}, None, warnings)

    by_class: dict[str, list[Interval]] = {K.COMPUTE: [], K.COMM: [], K.MEM: []}
    for d in ev:
        if d.end > d.start:
            by_class[K.kernel_class(d.category)].append((d.start, d.end))
    busy = merge(iv for ivs in by_class.values() for iv in ivs)
    compute = merge(by_class[K.COMPUTE])
    comm = merge(by_class[K.COMM])
    memory = merge(by_class[K.MEM])
    overlap = intersect(compute, comm)
    m_busy, m_comp, m_comm, m_mem, m_ov = (
        _Measure(x) for x in (busy, compute, comm, memory, overlap)
    )
    host_wait, kernel_wait = _idle_split(busy, ev, pt.launches)
    m_host, m_kwait = _Measure(host_wait), _Measure(kernel_wait)
    starts = [d.start for d in ev]
    has_launch_info = any(d.correlation in pt.launches for d in ev)
    launch_ts = sorted(pt.launches.get(d.correlation, d.start) for d in ev if d.category != K.MEMORY)
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
        cats: dict[str, float] = defaultdict(float)
        kcount = h2d = h2d_bytes = 0
        for d in ev[lo:hi]:
            cats[d.category] += d.end - d.start
            if d.category != K.MEMORY:
                kcount += 1
            elif d.copy_kind == "HtoD":
                h2d += 1
                h2d_bytes += d.nbytes
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
    total = window("whole trace", None, busy[0][0], busy[-1][1])

    names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    name_cat: dict[str, str] = {}
    copies: dict[str, dict[str, float]] = {}
    for d in ev:
        agg = names[d.name]
        agg[0] += 1
        agg[1] += d.end - d.start
        name_cat[d.name] = d.category
        if d.category == K.MEMORY:
            c = copies.setdefault(d.copy_kind, {"count": 0, "bytes": 0, "time_us": 0.0})
            c["count"] += 1
            c["bytes"] += d.nbytes
            c["time_us"] += (d.end - d.start) / 1000.0
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
    collectives = [(d.name, (d.end - d.start) / 1000.0) for d in ev if d.category == K.COMMUNICATION]
    return RankResult(
        pt.rank, pt.path, pt.rank_source, platform, pt.events_seen, len(ev), steps, total,
        top_kernels, copies, round(100.0 * other / ksum, 2) if ksum else None, warnings,
        collectives,
    )


def _idle_split(busy: list[Interval], ev: list[DeviceEvent], launches: dict[int, int]
                ) -> tuple[list[Interval], list[Interval]]:
    """Split every gap in device activity into host wait and kernel wait.

    A gap ends when the next device event starts. If the host launched that event only after
    the gap began, the device had nothing queued: the gap up to the launch is host wait (the
    CPU was late) and the rest is launch latency (kernel wait). If it was launched before the
    gap began, the work was queued but not running (a dependency or sync): kernel wait. The
    time before the first and after the last event counts as host wait: nothing was queued.
    """
    host: list[Interval] = []
    kwait: list[Interval] = []
    starts = [d.start for d in ev]
    lo = -(1 << 62)
    prev_end = lo
    for s, e in busy:
        # The first event starting at s is the one whose start ends the gap.
        d = ev[bisect_left(starts, s)]
        launch = launches.get(d.correlation)
        if prev_end == lo:
            host.append((lo, s))
        elif launch is None or launch <= prev_end:
            kwait.append((prev_end, s))
        else:
            cut = min(launch, s)
            host.append((prev_end, cut))
            if cut < s:
                kwait.append((cut, s))
        prev_end = e
    host.append((prev_end, 1 << 62))
    return host, kwait


# ----------------------------------------------------------------------------- many ranks


@dataclass
class TraceReport:
    """The analysis of one or more rank traces: the JSON contract of ``stepscope trace``."""

    schema: str
    taxonomy_version: str
    ranks: list[RankResult]
    cross_rank: dict[str, Any] | None
    diagnosis: list[dict[str, str]]
    warnings: list[str]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r in d["ranks"]:
            r.pop("collectives", None)
        return d


def trace_files(path: str | os.PathLike[str]) -> list[Path]:
    """The trace files at `path`: the file itself, or the *.json / *.json.gz in a directory."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file()
                       and (f.name.endswith(".json") or f.name.endswith(".json.gz")))
        if files:
            return files
        raise AnalysisError(f"no .json or .json.gz trace files in directory {p}")
    raise AnalysisError(f"no such trace file or directory: {p}")


def _analyse_file(path: str) -> RankResult:
    return analyse_parsed(parse_trace(path))


def analyse(path: str | os.PathLike[str], workers: int | None = None) -> TraceReport:
    """Analyse a trace file or a directory of per-rank traces (ranks in parallel processes)."""
    files = trace_files(path)
    if len(files) > 1 and (workers is None or workers > 1):
        n = min(len(files), workers or os.cpu_count() or 1)
        with ProcessPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(_analyse_file, [str(f) for f in files]))
    else:
        results = [_analyse_file(str(f)) for f in files]
    warnings: list[str] = []
    ranks_seen: Counter[int] = Counter(r.rank for r in results)
    for rank, n in ranks_seen.items():
        if n > 1:
            warnings.append(f"rank {rank} appears in {n} files; ranks are shown per file")
    results.sort(key=lambda r: (r.rank, r.file))
    if all(r.total is None for r in results):
        warnings.append("no GPU activity in any trace: only CPU events were recorded")
    cross = cross_rank(results) if len(results) > 1 else None
    return TraceReport(SCHEMA, K.TAXONOMY_VERSION, results, cross, diagnose(results, cross),
                       warnings)


def cross_rank(results: list[RankResult]) -> dict[str, Any]:
    """Ranks side by side, and collective wait vs transfer.

    The k-th collective of the same name on every rank is taken to be the same collective.
    Its shortest duration across ranks is the transfer; the rest of each rank's duration is
    time spent waiting for the last rank to arrive. The rank with the least wait arrived last.
    """
    rows = []
    for r in results:
        if r.total is None:
            continue
        walls = [s.wall_us for s in r.steps]
        rows.append({
            "rank": r.rank,
            "mean_step_us": round(sum(walls) / len(walls), 3) if walls else None,
            "busy_us": r.total.busy_us, "compute_us": r.total.compute_us,
            "exposed_comm_us": r.total.exposed_comm_us, "idle_us": r.total.idle_us,
            "wall_us": r.total.wall_us,
        })
    seqs: dict[int, dict[str, list[float]]] = {}
    for r in results:
        per_name: dict[str, list[float]] = defaultdict(list)
        for name, dur in r.collectives:
            per_name[_collective_key(name)].append(dur)
        seqs[r.rank] = per_name
    ranks = [r.rank for r in results if r.collectives]
    wait: dict[int, float] = dict.fromkeys(ranks, 0.0)
    transfer = 0.0
    last: Counter[int] = Counter()
    matched = 0
    mismatched = False
    if len(ranks) > 1:
        keys = set.intersection(*(set(seqs[k]) for k in ranks))
        for key in sorted(keys):
            lists = [seqs[k][key] for k in ranks]
            n = min(len(x) for x in lists)
            mismatched |= any(len(x) != n for x in lists)
            for i in range(n):
                durs = [x[i] for x in lists]
                lo = min(durs)
                transfer += lo
                for k, dv in zip(ranks, durs, strict=True):
                    wait[k] += dv - lo
                last[ranks[durs.index(lo)]] += 1
                matched += 1
    return {
        "per_rank": rows,
        "collectives_matched": matched,
        "collective_counts_differ": mismatched,
        "collective_transfer_us": round(transfer, 3),
        "collective_wait_us": {str(k): round(v, 3) for k, v in wait.items()},
        "last_arriving_rank": last.most_common(1)[0][0] if last else None,
        "last_arrivals": {str(k): v for k, v in sorted(last.items())},
    }


def _collective_key(name: str) -> str:
    # "ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)" -> "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    return name.split("(", 1)[0]


def iter_breakdowns(report: TraceReport) -> Iterator[tuple[int, Breakdown]]:
    """Every (rank, step breakdown) pair, for renderers."""
    for r in report.ranks:
        for s in r.steps:
            yield r.rank, s


# ----------------------------------------------------------------------------- diagnosis

# Thresholds, as shares of step (or trace) wall time, above which a symptom is worth a line.
EXPOSED_COMM_PCT = 15.0
MEMORY_PCT = 15.0
IDLE_PCT = 30.0
TINY_KERNEL_US = 10.0
LAUNCH_BOUND_KERNELS = 200


def _windows(r: RankResult) -> list[Breakdown]:
    return r.steps or ([r.total] if r.total else [])


def diagnose(results: list[RankResult], cross: dict[str, Any] | None) -> list[dict[str, str]]:
    """Short plain-language verdicts, each with the rank, the evidence and what to try."""
    out: list[dict[str, str]] = []
    for r in results:
        ws = _windows(r)
        if not ws:
            continue
        wall = sum(w.wall_us for w in ws) or 1.0

        def pct(attr: str, ws: list[Breakdown] = ws, wall: float = wall) -> float:
            return 100.0 * float(sum(getattr(w, attr) for w in ws)) / wall

        exposed, mem, idle = pct("exposed_comm_us"), pct("exposed_memory_us"), pct("idle_us")
        host = pct("idle_host_wait_us")
        kernels = sum(w.kernel_count for w in ws)
        ksum = sum(w.kernel_sum_us - w.by_category_us.get(K.MEMORY, 0.0) for w in ws)
        mean_kernel = ksum / kernels if kernels else 0.0
        per_window = kernels / len(ws)
        tag = f"rank {r.rank}"
        if exposed >= EXPOSED_COMM_PCT:
            out.append({"rank": str(r.rank), "kind": "exposed_comm", "message":
                        f"{tag}: {exposed:.0f}% of step time is communication not hidden behind "
                        "compute. Overlap it (bucketed/async all-reduce, FSDP prefetch) or "
                        "reduce what is communicated."})
        if mean_kernel and mean_kernel < TINY_KERNEL_US and per_window >= LAUNCH_BOUND_KERNELS:
            out.append({"rank": str(r.rank), "kind": "launch_bound", "message":
                        f"{tag}: {per_window:.0f} kernels per step averaging {mean_kernel:.1f} µs: "
                        "launch-bound. Fuse them with torch.compile or capture the step in "
                        "CUDA graphs."})
        if mem >= MEMORY_PCT:
            out.append({"rank": str(r.rank), "kind": "memcpy_heavy", "message":
                        f"{tag}: {mem:.0f}% of step time is memory copies/sets alone. Pin host "
                        "memory, copy with non_blocking=True and prefetch the next batch."})
        if idle >= IDLE_PCT:
            where = ("the host did not enqueue work in time: input- or host-bound (dataloader, "
                     "Python overhead, synchronisation)" if host >= idle / 2 else
                     "queued work waited on dependencies or synchronisation")
            out.append({"rank": str(r.rank), "kind": "idle_heavy", "message":
                        f"{tag}: the GPU is idle {idle:.0f}% of step time ({host:.0f}% host wait); "
                        f"{where}."})
    if cross and cross.get("last_arriving_rank") is not None and cross.get("collectives_matched"):
        waits = cross["collective_wait_us"]
        out.append({"rank": str(cross["last_arriving_rank"]), "kind": "straggler", "message":
                    f"rank {cross['last_arriving_rank']} arrives last at most collectives; the "
                    f"others wait for it (waits µs: {waits})."})
    if not out and any(_windows(r) for r in results):
        out.append({"rank": "", "kind": "compute_bound", "message":
                    "No dominant stall: the GPU is mostly busy with compute. Speed-ups now come "
                    "from the kernels themselves (precision, fusion, larger batches)."})
    return out
