"""The recording core, driven on CPU.

A small lagging GPU stands in for CUDA here: events complete when the simulated device,
running ``lag`` steps behind the host, reaches them; each knows the stream it was recorded
on; ``elapsed_time`` on an unfinished event raises, as CUDA does.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import paths  # tests/support: where the repository is
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stepscope
from stepscope.common.errors import StepscopeWarning
from stepscope.recording.clock import CpuClock, CudaClock
from stepscope.recording.config import Config
from stepscope.recording.dist import spawn_local
from stepscope.recording.schema import read_run
from stepscope.tracer import Tracer


class LagGpu:
    """A device that runs ``lag`` steps behind the host, in order per stream."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.now = 0.0  # ms of work enqueued
        self.history: list[float] = []  # ``now`` at each step end
        self.done = 0.0
        self.queries = 0
        self.syncs = 0
        self.broken: set[int] = set()  # ids of events whose query raises

    def work(self, ms: float) -> None:
        self.now += ms

    def end_step(self) -> None:
        self.history.append(self.now)
        if len(self.history) > self.lag:
            self.done = self.history[-1 - self.lag]

    def catch_up(self) -> None:
        self.done = self.now


class LagEvent:
    def __init__(self, gpu: LagGpu) -> None:
        self.gpu = gpu
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = self.gpu.now

    def query(self) -> bool:
        gpu = self.gpu
        gpu.queries += 1
        if id(self) in gpu.broken:
            raise RuntimeError("cudaErrorLaunchFailure")
        return self.t is not None and self.t <= gpu.done

    def done(self) -> bool:
        return self.t is not None and self.t <= self.gpu.done

    def elapsed_time(self, other: LagEvent) -> float:
        if not (self.done() and other.done()):
            raise RuntimeError("cudaErrorNotReady")
        assert self.t is not None and other.t is not None
        return other.t - self.t

    def synchronize(self) -> None:
        self.gpu.syncs += 1
        self.gpu.catch_up()


def lag_clock(gpu: LagGpu, streams: bool = True) -> CudaClock:
    if not streams:
        return CudaClock(lambda: LagEvent(gpu), current_device=lambda: 0)
    return CudaClock(lambda: LagEvent(gpu), current_device=lambda: 0, current_stream=lambda dev: "default")


def _many_marks(tr: Any, gpu: LagGpu, steps: int, phases: int) -> None:
    for _ in range(steps):
        with tr.step():
            for i in range(phases):
                with tr.phase(f"p{i % 7}"):
                    gpu.work(0.5)
        gpu.end_step()


def _wait_for(pred: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


# ------------------------------------------------------------- §3.1 records lost


@pytest.mark.parametrize("streams", [True, False], ids=["stream-known", "stream-unknown"])
def test_steps_with_17_marks_resolve_during_the_run(mem_tracer, streams):
    """Main: the per-poll budget of 16 queries restarted at each step's first mark, so a
    step with 17+ marks never resolved before finish() (and only the last 256 reached it)."""
    gpu = LagGpu(lag=2)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu, streams), flush_every_n_steps=1)
    _many_marks(tr, gpu, steps=30, phases=8)  # 2 + 2*8 = 18 marks per step
    assert len(tr.resolver.pending) <= gpu.lag + 1, "steps stay pending far behind the GPU"
    assert _wait_for(lambda: len(tr.sink.records) >= 30 - gpu.lag - 1)
    assert len(tr.recent_records()) >= 30 - gpu.lag - 1, "summary()/live line see nothing"
    gpu.catch_up()
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == list(range(30))


def test_300_marks_per_step_gpu_100_steps_behind_nothing_lost_no_sync(mem_tracer):
    gpu = LagGpu(lag=100)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu), flush_every_n_steps=1, max_pending_steps=256)
    n = 400
    _many_marks(tr, gpu, steps=n, phases=150)  # 302 marks per step
    assert gpu.syncs == 0
    assert len(tr.resolver.pending) <= gpu.lag + 1
    assert _wait_for(lambda: len(tr.sink.records) >= n - gpu.lag - 1), len(tr.sink.records)
    # One stream: one query per pending step checked, not one per mark.
    assert gpu.queries < 20 * n, f"{gpu.queries} queries for {n} steps"
    gpu.catch_up()
    tr.finish()
    steps = [r["step"] for r in tr.sink.records]
    assert steps == list(range(n)), "records lost or doubled"
    assert all(r["dropped"] == {} for r in tr.sink.records)
    assert gpu.syncs == 0


def test_a_backlog_drains(mem_tracer):
    """The GPU stalls for 200 steps, then catches up: more than one step resolves per exit."""
    gpu = LagGpu(lag=10_000)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu), flush_every_n_steps=1, max_pending_steps=256)
    _many_marks(tr, gpu, steps=200, phases=3)
    assert len(tr.resolver.pending) == 200
    gpu.lag = 0
    _many_marks(tr, gpu, steps=40, phases=3)
    assert len(tr.resolver.pending) <= 1, "the backlog never drained"
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == list(range(240))


def test_cpu_clock_takes_the_same_pending_path(mem_tracer):
    """§1: no CPU shortcut around the resolver: a CPU step is pending, then checked."""
    asked: list[int] = []

    class SpyClock(CpuClock):
        def checkpoints(self, marks):  # type: ignore[no-untyped-def]
            out = super().checkpoints(marks)
            asked.append(len(out))
            return out

    tr = mem_tracer(auto=False, clock=SpyClock(), flush_every_n_steps=1)
    for _ in range(5):
        with tr.step(), tr.phase("a"):
            pass
    assert asked == [1] * 5, "CPU steps must go through the readiness check, one per step"
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == list(range(5))


# ------------------------------------------------- §3.10a one bad query ≠ timing off


def test_one_event_query_error_drops_that_step_only(mem_tracer):
    gpu = LagGpu(lag=0)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu), flush_every_n_steps=1)
    with tr.step(), tr.phase("a"):
        gpu.work(1.0)
    gpu.end_step()
    (step0,) = tr.resolver.pending
    gpu.broken.add(id(step0.end.event))  # the step's last mark on its stream is queried
    for _ in range(5):
        with tr.step(), tr.phase("a"):
            gpu.work(1.0)
        gpu.end_step()
        gpu.broken.clear()
    tr.finish()
    assert tr.enabled, "one query error switched timing off for the run"
    recs = tr.sink.records
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[0]["dropped"] == {"unreadable": 1}


# ------------------------------------------------------------------ CudaClock(device=)


def test_cuda_clock_records_on_the_given_devices_stream():
    seen: list[tuple[int, Any]] = []

    class Ev:
        def record(self, stream: Any = None) -> None:
            seen.append(stream)

    clk = CudaClock(lambda: Ev(), current_device=lambda: 0, current_stream=lambda d: ("s", d), device=3)
    m = clk.mark()
    assert m.device == 3 and m.stream == ("s", 3) and seen == [("s", 3)]
    assert clk.device == "cuda:3"
    m2 = clk.mark()
    assert m2.seq > m.seq
    assert clk.checkpoints([m, m2]) == [m2]
    with pytest.raises(ValueError, match="device"):
        CudaClock(lambda: Ev(), current_device=lambda: 0, device=-1)


def test_default_clock_accepts_a_device():
    from stepscope.recording.clock import default_clock

    clk = default_clock(device=0)
    assert clk.kind == ("cuda" if torch.cuda.is_available() else "cpu")



# ------------------------------------------- §3.5 a disk error never crashes the job


class FullDisk:
    def __init__(self) -> None:
        self.failed = threading.Event()

    def write(self, records: Any) -> None:
        self.failed.set()
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        pass


def test_a_disk_error_mid_run_is_acted_on_by_the_training_thread():
    """Main: the writer thread called fail(), which removed the optimizer hooks while the
    training thread iterated them: ``OrderedDict mutated during iteration`` in opt.step()."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = FullDisk()
    tr = Tracer(Config(out_dir="unused", flush_every_n_steps=1), model=model, optimizer=opt,
                clock=CpuClock(), sink=sink)
    waited = []

    def user_pre_hook(o: Any, args: Any, kwargs: Any) -> None:
        # The user's own hook, after stepscope's: the disk fails while opt.step() iterates.
        if not waited and sink.failed.wait(10):
            waited.append(1)
            time.sleep(0.3)

    opt.register_step_pre_hook(user_pre_hook)
    opt.register_step_pre_hook(lambda o, a, k: None)  # iteration goes on past the user's hook
    with pytest.warns(StepscopeWarning, match="timing disabled"):
        for _ in range(4):
            with tr.step():
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert waited, "the disk error never happened"
    assert not tr.enabled, "the failure was never acted on"
    tr.finish()


# --------------------------------------- §3.9 another thread's phase, per-thread tokens


def test_a_background_threads_phase_does_not_swallow_the_step(mem_tracer):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt, flush_every_n_steps=1)
    opened, release = threading.Event(), threading.Event()

    def logger() -> None:
        with tr.phase("log_upload"):
            opened.set()
            release.wait(10)

    for i in range(3):
        with tr.step():
            if i == 1:
                t = threading.Thread(target=logger)
                t.start()
                assert opened.wait(10)
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if i == 1:
                release.set()
                t.join()
    tr.finish()
    recs = tr.sink.records
    assert len(recs) == 3
    paths = {p["path"] for p in recs[1]["phases"]}
    assert {"forward", "backward", "optimizer", "log_upload"} <= paths, paths
    assert not any(p.startswith("log_upload/") for p in paths), paths


def test_sampled_owner_names_the_thread_of_an_open_sampled_step_and_nothing_else(mem_tracer):
    """The per-step hooks compare ``sampled_owner`` with the calling thread before anything
    else: it must be the owner's ident inside a sampled step only (not between steps, not on
    an unsampled step, not after timing was switched off), else a hook would time a forward
    the gate would have refused."""
    model = torch.nn.Linear(4, 1)
    tr = mem_tracer(model=model, every_n_steps=2)
    me = threading.get_ident()
    seen = []
    for _ in range(4):
        with tr.step():
            seen.append(tr.sampled_owner)
            model(torch.randn(2, 4))
        assert tr.sampled_owner == 0
    assert seen == [me, 0, me, 0]
    assert tr.settle()
    recs = tr.recent_records()
    assert [r["step"] for r in recs] == [0, 2]
    assert [p["calls"] for r in recs for p in r["phases"] if p["name"] == "forward"] == [1, 1]
    with pytest.warns(StepscopeWarning, match="switched off"), tr.step():
        tr.fail(RuntimeError("switched off"))
        assert tr.sampled_owner == 0
        model(torch.randn(2, 4))  # a hook after the switch-off times nothing, raises nothing
    tr.finish()


def test_the_heartbeat_reads_when_the_open_phase_started_from_a_host_mark(mem_tracer):
    """On the host clock a span keeps no wall time of its own (one clock read fewer a phase):
    ``state()`` derives it from the span's ``perf_counter_ns`` mark."""
    tr = mem_tracer(auto=False)
    with tr.step():
        before = time.time()
        with tr.phase("load"):
            after = time.time()
            time.sleep(0.05)
            st = tr.state()
            assert st["phase_stack"] == ["load"]
            assert tr.owner_stack()[0].wall is None
            assert before - 0.005 <= st["phase_started"] <= after + 0.005
    tr.finish()


def test_a_decorated_phase_entered_by_two_threads_closes_each_threads_own(mem_tracer):
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    @tr.phase("work")
    def work(first: bool) -> None:
        if first:
            a_in.set()
            assert b_in.wait(10)
        else:
            b_in.set()
            assert a_out.wait(10)
            time.sleep(0.05)

    def a() -> None:
        work(True)
        a_out.set()

    with tr.step():
        ta = threading.Thread(target=a)
        tb = threading.Thread(target=work, args=(False,))
        ta.start()
        assert a_in.wait(10)
        tb.start()
        ta.join()
        tb.join()
    tr.finish()
    (rec,) = tr.sink.records
    ph = {p["path"]: p for p in rec["phases"]}
    assert set(ph) == {"work"}, "one thread's phase nested under another's"
    assert ph["work"]["calls"] == 2


# ---------------------------------------- phases between steps


def test_a_user_phase_between_steps_does_not_pull_the_next_step_back(mem_tracer):
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    for _ in range(3):
        with tr.phase("eval"):  # evaluation between steps
            time.sleep(0.3)
        with tr.step(), tr.phase("work"):
            time.sleep(0.005)
    tr.finish()
    recs = tr.sink.records
    assert len(recs) == 3
    for r in recs:
        assert r["step_ms"] < 150, f"a 5 ms step recorded as {r['step_ms']} ms"
        assert [p["name"] for p in r["phases"]] == ["work"]


def test_a_manual_dataloader_phase_before_the_step_belongs_to_it(mem_tracer):
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    for _ in range(2):
        with tr.phase("dataloader"):
            time.sleep(0.05)
        with tr.step(), tr.phase("work"):
            time.sleep(0.005)
    tr.finish()
    for r in tr.sink.records:
        ph = {p["name"]: p for p in r["phases"]}
        assert set(ph) == {"dataloader", "work"}
        assert ph["dataloader"]["start_ms"] == 0.0 and ph["dataloader"]["ms"] >= 40
        assert r["step_ms"] >= ph["dataloader"]["ms"] + ph["work"]["ms"] - 1e-3


# -------------------------------- §3.2 backward collectives on an autograd thread


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; all-reduces the gradient in backward (tensor-parallel style)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


def test_backward_on_a_device_thread_times_its_collectives_and_nothing_else(
    world1: Any, mem_tracer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA, backward runs on a device thread while the owner blocks; the thread-local
    gate was never raised there, so backward all-reduces/reduce-scatters were unseen."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _AllReduceGrad.apply(self.lin(x))

    import torch.autograd as autograd

    model = Net()
    tr = mem_tracer(model=model, auto={"forward", "backward"}, flush_every_n_steps=1)
    device_thread = ThreadPoolExecutor(1)  # stands in for autograd's device thread
    run_engine = autograd._engine_run_backward
    engine_threads: list[int] = []

    def on_device_thread(*args: Any, **kwargs: Any) -> Any:
        # As on CUDA: the owner calls loss.backward() and blocks; the engine runs the graph on
        # the device's worker thread.
        def run() -> Any:
            engine_threads.append(threading.get_ident())
            return run_engine(*args, **kwargs)

        return device_thread.submit(run).result()

    def unrelated() -> None:
        dist.all_reduce(torch.ones(3))  # same thread, outside the owner's graph task

    monkeypatch.setattr(autograd, "_engine_run_backward", on_device_thread)
    try:
        for _ in range(3):
            with tr.step():
                loss = model(torch.randn(2, 4)).sum()
                loss.backward()
                device_thread.submit(unrelated).result()
    finally:
        device_thread.shutdown()
    assert len(engine_threads) == 3 and threading.get_ident() not in engine_threads
    tr.finish()
    recs = tr.sink.records
    assert len(recs) == 3
    for r in recs:
        cs = r.get("collectives", [])
        assert [(c["phase"], c["op"], c["count"]) for c in cs] == [("backward", "all_reduce", 1)], cs
        assert {p["path"] for p in r["phases"]} == {"forward", "backward"}


# -------------------------------------- §3.3 FSDP2: no grad_sync, reduce-scatters timed

FSDP_STEPS = 3


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    import stepscope

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stepscope.init(out_dir=out, model=model, optimizer=opt, flush_every_n_steps=1)
    import torch.autograd as autograd

    device_thread = ThreadPoolExecutor(1)  # backward's engine off the owner thread, as on CUDA
    run_engine = autograd._engine_run_backward

    def on_device_thread(*args: Any, **kwargs: Any) -> Any:
        return device_thread.submit(run_engine, *args, **kwargs).result()

    autograd._engine_run_backward = on_device_thread
    for _ in range(FSDP_STEPS):
        with stepscope.step():
            loss = model(torch.randn(8, 16)).sum()
            loss.backward()  # the owner calls it and blocks, the engine runs on the device thread
            opt.step()
            opt.zero_grad()
    autograd._engine_run_backward = run_engine
    device_thread.shutdown()
    stepscope.finish()
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_has_no_grad_sync_and_its_backward_reduce_scatters_are_timed(tmp_path: Path):
    out = tmp_path / "run"
    spawn_local(_fsdp_worker, 2, out)
    recs = read_run(out)
    assert len(recs) == 2 * FSDP_STEPS
    for r in recs:
        names = {p["name"] for p in r["phases"]}
        assert "grad_sync" not in names, "FSDP2's grad_sync is ~0 on every rank: meaningless"
        assert {"forward", "backward", "optimizer"} <= names
        bwd = [c for c in r.get("collectives", []) if c["phase"] == "backward"
               and c["op"].startswith("reduce_scatter")]
        assert sum(c["count"] for c in bwd) == 2, r.get("collectives")


# --------------------------------------------------------- §4 the shape, by its imports

SRC = paths.SRC
FORBIDDEN = ("stepscope.analysis", "stepscope.report", "duckdb", "rich", "matplotlib", "pandas")


def _imports(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions."""
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _module_file(name: str) -> tuple[Path, str] | None:
    rel = Path(*name.split("."))
    parent = name.rpartition(".")[0]
    for cand, pkg in ((SRC / rel / "__init__.py", name), (SRC / rel.with_suffix(".py"), parent)):
        if cand.is_file():
            return cand, pkg
    return None


def _closure(root: str) -> dict[str, str]:
    """Every module reachable from ``root`` by imports (stepscope's own, followed; forbidden
    ones, recorded) -> the module that imports it first."""
    seen = {root: "<root>"}
    todo = [root]
    while todo:
        name = todo.pop()
        found = _module_file(name)
        if found is None:
            continue
        for imp in _imports(*found):
            if imp.startswith(FORBIDDEN):
                top = imp.split(".")[0] if not imp.startswith("stepscope") else ".".join(imp.split(".")[:2])
                seen.setdefault(top, name)
                continue
            if not imp.startswith("stepscope"):
                continue
            parts = imp.split(".")
            # The longest prefix that is a module (``from a.b import c``: ``a.b.c`` or ``a.b``).
            for i in range(len(parts), 0, -1):
                sub = ".".join(parts[:i])
                if _module_file(sub) is not None:
                    if sub not in seen:
                        seen[sub] = name
                        todo.append(sub)
                    break
    return seen


#: Edges into analysis/report/rich from recording-side modules, known
#: when this test was written (the live line and auto-profiling reuse the one wait rule and the
#: one robust-stats module). Nothing else may appear; remove an entry once its edge is gone.
#: The one allowed edge: the opt-in live line (rank 0, ``log_every_n_steps``) renders with rich,
#: imported when the live view starts, never by ``import stepscope``. Robust statistics, the wait
#: rule and the escapers live in ``stepscope.common``, used by both sides.
#: The rich markup escaper sits beside the other escapers in ``stepscope.common.escape`` and
#: imports rich only when called (by the live line or a report), never on ``import stepscope``.
KNOWN = {("rich", "stepscope.listeners.live"), ("rich", "stepscope.common.escape")}


def test_the_recording_side_never_imports_analysis_or_report():
    reach = _closure("stepscope")
    bad = {(m, by) for m, by in reach.items() if m.startswith(FORBIDDEN)} - KNOWN
    bad = {(m, by) for m, by in bad if not by.startswith(("stepscope.analysis", "stepscope.report"))}
    assert not bad, f"recording side imports (module, imported by): {sorted(bad)}"
    # The core of the recording side reaches none of them, even through its own imports.
    for core in ("stepscope.recording.recorder", "stepscope.recording.step",
                 "stepscope.recording.resolver", "stepscope.recording.clock",
                 "stepscope.recording.session", "stepscope.tracer"):
        found = _module_file(core)
        assert found is not None
        direct = _imports(*found)
        assert not [m for m in direct if m.startswith(FORBIDDEN)], (core, direct)


@pytest.mark.parametrize("core", ["stepscope.recording.recorder", "stepscope.recording.step",
                                  "stepscope.recording.resolver", "stepscope.recording.clock"])
def test_the_recorder_imports_no_instrument_and_no_observer(core):
    allowed = ("stepscope.instrument", "stepscope.recording.gate")
    observers = ("stepscope.listeners.live", "stepscope.listeners.autoprofile",
                 "stepscope.listeners.heartbeat", "stepscope.listeners.profiler",
                 "stepscope.lifecycle", "stepscope.recording.session", "stepscope.tracer",
                 "stepscope.prefetch",
                 "stepscope.integrations", "stepscope.recording.sinks")
    found = _module_file(core)
    assert found is not None
    direct = _imports(*found)
    bad = [m for m in direct
           if (m.startswith("stepscope.instrument") and m not in allowed and not m.startswith(allowed[1]))
           or m.startswith(observers)]
    assert not bad, f"{core} imports {bad}"


# ------------------------------------------- the hot path and the writer


def test_phases_aggregate_by_path_repeated_and_nested(mem_tracer):
    """The writer's one-pass record build: calls summed per path, first start, last end,
    nested time inside its parent, residual = step - top-level phases (exact GPU-style times)."""
    gpu = LagGpu(lag=0)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu), flush_every_n_steps=1)
    with tr.step():
        gpu.work(0.25)  # before any phase: residual
        with tr.phase("a"):
            gpu.work(1.0)
        with tr.phase("a"):
            gpu.work(1.5)
            with tr.phase("b"):
                gpu.work(0.5)
            with tr.phase("b"):
                gpu.work(0.25)
        with tr.phase("c"):
            gpu.work(2.0)
        gpu.work(0.5)
    gpu.end_step()
    tr.finish()
    (rec,) = tr.sink.records
    got = {p["path"]: p for p in rec["phases"]}
    assert list(got) == ["a", "a/b", "c"], "first-appearance order by path"
    a, ab, c = got["a"], got["a/b"], got["c"]
    assert (a["calls"], a["ms"], a["start_ms"], a["end_ms"]) == (2, 3.25, 0.25, 3.5)
    assert (ab["calls"], ab["ms"], ab["start_ms"], ab["end_ms"], ab["parent"]) == (2, 0.75, 2.75, 3.5, "a")
    assert (c["calls"], c["ms"], c["parent"], c["name"]) == (1, 2.0, None, "c")
    assert rec["step_ms"] == 6.0 and rec["residual_ms"] == 0.75
    assert all("host_ms" not in p for p in rec["phases"])
    assert list(a) == ["name", "path", "parent", "ms", "calls", "start_ms", "end_ms"]


def test_host_phase_carries_host_ms_summed_over_calls(mem_tracer):
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    with tr.step():
        for _ in range(2):
            with tr.phase("wait", host=True):
                time.sleep(0.002)
    tr.finish()
    (p,) = tr.sink.records[0]["phases"]
    assert p["calls"] == 2 and list(p)[-1] == "host_ms"
    assert 4.0 <= p["host_ms"] <= p["ms"] + 0.01


def test_writer_gives_the_gil_back_in_long_batches_only(mem_tracer, monkeypatch):
    """Building a batch can pause between two records; the writer's pause gives the GIL back
    (sleep(0)) once per GIL_SLICE_S of building, so a large held-back batch never holds it
    for long, and a usual batch does not pause at all."""
    from types import SimpleNamespace

    from stepscope.recording import outbox

    tr = mem_tracer(auto=False, flush_every_n_steps=1000)
    for _ in range(5):
        with tr.step(), tr.phase("a"):
            pass
    tr.resolver.poll()
    steps = tr.resolver.take_ready()
    pauses: list[int] = []
    records = tr.resolver.build(steps, pause=lambda: pauses.append(1))
    assert [r["step"] for r in records] == list(range(5)) and len(pauses) == 4
    tr.finish()

    cpu, wall = [0.0], [0.0]
    slept: list[float] = []
    cpu_reads: list[float] = []

    def thread_time() -> float:
        cpu_reads.append(cpu[0])
        return cpu[0]

    monkeypatch.setattr(outbox, "time", SimpleNamespace(
        thread_time=thread_time, perf_counter=lambda: wall[0], sleep=slept.append))
    slicer = outbox._GilSlicer()
    for t in (0.0002, 0.0005, 0.0009):
        cpu[0] = wall[0] = t
        slicer()
    assert slept == [], "a short batch keeps the GIL"
    assert len(cpu_reads) == 1, "inside a slice only the wall clock is read (no system call per record)"
    wall[0] = 0.004  # preempted: the wall clock moved, the writer's CPU time did not
    cpu[0] = 0.0009
    slicer()
    assert slept == [] and len(cpu_reads) == 2, "off-CPU time is not counted as building"
    wall[0] = 0.00405  # less wall time than the CPU left in the slice: no look, no pause
    slicer()
    assert len(cpu_reads) == 2
    cpu[0] = outbox.GIL_SLICE_S + 0.0001
    wall[0] = 0.0045
    slicer()
    cpu[0] += 0.0005
    wall[0] += 0.0005
    slicer()
    assert slept == [0], "one pause per slice"


def test_a_plain_step_allocates_no_side_collective_or_extra_containers(mem_tracer):
    tr = mem_tracer(auto=False, collectives=False, flush_every_n_steps=1000)
    seen: list[Any] = []
    with tr.step(), tr.phase("a"):
        seen.append(tr._cur)
    step = seen[0]
    assert step.side is None and step.collectives is None and step.extra is None
    tr.add_listener(lambda rec: None)
    tr.finish()
    rec = tr.sink.records[0]
    assert "side_ms" not in rec and "collectives" not in rec


def test_worker_processes_are_listed_without_walking_proc():
    """The children of this process, from /proc/self/task/*/children: the same processes
    psutil's full /proc scan finds."""
    psutil = pytest.importorskip("psutil")
    from stepscope.instrument.resource_sampler import HostMemory

    hm = HostMemory()
    kids = [mp.get_context("spawn").Process(target=time.sleep, args=(30,)) for _ in range(2)]
    for k in kids:
        k.start()
    try:
        fast = sorted(p.pid for p in hm._children())
        slow = sorted(p.pid for p in psutil.Process().children(recursive=False))
        assert {k.pid for k in kids} <= set(fast)
        assert fast == slow
        assert hm.workers_rss_bytes() is not None
    finally:
        for k in kids:
            k.terminate()
            k.join()
        hm.close()


# ------------------------------------------------------------- writer wakes


def _thread_named(name: str) -> threading.Thread:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for t in threading.enumerate():
            if t.name == name and t.native_id is not None:
                return t
        time.sleep(0.01)
    raise AssertionError(f"no thread {name!r}")


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux-only")
def test_heartbeat_and_writer_do_not_preempt_the_training_thread_when_woken(tmp_path):
    """The heartbeat's timer wakes and the writer's hand-over wakes must not take the CPU from
    the training thread that holds the GIL: both run as SCHED_BATCH (fair share, no wake-up
    preemption). The training thread's own policy is left alone. The writer's records are
    bound by time instead (``sinks.DELIVERY_BOUND_S``; see the GPU-simulator tests)."""
    main_policy = os.sched_getscheduler(0)
    tr = Tracer(Config(out_dir=str(tmp_path), auto=False, heartbeat_s=0.05), clock=CpuClock())
    try:
        for name in ("stepscope-heartbeat", "stepscope-writer"):
            tid = _thread_named(name).native_id
            deadline = time.monotonic() + 10  # the thread sets it itself when it starts
            while os.sched_getscheduler(tid) != os.SCHED_BATCH and time.monotonic() < deadline:
                time.sleep(0.01)
            assert os.sched_getscheduler(tid) == os.SCHED_BATCH, name
        for _ in range(3):
            with tr.step():
                pass
        assert os.sched_getscheduler(0) == main_policy
    finally:
        tr.finish()
    assert [r["step"] for r in read_run(tmp_path)] == [0, 1, 2]


def test_records_reach_the_file_within_the_idle_tick_when_the_loop_stops(tmp_path):
    """Steps resolved since the last hand-over are written by the writer's own tick
    (``IDLE_TICK_S``) while the run is still going, not only at the next flush or finish."""
    from stepscope.recording import sinks

    tick = getattr(sinks, "IDLE_TICK_S", 0.5)
    tr = Tracer(Config(out_dir=str(tmp_path), auto=False, flush_every_n_steps=1000, heartbeat_s=0),
                clock=CpuClock())
    try:
        for _ in range(5):
            with tr.step():
                pass
        t0 = time.monotonic()
        got: list[int] = []
        while time.monotonic() - t0 < 20 * tick + 10:  # generous: 2 loaded cores
            got = [r["step"] for r in read_run(tmp_path)] if (tmp_path / "rank0.jsonl").exists() else []
            if len(got) == 5:
                break
            time.sleep(0.02)
        assert got == [0, 1, 2, 3, 4], "a stalled loop's resolved steps never reached the file"
        assert not tr._finished
    finally:
        tr.finish()


def test_step_ends_hand_over_no_sooner_than_every_s_but_an_exception_at_once(mem_tracer, monkeypatch):
    """A hand-over wakes the writer, and each wake costs the training thread ~80-100 µs of its
    CPU on the 2-vCPU test host (the wake, then the GIL hand-back: see
    ``stepscope.recording.outbox``). So a step
    end hands over every ``flush_every_n_steps`` steps *and* no sooner than the outbox's
    ``every_s`` after the last hand-over. A step that raises hands over at once (the
    exception may end the job), and ``flush()`` always does. Nothing is lost meanwhile."""
    from stepscope.recording import sinks

    monkeypatch.setattr(sinks, "IDLE_TICK_S", None)  # no tick taking steps during the checks
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    ob = tr._outbox
    ob.every_s = 3600.0
    calls: list[int] = []
    real = ob.submit

    def counted() -> bool:
        calls.append(tr.step_index)
        return real()

    monkeypatch.setattr(ob, "submit", counted)
    for _ in range(50):
        with tr.step():
            pass
    assert calls == [1], "a step end handed over before every_s had passed"
    with pytest.raises(RuntimeError), tr.step():
        raise RuntimeError("boom")
    assert calls == [1, 51], "a step that raised did not hand over at once"
    ob.every_s, ob.due_at = 0.0, 0.0
    for _ in range(3):
        with tr.step():
            pass
    assert calls == [1, 51, 52, 53, 54], "with every_s = 0 every step end hands over"
    ob.every_s = 3600.0  # from the next hand-over on: the first step end below is still due
    for _ in range(2):
        with tr.step():
            pass
    assert calls == [1, 51, 52, 53, 54, 55]
    tr.flush()
    assert calls == [1, 51, 52, 53, 54, 55, 56], "flush() did not hand over"
    assert tr.settle()
    assert [r["step"] for r in tr.sink.records] == list(range(56))


def test_writer_takes_a_few_stray_steps_only_at_its_tick_not_after_each_batch(mem_tracer, monkeypatch):
    """After a batch, steps resolved meanwhile (fewer than a flush's worth) wait for the next
    hand-over or the idle tick: each would otherwise be a batch and a file write of its own.
    Steps held back while the writer was behind (a flush's worth or more) go right away."""
    from stepscope.recording import sinks

    monkeypatch.setattr(sinks, "IDLE_TICK_S", None)  # no tick racing the checks below
    tr = mem_tracer(auto=False, flush_every_n_steps=10)
    ob = tr._outbox
    for _ in range(3):
        with tr.step():
            pass
    assert tr.resolver.ready_count() == 3
    assert ob._held_job(False) is None, "3 stray steps became a batch of their own"
    job = ob._held_job(True)  # the idle tick takes them
    assert job is not None and [r["step"] for r in job()] == [0, 1, 2]
    tr.resolver.add(_held_step(tr, 3))
    for i in range(4, 13):
        tr.resolver.add(_held_step(tr, i))
    tr.resolver.poll(1 << 30)
    assert tr.resolver.ready_count() == 10
    held = ob._held_job(False)  # ten held back: a flush's worth, taken after the batch
    assert held is not None and [r["step"] for r in held()] == list(range(3, 13))


def _held_step(tr: Tracer, index: int) -> Any:
    from stepscope.recording.step import Step

    step = Step(index)
    step.start, step.end = tr.clock.mark(), tr.clock.mark()
    step.start_unix_ns = time.time_ns()
    return step


# ------------------------------------------------- the training thread's own path


def test_training_thread_makes_few_python_calls_into_stepscope_per_step(mem_tracer):
    """Deterministic (load-independent) proxy of the hot path's cost: Python calls into
    stepscope per step on a tiny model with every automatic instrument (the step boundary,
    forward, backward with its hook and end-of-backward callbacks, optimizer, h2d). Only files
    of the imported package count, wherever the checkout lives (a clone named ``stepscope``
    holds torch's own files under its ``.venv``); the budget leaves a little room."""
    import cProfile
    import pstats

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 8)
    tr = mem_tracer(model=model, optimizer=opt, flush_every_n_steps=10)

    def steps(n: int) -> None:
        for _ in range(n):
            with tr.step():
                model(x.to(torch.float32)).sum().backward()
                opt.step()
                opt.zero_grad()

    steps(20)  # first-step work (grad_sync calibration, the forward check) is not the budget's
    prof = cProfile.Profile()
    prof.enable()
    steps(200)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    package = str(Path(stepscope.__file__).resolve().parent) + os.sep
    ours = sum(v[1] for k, v in stats.items() if os.path.realpath(k[0]).startswith(package)) / 200
    assert ours >= 5, f"{ours:.1f} calls counted: the count must see stepscope's own frames"
    assert ours <= 38, f"{ours:.1f} Python calls into stepscope per step (budget 38)"
    assert len(tr.recent_records()) <= 256  # the run still records (summary() below settles)
    assert tr.summary()["steps"] > 0


def test_summary_waits_for_a_slow_writer_within_the_delivery_bound(mem_tracer):
    """Records are built on the writer thread, which never preempts the training thread: a
    ``summary()`` called between steps first lets the writer catch up (bounded by
    ``sinks.DELIVERY_BOUND_S``), so it covers every step resolved so far."""
    from stepscope.recording.sinks import DELIVERY_BOUND_S

    tr = mem_tracer(auto=False, flush_every_n_steps=5)

    def slow(record: dict[str, Any]) -> None:  # a listener that keeps the writer busy
        time.sleep(0.02)

    tr.add_listener(slow)
    for _ in range(10):
        with tr.step():
            pass
    t0 = time.monotonic()
    s = tr.summary()
    assert time.monotonic() - t0 < DELIVERY_BOUND_S + 5.0  # bounded (margin: loaded CI)
    assert s["steps"] == 10 and s["last_step"] == 9


def test_step_context_binds_and_exits_through_the_tracers_own_methods(mem_tracer):
    """``step()``'s context manager calls the tracer's entry and exit directly (bound methods
    on a per-tracer class): ``as`` still binds the context manager, an exception still
    reaches the exit (and is not swallowed), and two tracers do not share their entries."""
    a, b = mem_tracer(auto=False), mem_tracer(auto=False)
    with a.step() as cm:
        assert cm is a.step() and a.in_step and not b.in_step
    with pytest.raises(KeyError), b.step():
        raise KeyError("x")
    assert not b.in_step and b.step_index == 1 and a.step_index == 1
    a.finish()
    b.finish()
    assert [r["step"] for r in a.sink.records] == [0] and [r["step"] for r in b.sink.records] == [0]


def test_unsampled_steps_read_the_run_queue_clock_only_before_a_sampled_one(mem_tracer):
    """The run-queue read (a system call) is taken at the end of a sampled step and of the
    step before one (its baseline), never between two unsampled steps; a sampled step whose
    previous step's end was not read (the index jumped) carries no ``runq_ms`` rather than a
    wait summed over several steps."""
    tr = mem_tracer(auto=False, every_n_steps=3)
    rq = tr.sched
    if rq is None or not rq.on:
        pytest.skip(f"no run-queue reader here: {getattr(rq, 'reason', 'not a CPU clock')}")
    reads: list[int] = []
    real = rq.step_end

    def spy(thread: int | None = None, wall_ns: int | None = None) -> float | None:
        reads.append(tr.step_index)
        return real(thread, wall_ns)

    rq.step_end = spy  # type: ignore[method-assign]
    for _ in range(8):  # indices 0..7; sampled: 0, 3, 6
        with tr.step():
            pass
    # After each exit the index is the next step's: reads at the ends of 0, 2, 3, 5, 6.
    assert reads == [1, 3, 4, 6, 7]
    with tr.step(index=12):  # sampled, but the end of 7 (the step before it) was not read
        pass
    assert reads[-1] == 13
    tr.finish()
    recs = {r["step"]: r for r in tr.sink.records}
    assert sorted(recs) == [0, 3, 6, 12]
    assert all("runq_ms" in recs[i]["counters"] for i in (0, 3, 6))
    assert "runq_ms" not in recs[12].get("counters", {})


def test_step_stream_and_stream_waits_belong_to_the_open_sampled_step(mem_tracer):
    """``step_stream()`` is the stream of the open step's start mark (None between steps and
    on the host clock); a stream wait is kept in the step, resolves with it and adds no
    collective to the record; outside a step its marks are given back."""
    gpu = LagGpu(lag=0)
    tr = mem_tracer(auto=False, clock=lag_clock(gpu), flush_every_n_steps=1)
    assert tr.step_stream() is None
    stray = tr.clock.mark(), tr.clock.mark()
    tr.add_stream_wait(*stray, ("comm", 1))  # no step open: released, not kept
    assert tr.clock.mark() is stray[1] and tr.clock.mark() is stray[0]  # back in the pool
    with tr.step():
        assert tr.step_stream() == "default"
        gpu.work(1.0)
        tr.add_stream_wait(tr.clock.mark(), tr.clock.mark(), ("comm", 2))
        gpu.end_step()
    tr.finish()
    (rec,) = tr.sink.records
    assert "collectives" not in rec
    cpu = mem_tracer(auto=False, flush_every_n_steps=1)
    with cpu.step():
        assert cpu.step_stream() is None
    cpu.finish()
