"""Where records go: per-rank JSONL or SQLite files (or memory, for tests), written off-thread."""

from __future__ import annotations

import fcntl
import json
import math
import os
import sqlite3
import stat
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from stepscope.common.errors import warn
from stepscope.recording.schema import SQLITE_COLUMNS, SQLITE_TABLE, rank_file, record_to_row


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
        self._fh = _open_append(self.path)
        self._id = _file_id(self._fh.fileno())
        self._warned = False
        #: Records that could not be encoded (counted, never raised).
        self.unwritable = 0

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        if not records:
            return
        if _file_gone(self.path, self._id):
            # Writing on would append to an unlinked file: every record lost, silently.
            self._warned = _warn_gone(self.path, self._warned)
            self._fh.close()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = _open_append(self.path)
            self._id = _file_id(self._fh.fileno())
        lines = [encode_record(r) for r in records]
        kept = [line for line in lines if line is not None]
        if len(kept) < len(lines):
            self.unwritable += len(lines) - len(kept)
        self._fh.write(b"".join(kept))
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


#: JSON readers (DuckDB, most languages) hold integers in 64 bits; larger ones become floats.
_INT_LIMIT = 1 << 63


def encode_record(record: dict[str, Any]) -> bytes | None:
    """One record as a JSON line; ``None`` when even a cleaned copy cannot be encoded.

    The fast path is plain orjson (the encoding competes with training for the GIL). A
    record it refuses (an integer past 64 bits, a non-string key, an unknown type) is
    cleaned, never raised: one bad field must not stop the recorder.
    """
    try:
        return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        pass
    try:
        return orjson.dumps(_clean(record, 0), option=orjson.OPT_APPEND_NEWLINE)
    except (TypeError, ValueError, RecursionError):  # protect the job: counted by the sink
        return None


def _clean(obj: Any, depth: int) -> Any:
    """``obj`` as plain JSON data: huge ints as floats, keys as strings, the rest as text."""
    if depth > 32:
        return None
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        if -_INT_LIMIT <= obj < _INT_LIMIT:
            return obj
        try:
            return float(obj)  # a count past 2^63 (FLOPs of a large model's step): a float
        except OverflowError:
            return None
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v, depth + 1) for v in obj]
    try:
        return str(obj)[:1000]
    except Exception:  # protect the job: a broken __str__ loses this field only
        return None


def _open_append(path: Path) -> Any:
    """``path`` opened for appending, refusing (not blocking on) a FIFO, socket or device."""
    # O_NONBLOCK: opening a FIFO for writing blocks until a reader appears; with it the
    # open fails (no reader) or returns, and the type check below refuses it either way.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if path.exists() and not path.is_file():
            raise OSError(f"{path} is not a regular file (a FIFO or device?); records are only "
                          "written to regular files") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file (a FIFO or device?); records are only written "
                      "to regular files")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "ab")


def _file_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_ino, st.st_dev


def _file_gone(path: Path, file_id: tuple[int, int]) -> bool:
    """Whether ``path`` no longer names the open file ``file_id`` (deleted, or its dir
    removed); one ``stat`` per batch, the open file's identity being known."""
    try:
        st = os.stat(path)
    except OSError:
        return True
    return (st.st_ino, st.st_dev) != file_id


def _warn_gone(path: Path, warned: bool) -> bool:
    if not warned:
        warn(f"{path} was deleted while the run was writing to it (output directory removed?); "
             "records written before are lost, it is recreated for the rest", stacklevel=2)
    return True


class SqliteSink:
    """``rank{R}.sqlite`` with the table ``step_time_samples``; one transaction per batch."""

    def __init__(self, out_dir: str | os.PathLike[str], rank: int) -> None:
        self.path = rank_file(out_dir, rank, "sqlite")
        self._warned = False
        #: Records that could not be stored (counted, never raised).
        self.unwritable = 0
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
        rows = [record_to_row(r) for r in records]
        try:
            with self._con:
                self._con.executemany(self._insert, rows)
        except (OverflowError, sqlite3.InterfaceError, sqlite3.DataError):
            # One row SQLite cannot hold (an integer past 64 bits) must not lose the batch.
            with self._con:
                for row in rows:
                    try:
                        self._con.execute(self._insert, tuple(_clean(v, 0) for v in row))
                    except (OverflowError, sqlite3.InterfaceError, sqlite3.DataError):
                        self.unwritable += 1

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

#: Seconds between the writer's own looks for resolved steps not yet handed over (the bound
#: on how long a resolved step waits in memory when the loop stops between two flushes).
IDLE_TICK_S = 0.5

#: The delivery bound during a run: the record of a step resolved on the training thread
#: reaches the sink within this time (two idle ticks), on a host that gives the writer thread
#: CPU at all. Hand-overs (every ``flush_every_n_steps`` sampled steps, at most once per
#: ``outbox.HANDOVER_EVERY_S``) only wake the writer sooner; its wake never preempts the
#: training thread (SCHED_BATCH, Linux), so a record is bound by time, not by a number of
#: steps. At ``finish()``/exit every record is written.
DELIVERY_BOUND_S = 2 * IDLE_TICK_S

#: Steps the writer's queue holds at most (with the batch bound): what a job holds while its
#: writer is behind must not grow with the number of steps (a held step is ~1 KB). A loop
#: of tiny steps that outruns the writer for good loses batches, counted, instead of memory.
MAX_QUEUED_STEPS = 8192

#: Keys this module adds to a record's ``dropped`` section (counts since the previous record).
QUEUE_FULL = "writer_queue_full"
UNWRITABLE = "unwritable"
#: Records whose write failed (a full disk) and steps queued after it, never written.
WRITE_FAILED = "write_failed"


class Batch:
    """A deferred batch: ``fn()`` builds the records of ``steps`` steps on the writer thread.

    The count lets the writer say how many steps a dropped batch held.
    """

    __slots__ = ("fn", "steps")

    def __init__(self, fn: Callable[[], list[dict[str, Any]]], steps: int) -> None:
        self.fn = fn
        self.steps = steps

    def __call__(self) -> list[dict[str, Any]]:
        return self.fn()


class BackgroundWriter:
    """Runs record resolution and ``sink.write`` on a daemon thread, off the training loop.

    Items are lists of records, or callables returning one (the tracer's resolver). ``submit``
    never blocks and never waits for a lock the writer holds: the item goes on a deque and a
    bare lock (the *bell*) is released to wake the writer. A ``queue.Queue`` would make the
    training thread take the queue's mutex, which the writer holds while it wakes up: a writer
    preempted there on a loaded host stalled the hand-over for milliseconds (p90 1.8-4.2 ms,
    p99 18-30 ms at load 28). When the queue is full (a stalled file system), the item is dropped. No
    loss is silent: the first drop warns once (``StepscopeWarning``), and every dropped step
    and every record the sink could not encode is counted in :attr:`lost` and written into
    the ``dropped`` section of the next record that reaches the file (``writer_queue_full``,
    ``unwritable``), where ``stepscope report`` sums them. The first sink error (a full disk)
    calls ``on_error`` once and stops writing; the records of that write and the steps queued
    after it are counted as ``write_failed``. What no written record carries is
    :meth:`unreported` (the heartbeat file says it).
    """

    def __init__(
        self,
        sink: Sink,
        on_error: Callable[[BaseException], None],
        max_batches: int = 64,
        max_steps: int | None = None,
        on_idle: Callable[[bool], Callable[[], list[dict[str, Any]]] | None] | None = None,
    ) -> None:
        self.sink = sink
        #: Asked for more work whenever the queue runs dry (steps held back while it was full;
        #: the argument says whether this is the idle tick rather than the end of a batch).
        self._on_idle = on_idle
        self.dropped_batches = 0
        #: Steps lost in dropped batches and records the sink could not encode, by reason.
        self.lost: dict[str, int] = {QUEUE_FULL: 0, UNWRITABLE: 0, WRITE_FAILED: 0}
        #: What written records' ``dropped`` sections carry so far.
        self._reported: dict[str, int] = {QUEUE_FULL: 0, UNWRITABLE: 0, WRITE_FAILED: 0}
        self._refused = 0  # steps submitted after the writer stopped (write_failed too)
        self._warned = False
        self._on_error = on_error
        self._items: deque[Any] = deque()  # append/popleft are atomic: no lock on either side
        self._max = max_batches
        self._max_steps = MAX_QUEUED_STEPS if max_steps is None else max_steps
        #: Steps of the batches queued so far / taken so far: each counter has one writing
        #: thread (the submitter under the outbox's lock / the writer), so neither needs a lock.
        self._steps_in = 0
        self._steps_out = 0
        #: Released (by any thread) to wake the writer; the writer acquires it to sleep. A
        #: release while it is already released is a wake already pending.
        self._bell = threading.Lock()
        self._bell.acquire()
        self._failed = False
        #: Whether the writer thread runs as SCHED_BATCH (set by the thread as it starts).
        self.batch_policy = False
        self._thread = threading.Thread(target=self._run, name="stepscope-writer", daemon=True)
        self._thread.start()

    def behind(self) -> bool:
        """True while the queue is full (in batches or in steps): a batch submitted now would
        be dropped."""
        return len(self._items) >= self._max or self._steps_in - self._steps_out >= self._max_steps

    def _ring(self) -> None:
        try:  # noqa: SIM105 (training thread, each hand-over: no context-manager object)
            self._bell.release()
        except RuntimeError:  # already released: the writer has a wake pending
            pass

    def submit(self, item: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]]) -> None:
        if self._failed:
            # Counted apart from the writer's own count: each counter has one writing thread.
            self._refused += len(item) if isinstance(item, list) else getattr(item, "steps", 0)
            return
        steps = getattr(item, "steps", 0)
        queued = self._steps_in - self._steps_out
        # One batch past the step bound is taken into an empty queue (it is all there is).
        if len(self._items) < self._max and (queued + steps <= self._max_steps or not queued):
            self._steps_in += steps
            self._items.append(item)
            self._ring()
        else:
            self.dropped_batches += 1
            n = len(item) if isinstance(item, list) else getattr(item, "steps", 1)
            self.lost[QUEUE_FULL] += n  # one writer (this thread) per key: no lock needed
            if not self._warned:
                self._warned = True
                _warn(f"the record writer is behind (slow file system?); {n} step record(s) "
                      "dropped, and later drops are counted in the records' dropped."
                      f"{QUEUE_FULL} and shown by `stepscope report`")

    def unreported(self) -> dict[str, int]:
        """Losses by reason that no written record carries (read from any thread)."""
        out = {k: v - self._reported.get(k, 0) for k, v in list(self.lost.items())
               if v > self._reported.get(k, 0)}
        if self._refused:
            out[WRITE_FAILED] = out.get(WRITE_FAILED, 0) + self._refused
        return out

    def _stamp(self, records: list[dict[str, Any]]) -> dict[str, int]:
        """Add the losses not yet written to the first record's ``dropped`` section; returns
        them, to be counted as reported once the write succeeded."""
        sink_lost = int(getattr(self.sink, "unwritable", 0))
        if sink_lost > self.lost[UNWRITABLE]:
            if not self.lost[UNWRITABLE]:
                _warn(f"{sink_lost} record(s) could not be encoded and were not written; counted "
                      f"in the records' dropped.{UNWRITABLE}")
            self.lost[UNWRITABLE] = sink_lost
        new = {k: v - self._reported[k] for k, v in self.lost.items() if v > self._reported[k]}
        if not new:
            return new
        first = records[0]
        dropped = first.get("dropped")
        dropped = dict(dropped) if isinstance(dropped, dict) else {}
        for k, v in new.items():
            dropped[k] = int(dropped.get(k, 0)) + v
        first["dropped"] = dropped
        return new

    def _run(self) -> None:
        # SCHED_BATCH (see ``yield_on_wake``): a hand-over's wake no longer takes the CPU from
        # the training thread on a host with no idle core; the writer runs at the scheduler's
        # next turn instead. What it promises is a time, not a step count (DELIVERY_BOUND_S).
        # With an on_idle source the writer also looks for work every IDLE_TICK_S on its own:
        # steps resolved since the last hand-over reach the file within that time even when
        # the loop stops stepping (a hang, a long evaluation) before its next flush.
        self.batch_policy = yield_on_wake()
        tick = IDLE_TICK_S if self._on_idle is not None else None
        items, bell = self._items, self._bell
        while True:
            bell.acquire(timeout=-1 if tick is None else tick)
            worked = False
            while items:
                item = items.popleft()
                self._steps_out += getattr(item, "steps", 0)  # off the queue: out of the bound
                if item is _STOP:
                    return
                if not self._failed:
                    self._process(item)
                else:
                    self._count_failed(item)
                worked = True
            if self._on_idle is not None and not items and not self._failed:
                try:
                    held = self._on_idle(not worked)
                except Exception as exc:  # protect the job: report it like a write error
                    self._failed = True
                    self._on_error(exc)
                    continue
                if held is not None:
                    self._process(held)

    def wait_written(self, timeout: float) -> bool:
        """Wait until everything submitted before this call is written (or dropped); False on
        timeout, or at once when waiting cannot work (on the writer thread itself, the writer
        stopped, its queue full). Never on the training thread's hot path: for calls a user
        makes between steps (``summary()``)."""
        if self._failed or len(self._items) >= self._max or threading.current_thread() is self._thread:
            return False
        done = threading.Event()
        self._items.append(done.set)  # a callable item whose "records" are None: nothing written
        self._ring()
        return done.wait(timeout)

    def is_idle(self) -> bool:
        """Nothing queued."""
        return not self._items

    def _process(self, item: Any) -> None:
        records = None
        try:
            records = item() if callable(item) else item
            if records:
                new = self._stamp(records)
                self.sink.write(records)
                for k, v in new.items():
                    self._reported[k] += v
        except Exception as exc:  # protect the job: a full disk must not kill training
            self._failed = True
            if records:
                self.lost[WRITE_FAILED] += len(records)
            elif records is None:
                self._count_failed(item)
            self._on_error(exc)

    def _count_failed(self, item: Any) -> None:
        """A batch the writer will not write (it stopped after a write error): counted."""
        n = len(item) if isinstance(item, list) else getattr(item, "steps", 0)
        self.lost[WRITE_FAILED] += int(n)

    def close(self, final: Callable[[], list[dict[str, Any]]] | None = None, timeout: float = 10.0) -> bool:
        """Run ``final`` (if any), drain and close; False if not done within ``timeout``."""
        if final is not None:
            self._steps_in += getattr(final, "steps", 0)
            self._items.append(final)  # past the bound: the last batch is never dropped
        self._items.append(_STOP)
        self._ring()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        try:
            self.sink.close()
        except Exception as exc:  # protect the job: closing a broken file is not fatal
            self._on_error(exc)
        return True


def yield_on_wake() -> bool:
    """Make the calling thread one that does not preempt others when it wakes (Linux).

    For the background threads (the heartbeat's timer, the writer's hand-overs): a woken thread of
    the default policy usually preempts the running one (the training thread, holding the
    GIL) and then waits for that GIL, so the training thread loses its CPU for a scheduler
    round on a host with no idle core. ``SCHED_BATCH`` keeps the thread's fair CPU share but
    it only runs at the next tick or on an idle CPU. Returns True when the policy was set.
    """
    setter = getattr(os, "sched_setscheduler", None)
    policy = getattr(os, "SCHED_BATCH", None)
    if setter is None or policy is None:
        return False
    try:
        setter(0, policy, os.sched_param(0))  # pid 0: the calling thread on Linux
    except OSError:  # protect the job: a sandbox refusing the call only costs speed
        return False
    return True


def _warn(msg: str) -> None:
    warn(msg, stacklevel=3)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write a small JSON file so readers never see it half-written.

    A deleted output directory is recreated (the run goes on writing into it).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    text = json.dumps(payload, indent=2, default=str)
    try:
        tmp.write_text(text, encoding="utf-8")
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
