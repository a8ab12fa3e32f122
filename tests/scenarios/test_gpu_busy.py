"""stepscope on a busy simulated GPU: kernels cost GPU time, the host runs ahead.

Each test runs the public API on the GPU-bound simulator (``CudaSim(tflops=...)``: every op on
a simulated-device tensor is a kernel costed by its FLOPs) and checks a claim that only holds
when the GPU, not the host, is the bottleneck.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import stepscope
from stepscope.prefetch import PrefetchLoader
from stepscope.recording.config import AutoProfileConfig
from stepscope.recording.schema import read_run

KiB = 1 << 10
#: 2 FLOP/ns: one forward + weight-gradient backward of Linear(1024, 1024) on 64 rows is
#: 2 x 134 MFLOP, ~134 ms of GPU time.
TFLOPS = 2e-3
#: 2.5 MB/s: a 256 KiB batch (64 x 1024 float32) is ~105 ms of copy.
COPY_BYTES_PER_NS = 0.0025
BATCHES = 6


def _records(path: Any) -> list[dict[str, Any]]:
    return sorted(read_run(path), key=lambda r: r["step"])


def _train(sim: Any, loader: Any, model: nn.Module) -> None:
    for batch in loader:
        with stepscope.step():
            model(batch).sum().backward()
    sim.drain()  # the GPU finishes its queue (the simulator's, not a host sync)


def test_prefetch_hides_the_copy_under_compute_in_the_readme_loop(tmp_path, cuda_sim):
    sim = cuda_sim(tflops=TFLOPS, copy_bytes_per_ns=COPY_BYTES_PER_NS)
    model = nn.Linear(1024, 1024, bias=False).to("cuda")
    data = [torch.randn(64, 1024).pin_memory() for _ in range(BATCHES)]
    stepscope.init(out_dir=str(tmp_path), flush_every_n_steps=1, heartbeat_s=0)
    try:
        _train(sim, PrefetchLoader(data, "cuda"), model)
    finally:
        stepscope.finish()
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == list(range(BATCHES))
    copy_ms = 64 * 1024 * 4 / COPY_BYTES_PER_NS / 1e6
    compute_ms = 2 * 2 * 64 * 1024 * 1024 / TFLOPS / 1e9
    for r in recs[1:]:  # batch 0's copy has nothing to hide under
        # The copy span starts when the host queued it (the copy stream is idle): it is the
        # copy's cost plus however long the host took to issue it.
        assert r["side_ms"]["h2d_copy"] >= copy_ms * 0.99
        assert r["h2d_hidden_ms"] >= 0.95 * r["side_ms"]["h2d_copy"], r
        # The GPU does the compute, not compute + copy, per step.
        assert r["step_ms"] < compute_ms + 0.1 * copy_ms, r
    # No batch memory was reused while a kernel still read it (the fixture checks too).
    assert sim.reuse_errors == []


@pytest.mark.parametrize("set_device", [False, True])
@pytest.mark.parametrize("how", ["profile_steps", "auto_profile"])
def test_no_cuda_context_on_a_device_but_the_resolved_one(tmp_path, cuda_sim, monkeypatch,
                                                          how, set_device):
    import stepscope.listeners.autoprofile as autoprofile
    from stepscope.common.errors import StepscopeWarning

    sim = cuda_sim(devices=2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(autoprofile, "_warmed", False)  # the warm-up runs in this process
    if set_device:
        torch.cuda.set_device(1)
    # auto_profile: a capture triggered by one slow step (host time) after a short history.
    auto = AutoProfileConfig(window=8, min_history=6, patience=1, steps=2,
                                         warmup=1, compare_healthy=False)
    kw: dict[str, Any] = ({"profile_steps": (1, 3)} if how == "profile_steps" else
                          {"auto_profile": auto})
    with warnings.catch_warnings():
        # Without set_device: "cuda:1 (LOCAL_RANK) is not the current device", once a process.
        warnings.simplefilter("ignore", StepscopeWarning)
        stepscope.init(out_dir=str(tmp_path), flush_every_n_steps=1, heartbeat_s=0, **kw)
    try:
        for i in range(14):
            with stepscope.step():
                sim.kernel(1.0, torch.cuda.current_stream(1))
                time.sleep(0.3 if i == 8 else 0.01)
    finally:
        stepscope.finish()
    traces = list((tmp_path / "traces").rglob("*.json*"))
    assert traces, "no torch.profiler window was captured"
    assert set(sim.contexts) == {1}, sim.contexts
    assert len(_records(tmp_path)) == 14


def test_side_stream_work_inside_a_step_is_inside_step_ms(tmp_path, cuda_sim):
    sim = cuda_sim()
    side = torch.cuda.Stream()
    stepscope.init(out_dir=str(tmp_path), flush_every_n_steps=1, heartbeat_s=0)
    try:
        for _ in range(3):
            with stepscope.step():
                sim.kernel(1.0)
                with torch.cuda.stream(side), stepscope.phase("work"):
                    sim.kernel(30.0)
        sim.drain()
    finally:
        stepscope.finish()
    recs = _records(tmp_path)
    assert len(recs) == 3
    for r in recs:
        (work,) = [p for p in r["phases"] if p["name"] == "work"]
        assert work["ms"] >= 30.0
        # The step ends at its latest mark on any stream it used, without a wait added.
        assert r["step_ms"] >= work["end_ms"] >= 30.0, r
        assert r["residual_ms"] >= 0.0
    assert sim.syncs == 0, sim.sync_log


def test_no_event_query_while_another_thread_captures_in_global_mode(tmp_path, cuda_sim):
    import threading

    sim = cuda_sim()
    stepscope.init(out_dir=str(tmp_path), flush_every_n_steps=1, heartbeat_s=0)
    started, release, out = threading.Event(), threading.Event(), {}

    def capture() -> None:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):  # global mode, torch's default
                sim.kernel(2.0)
                started.set()
                release.wait(10)
            out["ended"] = "ok"
        except RuntimeError as exc:
            out["ended"] = str(exc)

    try:
        with stepscope.step():
            sim.kernel(1.0)
        t = threading.Thread(target=capture)
        t.start()
        assert started.wait(10)
        for _ in range(3):  # step exits while the other thread captures
            with stepscope.step():
                sim.kernel(1.0)
        release.set()
        t.join(10)
        for _ in range(2):
            with stepscope.step():
                sim.kernel(1.0)
        sim.drain()
    finally:
        release.set()
        stepscope.finish()
    assert out["ended"] == "ok"
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == list(range(6))  # resolved once the capture ended
    assert not any(r.get("dropped") for r in recs), [r["dropped"] for r in recs]


def test_a_mark_builds_no_stream_object_once_its_stream_is_known(cuda_sim, monkeypatch):
    from stepscope.recording.clock import CudaClock

    cuda_sim()
    built = []
    real = torch.cuda.current_stream

    def counting(device: Any = None) -> Any:
        built.append(device)
        return real(device)

    monkeypatch.setattr(torch.cuda, "current_stream", counting)
    clock = CudaClock()
    side = torch.cuda.Stream()
    marks = [clock.mark() for _ in range(50)]
    with torch.cuda.stream(side):
        marks += [clock.mark() for _ in range(50)]
    marks.append(clock.mark())
    assert len(built) == 2  # one Stream object per stream, not one per mark
    assert [m.stream for m in marks[:50]] == [real(0)] * 50
    assert [m.stream for m in marks[50:100]] == [side] * 50
    assert marks[-1].stream == real(0)


def test_a_prefetched_batch_is_ready_on_the_stream_it_is_read_from(tmp_path, cuda_sim):
    sim = cuda_sim(tflops=TFLOPS, copy_bytes_per_ns=COPY_BYTES_PER_NS)
    model = nn.Linear(1024, 1024, bias=False).to("cuda")
    data = [torch.randn(64, 1024).pin_memory() for _ in range(BATCHES)]
    side = torch.cuda.Stream()
    stepscope.init(out_dir=str(tmp_path), flush_every_n_steps=1, heartbeat_s=0)
    try:
        with torch.cuda.stream(side):  # the batches are handed over on the stream reading them
            _train(sim, PrefetchLoader(data, "cuda"), model)
    finally:
        stepscope.finish()
    assert len(_records(tmp_path)) == BATCHES
    # Each kernel read its batch after the copy ended, and before any reuse (the simulator
    # raises otherwise; the fixture checks what stepscope might have swallowed).
    assert sim.reuse_errors == []
    assert sim.kernels > 0


@pytest.mark.parametrize("every_n_steps", [1, 2])
def test_a_batch_is_ready_on_a_side_stream_a_timed_phase_reads_it_on(tmp_path, cuda_sim,
                                                                   every_n_steps):
    # Batches are handed over on the default stream; each step reads its batch on a side
    # stream inside a timed phase. The phase's opening makes the side stream wait for the
    # copy; once seen, every later batch (unsampled steps too) is made ready there at
    # hand-over, and stays alive until the side stream has passed its last use.
    sim = cuda_sim(tflops=TFLOPS, copy_bytes_per_ns=COPY_BYTES_PER_NS)
    model = nn.Linear(1024, 1024, bias=False).to("cuda")
    data = [torch.randn(64, 1024).pin_memory() for _ in range(BATCHES)]
    side = torch.cuda.Stream()
    stepscope.init(out_dir=str(tmp_path), flush_every_n_steps=1, heartbeat_s=0,
                   every_n_steps=every_n_steps)
    try:
        for batch in PrefetchLoader(data, "cuda"):
            with stepscope.step():
                with torch.cuda.stream(side), stepscope.phase("work"):
                    model(batch).sum().backward()
                torch.cuda.current_stream().wait_stream(side)
        sim.drain()
    finally:
        stepscope.finish()
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == list(range(0, BATCHES, every_n_steps))
    # Every read came after its copy and before any reuse (the simulator raises otherwise).
    assert sim.reuse_errors == []
    copy_ms = 64 * 1024 * 4 / COPY_BYTES_PER_NS / 1e6
    for r in recs[1:]:
        (work,) = [p for p in r["phases"] if p["name"] == "work"]
        assert work["ms"] > 0.0
        assert r["side_ms"]["h2d_copy"] >= copy_ms * 0.99
