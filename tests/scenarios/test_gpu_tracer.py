"""The tracer's CUDA path on the simulated runtime: the GPU tests of ``test_tracer_gpu.py`` and
the fake-event clock tests of ``test_clock.py``, run against lagging simulated streams.

Unlike the fakes, the simulator completes events only when its stream reaches them, raises on
early ``elapsed_time``, runs backward on a device thread and counts every host sync.
"""

from __future__ import annotations

import time

import torch
from torch import nn

import stepscope
from stepscope.recording.clock import CudaClock
from stepscope.recording.schema import read_run


def _train(model, opt, sim, steps, *, non_blocking=True):
    host = torch.randn(256, 1024).pin_memory()
    for _ in range(steps):
        with stepscope.step():
            x = host.to("cuda", non_blocking=non_blocking)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        sim.host_tick()


def test_cuda_clock_records_every_phase_without_host_sync(cuda_sim, tmp_path):
    sim = cuda_sim(lag_steps=3)
    model = nn.Sequential(nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tracer = stepscope.init(out_dir=str(tmp_path), model=model, optimizer=opt,
                            flush_every_n_steps=5)
    sim.reset_counts()
    _train(model, opt, sim, 30)
    assert sim.sync_log == [], "the training loop must never synchronise"
    assert tracer.clock.kind == "cuda"
    stepscope.finish()
    recs = read_run(tmp_path)
    assert [r["step"] for r in recs] == list(range(30))
    for r in recs[5:]:
        ph = {p["name"]: p for p in r["phases"]}
        assert r["clock"] == "cuda" and r["device_name"] == "cuda:0"
        assert {"h2d", "forward", "backward", "optimizer"} <= set(ph)
        assert ph["forward"]["ms"] > 0 and ph["backward"]["ms"] > 0
        assert r["counters"]["h2d_bytes"] == 256 * 1024 * 4
        assert ph["h2d"]["end_ms"] <= ph["forward"]["start_ms"] + 1e-3
        assert r["step_ms"] >= sum(p["ms"] for p in r["phases"] if p["parent"] is None) - 1e-3


def test_backward_is_timed_when_it_runs_on_the_device_thread(cuda_sim, tmp_path):
    sim = cuda_sim(devices=2, lag_steps=2)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to("cuda:1")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    stepscope.init(out_dir=str(tmp_path), model=model, optimizer=opt)
    for _ in range(12):
        with stepscope.step():
            loss = model(torch.randn(8, 64).pin_memory().to("cuda:1", non_blocking=True)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        sim.host_tick()
    stepscope.finish()
    recs = read_run(tmp_path)
    assert sim.backward_threads and set(sim.backward_threads) == {"cudasim-autograd-1"}
    assert len(recs) == 12 and {r["device_name"] for r in recs} == {"cuda:1"}
    assert all("backward" in {p["name"] for p in r["phases"]} for r in recs[2:])


def test_gpu_phase_times_follow_gpu_work(cuda_sim, tmp_path):
    """A phase that enqueues 20 ms of GPU sleep measures >= 20 ms on the CUDA clock."""
    sim = cuda_sim(lag_steps=1)
    tracer = stepscope.init(out_dir=str(tmp_path), auto=False)
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.02)  # ~20 ms
    for _ in range(5):
        with stepscope.step(), stepscope.phase("sleepy"):
            torch.cuda._sleep(cycles)
        sim.host_tick()
    assert tracer.clock.kind == "cuda"
    stepscope.finish()
    recs = read_run(tmp_path)
    assert len(recs) == 5
    for r in recs:
        assert 19.9 <= r["phases"][0]["ms"] < 40.0


def test_cuda_method_and_model_init_outside_steps(cuda_sim, tmp_path):
    sim = cuda_sim()
    tracer = stepscope.init(out_dir=str(tmp_path), auto={"h2d"})
    torch.ones(1000).cuda()  # outside a step: never counted
    with stepscope.step():
        torch.ones(1000).pin_memory().cuda(non_blocking=True)
        torch.ones(10, device="cuda").to(torch.float16)  # device-side cast, not H2D
    assert tracer.clock.kind == "cuda"
    assert [k for k, _ in sim.sync_log] == ["h2d.pageable"]  # the copy outside the step
    stepscope.finish()
    (rec,) = read_run(tmp_path)
    assert [p["name"] for p in rec["phases"]] == ["h2d"] and rec["phases"][0]["calls"] == 1
    assert rec["counters"]["h2d_bytes"] == 4000


def test_cuda_clock_defers_reads_until_events_complete(cuda_sim, mem_tracer):
    sim = cuda_sim(lag_steps=2, idle_drain_s=None)
    tr = mem_tracer(auto=False, clock=CudaClock(), flush_every_n_steps=2)
    for _ in range(4):
        with tr.step():
            with tr.phase("forward"):
                sim.kernel(3.0)
            with tr.phase("backward"):
                sim.kernel(5.0)
            sim.kernel(1.0)
    # Nothing has run on the GPU yet (no host step ended): flushes found nothing and did not wait.
    assert tr.sink.records == [] and sim.syncs == 0
    sim.drain()
    time.sleep(0.05)  # the 36 ms of queued kernels have run
    tr.finish()
    recs = tr.sink.records
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    for r in recs:
        ph = {p["name"]: p for p in r["phases"]}
        assert r["clock"] == "cuda"
        # The GPU time of each phase: its kernels, plus the host's gaps between launches that
        # the drained GPU replays (small; generous bounds for a loaded machine).
        assert 3.0 <= ph["forward"]["ms"] < 3.0 + 20
        assert 5.0 <= ph["backward"]["ms"] < 5.0 + 20
        assert ph["backward"]["start_ms"] >= 3.0
        assert 9.0 <= r["step_ms"] < 9.0 + 40
        assert r["residual_ms"] >= 1.0
    assert sim.syncs == 0


def test_events_are_pooled_and_reused(cuda_sim, mem_tracer):
    sim = cuda_sim()
    tr = mem_tracer(auto=False, clock=CudaClock(), flush_every_n_steps=1)
    created = 0
    real_event = torch.cuda.Event

    def counting(*a, **k):
        nonlocal created
        created += 1
        return real_event(*a, **k)

    torch.cuda.Event = counting  # restored by the fixture's uninstall
    for _ in range(50):
        with tr.step(), tr.phase("forward"):
            sim.kernel(0.01)
        sim.host_tick()
        time.sleep(0.002)
    tr.finish()
    assert len(tr.sink.records) == 50
    assert created <= 16, f"events are not reused: {created} created for 50 steps"
