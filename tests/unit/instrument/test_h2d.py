"""Step-scoped automatic H2D timing and the manual wrap_h2d proxy.

There is no accelerator here, so the tests add "meta" to the device types that count as a
host-to-device target: the gating logic (in step or not, CPU source or not, which
arguments) is the same code path a CUDA copy takes.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
import torch
from frames import calls_of

from stepscope.instrument import h2d
from stepscope.recording import gate


@pytest.fixture
def meta_is_device(monkeypatch):
    monkeypatch.setattr(h2d, "TARGET_DEVICE_TYPES", {"cuda", "meta"})


@pytest.fixture
def nothing_compiled(monkeypatch):
    """Dynamo's frame counts as in a process that has compiled nothing (other tests compile)."""
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters, "frames", collections.Counter())


def _h2d(rec):
    return next((p for p in rec["phases"] if p["name"] == "h2d"), None)


def test_only_cpu_to_device_copies_inside_steps_count(mem_tracer, meta_is_device):
    tr = mem_tracer(auto={"h2d"})
    x = torch.ones(256, dtype=torch.float32)
    x.to("meta")  # outside any step: model init / checkpoint loading is never counted
    with tr.step():
        x.to(torch.float16)  # dtype-only cast
        x.to("cpu")  # CPU -> CPU
        x.to(torch.device("cpu"), torch.float64)
        y = x.to("meta", non_blocking=True)
        z = x.to(device="meta", dtype=torch.float16)
        y.to("meta")  # already on the device: not a host-to-device copy
    tr.finish()
    rec = tr.sink.records[0]
    assert y.device.type == "meta" and z.dtype == torch.float16
    assert _h2d(rec)["calls"] == 2
    assert rec["counters"]["h2d_bytes"] == 2 * 256 * 4


def test_patch_is_removed_at_finish_and_refcounted(mem_tracer):
    orig = torch.Tensor.to
    a = mem_tracer(auto={"h2d"})
    b = mem_tracer(auto={"h2d"})
    assert torch.Tensor.to is not orig
    a.finish()
    assert torch.Tensor.to is not orig, "b still needs the patch"
    b.finish()
    assert torch.Tensor.to is orig and torch.Tensor.cuda is h2d._orig_cuda


def test_finishing_inside_a_step_lowers_the_flag(mem_tracer, meta_is_device):
    tr = mem_tracer(auto={"h2d"})
    with tr.step():
        tr.finish()
    other = mem_tracer(auto={"h2d"})
    torch.ones(2).to("meta")  # outside any step of `other`: must not reach the dead tracer
    other.finish()
    assert gate.current() is None


def test_other_threads_are_not_counted(mem_tracer, meta_is_device):
    tr = mem_tracer(auto={"h2d"})
    with tr.step():
        t = threading.Thread(target=lambda: torch.ones(8).to("meta"))
        t.start()
        t.join()
    tr.finish()
    assert _h2d(tr.sink.records[0]) is None


def test_unsampled_steps_cost_nothing(mem_tracer, meta_is_device):
    tr = mem_tracer(auto={"h2d"}, every_n_steps=2)
    for _ in range(4):
        with tr.step():
            torch.ones(4).to("meta")
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [0, 2]


def test_the_patch_is_on_only_around_sampled_steps(mem_tracer, meta_is_device, nothing_compiled):
    tr = mem_tracer(auto={"h2d"}, every_n_steps=5)
    patched: list[bool] = []
    for _ in range(11):
        with tr.step():
            patched.append(torch.Tensor.to is not h2d._orig_to)
            torch.ones(4).to("meta")
    tr.finish()
    # On from the end of the step before a sampled one (4, 9) to the end of the sampled one.
    assert patched == [True, False, False, False, False, True, False, False, False, False, True]
    assert [r["step"] for r in tr.sink.records] == [0, 5, 10]
    assert all(_h2d(r)["calls"] == 1 for r in tr.sink.records)
    assert torch.Tensor.to is h2d._orig_to and torch.Tensor.cuda is h2d._orig_cuda


def test_the_patch_stays_on_when_every_step_is_sampled(mem_tracer, monkeypatch):
    tr = mem_tracer(auto={"h2d"})
    swaps: list[str] = []
    monkeypatch.setattr(h2d._patch, "_apply", lambda: swaps.append("on"))
    monkeypatch.setattr(h2d._patch, "_restore", lambda: swaps.append("off"))
    for _ in range(5):
        with tr.step():
            pass
    assert swaps == [] and torch.Tensor.to is not h2d._orig_to
    tr.finish()
    assert swaps == ["off"]
    h2d._restore()


def test_a_copy_before_a_sampled_step_asks_nothing_but_whether_dynamo_traces(
        mem_tracer, meta_is_device, nothing_compiled):
    tr = mem_tracer(auto={"h2d"}, every_n_steps=2)
    x = torch.ones(4)
    for _ in range(2):
        with tr.step():
            pass
    out: list[torch.Tensor] = []
    raised: list[BaseException] = []

    def cuda() -> None:
        try:
            x.cuda()
        except (AssertionError, RuntimeError) as err:  # no CUDA here: torch's own error
            raised.append(err)

    # Between the step before a sampled one and the sampled one: the patch is on, the gate down.
    calls = [*calls_of(lambda: out.append(x.to("meta"))), "--", *calls_of(cuda)]
    y = out[0]
    tr.finish()
    assert y.device.type == "meta"
    assert calls[:calls.index("--")] == ["_patched_to", "is_dynamo_compiling"]
    # torch's own error, raised past the same two checks
    assert raised and calls[calls.index("--") + 1:][:2] == ["_patched_cuda", "is_dynamo_compiling"]
    assert "current" not in calls and "_active" not in calls


def test_a_copy_on_an_unsampled_step_calls_no_stepscope_code(mem_tracer, meta_is_device, nothing_compiled):
    tr = mem_tracer(auto={"h2d"}, every_n_steps=1000)
    x = torch.ones(4)
    with tr.step():
        pass
    out: list[torch.Tensor] = []
    with tr.step():
        calls = calls_of(lambda: out.append(x.to("meta")))
    y = out[0]
    tr.finish()
    assert y.device.type == "meta" and calls == []


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_step_keeps_the_patch_on_and_compiles_once(backend, mem_tracer, nothing_compiled):
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = torch.nn.Linear(8, 8)

    def body(x):  # x.to(device) on an input: its graph guards on the type of x.to
        return model(x.to("cpu").to(torch.float32)).sum()

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    step = torch.compile(body, backend=backend)
    tr = mem_tracer(auto={"h2d"}, every_n_steps=3)
    x = torch.randn(4, 8, dtype=torch.float64)
    patched = []
    for _ in range(9):
        with tr.step():
            patched.append(torch.Tensor.to is not h2d._orig_to)
            step(x)
    tr.finish()
    torch._dynamo.reset()
    assert patched == [True] * 9  # compiled at step 0: never swapped after it
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert not counters["graph_break"]


def test_bad_to_arguments_still_raise_torchs_error(mem_tracer):
    tr = mem_tracer(auto={"h2d"})
    with tr.step(), pytest.raises(TypeError):
        torch.ones(1).to(12345, "nonsense", bogus=True)
    tr.finish()


Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    name: str


class Movable:
    def __init__(self) -> None:
        self.moved_to = None

    def to(self, device, non_blocking=False):
        self.moved_to = device
        return self


def test_wrap_h2d_moves_nested_batches_and_times_them(mem_tracer):
    tr = mem_tracer(auto=False)
    mov = Movable()
    batch = {
        "x": torch.ones(4, 4),
        "pair": Pair(torch.zeros(2), [torch.ones(3), 7]),
        "sample": Sample(torch.ones(2, 2), torch.tensor([1]), "id-1"),
        "tokens": (torch.arange(5), "text"),
        "obj": mov,
    }
    with tr.step():
        out = tr.wrap_h2d(batch).to("cpu", non_blocking=True)
    tr.finish()
    assert isinstance(out["pair"], Pair) and isinstance(out["sample"], Sample)
    assert out["pair"].b[1] == 7 and out["sample"].name == "id-1" and out["tokens"][1] == "text"
    assert torch.equal(out["x"], batch["x"]) and mov.moved_to == "cpu"
    rec = tr.sink.records[0]
    assert _h2d(rec)["calls"] == 1
    expected = sum(t.numel() * t.element_size() for t in
                   [batch["x"], batch["pair"].a, batch["pair"].b[0], batch["sample"].image,
                    batch["sample"].label, batch["tokens"][0]])
    assert rec["counters"]["h2d_bytes"] == expected


def test_wrap_h2d_on_a_tensor_and_attribute_passthrough(mem_tracer):
    tr = mem_tracer(auto=False)
    x = torch.ones(3)
    proxy = tr.wrap_h2d(x)
    assert proxy.shape == (3,)
    with tr.step():
        y = proxy.to("cpu")
    tr.finish()
    assert torch.equal(x, y) and _h2d(tr.sink.records[0])["calls"] == 1


def test_compiled_model_inside_a_step(mem_tracer, meta_is_device):
    """torch.compile of a model called inside a step still compiles and runs correctly."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="aot_eager")
    tr = mem_tracer(model=compiled, auto={"h2d", "forward", "backward"})
    inner = mem_tracer(model=model, auto={"forward"})
    x = torch.randn(4, 8)
    expected = model(x)
    for _ in range(3):
        with tr.step():
            out = compiled(x)
            out.sum().backward()
    tr.finish()
    inner.finish()
    assert torch.allclose(out, expected, atol=1e-6)
    names = [{p["name"] for p in r["phases"]} for r in tr.sink.records]
    assert all({"forward", "backward"} <= n for n in names), names


def test_a_step_moved_onto_a_sampled_index_has_the_patch_at_once(
        mem_tracer, meta_is_device, nothing_compiled):
    tr = mem_tracer(auto={"h2d"}, every_n_steps=10)
    with tr.step():
        pass
    with tr.step():
        assert torch.Tensor.to is h2d._orig_to
    with tr.step(index=10):
        assert torch.Tensor.to is not h2d._orig_to
        torch.ones(4).to("meta")
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [0, 10]
    assert _h2d(tr.sink.records[1])["calls"] == 1
