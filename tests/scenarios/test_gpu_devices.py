"""The DDP tutorial pattern on the simulated CUDA runtime: ``model.to(rank)``
without ``torch.cuda.set_device``. Timing, PrefetchLoader and memory go to the model's device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stepscope
from stepscope.common.errors import StepscopeWarning
from stepscope.prefetch import PrefetchLoader
from stepscope.recording import devices
from stepscope.recording.schema import read_run


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_warned", set())
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def _events_on(sim: object, index: int) -> int:
    """Items ever enqueued on device ``index``'s streams (events, copies, waits)."""
    return sum(s.last is not None for s in sim._devices[index].streams)  # type: ignore[attr-defined]


def test_resolver_names_the_models_simulated_second_gpu(cuda_sim):
    sim = cuda_sim(devices=2)
    model = nn.Linear(8, 8).to(1)  # rank 1 of the tutorial; the current device stays cuda:0
    assert torch.cuda.current_device() == 0
    with pytest.warns(StepscopeWarning, match=r"cuda:1 \(the model's parameters\).*cuda:0"):
        assert devices.resolve(model) == 1
    # Explicit wins; a model still on the CPU falls back to the current device, quietly.
    assert devices.resolve(model, device="cuda:0") == 0
    assert devices.resolve(nn.Linear(2, 2)) == 0
    # PrefetchLoader given the resolved device copies there, on that device's streams.
    sim.reset_counts()
    out = list(PrefetchLoader([torch.randn(4, 8) for _ in range(3)], device=devices.resolve(model)))
    assert all(b.device == torch.device("cuda", 1) for b in out)
    assert sim.syncs == 0, sim.sync_log


def test_ddp_tutorial_without_set_device_times_on_the_models_gpu(tmp_path, cuda_sim):
    sim = cuda_sim(devices=2)
    model = nn.Linear(8, 8).to(1)
    x = torch.randn(4, 8).to(1, non_blocking=True)
    with pytest.warns(StepscopeWarning, match="cuda:1"):
        tracer = stepscope.init(out_dir=str(tmp_path), model=model, auto={"forward", "backward"},
                                flush_every_n_steps=1, heartbeat_s=0)
    try:
        for _ in range(4):
            with stepscope.step():
                model(x).sum().backward()
            sim.host_tick()
        # PrefetchLoader without a device follows the tracer's (the model's) device.
        assert all(b.device == torch.device("cuda", 1) for b in PrefetchLoader([torch.ones(2)] * 2))
    finally:
        stepscope.finish()
    assert tracer.clock.device == "cuda:1"
    # Before: every event went to cuda:0's idle stream (the current device).
    assert _events_on(sim, 0) == 0
    recs = read_run(tmp_path)
    assert len(recs) == 4 and all(r["device_name"] == "cuda:1" for r in recs)
    assert all({"forward", "backward"} <= {p["name"] for p in r["phases"]} for r in recs)
