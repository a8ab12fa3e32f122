"""The tracer on a real GPU: CUDA-event clock, automatic H2D, no host sync inside steps.

Skipped without CUDA; run with `pytest -m gpu` on a machine that has one.
"""

from __future__ import annotations

import pytest
import torch

import stepscope
from stepscope.recording.schema import read_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _train(model, opt, steps, *, non_blocking=True):
    host = torch.randn(256, 1024).pin_memory()
    for _ in range(steps):
        with stepscope.step():
            x = host.to("cuda", non_blocking=non_blocking)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()


def test_cuda_clock_records_every_phase_without_host_sync(tmp_path, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tracer = stepscope.init(out_dir=str(tmp_path), model=model, optimizer=opt, flush_every_n_steps=5)
    syncs = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1) or real_sync(*a, **k))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: syncs.append(1), raising=False)
    _train(model, opt, 30)
    assert syncs == [], "the training loop must never synchronise"
    monkeypatch.undo()
    assert tracer.clock.kind == "cuda"
    stepscope.finish()
    recs = read_run(tmp_path)
    assert [r["step"] for r in recs] == list(range(30))
    for r in recs[5:]:
        ph = {p["name"]: p for p in r["phases"]}
        assert r["clock"] == "cuda" and r["device"].startswith("cuda:")
        assert {"h2d", "forward", "backward", "optimizer"} <= set(ph)
        assert ph["forward"]["ms"] > 0 and ph["backward"]["ms"] > 0
        assert r["counters"]["h2d_bytes"] == 256 * 1024 * 4
        assert ph["h2d"]["end_ms"] <= ph["forward"]["start_ms"] + 1e-3
        assert r["step_ms"] >= sum(p["ms"] for p in r["phases"] if p["parent"] is None) - 1e-3


def test_gpu_phase_times_follow_gpu_work(tmp_path):
    """A phase that enqueues 20 ms of GPU sleep measures >= 20 ms on the CUDA clock."""
    tracer = stepscope.init(out_dir=str(tmp_path), auto=False)
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.02)  # ~20 ms
    for _ in range(5):
        with stepscope.step(), stepscope.phase("sleepy"):
            torch.cuda._sleep(cycles)
    assert tracer.clock.kind == "cuda"
    stepscope.finish()
    for r in read_run(tmp_path):
        assert r["phases"][0]["ms"] >= 15.0


def test_cuda_method_and_model_init_outside_steps(tmp_path):
    tracer = stepscope.init(out_dir=str(tmp_path), auto={"h2d"})
    torch.ones(1000).cuda()  # outside a step: never counted
    with stepscope.step():
        torch.ones(1000).cuda(non_blocking=True)
        torch.ones(10, device="cuda").to(torch.float16)  # device-side cast, not H2D
    assert tracer.clock.kind == "cuda"
    stepscope.finish()
    (rec,) = read_run(tmp_path)
    assert [p["name"] for p in rec["phases"]] == ["h2d"] and rec["phases"][0]["calls"] == 1
    assert rec["counters"]["h2d_bytes"] == 4000
