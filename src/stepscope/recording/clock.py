"""Clocks behind phase timing: CUDA events read only once complete, or ``perf_counter_ns``.

Both clocks share one interface. ``mark()`` takes a timestamp handle in the hot path;
``ready(mark)`` says, without blocking, whether it can be read; ``elapsed_ms(a, b)`` reads
two ready marks; ``release(mark)`` returns pooled resources. ``same_device(a, b)`` says
whether two marks can be compared at all.

CUDA specifics, each the fix for a failure seen on real clusters:

- **One event pool per device.** A pooled event that was recorded on GPU 0 raises when
  recorded again on GPU 1 (one process driving several GPUs, pipeline stages,
  ``device_map="auto"``). Each mark remembers its device; marks are only compared with
  marks of the same device.
- **Device label at the first mark**, not at construction: ``init()`` often runs before
  ``torch.cuda.set_device``.
- **No CUDA call off the training thread.** The resolver queries events on the training
  thread at step exit (see :mod:`stepscope.recording.resolver`); a background thread would create a
  context on GPU 0 and break CUDA-graph capture.
- **Wall-clock anchor.** :class:`GpuAnchor` turns "ms after the step's start event" into
  wall-clock time on the GPU's own timeline, so ranks are placed on one timeline without
  shifting each by its host-ahead-of-GPU lag.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol


class Clock(Protocol):
    kind: str
    device: str
    #: False when marks hold nothing to give back (``release`` is a no-op) and all compare.
    pooled: bool
    #: True when a mark is a ``time.perf_counter_ns()`` value: reading a time is plain
    #: arithmetic (no device call), any thread may do it.
    host_readable: bool

    def mark(self) -> Any: ...

    def ready(self, mark: Any) -> bool: ...

    def same_device(self, a: Any, b: Any) -> bool: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...

    def release(self, mark: Any) -> None: ...

    def foreign(self, mark: Any) -> Any: ...

    def checkpoints(self, marks: Iterable[Any]) -> list[Any]: ...


class CpuClock:
    """Monotonic wall clock (``time.perf_counter_ns``); marks are ints, always ready."""

    kind = "cpu"
    device = "cpu"
    pooled = False
    host_readable = True

    #: The C function itself: a mark is taken several times per step on the training thread,
    #: and a Python method around it would add a frame to each.
    mark = staticmethod(time.perf_counter_ns)

    #: Always true: a mark is a ``perf_counter_ns`` value, never 0. ``bool`` itself, so the
    #: resolver's readiness check at each step exit runs no Python frame (nor does
    #: :meth:`checkpoints`).
    ready = staticmethod(bool)

    def same_device(self, a: Any, b: Any) -> bool:
        return True

    def elapsed_ms(self, start: int, end: int) -> float:
        return (end - start) / 1e6

    def release(self, mark: Any) -> None:
        pass

    def foreign(self, mark: Any) -> Any:
        return mark

    #: Every mark given: host-clock marks are always ready, so any one of them stands for
    #: the step's, and the resolver passes one (the step's start): it asks once per step, as
    #: it asks once per stream on a GPU.
    checkpoints: staticmethod[[Iterable[Any]], list[Any]] = staticmethod(list)


class CudaMark:
    """A CUDA event, the device index and stream it was recorded on, its order of recording
    (``seq``), and ``pooled`` if the clock owns it.

    ``stream`` is ``None`` when unknown (an event recorded by someone else, fake clocks in
    tests): such a mark is checked on its own, never assumed complete because of another.
    """

    __slots__ = ("device", "event", "pooled", "seq", "stream")

    def __init__(self, event: Any, device: int, pooled: bool = True, stream: Any = None) -> None:
        self.event = event
        self.device = device
        self.pooled = pooled
        self.stream = stream
        self.seq = 0


class CudaClock:
    """CUDA events recorded on the current stream of the training device, pooled per device.

    ``mark()`` records an event and returns it; nothing here waits for the GPU. Callers check
    ``ready()`` (``Event.query()``) before ``elapsed_ms()``, so reading a time never blocks
    the host. Each mark remembers its stream and its order of recording, so a caller can ask
    only the latest mark of each stream (a stream completes in order).

    ``device``: record on that device's current stream (and pool for it) instead of the
    current device's. ``event_factory``, ``current_device`` and ``current_stream`` exist so
    tests can drive the logic with fake events on CPU; with a fake ``event_factory`` and no
    ``current_stream`` the stream of a mark is unknown and each mark is checked on its own.
    """

    kind = "cuda"
    pooled = True
    host_readable = False

    def __init__(
        self,
        event_factory: Callable[[], Any] | None = None,
        pool_size: int = 4096,
        current_device: Callable[[], int] | None = None,
        current_stream: Callable[[int], Any] | None = None,
        *,
        device: int | None = None,
    ) -> None:
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise ValueError(f"device must be a non-negative CUDA device index or None; got {device!r}")
        real = event_factory is None
        if event_factory is None or current_device is None or (real and current_stream is None):
            import torch

            if event_factory is None:

                def event_factory() -> Any:
                    return torch.cuda.Event(enable_timing=True)

            if current_device is None:
                current_device = torch.cuda.current_device
            if real and current_stream is None:
                current_stream = cached_current_stream()
        self._new = event_factory
        self._current_device = current_device
        self._current_stream = current_stream
        self._fixed = device
        self._pools: dict[int, list[CudaMark]] = {}
        self._pool_size = pool_size
        self._seq = 0
        #: ``"cuda:N"`` of the first mark (the training device); "cuda" before any mark.
        self.device = "cuda" if device is None else f"cuda:{device}"
        self.device_index: int | None = device

    def mark(self) -> CudaMark:
        dev = self._fixed
        if dev is None:
            dev = self._current_device()
        pool = self._pools.get(dev)
        if pool:
            m = pool.pop()
        else:
            if self.device_index is None:
                self.device_index = dev
                self.device = f"cuda:{dev}"
            m = CudaMark(self._new(), dev)
        stream_of = self._current_stream
        if stream_of is None:
            m.event.record()
        else:
            s = m.stream = stream_of(dev)
            m.event.record(s)
        self._seq = m.seq = self._seq + 1
        return m

    def ready(self, mark: CudaMark) -> bool:
        return bool(mark.event.query())

    def checkpoints(self, marks: Iterable[CudaMark]) -> list[CudaMark]:
        """The marks whose completion implies all of ``marks``': the latest one recorded on
        each stream (a stream runs in order), and every mark whose stream is unknown."""
        out: list[CudaMark] = []
        last: dict[Any, CudaMark] = {}
        for m in marks:
            s = m.stream
            if s is None:
                out.append(m)
                continue
            key = (m.device, s)
            cur = last.get(key)
            if cur is None or m.seq > cur.seq:
                last[key] = m
        out.extend(last.values())
        return out

    def same_device(self, a: CudaMark, b: CudaMark) -> bool:
        return a.device == b.device

    def elapsed_ms(self, start: CudaMark, end: CudaMark) -> float:
        # Only called after ready() is True on both, so elapsed_time does not wait on the GPU.
        return float(start.event.elapsed_time(end.event))

    def release(self, mark: CudaMark) -> None:
        if not mark.pooled:
            return  # someone else's event (e.g. PrefetchLoader's copy events): never reused here
        pool = self._pools.setdefault(mark.device, [])
        if len(pool) < self._pool_size:
            pool.append(mark)

    def foreign(self, event: Any) -> CudaMark:
        """Wrap an event recorded by someone else (on the training device) as a mark; its
        stream is unknown, so it is checked on its own."""
        dev = self._fixed
        return CudaMark(event, self._current_device() if dev is None else dev, pooled=False)


#: Streams remembered by :func:`cached_current_stream` before the memory is cleared (a job
#: that makes a new stream per epoch must not grow it without bound).
STREAM_CACHE_SIZE = 256


def cached_current_stream() -> Callable[[int], Any]:
    """``current_stream(device)`` for the hot path: one C call per mark.

    ``torch.cuda.current_stream`` builds a new Python ``Stream`` on every call (a device-index
    parse, a C call returning the stream's fields, an object). The raw handle of the current
    stream (``torch._C._cuda_getCurrentRawStream``, one C call) names the stream as well, so
    the ``Stream`` object is built once per stream and reused; a ``torch.cuda.stream(s)``
    block or ``set_stream`` changes the handle, and so the stream a mark is recorded on.
    Falls back to ``torch.cuda.current_stream`` where torch has no such call.
    """
    import torch

    current = torch.cuda.current_stream
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return current
    known: dict[tuple[int, int], Any] = {}

    def current_stream(device: int) -> Any:
        key = (device, raw(device))
        s = known.get(key)
        if s is None:
            if len(known) >= STREAM_CACHE_SIZE:
                known.clear()
            s = known[key] = current(device)
        return s

    return current_stream


class GpuAnchor:
    """Places GPU marks on the wall clock without ever waiting for the GPU.

    Every step start is a CUDA event recorded at a known host time ``host_ns``. The GPU runs
    that event at ``host_ns`` or later (the GPU lags the host, never leads it), so
    ``host_ns - gpu_offset(event)`` is a lower bound of the GPU-to-wall offset. The tightest
    bound over recent steps (their maximum) is exact whenever the GPU caught up with the host
    at one of them (any ``.item()``, any data wait), and it tracks drift because old steps
    leave the window. Offsets are measured from a base event that is moved forward every
    ``rebase_ms`` so that float32 ``elapsed_time`` keeps microsecond precision on long runs.

    All methods are called by the resolver on the training thread, with ready marks only.
    """

    def __init__(self, clock: CudaClock, window: int = 512, rebase_ms: float = 60_000.0) -> None:
        self._clock = clock
        self._window = window
        self._rebase_ms = rebase_ms
        self._base: CudaMark | None = None
        self._base_wall_ns = 0  # provisional wall time of the base event
        self._seen = 0
        # Sliding maximum of (host_ns - provisional wall ns) over the last ``window`` steps.
        self._lags: deque[tuple[int, float]] = deque()

    def wall_ns(self, start: CudaMark, host_ns: int) -> int | None:
        """Wall-clock ns at which the GPU ran ``start``, recorded when the host was at ``host_ns``.

        ``None`` for a mark on another device than the anchor's (the record then has the host
        entry time only).
        """
        clock = self._clock
        if self._base is None:
            self._base, self._base_wall_ns = start, host_ns
        elif not clock.same_device(self._base, start):
            return None
        g = clock.elapsed_ms(self._base, start)
        provisional = self._base_wall_ns + g * 1e6
        i = self._seen
        self._seen += 1
        lag = host_ns - provisional
        lags = self._lags
        while lags and lags[-1][1] <= lag:
            lags.pop()
        lags.append((i, lag))
        while lags[0][0] <= i - self._window:
            lags.popleft()
        wall = int(provisional + max(0.0, lags[0][1]))
        if g >= self._rebase_ms:
            # Move the base forward. Provisional times keep their meaning (the new base's
            # provisional time is the old base's plus g), so the recorded lags stay valid.
            old, self._base, self._base_wall_ns = self._base, start, int(provisional)
            clock.release(old)
        return wall

    def owns(self, mark: CudaMark) -> bool:
        """True when ``mark`` is the base event, which the resolver must not release."""
        return mark is self._base


def default_clock(device: int | None = None) -> CpuClock | CudaClock:
    """CUDA events (on ``device``'s current stream when given) when CUDA is available,
    else the CPU clock."""
    import torch

    if torch.cuda.is_available():
        return CudaClock(device=device)
    return CpuClock()
