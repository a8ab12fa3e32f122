"""The one device resolver: explicit, then the model, then LOCAL_RANK, then current."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from stepscope.common.errors import StepscopeWarning
from stepscope.instrument import resource_sampler as resources
from stepscope.prefetch import PrefetchLoader
from stepscope.recording import devices


class Runtime:
    """torch.cuda's device calls: ``count`` devices, the current one ``current``."""

    def __init__(self, count: int = 4, current: int = 0, available: bool = True) -> None:
        self.count, self.current, self.available = count, current, available

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current


class Placed:
    """What ``model.to(rank)`` leaves: parameters whose ``.device`` is ``cuda:rank``.

    (A CPU-only machine cannot hold CUDA tensors; the resolver only reads ``.device``.)
    """

    def __init__(self, *devs: str) -> None:
        self._p = [type("P", (), {"device": torch.device(d)})() for d in devs]

    def parameters(self) -> list[Any]:
        return self._p

    def buffers(self) -> list[Any]:
        return []


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_warned", set())
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_ddp_tutorial_pattern_resolves_to_the_models_device_not_the_current_one():
    # model.to(rank) on rank 2, no torch.cuda.set_device: the current device is still 0.
    with pytest.warns(StepscopeWarning, match=r"cuda:2 \(the model's parameters\).*cuda:0"):
        assert devices.resolve(Placed("cpu", "cuda:2"), runtime=Runtime(current=0)) == 2
    # Once per (resolved, current) pair: a second resolve (PrefetchLoader, monitor) is quiet.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.resolve(Placed("cuda:2"), runtime=Runtime(current=0)) == 2


def test_order_explicit_then_model_then_local_rank_then_current(monkeypatch):
    rt = Runtime(count=4, current=3)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepscopeWarning)
        assert devices.resolve(Placed("cuda:2"), device="cuda:0", runtime=rt) == 0
        assert devices.resolve(Placed("cuda:2"), runtime=rt) == 2
        assert devices.resolve(Placed("cpu"), runtime=rt) == 1  # model still on the CPU
        assert devices.resolve(None, device=torch.device("cuda"), runtime=rt) == 1
    # CUDA_VISIBLE_DEVICES narrowed the view to one device: LOCAL_RANK 1 does not exist here.
    assert devices.resolve(None, runtime=Runtime(count=1, current=0)) == 0
    monkeypatch.delenv("LOCAL_RANK")
    assert devices.resolve(None, runtime=rt) == 3


def test_no_warning_when_the_job_set_its_device():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.resolve(Placed("cuda:1"), runtime=Runtime(current=1)) == 1


def test_no_cuda_resolves_to_none_and_bad_devices_are_rejected():
    assert devices.resolve(Placed("cpu"), runtime=Runtime(available=False)) is None
    with pytest.raises(TypeError, match="device must be"):
        devices.resolve(device=1.5, runtime=Runtime())
    with pytest.raises(ValueError, match=">= 0"):
        devices.resolve(device=-1, runtime=Runtime())
    with pytest.raises(ValueError, match="CUDA device"):
        devices.resolve(device="cpu", runtime=Runtime())
    with pytest.raises(ValueError, match="does not exist"):
        devices.resolve(device=7, runtime=Runtime(count=2))
    with pytest.raises(ValueError, match="not a device"):
        devices.resolve(device="gpu:x", runtime=Runtime())


def test_prefetch_loader_follows_the_tracers_device(monkeypatch):
    """PrefetchLoader(device=None) copies to the tracer's (model-resolved) device, not current."""
    from fake_cuda_backend import FakeBackend, FakeTracer

    be = FakeBackend(count=4, current=0)
    tracer = FakeTracer(be.log)
    tracer.clock = type("C", (), {"device_index": 3})()  # type: ignore[attr-defined]
    loader = PrefetchLoader([torch.ones(2), torch.ones(2)], tracer=tracer, _backend=be)
    assert len(list(loader)) == 2
    assert loader.device == torch.device("cuda", 3)
    assert set(be.devices_entered) == {torch.device("cuda", 3)}
    # Without a tracer device: the resolver's LOCAL_RANK.
    monkeypatch.setenv("LOCAL_RANK", "2")
    be2 = FakeBackend(count=4, current=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepscopeWarning)
        loader2 = PrefetchLoader([torch.ones(2)], tracer=FakeTracer(be2.log), _backend=be2)
        list(loader2)
    assert loader2.device == torch.device("cuda", 2)


def test_resource_monitor_reads_memory_of_the_resolved_device(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resources._cuda_index("cuda") == 1
    assert resources._cuda_index("cuda:0") == 0
    assert resources._cuda_index("cpu") is None
