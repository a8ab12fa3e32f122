"""Forward/backward/optimizer hooks on a real model and optimizer."""

from __future__ import annotations

import time

import torch

from stepscope.tracer import Tracer


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.005)
        return g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, x):
        time.sleep(0.003)
        return SlowBackward.apply(self.lin(x))


def _ph(rec):
    return {p["name"]: p for p in rec["phases"]}


def test_forward_backward_optimizer_are_timed_in_order(mem_tracer):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt)
    model(torch.randn(2, 16))  # outside a step: not recorded
    for _ in range(3):
        with tr.step():
            loss = model(torch.randn(2, 16)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    tr.finish()
    assert len(tr.sink.records) == 3
    for rec in tr.sink.records:
        ph = _ph(rec)
        assert set(ph) == {"forward", "backward", "optimizer"}
        assert ph["forward"]["ms"] >= 3.0 and ph["backward"]["ms"] >= 5.0
        assert ph["forward"]["end_ms"] <= ph["backward"]["start_ms"]
        assert ph["backward"]["end_ms"] <= ph["optimizer"]["start_ms"]


def test_gradient_accumulation_counts_calls(mem_tracer):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt)
    with tr.step():
        for _ in range(3):
            model(torch.randn(2, 16)).sum().backward()
        opt.step()
    tr.finish()
    ph = _ph(tr.sink.records[0])
    assert ph["forward"]["calls"] == 3 and ph["backward"]["calls"] == 3
    assert ph["optimizer"]["calls"] == 1 and ph["backward"]["ms"] >= 15.0


def test_no_grad_forward_has_no_backward(mem_tracer):
    model = Net()
    tr = mem_tracer(model=model)
    with tr.step(), torch.no_grad():
        model(torch.randn(2, 16))
    tr.finish()
    assert set(_ph(tr.sink.records[0])) == {"forward"}


def test_hooks_are_removed_at_finish(mem_tracer):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr: Tracer = mem_tracer(model=model, optimizer=opt)
    assert model._forward_hooks and model._forward_pre_hooks and opt._optimizer_step_pre_hooks
    tr.finish()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_dict_and_dataclass_outputs(mem_tracer):
    class DictNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            return {"logits": self.lin(x), "aux": [self.lin(x) * 2]}

    model = DictNet()
    tr = mem_tracer(model=model)
    with tr.step():
        out = model(torch.randn(3, 4))
        (out["logits"].sum() + out["aux"][0].sum()).backward()
    tr.finish()
    assert _ph(tr.sink.records[0])["backward"]["calls"] == 1


def test_wrong_model_type_is_a_type_error_at_construction():
    import pytest

    from stepscope.config import Config
    from stepscope.sinks import MemorySink

    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        Tracer(Config(out_dir="x"), model=object(), sink=MemorySink())
