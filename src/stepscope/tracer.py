"""Tracer: step lifecycle, phase stack, sampling, deferred event resolution, flushing.

The hot path (inside ``step()``) only takes clock marks and appends small objects to
lists. Marks are turned into numbers later, when ``Clock.ready`` says they can be read
without blocking, and records reach the files through a background writer.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import uuid
import warnings
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

from stepscope.clock import Clock, default_clock
from stepscope.config import Config
from stepscope.dist import RankInfo, rank_info
from stepscope.errors import InstrumentationError, StepscopeWarning
from stepscope.instrument import gate
from stepscope.records import SCHEMA_VERSION
from stepscope.sinks import BackgroundWriter, Sink, open_sink, write_json_atomic

F = TypeVar("F", bound=Callable[..., Any])

#: How long ``finish()`` keeps polling CUDA events before giving up on them (seconds).
FINISH_TIMEOUT_S = 5.0


class _Span:
    __slots__ = ("end", "name", "parent", "start")

    def __init__(self, name: str, parent: str | None, start: Any) -> None:
        self.name = name
        self.parent = parent
        self.start = start
        self.end: Any = None


class _Step:
    __slots__ = ("colls", "counters", "end", "index", "side", "spans", "start", "start_unix_ns")

    def __init__(self, index: int, start: Any, start_unix_ns: int, spans: list[_Span]) -> None:
        self.index = index
        self.start = start
        self.start_unix_ns = start_unix_ns
        self.spans = spans
        self.side: list[tuple[str, Any, Any]] = []
        self.counters: dict[str, float] = {}
        # [collectives] entries from tracer.add_collective (see instrument/collectives.py)
        self.colls: list[tuple[Any, ...]] = []
        self.end: Any = None


class _PhaseContext:
    """``with tracer.phase("x"):`` and ``@tracer.phase("x")``."""

    __slots__ = ("_name", "_tokens", "_tracer")

    def __init__(self, tracer: Tracer, name: str) -> None:
        self._tracer = tracer
        self._name = name
        self._tokens: list[Any] = []

    def __enter__(self) -> _PhaseContext:
        self._tokens.append(self._tracer.open_phase(self._name))
        return self

    def __exit__(self, *exc: object) -> None:
        self._tracer.close_phase(self._tokens.pop())

    def __call__(self, fn: F) -> F:
        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class _StepContext:
    __slots__ = ("_tracer",)

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def __enter__(self) -> _StepContext:
        self._tracer._enter_step()
        return self

    def __exit__(self, *exc: object) -> None:
        self._tracer._exit_step()


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
        self.dropped: Counter[str] = Counter()
        self._dropped_reported: Counter[str] = Counter()
        self._auto_active: set[str] = set()
        # [collectives] whether the in-step gate is raised (h2d and/or collectives patched)
        self._gated = False
        self._uninstallers: list[Callable[[], None]] = []
        self._index = 0
        self._in_step = False
        self._cur: _Step | None = None
        self._stack: list[_Span] = []
        self._pre: list[_Span] = []
        self._pre_unix_ns = 0
        self._pre_holder: _Step | None = None
        # Filled by the training thread, emptied by the writer thread's resolver.
        self._pending: deque[_Step] = deque()
        self._pending_lock = threading.Lock()
        self._since_flush = 0
        self._warned = False
        self._finished = False
        self._step_cm = _StepContext(self)
        self._profiler: Any = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        from stepscope.live import RecentRecords

        self._recent = RecentRecords()
        self._listeners.append(self._recent)
        self.device: str = getattr(self.clock, "device", self.clock.kind)
        self._writer = BackgroundWriter(
            sink if sink is not None else open_sink(config.sink, config.out_dir, self.rank.rank),
            on_error=self._fail,
        )
        #: Called as ``fn(tracer, step_index)`` on the training thread after every step
        #: (sampled or not); must be cheap. Used by the live summary and auto-profiling.
        self.step_end_callbacks: list[Callable[[Tracer, int], None]] = []
        #: Called as ``fn(tracer)`` at the start of ``finish()``.
        self.finish_callbacks: list[Callable[[Tracer], None]] = []
        self._live: Any = None  # set by stepscope.live.attach_live
        self._autoprofile: Any = None  # set by stepscope.autoprofile.attach_autoprofile
        self._install(model, optimizer)
        if config.profile_steps is not None:
            self._start_profiler()
        if config.log_every_n_steps:
            from stepscope.live import attach_live

            attach_live(self)
        if config.auto_profile:
            from stepscope.autoprofile import attach_autoprofile

            attach_autoprofile(self)
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
    def step_index(self) -> int:
        """Index of the current step inside ``step()``, else of the next one."""
        return self._index

    def step(self, index: int | None = None) -> _StepContext:
        """Context manager around one optimizer step; ``index`` overrides the step counter."""
        if index is not None:
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f"step index must be a non-negative int; got {index!r}")
            self._index = index
        return self._step_cm

    def phase(self, name: str) -> _PhaseContext:
        """A user-named (or manual canonical) phase: a context manager and a decorator."""
        if not isinstance(name, str) or not name or name == "residual":
            raise ValueError(f"phase name must be a non-empty string other than 'residual'; got {name!r}")
        if name in self._auto_active:
            raise InstrumentationError(
                f"phase {name!r} is already timed automatically; time it either automatically "
                f"or with phase({name!r}), not both (pass auto=False or auto={{...}} without "
                f"{name!r} to init() to time it manually)"
            )
        return _PhaseContext(self, name)

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

    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(record)`` for each resolved record (at flush cadence, off the hot path)."""
        self._listeners.append(fn)

    def finish(self) -> None:
        """Resolve pending events, flush, close files and remove hooks. Idempotent."""
        if self._finished:
            return
        self._finished = True
        atexit.unregister(self._at_exit)
        try:
            for fn in self.finish_callbacks:
                fn(self)
            self._stop_profiler()
            self._uninstall()
        except Exception as exc:  # protect the job: finishing must never raise into it
            self._fail(exc)
        final = (lambda: self._resolve_ready(FINISH_TIMEOUT_S)) if self.enabled else None
        closed = self._writer.close(final, timeout=FINISH_TIMEOUT_S + 10.0)
        if not closed:
            self._warn("the writer did not finish within its timeout; the last records may be missing")

    # ------------------------------------------------- instrument-facing interface

    def open_phase(self, name: str) -> _Span | None:
        """Start timing ``name``; returns a token for :meth:`close_phase` (``None`` = not timed).

        Between steps, the span is kept and attached to the next step (dataloader wait,
        prefetch wait), whose start moves back to the span's start.
        """
        if not self.enabled:
            return None
        try:
            if self._in_step:
                if self._cur is None:
                    return None
                parent = self._stack[-1].name if self._stack else None
                span = _Span(name, parent, self.clock.mark())
                self._cur.spans.append(span)
            else:
                if not self.config.samples(self._index):
                    return None
                if not self._pre:
                    self._pre_unix_ns = time.time_ns()
                span = _Span(name, None, self.clock.mark())
                self._pre.append(span)
                if self._gated:  # [collectives] gate raised over sampled pre-step spans
                    gate.set_current(self)
            self._stack.append(span)
            return span
        except Exception as exc:  # protect the job: timing errors disable timing only
            self._fail(exc)
            return None

    def close_phase(self, token: _Span | None) -> None:
        if token is None or token.end is not None or not self.enabled:
            return
        try:
            token.end = self.clock.mark()
            stack = self._stack
            if stack and stack[-1] is token:
                stack.pop()
            elif token in stack:
                # Backward closes on an autograd thread while a user phase may be open.
                stack.remove(token)
            if self._gated and not self._in_step and not stack:  # [collectives] pre-step gate
                gate.set_current(None)
        except Exception as exc:  # protect the job
            self._fail(exc)

    def discard_phase(self, token: _Span | None) -> None:
        """Forget an open span (e.g. the loader's wait that ended in StopIteration)."""
        if token is None:
            return
        for seq in (self._stack, self._pre, self._cur.spans if self._cur else []):
            if token in seq:
                seq.remove(token)
        if self._gated and not self._in_step and not self._stack:  # [collectives] pre-step gate
            gate.set_current(None)
        self.clock.release(token.start)

    def add_side_span(self, name: str, start: Any, end: Any) -> None:
        """A span measured on another stream (e.g. the prefetch copy); not in the step sum."""
        step = self._reporting_step()
        if step is not None:
            step.side.append((name, start, end))

    def add_counter(self, name: str, value: float) -> None:
        """Add ``value`` to the per-step counter ``name`` (e.g. ``h2d_bytes``)."""
        step = self._reporting_step()
        if step is not None:
            step.counters[name] = step.counters.get(name, 0) + value

    # [collectives] --- begin: recorder methods for instrument/collectives.py
    def current_path(self) -> str | None:
        """Path of the innermost open phase ("forward/h2d"), or None when none is open."""
        stack = self._stack
        if not stack:
            return None
        if len(stack) == 1:
            return stack[0].name
        return "/".join(s.name for s in stack)

    def add_collective(
        self, op: str, pg: str, pg_size: int, nbytes: int, start: Any, end: Any,
        phase_path: str | None, *, seq: int = 0, gap: tuple[Any, Any] | None = None,
    ) -> None:
        """One timed collective, attached to the current (or the next sampled) step."""
        step = self._reporting_step() if self.enabled else None
        if step is None:
            rel = self.clock.release
            for m in (start, end, *(gap or ())):
                rel(m)
            return
        step.colls.append((op, pg, pg_size, nbytes, start, end, phase_path, seq, gap))
    # [collectives] --- end

    # ------------------------------------------------------------- step lifecycle

    def _reporting_step(self) -> _Step | None:
        """The step a side span or counter belongs to: the current one, or the next sampled one."""
        if self._in_step:
            return self._cur
        if not self.recording:
            return None
        # Reported between steps (prefetch): held in a placeholder until the step opens.
        if self._pre_holder is None or self._pre_holder.index != self._index:
            self._pre_holder = _Step(self._index, None, 0, [])
        return self._pre_holder

    def _enter_step(self) -> None:
        if not self.enabled:
            return
        if self._in_step:
            raise InstrumentationError("step() is already active; steps cannot be nested")
        try:
            self._in_step = True
            if not self.config.samples(self._index):
                self._pre.clear()
                return
            pre = self._pre
            if pre:
                step = _Step(self._index, pre[0].start, self._pre_unix_ns, list(pre))
                pre.clear()
            else:
                step = _Step(self._index, self.clock.mark(), time.time_ns(), [])
            holder = self._pre_holder
            if holder is not None and holder.index == self._index:
                step.side, step.counters = holder.side, holder.counters
                step.colls = holder.colls  # [collectives]
                self._pre_holder = None
            # Spans left open by the pre-step phase (none normally) stay on the stack.
            self._stack = [s for s in self._stack if s.end is None]
            self._cur = step
            if self._gated:  # [collectives] was: if "h2d" in self._auto_active
                gate.set_current(self)
        except Exception as exc:  # protect the job
            self._fail(exc)

    def _exit_step(self) -> None:
        if not self.enabled:
            self._in_step = False
            return
        try:
            step = self._cur
            if step is not None:
                if self._gated:  # [collectives] was: if "h2d" in self._auto_active
                    gate.set_current(None)
                end = self.clock.mark()
                for span in self._stack:
                    if span.end is None:
                        span.end = end
                self._stack.clear()
                step.end = end
                pending = self._pending
                pending.append(step)
                limit = self.config.max_pending_steps
                if len(pending) > limit:
                    # Re-checked under the lock: the resolver may have drained it meanwhile.
                    with self._pending_lock:
                        while len(pending) > limit:
                            self._release(pending.popleft())
                            self.dropped["pending_overflow"] += 1
                self._since_flush += 1
                if self._since_flush >= self.config.flush_every_n_steps:
                    self._since_flush = 0
                    self._writer.submit(self._resolve_ready)
            self._cur = None
            self._in_step = False
            done = self._index
            self._index += 1
            if self._profiler is not None:
                self._profiler.step()
            for fn in self.step_end_callbacks:
                fn(self, done)
        except Exception as exc:  # protect the job
            self._in_step = False
            self._fail(exc)

    # -------------------------------------------------------------- resolution

    def _resolve_ready(self, timeout: float = 0.0) -> list[dict[str, Any]]:
        """Resolve pending steps, in order, while their marks are ready (writer thread).

        With ``timeout`` > 0 (at finish) it polls that long for late events, then counts
        what is still pending as dropped.
        """
        deadline = time.monotonic() + timeout
        pending = self._pending
        out: list[dict[str, Any]] = []
        while True:
            with self._pending_lock:
                step = pending[0] if pending else None
                ready = step is not None and self._step_ready(step)
                if ready:
                    pending.popleft()
            if step is None:
                break
            if not ready:
                if time.monotonic() >= deadline:
                    break
                # Polling on the writer thread at finish: the host never calls synchronize.
                time.sleep(0.001)
                continue
            out.append(self._resolve(step))
            self._release(step)
        if timeout > 0 and pending:
            with self._pending_lock:
                self.dropped["unresolved_at_finish"] += len(pending)
                pending.clear()
        for fn in self._listeners:
            for rec in out:
                fn(rec)
        return out

    def _step_ready(self, step: _Step) -> bool:
        ready = self.clock.ready
        if not ready(step.end):
            return False
        return (
            all(ready(s.end) for s in step.spans)
            and all(ready(e) for _, _, e in step.side)
            and all(ready(c[5]) for c in step.colls)  # [collectives]
        )

    def _resolve(self, step: _Step) -> dict[str, Any]:
        el = self.clock.elapsed_ms
        t0 = step.start
        phases: dict[str, dict[str, Any]] = {}
        top = 0.0
        for s in step.spans:
            ms = el(s.start, s.end)
            start_ms = el(t0, s.start)
            end_ms = el(t0, s.end)
            p = phases.get(s.name)
            if p is None:
                phases[s.name] = {
                    "name": s.name,
                    "parent": s.parent,
                    "ms": ms,
                    "calls": 1,
                    "start_ms": start_ms,
                    "end_ms": end_ms,
                }
            else:
                p["ms"] += ms
                p["calls"] += 1
                p["start_ms"] = min(p["start_ms"], start_ms)
                p["end_ms"] = max(p["end_ms"], end_ms)
            if s.parent is None:
                top += ms
        step_ms = el(t0, step.end)
        rec: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "run_id": self.run_id,
            "rank": self.rank.rank,
            "local_rank": self.rank.local_rank,
            "world_size": self.rank.world_size,
            "hostname": self.rank.hostname,
            "device": self.device,
            "step": step.index,
            "start_unix_ns": step.start_unix_ns,
            "clock": self.clock.kind,
            "step_ms": _r(step_ms),
            "phases": [
                {**p, "ms": _r(p["ms"]), "start_ms": _r(p["start_ms"]), "end_ms": _r(p["end_ms"])}
                for p in phases.values()
            ],
            "residual_ms": _r(max(0.0, step_ms - top)),
        }
        if step.side:
            side: dict[str, float] = {}
            for name, a, b in step.side:
                side[name] = side.get(name, 0.0) + el(a, b)
            rec["side_ms"] = {k: _r(v) for k, v in side.items()}
            if "h2d_copy" in side:
                exposed = phases["h2d"]["ms"] if "h2d" in phases else 0.0
                rec["h2d_hidden_ms"] = _r(max(0.0, side["h2d_copy"] - exposed))
        if step.counters:
            rec["counters"] = dict(step.counters)
        if step.colls:  # [collectives]
            from stepscope.instrument.collectives import summarize

            rec["collectives"] = summarize(step.colls, el)
        with self._pending_lock:
            new_drops = self.dropped - self._dropped_reported
            self._dropped_reported.update(new_drops)
        rec["dropped"] = dict(new_drops)
        return rec

    def _release(self, step: _Step) -> None:
        rel = self.clock.release
        rel(step.start)
        rel(step.end)
        for s in step.spans:
            if s.start is not step.start:
                rel(s.start)
            if s.end is not step.end:
                rel(s.end)
        for c in step.colls:  # [collectives]
            rel(c[4])
            rel(c[5])
            if c[8] is not None:
                rel(c[8][0])
                rel(c[8][1])

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
            self._gated = True
        if self.config.collectives:  # [collectives]
            from stepscope.instrument import collectives

            if collectives.available():
                self._uninstallers.append(collectives.install_patch())
                self._gated = True

    def _uninstall(self) -> None:
        if self._gated and gate.current() is self:  # [collectives] was: if "h2d" in ...
            gate.set_current(None)
        self._gated = False
        while self._uninstallers:
            try:
                self._uninstallers.pop()()
            except Exception as exc:  # protect the job: a stale hook handle is harmless
                self._warn(f"could not remove a hook: {exc!r}")
        self._auto_active.clear()

    def _start_profiler(self) -> None:
        from stepscope.profiler import Profiler

        start, end = self.config.profile_steps  # type: ignore[misc]
        self._profiler = Profiler(
            out_dir=os.path.join(self.config.out_dir, "traces"),
            start_step=start,
            end_step=end,
            ranks=self.config.ranks,
        )
        self._profiler.start()

    def _stop_profiler(self) -> None:
        if self._profiler is not None:
            prof, self._profiler = self._profiler, None
            prof.stop()

    def _warn(self, msg: str) -> None:
        # protect the job: warnings configured as errors must not escape into it
        with contextlib.suppress(Exception):
            warnings.warn(f"stepscope: {msg}", StepscopeWarning, stacklevel=3)

    def _fail(self, exc: BaseException) -> None:
        """Report once, turn timing off, and let the training job go on."""
        if self._warned:
            return
        self._warned = True
        self.enabled = False
        self._in_step = False
        self._cur = None
        self._pre.clear()
        self._stack.clear()
        with contextlib.suppress(Exception):  # protect the job: we are already failing
            self._uninstall()
        self._warn(f"timing disabled after an internal error: {exc!r}")


class NullTracer:
    """What a disabled (or filtered-out rank's) ``init()`` returns: every call is a no-op."""

    enabled = False
    recording = False
    step_index = 0

    class _Null:
        __slots__ = ()

        def __enter__(self) -> NullTracer._Null:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def __call__(self, fn: F) -> F:
            return fn

    _NULL = _Null()

    def step(self, index: int | None = None) -> NullTracer._Null:
        return self._NULL

    def phase(self, name: str) -> NullTracer._Null:
        return self._NULL

    def wrap_loader(self, loader: Any) -> Any:
        return loader

    def wrap_h2d(self, batch: Any) -> Any:
        return batch

    def open_phase(self, name: str) -> None:
        return None

    def close_phase(self, token: Any) -> None:
        return None

    def discard_phase(self, token: Any) -> None:
        return None

    def add_side_span(self, name: str, start: Any, end: Any) -> None:
        return None

    def add_counter(self, name: str, value: float) -> None:
        return None

    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        return None

    def current_path(self) -> None:  # [collectives]
        return None

    def add_collective(self, *args: Any, **kwargs: Any) -> None:  # [collectives]
        return None

    def summary(self) -> dict[str, Any]:
        return {}

    def finish(self) -> None:
        return None


NULL_TRACER = NullTracer()
_current: Tracer | NullTracer = NULL_TRACER


def current_tracer() -> Tracer | NullTracer:
    """The default tracer the module-level functions forward to."""
    return _current


def set_current(tracer: Tracer | NullTracer) -> None:
    global _current
    _current = tracer


def create(
    config: Config,
    *,
    model: Any = None,
    optimizer: Any = None,
    clock: Clock | None = None,
    sink: Sink | None = None,
) -> Tracer | NullTracer:
    """Build the tracer ``init()`` asks for, or a no-op one, never raising for runtime trouble.

    Bad arguments were already rejected by ``Config``; what can still go wrong here (an
    unwritable directory, a broken CUDA runtime) disables timing with one warning.
    """
    _check_targets(model, optimizer)
    if not config.enabled:
        return NULL_TRACER
    info = rank_info()
    if config.ranks is not None and info.rank not in config.ranks:
        return NULL_TRACER
    try:
        if sink is None:
            Path(config.out_dir).mkdir(parents=True, exist_ok=True)
        tracer = Tracer(
            config, model=model, optimizer=optimizer, clock=clock, sink=sink, rank=info
        )
        if sink is None and info.rank == (min(config.ranks) if config.ranks else 0):
            write_json_atomic(Path(config.out_dir) / "meta.json", _meta(tracer))
        return tracer
    except Exception as exc:  # protect the job: a bad runtime environment disables timing
        # protect the job: warnings configured as errors must not escape into it
        with contextlib.suppress(Exception):
            warnings.warn(
                f"stepscope: timing disabled, could not start: {exc!r}", StepscopeWarning, stacklevel=3
            )
        return NULL_TRACER


def _check_targets(model: Any, optimizer: Any) -> None:
    import torch

    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None; got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__name__}"
        )


def _meta(tracer: Tracer) -> dict[str, Any]:
    import platform

    import torch

    devices: list[str] = []
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "schema": SCHEMA_VERSION,
        "run_id": tracer.run_id,
        "created_unix_ns": time.time_ns(),
        "world_size": tracer.rank.world_size,
        "hostname": tracer.rank.hostname,
        "clock": tracer.clock.kind,
        "config": tracer.config.to_json(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "devices": devices,
        "python": platform.python_version(),
        "stepscope": _version(),
    }


def _version() -> str:
    from stepscope import __version__

    return __version__


def _default_run_id() -> str:
    for var in ("STEPSCOPE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(var):
            return os.environ[var]
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def _r(x: float) -> float:
    return round(x, 4)

