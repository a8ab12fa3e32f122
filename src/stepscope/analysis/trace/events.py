"""One pass over a trace's events, keeping what the breakdown needs (device events, launches, steps)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from msgspec import UNSET, Raw

from stepscope.analysis import kernels as K
from stepscope.analysis.trace.reader import (
    MAX_DEPTH,
    MAX_INFLATED_BYTES,
    READ_CHUNK,
    _open,
    _rank_of,
    _read_head_meta,
    _TraceReader,
    read_blocks,
)
from stepscope.analysis.trace.scan import (
    BLOCK_BYTES,
    MAX_EVENT_BYTES,
    Args,
    Event,
    EventScan,
    Malformed,
    Span,
    TraceEvent,
    value,
)
from stepscope.analysis.trace.times import parse_ns

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
# Host-side API calls whose `correlation` arg ties a launch to the device event it created.
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver", "Runtime", "Driver"}
_STEP_RE = re.compile(r"^ProfilerStep\s*#\s*(\d+)")


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
    # Launches as int64 columns in file order: correlation id and host launch ns (for an id
    # launched twice the later one counts, as in :attr:`launches`). Ids past 64 bits
    # (hostile input only) go to ``launch_odd`` instead.
    launch_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    launch_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    launch_odd: dict[int, int] = field(default_factory=dict)
    # The device events' start and end ns as int64 columns (see device_times).
    device_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    device_end: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
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

    def device_times(self) -> tuple[np.ndarray, np.ndarray]:
        """Start and end ns of each device event (in ``device_events`` order), int64.

        The columns the scan kept; taken from the events again if the list was changed since.
        """
        n = len(self.device_events)
        if len(self.device_start) != n:
            self.device_start = np.fromiter((d.start for d in self.device_events),
                                            dtype=np.int64, count=n)
            self.device_end = np.fromiter((d.end for d in self.device_events),
                                          dtype=np.int64, count=n)
        return self.device_start, self.device_end

    @property
    def launches(self) -> dict[int, int]:
        """Correlation id -> host launch ns (built on each call; the breakdown reads the
        columns)."""
        out = dict(zip(self.launch_ids.tolist(), self.launch_ns.tolist(), strict=True))
        out.update(self.launch_odd)
        return out


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
    scan = EventScan(MAX_DEPTH)
    try:
        with _open(p, max_bytes, max_depth=None) as reader:
            _scan_events(_items(reader, scan), out)
    except (Malformed, EOFError, zlib.error, OSError) as e:
        _count_scan_skips(scan, out)
        _cpu_pass(p, out, max_bytes)
        # Everything decoded before the damage is already in `out`.
        stopped = reader.stopped if reader is not None else None
        if stopped:
            out.warnings.append(f"{p.name}: {stopped}; results are partial "
                                f"({out.events_seen} events read)")
        else:
            out.warnings.append(
                f"{p.name}: trace is truncated or malformed after {out.events_seen} events "
                f"({type(e).__name__}: {str(e)[:120]}); results are partial"
            )
        return out
    _count_scan_skips(scan, out)
    _cpu_pass(p, out, max_bytes)
    stopped = scan.stopped or (reader.stopped if reader is not None else None)
    if stopped:
        out.warnings.append(f"{p.name}: {stopped}; results are partial "
                            f"({out.events_seen} events read)")
    return out


def _items(reader: _TraceReader, scan: EventScan) -> Iterator[list[Any]]:
    """The items of the trace's ``traceEvents`` array in lists, decoded a block at a time."""
    # A small first block: the exact scan reads the document's head up to traceEvents,
    # and the fast path takes every block after the array has begun.
    for block in read_blocks(reader, max(BLOCK_BYTES, READ_CHUNK), first=64 << 10):
        yield from scan.feed_batches(block)
        if scan.stopped is not None:
            return
    yield from scan.finish_batches()


def _count_scan_skips(scan: EventScan, out: ParsedTrace) -> None:
    skipped = scan.oversized + scan.unconvertible
    out.events_seen += skipped
    out.skipped_events += skipped
    if skipped and not out.first_skip_reason:
        out.first_skip_reason = (
            f"an event longer than {MAX_EVENT_BYTES >> 20} MiB (a name or argument that long "
            "is hostile or corrupt)" if scan.oversized else scan.first_unconvertible)


def _cpu_pass(p: Path, out: ParsedTrace, max_bytes: int) -> None:
    if out.device_events or not out.events_seen:
        return
    # The same bounds as the first pass; damage there ends this pass at the same point.
    with contextlib.suppress(Malformed, EOFError, zlib.error, OSError), \
            _open(p, max_bytes, max_depth=None) as reader:
        _scan_cpu(_items(reader, EventScan(MAX_DEPTH)), out)


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


_US_DIGITS = 10**16  # a Decimal with adjusted() < 16, as _num accepts
# Times are kept as int64 ns: a time that passes the bounds above but not these is skipped.
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _time(raw: Raw | bytes, what: str) -> int:
    """A raw JSON number of µs as exact integer ns (``int(Decimal(text) * 1000)``)."""
    b = bytes(raw)
    if not b.isdigit():
        whole, dot, frac = b.partition(b".")
        neg = whole[:1] == b"-"
        if neg:
            whole = whole[1:]
        # The usual non-integer, digits "." digits: exact without building a Decimal.
        if dot and frac.isdigit() and whole.isdigit():
            w = int(whole)
            if w < _US_DIGITS:
                ns = w * 1000 + int((frac + b"00")[:3])
                return -ns if neg else ns
    try:  # the common case, a plain JSON number, without a decoder call
        v: Any = int(b) if b.isdigit() else Decimal(b.decode("ascii"))
    except (ValueError, ArithmeticError, UnicodeDecodeError):
        try:
            v = value(raw)
        except ValueError:  # msgspec: an integer too large to convert
            raise _BadEvent(f"{what} is out of range") from None
    return _num(v, what)


def _span(e: Span | Event | TraceEvent) -> tuple[int, int]:
    start = _time(e.ts, "ts")
    if not len(e.dur):
        raise _BadEvent("dur is missing")
    dur = _time(e.dur, "dur")
    if dur < 0:
        raise _BadEvent("dur is negative")
    return start, start + dur


def _args(e: TraceEvent) -> dict[str, Any]:
    a = value(e.args)
    if a is None:
        return {}
    if not isinstance(a, dict):
        raise _BadEvent("args is not an object")
    return a


class _LaunchArgs(msgspec.Struct):
    correlation: Any = None


_LAUNCH_ARGS = msgspec.json.Decoder(_LaunchArgs | None, float_hook=Decimal)


def _correlation(e: TraceEvent) -> Any:
    """A launch's ``args.correlation`` without building its whole args dict."""
    if not len(e.args):
        return None
    try:
        a = _LAUNCH_ARGS.decode(e.args)
    except msgspec.ValidationError:  # args not an object (or odd): the general path decides
        return _args(e).get("correlation")
    return None if a is None else a.correlation


def _name(e: Span | Event | TraceEvent) -> Any:
    return "" if e.name is UNSET else e.name


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


def _get(v: Any, default: Any) -> Any:
    return default if v is UNSET else v


def _note_flops(out: ParsedTrace, e: Any, fl: Any) -> None:
    """Keep a CPU op's ``flops`` (a non-negative finite number, else the event is bad)."""
    if isinstance(fl, bool) or not isinstance(fl, (int, float, Decimal)):
        raise _BadEvent("flops is not a number")
    fv = float(fl)
    if not math.isfinite(fv) or fv < 0:
        raise _BadEvent("flops is out of range")
    out.flops.append((_time(e.ts, "ts"), fv))


def _note_comm(out: ParsedTrace, e: Any, key: tuple[str, str, int] | None, ext_raw: Any) -> None:
    """Keep a ``record_param_comms`` op: its span and, with a sequence number, its external id."""
    if key is None:
        return
    start, end = _span(e)
    ext = _int_arg(ext_raw)
    if key[2] >= 0 and ext >= 0:
        out.comm_seq[ext] = key
    out.comm_ops.append((start, end, key))


def _comm_key_of(a: Args) -> tuple[str, str, int] | None:
    """:func:`_comm_key` on decoded :class:`Args`."""
    pg = a.pg if a.pg is not UNSET else _get(a.pg_name, None)
    if pg is None:
        return None
    coll = a.coll if a.coll is not UNSET else _get(a.collective_name, "")
    seq = _int_arg(a.seq_cap if a.seq_cap is not UNSET else _get(a.seq, None), -1)
    return str(pg)[:200], str(coll)[:100], seq


_NO_ARGS = Args()


class _TimeColumn:
    """Raw JSON times gathered while scanning, converted to ns together at the end.

    Each decoded batch's raw texts are joined into one buffer when the batch ends (a raw
    value points into the decoded slice; joining copies the few bytes and lets the slice
    go). :func:`times.parse_ns` converts the plain numbers in numpy; any other text is
    converted on its own by :func:`_time`, which also raises for the bad ones.
    """

    __slots__ = ("batch", "n", "odd", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.batch: list[Any] = []
        self.n = 0
        self.odd: dict[int, bytes] = {}  # row -> text that spans lines (never a number)

    def flush(self) -> None:
        raws = self.batch
        if not raws:
            return
        buf = b"\n".join(raws)
        if buf.count(b"\n") != len(raws) - 1:  # a value with a line break (not a number)
            for i, r in enumerate(raws):
                if b"\n" in bytes(r):
                    self.odd[self.n + i] = bytes(r)
                    raws[i] = b"?"
            buf = b"\n".join(raws)
        self.parts.append(buf)
        self.n += len(raws)
        self.batch = []

    def array(self, what: str) -> tuple[np.ndarray, list[str | None] | None]:
        """Each row's ns as int64 (0 where bad) and, where any row is bad, per row None or
        why it is bad (None when every row converted)."""
        self.flush()
        buf = b"\n".join(self.parts)
        self.parts = []
        ns, ok = parse_ns(buf, self.n)
        if not self.n or ok.all():
            return ns, None
        errors: list[str | None] = [None] * self.n
        texts = buf.split(b"\n")
        for i in np.flatnonzero(~ok).tolist():
            text = self.odd.get(i, texts[i] if i < len(texts) else b"")
            try:
                v = _time(text, what)
                if not _I64_MIN <= v <= _I64_MAX:  # up to 1e19 ns passes _time's bounds
                    raise _BadEvent(f"{what} is out of range")
                ns[i] = v
            except _BadEvent as exc:
                errors[i] = str(exc)
        return ns, (errors if any(errors) else None)


def _skip(out: ParsedTrace, reason: str) -> None:
    out.skipped_events += 1
    if out.skipped_events == 1:
        out.first_skip_reason = reason[:120]


def _scan_events(batches: Iterable[list[Any]], out: ParsedTrace) -> None:
    dev = out.device_events
    steps = out.steps
    # Kernel names repeat thousands of times and run to hundreds of characters: keep one
    # copy, and classify each distinct (name, category) once.
    names: dict[str, str] = {}
    classes: dict[tuple[str, str], tuple[str, str]] = {}
    kinds: dict[tuple[str, str | None], str] = {}  # (memcpy name, args.kind) -> copy kind
    # Columns filled per event, times converted together after the pass (see _TimeColumn):
    # launches (correlation, ts) and device events (ts, dur, the other fields).
    launch_corr = _LaunchIds()
    launch_ts = _TimeColumn()
    dev_ts, dev_dur = _TimeColumn(), _TimeColumn()
    dev_rows: list[DeviceEvent] = []
    lts, dts, ddur = launch_ts.batch, dev_ts.batch, dev_dur.batch
    # Bound appends of the hot columns (rebound per batch with the columns' new lists).
    corr_add, lts_add = launch_corr.ids.append, lts.append
    try:
        for batch in batches:
            out.events_seen += len(batch)
            for e in batch:
                tp = type(e)
                if tp is not Span:  # the fast path's complete events; the rest are rare
                    if tp is TraceEvent:
                        _lenient_event(e, out, names, launch_corr, lts, dts, ddur, dev_rows)
                    if tp is not Event or e.ph != "X":
                        continue
                cat = e.cat
                try:
                    if cat == "cpu_op":
                        a = e.args
                        if a is None:
                            continue
                        if a.flops:
                            _note_flops(out, e, a.flops)
                        if e.name == "record_param_comms":
                            _note_comm(out, e, _comm_key_of(a), _get(a.external_id, -1))
                    elif cat in _LAUNCH_CATS:
                        a = e.args
                        if a is not None:
                            corr = a.correlation
                            if type(corr) is int:
                                try:
                                    corr_add(corr)
                                except OverflowError:  # past 64 bits (hostile): aside
                                    launch_corr.add_big(corr)
                                lts_add(e.ts)
                            elif corr is not None and corr is not UNSET:
                                launch_corr.add(_int_arg(corr))
                                lts_add(e.ts)
                        if cat[0] == "h" and cat[:3] == "hip":  # no slice for CUDA
                            out.is_rocm = True
                    elif cat in _DEVICE_CATS:
                        a = e.args or _NO_ARGS
                        if not len(e.dur):
                            # The ts is checked first, as for any span.
                            _time(e.ts, "ts")
                            raise _BadEvent("dur is missing")
                        name = e.name
                        if type(name) is not str:
                            name = "" if name is UNSET else str(name)
                        # One lookup per event: the first copy of the name and its class.
                        known = classes.get((name, cat))
                        if known is None:
                            first = names.setdefault(name, name)
                            known = classes[(name, cat)] = (first, K.classify(first, cat))
                        name, category = known
                        kind = ""
                        nbytes = 0
                        if category == K.MEMORY:
                            ka = a.kind
                            if ka is UNSET:
                                ka = None
                            if ka is None or type(ka) is str:  # hashable: once per pair
                                kind = kinds.get((name, ka)) or kinds.setdefault(
                                    (name, ka), K.copy_kind(name, ka))
                            else:
                                kind = K.copy_kind(name, ka)
                            nb = a.nbytes
                            nbytes = (max(0, nb) if type(nb) is int
                                      else max(0, _int_arg(None if nb is UNSET else nb, 0)))
                        stream = a.stream
                        if stream is UNSET:
                            stream = -1 if e.tid is UNSET else e.tid
                        corr = a.correlation
                        ext = a.external_id
                        row = DeviceEvent(
                            0, 0, name, category,
                            int(stream) if isinstance(stream, int) else -1,
                            corr if type(corr) is int else _int_arg(_get(corr, -1)), nbytes, kind,
                            _comm_key_of(a) if category == K.COMMUNICATION else None,
                            ext if type(ext) is int else _int_arg(_get(ext, -1)),
                        )
                        dts.append(e.ts)
                        ddur.append(e.dur)
                        dev_rows.append(row)
                    elif cat == "user_annotation":
                        m = _STEP_RE.match(str(_name(e)))
                        if m:
                            start, end = _span(e)
                            steps.append((int(m.group(1)), start, end))
                except (_BadEvent, KeyError, TypeError, ValueError, ArithmeticError) as exc:
                    # One malformed event (missing ts, a string where a number belongs) must
                    # not cost the whole file: skip it and count it.
                    _skip(out, str(exc) or type(exc).__name__)
            launch_ts.flush()
            dev_ts.flush()
            dev_dur.flush()
            lts, dts, ddur = launch_ts.batch, dev_ts.batch, dev_dur.batch
            lts_add = lts.append
            # Freed before the next batch is decoded, which then reuses its memory.
            del batch
    finally:
        # Also when the scan stops at damage: what was read before it is kept.
        _finish_launches(out, launch_corr, launch_ts)
        _finish_device(dev, out, dev_ts, dev_dur, dev_rows)


class _LaunchIds:
    """Launches' correlation ids in file order, as a C array of int64 (no Python int kept
    per launch); an id past 64 bits (hostile input only) holds a 0 there and is kept in
    ``big`` by its row."""

    __slots__ = ("big", "ids")

    def __init__(self) -> None:
        self.ids = array("q")
        self.big: dict[int, int] = {}

    def add(self, v: int) -> None:
        try:
            self.ids.append(v)
        except OverflowError:
            self.add_big(v)

    def add_big(self, v: int) -> None:
        self.big[len(self.ids)] = v
        self.ids.append(0)


def _finish_launches(out: ParsedTrace, corr: _LaunchIds, ts_col: _TimeColumn) -> None:
    ts, errors = ts_col.array("ts")
    ids = np.array(corr.ids, dtype=np.int64) if len(corr.ids) else np.zeros(0, np.int64)
    big = corr.big
    keep = None
    if errors is not None:  # rare: skip the launches whose time is bad, in file order
        keep = np.array([e is None for e in errors], dtype=bool)
        for err in errors:
            if err is not None:
                _skip(out, err)
    if big:  # ids past 64 bits (hostile): those few as a dict, later launches winning
        tl = ts.tolist()
        out.launch_odd.update((k, tl[row]) for row, k in big.items()
                              if keep is None or keep[row])
        small = np.ones(len(ids), dtype=bool)
        small[list(big)] = False
        keep = small if keep is None else keep & small
    if keep is not None:
        ids, ts = ids[keep], ts[keep]
    out.launch_ids = np.concatenate((out.launch_ids, ids)) if len(out.launch_ids) else ids
    out.launch_ns = np.concatenate((out.launch_ns, ts)) if len(out.launch_ns) else ts


def _finish_device(dev: list[DeviceEvent], out: ParsedTrace, ts_col: _TimeColumn,
                   dur_col: _TimeColumn, rows: list[DeviceEvent]) -> None:
    """Give the device events built during the pass their times (skipping bad ones), and
    keep the times as int64 columns beside them."""
    ts, ts_err = ts_col.array("ts")
    dur, dur_err = dur_col.array("dur")
    end = ts + dur  # wraps only past int64 (hostile input): then end < ts, skipped below
    bad = (dur < 0) | (end < ts)
    if ts_err is not None:
        bad |= np.array([e is not None for e in ts_err], dtype=bool)
    if dur_err is not None:
        bad |= np.array([e is not None for e in dur_err], dtype=bool)
    if bad.any():  # rare: skip them (counted, in file order), keep the rest
        for i in np.flatnonzero(bad).tolist():
            _skip(out, (ts_err[i] if ts_err is not None else None)
                  or (dur_err[i] if dur_err is not None else None)
                  or ("dur is negative" if dur[i] < 0 else "ts + dur is out of range"))
        keep = ~bad
        rows = [r for r, k in zip(rows, keep.tolist(), strict=True) if k]
        ts, end = ts[keep], end[keep]
    for r, s, e in zip(rows, ts.tolist(), end.tolist(), strict=True):
        r.start = s
        r.end = e
    dev.extend(rows)
    out.device_start, out.device_end = ts, end


def _lenient_event(e: TraceEvent, out: ParsedTrace, names: dict[str, str],
                   launch_corr: _LaunchIds, launch_ts: list[Any], dev_ts: list[Any],
                   dev_dur: list[Any], dev_rows: list[DeviceEvent]) -> None:
    """One event in the lenient form (args not an object, or a value msgspec could not
    convert): the general path, reading ``args`` as a dict. Launches and device events
    join the columns of :func:`_scan_events` (in file order)."""
    if e.ph != "X":
        return
    cat = e.cat
    try:
        if cat in _DEVICE_CATS:
            args = _args(e)
            if not len(e.dur):
                _time(e.ts, "ts")
                raise _BadEvent("dur is missing")
            name = str(_name(e))
            name = names.setdefault(name, name)
            category = K.classify(name, cat)
            kind = ""
            nbytes = 0
            if category == K.MEMORY:
                kind = K.copy_kind(name, args.get("kind"))
                nbytes = max(0, _int_arg(args.get("bytes"), 0))
            stream = args.get("stream", -1 if e.tid is UNSET else e.tid)
            row = DeviceEvent(
                0, 0, name, category,
                int(stream) if isinstance(stream, int) else -1,
                _int_arg(args.get("correlation", -1)), nbytes, kind,
                _comm_key(args) if category == K.COMMUNICATION else None,
                _int_arg(args.get("External id", -1)),
            )
            dev_ts.append(e.ts)
            dev_dur.append(e.dur)
            dev_rows.append(row)
        elif cat in _LAUNCH_CATS:
            corr = _correlation(e)
            if corr is not None:
                launch_corr.add(_int_arg(corr))
                launch_ts.append(e.ts)
            if str(cat).startswith("hip"):
                out.is_rocm = True
        elif cat == "user_annotation":
            m = _STEP_RE.match(str(_name(e)))
            if m:
                start, end = _span(e)
                out.steps.append((int(m.group(1)), start, end))
        elif cat == "cpu_op":
            raw = bytes(e.args).lstrip()
            if not raw or raw == b"null":
                return
            if raw[:1] != b"{":
                raise _BadEvent("args is not an object")
            # Most CPU ops carry neither: skip building their (large) args dicts.
            if b'"flops"' not in raw and e.name != "record_param_comms":
                return
            args = _args(e)
            if args.get("flops"):
                _note_flops(out, e, args["flops"])
            if e.name == "record_param_comms":
                _note_comm(out, e, _comm_key(args), args.get("External id", -1))
    except (_BadEvent, KeyError, TypeError, ValueError, ArithmeticError) as exc:
        # One malformed event (missing ts, a string where a number belongs, args that
        # are not an object) must not cost the whole file: skip it and count it.
        _skip(out, str(exc) or type(exc).__name__)


def _scan_cpu(batches: Iterable[list[Any]], out: ParsedTrace) -> None:
    """Second pass over a trace with no device events: collect its CPU ops and annotations.

    Only CPU-only traces pay for it; events the first pass already used (steps, flops,
    record_param_comms) or skipped (args not an object) are not counted again.
    """
    cpu = out.cpu_ops
    for batch in batches:
        for e in batch:
            tp = type(e)
            if tp is not Span and ((tp is not Event and tp is not TraceEvent) or e.ph != "X"):
                continue
            cat = e.cat
            if cat != "cpu_op" and cat != "user_annotation":
                continue
            name = _name(e)
            name = name if isinstance(name, str) else str(name)
            if name == "record_param_comms" or (cat == "user_annotation"
                                                and _STEP_RE.match(name)):
                continue
            if tp is TraceEvent:  # the lenient form: args may be something else
                raw = bytes(e.args).lstrip()
                if raw and raw != b"null" and raw[:1] != b"{":
                    continue
            try:
                start, end = _span(e)
            except _BadEvent as exc:
                out.skipped_events += 1
                if out.skipped_events == 1:
                    out.first_skip_reason = str(exc)
                continue
            tid = 0 if e.tid is UNSET else e.tid
            cpu.add(start, end, name, tid if isinstance(tid, (int, str)) else 0)
