"""The ``traceEvents`` array cut into large slices of whole events, parsed natively.

Two paths over the same bytes. The fast path, used inside the array from any boundary
between events: the last ``}`` followed by ``,`` and ``{`` in the next 256 KiB is a
candidate cut, and msgspec decoding ``[`` slice ``]`` without error proves it (parsing from
a known boundary is deterministic, so a cut inside a string or a nested value leaves
something unterminated). Each event is decoded straight into a small struct: ``args`` into
:class:`Args`, the few keys the analysis reads (msgspec skips the rest without building
them), ``ts``/``dur`` raw until the event is kept. The exact path, used for the document's
head and tail and for any slice the fast path does not vouch for: one ``bytes.translate``
marks the bytes that matter for structure (quotes, backslashes, brackets, commas); numpy
finds which quotes are escaped, which brackets and commas lie outside strings and the
depth after each, and the commas at the array's own depth separate events. Python touches
each event once, in the caller's loop over lists of them.

Bounds, checked while scanning so hostile input costs linear time and bounded memory:
nesting deeper than ``max_depth`` stops the read there (the fast path hands any slice whose
bracket count could pass it to the exact path); an event longer than ``max_event_bytes``
(a 200 MiB kernel name, a 1 GiB string in a 1 MB gzip) is never buffered: it is skipped and
counted (fast slices are never longer than that, so none of their events is).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from decimal import Decimal
from typing import Any, Union

import msgspec
import numpy as np

#: Longest single event kept. Real Kineto events are well under 100 KB (a templated kernel
#: name runs to a few KB); anything past this is hostile or corrupt and is skipped, counted.
MAX_EVENT_BYTES = 1 << 20
#: Bytes scanned per block: large enough that per-block overhead vanishes, small enough that
#: the block and its index arrays stay a few MiB.
BLOCK_BYTES = 512 << 10
#: Bytes of events decoded per msgspec call (bounds the dicts alive at once).
BATCH_BYTES = 128 << 10
#: Bytes of whole events the fast path decodes per msgspec call: a slice and the objects
#: decoded from it stay within a core's L2 cache (2 MiB here). Cutting, checking and
#: decoding the 54 MB trace's slices: 512 KiB 0.1285 s, 256 KiB 0.1265 s (medians of 7).
FAST_BYTES = 256 << 10

_QUOTE, _BACKSLASH, _OPEN, _CLOSE, _COMMA = 1, 2, 3, 4, 5
_CLASS = bytearray(256)
_CLASS[ord('"')] = _QUOTE
_CLASS[ord("\\")] = _BACKSLASH
_CLASS[ord("[")] = _CLASS[ord("{")] = _OPEN
_CLASS[ord("]")] = _CLASS[ord("}")] = _CLOSE
_CLASS[ord(",")] = _COMMA
_TABLE = bytes(_CLASS)
_KEY = b'"traceEvents"'
_FAST_GIVE_UP = 8
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_WS = b" \t\r\n"
#: Bytes of the document outside traceEvents kept to check it is well-formed at the end.
_SKELETON_CAP = 16 << 20



class Args(msgspec.Struct, gc=False):
    """The ``args`` keys the analysis reads; msgspec skips every other key without building it.
    A key that is absent stays ``UNSET`` (``None`` is a JSON null).

    The fields are in the order Kineto writes its keys ("External id" first, then "stream"
    and "correlation"): msgspec looks a key up from the field after the last one matched,
    so each key it knows is found at the first compare (decoding the 54 MB trace's slices:
    0.0897 -> 0.0882 s, min of 9, three alternating rounds)."""

    external_id: Any = msgspec.field(default=msgspec.UNSET, name="External id")
    stream: Any = msgspec.UNSET
    correlation: Any = msgspec.UNSET
    nbytes: Any = msgspec.field(default=msgspec.UNSET, name="bytes")
    kind: Any = msgspec.UNSET
    flops: Any = msgspec.UNSET
    pg: Any = msgspec.field(default=msgspec.UNSET, name="Process Group Name")
    pg_name: Any = msgspec.UNSET
    coll: Any = msgspec.field(default=msgspec.UNSET, name="Collective name")
    collective_name: Any = msgspec.UNSET
    seq_cap: Any = msgspec.field(default=msgspec.UNSET, name="Seq")
    seq: Any = msgspec.UNSET


class _Fields(msgspec.Struct, gc=False):
    """The fields of an event the analysis reads, declared once for every form below.
    ``ts`` and ``dur`` stay raw JSON until an event is kept (see ``events._time``)."""

    cat: Any = msgspec.UNSET
    name: Any = msgspec.UNSET
    tid: Any = msgspec.UNSET
    ts: msgspec.Raw = msgspec.Raw(b"")
    dur: msgspec.Raw = msgspec.Raw(b"")


class Span(_Fields, tag_field="ph", tag="X"):
    """A complete event (``"ph": "X"``) from the fast path: the only phase the analysis reads.
    ``args`` (an object, absent or null) is decoded straight into :class:`Args`."""

    args: Args | None = None


class Mark(msgspec.Struct, gc=False, tag_field="ph"):
    """An event of any other phase (flows, instants, metadata, counters) from the fast path:
    counted, never read, so none of its fields is built."""


# One tagged type per phase of the Chrome trace event format (and its legacy async ones).
# An event whose phase is none of these (or missing) fails the fast decode of its slice,
# and the exact path decodes it as an :class:`Event`.
_MARKS = tuple(msgspec.defstruct(f"Mark_{ord(c)}", [], bases=(Mark,), tag=c)
               for c in "BEIiCbnestfPONDMRc()STpF")


class Event(_Fields):
    """One event in the common form, from the exact path: ``args`` an object (or absent/null)
    decoded straight into :class:`Args`. An event that does not fit (args not an object, a
    number too large for 64 bits) is decoded as a :class:`TraceEvent` instead."""

    ph: Any = msgspec.UNSET
    args: Args | None = None


class TraceEvent(_Fields):
    """An event whose ``args`` is not a plain object of plain values (rare: the lenient form);
    :func:`value` decodes its raw ``args`` with non-integers as exact ``Decimal``."""

    ph: Any = msgspec.UNSET
    args: msgspec.Raw = msgspec.Raw(b"")


_DECODER = msgspec.json.Decoder(float_hook=Decimal)
_BATCH = msgspec.json.Decoder(list[Event], float_hook=Decimal)
# The fast path decodes complete events into Span and every other phase into a fieldless Mark.
_FAST_ITEM: Any = Union[(Span,) + _MARKS]  # noqa: UP007, RUF005 - a union from a tuple (3.10)
_FAST = msgspec.json.Decoder(list[_FAST_ITEM], float_hook=Decimal)
_ONE_EVENT = msgspec.json.Decoder(Event, float_hook=Decimal)
_ONE = msgspec.json.Decoder(TraceEvent)


def value(raw: msgspec.Raw | bytes, missing: Any = None) -> Any:
    """A raw field decoded (``missing`` when the event did not have it)."""
    return _DECODER.decode(raw) if len(raw) else missing


class Malformed(ValueError):
    """The JSON is broken at a point; events before it were delivered."""


class _Structure:
    """Structural bytes of one block: positions, kinds and the depth after each."""

    __slots__ = ("depth", "kind", "pos")

    def __init__(self, pos: Any, kind: Any, depth: Any) -> None:
        self.pos, self.kind, self.depth = pos, kind, depth


def _structure(data: bytes, depth0: int, in_string: bool) -> tuple[_Structure, bool]:
    """Brackets and commas outside strings in ``data`` with the depth after each.

    Returns them and whether ``data`` ends inside a string. ``data`` must not end in a
    backslash (the caller carries a trailing run into the next block).
    """
    codes = np.frombuffer(data.translate(_TABLE), dtype=np.uint8)
    pos = np.flatnonzero(codes)
    kind = codes[pos]
    quote = kind == _QUOTE
    bs = np.flatnonzero(kind == _BACKSLASH)
    if len(bs):
        # A quote is escaped when an odd run of backslashes ends right before it.
        bpos = pos[bs]
        run_start = np.ones(len(bpos), dtype=bool)
        run_start[1:] = np.diff(bpos) != 1
        start_of = bpos[run_start][np.cumsum(run_start) - 1]
        qi = np.flatnonzero(quote)
        qpos = pos[qi]
        k = np.minimum(np.searchsorted(bpos, qpos - 1), len(bpos) - 1)
        after_bs = bpos[k] == qpos - 1
        escaped = after_bs & ((qpos - start_of[k]) % 2 == 1)
        quote[qi[escaped]] = False
    # uint8 wraps at 256, which keeps the parity: all that is needed of the count.
    parity = (np.cumsum(quote, dtype=np.uint8) + np.uint8(in_string)) & 1
    ends_in_string = bool(parity[-1]) if len(parity) else in_string
    keep = (kind >= _OPEN) & (parity == 0)
    skind = kind[keep]
    delta = (skind == _OPEN).astype(np.int64) - (skind == _CLOSE).astype(np.int64)
    return _Structure(pos[keep], skind, depth0 + np.cumsum(delta)), ends_in_string


class EventScan:
    """Feed blocks of a trace's bytes; get back lists of decoded ``traceEvents`` items.

    ``stopped`` says why reading stopped early (depth), ``oversized`` counts skipped
    events; :meth:`finish` raises :class:`Malformed` for a truncated or broken document.
    """

    def __init__(self, max_depth: int, max_event_bytes: int = MAX_EVENT_BYTES,
                 fast_bytes: int = FAST_BYTES) -> None:
        self.max_depth = max_depth
        self.max_event_bytes = max_event_bytes
        self.depth = 0
        self.in_string = False
        self.in_array = False
        self.array_depth = 0
        self.offset = 0  # stream offset of the block being scanned
        self.pending: list[bytes] = []  # the event in progress (after the last comma)
        self.pending_len = 0
        self.skipping = False  # the event in progress is oversized: drop its bytes
        self.oversized = 0
        self.unconvertible = 0  # whole events msgspec parsed but could not convert
        self.first_unconvertible = ""
        self.stopped: str | None = None
        self.skeleton: list[bytes] = []
        self.skeleton_len = 0
        self.went_negative = False
        self._carry = b""
        self._prev_tail = b""
        # Bytes from a boundary between events, not decoded yet (fast path): a view of the
        # end of the last block, which the next block's first slice copies once.
        self._rest: bytes | memoryview = b""
        self.fast_items = 0  # items the fast path decoded (the rest went through the exact scan)
        # Decodes wasted in a row: a trace whose slices keep failing (odd items everywhere)
        # stops trying, so it costs the exact scan alone, not both.
        self._fast_failures = 0
        # Slices the fast path decodes at once: at most max_event_bytes, so none holds an
        # oversized event.
        self._fast_bytes = min(fast_bytes, max_event_bytes)

    # ---------------------------------------------------------------- feeding

    def feed(self, data: bytes) -> Iterator[Any]:
        """Decoded items completed by ``data`` (one at a time; see :meth:`feed_batches`)."""
        for batch in self.feed_batches(data):
            yield from batch

    def feed_batches(self, data: bytes) -> Iterator[list[Any]]:
        """Lists of decoded items completed by ``data`` (feed several MiB at a time)."""
        if self.stopped is not None or self.went_negative:
            return
        if self.in_array and not self.skipping and self._fast_failures < _FAST_GIVE_UP:
            # At (or just past) a boundary between events: try the fast path from there.
            rest: bytes | memoryview = self._rest
            if self.pending:
                rest = b"".join(self.pending)
                self.offset -= self.pending_len
                self.pending, self.pending_len = [], 0
            if self._carry:
                rest = b"".join((rest, self._carry))
                self._carry = b""
            self._rest = b""
            self.depth, self.in_string = self.array_depth, False
            start = 0
            if rest:
                # The first slice joins what was carried with the head of this block, so
                # the block itself is never copied whole behind it; when that slice does
                # not decode, the block is scanned from the carried bytes as one piece.
                start = yield from self._fast_across(rest, data)
                if start < 0:
                    data, start = b"".join((rest, data)), 0
            done = yield from self._fast(data, start)
            if done >= len(data) - self._fast_bytes:
                # A view, not a copy: the next block's first slice copies these bytes anyway
                # (copying them here too cost a copy of ~half of every block).
                self._rest = memoryview(data)[done:]
                return
            data = data[done:]  # something the fast path does not vouch for: scan exactly
        yield from self._feed_exact(data)

    def _fast_across(self, head: bytes | memoryview, data: bytes) -> Generator[list[Any], None, int]:
        """The first slice of events from ``head`` (bytes from a boundary between events)
        on into ``data``, decoded without joining the two whole; returns where it ended in
        ``data`` (the next event's start), or -1 when it did not decode (nothing yielded)."""
        room = self._fast_bytes - len(head)
        c = _cut(data, 0, room) if room > 0 and len(data) > room else -1
        if c < 0:
            return -1
        doc = b"".join((b"[", head, memoryview(data)[:c + 1], b"]"))
        if not self._shallow(doc):
            return -1
        try:
            items: list[Any] = _FAST.decode(doc)
        except (msgspec.DecodeError, RecursionError):  # ValidationError included
            return -1
        self._fast_failures = 0
        self.fast_items += len(items)
        self.offset += len(head) + c + 2
        yield items
        return c + 2

    def _fast(self, data: bytes, start: int = 0) -> Generator[list[Any], None, int]:
        """Whole events from ``data[start:]`` (a boundary between events), as long as
        slices of them decode; returns where it stopped.

        A slice ends at a ``}`` followed by a comma. msgspec decoding ``[slice]`` without
        error proves the cut was at the array's own level: parsing from a known boundary is
        deterministic, so a cut inside a string or a nested value leaves it unterminated.
        Slices are at most ``max_event_bytes`` (so no event in them is oversized) and their
        nesting is checked before they are decoded (:meth:`_shallow`). Anything else (an
        item that is not an event object, a huge number, the end of the array) makes it stop
        and leaves the rest to the exact scan.
        """
        pos, n, size = start, len(data), self._fast_bytes
        view = memoryview(data)
        while n - pos > size:
            c = _cut(data, pos, pos + size)
            if c < 0:
                break
            # The slice as a JSON array, in one copy.
            doc = b"".join((b"[", view[pos:c + 1], b"]"))
            if not self._shallow(doc):
                break
            try:
                items: list[Any] = _FAST.decode(doc)
            except (msgspec.DecodeError, RecursionError):  # ValidationError included
                # Most often a "},{" inside an event (a list of objects in args): one
                # earlier cut, then the exact scan.
                c = _cut(data, pos, c)
                if c < 0:
                    break
                try:  # a prefix of a shallow slice is shallow
                    items = _FAST.decode(b"".join((b"[", view[pos:c + 1], b"]")))
                except (msgspec.DecodeError, RecursionError):
                    self._fast_failures += 1
                    break
            self._fast_failures = 0
            self.fast_items += len(items)
            yield items
            del items  # freed before the next slice is decoded (the caller dropped it too)
            pos = c + 2
        self.offset += pos - start
        return pos

    def _shallow(self, doc: bytes) -> bool:
        """Whether ``doc`` (``[`` whole events from a boundary ``]``) can stay within
        ``max_depth``.

        Counts brackets without telling strings apart (one ``translate``, one cumsum over
        the brackets alone, ~2% of the bytes): brackets inside Kineto strings are balanced
        (``{lambda()#1}``) and only raise the count, so a real trace passes; a string of
        closers could hide some depth from it, which msgspec's own recursion limit still
        bounds (RecursionError: the exact scan takes over). A piece that does not pass is
        scanned exactly, which stops at the first byte past ``max_depth``.
        """
        br = doc.translate(None, _NOT_BRACKETS)
        room = self.max_depth - self.array_depth + 1  # the brackets around the events
        if len(br) <= room:
            return True
        # "[" and "{" have bit 1 set, "]" and "}" do not: (b & 2) - 1 is +1 or -1.
        depth = np.cumsum((np.frombuffer(br, dtype=np.int8) & 2) - 1, dtype=np.int32)
        return int(depth.max()) <= room

    def _feed_exact(self, data: bytes) -> Iterator[list[Any]]:
        if self.stopped is not None or self.went_negative:
            return
        data = self._carry + data if self._carry else data
        n_back = len(data) - len(data.rstrip(b"\\"))
        if n_back:
            self._carry, data = data[len(data) - n_back:], data[: len(data) - n_back]
        else:
            self._carry = b""
        if not data:
            return
        st, ends_in_string = _structure(data, self.depth, self.in_string)
        limit = len(data)
        if len(st.depth):
            over = np.flatnonzero((st.depth > self.max_depth) | (st.depth < 0))
            if len(over):
                i = int(over[0])
                limit = int(st.pos[i])
                if int(st.depth[i]) < 0:
                    self.went_negative = True
                else:
                    self.stopped = (
                        f"JSON nested deeper than {self.max_depth} levels at byte "
                        f"{self.offset + limit:,} (no Kineto trace nests that deep); "
                        "stopped reading there")
                st = _Structure(st.pos[:i], st.kind[:i], st.depth[:i])
        yield from self._walk(data, st, limit)
        if self.stopped is None and not self.went_negative:
            self.in_string = ends_in_string
            self.depth = int(st.depth[-1]) if len(st.depth) else self.depth
        self._prev_tail = (self._prev_tail + data[-256:])[-256:]
        self.offset += len(data)

    def _walk(self, data: bytes, st: _Structure, limit: int) -> Iterator[list[Any]]:
        at = 0  # index into st
        cut = 0  # byte in data where the current region starts
        n = len(st.pos)
        while True:
            if not self.in_array:
                opens = np.flatnonzero((st.kind[at:] == _OPEN) & (st.depth[at:] == 2))
                found = -1
                for j in opens.tolist():
                    p = int(st.pos[at + j])
                    if data[p:p + 1] == b"[" and self._is_trace_events(data, p):
                        found = at + j
                        break
                if found < 0:
                    self._keep_skeleton(data[cut:limit])
                    return
                p = int(st.pos[found])
                self._keep_skeleton(data[cut:p + 1])
                self.in_array, self.array_depth = True, 2
                at, cut = found + 1, p + 1
                continue
            a = self.array_depth
            rest_kind, rest_depth = st.kind[at:], st.depth[at:]
            close = np.flatnonzero((rest_kind == _CLOSE) & (rest_depth == a - 1))
            end = at + int(close[0]) if len(close) else n
            commas = at + np.flatnonzero((st.kind[at:end] == _COMMA) & (st.depth[at:end] == a))
            bounds = [int(x) for x in st.pos[commas].tolist()]
            if end < n:
                bounds.append(int(st.pos[end]))
            if bounds:
                yield from self._region(data, cut, bounds)
            if end < n:
                p = int(st.pos[end])
                self.in_array = False
                self._keep_skeleton(data[p:p + 1])
                at, cut = end + 1, p + 1
                continue
            tail_from = bounds[-1] + 1 if bounds else cut
            if self.skipping:
                return
            piece = data[tail_from:limit]
            if not self.pending:  # whitespace between events is not part of the next one
                piece = piece.lstrip(_WS)
                if not piece:
                    return
            self.pending.append(piece)
            self.pending_len += len(piece)
            if self.pending_len > self.max_event_bytes:
                self.pending, self.pending_len, self.skipping = [], 0, True
            return

    def _region(self, data: bytes, cut: int, bounds: list[int]) -> Iterator[list[Any]]:
        """Items ending at each of ``bounds`` (comma or closing bracket positions).

        Decoded in batches of about :data:`BATCH_BYTES`, so the dicts alive at once stay
        few whatever the block size.
        """
        pre = b"".join(self.pending) if self.pending else b""
        self.pending, self.pending_len = [], 0
        lo, prev = cut, cut - 1
        if self.skipping:  # the event in progress (from earlier blocks) is oversized
            self.skipping, pre = False, b""
            self.oversized += 1
            lo = prev = bounds[0]
            lo += 1
            bounds = bounds[1:]
        for b in bounds:
            if b - prev - 1 + len(pre) > self.max_event_bytes and \
                    len(data[prev + 1:b].strip(_WS)) + len(pre) > self.max_event_bytes:
                if prev >= lo:  # whole items before it (``pre`` is the first one's head)
                    yield from self._decode(pre + data[lo:prev] if pre else data[lo:prev])
                self.oversized += 1
                pre, lo = b"", b + 1
            elif b - lo >= BATCH_BYTES:
                yield from self._decode(pre + data[lo:b] if pre else data[lo:b])
                pre, lo = b"", b + 1
            prev = b
        if prev >= lo:
            yield from self._decode(pre + data[lo:prev] if pre else data[lo:prev])

    def _decode(self, body: bytes) -> Iterator[list[Any]]:
        if not body.strip(_WS):
            return
        try:
            items: list[Any] | None = _BATCH.decode(b"[" + body + b"]")
        except (msgspec.DecodeError, RecursionError):  # ValidationError included
            items = None
        if items is not None:
            yield items
            return
        # Something in this run is broken or odd: go item by item, keep what precedes the
        # damage (items that are not event objects are yielded as plain values).
        out: list[Any] = []
        for raw in _split_items(body):
            try:
                out.append(_ONE_EVENT.decode(raw))
                continue
            except (msgspec.ValidationError, RecursionError):
                pass
            except msgspec.DecodeError as exc:
                yield out
                raise Malformed(str(exc)) from None
            try:
                out.append(_ONE.decode(raw))
                continue
            except msgspec.ValidationError:
                pass
            except msgspec.DecodeError as exc:
                yield out
                raise Malformed(str(exc)) from None
            try:
                out.append(_DECODER.decode(raw))
            except msgspec.ValidationError as exc:  # parsed, not convertible (a huge int)
                self.unconvertible += 1
                self.first_unconvertible = self.first_unconvertible or str(exc)[:120]
            except msgspec.DecodeError as exc:
                yield out
                raise Malformed(str(exc)) from None
        yield out

    def _is_trace_events(self, data: bytes, p: int) -> bool:
        before = (self._prev_tail + data[:p])[-256:] if p < 256 else data[p - 256:p]
        before = before.rstrip(_WS)
        if not before.endswith(b":"):
            return False
        return before[:-1].rstrip(_WS).endswith(_KEY)

    def _keep_skeleton(self, piece: bytes) -> None:
        if self.skeleton_len <= _SKELETON_CAP:
            self.skeleton.append(piece)
            self.skeleton_len += len(piece)

    # ---------------------------------------------------------------- the end

    def finish(self) -> Iterator[Any]:
        """The last items; raise if the JSON is broken (see :meth:`finish_batches`)."""
        for batch in self.finish_batches():
            yield from batch

    def finish_batches(self) -> Iterator[list[Any]]:
        """The last items if the stream ended right after them; raise if the JSON is broken."""
        if self._rest:  # what the fast path left: the array's end, or a last partial event
            rest, self._rest = self._rest, b""
            yield from self._feed_exact(bytes(rest))
        if self.stopped is not None:
            return
        if self.went_negative:
            raise Malformed(f"a closing bracket without an opening one at byte {self.offset:,}")
        if self.in_array and not self.skipping and self.pending and not self.in_string \
                and self.depth == self.array_depth:
            body = b"".join(self.pending)
            self.pending = []
            # A broken last item is the truncation reported just below.
            with contextlib.suppress(Malformed):
                yield from self._decode(body)
        if self.depth != 0 or self.in_string or self.in_array:
            raise Malformed(f"the document ends early (at byte {self.offset + len(self._carry):,},"
                            f" {self.depth} level(s) open)")
        if self.skeleton_len <= _SKELETON_CAP:
            doc = b"".join(self.skeleton)
            try:
                _DECODER.decode(doc if doc.strip(_WS) else b"")
            except msgspec.DecodeError as exc:
                raise Malformed(str(exc)) from None
            except msgspec.ValidationError:  # a huge number outside the events: harmless
                pass


def _cut(data: bytes, lo: int, hi: int) -> int:
    """The last ``}`` in ``data[lo:hi]`` followed by a comma and then ``{`` (whitespace aside):
    where one event object may end and the next begin; -1 if there is none. A candidate
    only; decoding proves it."""
    end = hi
    for _ in range(64):
        c = data.rfind(b"},", lo, end)
        if c < 0:
            return -1
        nxt = data[c + 2:c + 66].lstrip(_WS)[:1]
        if nxt == b"{" or (not nxt and c + 66 >= len(data)):
            return c
        end = c + 1
    return -1


def _split_items(body: bytes) -> list[bytes]:
    """The comma-separated items of an array's content (``body`` holds whole items)."""
    st, _ = _structure(body.rstrip(b"\\"), 0, False)
    cuts = st.pos[(st.kind == _COMMA) & (st.depth == 0)].tolist()
    out, lo = [], 0
    for c in cuts:
        out.append(body[lo:c])
        lo = c + 1
    out.append(body[lo:])
    return [x for x in out if x.strip(_WS)] or [body]
