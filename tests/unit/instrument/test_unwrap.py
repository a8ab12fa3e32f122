"""Framework wrappers around the optimizer and model: timing finds the real object."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import stepscope
from stepscope.common.errors import StepscopeWarning
from stepscope.instrument import unwrap
from stepscope.recording.sinks import MemorySink


def _tracer(model: Any, opt: Any, sink: MemorySink) -> stepscope.Tracer:
    cfg = stepscope.Config(auto={"forward", "backward", "optimizer"}, collectives=False)
    return stepscope.Tracer(cfg, model=model, optimizer=opt, sink=sink)


def _train(tracer: stepscope.Tracer, model: nn.Module, opt: Any, steps: int = 3) -> None:
    for _ in range(steps):
        with tracer.step():
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    tracer.finish()


def _phases(sink: MemorySink) -> set[str]:
    return {p["name"] for r in sink.records for p in r["phases"]}


def test_accelerated_optimizer_is_unwrapped(tmp_path: Any) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    model = nn.Linear(8, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    try:
        model, wrapped = accelerate.Accelerator(cpu=True).prepare(model, inner)
        assert type(wrapped).__name__ == "AcceleratedOptimizer"
        assert not unwrap.hookable_optimizer(wrapped)  # the bug: no hook registries of its own
        assert unwrap.optimizer(wrapped) is inner
        _train(_tracer(model, wrapped, sink), model, wrapped)
    finally:
        AcceleratorState._reset_state(True)  # accelerate keeps process-wide state
    assert {"forward", "backward", "optimizer"} <= _phases(sink)
    assert len(sink.records) == 3


class _LightningStyleOptimizer:
    """Holds the optimizer as ``_optimizer`` and forwards ``step`` (Lightning's pattern)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self._optimizer = opt

    def step(self) -> None:
        self._optimizer.step()

    def zero_grad(self) -> None:
        self._optimizer.zero_grad()


def test_holder_of_optimizer_is_unwrapped() -> None:
    model = nn.Linear(8, 2)
    inner = torch.optim.Adam(model.parameters())
    holder = _LightningStyleOptimizer(inner)
    assert unwrap.optimizer(holder) is inner
    sink = MemorySink()
    _train(_tracer(model, holder, sink), model, holder)
    assert "optimizer" in _phases(sink)


class _Broken(torch.optim.Optimizer):
    """An Optimizer subclass that skipped ``__init__`` and holds nothing to unwrap."""

    def __init__(self, params: Any) -> None:
        self.param_groups = [{"params": list(params), "lr": 0.1}]

    def step(self, closure: Any = None) -> None:
        for p in self.param_groups[0]["params"]:
            p.data.add_(p.grad, alpha=-0.1)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None


def test_unhookable_optimizer_drops_only_that_phase() -> None:
    model = nn.Linear(8, 2)
    opt = _Broken(model.parameters())
    sink = MemorySink()
    with pytest.warns(StepscopeWarning, match="optimizer phase is not timed.*_Broken"):
        tracer = _tracer(model, opt, sink)
    _train(tracer, model, opt)
    names = _phases(sink)
    assert {"forward", "backward"} <= names and "optimizer" not in names
    assert len(sink.records) == 3


def test_compiled_and_ddp_wrappers_are_named() -> None:
    inner = nn.Linear(8, 2)
    compiled = torch.compile(inner, backend="eager")
    assert unwrap.model_wrappers(compiled) == ["OptimizedModule", "Linear"]
    assert unwrap.module(compiled) is compiled  # its own hooks run eagerly around the call
    assert not unwrap.uses_ddp(compiled)
    assert unwrap.optimizer(None) is None


def test_lightning_optimizer_is_unwrapped() -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = nn.Linear(8, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = LightningOptimizer(inner)
    assert isinstance(wrapped, torch.optim.Optimizer) and not unwrap.hookable_optimizer(wrapped)
    assert unwrap.optimizer(wrapped) is inner
    sink = MemorySink()
    _train(_tracer(model, wrapped, sink), model, inner)
    assert "optimizer" in _phases(sink)
