"""The bytes of a Kineto trace (plain or gzip), bounded in size and depth, and its head."""

from __future__ import annotations

import io
import re
import zlib
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgspec

_RANK_FROM_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
# Kineto writes distributedInfo before traceEvents; the head of the file is enough to find it.
_HEAD_BYTES = 1 << 20
#: What is read of the head first: traceEvents usually starts within a few KB, and each
#: byte read here is depth-checked; only a longer head is read again up to _HEAD_BYTES.
_HEAD_FIRST = 64 << 10

#: Deepest JSON nesting a trace may have. Kineto's deepest values sit at about 7 levels (the
#: document, traceEvents, an event, args, "Input Dims", one tensor's dims, nested lists);
#: deeper input is hostile or broken, and a streaming parser's work grows with depth squared.
MAX_DEPTH = 64
#: Default cap on the bytes read from one trace file after gzip inflation (4 GiB).
MAX_INFLATED_BYTES = 4 << 30
#: How much is read (and inflated) at a time: large reads keep per-call overhead negligible.
READ_CHUNK = 1 << 20

# Non-integers as exact Decimal, as ijson gives them.
_HEAD_DECODER = msgspec.json.Decoder(float_hook=Decimal)
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
    event and reports the truncation itself. Output is produced ``READ_CHUNK`` at a time
    (``max_length``), so a small file that inflates enormously never builds a huge buffer.
    When the input nests deeper than ``max_depth`` or passes ``max_bytes``, reading stops
    at that point and ``stopped`` says why: the parser then sees a truncated document.
    """

    def __init__(self, path: Path, max_bytes: int = MAX_INFLATED_BYTES,
                 max_depth: int | None = MAX_DEPTH) -> None:
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
        # None: the caller bounds depth itself (the event scan does, at no extra pass).
        self._guard = _DepthGuard(max_depth) if max_depth is not None else None

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
                rest = self._raw.read(READ_CHUNK)
            if not rest:
                self._done = True
                return b""
            # Concatenated gzip members (rare, but legal): start a new decoder.
            z = self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            return z.decompress(rest, READ_CHUNK)
        src = z.unconsumed_tail or self._raw.read(READ_CHUNK)
        if not src:
            self.truncated = not z.eof
            self._done = True
            return b""
        return z.decompress(src, READ_CHUNK)

    def _fill(self) -> bytes:
        try:
            data = self._inflate() if self._z is not None else self._raw.read(READ_CHUNK)
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
        keep = self._guard.allowed(data) if self._guard is not None else len(data)
        if keep < len(data) and self._guard is not None:
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


def _open(path: Path, max_bytes: int = MAX_INFLATED_BYTES,
          max_depth: int | None = MAX_DEPTH) -> _TraceReader:
    return _TraceReader(path, max_bytes=max_bytes, max_depth=max_depth)


def read_blocks(reader: _TraceReader, size: int, first: int | None = None) -> Iterator[bytes]:
    """The reader's bytes in blocks of at most ``size`` (the first at most ``first``), each
    what one read gives: with ``size`` >= ``READ_CHUNK`` a block is the chunk the reader
    produced, handed on without a copy (topping blocks up to an exact size copied every
    byte once more)."""
    want = first or size
    while True:
        data = reader.read(want)
        if not data:
            return
        yield data
        want = size


def _read_head_meta(path: Path) -> dict[str, Any]:
    """Top-level keys that precede traceEvents (distributedInfo, deviceProperties, ...)."""
    try:
        for size in (_HEAD_FIRST, _HEAD_BYTES):
            with _open(path, size) as f:
                head = f.read(size)
            if b'"traceEvents"' in head or len(head) < size:
                break
    except (OSError, EOFError, zlib.error, ValueError):
        return {}  # unreadable: the full parse reports it
    # Close the object just before traceEvents so that parsing the head never builds
    # events (the head may hold a megabyte of them).
    cut = head.find(b'"traceEvents"')
    if cut >= 0:
        head = head[:cut] + b'"traceEvents": []}'
    try:  # the usual head: whole JSON once closed, decoded natively in one call
        doc = _HEAD_DECODER.decode(head)
    except (msgspec.DecodeError, RecursionError):  # ValidationError included
        return _head_meta_partial(head)
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if k != "traceEvents"}


def _head_meta_partial(head: bytes) -> dict[str, Any]:
    """The keys of a head that is not whole JSON, one at a time up to the damage."""
    import ijson  # only for damaged or very long heads: its import costs ~20 ms

    meta: dict[str, Any] = {}
    try:
        for key, value in ijson.kvitems(io.BytesIO(head), ""):
            if key != "traceEvents":
                meta[key] = value
    except (ijson.JSONError, ValueError):
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
