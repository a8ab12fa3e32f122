"""Clocks behind phase timing: CUDA events resolved later with ``query()``, or perf_counter.

Both clocks share one interface: ``mark()`` takes a timestamp handle in the hot path,
``ready(mark)`` says (without blocking) whether it can be read, ``elapsed_ms(a, b)`` reads
it, ``release(mark)`` returns pooled resources.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


class Clock(Protocol):
    kind: str
    device: str

    def mark(self) -> Any: ...

    def ready(self, mark: Any) -> bool: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...

    def release(self, mark: Any) -> None: ...


class CpuClock:
    """Monotonic wall clock (``time.perf_counter_ns``); marks are ints, always ready."""

    kind = "cpu"
    device = "cpu"

    def mark(self) -> int:
        return time.perf_counter_ns()

    def ready(self, mark: Any) -> bool:
        return True

    def elapsed_ms(self, start: int, end: int) -> float:
        return (end - start) / 1e6

    def release(self, mark: Any) -> None:
        pass


class CudaClock:
    """CUDA events recorded on the current stream, pooled and reused.

    ``mark()`` records an event and returns it; nothing here waits for the GPU. The tracer
    calls ``ready()`` (``Event.query()``) before ``elapsed_ms()`` so that reading a time never
    blocks the host.

    ``event_factory`` exists so tests can drive the logic with fake events on CPU.
    """

    kind = "cuda"

    def __init__(self, event_factory: Any = None, pool_size: int = 4096, device: str = "cuda") -> None:
        self.device = device
        if event_factory is None:
            import torch

            self.device = f"cuda:{torch.cuda.current_device()}"

            def event_factory() -> Any:
                return torch.cuda.Event(enable_timing=True)

        self._new = event_factory
        self._pool: list[Any] = []
        self._pool_size = pool_size

    def mark(self) -> Any:
        ev = self._pool.pop() if self._pool else self._new()
        ev.record()
        return ev

    def ready(self, mark: Any) -> bool:
        return bool(mark.query())

    def elapsed_ms(self, start: Any, end: Any) -> float:
        # Only called after ready(end) is True, so elapsed_time does not wait on the GPU.
        return float(start.elapsed_time(end))

    def release(self, mark: Any) -> None:
        if len(self._pool) < self._pool_size:
            self._pool.append(mark)


def default_clock() -> CpuClock | CudaClock:
    """CUDA events when CUDA is available, else the CPU clock."""
    import torch

    if torch.cuda.is_available():
        return CudaClock()
    return CpuClock()
