"""Outbox: how resolved steps leave the training thread for the writer thread.

The training thread hands the steps the resolver has timed to the
:class:`~stepscope.recording.sinks.BackgroundWriter` every ``flush_every_n_steps`` steps, but no more
often than once per ``HANDOVER_EVERY_S``, as one deferred batch: the records are built (and
listeners' ``on_record`` called) on the writer thread, never on the training thread. The
hand-over never waits: the training thread only *tries* the outbox lock, and a batch the
writer cannot take now (its queue full: a slow file system) stays with the resolver until
the writer catches up, up to ``MAX_HELD_STEPS``. Between two hand-overs the writer also
takes resolved steps on its own every ``sinks.IDLE_TICK_S`` (0.5 s): a loop that stops
stepping (a hang, an evaluation) still gets its last steps' records on disk within that
time, without a wake from the training thread. The writer never preempts the training thread
when woken (``SCHED_BATCH``), so what it promises is a time (``sinks.DELIVERY_BOUND_S``),
not that a record is on disk N steps later.

Building records holds the GIL. Once a batch has held it for ``GIL_SLICE_S``, the writer
gives it back between two records (``time.sleep(0)``): a training thread returning from a C
call that released the GIL then waits about that long at most, not for a whole large batch
(steps held back while the file system was slow). A usual batch (``flush_every_n_steps``
records, ~10 µs each) never pauses: each pause can cost the writer up to the interpreter's
switch interval (5 ms) to get the GIL back, which would slow it behind a busy training loop.

**Why a hand-over is rate-limited.** A wake of the writer costs the training thread far
more CPU than the call that rings it, and a woken writer takes the GIL at the training
thread's next torch op (``benchmarks/hot_path.py --mode wakes``). Bounding the wakes by time
bounds that cost as a
share of the run (one wake per 0.1 s is ≤ 0.1%), whatever the step length: a 1 s GPU step
still hands over every ``flush_every_n_steps`` steps, a 100 µs CPU step every ~1,000.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from stepscope.recording.resolver import Resolver
from stepscope.recording.sinks import BackgroundWriter, Batch, Sink

#: Resolved steps held back while the writer is behind, before a batch is dropped (counted).
MAX_HELD_STEPS = 4096
#: Records kept for ``summary()`` and the live view.
RECENT_RECORDS = 256
#: Seconds of record building after which the writer gives the GIL back (between records).
GIL_SLICE_S = 0.001
#: Least seconds between two hand-overs at step ends (the module docstring says why). Far
#: under the delivery bound (``sinks.DELIVERY_BOUND_S``), which the writer's own idle tick keeps.
HANDOVER_EVERY_S = 0.1


class RecentRecords:
    """The last resolved records (a listener), for ``summary()`` and the live view."""

    def __init__(self, size: int = RECENT_RECORDS) -> None:
        self._buf: deque[dict[str, Any]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def on_record(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._buf.append(record)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._buf)


class Outbox:
    """Resolved steps → batches on the writer thread → sink and listeners.

    ``listeners`` is the owning session's list (read at each batch, so listeners added later
    see later records); ``on_error`` gets the writer's first error (a full disk).
    """

    def __init__(
        self, resolver: Resolver, sink: Sink, listeners: list[Any],
        on_error: Callable[[BaseException], None], batch: int = 1,
    ) -> None:
        self.resolver = resolver
        #: Resolved steps the writer takes on its own right after a batch (steps held back
        #: while it was behind): fewer than this wait for the next hand-over or idle tick, so a
        #: step or two resolved during a write do not become a batch (and a write) of their own.
        self._batch = batch
        self._listeners = listeners
        #: Taking resolved steps and queueing them is one move: the training thread only tries
        #: this lock (it never waits); the writer holds it while it takes held-back steps.
        self._lock = threading.Lock()
        self.writer = BackgroundWriter(sink, on_error=on_error, on_idle=self._held_job)
        #: Least seconds between two hand-overs at step ends (``HANDOVER_EVERY_S``).
        self.every_s = HANDOVER_EVERY_S
        #: ``time.monotonic()`` from which a step end may hand over again (``every_s`` after
        #: the last hand-over). Read at step ends as an attribute: no call on that path.
        self.due_at = 0.0

    def submit(self) -> bool:
        """Queue the steps resolved so far (training thread); False when none went."""
        self.due_at = time.monotonic() + self.every_s
        if not self._lock.acquire(blocking=False):
            return False  # the writer is taking held steps this instant; these go next time
        try:
            job = self.job()
            if job is None:
                return False
            self.writer.submit(job)
            return True
        finally:
            self._lock.release()

    def submit_background(self, job: Callable[[], Any]) -> None:
        """Run ``job()`` on the writer thread (never blocks; no CUDA calls allowed there)."""

        def run() -> list[dict[str, Any]]:
            job()
            return []

        self.writer.submit(run)

    def close(self, final: bool, timeout: float) -> bool:
        """Write what is resolved (when ``final``), drain and close; False on timeout."""
        with self._lock:
            job = self.job(force=True) if final else None
        return self.writer.close(job, timeout=timeout)

    def _held_job(self, tick: bool) -> Callable[[], list[dict[str, Any]]] | None:
        """Writer thread, its queue just emptied: the steps held back while it was behind; or
        (``tick``) its idle tick: every step resolved since the last hand-over."""
        held = self.resolver.ready_count()
        if not held or (not tick and held < self._batch):
            return None
        with self._lock:
            if not self.writer.is_idle() or not self.resolver.ready_count():
                return None
            return self.job(force=True)

    def job(self, force: bool = False) -> Callable[[], list[dict[str, Any]]] | None:
        """The writer's job for the steps resolved so far; None when there are none (an
        empty job would only take a place in the writer's bounded queue).

        While the writer is behind (its queue full: a slow file system), resolved steps stay
        with the resolver and leave with the next batch instead of being dropped; only past
        ``MAX_HELD_STEPS`` does a batch go to the full queue, where its loss is counted.
        """
        resolver = self.resolver
        if not force and self.writer.behind() and resolver.ready_count() < MAX_HELD_STEPS:
            return None
        steps = resolver.take_ready()
        if not steps:
            return None
        listeners = [fn for fn in (getattr(x, "on_record", None) for x in self._listeners) if fn]

        def job() -> list[dict[str, Any]]:
            records = resolver.build(steps, pause=_GilSlicer())
            for fn in listeners:
                for rec in records:
                    fn(rec)
            return records

        return Batch(job, len(steps))  # the count says how many steps a dropped batch held


class _GilSlicer:
    """Called between two records: gives the GIL back once per ``GIL_SLICE_S`` of building.

    Counted in this thread's CPU time: time the writer spent preempted (a loaded host) held
    no GIL, and counting it would make the writer yield, and fall behind, for nothing. The
    CPU clock is a system call (~1.4 µs on the test machine, paid while the training thread
    may want the GIL), so between records only the wall clock (vDSO) is read: CPU time never
    runs faster than wall time, so the slice cannot be over before the wall clock has moved
    by what is left of it. Same yields, one CPU-clock read per slice instead of per record.
    """

    __slots__ = ("_look", "_since")

    def __init__(self) -> None:
        self._since = time.thread_time()  # CPU time at the slice's start
        self._look = time.perf_counter() + GIL_SLICE_S  # no CPU look before this wall time

    def __call__(self) -> None:
        wall = time.perf_counter()
        if wall < self._look:
            return
        used = time.thread_time() - self._since
        if used >= GIL_SLICE_S:
            time.sleep(0)  # releases the GIL: a training thread waiting for it takes it here
            self._since = time.thread_time()
            self._look = time.perf_counter() + GIL_SLICE_S
        else:
            self._look = wall + (GIL_SLICE_S - used)
