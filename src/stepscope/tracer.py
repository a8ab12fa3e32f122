"""Tracer: the step lifecycle, the phase stack and sampling on one rank.

This module is the *recorder* that instruments talk to. Its whole instrument-facing surface
is a handful of public methods (the recorder protocol): ``open_phase`` / ``close_phase`` /
``discard_phase``, ``add_side_span``, ``add_counter``, ``add_collective``, ``current_path``,
``in_step`` and ``recording``. Observers (live view, auto-profiling, metric sinks, the
heartbeat) are *listeners*: objects with any of ``on_step_end(tracer, index)``,
``on_record(record)``, ``on_exception(tracer, exc_type, exc, phase_stack)``,
``on_finish(tracer)``; the tracer does
not import them (:mod:`stepscope.lifecycle` wires them from the config).

The hot path (inside ``step()``) takes clock marks and appends small objects to lists.
Everything a step collects before it opens (the dataloader wait, a prefetch hand-over, their
counters and collectives) goes to one object, the *next step*, which the step adopts when it
opens. Finished steps go to the :class:`~stepscope.resolver.Resolver`; records reach the files
through a background writer that makes no CUDA calls.

Steps belong to the thread that opened them. A ``step()`` nested in another, or opened by a
second thread while one is open, is not timed and warns once: the job is never interrupted.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from functools import wraps
from typing import Any, TypeVar

from stepscope.clock import Clock, CudaClock, GpuAnchor, default_clock
from stepscope.config import Config
from stepscope.dist import RankInfo, rank_info
from stepscope.errors import InstrumentationError, StepscopeWarning
from stepscope.instrument import gate
from stepscope.instrument.resources import ResourceMonitor, check_count, check_counts, warn_outside_step
from stepscope.resolver import Resolver
from stepscope.sinks import BackgroundWriter, Sink, open_sink

F = TypeVar("F", bound=Callable[..., Any])

#: How long ``finish()`` keeps polling CUDA events before giving up on them (seconds).
FINISH_TIMEOUT_S = 5.0
#: Records kept for ``summary()`` and the live view.
RECENT_RECORDS = 256


class Span:
    """One timed region: a phase occurrence. ``path`` is ``parent/name`` (``forward/h2d``)."""

    __slots__ = ("end", "host_end", "host_start", "name", "parent", "path", "start", "wall")

    def __init__(self, name: str, parent: str | None, start: Any, host: bool) -> None:
        self.name = name
        self.parent = parent
        self.path = name if parent is None else f"{parent}/{name}"
        self.start = start
        self.end: Any = None
        self.host_start: int | None = time.perf_counter_ns() if host else None
        self.host_end: int | None = None
        self.wall = _wall()  # for observers (heartbeat): when this phase opened


_wall = time.time


class Step:
    """A sampled step: its marks while open and pending, its numbers once resolved."""

    __slots__ = (
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
        self.side: list[tuple[str, Any, Any]] = []
        self.counters: dict[str, float] = {}
        self.collectives: list[Any] = []
        self.extra: dict[str, Any] = {}
        self.step_ms = 0.0
        self.side_ms: list[tuple[str, float]] = []
        self.timed: list[tuple[Span, float, float]] = []  # (span, start_ms, end_ms) once resolved
        self.collective_summary: list[dict[str, Any]] | None = None
        self.gpu_start_unix_ns: int | None = None
        self.res: Any = None  # ResourceMonitor.on_step_end snapshot (memory at step end)

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
        for _, a, b in self.side:
            yield a
            yield b
        for c in self.collectives:  # (op, pg, pg_size, nbytes, start, end, path, seq, gap)
            yield c[4]
            yield c[5]
            if c[8] is not None:
                yield c[8][0]
                yield c[8][1]


class PhaseContext:
    """``with tracer.phase("x"):`` and ``@tracer.phase("x")``."""

    __slots__ = ("_host", "_name", "_tokens", "_tracer")

    def __init__(self, tracer: Tracer | None, name: str, host: bool) -> None:
        self._tracer = tracer  # None: resolve the default tracer at each use
        self._name = name
        self._host = host
        self._tokens: list[tuple[Any, Any]] = []

    def __enter__(self) -> PhaseContext:
        tracer: Any = self._tracer
        if tracer is None:
            from stepscope.lifecycle import current_tracer

            tracer = current_tracer()
        self._tokens.append((tracer, tracer.open_phase(self._name, host=self._host)))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        tracer, token = self._tokens.pop()
        if exc is not None:
            tracer.note_raise(exc)  # the innermost phase an exception left, before it closes
        tracer.close_phase(token)

    def __call__(self, fn: F) -> F:
        ctx = self

        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with ctx:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class _StepContext:
    __slots__ = ("_tracer",)

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def __enter__(self) -> _StepContext:
        self._tracer._enter_step()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._tracer._exit_step(exc)


class _RecentRecords:
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


class Tracer:
    """Times the phases of each training step on one rank and records sampled steps.

    Example::

        tracer = stepscope.Tracer(Config(out_dir="runs/a"), model=model, optimizer=opt)
        for batch in tracer.wrap_loader(loader):
            with tracer.step():
                ...
        tracer.finish()
    """

    def __init__(
        self,
        config: Config,
        *,
        model: Any = None,
        optimizer: Any = None,
        clock: Clock | None = None,
        sink: Sink | None = None,
        rank: RankInfo | None = None,
    ) -> None:
        _check_targets(model, optimizer)
        self.config = config
        self.rank = rank if rank is not None else rank_info()
        self.clock: Clock = clock if clock is not None else default_clock()
        self.run_id = config.run_id or _default_run_id()
        self.enabled = True
        self._auto_active: set[str] = set()
        self._uninstallers: list[Callable[[], None]] = []
        self._index = 0
        self._cur: Step | None = None  # the open sampled step
        self._next: Step | None = None  # what arrived before the next step opened
        self._stack: list[Span] = []
        self._owner: int | None = None  # thread that opened the current step
        self._ignored = threading.local()  # per thread: step() entries not timed (nested, other thread)
        self._refused = 0  # such entries open on any thread (a cheap check before the thread-local)
        self._in_step = False
        self._since_flush = 0
        self._warned: set[str] = set()
        self._failed = False
        self._finished = False
        self._step_cm = _StepContext(self)
        self._listeners: list[Any] = []
        self._step_end: list[Callable[[Tracer, int], None]] = []
        self._forward_seen = False
        self._sampled_seen = 0
        self._step_wall = 0.0  # time.time() at step entry
        self._last_step: tuple[int, float, float] | None = None  # index, end wall, seconds
        self._raised: tuple[BaseException, list[str]] | None = None
        # Throughput, FLOPs, memory, device health (issue 13). Built at the first sampled step,
        # once the clock knows its device (init() often runs before set_device).
        self._step_counts: tuple[int | None, int | None] | None = None
        self._resources: ResourceMonitor | None = None
        #: False when records go to a sink passed in (tests): no files beside them (heartbeat).
        self.writes_files = sink is None
        self._recent = _RecentRecords()
        self._listeners.append(self._recent)
        anchor = GpuAnchor(self.clock) if isinstance(self.clock, CudaClock) else None
        self.resolver = Resolver(
            self.clock,
            {
                "run_id": self.run_id,
                "rank": self.rank.rank,
                "local_rank": self.rank.local_rank,
                "world_size": self.rank.world_size,
                "hostname": self.rank.hostname,
            },
            config.max_pending_steps,
            anchor,
            _capture_probe() if anchor is not None else None,
            self._step_fields,
        )
        self._writer = BackgroundWriter(
            sink if sink is not None else open_sink(config.sink, config.out_dir, self.rank.rank),
            on_error=self.fail,
        )
        #: Observers attached by :mod:`stepscope.lifecycle` (opaque here), for users and tests.
        self.profiler: Any = None
        self.live: Any = None
        self.autoprofile: Any = None
        self._install(model, optimizer)
        if self.clock.kind == "cpu":  # the device is known now; a CUDA clock knows it at its first mark
            self._resources = self._new_resources()
        from stepscope.lifecycle import wire

        wire(self)
        ref = weakref.ref(self)

        def _at_exit() -> None:
            tracer = ref()
            if tracer is not None:
                tracer.finish()

        self._at_exit = _at_exit
        atexit.register(_at_exit)

    # ------------------------------------------------------------------ public API

    @property
    def recording(self) -> bool:
        """True when the current step (or the next one, between steps) is sampled."""
        if not self.enabled:
            return False
        if self._in_step:
            return self._cur is not None
        return self.config.samples(self._index)

    @property
    def in_step(self) -> bool:
        """True while a sampled step is open (on whichever thread asks)."""
        return self._cur is not None

    @property
    def step_index(self) -> int:
        """Index of the current step inside ``step()``, else of the next one."""
        return self._index

    def step(
        self, index: int | None = None, *, tokens: int | None = None, samples: int | None = None
    ) -> _StepContext:
        """Context manager around one optimizer step; ``index`` overrides the step counter.

        ``tokens``/``samples`` (non-negative ints) give the step's throughput numbers.
        """
        # Validated at the call (ValueError), applied when the step opens.
        self._step_counts = check_counts(tokens, samples)
        if index is not None:
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f"step index must be a non-negative int; got {index!r}")
            if not self._in_step:
                self._index = index
        return self._step_cm

    def phase(self, name: str, *, host: bool = False) -> PhaseContext:
        """A user-named (or manual canonical) phase: a context manager and a decorator.

        ``host=True`` marks a phase with no GPU work of its own (waiting on a queue, a file,
        a remote service): on GPU its record carries the host time too (``host_ms``).
        """
        check_phase_name(name)
        if name in self._auto_active:
            raise InstrumentationError(
                f"phase {name!r} is already timed automatically; time it either automatically "
                f"or with phase({name!r}), not both (pass auto=False or auto={{...}} without "
                f"{name!r} to init() to time it manually)"
            )
        return PhaseContext(self, name, host)

    def wrap_loader(self, loader: Iterable[Any]) -> Any:
        """Time the wait for each next batch as ``dataloader``."""
        from stepscope.instrument.loader import TimedLoader

        if "dataloader" not in self.config.auto:
            raise InstrumentationError(
                "wrap_loader() times 'dataloader' automatically, but 'dataloader' is not in "
                "auto; use phase('dataloader') instead or enable it"
            )
        self._auto_active.add("dataloader")
        return TimedLoader(loader, self)

    def wrap_h2d(self, batch: Any) -> Any:
        """Return a proxy whose next ``.to(device)``/``.cuda()`` is timed as ``h2d``."""
        from stepscope.instrument.h2d import H2DProxy

        if "h2d" in self._auto_active:
            raise InstrumentationError(
                "wrap_h2d() times 'h2d' manually, but host-to-device copies are already timed "
                "automatically; pass auto=False (or an auto set without 'h2d') to init()"
            )
        return H2DProxy(batch, self)

    def summary(self) -> dict[str, Any]:
        """Per-phase medians over the records resolved so far on this rank (plain dict)."""
        from stepscope.live import local_summary

        return local_summary(self)

    def recent_records(self) -> list[dict[str, Any]]:
        """The last resolved records of this rank (oldest first)."""
        return self._recent.snapshot()

    def add_listener(self, listener: Any) -> None:
        """Register an observer: an object with any of ``on_step_end(tracer, index)``,
        ``on_record(record)``, ``on_exception(tracer, exc_type, exc, phase_stack)``,
        ``on_finish(tracer)``; a plain
        callable is taken as ``on_record``. ``on_record`` runs on the writer thread."""
        if callable(listener) and not hasattr(listener, "on_record"):
            fn = listener

            class _OnRecord:
                def on_record(self, record: dict[str, Any]) -> None:
                    fn(record)

            listener = _OnRecord()
        self._listeners.append(listener)
        if hasattr(listener, "on_step_end"):
            self._step_end.append(listener.on_step_end)

    def submit_background(self, job: Callable[[], Any]) -> None:
        """Run ``job()`` on the writer thread (never blocks; no CUDA calls allowed there)."""

        def run() -> list[dict[str, Any]]:
            job()
            return []

        self._writer.submit(run)

    def flush(self) -> None:
        """Hand every record resolved so far to the writer now (it writes them in order)."""
        if self.enabled and not self._finished:
            self.resolver.poll()
            self._since_flush = 0
            self._writer.submit(self._flush_job())

    def finish(self) -> None:
        """Resolve pending events, flush, close files and remove hooks. Idempotent."""
        if self._finished:
            return
        self._finished = True
        atexit.unregister(self._at_exit)
        for listener in list(self._listeners):
            fn = getattr(listener, "on_finish", None)
            if fn is not None:
                try:
                    fn(self)
                except Exception as exc:  # protect the job: finishing must never raise into it
                    self.fail(exc)
        try:
            self._uninstall()
            if self._resources is not None:
                self._resources.close()
        except Exception as exc:  # protect the job
            self.fail(exc)
        if self.enabled:
            deadline = time.monotonic() + FINISH_TIMEOUT_S

            def late() -> bool:
                # Polling for late events at finish only; the host never calls synchronize.
                time.sleep(0.001)
                return time.monotonic() >= deadline

            try:
                self.resolver.drain(late)
            except Exception as exc:  # protect the job
                self.fail(exc)
        final = self._flush_job() if self.enabled else None
        closed = self._writer.close(final, timeout=FINISH_TIMEOUT_S + 10.0)
        if not closed:
            self.warn("the writer did not finish within its timeout; the last records may be missing")
        for fn in [getattr(x, "on_closed", None) for x in self._listeners]:  # [export] after the last record
            if fn is not None:
                with contextlib.suppress(Exception):  # protect the job: finishing must never raise
                    fn(self)

    def fail(self, exc: BaseException) -> None:
        """Report once, turn timing off, and let the training job go on."""
        if self._failed:
            return
        self._failed = True
        self.enabled = False
        self._in_step = False
        self._cur = None
        self._next = None
        self._stack.clear()
        gate.set_current(None)
        with contextlib.suppress(Exception):  # protect the job: we are already failing
            self._uninstall()
        self.warn(f"timing disabled after an internal error: {exc!r}")

    def warn(self, msg: str, key: str | None = None) -> None:
        """One ``StepscopeWarning`` per ``key`` (default: the message) for this tracer."""
        key = key or msg
        if key in self._warned:
            return
        self._warned.add(key)
        # protect the job: warnings configured as errors must not escape into it
        with contextlib.suppress(Exception):
            warnings.warn(f"stepscope: {msg}", StepscopeWarning, stacklevel=3)

    def state(self) -> dict[str, Any]:
        """A snapshot for observers on other threads (the heartbeat): plain values, no clock
        (no CUDA) call. Phases are known on sampled steps only."""
        stack = [sp for sp in list(self._stack) if sp.end is None]  # copied first: thread-safe
        last = self._last_step
        return {
            "step": self._index,
            "in_step": self._in_step,
            "step_started": self._step_wall if self._in_step else None,
            "phase_stack": [sp.name for sp in stack],
            "phase_started": stack[-1].wall if stack else None,
            "last_step": last[0] if last else None,
            "last_step_end": last[1] if last else None,
            "last_step_s": last[2] if last else None,
            "finished": self._finished,
            "enabled": self.enabled,
            "collective": self._blocked_in(),
        }

    def _blocked_in(self) -> dict[str, Any] | None:
        owner = self._owner
        if owner is None or not self.config.collectives:
            return None
        from stepscope.instrument.collectives import blocked_in

        got = blocked_in(owner)
        return None if got is None else {"op": got[0], "since": got[1]}

    def note_raise(self, exc: BaseException) -> None:
        """Remember the open phases where ``exc`` was first seen (for crash evidence)."""
        if self._raised is None or self._raised[0] is not exc:
            self._raised = (exc, [sp.name for sp in self._stack if sp.end is None])

    # ------------------------------------------------- instrument-facing interface

    def current_path(self) -> str | None:
        """Path of the innermost open phase (``forward/h2d``); None outside any phase."""
        stack = self._stack
        return stack[-1].path if stack else None

    def open_phase(self, name: str, host: bool = False) -> Span | None:
        """Start timing ``name``; returns a token for :meth:`close_phase` (``None`` = not timed).

        Between steps, the span goes to the next step (dataloader wait, prefetch hand-over),
        whose start moves back to the span's start; while it is open the in-step gate is
        raised on this thread, so collectives inside a batch fetch are seen.
        """
        if not self.enabled:
            return None
        try:
            if self._in_step:
                cur = self._cur
                if cur is None:
                    return None
                if self._refused and getattr(self._ignored, "n", 0) and threading.get_ident() != self._owner:
                    return None  # inside a step() refused to this (second) thread
                stack = self._stack
                span = Span(name, stack[-1].path if stack else None, self.clock.mark(), host)
                cur.spans.append(span)
            else:
                nxt = self._next_step()
                if nxt is None:
                    return None
                stack = self._stack
                span = Span(name, stack[-1].path if stack else None, self.clock.mark(), host)
                if nxt.start is None:
                    nxt.start = span.start
                    nxt.start_unix_ns = time.time_ns()
                nxt.spans.append(span)
                gate.set_current(self)
            stack.append(span)
            return span
        except Exception as exc:  # protect the job: timing errors disable timing only
            self.fail(exc)
            return None

    def close_phase(self, token: Span | None) -> None:
        if token is None or token.end is not None or not self.enabled:
            return
        try:
            token.end = self.clock.mark()
            if token.host_start is not None:
                token.host_end = time.perf_counter_ns()
            stack = self._stack
            if stack and stack[-1] is token:
                stack.pop()
            elif token in stack:
                # Backward closes on an autograd thread while a user phase may be open.
                stack.remove(token)
            if not self._in_step and not stack:
                gate.set_current(None)
        except Exception as exc:  # protect the job
            self.fail(exc)

    def discard_phase(self, token: Span | None) -> None:
        """Forget a span (e.g. the loader's wait that ended in StopIteration)."""
        if token is None:
            return
        if token in self._stack:
            self._stack.remove(token)
        for step in (self._next, self._cur):
            if step is not None and token in step.spans:
                step.spans.remove(token)
                self._forget(step, token)
        if not self._in_step and not self._stack:
            gate.set_current(None)

    def drop_unconsumed(self, token: Span | None) -> None:
        """Forget a pre-step span that no step has adopted (a loader abandoned by ``break``)."""
        nxt = self._next
        if token is not None and nxt is not None and token in nxt.spans:
            self.discard_phase(token)

    def add_side_span(self, name: str, start: Any, end: Any) -> None:
        """A span measured on another stream (e.g. the prefetch copy); not in the step sum."""
        step = self._reporting_step()
        if step is not None:
            foreign = self.clock.foreign
            step.side.append((name, foreign(start), foreign(end)))

    def count(self, name: str, n: int) -> None:
        """Add ``n`` (int >= 0) to the open step's ``tokens``/``samples`` (or any counter).

        Outside a step: a warning, nothing counted.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"counter name must be a non-empty string; got {name!r}")
        check_count(name, n)
        if not self._in_step:
            warn_outside_step(name)
            return
        cur = self._cur
        if cur is not None:
            cur.counters[name] = cur.counters.get(name, 0) + n

    def add_counter(self, name: str, value: float) -> None:
        """Add ``value`` to the per-step counter ``name`` (e.g. ``h2d_bytes``)."""
        step = self._reporting_step()
        if step is not None:
            step.counters[name] = step.counters.get(name, 0) + value

    def add_collective(
        self, op: str, pg: str, pg_size: int, nbytes: int, start: Any, end: Any,
        phase_path: str | None, *, seq: int = 0, gap: tuple[Any, Any] | None = None,
    ) -> None:
        """One timed collective (see :mod:`stepscope.instrument.collectives`), attached to the
        current step or, during a pre-step phase, to the next one. ``gap`` is the
        ``(issue_end, wait_start)`` marks of an async call: overlapped work, not collective time.
        """
        step = self._reporting_step()
        if step is None:
            rel = self.clock.release
            for m in (start, end, *(gap or ())):
                rel(m)
            return
        step.collectives.append((op, pg, pg_size, nbytes, start, end, phase_path, seq, gap))

    def set_step_fields(self, fields: dict[str, Any]) -> None:
        """Merge extra top-level record sections (throughput, memory, ...) into the open step."""
        step = self._cur
        if step is not None:
            step.extra.update(fields)

    # ------------------------------------------------------------- step lifecycle

    def _next_step(self) -> Step | None:
        """The step that things reported between steps belong to (None if not sampled)."""
        nxt = self._next
        if nxt is not None and nxt.index == self._index:
            return nxt
        if nxt is not None:  # the step index moved on (step(index=...)): stale
            self._drop_next()
        if not self.config.samples(self._index):
            return None
        nxt = self._next = Step(self._index)
        return nxt

    def _reporting_step(self) -> Step | None:
        if self._in_step:
            return self._cur
        if not self.enabled:
            return None
        return self._next_step()

    def _drop_next(self) -> None:
        nxt, self._next = self._next, None
        if nxt is None:
            return
        self._stack = [s for s in self._stack if s not in nxt.spans]
        rel = self.clock.release
        for m in nxt.marks():
            if m is not None:
                rel(m)

    def _forget(self, step: Step, span: Span) -> None:
        if step.start is span.start:
            step.start = step.spans[0].start if step.spans else None
            if step.start is None:
                step.start_unix_ns = 0
        else:
            self.clock.release(span.start)
        if span.end is not None:
            self.clock.release(span.end)

    def _enter_step(self) -> None:
        if not self.enabled:
            return
        if self._in_step:
            tl = self._ignored
            tl.n = getattr(tl, "n", 0) + 1
            self._refused += 1
            if self._owner == threading.get_ident():
                self.warn("step() entered inside an open step(); the inner one is not timed",
                          key="nested")
            else:
                self.warn("step() entered on a second thread while another thread's step is open; "
                          "steps are per thread, the second one is not timed", key="threads")
            return
        try:
            self._in_step = True
            self._owner = threading.get_ident()
            self._step_wall = time.time()
            if not self.config.samples(self._index):
                self._drop_next()
                self._step_counts = None
                return
            step = self._next_step()
            self._next = None
            assert step is not None
            if step.start is None:
                step.start = self.clock.mark()
                step.start_unix_ns = time.time_ns()
            # Pre-step spans still open (none normally) stay on the stack.
            self._stack = [s for s in self._stack if s.end is None]
            self._cur = step
            self._sampled_seen += 1
            counts = self._step_counts
            if counts is not None:
                self._step_counts = None
                if counts[0] is not None:
                    step.counters["tokens"] = step.counters.get("tokens", 0) + counts[0]
                if counts[1] is not None:
                    step.counters["samples"] = step.counters.get("samples", 0) + counts[1]
            res = self._resources
            if res is None:
                res = self._resources = self._new_resources()
            res.on_step_start(step.index)
            gate.set_current(self)
        except Exception as exc:  # protect the job
            self.fail(exc)

    def _exit_step(self, exc: BaseException | None = None) -> None:
        if self._refused:
            tl = self._ignored
            n = getattr(tl, "n", 0)
            if n:  # the matching entry was not timed
                tl.n = n - 1
                self._refused -= 1
                return
        if not self.enabled:
            self._in_step = False
            return
        try:
            raised_in: list[str] = []
            if exc is not None:
                noted = self._raised
                raised_in = noted[1] if noted is not None and noted[0] is exc else [
                    sp.name for sp in self._stack if sp.end is None
                ]
                self._raised = None
                # Observers see the state as it was when the step raised (step, phases).
                for listener in self._listeners:
                    fn = getattr(listener, "on_exception", None)
                    if fn is not None:
                        fn(self, type(exc), exc, raised_in)
            step = self._cur
            if step is not None:
                gate.set_current(None)
                end = self.clock.mark()
                for span in self._stack:
                    if span.end is None:
                        span.end = end
                self._stack.clear()
                step.end = end
                if self._resources is not None:
                    step.res = self._resources.on_step_end(step.index)
                if not self._forward_seen and "forward" in self._auto_active:
                    self._check_forward(step)
                self.resolver.add(step)
                self._since_flush += 1
            self._cur = None
            self._in_step = False
            self._owner = None
            done = self._index
            self._index += 1
            now = time.time()
            self._last_step = (done, now, now - self._step_wall)
            if step is not None:
                self.resolver.poll()
                # An exception may end the job: what is resolved goes to the file now.
                if self._since_flush >= self.config.flush_every_n_steps or exc is not None:
                    self._since_flush = 0
                    self._writer.submit(self._flush_job())

            for fn in self._step_end:
                fn(self, done)
        except Exception as err:  # protect the job
            self._in_step = False
            self.fail(err)

    def _new_resources(self) -> ResourceMonitor:
        cfg = self.config

        def build(device: str) -> ResourceMonitor:
            return ResourceMonitor(device=device, flops_per_step=cfg.flops_per_step,
                                   model_flops=cfg.model_flops, peak_tflops=cfg.peak_tflops)

        try:
            return build(self.clock.device)
        except Exception as exc:  # protect the job: device metrics are optional, timing is not
            self.warn(f"device memory and health are not recorded: {exc!r}", key="resources")
            return build("cpu")

    def _step_fields(
        self, index: int, start_unix_ns: int, step_ms: float, counters: dict[str, float], res: Any
    ) -> dict[str, Any]:
        """Record sections from the resource monitor (writer thread); pops tokens/samples."""
        mon = self._resources
        if mon is None:
            return {}
        return mon.step_fields(index, start_unix_ns, step_ms, counters, res)

    def _check_forward(self, step: Step) -> None:
        if any(s.name == "forward" for s in step.spans):
            self._forward_seen = True
        elif self._sampled_seen >= 3:
            self._forward_seen = True  # warn once, then stop checking
            self.warn(
                "three sampled steps had no forward span although a model was passed to init(); "
                "if the model was compiled after init() (torch.compile(model) or model.compile()), "
                "pass the compiled module to init() instead, or time it with phase('forward')",
                key="no-forward",
            )

    def _flush_job(self) -> Callable[[], list[dict[str, Any]]]:
        steps = self.resolver.take_ready()
        listeners = [fn for fn in (getattr(x, "on_record", None) for x in self._listeners) if fn]

        def job() -> list[dict[str, Any]]:
            records = self.resolver.build(steps)
            for fn in listeners:
                for rec in records:
                    fn(rec)
            return records

        return job

    # ------------------------------------------------------ install / failure

    def _install(self, model: Any, optimizer: Any) -> None:
        auto = self.config.auto
        if model is not None and auto & {"forward", "backward"}:
            from stepscope.instrument.hooks import attach_model

            self._uninstallers.append(
                attach_model(self, model, forward="forward" in auto, backward="backward" in auto)
            )
            self._auto_active |= auto & {"forward", "backward"}
        if optimizer is not None and "optimizer" in auto:
            from stepscope.instrument.hooks import attach_optimizer

            self._uninstallers.append(attach_optimizer(self, optimizer))
            self._auto_active.add("optimizer")
        if "h2d" in auto:
            from stepscope.instrument.h2d import install_patch

            self._uninstallers.append(install_patch())
            self._auto_active.add("h2d")
        if self.config.collectives:
            from stepscope.instrument import collectives

            self._uninstallers.append(collectives.install_patch())

    def add_uninstaller(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the tracer finishes (instruments installed from outside)."""
        self._uninstallers.append(fn)

    def _uninstall(self) -> None:
        if gate.current() is self:
            gate.set_current(None)
        while self._uninstallers:
            try:
                self._uninstallers.pop()()
            except Exception as exc:  # protect the job: a stale hook handle is harmless
                self.warn(f"could not remove a hook: {exc!r}")
        self._auto_active.clear()


def check_phase_name(name: Any) -> None:
    if not isinstance(name, str) or not name or name == "residual" or "/" in name:
        raise ValueError(
            f"phase name must be a non-empty string other than 'residual', without '/'; got {name!r}"
        )


def _capture_probe() -> Callable[[], bool]:
    import torch

    if not torch.cuda.is_available():  # fake CUDA clocks in tests: nothing can be capturing
        return lambda: False
    return torch.cuda.is_current_stream_capturing


def _check_targets(model: Any, optimizer: Any) -> None:
    import torch

    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or None; got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__name__}"
        )


def _default_run_id() -> str:
    import os
    import uuid

    for var in ("STEPSCOPE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(var):
            return os.environ[var]
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
