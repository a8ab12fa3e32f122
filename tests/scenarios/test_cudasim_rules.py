"""The GPU-bound rules of the simulated CUDA runtime (``tests/support/cudasim.py``), one test each.

Each test drives the simulator through the public ``torch.cuda`` API, as stepscope does, and
checks one rule against the CUDA / PyTorch behaviour it models. GPU times are read from
events after :meth:`CudaSim.drain`, which completes the queued work without a host sleep, so
the figures are the simulated GPU timeline's and do not depend on the load of the machine.
"""

from __future__ import annotations

import threading

import pytest
import torch
from cudasim import UseAfterReuse
from torch import nn

MiB = 1 << 20


def _ev() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _ms(a: torch.cuda.Event, b: torch.cuda.Event) -> float:
    return a.elapsed_time(b)


def _gate(sim, *streams: torch.cuda.Stream) -> None:
    """Hold the GPU behind 5 s of work, so everything the test enqueues next is queued before
    the GPU reaches it: its spans are then the work's costs, however slow the host is."""
    sim.kernel(5000.0)
    g = _ev()
    for s in streams:
        s.wait_event(g)


def test_streams_are_in_order_queues_and_engines_run_concurrently(cuda_sim):
    sim = cuda_sim()
    compute = torch.cuda.current_stream()
    copy = torch.cuda.Stream()
    host = torch.empty(25 * MiB // 4).pin_memory()
    _gate(sim, copy)
    t0 = _ev()
    sim.kernel(50.0)  # compute engine
    k_end = _ev()
    with torch.cuda.stream(copy):
        c0 = _ev()
        x = host.to("cuda", non_blocking=True)  # ~1 ms
        sim.kernel(30.0)  # more work on the copy stream, in order after the copy
        c_end = _ev()
        copy.wait_event(k_end)  # joined by an event: starts after the compute kernel
        sim.kernel(10.0)
        j_end = _ev()
    sim.drain()
    assert x.is_cuda
    assert _ms(t0, k_end) == pytest.approx(50.0, abs=1.0)
    assert _ms(c0, c_end) == pytest.approx(31.0, abs=1.5)  # copy then kernel: in order
    # The two streams overlapped: both ended long before the sum of their work.
    assert _ms(t0, c_end) < 50.0 + 31.0 - 20.0
    assert _ms(k_end, j_end) == pytest.approx(10.0, abs=1.0)  # waited for the event
    assert compute != copy


def test_an_item_starts_no_earlier_than_the_host_enqueued_it(cuda_sim):
    import time

    sim = cuda_sim()
    a = _ev()
    time.sleep(0.05)  # the GPU is idle meanwhile: the next item cannot start before it exists
    sim.kernel(1.0)
    b = _ev()
    sim.drain()
    assert _ms(a, b) >= 1.0 + 40.0


def test_ops_on_device_tensors_cost_gpu_time_and_the_host_runs_ahead(cuda_sim):
    import time

    # 1e-3 TFLOPS = 1 FLOP/ns: a 1024x1024 by 1024x256 matmul is ~0.54 s of GPU time.
    sim = cuda_sim(tflops=1e-3)
    model = nn.Linear(1024, 1024, bias=False).to("cuda")
    x = torch.randn(256, 1024).to("cuda")
    sim.drain()
    sim.reset_counts()  # the two pageable copies above block, as they should
    start = _ev()
    host0 = time.perf_counter()
    y = model(x)
    y.sum().backward()
    end = _ev()
    host_s = time.perf_counter() - host0
    assert y.is_cuda and model.weight.grad is not None and model.weight.grad.is_cuda
    assert sim.kernels >= 4  # matmul, sum, and the backward's kernels on the device thread
    done_early = end.query()
    sim.drain()
    gpu_ms = _ms(start, end)
    flops = 2 * 2 * 256 * 1024 * 1024  # forward + the weight-gradient matmul (x needs none)
    assert gpu_ms >= flops / 1e6 * 0.99
    if host_s < gpu_ms / 1e3 / 2:  # the host issued it in less than half the GPU time
        assert not done_early  # so the GPU was still behind when the host finished
    assert sim.syncs == 0, sim.sync_log


def test_a_full_launch_queue_blocks_the_host(cuda_sim):
    sim = cuda_sim(tflops=1e-3, launch_queue=8)
    w = torch.randn(512, 512).to("cuda")
    sim.reset_counts()  # that copy from pageable memory blocks, as it should
    for _ in range(20):
        w = w @ w * 0.0  # each ~0.27 s of GPU time: the host is far ahead at once
    assert sim.launch_waits > 0
    stream = torch.cuda.current_stream()._s
    assert len(stream.pending) <= 8
    assert sim.syncs == 0  # not a sync the code asked for


def test_h2d_copies_cost_bytes_over_bandwidth_and_only_pageable_or_blocking_ones_block(cuda_sim):
    sim = cuda_sim(copy_bytes_per_ns=1.0)  # 1 GB/s: 10 MiB is ~10.5 ms
    pinned = torch.empty(10 * MiB // 4).pin_memory()
    _gate(sim)
    a = _ev()
    pinned.to("cuda", non_blocking=True)
    b = _ev()
    assert sim.syncs == 0
    torch.empty(10 * MiB // 4).to("cuda", non_blocking=True)  # pageable: blocks
    assert [k for k, _ in sim.sync_log] == ["h2d.pageable"]
    pinned.to("cuda")  # pinned but blocking: blocks too
    assert [k for k, _ in sim.sync_log] == ["h2d.pageable", "h2d.blocking"]
    sim.drain()
    assert _ms(a, b) == pytest.approx(10 * MiB / 1e6, rel=0.05)


def test_contexts_are_created_by_work_and_synchronize_never_by_query(cuda_sim):
    sim = cuda_sim(devices=3)
    torch.cuda.get_device_properties(2)
    torch.cuda.current_stream(2)
    e = torch.cuda.Event()
    assert e.query()  # never recorded: no CUDA call
    with torch.cuda.device(1):
        torch.cuda.Event().query()
    assert sim.contexts == {}
    e.record()
    assert set(sim.contexts) == {0}
    with torch.cuda.device(1):
        e.query()  # an event of device 0, queried with device 1 current
    assert set(sim.contexts) == {0}
    with torch.cuda.device(2):
        torch.cuda.synchronize()  # the current device's
    assert set(sim.contexts) == {0, 2} and sim.contexts[2] == "synchronize"
    torch.zeros(4, device="cuda:1")
    assert set(sim.contexts) == {0, 1, 2}


def _capture_on_thread(sim, mode, started, release, out):
    def run():
        try:
            with sim.capture(torch.cuda.Stream(), mode=mode):
                started.set()
                release.wait(5)
            out["ended"] = "ok"
        except RuntimeError as exc:
            out["ended"] = str(exc)

    t = threading.Thread(target=run)
    t.start()
    started.wait(5)
    return t


@pytest.mark.parametrize("mode, query_ok", [("global", False), ("thread_local", True),
                                            ("relaxed", True)])
def test_a_query_on_another_thread_breaks_only_a_global_capture(cuda_sim, mode, query_ok):
    sim = cuda_sim()
    e = _ev()
    started, release, out = threading.Event(), threading.Event(), {}
    t = _capture_on_thread(sim, mode, started, release, out)
    try:
        assert not torch.cuda.is_current_stream_capturing()  # this thread's stream is not
        assert sim.capturing
        if query_ok:
            assert e.query() in (True, False)
        else:
            with pytest.raises(RuntimeError, match="another thread captured in global mode"):
                e.query()
    finally:
        release.set()
        t.join(5)
    if query_ok:
        assert out["ended"] == "ok"
    else:
        assert "cudaErrorStreamCaptureInvalidated" in out["ended"]


@pytest.mark.parametrize("mode, own_query_ok", [("global", False), ("thread_local", False),
                                                ("relaxed", True)])
def test_the_capturing_threads_own_query_is_refused_unless_relaxed(cuda_sim, mode, own_query_ok):
    sim = cuda_sim()
    e = _ev()
    side = torch.cuda.Stream()
    if own_query_ok:
        with sim.capture(side, mode=mode):
            assert torch.cuda.is_current_stream_capturing()
            e.query()
        return
    with (pytest.raises(RuntimeError, match="Invalidated"), sim.capture(side, mode=mode),
          pytest.raises(RuntimeError, match="this thread captured")):
        e.query()


def test_work_in_a_capture_does_not_run_and_its_events_are_unusable_later(cuda_sim):
    sim = cuda_sim()
    side = torch.cuda.Stream()
    with sim.capture(side, mode="relaxed") as g:
        a = _ev()
        sim.kernel(7.0)
        b = _ev()
        assert not side._s.pending  # nothing was queued to run
    for bad in (a.query, b.synchronize, lambda: a.elapsed_time(b)):
        with pytest.raises(RuntimeError, match="capturing stream"):
            bad()
    _gate(sim)
    start = _ev()
    g.replay()  # the graph's work runs when it is replayed
    end = _ev()
    sim.drain()
    assert _ms(start, end) == pytest.approx(7.0, abs=0.5)


def test_collectives_run_on_a_comm_stream_beside_compute_joined_by_events(cuda_sim):
    sim = cuda_sim()
    comm = sim.comm_stream()
    assert comm != torch.cuda.current_stream() and comm.priority < 0
    _gate(sim, comm)
    t0 = _ev()
    sim.kernel(20.0)  # the collective's inputs are produced here
    work = sim.collective(30.0, async_op=True)
    sim.kernel(40.0)  # overlaps the collective
    before_wait = _ev()
    work.wait()  # the compute stream waits for the collective's end, the host does not
    after_wait = _ev()
    sim.kernel(5.0)
    t1 = _ev()
    sim.drain()
    assert sim.syncs == 0
    assert work.is_completed()
    assert _ms(t0, before_wait) == pytest.approx(60.0, abs=1.0)
    assert _ms(before_wait, after_wait) == pytest.approx(0.0, abs=0.5)  # hidden: 20+30 < 60
    assert _ms(t0, work.end) == pytest.approx(50.0, abs=1.0)  # started after its inputs
    assert _ms(t0, t1) == pytest.approx(65.0, abs=1.0)
    # A synchronous collective (no overlap) holds the compute stream for its whole length.
    _gate(sim, comm)
    a = _ev()
    sim.collective(25.0)
    b = _ev()
    sim.drain()
    assert _ms(a, b) == pytest.approx(25.0, abs=1.0)


def test_wait_event_and_wait_stream_join_through_event_wait_but_nccl_work_does_not(
        cuda_sim, monkeypatch):
    """torch/cuda/streams.py: ``Stream.wait_event(e)`` is ``e.wait(self)`` and ``wait_stream``
    goes through it; ``WorkNCCL::synchronizeStream`` waits in C++, not through ``Event.wait``."""
    sim = cuda_sim()
    seen = []
    orig = torch.cuda.Event.wait

    def wait(self, stream=None):
        seen.append(stream)
        return orig(self, stream)

    side = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    _gate(sim, side)
    monkeypatch.setattr(torch.cuda.Event, "wait", wait)
    side.wait_event(_ev())
    compute.wait_stream(side)
    assert seen == [side, compute]
    work = sim.collective(10.0, async_op=True)
    work.wait()
    assert len(seen) == 2
    with sim.nccl_group(ms=10.0):
        torch.distributed.all_reduce(torch.zeros(4, device="cuda"))
    assert len(seen) == 2


def test_a_one_rank_nccl_group_runs_each_call_on_the_comm_stream_like_nccl(cuda_sim):
    """:meth:`CudaSim.nccl_group`: ProcessGroupNCCL::collective (syncStream: the NCCL stream
    waits for the caller's current stream; kernel and end event on the NCCL stream), and
    WorkNCCL::synchronizeStream for the synchronous call (the current stream waits for the
    end) or on ``wait()`` for ``async_op=True``; the host never waits."""
    import torch.distributed as dist

    sim = cuda_sim()
    ag = torch.cuda.Stream()  # FSDP2's all-gather stream
    x = torch.zeros(256, device="cuda")
    out = torch.zeros(256, device="cuda")
    with sim.nccl_group(ms=lambda op: {"all_gather_single": 30.0}.get(op, 20.0)) as pg:
        _gate(sim, ag)
        t0 = _ev()
        sim.kernel(10.0)  # the inputs are produced here
        ag.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ag):
            a = _ev()
            dist.all_gather_single(out, x)  # synchronous: ag waits for its end
            b = _ev()
        sim.kernel(50.0)  # compute beside it
        c = _ev()
        work = dist.all_reduce(x, async_op=True)
        d = _ev()  # not held: the host and the compute stream go on
        work.wait()
        e = _ev()
        sim.drain()
        assert pg.calls == ["all_gather_single", "allreduce"]
    assert sim.syncs == 0
    assert _ms(t0, a) == pytest.approx(10.0, abs=1.0)
    assert _ms(a, b) == pytest.approx(30.0, abs=1.0)
    assert _ms(t0, c) == pytest.approx(60.0, abs=1.0)  # compute was not held by the gather
    assert _ms(c, d) == pytest.approx(0.0, abs=0.5)
    assert _ms(c, e) == pytest.approx(20.0, abs=1.0)  # wait(): held until the all-reduce ends


def _reuse_scenario(sim, record: bool) -> None:
    copy = torch.cuda.Stream()
    src = torch.empty(MiB // 4).pin_memory()
    with torch.cuda.stream(copy):
        a = src.to("cuda", non_blocking=True)  # allocated on the copy stream
    torch.cuda.current_stream().wait_stream(copy)
    sim.kernel(100.0)  # the compute stream is busy ...
    sim.kernel(50.0, reads=(a,))  # ... before this kernel reads `a`
    if record:
        a.record_stream(torch.cuda.current_stream())
    del a  # freed on the host while the read is still queued
    with torch.cuda.stream(copy):
        b = src.to("cuda", non_blocking=True)  # same size, same stream: the block is reused
    sim.drain()
    assert b.is_cuda


def test_a_kernel_reading_memory_a_later_copy_overwrote_raises(cuda_sim):
    sim = cuda_sim()
    # Which side is checked first follows the GPU timeline: the copy normally starts first
    # ("overwrote ... while ... still read"); if the host is descheduled for longer than the
    # 100 ms kernel before queueing the copy, the read starts first ("had overwritten").
    # Either message names the same fault.
    with pytest.raises(UseAfterReuse, match=r"overwr(ote|itten)"):
        _reuse_scenario(sim, record=False)
    assert sim.reuse_errors
    sim.reuse_errors.clear()  # seen: the fixture's check at teardown passes


def test_record_stream_defers_the_reuse_until_the_reading_stream_is_done(cuda_sim):
    sim = cuda_sim()
    _reuse_scenario(sim, record=True)
    assert sim.reuse_errors == []


def test_a_kernel_reading_memory_before_its_copy_finished_raises(cuda_sim):
    sim = cuda_sim()
    copy = torch.cuda.Stream()
    _gate(sim, copy)
    with torch.cuda.stream(copy):
        a = torch.empty(MiB // 4).pin_memory().to("cuda", non_blocking=True)
        sim.kernel(50.0)  # the copy stream is busy after the copy
    sim.kernel(10.0, reads=(a,))  # compute reads `a` without waiting for the copy stream
    with pytest.raises(UseAfterReuse, match="before h2d"):
        sim.drain()
    sim.reuse_errors.clear()  # seen: the fixture's check at teardown passes
