"""The simulated CUDA runtime itself: faithful to CUDA/PyTorch where stepscope depends on it."""

from __future__ import annotations

import itertools
import threading

import cudasim
import pytest
import torch
from torch import nn


def _timed() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def test_install_reports_a_cuda_machine(cuda_sim):
    sim = cuda_sim(devices=4)
    assert torch.cuda.is_available() and torch.cuda.device_count() == 4
    assert torch.cuda.get_device_name() == "NVIDIA H100 80GB HBM3"
    props = torch.cuda.get_device_properties(2)
    assert props.total_memory > 80e9 and (props.major, props.minor) == (9, 0)
    assert str(torch.cuda.get_device_properties(1).uuid) != str(props.uuid)
    assert torch.cuda.current_device() == 0
    torch.cuda.set_device(3)
    assert torch.cuda.current_device() == 3
    with torch.cuda.device(1):
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 3
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(4)
    assert cudasim.active() is sim


def test_uninstall_restores_torch_untouched():
    names = ("is_available", "device_count", "current_device", "Event", "Stream", "synchronize",
             "current_stream", "stream", "memory_allocated")
    before_cuda = {n: getattr(torch.cuda, n) for n in names}
    before_tensor = dict(vars(torch.Tensor))
    before_module = dict(vars(nn.Module))
    before_torch = {n: getattr(torch, n) for n in ("zeros", "randn", "empty_like")}
    before_engine = torch.autograd._engine_run_backward
    before_acc = dict(vars(torch.accelerator))
    with cudasim.CudaSim(devices=2) as sim:
        assert torch.cuda.is_available()
        model = nn.Linear(2, 2).to("cuda:1")
        assert model.weight.device == torch.device("cuda", 1)
        model(torch.randn(3, 2)).sum().backward()
        assert sim.backward_threads == ["cudasim-autograd-1"]
    assert {n: getattr(torch.cuda, n) for n in names} == before_cuda
    assert dict(vars(torch.Tensor)) == before_tensor
    assert dict(vars(nn.Module)) == before_module
    assert {n: getattr(torch, n) for n in ("zeros", "randn", "empty_like")} == before_torch
    assert torch.autograd._engine_run_backward is before_engine
    assert dict(vars(torch.accelerator)) == before_acc
    assert not torch.cuda.is_available()
    assert cudasim.active() is None
    assert not any(t.name.startswith("cudasim-") for t in threading.enumerate())


def test_events_complete_only_when_the_lagging_gpu_reaches_them(cuda_sim):
    sim = cuda_sim(lag_steps=3, idle_drain_s=None)
    marks = []
    for _ in range(6):
        start, end = _timed(), _timed()
        start.record()
        sum(range(20_000))  # host work between the marks
        end.record()
        marks.append((start, end))
        sim.host_tick()
    # Work of step k has completed once the host ended step k+lag-1: steps 0..3 of 6.
    assert [e.query() for _, e in marks] == [True] * 4 + [False] * 2
    with pytest.raises(RuntimeError, match="not ready"):
        marks[5][0].elapsed_time(marks[5][1])
    ms = [s.elapsed_time(e) for s, e in marks[:4]]
    assert all(m > 0 for m in ms)
    assert sim.syncs == 0


def test_unrecorded_event_query_true_but_elapsed_time_raises(cuda_sim):
    cuda_sim()
    a, b = _timed(), _timed()
    assert a.query()  # CUDAEvent::query is true before the first record
    b.record()
    with pytest.raises(RuntimeError, match="recorded"):
        a.elapsed_time(b)
    a.record()
    untimed = torch.cuda.Event()
    untimed.record()
    with pytest.raises(RuntimeError, match="invalid resource"):
        untimed.elapsed_time(a)  # timing disabled


def test_event_is_bound_to_its_first_device(cuda_sim):
    cuda_sim(devices=2)
    e = _timed()
    e.record()
    with torch.cuda.device(1), pytest.raises(RuntimeError, match="does not match"):
        e.record()


def test_gpu_timestamps_are_monotone_and_never_before_enqueue(cuda_sim):
    import time

    sim = cuda_sim(lag_steps=2)
    events, host = [], []
    for _ in range(5):
        for _ in range(4):
            e = _timed()
            host.append(time.perf_counter_ns())
            e.record()
            events.append(e)
        sim.kernel(0.2)
        sim.host_tick()
    sim.host_tick(2)
    time.sleep(0.01)  # the last step's kernel is still running on the GPU right after the tick
    assert all(e.query() for e in events)
    gaps = [events[0].elapsed_time(e) for e in events]
    assert gaps == sorted(gaps)
    # GPU time of event i minus GPU time of event 0 >= 0 and each event ran after its enqueue:
    # the host-side gap can only be smaller than or equal to the GPU-side one plus the lag.
    ends = [e._item.end_ns for e in events]
    assert all(end >= h for end, h in zip(ends, host, strict=True))


def test_wait_event_orders_a_stream_after_another(cuda_sim):
    sim = cuda_sim()
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() == side
        sim.kernel(5000.0)  # a long copy/kernel on the side stream
        copied = _timed()
        copied.record()
    assert torch.cuda.current_stream() == main
    main.wait_event(copied)
    after = _timed()
    after.record()
    before = _timed()
    before.record(side)  # nothing orders `side` after main's work
    assert not after.query(), "main's later work cannot complete before the awaited event"
    assert not copied.query()
    sim.drain()
    assert after.query() and copied.query()
    assert copied.elapsed_time(after) >= 0.0
    assert sim.syncs == 0  # drain() is the test's helper, not a host sync


def test_wait_stream_and_query_do_not_block(cuda_sim):
    sim = cuda_sim(lag_steps=1, idle_drain_s=None)
    side = torch.cuda.Stream()
    e = side.record_event(_timed())
    torch.cuda.current_stream().wait_stream(side)
    assert not side.query() and not torch.cuda.current_stream().query()
    assert sim.syncs == 0
    sim.host_tick()
    assert side.query() and torch.cuda.current_stream().query() and e.query()


def test_every_synchronize_is_counted(cuda_sim):
    sim = cuda_sim(lag_steps=5, idle_drain_s=None)
    e = _timed()
    e.record()
    assert not e.query()
    e.synchronize()
    assert e.query()
    torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()
    assert [k for k, _ in sim.sync_log] == ["event.synchronize", "stream.synchronize",
                                            "device.synchronize"]
    sim.reset_counts()
    assert sim.syncs == 0


def test_pageable_copy_blocks_and_counts_pinned_async_does_not(cuda_sim):
    sim = cuda_sim(lag_steps=2, idle_drain_s=None)
    pageable = torch.randn(64, 64)
    before = _timed()
    before.record()
    x = pageable.to("cuda", non_blocking=True)  # pageable: synchronous despite non_blocking
    assert x.device == torch.device("cuda", 0) and x.is_cuda and not pageable.is_cuda
    assert torch.equal(x.cpu(), pageable)
    assert before.query(), "the stream drained up to the copy"
    assert [k for k, _ in sim.sync_log] == ["h2d.pageable", "d2h"]
    sim.reset_counts()
    pinned = torch.randn(64, 64).pin_memory()
    assert pinned.is_pinned() and not pageable.is_pinned()
    y = pinned.to("cuda", non_blocking=True)
    assert y.is_cuda and not y.is_pinned()
    done = _timed()
    done.record()
    assert sim.syncs == 0 and not done.query()
    assert sim.copies == [("h2d", 64 * 64 * 4, False)]
    pinned.cuda()  # pinned but non_blocking=False: torch synchronises the stream
    assert [k for k, _ in sim.sync_log] == ["h2d.blocking"]
    torch.ones((), device="cuda").item()  # a blocking device-to-host read
    assert sim.sync_log[-1][0] == "item"


def test_module_to_places_parameters_and_math_still_runs(cuda_sim):
    sim = cuda_sim(devices=2)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(1)  # DDP tutorial
    assert {p.device for p in model.parameters()} == {torch.device("cuda", 1)}
    assert torch.cuda.current_device() == 0, "Module.to does not change the current device"
    assert torch.cuda.memory_allocated(1) >= sum(p.numel() * 4 for p in model.parameters())
    assert torch.cuda.memory_allocated(0) == 0
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(model(x.to("cuda:1")), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] * 0.5
    assert sim.place(nn.Linear(2, 2), 0).weight.device.index == 0
    z = torch.zeros(3, device="cuda:1")
    assert z.device.index == 1 and torch.zeros_like(z).device.index == 1
    assert torch.ones(2).device.type == "cpu"


def test_backward_runs_on_a_device_thread_without_the_callers_thread_locals(cuda_sim):
    sim = cuda_sim(devices=2)
    local = threading.local()
    local.gate = "owner"
    model = nn.Linear(4, 4).to("cuda:1")
    seen = []

    class Tap(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(("fn", threading.current_thread().name, getattr(local, "gate", None),
                         torch.is_grad_enabled(), torch.cuda.current_device()))
            return g

    model.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(("hook", threading.current_thread().name,
                               getattr(local, "gate", None)))
    )
    engine = torch.autograd.Variable._execution_engine
    out = model(torch.randn(2, 4))
    out.register_hook(
        lambda g: engine.queue_callback(lambda: seen.append(
            ("callback", threading.current_thread().name, None)))
    )
    Tap.apply(out).sum().backward()
    names = {s[1] for s in seen}
    assert names == {"cudasim-autograd-1"}
    assert threading.current_thread().name not in names
    assert [s[0] for s in seen][-1] == "callback"  # engine callbacks run at the end
    fn = next(s for s in seen if s[0] == "fn")
    assert fn[2] is None, "the caller's thread-locals are not visible on the device thread"
    assert fn[3] is False and fn[4] == 1, "grad mode travels; the device thread is on cuda:1"
    assert model.weight.grad is not None

    # torch.autograd.grad takes the same path; errors come back to the caller.
    x = torch.randn(3, requires_grad=True)
    (g,) = torch.autograd.grad((x * x).sum(), x, create_graph=True)
    assert torch.allclose(g, 2 * x)
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.randn(2).sum().backward()
    assert sim.backward_threads.count("cudasim-autograd-1") == 3


def test_backward_runs_on_the_callers_current_stream(cuda_sim):
    cuda_sim()
    side = torch.cuda.Stream()
    lin = nn.Linear(2, 2)
    seen = []
    lin.weight.register_hook(lambda g: seen.append(torch.cuda.current_stream()))
    with torch.cuda.stream(side):
        lin(torch.randn(3, 2)).sum().backward()
    lin(torch.randn(3, 2)).sum().backward()
    assert seen == [side, torch.cuda.default_stream()]


def test_reentrant_checkpoint_backward_runs_inline(cuda_sim):
    from torch.utils.checkpoint import checkpoint

    cuda_sim()
    lin = nn.Linear(4, 4)
    out = checkpoint(lin, torch.randn(2, 4, requires_grad=True), use_reentrant=True)
    out.sum().backward()
    assert lin.weight.grad is not None


def test_memory_stats_follow_placed_tensors(cuda_sim):
    cuda_sim()
    base = torch.cuda.memory_allocated()
    t = torch.empty(1 << 20, device="cuda")
    assert torch.cuda.memory_allocated() == base + 4 << 20
    peak = torch.cuda.max_memory_allocated()
    del t
    assert torch.cuda.memory_allocated() == base
    assert torch.cuda.max_memory_allocated() == peak
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == base
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == base
    nested = torch.cuda.memory_stats_as_nested_dict()
    assert nested["reserved_bytes"]["all"]["peak"] >= 4 << 20
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total


def test_capture_flag(cuda_sim):
    sim = cuda_sim()
    e = _timed()
    e.record()
    # The query is refused and, in the default global mode, breaks the capture: ending it
    # raises cudaErrorStreamCaptureInvalidated.
    with pytest.raises(RuntimeError, match="Invalidated"), sim.capture():
        assert torch.cuda.is_current_stream_capturing()
        with pytest.raises(RuntimeError, match="capturing"):
            e.query()
    assert not torch.cuda.is_current_stream_capturing() and e.query()


def test_an_idle_host_lets_the_gpu_drain_its_queue(cuda_sim):
    import time

    sim = cuda_sim(lag_steps=50, idle_drain_s=0.3)
    events = []
    for _ in range(5):
        e = _timed()
        e.record()
        events.append(e)
        time.sleep(0.002)
        sim.host_tick()
    assert not events[0].query()  # 50 steps behind: nothing has run yet
    time.sleep(1.0)  # the host stops ticking (end of the loop): 50 x ~2 ms of queued work
    assert all(e.query() for e in events)
    assert events[0].elapsed_time(events[-1]) > 0
    assert sim.syncs == 0


def test_stepscope_h2d_copies_taken_at_import_go_through_the_sim(cuda_sim, tmp_path):
    import stepscope
    import stepscope.instrument.h2d as h2d

    real_to = h2d._orig_to
    sim = cuda_sim()
    model = nn.Linear(4, 4).to("cuda")
    stepscope.init(out_dir=str(tmp_path), model=model)
    try:
        host = torch.randn(2, 4).pin_memory()
        sim.reset_counts()
        with stepscope.step():
            x = host.to("cuda", non_blocking=True)
            model(x).sum().backward()
        assert x.is_cuda and sim.copies == [("h2d", 32, False)] and sim.syncs == 0
    finally:
        stepscope.finish()
    sim.uninstall()
    assert h2d._orig_to is real_to


def test_injected_query_errors_raise_then_stop(cuda_sim):
    sim = cuda_sim()
    e = _timed()
    e.record()
    sim.inject_query_errors(2)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="unspecified launch failure"):
            e.query()
    assert e.query()


def test_a_forced_drain_keeps_the_spacing_of_the_queued_work(cuda_sim):
    import time

    sim = cuda_sim(lag_steps=100, idle_drain_s=None)
    events = []
    for _ in range(4):
        e = _timed()
        e.record()
        events.append(e)
        time.sleep(0.005)
        sim.host_tick()
    assert not any(e.query() for e in events)
    events[-1].synchronize()  # the host waits for 100 steps of queued work
    gaps = [a.elapsed_time(b) for a, b in itertools.pairwise(events)]
    assert all(g >= 4.0 for g in gaps), gaps  # each ~5 ms apart, as enqueued
    assert sim.syncs == 1


def test_a_host_stall_never_squeezes_a_lagging_step_to_zero(cuda_sim):
    """Seen in a loaded CI run: the host stalled past ``idle_drain_s`` mid-run while the GPU
    was 100 steps behind, and three whole steps came out at one instant (elapsed 0.0). The
    GPU runs a step's work with the spacing the host gave it, whichever way it catches up."""
    import time

    sim = cuda_sim(lag_steps=4, idle_drain_s=0.05)
    pairs = []
    pauses = [0.002] * 6 + [0.04] + [0.002] * 3 + [0.12] + [0.002] * 4 + [0.08, 0.002, 0.002]
    for k, pause in enumerate(pauses):
        a, b = _timed(), _timed()
        a.record()
        time.sleep(0.003)
        b.record()
        pairs.append((a, b))
        if k in (9, 15):
            time.sleep(0.12)  # the host stalls past idle_drain_s between two steps
            for x, y in pairs:
                x.query(), y.query()
        time.sleep(pause)
        sim.host_tick()
    time.sleep(0.5)
    assert all(a.query() and b.query() for a, b in pairs)
    widths = [a.elapsed_time(b) for a, b in pairs]
    assert min(widths) > 0, widths
    assert sim.syncs == 0
