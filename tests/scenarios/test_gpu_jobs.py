"""The GPU scenario matrix, on the simulated CUDA runtime (``tests/support/cudasim.py``).

The real recording side runs with its default clock: the simulator makes
``torch.cuda.is_available()`` true, so stepscope records CUDA events on simulated streams that
complete later (the GPU ``lag_steps`` host steps behind), backward runs on a device thread, and
every host sync is counted. Multi-rank scenarios run real gloo processes, each simulating its
own device. A scenario that fails because of a defect still being fixed is marked
``xfail(strict=True)`` with the defect's number: the mark must go once the fix lands.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import cudasim
import paths  # tests/support: where the repository is
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stepscope
from stepscope.demo import SleepInBackward
from stepscope.recording.dist import become_local_rank, free_port, run_then_exit, spawn_local
from stepscope.recording.schema import read_run

MS = 25.0  # injected slowness: far above a busy 2-core machine's jitter


def _rank_file(out: Path, rank: int = 0) -> Path:
    return out / f"rank{rank}.jsonl"


def _lines_within(path: Path, want: int) -> int:
    """Lines in ``path`` once there are ``want`` of them, or after five times the writer's
    delivery bound (``sinks.DELIVERY_BOUND_S``: the margin is for a loaded 2-core CI host)."""
    from stepscope.recording.sinks import DELIVERY_BOUND_S

    deadline = time.monotonic() + 5 * DELIVERY_BOUND_S
    n = _lines(path)
    while n < want and time.monotonic() < deadline:
        time.sleep(0.02)
        n = _lines(path)
    return n


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# --------------------------------------------------------------------------------------------
# 17+ and 300+ marks per step, the GPU 100 steps behind
# --------------------------------------------------------------------------------------------


def _marks_job(out: Path, sim: cudasim.CudaSim, steps: int, user_phases: int) -> dict[str, Any]:
    """A 3-tensor batch, the automatic phases, and ``user_phases`` user phases per step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 4), torch.ones(64, 1))
    loader = DataLoader(data, batch_size=8, pin_memory=True)  # pinned by the (simulated) CUDA
    stepscope.init(out_dir=str(out), model=model, optimizer=opt, flush_every_n_steps=10)
    sim.reset_counts()
    marks: list[int] = []
    written_at: dict[int, int] = {}
    i = 0
    before = sim.records
    while i < steps:
        for x, y, m in stepscope.wrap_loader(loader):
            if i >= steps:
                break
            with stepscope.step():
                x, y, m = (t.to("cuda", non_blocking=True) for t in (x, y, m))
                out_ = model(x)
                for k in range(user_phases):
                    with stepscope.phase(f"loss{k}"):
                        loss = ((out_ - y) ** 2 * m).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            marks.append(sim.records - before)  # this iteration's, the loader's wait included
            before = sim.records
            sim.host_tick()
            i += 1
            if i in (steps // 2, steps - 1):
                # Delivery is bound by time, not steps: the writer (which never preempts the
                # training thread) gets up to DELIVERY_BOUND_S; no finish(), no host sync.
                written_at[i] = _lines_within(_rank_file(out), i - sim.lag_steps - 30)
    syncs = list(sim.sync_log)
    # The host is done; the GPU, 100 steps behind, works through its queue (an idle host lets
    # it, at the step pace: seconds here). drain() skips that wait; it is not a host sync.
    sim.drain()
    stepscope.finish()
    return {"marks": marks, "written_at": written_at, "syncs": syncs}


def _check_marks(out: Path, res: dict[str, Any], steps: int, lag: int, min_marks: int) -> None:
    assert min(res["marks"]) >= min_marks, res["marks"][:5]
    assert res["syncs"] == [], "the training loop must never block on the GPU"
    # Written DURING the run: by step i, every step the GPU finished (i - lag) less what the
    # writer has not flushed yet (flush_every_n_steps=10, one resolve pass of slack).
    for i, n in res["written_at"].items():
        assert n >= i - lag - 30, (i, n)
    recs = read_run(out)
    got = [r["step"] for r in recs]
    assert sorted(got) == list(range(steps)), "every step exactly once: none lost or doubled"
    assert {r["clock"] for r in recs} == {"cuda"}
    assert all(r["step_ms"] > 0 for r in recs)


def test_17_marks_per_step_with_the_gpu_100_steps_behind(cuda_sim, tmp_path):
    steps, lag = 300, 100
    sim = cuda_sim(lag_steps=lag)
    res = _marks_job(tmp_path, sim, steps, user_phases=1)
    _check_marks(tmp_path, res, steps, lag, min_marks=17)


def test_300_marks_per_step_with_the_gpu_100_steps_behind(cuda_sim, tmp_path):
    steps, lag = 300, 100
    sim = cuda_sim(lag_steps=lag)
    res = _marks_job(tmp_path, sim, steps, user_phases=150)
    _check_marks(tmp_path, res, steps, lag, min_marks=300)


def test_few_marks_per_step_resolve_during_the_run(cuda_sim, tmp_path):
    """The control: under 16 marks per step the pipeline already keeps up (no xfail).

    Every step but the GPU's last ``lag`` resolves during the run and reaches the file
    before ``finish()``: handed over every 5 steps, and taken by the writer on its own
    within its idle tick (``sinks.IDLE_TICK_S``) where it did not get the CPU in time (a
    busy 2-core machine: 81 of 90 lines at the last step once). So the check waits up to
    ten ticks, never calling ``finish()`` first.
    """
    from stepscope.recording.sinks import IDLE_TICK_S

    steps, lag = 120, 10
    sim = cuda_sim(lag_steps=lag)
    torch.manual_seed(0)
    model = nn.Linear(8, 8).to("cuda")
    stepscope.init(out_dir=str(tmp_path), model=model, auto=False, flush_every_n_steps=5)
    sim.reset_counts()
    for _ in range(steps):
        with stepscope.step(), stepscope.phase("work"):
            model(torch.randn(4, 8))
        sim.host_tick()
    deadline = time.monotonic() + 10 * IDLE_TICK_S
    mid = _lines(_rank_file(tmp_path))
    while mid < steps - lag - 20 and time.monotonic() < deadline:
        time.sleep(0.05)
        mid = _lines(_rank_file(tmp_path))
    assert sim.syncs == 0
    stepscope.finish()
    assert mid >= steps - lag - 20
    assert sorted(r["step"] for r in read_run(tmp_path)) == list(range(steps))


# --------------------------------------------------------------------------------------------
# PrefetchLoader(wrap_loader(...)) with unpinned leaves
# --------------------------------------------------------------------------------------------


class _Pair:
    """A batch object with its own ``.to()`` (like HF's BatchEncoding): its leaves are unpinned."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def to(self, device: Any, non_blocking: bool = False) -> _Pair:
        return _Pair(self.x.to(device, non_blocking=non_blocking),
                     self.y.to(device, non_blocking=non_blocking))


def _slow_batches(n: int, slow: set[int], as_object: bool) -> Any:
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        if i in slow:
            time.sleep(MS * 2 / 1000)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        yield _Pair(x, y) if as_object else (x, y)


def _prefetch_job(out: Path, sim: cudasim.CudaSim, as_object: bool, pin: bool) -> dict[str, Any]:
    import warnings

    n, slow = 16, {0, 9}
    model = nn.Linear(32, 4).to("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stepscope.init(out_dir=str(out), model=model, optimizer=opt, flush_every_n_steps=4)
    steady: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = stepscope.PrefetchLoader(stepscope.wrap_loader(_slow_batches(n, slow, as_object)),
                                          pin_memory=pin)
        for i, batch in enumerate(loader):
            if i == 3:
                sim.reset_counts()  # steady state from here
            with stepscope.step():
                x, y = (batch.x, batch.y) if as_object else batch
                assert x.is_cuda, "PrefetchLoader hands out device batches"
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            sim.host_tick()
        steady = [k for k, _ in sim.sync_log]
    stepscope.finish()
    warned = [str(w.message) for w in caught if "pin" in str(w.message).lower()]
    return {"syncs": steady, "warned": warned, "n": n, "slow": slow}


def _dataloader_ms(rec: dict[str, Any]) -> float:
    # The wait for a batch is host time (host_ms); on the GPU clock it is whatever the GPU,
    # two steps behind, was running meanwhile.
    return sum(p.get("host_ms", p["ms"]) for p in rec["phases"] if p["name"] == "dataloader")


@pytest.mark.parametrize(("as_object", "pin"), [(False, False), (True, True)],
                         ids=["pin_memory_false", "object_with_own_to"])
def test_prefetch_loader_over_wrap_loader_with_unpinned_leaves(cuda_sim, tmp_path, as_object, pin):
    sim = cuda_sim(lag_steps=2)
    res = _prefetch_job(tmp_path, sim, as_object, pin)
    # No host sync in steady state, or one warning that says so and a fallback.
    assert res["syncs"] == [] or len(res["warned"]) == 1, (res["syncs"][:4], res["warned"])
    recs = {r["step"]: r for r in read_run(tmp_path)}
    assert sorted(recs) == list(range(res["n"]))
    assert _dataloader_ms(recs[0]) >= MS, "batch 0's wait is kept (charged to step 0)"
    assert _dataloader_ms(recs[9]) >= MS, "batch 9's wait is charged to step 9"
    assert _dataloader_ms(recs[8]) < MS / 2, "step 8 is not charged the next batch's wait"


# --------------------------------------------------------------------------------------------
# Multi-rank gloo scenarios: each rank simulates its own device
# --------------------------------------------------------------------------------------------


class _Slow(nn.Module):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sleeps on the slow rank in backward, on the device thread.
        out: torch.Tensor = SleepInBackward.apply(x, self.delay)
        return out


def _env(rank: int, world: int, port: int) -> None:
    become_local_rank(rank, world, port)


def _result(out: str, rank: int, **fields: Any) -> None:
    (Path(out) / f"result{rank}.json").write_text(json.dumps(fields))


def _fsdp_worker(rank: int, world: int, port: int, out: str, steps: int, slow_rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _env(rank, world, port)
    # lag_steps=0: a gloo collective on CUDA tensors copies them to the host, synchronising the
    # stream, so across collectives the GPU cannot fall behind (see cudasim's docstring).
    sim = cudasim.install(devices=world, lag_steps=0)
    torch.cuda.set_device(rank)  # what FSDP2 scripts do; the mesh stays on CPU (gloo)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        delay = MS / 1000 if rank == slow_rank else 0.0
        mods: list[nn.Module] = [nn.Linear(64, 128), nn.ReLU()]
        for i in range(4):
            if i == 2:
                mods.append(_Slow(delay))
            mods += [nn.Linear(128, 128), nn.ReLU()]
        mods.append(nn.Linear(128, 10))
        model = nn.Sequential(*mods)
        mesh = init_device_mesh("cpu", (world,))
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        stepscope.init(out_dir=out, model=model, optimizer=opt, run_id="fsdp-sim")
        loss_fn = nn.CrossEntropyLoss()
        for _ in range(steps):
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            with stepscope.step():
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            sim.host_tick()
        stepscope.finish()
        _result(out, rank, backward_threads=sorted(set(sim.backward_threads)))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2-sim")
    return spawn_local(_fsdp_worker, 2, out, 40, 1)


@pytest.mark.slow
def test_fsdp2_rank_slow_in_backward_is_named_with_reduce_scatter_waits(fsdp_run):
    from stepscope.analysis.run import analyze_run

    for rank in (0, 1):
        res = json.loads((fsdp_run / f"result{rank}.json").read_text())
        assert res["backward_threads"] == [f"cudasim-autograd-{rank}"]
    doc = analyze_run(fsdp_run)
    assert doc["stragglers"], doc["verdicts"]
    s = doc["stragglers"][0]
    assert (s["rank"], s["phase"]) == (1, "backward")
    assert s["victims"] == [0]
    ops = {o["op"]: o for o in doc["collectives"]["ops"]}
    rs = [o for name, o in ops.items() if name.startswith("reduce_scatter")]
    assert rs and all("backward" in o["phases"] for o in rs), sorted(ops)
    waits = sum(o["wait_ms_per_step"] for o in doc["collectives"]["ops"]
                if "backward" in o["phases"])
    assert waits >= 0.3 * MS / 2, doc["collectives"]  # rank 0's wait, averaged over 2 ranks


@pytest.mark.slow
def test_fsdp2_backward_is_timed_by_its_reduce_scatters_not_grad_sync(fsdp_run):
    for rank in (0, 1):
        recs = [json.loads(line) for line in _rank_file(fsdp_run, rank).read_text().splitlines()]
        assert len(recs) == 40
        for r in recs[3:]:
            paths = {p["path"] for p in r["phases"]}
            assert "backward/grad_sync" not in paths, "grad_sync means DDP's bucket all-reduce"
            ops = {(c["phase"], c["op"]) for c in r.get("collectives", [])}
            assert any(ph == "backward" and op.startswith("reduce_scatter") for ph, op in ops), ops


def _ddp_tutorial_worker(rank: int, world: int, port: int, out: str, steps: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _env(rank, world, port)
    sim = cudasim.install(devices=world, lag_steps=0)  # gloo: see _fsdp_worker
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # The PyTorch DDP tutorial: no set_device, the model moved with .to(rank).
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)).to(rank)
        ddp_model = DDP(model, device_ids=[rank])
        loss_fn = nn.MSELoss()
        opt = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
        stepscope.init(out_dir=out, model=ddp_model, optimizer=opt, run_id="ddp-tutorial")
        for _ in range(steps):
            with stepscope.step():
                outputs = ddp_model(torch.randn(20, 10))
                labels = torch.randn(20, 5).to(rank)
                loss_fn(outputs, labels).backward()
                opt.step()
                opt.zero_grad()
            sim.host_tick()
        _result(out, rank, current_device=torch.cuda.current_device(),
                param_device=str(next(model.parameters()).device))
        stepscope.finish()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_tutorial_without_set_device_records_on_the_models_device(tmp_path):
    steps = 30
    spawn_local(_ddp_tutorial_worker, 2, tmp_path, steps)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert res == {"current_device": 0, "param_device": f"cuda:{rank}"}  # the pattern
        recs = [json.loads(line) for line in _rank_file(tmp_path, rank).read_text().splitlines()]
        assert sorted(r["step"] for r in recs) == list(range(steps))
        assert {r["device_name"] for r in recs} == {f"cuda:{rank}"}
        for r in recs[3:]:
            names = {p["name"] for p in r["phases"]}
            assert {"forward", "backward", "optimizer"} <= names, (rank, r["step"], names)


def _configs_worker(rank: int, world: int, port: int, out: str, steps: int) -> None:
    _env(rank, world, port)
    sim = cudasim.install(devices=world)
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = nn.Linear(8, 8).to("cuda")
        t0 = time.monotonic()
        stepscope.init(out_dir=out, model=model, run_id="configs",
                       log_every_n_steps=50 if rank == 0 else 0)
        init_s = time.monotonic() - t0
        (Path(out) / f"init{rank}.done").touch()
        for _ in range(steps):
            with stepscope.step():
                model(torch.randn(4, 8)).sum().backward()
            sim.host_tick()
        stepscope.finish()
        (Path(out) / f"trained{rank}.done").touch()
        # The job's own later new_group must pair up with the other ranks' one.
        group = dist.new_group([0, 1])
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        _result(out, rank, init_s=init_s, total=float(t))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_per_rank_different_configs_do_not_hang(tmp_path):
    ctx = mp.start_processes(run_then_exit,  # type: ignore[attr-defined]
                             args=(_configs_worker, 2, free_port(), str(tmp_path), 30),
                             nprocs=2, join=False, start_method="spawn")
    # A healthy run takes seconds. A hang shows as one rank stuck in a stage (init, training,
    # the job's own new_group) that the other left: at most 20 s from the first rank to leave
    # a stage to the last, 20 s for the new_group once both trained, and 90 s in all.
    start = time.monotonic()
    first: dict[str, float] = {}
    try:
        while not ctx.join(timeout=0.5):
            now = time.monotonic()
            files = set(os.listdir(tmp_path))
            for stage in ("init", "trained"):
                done = sum(f"{stage}{r}.done" in files for r in (0, 1))
                if done:
                    first.setdefault(stage, now)
                assert done in (0, 2) or now - first[stage] < 20, f"ranks hung after {stage}"
            assert "trained" not in first or now - first["trained"] < 20, (
                f"the job's own new_group hung: {sorted(files)}")
            assert now - start < 90, f"ranks with different configs hung: {sorted(files)}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        res = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert res["total"] == 3.0
        assert res["init_s"] < 30


# --------------------------------------------------------------------------------------------
# A disk error mid-run
# --------------------------------------------------------------------------------------------


_DISK_JOB = r"""
import json, os, resource, signal, sys, time, warnings
sys.path.insert(0, {tests!r})
import torch
from torch import nn
import cudasim, stepscope

out = {out!r}
sim = cudasim.install(lag_steps=1)
model = nn.Linear(16, 16).to("cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = {{"calls": 0, "disk_full": False, "failed_inside": False}}
# A write past RLIMIT_FSIZE fails with EFBIG and raises SIGXFSZ; the handler only notes it.
signal.signal(signal.SIGXFSZ, lambda *_: state.update(disk_full=True))

def user_pre_hook(optimizer, args, kwargs):
    # The user's own optimizer pre-hook (clipping, logging...), registered before stepscope's.
    # At step {fail_at} the disk fills up while it runs, and records are being written.
    state["calls"] += 1
    if state["calls"] != {fail_at}:
        return
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))  # the disk is full
    tracer.flush()  # hand the resolved records to the writer thread, which now fails
    deadline = time.monotonic() + 10
    while not state["disk_full"] and time.monotonic() < deadline:
        time.sleep(0.01)
    state["failed_inside"] = state["disk_full"]
    time.sleep(0.5)  # still inside the optimizer's hook loop while the failure is handled

opt.register_step_pre_hook(user_pre_hook)
tracer = stepscope.init(out_dir=out, model=model, optimizer=opt, flush_every_n_steps=1000)
done = 0
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for i in range({steps}):
        with stepscope.step():
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        sim.host_tick()
        done += 1
    stepscope.finish()
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps({{"done": done, "failed_inside": state["failed_inside"]}}))
"""


@pytest.mark.slow
def test_a_disk_error_mid_run_does_not_crash_the_job(tmp_path):
    import subprocess

    steps = 40
    code = _DISK_JOB.format(tests=str(paths.SUPPORT), out=str(tmp_path), steps=steps,
                            fail_at=20)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {"done": steps, "failed_inside": True}


# --------------------------------------------------------------------------------------------
# Defect 10: one query error, the user's own memory peak
# --------------------------------------------------------------------------------------------


def test_one_event_query_error_does_not_end_timing(cuda_sim, tmp_path):
    sim = cuda_sim(lag_steps=1)
    model = nn.Linear(16, 16).to("cuda")
    stepscope.init(out_dir=str(tmp_path), model=model, flush_every_n_steps=2)
    for i in range(40):
        if i == 10:
            sim.inject_query_errors(1)
        with stepscope.step():
            model(torch.randn(4, 16)).sum().backward()
        sim.host_tick()
    stepscope.finish()
    steps = {r["step"] for r in read_run(tmp_path)}
    assert set(range(15, 40)) <= steps, sorted(steps)[-5:]


def test_the_users_memory_peak_survives_stepscope(cuda_sim, tmp_path):
    sim = cuda_sim()
    model = nn.Linear(64, 64).to("cuda")
    stepscope.init(out_dir=str(tmp_path), model=model)
    torch.cuda.reset_peak_memory_stats()  # the user's own epoch-level peak, as HF logs it
    for i in range(10):
        with stepscope.step():
            model(torch.randn(4, 64)).sum().backward()
            if i == 3:
                spike = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
                del spike
        sim.host_tick()
    peak = torch.cuda.max_memory_allocated()
    stepscope.finish()
    assert peak >= 64 << 20, f"the user's peak over the epoch is {peak} bytes"
    assert len(read_run(tmp_path)) == 10
