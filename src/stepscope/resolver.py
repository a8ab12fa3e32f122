"""Resolver: turns finished steps (clock marks) into records, without ever waiting for the GPU.

Shape::

    training thread, step exit          writer thread, flush cadence
    ───────────────────────────         ────────────────────────────
    Resolver.add(step)                  Resolver.build(steps) -> records -> sink, listeners
    Resolver.poll(): a bounded number
      of non-blocking query() calls on
      the oldest pending steps; ready
      ones are timed (elapsed_time)
      and moved to ``ready``

Every CUDA call (``query``, ``elapsed_time``) runs on the training thread: a background
thread would create a CUDA context on GPU 0 (its current device) on every rank and break
CUDA-graph capture, so ``poll`` does nothing while the current stream is capturing. Host-clock
marks are plain ints and need no such care: with the CPU clock the arithmetic is left to the
writer thread, keeping the training thread's share to appending to a list.

A step whose marks never complete stays pending until ``max_pending_steps`` pushes it out
(counted as ``pending_overflow``). A step with a mark on a foreign device, or whose times
cannot be read, is dropped and counted; timing itself stays on.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stepscope.records import SCHEMA_VERSION

if TYPE_CHECKING:
    from stepscope.clock import Clock, GpuAnchor
    from stepscope.tracer import Step

#: ``query()`` calls one step exit may spend on pending steps.
MAX_QUERIES_PER_POLL = 16


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
        self.identity = identity  # run_id, rank, ... copied into every record
        self.max_pending = max_pending
        self.anchor = anchor
        self._capturing = capturing
        #: ``fields(index, start_unix_ns, step_ms, counters, snapshot) -> sections`` (writer
        #: thread): throughput, flops, memory, device; may pop entries from ``counters``.
        self._fields = fields
        #: Finished steps whose marks are not known to be complete (training thread only).
        self.pending: deque[Step] = deque()
        #: Timed steps waiting for the writer (filled on the training thread, drained by
        #: ``take_ready``; the lock guards the hand-over).
        self._ready: list[Step] = []
        self._lock = threading.Lock()
        self._host_clock = clock.kind == "cpu"
        self.dropped: Counter[str] = Counter()
        self._dropped_reported: Counter[str] = Counter()

    # ------------------------------------------------------------ training thread

    def add(self, step: Step) -> None:
        if self._host_clock:
            with self._lock:
                self._ready.append(step)
            return
        pending = self.pending
        pending.append(step)
        while len(pending) > self.max_pending:
            self._release(pending.popleft())
            self.dropped["pending_overflow"] += 1

    def poll(self, max_queries: int = MAX_QUERIES_PER_POLL) -> None:
        """Time the oldest pending steps whose marks are complete; never blocks."""
        pending = self.pending
        if not pending:
            return
        if self._capturing is not None and self._capturing():
            return  # querying events during CUDA-graph capture would break the capture
        budget = max_queries
        done: list[Step] = []
        while pending and budget > 0:
            step = pending[0]
            ready, used = self._ready_step(step, budget)
            budget -= used
            if not ready:
                break
            pending.popleft()
            if self._time(step):
                done.append(step)
        if done:
            with self._lock:
                self._ready.extend(done)

    def drain(self, deadline_poll: Callable[[], bool]) -> None:
        """At finish: poll until nothing is pending or ``deadline_poll()`` says stop."""
        while self.pending:
            self.poll(max_queries=1 << 30)
            if not self.pending or deadline_poll():
                break
        if self.pending:
            self.dropped["unresolved_at_finish"] += len(self.pending)
            while self.pending:
                self._release(self.pending.popleft())

    def take_ready(self) -> list[Step]:
        with self._lock:
            out, self._ready = self._ready, []
        return out

    def _ready_step(self, step: Step, budget: int) -> tuple[bool, int]:
        """Whether every mark of ``step`` is complete, and how many queries that cost.

        Start marks are checked too: a start on a lagging stream (autograd's, a copy
        stream) can complete after its end is recorded elsewhere.
        """
        ready = self.clock.ready
        used = 0
        for m in step.marks():
            if used >= budget:
                return False, used
            used += 1
            if not ready(m):
                return False, used
        return True, used

    def _time(self, step: Step) -> bool:
        """Fill the step's numeric times from its marks; False (and counted) if unreadable."""
        clock = self.clock
        el = clock.elapsed_ms
        same = clock.same_device
        t0 = step.start
        try:
            step.step_ms = el(t0, step.end)
            timed = []
            for s in step.spans:
                if not (same(t0, s.start) and same(t0, s.end)):
                    self.dropped["foreign_device"] += 1
                    continue
                timed.append((s, el(t0, s.start), el(t0, s.end)))
            step.timed = timed
            side = []
            for name, a, b in step.side:
                if same(a, b):
                    side.append((name, el(a, b)))
                else:
                    self.dropped["foreign_device"] += 1
            step.side_ms = side
            if step.collectives:
                from stepscope.instrument.collectives import summarize

                step.collective_summary = summarize(step.collectives, el)
            if self.anchor is not None:
                step.gpu_start_unix_ns = self.anchor.wall_ns(t0, step.start_unix_ns)
        except Exception:  # protect the job: one unreadable step is dropped, timing stays on
            self.dropped["unreadable"] += 1
            self._release(step)
            return False
        self._release(step)
        return True

    def _release(self, step: Step) -> None:
        rel = self.clock.release
        anchor = self.anchor
        for m in step.marks():
            if anchor is None or not anchor.owns(m):
                rel(m)

    # -------------------------------------------------------------- writer thread

    def build(self, steps: list[Step]) -> list[dict[str, Any]]:
        if self._host_clock:
            steps = [s for s in steps if self._time(s)]
        new: Counter[str] = Counter()
        if steps:  # counts ride on the next record written, so none is lost in an empty batch
            with self._lock:
                new = self.dropped - self._dropped_reported
                self._dropped_reported.update(new)
        out = []
        for i, step in enumerate(steps):
            out.append(self._record(step, dict(new) if i == 0 else {}))
        return out

    def _record(self, step: Step, dropped: dict[str, int]) -> dict[str, Any]:
        phases: dict[str, dict[str, Any]] = {}
        top = 0.0
        for s, start_ms, end_ms in step.timed:
            ms = end_ms - start_ms
            p = phases.get(s.path)
            if p is None:
                p = phases[s.path] = {
                    "name": s.name,
                    "path": s.path,
                    "parent": s.parent,
                    "ms": ms,
                    "calls": 1,
                    "start_ms": start_ms,
                    "end_ms": end_ms,
                }
                if s.host_start is not None:
                    p["host_ms"] = 0.0
            else:
                p["ms"] += ms
                p["calls"] += 1
                p["start_ms"] = min(p["start_ms"], start_ms)
                p["end_ms"] = max(p["end_ms"], end_ms)
            if s.host_start is not None and s.host_end is not None and "host_ms" in p:
                p["host_ms"] += (s.host_end - s.host_start) / 1e6
            if s.parent is None:
                top += ms
        rec: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            **self.identity,
            "step": step.index,
            "start_unix_ns": step.start_unix_ns,
            "device_name": self.clock.device,
            "clock": self.clock.kind,
            "step_ms": _r(step.step_ms),
            "phases": [
                {**p, "ms": _r(p["ms"]), "start_ms": _r(p["start_ms"]), "end_ms": _r(p["end_ms"]),
                 **({"host_ms": _r(p["host_ms"])} if "host_ms" in p else {})}
                for p in phases.values()
            ],
            "residual_ms": _r(max(0.0, step.step_ms - top)),
        }
        if step.gpu_start_unix_ns is not None:
            rec["gpu_start_unix_ns"] = step.gpu_start_unix_ns
        if step.side_ms:
            side: dict[str, float] = {}
            for name, ms in step.side_ms:
                side[name] = side.get(name, 0.0) + ms
            rec["side_ms"] = {k: _r(v) for k, v in side.items()}
            if "h2d_copy" in side:
                exposed = sum(p["ms"] for p in phases.values() if p["name"] == "h2d")
                rec["h2d_hidden_ms"] = _r(max(0.0, side["h2d_copy"] - exposed))
        counters = dict(step.counters)
        if self._fields is not None:
            rec.update(self._fields(step.index, step.start_unix_ns, step.step_ms, counters, step.res))
        if counters:
            rec["counters"] = counters
        if step.collective_summary:
            rec["collectives"] = step.collective_summary
        if step.extra:
            rec.update(step.extra)
        rec["dropped"] = dropped
        return rec


def _r(x: float) -> float:
    return round(x, 4)
