"""Collective timing: the patch, its gate, the record section, and real 2-rank gloo runs."""

from __future__ import annotations

import os
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stepscope.common.errors import StepscopeWarning
from stepscope.instrument import collective_timing as collectives
from stepscope.recording.clock import CudaClock
from stepscope.recording.dist import spawn_local
from stepscope.recording.schema import read_run
from stepscope.recording.step import STREAM_WAIT

C10D = dist.distributed_c10d


# ---------------------------------------------------------------- one-rank, in-process


def colls(rec: dict[str, Any]) -> dict[tuple[Any, str], dict[str, Any]]:
    return {(c["phase"], c["op"]): c for c in rec.get("collectives", [])}


def test_removal_restores_the_originals_and_is_reference_counted():
    orig_c10d = {n: getattr(C10D, n) for n in collectives.OPS if hasattr(C10D, n)}
    orig_dist = {n: getattr(dist, n) for n in orig_c10d if hasattr(dist, n)}
    first = collectives.install_patch()
    second = collectives.install_patch()
    try:
        assert C10D.all_reduce is not orig_c10d["all_reduce"]
        assert dist.all_reduce is C10D.all_reduce  # callers reaching it either way see the patch
        assert dist.all_gather_single is C10D.all_gather_single
        first()
        first()  # idempotent: does not release the second install
        assert dist.reduce_scatter_single is not orig_c10d["reduce_scatter_single"]
    finally:
        second()
    assert {n: getattr(C10D, n) for n in orig_c10d} == orig_c10d
    assert {n: getattr(dist, n) for n in orig_dist} == orig_dist


def test_the_stream_join_patches_go_in_and_out_with_collective_timing():
    """``Event.wait`` and ``Stream.record_event`` (what splits side-stream collectives) are
    patched exactly while collective timing is installed."""
    wait, record_event = torch.cuda.Event.wait, torch.cuda.Stream.record_event
    remove = collectives.install_patch()
    try:
        assert torch.cuda.Event.wait.__wrapped__ is wait
        assert torch.cuda.Stream.record_event.__wrapped__ is record_event
    finally:
        remove()
    assert torch.cuda.Event.wait is wait
    assert torch.cuda.Stream.record_event is record_event


def test_ops_inside_a_step_are_recorded_once_each_with_bytes_and_sequence(world1, mem_tracer):
    tr = mem_tracer(auto=False)
    t = torch.ones(16)  # 64 bytes
    out = torch.empty(16)
    with tr.step():
        with tr.phase("metrics"):
            dist.all_reduce(t)
            work = dist.all_reduce(t, async_op=True)
            assert isinstance(work, dist.Work)  # FSDP2 checks isinstance before wait()
            work.wait()
            assert work.is_completed()
            dist.broadcast(t, src=0)
        dist.all_gather_into_tensor(out, t)  # nested all_gather_single: timed once
        dist.reduce_scatter_tensor(out, t)
        dist.barrier()
    tr.finish()
    (rec,) = tr.sink.records
    got = colls(rec)
    assert set(got) == {
        ("metrics", "all_reduce"), ("metrics", "broadcast"), (None, "all_gather_into_tensor"),
        (None, "reduce_scatter_tensor"), (None, "barrier"),
    }
    ar = got[("metrics", "all_reduce")]
    assert (ar["count"], ar["bytes"], ar["pg"], ar["pg_size"]) == (2, 128, "world", 1)
    assert (ar["seq_first"], ar["seq_last"]) == (1, 2)
    assert got[("metrics", "broadcast")]["seq_first"] == 3
    assert got[(None, "all_gather_into_tensor")]["seq_first"] == 4
    assert got[(None, "barrier")]["bytes"] == 0 and got[(None, "barrier")]["seq_last"] == 6
    assert all(c["ms"] >= c["max_ms"] >= 0 for c in got.values())
    assert torch.equal(t, torch.ones(16))


def test_nothing_recorded_outside_a_step_or_from_another_thread(world1, mem_tracer):
    tr = mem_tracer(auto=False)
    t = torch.ones(4)
    dist.all_reduce(t)  # before any step
    other_done = threading.Event()

    def other() -> None:
        dist.all_reduce(torch.ones(4))
        other_done.set()

    with tr.step():
        th = threading.Thread(target=other)
        th.start()
        th.join(30)
        assert other_done.is_set()
        dist.all_reduce(t)
    dist.barrier()  # between steps, no sampled pre-step span open
    tr.finish()
    (rec,) = tr.sink.records
    assert [(c["op"], c["count"]) for c in rec["collectives"]] == [("all_reduce", 1)]


def test_unsampled_steps_and_disabled_config_record_nothing(world1, mem_tracer):
    tr = mem_tracer(auto=False, every_n_steps=2)
    for _ in range(2):
        with tr.step():
            dist.all_reduce(torch.ones(2))
    tr.finish()
    assert [len(r.get("collectives", [])) for r in tr.sink.records] == [1]
    off = mem_tracer(auto=False, collectives=False)
    assert C10D.all_reduce.__name__ == "all_reduce"
    with off.step():
        dist.all_reduce(torch.ones(2))
    off.finish()
    assert "collectives" not in off.sink.records[0]


def test_a_collective_inside_the_dataloader_wait_counts_for_the_next_step(world1, mem_tracer):
    tr = mem_tracer(auto={"dataloader"})

    def batches():
        for _ in range(2):
            n = torch.ones(1)
            dist.all_reduce(n)  # e.g. HF Trainer gathering num_items_in_batch
            yield n

    for _ in tr.wrap_loader(batches()):
        with tr.step():
            dist.all_reduce(torch.ones(3))
    tr.finish()
    for rec in tr.sink.records:
        got = colls(rec)
        assert got[("dataloader", "all_reduce")]["bytes"] == 4
        assert got[(None, "all_reduce")]["bytes"] == 12


def test_the_collectives_own_errors_propagate_unchanged_and_are_not_recorded(world1, mem_tracer):
    tr = mem_tracer(auto=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepscopeWarning)
        with tr.step():
            with pytest.raises(TypeError, match="Expected parameter `tensor`"):
                dist.all_reduce("not a tensor")  # type: ignore[arg-type]
            dist.all_reduce(torch.ones(2))
    tr.finish()
    (rec,) = tr.sink.records
    assert [(c["op"], c["count"]) for c in rec["collectives"]] == [("all_reduce", 1)]


def test_a_destroyed_group_is_untimed_quietly(world1, mem_tracer):
    tr = mem_tracer(auto=False)
    g = dist.new_group([0])
    dist.destroy_process_group(g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepscopeWarning)
        with tr.step():
            try:
                dist.all_reduce(torch.ones(2), group=g)
            except Exception as exc:  # torch may or may not refuse; if it does, its own error
                assert "stepscope" not in repr(exc)
            dist.all_reduce(torch.ones(2))
    tr.finish()
    (rec,) = tr.sink.records
    assert [(c["pg"], c["count"]) for c in rec["collectives"]] == [("world", 1)]


def test_an_internal_error_disables_collective_timing_once_and_the_call_goes_through(
    world1, mem_tracer, monkeypatch
):
    def broken(group: Any) -> Any:
        raise RuntimeError("bug in stepscope")

    monkeypatch.setattr(collectives, "group_info", broken)
    tr = mem_tracer(auto=False)
    t = torch.full((2,), 3.0)
    with pytest.warns(StepscopeWarning, match="collective timing disabled") as caught, tr.step():
        dist.all_reduce(t)
        work = dist.all_reduce(t, async_op=True)
        assert work is not None
        work.wait()
    assert len([w for w in caught if issubclass(w.category, StepscopeWarning)]) == 1
    tr.finish()
    assert torch.equal(t, torch.full((2,), 3.0))
    assert "collectives" not in tr.sink.records[0]
    assert tr.enabled  # only collective timing is off; the step was recorded


def test_torch_compile_of_a_function_calling_all_reduce_still_works(world1, mem_tracer):
    tr = mem_tracer(auto=False)

    @torch.compile(backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x * 2

    with warnings.catch_warnings():
        warnings.simplefilter("error", StepscopeWarning)
        with tr.step():
            y = f(torch.ones(3))
    tr.finish()
    assert torch.equal(y, torch.full((3,), 2.0))
    assert tr.enabled


# ---------------------------------------------------------------- GPU path with fake events


class FakeGpu:
    def __init__(self) -> None:
        self.now = 0.0
        self.done = 0.0

    def work(self, ms: float) -> None:
        self.now += ms


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.t: float | None = None

    def record(self) -> None:
        self.t = self.gpu.now

    def query(self) -> bool:
        return self.t is not None and self.t <= self.gpu.done

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.query() and other.query(), "elapsed_time read before query() said done"
        return other.t - self.t  # type: ignore[operator]

    def synchronize(self) -> None:
        raise AssertionError("Event.synchronize called")


def test_gpu_path_uses_stream_events_without_host_sync(world1, mem_tracer, monkeypatch):
    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("host synchronisation in the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    gpu = FakeGpu()
    real = C10D.all_reduce

    def on_stream_all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                             async_op: bool = False) -> Any:
        gpu.work(4.0)  # the collective's kernel on the current stream
        return real(tensor, op=op, group=group, async_op=async_op)

    # The fake "original" is what the patch wraps and what removal must put back.
    monkeypatch.setattr(C10D, "all_reduce", on_stream_all_reduce)
    monkeypatch.setattr(dist, "all_reduce", on_stream_all_reduce)
    tr = mem_tracer(auto=False, clock=CudaClock(lambda: FakeEvent(gpu)), flush_every_n_steps=1)
    for _ in range(2):
        with tr.step():
            with tr.phase("forward"):
                gpu.work(1.0)
                dist.all_reduce(torch.ones(2))
                work = dist.all_reduce(torch.ones(2), async_op=True)
                gpu.work(10.0)  # overlapped compute between issue and wait: not collective time
                work.wait()
            gpu.work(1.0)
    assert tr.sink.records == []  # nothing completed on the "GPU": nothing read, nothing waited
    gpu.done = gpu.now
    tr.finish()
    assert dist.all_reduce is on_stream_all_reduce and C10D.all_reduce is on_stream_all_reduce
    for rec in tr.sink.records:
        (c,) = rec["collectives"]
        assert (c["phase"], c["op"], c["count"]) == ("forward", "all_reduce", 2)
        assert c["ms"] == pytest.approx(8.0) and c["max_ms"] == pytest.approx(4.0)


def test_summarize_aggregates_per_phase_op_and_group():
    def el(a: float, b: float) -> float:
        return b - a

    entries = [
        ("all_reduce", "world", 2, 8, 0.0, 3.0, "forward", 1, None),
        ("all_reduce", "world", 2, 8, 5.0, 6.0, "forward", 2, None),
        ("all_reduce", "g0-1#1", 2, 4, 6.0, 7.5, "forward", 1, None),
        ("all_reduce", "world", 2, 8, 7.0, 20.0, "backward", 3, (8.0, 18.0)),
    ]
    out = collectives.summarize(entries, el)
    assert out == [
        {"phase": "forward", "op": "all_reduce", "pg": "world", "pg_size": 2, "count": 2,
         "bytes": 16, "ms": 4.0, "max_ms": 3.0, "exposed_ms": 4.0, "hidden_ms": 0.0,
         "seq_first": 1, "seq_last": 2},
        {"phase": "forward", "op": "all_reduce", "pg": "g0-1#1", "pg_size": 2, "count": 1,
         "bytes": 4, "ms": 1.5, "max_ms": 1.5, "exposed_ms": 1.5, "hidden_ms": 0.0,
         "seq_first": 1, "seq_last": 1},
        {"phase": "backward", "op": "all_reduce", "pg": "world", "pg_size": 2, "count": 1,
         "bytes": 8, "ms": 3.0, "max_ms": 3.0, "exposed_ms": 3.0, "hidden_ms": 0.0,
         "seq_first": 3, "seq_last": 3},
    ]


def test_summarize_splits_a_side_stream_call_by_the_waits_of_the_step_stream_on_it():
    """A call on a side stream is exposed only where the step's stream was held waiting on
    an event of that stream recorded after it (or by its own ``wait()``); the rest is hidden."""
    def el(a: float, b: float) -> float:
        return b - a

    wait = STREAM_WAIT
    entries = [
        # 150 ms all-gather on stream "ag" from t=0, joined at t=100: held 100..150.
        ("all_gather", "world", 2, 8, 0.0, 150.0, "forward", 1, None, None, ("ag", 1)),
        (wait, "", 0, 0, 100.0, 150.0, None, 0, None, None, ("ag", 2)),
        # A wait on another stream's work, and one on an event recorded before the call:
        # neither makes the call exposed; the join after it (not held) makes it hidden.
        (wait, "", 0, 0, 20.0, 40.0, None, 0, None, None, ("rs", 9)),
        ("reduce_scatter", "world", 2, 8, 200.0, 230.0, "backward", 2, None, None, ("ag", 5)),
        (wait, "", 0, 0, 210.0, 230.0, None, 0, None, None, ("ag", 4)),
        (wait, "", 0, 0, 235.0, 235.0, None, 0, None, None, ("ag", 7)),
        # No join seen in the step: all exposed, as if on the step's stream.
        ("broadcast", "world", 2, 8, 250.0, 262.0, "backward", 5, None, None, ("bc", 8)),
        # async on "ag", waited from the step's stream at 310 (ends 330): that wait is held.
        ("all_reduce", "world", 2, 8, 300.0, 330.0, "backward", 3, (301.0, 310.0), None,
         ("ag", 6, True)),
        # on the step's stream: all of it exposed.
        ("all_reduce", "world", 2, 8, 400.0, 410.0, "optimizer", 4, None, None, None),
    ]
    out = {c["op"]: c for c in collectives.summarize(entries, el)}
    assert set(out) == {"all_gather", "reduce_scatter", "all_reduce", "broadcast"}  # no waits
    ag, rs, bc = out["all_gather"], out["reduce_scatter"], out["broadcast"]
    assert (ag["ms"], ag["exposed_ms"], ag["hidden_ms"]) == (150.0, 50.0, 100.0)
    assert (rs["ms"], rs["exposed_ms"], rs["hidden_ms"]) == (30.0, 0.0, 30.0)
    assert (bc["ms"], bc["exposed_ms"], bc["hidden_ms"]) == (12.0, 12.0, 0.0)
    ar = [c for c in collectives.summarize(entries, el) if c["op"] == "all_reduce"]
    assert [(c["ms"], c["exposed_ms"], c["hidden_ms"]) for c in ar] == [
        (21.0, 20.0, 1.0), (10.0, 10.0, 0.0)]


# ---------------------------------------------------------------- real 2-rank gloo runs



def _setup(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)


SLOW_MS = 40.0
OPS_STEPS = 2
SLOW_STEPS = 6


def _ops_worker(rank: int, world: int, port: int, out: str) -> None:
    import stepscope

    _setup(rank, world, port)
    sub = dist.new_group([0, 1])
    tr = stepscope.init(out_dir=out, auto={"dataloader"}, flush_every_n_steps=4)
    peer = 1 - rank

    def loader():
        for _ in range(OPS_STEPS):
            n = torch.tensor([float(rank + 1)])
            dist.all_reduce(n)
            assert n.item() == 3.0
            yield n

    for _ in tr.wrap_loader(loader()):
        with stepscope.step():
            with stepscope.phase("ops"):
                t = torch.full((8,), float(rank))
                dist.all_reduce(t)
                assert torch.equal(t, torch.full((8,), 1.0))
                w = dist.all_reduce(t, async_op=True)
                w.wait()
                assert torch.equal(t, torch.full((8,), 2.0))
                gathered = torch.empty(16)
                dist.all_gather_into_tensor(gathered, torch.full((8,), float(rank)))
                assert torch.equal(gathered, torch.cat([torch.zeros(8), torch.ones(8)]))
                shard = torch.empty(4)
                dist.reduce_scatter_tensor(shard, torch.arange(8, dtype=torch.float32))
                assert torch.equal(shard, 2 * torch.arange(8, dtype=torch.float32)[rank * 4:rank * 4 + 4])
                b = torch.full((4,), float(rank))
                dist.broadcast(b, src=0)
                assert torch.equal(b, torch.zeros(4))
                dist.barrier()
                dist.all_reduce(torch.ones(2), group=sub)
            with stepscope.phase("p2p"):
                x = torch.full((5,), float(rank))
                if rank == 0:
                    dist.send(x, dst=peer)
                    dist.recv(x, src=peer)
                else:
                    dist.recv(x, src=peer)
                    x += 1
                    dist.send(x, dst=peer)
                assert torch.equal(x, torch.ones(5))  # rank 0's zeros, incremented by rank 1
                reqs = [dist.isend(torch.ones(3), dst=peer), dist.irecv(torch.empty(3), src=peer)]
                for r in reqs:
                    r.wait()
    # The wait rule's case: rank 1 arrives SLOW_MS late, rank 0 waits for it inside the call.
    for _ in range(SLOW_STEPS):
        with stepscope.step():
            with stepscope.phase("sync"):
                if rank == 1:
                    time.sleep(SLOW_MS / 1e3)
                dist.all_reduce(torch.ones(64))
            with stepscope.phase("async_late"):
                # Issued by rank 0 at once, by rank 1 SLOW_MS late; rank 0 waits right away.
                if rank == 1:
                    time.sleep(SLOW_MS / 1e3)
                dist.all_reduce(torch.ones(64), async_op=True).wait()
            with stepscope.phase("async_overlap"):
                # Both issue at once; rank 0 computes 2*SLOW_MS before waiting: not collective time.
                w = dist.all_reduce(torch.ones(64), async_op=True)
                if rank == 0:
                    time.sleep(2 * SLOW_MS / 1e3)
                w.wait()
            dist.barrier()
    # Mismatched counts on the last step: rank 0 times a barrier that rank 1 makes outside.
    with stepscope.step():
        if rank == 0:
            dist.barrier()
    if rank == 1:
        dist.barrier()
    stepscope.finish()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ops_run(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("coll") / "run"
    spawn_local(_ops_worker, 2, out)
    recs = read_run(out)
    return {r: sorted((x for x in recs if x["rank"] == r), key=lambda x: x["step"]) for r in (0, 1)}




@pytest.mark.slow
def test_two_ranks_record_every_op_with_matching_groups_and_sequences(ops_run):
    expect = {
        ("dataloader", "all_reduce"), ("ops", "all_reduce"), ("ops", "all_gather_into_tensor"),
        ("ops", "reduce_scatter_tensor"), ("ops", "broadcast"), ("ops", "barrier"),
        ("p2p", "send"), ("p2p", "recv"), ("p2p", "isend"), ("p2p", "irecv"),
    }
    for step in range(OPS_STEPS):
        per_rank = [ops_run[r][step] for r in (0, 1)]
        keys = [{(c["phase"], c["op"], c["pg"]): c for c in rec["collectives"]} for rec in per_rank]
        for k in keys:
            assert {(p, o) for p, o, _ in k} == expect
        # A collective's group id, size, count, bytes and sequence agree across its ranks.
        coll_keys = {k for k in keys[0] if k[1] not in ("send", "recv", "isend", "irecv")}
        assert coll_keys == {k for k in keys[1] if k[1] not in ("send", "recv", "isend", "irecv")}
        for k in coll_keys:
            a, b = keys[0][k], keys[1][k]
            assert (a["count"], a["bytes"], a["seq_first"], a["seq_last"], a["pg_size"]) == (
                b["count"], b["bytes"], b["seq_first"], b["seq_last"], b["pg_size"]
            ), k
        ar = keys[0][("ops", "all_reduce", "world")]
        assert (ar["count"], ar["bytes"], ar["pg_size"]) == (2, 64, 2)
        sub = [k for k in coll_keys if k[2] not in ("world",)]
        assert {k[2] for k in sub} == {"g0-1#1"}  # the new_group, told apart from the world
        assert keys[0][("ops", "all_gather_into_tensor", "world")]["bytes"] == 64
        assert keys[0][("ops", "reduce_scatter_tensor", "world")]["bytes"] == 32
        assert keys[0][("p2p", "isend", "world:0>1")]["bytes"] == 12
        # A point-to-point call names its link (src>dst), the same id on both ends.
        for op, link in (("send", "0>1"), ("recv", "1>0"), ("isend", "0>1"), ("irecv", "1>0")):
            assert ("p2p", op, f"world:{link}") in keys[0]
            other = {"send": "recv", "recv": "send", "isend": "irecv", "irecv": "isend"}[op]
            assert ("p2p", other, f"world:{link}") in keys[1]
            assert keys[0][("p2p", op, f"world:{link}")]["pg_size"] == 2


@pytest.mark.slow
def test_a_late_rank_lengthens_the_other_ranks_time_in_the_collective(ops_run):
    slow = [rec for rec in ops_run[0] if rec["step"] >= OPS_STEPS][:SLOW_STEPS]
    slow1 = [rec for rec in ops_run[1] if rec["step"] >= OPS_STEPS][:SLOW_STEPS]
    assert len(slow) == len(slow1) == SLOW_STEPS

    def med(recs: list[dict[str, Any]], phase: str) -> float:
        return statistics.median(
            next(c["ms"] for c in r["collectives"] if c["phase"] == phase and c["op"] == "all_reduce")
            for r in recs
        )

    # Synchronous: rank 0 arrives first and waits ~SLOW_MS; rank 1 arrives last, waits ~0.
    assert med(slow, "sync") >= 0.75 * SLOW_MS
    assert med(slow, "sync") - med(slow1, "sync") >= 0.6 * SLOW_MS
    # Async issued on time by rank 0 and waited at once: the wait carries rank 1's lateness.
    assert med(slow, "async_late") >= 0.75 * SLOW_MS
    assert med(slow, "async_late") - med(slow1, "async_late") >= 0.6 * SLOW_MS
    # Overlapped compute between issue and wait is not time in the collective.
    assert med(slow, "async_overlap") <= 0.5 * SLOW_MS


@pytest.mark.slow
def test_different_collective_counts_per_step_are_recorded_as_they_happened(ops_run):
    last0, last1 = ops_run[0][-1], ops_run[1][-1]
    assert last0["step"] == last1["step"] == OPS_STEPS + SLOW_STEPS
    assert [c["op"] for c in last0["collectives"]] == ["barrier"]
    assert "collectives" not in last1


FSDP_STEPS = 4


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    import stepscope

    _setup(rank, world, port)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stepscope.init(out_dir=out, model=model, optimizer=opt, flush_every_n_steps=2)
    for _ in range(FSDP_STEPS):
        with stepscope.step():
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    stepscope.finish()
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_all_gathers_in_forward_and_reduce_scatters_in_backward(tmp_path: Path):
    out = tmp_path / "run"
    spawn_local(_fsdp_worker, 2, out)
    recs = read_run(out)
    assert len(recs) == 2 * FSDP_STEPS
    by = {(r["rank"], r["step"]): r for r in recs}
    for step in range(FSDP_STEPS):
        per_rank = []
        for rank in (0, 1):
            cs = by[(rank, step)]["collectives"]
            fwd = [c for c in cs if c["phase"] == "forward" and c["op"].startswith("all_gather")]
            bwd = [c for c in cs if c["phase"] == "backward" and c["op"].startswith("reduce_scatter")]
            assert fwd and bwd, cs
            assert all(c["pg_size"] == 2 and c["bytes"] > 0 for c in fwd + bwd)
            # One reduce-scatter per sharded Linear; its bytes are the unsharded gradients.
            assert sum(c["count"] for c in bwd) == 2
            assert sum(c["bytes"] for c in bwd) == 4 * (16 * 32 + 32 + 32 * 4 + 4)
            per_rank.append(sorted((str(c["phase"]), c["op"], c["seq_first"], c["seq_last"]) for c in cs))
        assert per_rank[0] == per_rank[1]


def test_config_switch_and_environment_override():
    from stepscope.common.errors import ConfigError
    from stepscope.recording.config import Config, env_overrides

    assert Config().collectives is True
    assert env_overrides({"STEPSCOPE_COLLECTIVES": "0"}) == {"collectives": False}
    assert env_overrides({"STEPSCOPE_COLLECTIVES": "1"}) == {"collectives": True}
    assert "collectives" not in env_overrides({})
    with pytest.raises(ConfigError, match="collectives must be a bool"):
        Config(collectives="yes")  # type: ignore[arg-type]


def test_async_work_waited_twice_or_after_the_step_does_not_break(world1, mem_tracer):
    tr = mem_tracer(auto=False)
    with tr.step():
        kept = dist.all_reduce(torch.ones(2), async_op=True)
        twice = dist.all_reduce(torch.ones(2), async_op=True)
        twice.wait()
        twice.wait()  # the second wait is the real one's, untimed
        never = dist.all_reduce(torch.ones(2), async_op=True)  # never waited: never recorded
    kept.wait()  # after the step: attached to the next sampled step, not lost, no error
    assert kept.is_completed() and never.is_completed() is not None
    with tr.step():
        pass
    tr.finish()
    first, second = tr.sink.records
    assert [(c["op"], c["count"]) for c in first["collectives"]] == [("all_reduce", 1)]
    assert [(c["op"], c["count"], c["seq_first"]) for c in second["collectives"]] == [("all_reduce", 1, 1)]


def test_untimed_groups_ask_torch_once_a_second_until_a_group_exists_then_see_it(
    mem_tracer, monkeypatch
):
    """A single-process run asks ``is_initialized`` once per ``DIST_CHECK_S``, not at every
    step end; a group made after the tracer started is still looked at, and a collective
    issued on it from C++'s side is counted as untimed."""
    import sys

    from stepscope.instrument import untimed

    clock = [1000.0]
    monkeypatch.setattr(untimed, "_monotonic", lambda: clock[0])
    asked: list[int] = []
    real = dist.is_initialized

    def spy() -> bool:
        if sys._getframe(1).f_code is untimed.UntimedGroups.on_step_end.__code__:
            asked.append(1)
        return real()

    monkeypatch.setattr(torch.distributed, "is_initialized", spy)
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    for _ in range(50):
        with tr.step():
            pass
    assert len(asked) == 1
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.distributed_c10d._get_default_group()
        with tr.step():
            pass  # within the second: not asked again yet
        assert len(asked) == 1
        clock[0] += untimed.DIST_CHECK_S
        with tr.step():
            pass  # asks, finds the group: its first look sets the baseline
        with tr.step():
            pg.allreduce([torch.ones(2)]).wait()  # the ProcessGroup's own method: not timed
        for _ in range(3):
            with tr.step():
                pass
        tr.finish()
    finally:
        dist.destroy_process_group()
    assert len(asked) == 2  # once a group was seen, never again
    assert sum(r.get("counters", {}).get("unseen_untimed", 0) for r in tr.sink.records) == 1


def test_untimed_groups_look_only_around_sampled_steps(world1, mem_tracer, monkeypatch):
    """With one step in 5 recorded, the groups are looked at the end of each sampled step and
    of the step before it, not at every step; a C++-side collective in an unsampled step is not
    charged to the next sampled one."""
    from stepscope.instrument import untimed

    looks: list[int] = []
    real = untimed.UntimedGroups.look

    def spy(self):
        looks.append(1)
        return real(self)

    monkeypatch.setattr(untimed.UntimedGroups, "look", spy)
    pg = dist.distributed_c10d._get_default_group()
    tr = mem_tracer(auto=False, every_n_steps=5, flush_every_n_steps=1)
    for i in range(15):
        with tr.step():
            if i in (3, 6):  # unsampled steps: step 5's window starts at the end of step 4
                pg.allreduce([torch.ones(2)]).wait()
    tr.finish()
    assert len(looks) == 6  # ends of steps 0, 4, 5, 9, 10, 14
    counts = {r["step"]: r.get("counters", {}).get("unseen_untimed", 0) for r in tr.sink.records}
    assert counts == {0: 0, 5: 0, 10: 0}


def test_untimed_groups_count_a_one_step_window_before_a_sampled_step(world1, mem_tracer):
    """With one step in 2 recorded, the look at the end of an unsampled step comes one step
    after the previous look: that window (the unsampled step) is counted on the next sampled
    step, as every window of one step is; the sampled step's own window has no sampled step
    after it to go to."""
    pg = dist.distributed_c10d._get_default_group()
    tr = mem_tracer(auto=False, every_n_steps=2, flush_every_n_steps=1)
    for i in range(6):
        with tr.step():
            if i in (1, 3):  # unsampled steps whose ends are looked at
                pg.allreduce([torch.ones(2)]).wait()  # the ProcessGroup's own method: not timed
            if i == 2:  # a sampled step's window: nowhere to go
                pg.allreduce([torch.ones(2)]).wait()
    tr.finish()
    counts = {r["step"]: r.get("counters", {}).get("unseen_untimed", 0) for r in tr.sink.records}
    assert counts == {0: 0, 2: 1, 4: 1}


def test_the_untimed_groups_look_of_a_ddp_step_costs_at_most_8_calls(world1, mem_tracer):
    """Budget: at the end of a recorded DDP step, the look that counts the C++-issued bucket
    all-reduces makes at most 8 Python calls (its own frames, one sequence-number read per
    group, and the counter it reports), measured with ``sys.setprofile``."""
    import sys

    from stepscope.instrument import untimed

    net = torch.nn.Linear(4, 4)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt, flush_every_n_steps=1)
    calls: list[int] = []
    depth = [0]
    look = untimed.UntimedGroups.on_step_end.__code__

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and (depth[0] or frame.f_code is look):
            depth[0] += 1
            calls.append(1)
        elif event == "c_call" and depth[0]:
            calls.append(1)
        elif event == "return" and depth[0]:
            depth[0] -= 1

    for i in range(4):
        if i == 3:
            sys.setprofile(prof)
        with tr.step():
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        sys.setprofile(None)
    tr.finish()
    assert 1 <= len(calls) <= 8, len(calls)
    assert tr.sink.records[-1]["counters"]["unseen_untimed"] >= 1  # the look did count
