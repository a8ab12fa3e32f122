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

    from stepscope.recording.config import Config
    from stepscope.recording.sinks import MemorySink

    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        Tracer(Config(out_dir="x"), model=object(), sink=MemorySink())


# ------------------------------------ backward timed at its call (torch.autograd.backward)


def test_backward_wrapper_is_installed_only_while_a_tracer_times_backward(mem_tracer):
    """Installed by the first tracer that times backward, restored when the last one finishes
    (two tracers at once, finished in either order); none installed without backward timing."""
    import torch.autograd as autograd

    real = autograd.backward
    a = mem_tracer(model=Net(), auto={"forward"})
    assert autograd.backward is real  # no backward timing: nothing patched
    b = mem_tracer(model=Net())
    c = mem_tracer(model=Net())
    assert autograd.backward is not real
    b.finish()
    assert autograd.backward is not real  # c still times backward
    c.finish()
    a.finish()
    assert autograd.backward is real


def test_backward_wrapper_stays_when_someone_wrapped_it_after_us(mem_tracer):
    import torch.autograd as autograd

    real = autograd.backward
    tr = mem_tracer(model=Net())
    ours = autograd.backward
    calls = []

    def theirs(*args, **kwargs):
        calls.append(1)
        return ours(*args, **kwargs)

    autograd.backward = theirs  # another library wraps it while we run
    try:
        tr.finish()
        assert autograd.backward is theirs  # not pulled from under the later wrapper
        x = torch.randn(2, 16, requires_grad=True)
        (x * 2).sum().backward()  # ours passes through to the real one
        assert calls == [1] and x.grad is not None
        assert torch.equal(x.grad, torch.full((2, 16), 2.0))
        # A tracer started now uses ours where it is (under theirs): no second layer, no loop.
        model = Net()
        again = mem_tracer(model=model)
        assert autograd.backward is theirs
        with again.step():
            model(torch.randn(2, 16)).sum().backward()
        again.finish()
        assert calls == [1, 1] and _ph(again.sink.records[0])["backward"]["calls"] == 1
    finally:
        autograd.backward = ours  # they unwrap: what they wrapped goes back
    mem_tracer(model=Net()).finish()  # the next finish finds ours on top: the original back
    assert autograd.backward is real


def test_an_exception_inside_backward_closes_it_and_names_it(mem_tracer):
    model = Net()
    tr = mem_tracer(model=model)
    raised = []
    with tr.step():
        out = model(torch.randn(2, 16)).sum() * 1.0
        out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")))
        try:
            out.backward()
        except RuntimeError as exc:
            raised.append(exc)
        assert tr.current_path() is None  # backward closed when the call raised
        model(torch.randn(2, 16)).sum().backward()  # the next backward in the step is timed
    tr.finish()
    assert raised and tr._raised is not None and "backward" in tr._raised[1]
    assert _ph(tr.sink.records[0])["backward"]["calls"] == 2


def test_a_gradient_penalty_pass_is_not_timed_as_a_backward(mem_tracer):
    """torch.autograd.grad is not a training backward."""
    model = Net()
    tr = mem_tracer(model=model)
    with tr.step():
        x = torch.randn(2, 16, requires_grad=True)
        torch.autograd.grad(model(x).sum(), x)
    tr.finish()
    assert [p["path"] for p in tr.sink.records[0]["phases"]] == ["forward"]


def test_a_reentrant_backward_is_not_a_second_backward(mem_tracer):
    """Reentrant checkpointing calls torch.autograd.backward inside the outer one: one
    backward, no ``backward/backward``."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=True))

    model = Ckpt()
    tr = mem_tracer(model=model)
    with tr.step():
        model(torch.randn(2, 16, requires_grad=True)).sum().backward()
    tr.finish()
    rec = tr.sink.records[0]
    assert sorted(p["path"] for p in rec["phases"]) == ["backward", "forward"], rec["phases"]
    assert _ph(rec)["backward"]["calls"] == 1
    assert model.a.weight.grad is not None  # the reentrant backward ran


def test_backward_outside_a_step_or_on_another_thread_is_not_timed(mem_tracer):
    from concurrent.futures import ThreadPoolExecutor

    model = Net()
    tr = mem_tracer(model=model)
    model(torch.randn(2, 16)).sum().backward()  # between steps
    with ThreadPoolExecutor(1) as pool, tr.step():
        loss = model(torch.randn(2, 16)).sum()
        pool.submit(lambda: model(torch.randn(2, 16)).sum().backward()).result()  # not the owner
        loss.backward()
    tr.finish()
    assert len(tr.sink.records) == 1
    assert _ph(tr.sink.records[0])["backward"]["calls"] == 1


# ------------------------------------ hooks on for sampled steps only


def _hooked(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[bool, bool, bool]:
    import torch.autograd as autograd

    from stepscope.instrument import hooks

    return (bool(model._forward_pre_hooks or model._forward_hooks),
            bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks),
            autograd.backward is hooks._timed_backward)


def _sampled_run(tr: Tracer, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 steps: int) -> list[tuple[bool, bool, bool]]:
    """``steps`` training steps; what is hooked inside each one (read during the step)."""
    seen = []
    for _ in range(steps):
        with tr.step():
            seen.append(_hooked(model, opt))
            loss = model(torch.randn(2, 16)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return seen


def test_hooks_are_on_for_sampled_steps_only(mem_tracer):
    """Between and during unsampled steps nothing is hooked (Module.__call__'s fast path, torch's
    own backward); the step before a sampled one puts everything on, and the sampled steps
    time forward, backward and optimizer as before."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt, every_n_steps=3)
    seen = _sampled_run(tr, model, opt, 7)
    assert seen == [(True, True, True) if i % 3 == 0 else (False, False, False) for i in range(7)]
    assert _hooked(model, opt) == (False, False, False)  # after step 6: step 7 is not sampled
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [0, 3, 6]
    for rec in tr.sink.records:
        ph = _ph(rec)
        assert set(ph) == {"forward", "backward", "optimizer"}
        assert ph["forward"]["ms"] >= 3.0 and ph["backward"]["ms"] >= 5.0
        assert ph["forward"]["calls"] == ph["backward"]["calls"] == ph["optimizer"]["calls"] == 1


def test_a_step_index_moved_onto_a_sampled_step_puts_the_hooks_on(mem_tracer):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt, every_n_steps=10)
    _sampled_run(tr, model, opt, 2)  # steps 0 (sampled) and 1
    assert _hooked(model, opt) == (False, False, False)
    tr.step(index=20)
    assert _sampled_run(tr, model, opt, 1) == [(True, True, True)]
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [0, 20]
    assert set(_ph(tr.sink.records[1])) == {"forward", "backward", "optimizer"}


def test_ddp_model_hooked_for_sampled_steps_only(mem_tracer, world1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt, every_n_steps=2)
    seen = _sampled_run(tr, model, opt, 4)
    assert seen == [(True, True, True), (False, False, False)] * 2
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [0, 2]
    for rec in tr.sink.records:
        ph = _ph(rec)
        assert ph["forward"]["ms"] >= 3.0 and ph["backward"]["ms"] >= 5.0
        assert ph["optimizer"]["calls"] == 1


def test_a_compiled_model_keeps_its_hooks_on_every_step(mem_tracer):
    """Dynamo keeps the hooks a module was compiled with, so a compiled model's hooks stay on;
    the optimizer's and the backward wrapper still come off between sampled steps."""
    inner = Net()
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    inner.compile(backend="eager")  # compiled in place: its own __call__ runs under dynamo
    tr = mem_tracer(model=inner, optimizer=opt, every_n_steps=2)
    seen = _sampled_run(tr, inner, opt, 4)
    assert [s[0] for s in seen] == [True] * 4
    assert [s[1:] for s in seen] == [(True, True), (False, False)] * 2
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [0, 2]
    assert not inner._forward_pre_hooks and not inner._forward_hooks  # removed at finish


def test_a_model_compiled_after_init_keeps_its_hooks_from_then_on(mem_tracer):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt, every_n_steps=2)
    _sampled_run(tr, model, opt, 1)
    assert _hooked(model, opt)[0] is False
    tr.step(index=2)
    with tr.step():
        model.compile(backend="eager")  # inside a sampled step, the hooks on
    seen = _sampled_run(tr, model, opt, 3)
    assert [s[0] for s in seen] == [True] * 3


def test_a_forward_and_optimizer_step_of_another_thread_inside_the_step_are_not_timed(mem_tracer):
    """Another thread runs the hooked model and optimizer while the owner's forward is open:
    neither is timed, and the owner's forward is closed by its own post-hook (not at the end
    of the step)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    main = threading.current_thread()

    class Reentrant(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 4)
            self.pool: ThreadPoolExecutor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if threading.current_thread() is main and self.pool is not None:
                self.pool.submit(lambda: (self(x), opt.step())).result()
            return self.lin(x)

    model = Reentrant()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt)
    with ThreadPoolExecutor(1) as pool:
        model.pool = pool
        with tr.step():
            model(torch.randn(2, 16)).sum().backward()
            time.sleep(0.005)  # after forward: a forward left open would end with the step
            opt.step()
    tr.finish()
    ph = _ph(tr.sink.records[0])
    assert ph["forward"]["calls"] == 1 and ph["optimizer"]["calls"] == 1
    assert ph["forward"]["end_ms"] <= ph["backward"]["start_ms"]
