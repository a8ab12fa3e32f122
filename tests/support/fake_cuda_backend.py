"""A stand-in for ``torch.cuda`` that logs every stream, event and copy call: tensors stay on
the CPU and "device" copies are clones, so the PrefetchLoader's stream protocol can be checked
on any machine."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from stepscope.instrument import h2d


class FakeEvent:
    def __init__(
        self, n: int, timing: bool, log: list[tuple[Any, ...]], gpu: FakeBackend | None = None
    ) -> None:
        self.n, self.timing, self.log, self.gpu = n, timing, log, gpu
        self.done = False
        self.stream: FakeStream | None = None
        self.t = 0.0

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream
        if self.gpu is not None:
            self.t, self.done = self.gpu.now, self.gpu.instant
        self.log.append(("record", self.n, stream.name if stream else "current"))

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done and end.done, "elapsed_time before the events completed"
        return end.t - self.t

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(("sync", self.n))
        self.done = True


class FakeStream:
    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.n))


class FakeBackend:
    """Stands in for torch.cuda: tensors stay on the CPU, 'device' copies are clones."""

    def __init__(self, available: bool = True, count: int = 2, current: int = 0) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.available, self.count, self.current = available, count, current
        self.consumer = FakeStream("consumer", self.log)
        self.streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.active: FakeStream | None = None
        self.devices_entered: list[torch.device] = []
        self._on_device: dict[int, weakref.ref[torch.Tensor]] = {}
        self._pinned: dict[int, weakref.ref[torch.Tensor]] = {}
        self.pins: list[weakref.ref[torch.Tensor]] = []
        self.fail_pin_at: int | None = None
        self.now = 0.0  # ms on a fake GPU timeline; copies take copy_ms
        self.copy_ms = 0.0
        self.instant = False  # events complete as soon as they are recorded
        self.auto_h2d_active: list[object] = []

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    @contextlib.contextmanager
    def device(self, device: torch.device) -> Iterator[None]:
        self.devices_entered.append(device)
        yield

    def new_stream(self, device: torch.device) -> FakeStream:
        s = FakeStream(f"copy{len(self.streams)}", self.log)
        self.streams.append(s)
        return s

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.consumer

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        prev, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = prev

    def new_event(self, enable_timing: bool) -> FakeEvent:
        e = FakeEvent(len(self.events), enable_timing, self.log, self)
        self.events.append(e)
        return e

    @staticmethod
    def _has(table: dict[int, weakref.ref[torch.Tensor]], t: torch.Tensor) -> bool:
        ref = table.get(id(t))
        return ref is not None and ref() is t

    def is_on(self, t: torch.Tensor, device: torch.device) -> bool:
        return self._has(self._on_device, t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self._has(self._pinned, t)

    def mark_pinned(self, t: torch.Tensor) -> torch.Tensor:
        self._pinned[id(t)] = weakref.ref(t)
        return t

    def mark_on_device(self, t: torch.Tensor) -> torch.Tensor:
        self._on_device[id(t)] = weakref.ref(t)
        return t

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        if self.fail_pin_at is not None and len(self.pins) == self.fail_pin_at:
            raise RuntimeError("pinned allocation failed")
        p = self.mark_pinned(t.clone())
        self.pins.append(weakref.ref(p))
        self.log.append(("pin",))
        return p

    def copy(self, t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
        # Every copy must be queued on the loader's copy stream, never the consumer's.
        assert self.active is not None and self.active is not self.consumer
        self.log.append(("copy", self.active.name, tuple(t.shape), non_blocking))
        self.auto_h2d_active.append(h2d._active())
        self.now += self.copy_ms
        return self.mark_on_device(t.clone())


class FakeTracer:
    def __init__(self, log: list[tuple[Any, ...]], recording: bool = True, enabled: bool = True) -> None:
        self.log, self.recording, self.enabled = log, recording, enabled

    def open_phase(self, name: str) -> str:
        self.log.append(("open", name))
        return name

    def close_phase(self, token: str) -> None:
        self.log.append(("close", token))

    def add_side_span(self, name: str, start: FakeEvent, end: FakeEvent) -> None:
        self.log.append(("side", name, start.n, end.n))

    def add_counter(self, name: str, value: float) -> None:
        self.log.append(("counter", name, value))
