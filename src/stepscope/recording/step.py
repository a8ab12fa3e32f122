"""Record assembly: what one timed step holds (:class:`Span`, :class:`Step`) and how it
becomes a record of the schema in :mod:`stepscope.recording.schema`.

A :class:`Step` collects clock marks on the training thread while it is open; the resolver
fills its numeric times once the marks are complete; :func:`build_record` turns it into a
plain dict on the writer thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from stepscope.recording.schema import SCHEMA_VERSION

#: The op of an entry of :attr:`Step.collectives` that is no collective: the step's stream
#: held by a wait on a communication stream (``Recorder.add_stream_wait``), what splits a
#: side-stream collective's time into exposed and hidden.
STREAM_WAIT = "<stream wait>"


class Span:
    """One timed region: a phase occurrence. ``path`` is ``parent/name`` (``forward/h2d``).

    Made only by :meth:`~stepscope.recording.recorder.Recorder.open_phase`, which sets every
    field: the class has no ``__init__``, so making one runs no Python frame (three or more a
    recorded step, each with the caches cold after a long torch op).
    """

    __slots__ = ("end", "host_end", "host_start", "name", "parent", "path", "stack", "start", "wall")

    name: str
    parent: str | None
    path: str
    start: Any
    end: Any
    #: ``time.perf_counter_ns()`` at open and close, for a phase timed on the host as well.
    host_start: int | None
    host_end: int | None
    #: For observers (the heartbeat): ``time.time()`` when this phase opened, where the
    #: clock's marks do not say it (``None`` when ``start`` is a ``perf_counter_ns`` value).
    wall: float | None
    stack: list[Span] | None  # the phase stack it was opened on


#: A step's ``timed`` until it is resolved (shared, never mutated: ``_time`` replaces it).
_NOT_TIMED: list[tuple[Span, float, float]] = []


class Step:
    """A sampled step: its marks while open and pending, its numbers once resolved."""

    __slots__ = (
        "checked",
        "checks",
        "collective_summary",
        "collectives",
        "counters",
        "end",
        "extra",
        "gpu_start_unix_ns",
        "index",
        "res",
        "side",
        "side_ms",
        "spans",
        "start",
        "start_unix_ns",
        "step_ms",
        "timed",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.start: Any = None
        self.start_unix_ns = 0
        self.end: Any = None
        self.spans: list[Span] = []
        # What most steps never carry is None until the first one arrives: no empty list or
        # dict allocated per step on the training thread.
        self.side: list[tuple[str, Any, Any]] | None = None
        self.counters: dict[str, float] = {}
        self.collectives: list[Any] | None = None
        self.extra: dict[str, Any] | None = None
        self.step_ms = 0.0
        self.side_ms: list[tuple[str, float]] | None = None
        self.timed: list[tuple[Span, float, float]] = _NOT_TIMED  # (span, start_ms, end_ms) once resolved
        self.collective_summary: list[dict[str, Any]] | None = None
        self.gpu_start_unix_ns: int | None = None
        self.res: Any = None  # ResourceMonitor.on_step_end snapshot (memory at step end)
        self.checks: list[Any] | None = None  # the resolver's checkpoints, once it looks
        self.checked = 0  # how many of them were found complete so far

    def marks(self) -> Iterator[Any]:
        """Every clock mark this step holds, each once (start, end, spans, side, collectives)."""
        start = self.start
        yield start
        yield self.end
        end = self.end
        for s in self.spans:
            if s.start is not start:
                yield s.start
            if s.end is not end:
                yield s.end
        for _, a, b in self.side or ():
            yield a
            yield b
        for c in self.collectives or ():  # (op, pg, pg_size, nbytes, start, end, path, seq, gap, ...)
            yield c[4]
            yield c[5]
            if c[8] is not None:
                yield c[8][0]
                yield c[8][1]


def build_record(
    step: Step,
    identity: dict[str, Any],
    clock: Any,
    fields: Callable[..., dict[str, Any]] | None,
    dropped: dict[str, int],
) -> dict[str, Any]:
    """The record of a timed step (writer thread): phases keyed by path, residual, side
    spans, counters, sections from ``fields`` and the step's extra fields."""
    # One pass over the timed spans, one dict per phase path built once at the end: this
    # runs on the writer thread while it holds the GIL, so fewer objects is less stolen time.
    acc: dict[str, list[Any]] = {}  # path -> [span, ms, calls, start_ms, end_ms, host_ms]
    top = 0.0
    for s, start_ms, end_ms in step.timed:
        ms = end_ms - start_ms
        p = acc.get(s.path)
        if p is None:
            acc[s.path] = p = [s, ms, 1, start_ms, end_ms, None if s.host_start is None else 0.0]
        else:
            p[1] += ms
            p[2] += 1
            if start_ms < p[3]:
                p[3] = start_ms
            if end_ms > p[4]:
                p[4] = end_ms
        if p[5] is not None and s.host_start is not None and s.host_end is not None:
            p[5] += (s.host_end - s.host_start) / 1e6
        if s.parent is None:
            top += ms
    phases = []
    for s, ms, calls, start_ms, end_ms, host_ms in acc.values():
        ph = {"name": s.name, "path": s.path, "parent": s.parent, "ms": round(ms, 4), "calls": calls,
              "start_ms": round(start_ms, 4), "end_ms": round(end_ms, 4)}
        if host_ms is not None:
            ph["host_ms"] = round(host_ms, 4)
        phases.append(ph)
    rec: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        **identity,
        "step": step.index,
        "start_unix_ns": step.start_unix_ns,
        "device_name": clock.device,
        "clock": clock.kind,
        "step_ms": round(step.step_ms, 4),
        "phases": phases,
        "residual_ms": round(max(0.0, step.step_ms - top), 4),
    }
    if step.gpu_start_unix_ns is not None:
        rec["gpu_start_unix_ns"] = step.gpu_start_unix_ns
    if step.side_ms:
        side: dict[str, float] = {}
        for name, ms in step.side_ms:
            side[name] = side.get(name, 0.0) + ms
        rec["side_ms"] = {k: _r(v) for k, v in side.items()}
        if "h2d_copy" in side:
            exposed = sum(p[1] for p in acc.values() if p[0].name == "h2d")
            rec["h2d_hidden_ms"] = _r(max(0.0, side["h2d_copy"] - exposed))
    counters = dict(step.counters)
    if fields is not None:
        rec.update(fields(step.index, step.start_unix_ns, step.step_ms, counters, step.res))
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
