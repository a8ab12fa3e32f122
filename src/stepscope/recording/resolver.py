"""Resolver: turns finished steps (clock marks) into timed steps, without waiting for the GPU.

Shape::

    training thread, step exit          writer thread, flush cadence
    ───────────────────────────         ────────────────────────────
    Resolver.add(step)                  Resolver.build(steps) -> records -> sink, listeners
    Resolver.poll(): up to
      MAX_STEPS_PER_POLL of the oldest
      pending steps, each checked with
      non-blocking query() calls on its
      checkpoints; ready ones are timed
      (elapsed_time; host-clock times,
      plain arithmetic, on the writer)
      and moved to ``ready``

Both clocks take this one path: a host-clock mark is simply always ready.

A step's *checkpoints* are the latest mark on each stream it recorded on (a stream
completes in order, so that mark being done implies every earlier one on it), plus each
mark whose stream is unknown. A step's check resumes where it stopped at the last poll, so
a step with hundreds of marks costs one query per stream per poll. The budget is counted in
steps, and more than one step can resolve per step exit, so a backlog drains.

Every CUDA call (``query``, ``elapsed_time``) runs on the training thread: a background
thread would create a CUDA context on GPU 0 (its current device) on every rank and break
CUDA-graph capture, so ``poll`` does nothing while ``capturing()`` says a capture is under way
(the current stream's, or any thread's in global mode: see :mod:`stepscope.instrument.graphs`).

A step whose marks never complete stays pending until ``max_pending_steps`` pushes it out
(counted as ``pending_overflow``). A step with a mark on a foreign device, or whose marks
cannot be queried or read, is dropped and counted (``foreign_device``, ``unreadable``);
timing itself stays on.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stepscope.recording.step import build_record

if TYPE_CHECKING:
    from stepscope.recording.clock import Clock, GpuAnchor
    from stepscope.recording.step import Step

#: Pending steps one step exit may check (a ready step is always let through).
MAX_STEPS_PER_POLL = 8

#: ``summarizer(collectives, elapsed_ms) -> record section``: how the collectives a step
#: holds become its ``collectives`` section. Set by whoever installs the collectives
#: instrument (the resolver imports no instrument).
Summarizer = Callable[[list[Any], Callable[[Any, Any], float]], list[dict[str, Any]]]


class Resolver:
    """Pending steps → timed steps (training thread) → records (writer thread)."""

    def __init__(
        self,
        clock: Clock,
        identity: dict[str, Any],
        max_pending: int,
        anchor: GpuAnchor | None = None,
        capturing: Callable[[], bool] | None = None,
        fields: Callable[..., dict[str, Any]] | None = None,
    ) -> None:
        self.clock = clock
        # A clock that does not say is treated as pooled and multi-device (the careful way).
        self._pooled = bool(getattr(clock, "pooled", True))
        # Times that are plain arithmetic (the host clock) are read on the writer thread, which
        # keeps the training thread's share to the readiness check; device times never are.
        self._read_on_writer = bool(getattr(clock, "host_readable", False))
        self.identity = identity  # run_id, rank, ... copied into every record
        self.max_pending = max_pending
        self.anchor = anchor
        self._capturing = capturing
        #: ``fields(index, start_unix_ns, step_ms, counters, snapshot) -> sections`` (writer
        #: thread): throughput, flops, memory, device; may pop entries from ``counters``.
        self._fields = fields
        self.summarize_collectives: Summarizer | None = None
        #: Finished steps whose marks are not known to be complete (training thread only).
        self.pending: deque[Step] = deque()
        #: Timed steps waiting for the writer: appended on the training thread, taken by
        #: ``take_ready`` (one taker at a time, under the outbox's lock). A deque: neither side
        #: takes a lock, so the training thread never waits for a preempted writer.
        self._ready: deque[Step] = deque()
        self._lock = threading.Lock()
        self.dropped: Counter[str] = Counter()
        self._dropped_reported: Counter[str] = Counter()

    # ------------------------------------------------------------ training thread

    def add(self, step: Step, *, poll: bool = False) -> None:
        """A finished step joins the pending ones; ``poll``: then :meth:`poll` (the step
        exit's one call)."""
        pending = self.pending
        pending.append(step)
        while len(pending) > self.max_pending:
            self._release(pending.popleft())
            self._count("pending_overflow")
        if poll:
            self.poll()

    def poll(self, max_steps: int = MAX_STEPS_PER_POLL) -> None:
        """Time the oldest pending steps whose marks are complete; never blocks.

        A step is complete when every one of its checkpoints is ready. Start marks count too:
        a start on a lagging stream (autograd's, a copy stream) can complete after the step's
        end is recorded on another stream. The check of a step resumes where the last poll
        stopped. (One loop, no helper call per step: this runs at every step exit.)
        """
        pending = self.pending
        if not pending:
            return
        if self._capturing is not None and self._capturing():
            return  # querying events during CUDA-graph capture would break the capture
        clock = self.clock
        ready = clock.ready
        host = self._read_on_writer
        out = self._ready
        n = 0
        while pending and n < max_steps:
            step = pending[0]
            try:
                checks = step.checks
                if checks is None:
                    # Host-clock marks are all ready at once: the step's start stands for
                    # every one of them (no walk over its marks).
                    marks = (step.start,) if host else step.marks()
                    checks = step.checks = clock.checkpoints(marks)
                i = step.checked
                k = len(checks)
                while i < k and ready(checks[i]):
                    i += 1
                step.checked = i
            except Exception:  # protect the job: one unqueryable step is dropped, timing stays on
                pending.popleft()
                n += 1
                self._count("unreadable")
                self._release(step)
                continue
            if i < k:
                break  # records leave in step order: a later step waits for this one
            pending.popleft()
            n += 1
            if host or self._time(step):
                out.append(step)  # atomic: the writer may be taking from the other end

    def drain(self, deadline_poll: Callable[[], bool]) -> None:
        """At finish: poll until nothing is pending or ``deadline_poll()`` says stop."""
        while self.pending:
            self.poll(max_steps=1 << 30)
            if not self.pending or deadline_poll():
                break
        if self.pending:
            self._count("unresolved_at_finish", len(self.pending))
            while self.pending:
                self._release(self.pending.popleft())

    def ready_count(self) -> int:
        """Timed steps not yet taken by the writer."""
        return len(self._ready)

    def take_ready(self) -> list[Step]:
        ready = self._ready
        pop = ready.popleft
        return [pop() for _ in range(len(ready))]  # only appended meanwhile: never short

    def _time(self, step: Step) -> bool:
        """Fill the step's numeric times from its marks; False (and counted) if unreadable."""
        clock = self.clock
        el = clock.elapsed_ms
        same = clock.same_device if self._pooled else None  # host marks all compare
        t0 = step.start
        try:
            step_ms = el(t0, step.end)
            timed = []
            for s in step.spans:
                if same is not None and not (same(t0, s.start) and same(t0, s.end)):
                    self._count("foreign_device")
                    continue
                end_ms = el(t0, s.end)
                timed.append((s, el(t0, s.start), end_ms))
                if end_ms > step_ms:
                    # The step ends at its latest mark on any stream it used: a phase on a side
                    # stream made current inside the step can end after the end mark recorded
                    # on the step's own stream (no wait is added to order them).
                    step_ms = end_ms
            step.step_ms = step_ms
            step.timed = timed
            if step.side:
                side = []
                for name, a, b in step.side:
                    if same is None or same(a, b):
                        side.append((name, el(a, b)))
                    else:
                        self._count("foreign_device")
                step.side_ms = side
            summarize = self.summarize_collectives
            if step.collectives and summarize is not None:
                step.collective_summary = summarize(step.collectives, el)
            if self.anchor is not None:
                step.gpu_start_unix_ns = self.anchor.wall_ns(t0, step.start_unix_ns)
        except Exception:  # protect the job: one unreadable step is dropped, timing stays on
            self._count("unreadable")
            self._release(step)
            return False
        self._release(step)
        return True

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:  # read by the writer thread in build()
            self.dropped[what] += n

    def _release(self, step: Step) -> None:
        if not self._pooled:
            return  # host marks hold nothing to give back
        rel = self.clock.release
        anchor = self.anchor
        for m in step.marks():
            if m is not None and (anchor is None or not anchor.owns(m)):
                rel(m)

    # -------------------------------------------------------------- writer thread

    def build(self, steps: list[Step], pause: Callable[[], Any] | None = None) -> list[dict[str, Any]]:
        """Records of ``steps`` (writer thread). ``pause()`` runs between two records: where
        the writer gives the GIL back to the training thread in a long batch (see
        :mod:`stepscope.recording.outbox`)."""
        if self._read_on_writer:
            steps = [s for s in steps if self._time(s)]
        new: Counter[str] = Counter()
        if steps:  # counts ride on the next record written, so none is lost in an empty batch
            with self._lock:
                new = self.dropped - self._dropped_reported
                self._dropped_reported.update(new)
        out = []
        for i, step in enumerate(steps):
            if i and pause is not None:
                pause()
            dropped = dict(new) if i == 0 else {}
            out.append(build_record(step, self.identity, self.clock, self._fields, dropped))
        return out
