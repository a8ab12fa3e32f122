"""Streaming Kineto trace analysis: per-rank, per-step GPU time breakdown from torch.profiler traces."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

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
    comm: tuple[str, str, int] | None = None  # (process group, collective, seq) of NCCL kernels
    external_id: int = -1


class CpuOps:
    """CPU ops and annotations in parallel arrays: start/end ns, interned name and thread."""

    def __init__(self) -> None:
        self.start = array("q")
        self.end = array("q")
        self.name = array("l")
        self.tid = array("l")
        self.names: list[str] = []
        self.tids: list[int | str] = []
        self._name_ix: dict[str, int] = {}
        self._tid_ix: dict[int | str, int] = {}

    def add(self, start: int, end: int, name: str, tid: int | str) -> None:
        n = self._name_ix.get(name)
        if n is None:
            n = self._name_ix[name] = len(self.names)
            self.names.append(name)
        t = self._tid_ix.get(tid)
        if t is None:
            t = self._tid_ix[tid] = len(self.tids)
            self.tids.append(tid)
        self.start.append(start)
        self.end.append(end)
        self.name.append(n)
        self.tid.append(t)

    def __len__(self) -> int:
        return len(self.start)


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
    # CPU ops and annotations, for CPU summaries (compact: ~24 bytes per op).
    cpu_ops: CpuOps = field(default_factory=lambda: CpuOps())
    # External id -> (process group, collective, seq) from record_param_comms.
    comm_seq: dict[int, tuple[str, str, int]] = field(default_factory=dict)
    # record_param_comms spans that name their process group: (start, end, key).
    comm_ops: list[tuple[int, int, tuple[str, str, int]]] = field(default_factory=list)
    events_seen: int = 0
    skipped_events: int = 0
    first_skip_reason: str = ""
    is_rocm: bool = False
    warnings: list[str] = field(default_factory=list)


#: Deepest JSON nesting a trace may have. Kineto's deepest values sit at about 7 levels (the
#: document, traceEvents, an event, args, "Input Dims", one tensor's dims, nested lists);
#: deeper input is hostile or broken, and a streaming parser's work grows with depth squared.
MAX_DEPTH = 64
#: Default cap on the bytes read from one trace file after gzip inflation (4 GiB).
MAX_INFLATED_BYTES = 4 << 30
#: How much is read (and inflated) at a time: large reads keep per-call overhead negligible.
_READ_CHUNK = 1 << 20

_OPENERS = b"[{"
_KEEP = b'[]{}"'
_DROP = bytes(b for b in range(256) if b not in _KEEP)


class _DepthGuard:
    """Tracks JSON nesting depth across chunks at C speed (translate, regex, numpy cumsum).

    Escapes are removed first (an escaped backslash, then an escaped quote), strings are cut
    out, and what remains is only brackets, whose running sum is the depth.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.depth = 0
        self.in_string = False
        self.carry = b""  # a trailing run of backslashes, completed by the next chunk

    def allowed(self, chunk: bytes) -> int:
        """How many bytes of ``chunk`` stay within the depth limit (``len(chunk)`` if all)."""
        data = self.carry + chunk if self.carry else chunk
        n_back = 0
        while n_back < len(data) and data[len(data) - 1 - n_back] == 92:  # trailing "\\"s
            n_back += 1
        if n_back:
            self.carry, data = data[len(data) - n_back:], data[: len(data) - n_back]
        else:
            self.carry = b""
        if b"\\" in data:  # escapes are rare in traces; skip the copies when there are none
            data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
        kept = data.translate(None, _DROP)
        if not kept:
            return len(chunk)
        import numpy as np  # imported on first use: small traces skip its import time

        # Only brackets and quotes remain. A quote's running count (plus the string state
        # carried in) is odd inside a string; brackets outside strings set the depth:
        # "[" (91) and "{" (123) have bit 1 set, "]" (93) and "}" (125) do not, so
        # (b & 2) - 1 is +1 for an opener and -1 for a closer.
        arr = np.frombuffer(kept, dtype=np.int8)
        quote = arr == 34
        parity = (np.cumsum(quote, dtype=np.int32) + int(self.in_string)) & 1
        self.in_string = bool(parity[-1])
        outside = arr[(parity == 0) & ~quote]
        if not len(outside):
            return len(chunk)
        depth = np.cumsum((outside & 2) - 1, dtype=np.int32)
        if self.depth + int(depth.max()) <= self.limit:
            self.depth += int(depth[-1])
            return len(chunk)
        return self._exact_cut(chunk)

    def _exact_cut(self, chunk: bytes) -> int:
        # Rare (hostile input): find the byte where the limit is crossed with a plain scan.
        # Re-scanning from the chunk start needs the state before it; reconstruct it from
        # the saved depth (the carry/in_string of the previous chunk are approximated as
        # clean: a cut a few bytes early or late is harmless here).
        depth, in_str, esc = self.depth, False, False
        for i, c in enumerate(chunk):
            if in_str:
                if esc:
                    esc = False
                elif c == 92:
                    esc = True
                elif c == 34:
                    in_str = False
            elif c == 34:
                in_str = True
            elif c in _OPENERS:
                depth += 1
                if depth > self.limit:
                    return i
            elif c in b"]}":
                depth -= 1
        return len(chunk)


class _TraceReader(io.RawIOBase):
    """The bytes of a trace, plain or gzip, in large chunks, with depth and size bounded.

    Gzip is sniffed by its magic rather than trusted from the suffix (people rename files)
    and inflated with zlib directly: a cut-off stream ends quietly (``truncated``) instead
    of raising and dropping the last decoded block, so the JSON parser yields every complete
    event and reports the truncation itself. Output is produced ``_READ_CHUNK`` at a time
    (``max_length``), so a small file that inflates enormously never builds a huge buffer.
    When the input nests deeper than ``max_depth`` or passes ``max_bytes``, reading stops
    at that point and ``stopped`` says why: the parser then sees a truncated document.
    """

    def __init__(self, path: Path, max_bytes: int = MAX_INFLATED_BYTES,
                 max_depth: int = MAX_DEPTH) -> None:
        self._raw = open(path, "rb")  # noqa: SIM115 - closed in close()
        magic = self._raw.read(2)
        self._raw.seek(0)
        self.gzip = magic == b"\x1f\x8b"
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS) if self.gzip else None
        self._pending = b""
        self._pos = 0
        self._done = False
        self.truncated = False
        self.stopped: str | None = None
        self.produced = 0
        self.max_bytes = max_bytes
        self._guard = _DepthGuard(max_depth)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        if size == 0:  # ijson probes with read(0) to tell bytes from text
            return b""
        while self._pos >= len(self._pending) and not self._done:
            self._pending, self._pos = self._fill(), 0
        if size is None or size < 0:
            size = len(self._pending) - self._pos
        out = self._pending[self._pos:self._pos + size]
        self._pos += len(out)
        return out

    def _inflate(self) -> bytes:
        assert self._z is not None
        z = self._z
        if z.eof:
            rest = z.unused_data
            if not rest:
                rest = self._raw.read(_READ_CHUNK)
            if not rest:
                self._done = True
                return b""
            # Concatenated gzip members (rare, but legal): start a new decoder.
            z = self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            return z.decompress(rest, _READ_CHUNK)
        src = z.unconsumed_tail or self._raw.read(_READ_CHUNK)
        if not src:
            self.truncated = not z.eof
            self._done = True
            return b""
        return z.decompress(src, _READ_CHUNK)

    def _fill(self) -> bytes:
        try:
            data = self._inflate() if self._z is not None else self._raw.read(_READ_CHUNK)
        except zlib.error:
            self.truncated = True
            self._done = True
            return b""
        if not data:
            self._done = True
            return b""
        if self.produced + len(data) > self.max_bytes:
            data = data[: self.max_bytes - self.produced]
            self.stopped = (f"stopped after {self.max_bytes:,} bytes"
                            + (" inflated" if self.gzip else "")
                            + " (the per-file cap; raise it with --max-inflated-mb)")
            self._done = True
        keep = self._guard.allowed(data)
        if keep < len(data):
            data = data[:keep]
            self.stopped = (f"JSON nested deeper than {self._guard.limit} levels at byte "
                            f"{self.produced + keep:,} (no Kineto trace nests that deep); "
                            "stopped reading there")
            self._done = True
        self.produced += len(data)
        return data

    def close(self) -> None:
        self._raw.close()
        super().close()


def _open(path: Path, max_bytes: int = MAX_INFLATED_BYTES) -> _TraceReader:
    return _TraceReader(path, max_bytes=max_bytes)


def _read_head_meta(path: Path) -> dict[str, Any]:
    """Top-level keys that precede traceEvents (distributedInfo, deviceProperties, ...)."""
    meta: dict[str, Any] = {}
    try:
        with _open(path, _HEAD_BYTES) as f:
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


def parse_trace(path: str | os.PathLike[str], max_bytes: int = MAX_INFLATED_BYTES) -> ParsedTrace:
    """Stream one Kineto trace file, keeping only what the breakdown needs.

    Never raises on damaged input: truncation and bad JSON become warnings and whatever was
    read before the damage is kept. Reading stops (with a warning) past ``max_bytes`` of
    inflated JSON or at nesting deeper than :data:`MAX_DEPTH`.
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
    reader: _TraceReader | None = None
    try:
        with _open(p, max_bytes) as reader:
            _scan_events(ijson.items(reader, "traceEvents.item", buf_size=1 << 16), out)
    except (ijson.JSONError, EOFError, zlib.error, OSError, ValueError) as e:
        _cpu_pass(p, out, max_bytes)
        # ijson reports truncation as IncompleteJSONError. Everything yielded before the
        # damage is already in `out`.
        if reader is not None and reader.stopped:
            out.warnings.append(f"{p.name}: {reader.stopped}; results are partial "
                                f"({out.events_seen} events read)")
        else:
            out.warnings.append(
                f"{p.name}: trace is truncated or malformed after {out.events_seen} events "
                f"({type(e).__name__}: {str(e)[:120]}); results are partial"
            )
        return out
    _cpu_pass(p, out, max_bytes)
    return out


def _cpu_pass(p: Path, out: ParsedTrace, max_bytes: int) -> None:
    if out.device_events or not out.events_seen:
        return
    # The same bounds as the first pass; damage there ends this pass at the same point.
    with contextlib.suppress(ijson.JSONError, EOFError, zlib.error, OSError, ValueError), \
            _open(p, max_bytes) as reader:
        _scan_cpu(ijson.items(reader, "traceEvents.item", buf_size=1 << 16), out)


# |ts| beyond ~146 years in µs is not a timestamp; checking before int() keeps a hostile
# 1e308 (or a Decimal with a huge exponent) from building enormous integers.
_MAX_US = 4.6e15


class _BadEvent(ValueError):
    """One event that is not a usable trace event; it is skipped and counted."""


def _num(v: Any, what: str) -> int:
    """A finite µs value as integer ns; anything else raises :class:`_BadEvent`."""
    t = type(v)
    if t is Decimal:  # ijson's type for every non-integer; adjusted() is the exponent
        if v.is_finite() and v.adjusted() < 16:
            return int(v * 1000)
    elif t is int:
        if -_MAX_US_INT <= v <= _MAX_US_INT:
            return int(v * 1000)
    elif t is float:
        if math.isfinite(v) and abs(v) <= _MAX_US:
            return int(v * 1000)
    else:
        raise _BadEvent(f"{what} is not a number")
    raise _BadEvent(f"{what} is out of range")


_MAX_US_INT = int(_MAX_US)


def _span(e: dict[str, Any]) -> tuple[int, int]:
    start = _num(e.get("ts"), "ts")
    if "dur" not in e:
        raise _BadEvent("dur is missing")
    dur = _num(e["dur"], "dur")
    if dur < 0:
        raise _BadEvent("dur is negative")
    return start, start + dur


def _args(e: dict[str, Any]) -> dict[str, Any]:
    a = e.get("args")
    if a is None:
        return {}
    if not isinstance(a, dict):
        raise _BadEvent("args is not an object")
    return a


def _int_arg(v: Any, default: int = -1) -> int:
    if isinstance(v, bool):
        return default
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit() and len(v) < 20:
        return int(v)
    return default


def _comm_key(args: dict[str, Any]) -> tuple[str, str, int] | None:
    """(process group, collective, sequence number) when the event carries them."""
    pg = args.get("Process Group Name", args.get("pg_name"))
    if pg is None:
        return None
    coll = args.get("Collective name", args.get("collective_name", ""))
    seq = _int_arg(args.get("Seq", args.get("seq")), -1)
    return str(pg)[:200], str(coll)[:100], seq


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
                args = _args(e)
                start, end = _span(e)
                name = str(e.get("name", ""))
                name = names.setdefault(name, name)
                category = K.classify(name, cat)
                kind = ""
                nbytes = 0
                if category == K.MEMORY:
                    kind = K.copy_kind(name, args.get("kind"))
                    nbytes = max(0, _int_arg(args.get("bytes"), 0))
                stream = args.get("stream", e.get("tid", -1))
                dev.append(DeviceEvent(
                    start, end, name, category,
                    int(stream) if isinstance(stream, int) else -1,
                    _int_arg(args.get("correlation", -1)), nbytes, kind,
                    _comm_key(args) if category == K.COMMUNICATION else None,
                    _int_arg(args.get("External id", -1)),
                ))
            elif cat in _LAUNCH_CATS:
                corr = _args(e).get("correlation")
                if corr is not None:
                    launches[_int_arg(corr)] = _num(e.get("ts"), "ts")
                if str(cat).startswith("hip"):
                    out.is_rocm = True
            elif cat == "user_annotation":
                m = _STEP_RE.match(str(e.get("name", "")))
                if m:
                    start, end = _span(e)
                    out.steps.append((int(m.group(1)), start, end))
            elif cat == "cpu_op":
                cargs = e.get("args")
                if cargs is None:
                    continue
                if type(cargs) is not dict:
                    raise _BadEvent("args is not an object")
                args = cargs
                fl = args.get("flops")
                if fl:
                    if isinstance(fl, bool) or not isinstance(fl, (int, float, Decimal)):
                        raise _BadEvent("flops is not a number")
                    fv = float(fl)
                    if not math.isfinite(fv) or fv < 0:
                        raise _BadEvent("flops is out of range")
                    out.flops.append((_num(e.get("ts"), "ts"), fv))
                if e.get("name") == "record_param_comms":
                    key = _comm_key(args)
                    if key is not None:
                        start, end = _span(e)
                        ext = _int_arg(args.get("External id", -1))
                        if key[2] >= 0 and ext >= 0:
                            out.comm_seq[ext] = key
                        out.comm_ops.append((start, end, key))
        except (_BadEvent, KeyError, TypeError, ValueError, ArithmeticError) as exc:
            # One malformed event (missing ts, a string where a number belongs, args that
            # are not an object) must not cost the whole file: skip it and count it.
            out.skipped_events += 1
            if out.skipped_events == 1:
                out.first_skip_reason = str(exc)[:120] or type(exc).__name__


def _scan_cpu(events: Iterable[Any], out: ParsedTrace) -> None:
    """Second pass over a trace with no device events: collect its CPU ops and annotations.

    Only CPU-only traces pay for it; events the first pass already used (steps, flops,
    record_param_comms) or skipped (args not an object) are not counted again.
    """
    cpu = out.cpu_ops
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat != "cpu_op" and cat != "user_annotation":
            continue
        name = e.get("name", "")
        name = name if isinstance(name, str) else str(name)
        if name == "record_param_comms" or (cat == "user_annotation" and _STEP_RE.match(name)):
            continue
        a = e.get("args")
        if a is not None and not isinstance(a, dict):
            continue
        try:
            start, end = _span(e)
        except _BadEvent as exc:
            out.skipped_events += 1
            if out.skipped_events == 1:
                out.first_skip_reason = str(exc)
            continue
        tid = e.get("tid", 0)
        cpu.add(start, end, name, tid if isinstance(tid, (int, str)) else 0)


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


def analyse_parsed(pt: ParsedTrace, top: int = 15) -> RankResult:
    """Compute the breakdown for one parsed trace."""
    warnings = list(pt.warnings)
    if pt.skipped_events:
        warnings.append(f"{Path(pt.path).name}: skipped {pt.skipped_events} malformed event(s) "
                        f"(first: {pt.first_skip_reason})")
    ev = sorted(pt.device_events, key=lambda d: d.start)
    platform = "rocm" if pt.is_rocm else ("cuda" if ev else "cpu")
    if not ev:
        return _cpu_result(pt, platform, warnings, top)

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
    lo_t = busy[0][0] if busy else min(d.start for d in ev)
    hi_t = busy[-1][1] if busy else max(d.end for d in ev)
    total = window("whole trace", None, lo_t, hi_t)

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
    collectives = _match_keys(
        [(d.start, d.end, _kernel_key(d, pt.comm_seq)) for d in ev if d.category == K.COMMUNICATION]
    )
    return RankResult(
        pt.rank, pt.path, pt.rank_source, platform, pt.events_seen, len(ev), steps, total,
        top_kernels, copies, round(100.0 * other / ksum, 2) if ksum else None, warnings,
        collectives, None, pt.skipped_events,
    )


CommKey = tuple[str, str, int]


def _kernel_key(d: DeviceEvent, comm_seq: dict[int, CommKey]) -> CommKey | str:
    """The match key of one NCCL kernel: its group and sequence number where known."""
    key = d.comm
    if key is not None and key[2] < 0:
        key = comm_seq.get(d.external_id, key)
    return key if key is not None else _collective_key(d.name)


def _match_keys(items: list[tuple[int, int, CommKey | str]]) -> list[tuple[CommKey, float]]:
    """Durations with a cross-rank match key each, in time order.

    Collectives on one process group are issued in the same order on every rank, so where
    the sequence number is missing the k-th call on the same group (or, lacking a group,
    of the same name) is the same collective.
    """
    seen: Counter[tuple[str, str]] = Counter()
    out: list[tuple[CommKey, float]] = []
    for s, e, key in sorted(items, key=lambda x: x[0]):
        if isinstance(key, str):
            group, coll, seq = "", key, -1
        else:
            group, coll, seq = key
        if seq < 0:
            seq = seen[(group, coll)]
            seen[(group, coll)] += 1
            group = group or ""
            key = (group, coll + "#k", seq)
        else:
            key = (group, coll, seq)
        out.append((key, (e - s) / 1000.0))
    return out


_DATALOADER_RE = re.compile(r"DataLoader|_DataLoaderIter|dataloader", re.IGNORECASE)
_COLL_PREFIXES = ("gloo:", "nccl:", "c10d::", "mpi:")


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
        if nm.startswith(_COLL_PREFIXES):
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
                      _match_keys(coll_items), cpu, pt.skipped_events)


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


def _analyse_file(path: str, max_bytes: int = MAX_INFLATED_BYTES) -> RankResult:
    return analyse_parsed(parse_trace(path, max_bytes))


def analyse(path: str | os.PathLike[str], workers: int | None = None,
            max_bytes: int = MAX_INFLATED_BYTES) -> TraceReport:
    """Analyse a trace file or a directory of per-rank traces (ranks in parallel processes).

    ``max_bytes`` caps the JSON read from each file after gzip inflation; a file past it is
    analysed up to the cap, with a warning.
    """
    if max_bytes <= 0:
        raise AnalysisError(f"max_bytes must be positive, got {max_bytes}")
    files = trace_files(path)
    if len(files) > 1 and (workers is None or workers > 1):
        n = min(len(files), workers or os.cpu_count() or 1)
        with ProcessPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(_analyse_file, [str(f) for f in files], [max_bytes] * len(files)))
    else:
        results = [_analyse_file(str(f), max_bytes) for f in files]
    warnings: list[str] = []
    ranks_seen: Counter[int] = Counter(r.rank for r in results)
    for rank, n in ranks_seen.items():
        if n > 1:
            warnings.append(f"rank {rank} appears in {n} files; ranks are shown per file")
    results.sort(key=lambda r: (r.rank, r.file))
    if all(r.total is None for r in results):
        warnings.append("no GPU activity in any trace: only CPU events were recorded")
    skipped = sum(r.skipped_events for r in results)
    if skipped:
        import warnings as _w

        from stepscope.errors import StepscopeWarning

        _w.warn(f"stepscope trace: skipped {skipped} malformed event(s) in {path}; "
                "see the per-rank warnings", StepscopeWarning, stacklevel=2)
    cross = cross_rank(results) if len(results) > 1 else None
    return TraceReport(SCHEMA, K.TAXONOMY_VERSION, results, cross, diagnose(results, cross),
                       warnings)


def cross_rank(results: list[RankResult]) -> dict[str, Any]:
    """Ranks side by side, and collective wait vs transfer.

    Collectives are matched across ranks by (process group, collective, sequence number)
    where the trace carries them (Kineto's NCCL kernel and ``record_param_comms`` args);
    without a sequence number, the k-th call on the same process group is the same
    collective (calls on one group are issued in the same order on every rank), and without
    a group, the k-th call of the same name. Each matched instance is split by the one wait
    rule (:func:`stepscope.analysis.waits.waits`): the shortest time across ranks is the
    transfer, the rest of each rank's time is waiting for the last rank to arrive, which is
    the rank with the shortest time. No clocks are compared across ranks.
    """
    from stepscope.analysis.waits import last_arriver, waits

    rows = []
    for r in results:
        if r.total is None:
            walls = [s.wall_us for s in r.steps]
            if r.cpu is not None:
                rows.append({"rank": r.rank,
                             "mean_step_us": round(sum(walls) / len(walls), 3) if walls else None,
                             "collective_us": r.cpu["collective_us"],
                             "dataloader_us": r.cpu["dataloader_us"]})
            continue
        walls = [s.wall_us for s in r.steps]
        rows.append({
            "rank": r.rank,
            "mean_step_us": round(sum(walls) / len(walls), 3) if walls else None,
            "busy_us": r.total.busy_us, "compute_us": r.total.compute_us,
            "exposed_comm_us": r.total.exposed_comm_us, "idle_us": r.total.idle_us,
            "wall_us": r.total.wall_us,
        })
    by_rank: dict[int, dict[tuple[str, str, int], float]] = {}
    for r in results:
        if r.rank in by_rank:  # the same rank in two files: keep the first
            continue
        by_rank[r.rank] = dict(r.collectives)
    ranks = [k for k, v in by_rank.items() if v]
    wait: dict[int, float] = dict.fromkeys(ranks, 0.0)
    transfer = 0.0
    last: Counter[int] = Counter()
    matched = 0
    by_seq = 0
    mismatched = False
    if len(ranks) > 1:
        keys = set.intersection(*(set(by_rank[k]) for k in ranks))
        union = set.union(*(set(by_rank[k]) for k in ranks))
        mismatched = len(keys) != len(union)
        for key in keys:
            durs = {k: by_rank[k][key] for k in ranks}
            transfer += min(durs.values())
            for k, w in waits(durs).items():
                wait[k] += w
            lr = last_arriver(durs)
            if lr is not None:
                last[lr] += 1
            matched += 1
            by_seq += not key[1].endswith("#k")
    return {
        "per_rank": rows,
        "collectives_matched": matched,
        "collectives_matched_by": ("process group and sequence number" if matched and by_seq == matched
                                   else "process group (or name) and order" if matched and not by_seq
                                   else "mixed" if matched else None),
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
    """Every (rank, GPU step breakdown) pair, for renderers."""
    for r in report.ranks:
        for s in r.steps:
            if isinstance(s, Breakdown):
                yield r.rank, s


# ----------------------------------------------------------------------------- diagnosis

# Thresholds, as shares of step (or trace) wall time, above which a symptom is worth a line.
EXPOSED_COMM_PCT = 15.0
MEMORY_PCT = 15.0
IDLE_PCT = 30.0
TINY_KERNEL_US = 10.0
LAUNCH_BOUND_KERNELS = 200


def _windows(r: RankResult) -> list[Breakdown]:
    if r.total is None:  # a CPU-only trace: no GPU breakdown to diagnose
        return []
    return r.steps or [r.total]


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
