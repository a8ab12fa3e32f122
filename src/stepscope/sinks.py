"""Where records go: per-rank JSONL or SQLite files (or memory, for tests), written off-thread."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sqlite3
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from stepscope.records import SQLITE_COLUMNS, SQLITE_TABLE, rank_file, record_to_row


class Sink(Protocol):
    def write(self, records: Sequence[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Append-only ``rank{R}.jsonl``: one JSON object per line, flushed per batch.

    Each batch is written with a single ``write`` of whole lines, so a process killed
    between batches leaves a valid file and one killed during a write leaves at most one
    torn last line, which the reader tolerates.
    """

    def __init__(self, out_dir: str | os.PathLike[str], rank: int) -> None:
        self.path = rank_file(out_dir, rank, "jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab")  # noqa: SIM115 - lives as long as the sink
        self._warned = False

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        if not records:
            return
        if _file_gone(self.path, self._fh.fileno()):
            # Writing on would append to an unlinked file: every record lost, silently.
            self._warned = _warn_gone(self.path, self._warned)
            self._fh.close()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "ab")  # noqa: SIM115 - lives as long as the sink
        # orjson: the encoding runs in this process and competes with training for the GIL,
        # so the faster encoder is worth its (small, wheel-only) dependency.
        self._fh.write(b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records))
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _file_gone(path: Path, fd: int) -> bool:
    """Whether ``path`` no longer names the open file ``fd`` (deleted, or its dir removed)."""
    try:
        st = os.stat(path)
    except OSError:
        return True
    own = os.fstat(fd)
    return (st.st_ino, st.st_dev) != (own.st_ino, own.st_dev)


def _warn_gone(path: Path, warned: bool) -> bool:
    if not warned:
        from stepscope.errors import StepscopeWarning

        with contextlib.suppress(Exception):  # warnings set as errors must not reach the job
            warnings.warn(f"stepscope: {path} was deleted while the run was writing to it (output "
                          "directory removed?); records written before are lost, it is recreated "
                          "for the rest", StepscopeWarning, stacklevel=2)
    return True


class SqliteSink:
    """``rank{R}.sqlite`` with the table ``step_time_samples``; one transaction per batch."""

    def __init__(self, out_dir: str | os.PathLike[str], rank: int) -> None:
        self.path = rank_file(out_dir, rank, "sqlite")
        self._warned = False
        self._open()
        self._insert = (
            f"INSERT INTO {SQLITE_TABLE} VALUES ({', '.join('?' for _ in SQLITE_COLUMNS)})"
        )

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The writer thread is the only user of this connection after construction.
        self._con = sqlite3.connect(self.path, check_same_thread=False)
        cols = ", ".join(f'"{name}" {kind}' for name, kind in SQLITE_COLUMNS)
        self._con.execute(f"CREATE TABLE IF NOT EXISTS {SQLITE_TABLE} ({cols})")
        self._con.commit()
        st = os.stat(self.path)
        self._id = (st.st_ino, st.st_dev)

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        if not records:
            return
        try:
            st = os.stat(self.path)
            gone = (st.st_ino, st.st_dev) != self._id
        except OSError:
            gone = True
        if gone:
            self._warned = _warn_gone(self.path, self._warned)
            self._con.close()
            self._open()
        with self._con:
            self._con.executemany(self._insert, [record_to_row(r) for r in records])

    def close(self) -> None:
        self._con.close()


class MemorySink:
    """Keeps records in a list; for tests and for in-process consumers."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.closed = False

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        self.closed = True


def open_sink(kind: str, out_dir: str | os.PathLike[str], rank: int) -> Sink:
    if kind == "jsonl":
        return JsonlSink(out_dir, rank)
    if kind == "sqlite":
        return SqliteSink(out_dir, rank)
    raise ValueError(f"unknown sink {kind!r}; expected 'jsonl' or 'sqlite'")


_STOP = object()


class BackgroundWriter:
    """Runs record resolution and ``sink.write`` on a daemon thread, off the training loop.

    Items are lists of records, or callables returning one (the tracer's resolver). ``submit``
    never blocks: when the queue is full (a stalled file system), the item is dropped and
    counted. The first sink error calls ``on_error`` once and stops writing.
    """

    def __init__(
        self,
        sink: Sink,
        on_error: Callable[[BaseException], None],
        max_batches: int = 64,
    ) -> None:
        self.sink = sink
        self.dropped_batches = 0
        self._on_error = on_error
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max_batches)
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="stepscope-writer", daemon=True)
        self._thread.start()

    def submit(self, item: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]]) -> None:
        if self._failed:
            return
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self.dropped_batches += 1

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            if self._failed:
                continue
            try:
                records = item() if callable(item) else item
                if records:
                    self.sink.write(records)
            except Exception as exc:  # protect the job: a full disk must not kill training
                self._failed = True
                self._on_error(exc)

    def close(self, final: Callable[[], list[dict[str, Any]]] | None = None, timeout: float = 10.0) -> bool:
        """Run ``final`` (if any), drain and close; False if not done within ``timeout``."""
        try:
            if final is not None:
                self._q.put(final, timeout=timeout)
            self._q.put(_STOP, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        try:
            self.sink.close()
        except Exception as exc:  # protect the job: closing a broken file is not fatal
            self._on_error(exc)
        return True


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write a small JSON file so readers never see it half-written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, path)
