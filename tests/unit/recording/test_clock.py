"""CUDA-event logic driven by fake events on CPU: deferred query, no sync, bounded pending."""

from __future__ import annotations

import time

import pytest
import torch

from stepscope.recording.clock import CpuClock, CudaClock


class FakeGpu:
    """A GPU timeline the test advances by hand; events complete when it passes them."""

    def __init__(self) -> None:
        self.now = 0.0  # ms of GPU work enqueued so far
        self.done = 0.0  # ms of GPU work completed
        self.stuck = False
        self.queries = 0
        self.created = 0

    def work(self, ms: float) -> None:
        self.now += ms

    def complete(self) -> None:
        if not self.stuck:
            self.done = self.now


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.t: float | None = None
        gpu.created += 1

    def record(self) -> None:
        self.t = self.gpu.now

    def query(self) -> bool:
        self.gpu.queries += 1
        return self.t is not None and self.t <= self.gpu.done

    def elapsed_time(self, other: FakeEvent) -> float:
        # A real elapsed_time on an unfinished event would block the host.
        assert self.query() and other.query(), "elapsed_time read before query() said done"
        return other.t - self.t

    def synchronize(self) -> None:
        raise AssertionError("Event.synchronize called")


@pytest.fixture
def no_sync(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("host synchronisation in the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", boom, raising=False)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", boom, raising=False)


def test_cuda_clock_defers_reads_until_events_complete(mem_tracer, no_sync):
    gpu = FakeGpu()
    tr = mem_tracer(auto=False, clock=fake_clock(gpu), flush_every_n_steps=2)
    for _ in range(4):
        with tr.step():
            with tr.phase("forward"):
                gpu.work(3.0)
            with tr.phase("backward"):
                gpu.work(5.0)
            gpu.work(1.0)
    # Nothing completed on the "GPU" yet: flushes found nothing ready and did not wait.
    assert tr.sink.records == [] and len(tr.resolver.pending) == 4
    gpu.complete()
    tr.finish()
    recs = tr.sink.records
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    for r in recs:
        ph = {p["name"]: p for p in r["phases"]}
        assert r["clock"] == "cuda"
        assert ph["forward"]["ms"] == 3.0 and ph["backward"]["ms"] == 5.0
        assert ph["backward"]["start_ms"] == 3.0 and r["step_ms"] == 9.0
        assert r["residual_ms"] == 1.0


def test_events_are_pooled_and_reused(mem_tracer, no_sync):
    gpu = FakeGpu()
    tr = mem_tracer(auto=False, clock=fake_clock(gpu), flush_every_n_steps=1)
    for _ in range(50):
        with tr.step(), tr.phase("forward"):
            gpu.work(1.0)
        gpu.complete()
        time.sleep(0.002)  # a step's worth of time for the resolver thread
    tr.finish()
    assert len(tr.sink.records) == 50
    assert gpu.created <= 16, f"events are not reused: {gpu.created} created for 50 steps"


def test_stuck_event_never_stalls_and_drops_are_counted(mem_tracer, no_sync):
    gpu = FakeGpu()
    gpu.stuck = True
    tr = mem_tracer(
        auto=False, clock=fake_clock(gpu), max_pending_steps=8, flush_every_n_steps=1
    )
    for _ in range(20):
        with tr.step(), tr.phase("forward"):
            gpu.work(1.0)
    assert len(tr.resolver.pending) == 8, "the pending queue is bounded"
    assert tr.resolver.dropped["pending_overflow"] == 12
    import stepscope.recording.session as tmod

    old = tmod.FINISH_TIMEOUT_S
    tmod.FINISH_TIMEOUT_S = 0.05
    try:
        tr.finish()
    finally:
        tmod.FINISH_TIMEOUT_S = old
    assert tr.resolver.dropped["unresolved_at_finish"] == 8
    assert tr.sink.records == []


def test_drop_counts_are_reported_in_the_next_record(mem_tracer):
    gpu = FakeGpu()
    tr = mem_tracer(auto=False, clock=fake_clock(gpu), max_pending_steps=2)
    for _ in range(5):
        with tr.step():
            gpu.work(1.0)
    gpu.complete()
    with tr.step():
        gpu.work(1.0)
    gpu.complete()
    tr.finish()
    recs = tr.sink.records
    assert [r["step"] for r in recs] == [4, 5]
    assert recs[0]["dropped"] == {"pending_overflow": 4} and recs[1]["dropped"] == {}


def test_cpu_clock_is_monotonic_ms():
    c = CpuClock()
    a = c.mark()
    b = c.mark()
    assert c.ready(a) and c.elapsed_ms(a, b) >= 0


def fake_clock(gpu: FakeGpu) -> CudaClock:
    return CudaClock(lambda: FakeEvent(gpu), current_device=lambda: 0)
