"""The measurement core's GPU hazards and silent losses, driven on CPU.

No GPU is available where this suite runs, so each CUDA hazard is reproduced with fake
events whose behaviour follows the real API: ``query()`` never blocks, ``elapsed_time()`` on
an unfinished event raises (as CUDA does with cudaErrorNotReady), and events remember the
device they were first recorded on and refuse another (as CUDA does). Each test says what it
would have caught in the code before the redesign.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import stepscope
from stepscope.instrument import hooks
from stepscope.recording.clock import CudaClock, GpuAnchor

MAIN = threading.get_ident()


class Gpu:
    """Per-device GPU timelines advanced by hand; records which threads touch events."""

    def __init__(self) -> None:
        self.device = 0
        self.now: dict[int, float] = {0: 0.0, 1: 0.0}
        self.done: dict[int, float] = {0: 0.0, 1: 0.0}
        self.threads: set[int] = set()
        self.lagging: set[int] = set()  # ids of events whose completion is held back
        self.unreadable = False  # elapsed_time raises (a driver error) while set

    def work(self, ms: float) -> None:
        self.now[self.device] += ms

    def complete(self) -> None:
        self.done = dict(self.now)


class Event:
    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.t: float | None = None
        self.dev: int | None = None

    def record(self) -> None:
        gpu = self.gpu
        gpu.threads.add(threading.get_ident())
        if self.dev is not None and self.dev != gpu.device:
            raise RuntimeError("event recorded on another device")  # what CUDA does
        self.dev = gpu.device
        self.t = gpu.now[gpu.device]

    def query(self) -> bool:
        self.gpu.threads.add(threading.get_ident())
        if id(self) in self.gpu.lagging:
            return False
        return self.t is not None and self.dev is not None and self.t <= self.gpu.done[self.dev]

    def elapsed_time(self, other: Event) -> float:
        self.gpu.threads.add(threading.get_ident())
        if self.gpu.unreadable:
            raise RuntimeError("cudaErrorUnknown")
        if not (self.query() and other.query()):
            raise RuntimeError("cudaErrorNotReady")
        assert self.t is not None and other.t is not None
        return other.t - self.t


def clock(gpu: Gpu) -> CudaClock:
    return CudaClock(lambda: Event(gpu), current_device=lambda: gpu.device)


# ------------------------------------------------------------------ GPU hazards


def test_events_are_only_touched_on_the_training_thread(mem_tracer):
    """Hazard 1: the writer thread used to query events (a CUDA context on GPU 0 per rank)."""
    gpu = Gpu()
    tr = mem_tracer(auto=False, clock=clock(gpu), flush_every_n_steps=2)
    for _ in range(12):
        with tr.step(), tr.phase("forward"):
            gpu.work(2.0)
        gpu.complete()
    tr.finish()
    assert len(tr.sink.records) == 12
    assert gpu.threads == {MAIN}, "a CUDA event was queried or read off the training thread"


def test_nothing_is_queried_while_the_stream_is_capturing(mem_tracer):
    """Hazard 1: a query during CUDA-graph capture breaks the capture."""
    gpu = Gpu()
    tr = mem_tracer(auto=False, clock=clock(gpu), flush_every_n_steps=1)
    capturing = [True]
    tr.resolver._capturing = lambda: capturing[0]
    queried: list[int] = []
    orig = Event.query

    def spy(self: Event) -> bool:
        queried.append(1)
        return orig(self)

    Event.query = spy  # type: ignore[method-assign]
    try:
        for _ in range(3):
            with tr.step():
                gpu.work(1.0)
            gpu.complete()
        assert queried == [] and len(tr.resolver.pending) == 3
        capturing[0] = False
        with tr.step():
            gpu.work(1.0)
        gpu.complete()
        tr.finish()
    finally:
        Event.query = orig  # type: ignore[method-assign]
    assert [r["step"] for r in tr.sink.records] == [0, 1, 2, 3]


def test_one_pool_per_device_and_foreign_marks_are_dropped_not_fatal(mem_tracer):
    """Hazard 2: one pool reused an event on another device → raise → timing off for good."""
    gpu = Gpu()
    clk = clock(gpu)
    assert clk.device == "cuda", "no device is decided before the first mark"
    tr = mem_tracer(auto=False, clock=clk, flush_every_n_steps=1)
    for i in range(6):
        gpu.device = i % 2  # a process that drives two GPUs, one step each
        with tr.step(), tr.phase("forward"):
            gpu.work(1.0)
        gpu.complete()
    gpu.device = 0
    with tr.step():
        with tr.phase("stage0"):
            gpu.work(1.0)
        gpu.device = 1
        with tr.phase("stage1"):  # a pipeline stage on the other GPU inside a step
            gpu.work(1.0)
        gpu.device = 0
    gpu.complete()
    tr.finish()
    assert tr.enabled, "a mark on another device must not switch timing off"
    recs = tr.sink.records
    assert len(recs) == 7 and clk.device == "cuda:0"
    assert all(p["name"] == "forward" for r in recs[:6] for p in r["phases"])
    last = recs[-1]
    assert [p["name"] for p in last["phases"]] == ["stage0"]
    assert sum(r["dropped"].get("foreign_device", 0) for r in recs) == 1


def test_start_events_are_checked_and_unreadable_steps_are_dropped(mem_tracer):
    """Hazard 3: only end events were checked; a lagging start made elapsed_time raise."""
    gpu = Gpu()
    clk = clock(gpu)
    tr = mem_tracer(auto=False, clock=clk, flush_every_n_steps=1)
    with tr.step():
        token = tr.open_phase("copy")
        gpu.work(3.0)
        tr.close_phase(token)
    assert token is not None
    gpu.complete()
    gpu.lagging.add(id(token.start.event))  # start recorded on a stream that lags
    with tr.step():
        gpu.work(1.0)
    gpu.complete()
    assert [s.index for s in tr.resolver.pending] == [0, 1], "the unready step waits"
    gpu.lagging.clear()
    # A step whose times cannot be read at all is dropped and counted, timing stays on.
    with tr.step():
        gpu.work(1.0)
    gpu.unreadable = True
    gpu.complete()
    with tr.step():  # its exit polls: steps 0 and 1 resolve, step 2 cannot be read
        gpu.work(1.0)
    gpu.unreadable = False
    gpu.complete()
    with tr.step():
        gpu.work(1.0)
    gpu.complete()
    tr.finish()
    assert tr.enabled
    assert [r["step"] for r in tr.sink.records] == [0, 1, 3, 4]
    assert sum(r["dropped"].get("unreadable", 0) for r in tr.sink.records) == 1


def test_gpu_anchor_removes_each_ranks_host_ahead_of_gpu_lag():
    """Hazard 4: host entry time + GPU offsets shifted every rank by its own lag (3-6 ms),
    which hid a 5 ms straggler. The anchor puts GPU time on the wall clock instead."""
    results = {}
    for rank, lag_ms in ((0, 3.0), (1, 6.0)):
        gpu = Gpu()
        clk = clock(gpu)
        anchor = GpuAnchor(clk)
        wall0 = 1_000_000_000_000
        errors = []
        for i in range(40):
            gpu_start = i * 20.0  # the GPU runs step i's start event at this wall ms
            # The host enqueues it ahead of the GPU: by lag_ms, except at a sync point
            # every 10 steps (a .item()) where the GPU has caught up.
            host_ms = gpu_start - (0.0 if i % 10 == 0 else lag_ms)
            gpu.now[0] = gpu_start
            m = clk.mark()
            gpu.now[0] = gpu_start + 5.0
            gpu.complete()
            got = anchor.wall_ns(m, wall0 + int(host_ms * 1e6))
            assert got is not None
            errors.append(abs(got - (wall0 + gpu_start * 1e6)) / 1e6)
            if not anchor.owns(m):
                clk.release(m)
        results[rank] = errors
    for _rank, errors in results.items():
        assert max(errors) < 0.01, f"anchored start off by up to {max(errors):.3f} ms"


def test_host_only_phases_carry_host_ms_on_the_cuda_clock(mem_tracer):
    """Hazard 5: events around next(loader) time GPU idle, not the host's wait."""
    gpu = Gpu()
    tr = mem_tracer(auto=True, clock=clock(gpu), flush_every_n_steps=1)

    def slow_source():
        for i in range(3):
            time.sleep(0.02)  # the host waits; the GPU does nothing meanwhile
            yield i

    for _ in tr.wrap_loader(slow_source()):
        with tr.step():
            with tr.phase("wait_queue", host=True):
                time.sleep(0.01)
            gpu.work(1.0)
        gpu.complete()
    tr.finish()
    for r in tr.sink.records:
        ph = {p["path"]: p for p in r["phases"]}
        assert ph["dataloader"]["ms"] == 0.0  # GPU time: nothing ran
        assert ph["dataloader"]["host_ms"] >= 15.0
        assert ph["wait_queue"]["host_ms"] >= 8.0


# --------------------------------------------------------- silent losses, wrong numbers


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_model_compiled_after_init_warns_once_instead_of_losing_forward(mem_tracer):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt, flush_every_n_steps=1)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    with pytest.warns(stepscope.StepscopeWarning, match="no forward span"):
        for _ in range(4):
            with tr.step():
                compiled(x).sum().backward()
                opt.step()
                opt.zero_grad()
    tr.finish()
    assert tr.enabled


def test_compiled_optimizer_step_is_not_broken_by_the_hooks(mem_tracer):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt, flush_every_n_steps=1)
    step_fn = torch.compile(opt.step, backend="eager")
    for _ in range(3):
        with tr.step():
            model(torch.randn(4, 8)).sum().backward()
            step_fn()
            opt.zero_grad()
    tr.finish()
    assert tr.enabled and len(tr.sink.records) == 3


def test_hooks_of_a_module_dynamo_traces_trace_to_nothing(mem_tracer):
    """The forward hooks and the Tensor.to patch ask dynamo's is-compiling flag first: traced
    inside a compiled caller, they fold to nothing (one graph, no break, no span from inside
    the graph), and the same hooks time the module again when it runs eagerly."""
    import torch._dynamo as dynamo

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt, flush_every_n_steps=1)
    outer = torch.nn.Sequential(model)  # the compiled caller; the hooked module is inside it

    def f(x):
        return outer(x.to(torch.float32)).sum()

    x = torch.randn(4, 8)
    with tr.step():
        got = dynamo.explain(f)(x)
    with tr.step():
        model(x).sum().backward()
    tr.finish()
    assert (got.graph_count, got.graph_break_count) == (1, 0)
    first, second = ([p["name"] for p in r["phases"]] for r in tr.sink.records)
    assert first == []
    assert "forward" in second and "backward" in second


def test_backward_is_timed_again_after_a_backward_that_raised(mem_tracer):
    """Catch-OOM-and-skip: the open backward token used to block every later backward."""
    model = MLP()
    tr = mem_tracer(model=model, flush_every_n_steps=1)
    for i in range(4):
        with tr.step():
            out = model(torch.randn(4, 8)).sum()
            if i == 1:
                out = out * 1.0
                out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")))
                with pytest.raises(RuntimeError, match="out of memory"):
                    out.backward()
                continue
            out.backward()
    tr.finish()
    has_bwd = [any(p["name"] == "backward" for p in r["phases"]) for r in tr.sink.records]
    assert has_bwd[2] and has_bwd[3], has_bwd


def test_gradient_penalty_first_does_not_turn_grad_sync_off(mem_tracer, monkeypatch):
    """torch.autograd.grad accumulates no parameter; calibration must retry, not give up."""
    monkeypatch.setattr(hooks, "_distributed", lambda: True)
    monkeypatch.setattr(hooks.unwrap, "ddp_forward_active", lambda: True)  # as inside DDP
    model = MLP()
    tr = mem_tracer(model=model, flush_every_n_steps=1)
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(3):
        with tr.step():
            out = model(x).sum()
            (g,) = torch.autograd.grad(out, x, create_graph=True)
            (out + g.pow(2).sum()).backward()
    tr.finish()
    paths = [{p["path"] for p in r["phases"]} for r in tr.sink.records]
    assert any("backward/grad_sync" in p for p in paths[1:]), paths


def test_phases_are_keyed_by_path(mem_tracer):
    """A name under two parents (h2d in forward and at top level) must stay two rows."""
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    with tr.step():
        with tr.phase("h2d"):
            time.sleep(0.002)
        with tr.phase("forward"), tr.phase("h2d"):
            time.sleep(0.002)
    tr.finish()
    ph = {p["path"]: p for p in tr.sink.records[0]["phases"]}
    assert set(ph) == {"h2d", "forward", "forward/h2d"}
    assert ph["forward/h2d"]["parent"] == "forward" and ph["forward/h2d"]["name"] == "h2d"
    assert ph["h2d"]["calls"] == 1 and ph["forward/h2d"]["calls"] == 1
    top = sum(p["ms"] for p in ph.values() if p["parent"] is None)
    assert top <= tr.sink.records[0]["step_ms"] + 1e-6


def test_decorator_applied_before_init_times_once_init_has_run(tmp_path):
    @stepscope.phase("metrics")
    def log_metrics() -> int:
        time.sleep(0.002)
        return 3

    stepscope.init(out_dir=str(tmp_path), auto=False, flush_every_n_steps=1)
    try:
        with stepscope.step():
            assert log_metrics() == 3
    finally:
        stepscope.finish()
    lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
    assert '"metrics"' in lines[0]


# ------------------------------------------------- training-side promises ----------


def test_a_second_threads_step_is_not_timed_and_does_not_raise(mem_tracer):
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    started, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        started.wait()
        try:
            with tr.step(), tr.phase("other"):
                pass
        except BaseException as exc:  # the test fails below if anything escaped
            errors.append(exc)
        release.set()

    th = threading.Thread(target=other)
    th.start()
    with pytest.warns(stepscope.StepscopeWarning, match="second thread"), tr.step():
        started.set()
        release.wait(5)
        with tr.phase("mine"):
            pass
    th.join()
    tr.finish()
    assert errors == []
    assert [[p["name"] for p in r["phases"]] for r in tr.sink.records] == [["mine"]]


def test_forwards_on_another_thread_are_not_counted(mem_tracer):
    model = MLP()
    tr = mem_tracer(model=model, flush_every_n_steps=1)
    stop = threading.Event()

    def evaluate() -> None:
        while not stop.is_set():
            with torch.no_grad():
                model(torch.randn(2, 8))

    th = threading.Thread(target=evaluate)
    th.start()
    try:
        for _ in range(6):
            with tr.step():
                model(torch.randn(4, 8)).sum().backward()
                time.sleep(0.003)
    finally:
        stop.set()
        th.join()
    tr.finish()
    calls = [next(p["calls"] for p in r["phases"] if p["name"] == "forward") for r in tr.sink.records]
    assert calls == [1] * 6


def test_wait_abandoned_by_break_is_not_charged_to_the_next_step(mem_tracer):
    tr = mem_tracer(auto=True, flush_every_n_steps=1)
    for i, _ in enumerate(tr.wrap_loader(range(10))):
        if i == 3:
            break  # the wait for batch 3 belongs to no step
        with tr.step():
            time.sleep(0.002)
    time.sleep(0.3)  # "evaluation" outside any step
    for _ in tr.wrap_loader(range(2)):
        with tr.step():
            time.sleep(0.002)
    tr.finish()
    recs = tr.sink.records
    assert len(recs) == 5
    assert max(r["step_ms"] for r in recs) < 150, [r["step_ms"] for r in recs]


