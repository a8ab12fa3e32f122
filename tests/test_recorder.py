"""The recording core (issue 18 §1, §3.1/2/3/5/9/10a; issue 21 item 8), driven on CPU.

A small lagging GPU stands in for CUDA here: events complete when the simulated device,
running ``lag`` steps behind the host, reaches them; each knows the stream it was recorded
on; ``elapsed_time`` on an unfinished event raises, as CUDA does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from stepscope.clock import CpuClock, CudaClock


class LagGpu:
    """A device that runs ``lag`` steps behind the host, in order per stream."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.now = 0.0  # ms of work enqueued
        self.history: list[float] = []  # ``now`` at each step end
        self.done = 0.0
        self.queries = 0
        self.syncs = 0
        self.broken: set[int] = set()  # ids of events whose query raises

    def work(self, ms: float) -> None:
        self.now += ms

    def end_step(self) -> None:
        self.history.append(self.now)
        if len(self.history) > self.lag:
            self.done = self.history[-1 - self.lag]

    def catch_up(self) -> None:
        self.done = self.now


class LagEvent:
    def __init__(self, gpu: LagGpu) -> None:
        self.gpu = gpu
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = self.gpu.now

    def query(self) -> bool:
        gpu = self.gpu
        gpu.queries += 1
        if id(self) in gpu.broken:
            raise RuntimeError("cudaErrorLaunchFailure")
        return self.t is not None and self.t <= gpu.done

    def done(self) -> bool:
        return self.t is not None and self.t <= self.gpu.done

    def elapsed_time(self, other: LagEvent) -> float:
        if not (self.done() and other.done()):
            raise RuntimeError("cudaErrorNotReady")
        assert self.t is not None and other.t is not None
        return other.t - self.t

    def synchronize(self) -> None:
        self.gpu.syncs += 1
        self.gpu.catch_up()


def lag_clock(gpu: LagGpu, streams: bool = True) -> CudaClock:
    if not streams:
        return CudaClock(lambda: LagEvent(gpu), current_device=lambda: 0)
    return CudaClock(lambda: LagEvent(gpu), current_device=lambda: 0, current_stream=lambda dev: "default")


def _many_marks(tr: Any, gpu: LagGpu, steps: int, phases: int) -> None:
    for _ in range(steps):
        with tr.step():
            for i in range(phases):
                with tr.phase(f"p{i % 7}"):
                    gpu.work(0.5)
        gpu.end_step()


def _wait_for(pred: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


# ------------------------------------------------------------- §3.1 records lost


@pytest.mark.parametrize("streams", [True, False], ids=["stream-known", "stream-unknown"])
def test_steps_with_17_marks_resolve_during_the_run(mem_tracer, streams):
    """Main: the per-poll budget of 16 queries restarted at each step's first mark, so a
    step with 17+ marks never resolved before finish() (and only the last 256 reached it)."""
    gpu = LagGpu(lag=2)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu, streams), flush_every_n_steps=1)
    _many_marks(tr, gpu, steps=30, phases=8)  # 2 + 2*8 = 18 marks per step
    assert len(tr.resolver.pending) <= gpu.lag + 1, "steps stay pending far behind the GPU"
    assert _wait_for(lambda: len(tr.sink.records) >= 30 - gpu.lag - 1)
    assert len(tr.recent_records()) >= 30 - gpu.lag - 1, "summary()/live line see nothing"
    gpu.catch_up()
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == list(range(30))


def test_300_marks_per_step_gpu_100_steps_behind_nothing_lost_no_sync(mem_tracer):
    gpu = LagGpu(lag=100)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu), flush_every_n_steps=1, max_pending_steps=256)
    n = 400
    _many_marks(tr, gpu, steps=n, phases=150)  # 302 marks per step
    assert gpu.syncs == 0
    assert len(tr.resolver.pending) <= gpu.lag + 1
    assert _wait_for(lambda: len(tr.sink.records) >= n - gpu.lag - 1), len(tr.sink.records)
    # One stream: one query per pending step checked, not one per mark.
    assert gpu.queries < 20 * n, f"{gpu.queries} queries for {n} steps"
    gpu.catch_up()
    tr.finish()
    steps = [r["step"] for r in tr.sink.records]
    assert steps == list(range(n)), "records lost or doubled"
    assert all(r["dropped"] == {} for r in tr.sink.records)
    assert gpu.syncs == 0


def test_a_backlog_drains(mem_tracer):
    """The GPU stalls for 200 steps, then catches up: more than one step resolves per exit."""
    gpu = LagGpu(lag=10_000)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu), flush_every_n_steps=1, max_pending_steps=256)
    _many_marks(tr, gpu, steps=200, phases=3)
    assert len(tr.resolver.pending) == 200
    gpu.lag = 0
    _many_marks(tr, gpu, steps=40, phases=3)
    assert len(tr.resolver.pending) <= 1, "the backlog never drained"
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == list(range(240))


def test_cpu_clock_takes_the_same_pending_path(mem_tracer):
    """§1: no CPU shortcut around the resolver: a CPU step is pending, then checked."""
    asked: list[int] = []

    class SpyClock(CpuClock):
        def checkpoints(self, marks):  # type: ignore[no-untyped-def]
            out = super().checkpoints(marks)
            asked.append(len(out))
            return out

    tr = mem_tracer(auto=False, clock=SpyClock(), flush_every_n_steps=1)
    for _ in range(5):
        with tr.step(), tr.phase("a"):
            pass
    assert asked == [1] * 5, "CPU steps must go through the readiness check, one per step"
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == list(range(5))


# ------------------------------------------------- §3.10a one bad query ≠ timing off


def test_one_event_query_error_drops_that_step_only(mem_tracer):
    gpu = LagGpu(lag=0)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu), flush_every_n_steps=1)
    with tr.step(), tr.phase("a"):
        gpu.work(1.0)
    gpu.end_step()
    (step0,) = tr.resolver.pending
    gpu.broken.add(id(step0.end.event))  # the step's last mark on its stream is queried
    for _ in range(5):
        with tr.step(), tr.phase("a"):
            gpu.work(1.0)
        gpu.end_step()
        gpu.broken.clear()
    tr.finish()
    assert tr.enabled, "one query error switched timing off for the run"
    recs = tr.sink.records
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[0]["dropped"] == {"unreadable": 1}


# ------------------------------------------------------------------ CudaClock(device=)


def test_cuda_clock_records_on_the_given_devices_stream():
    seen: list[tuple[int, Any]] = []

    class Ev:
        def record(self, stream: Any = None) -> None:
            seen.append(stream)

    clk = CudaClock(lambda: Ev(), current_device=lambda: 0, current_stream=lambda d: ("s", d), device=3)
    m = clk.mark()
    assert m.device == 3 and m.stream == ("s", 3) and seen == [("s", 3)]
    assert clk.device == "cuda:3"
    m2 = clk.mark()
    assert m2.seq > m.seq
    assert clk.checkpoints([m, m2]) == [m2]
    with pytest.raises(ValueError, match="device"):
        CudaClock(lambda: Ev(), current_device=lambda: 0, device=-1)


def test_default_clock_accepts_a_device():
    from stepscope.clock import default_clock

    clk = default_clock(device=0)
    assert clk.kind == ("cuda" if torch.cuda.is_available() else "cpu")


_ = threading  # used by later tests
