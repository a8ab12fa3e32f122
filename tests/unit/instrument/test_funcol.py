"""Functional collectives (DTensor's path) and the paths stepscope cannot time, in one process.

A one-rank gloo world: enough to check what is recorded (ops, bytes, received bytes, the
issue/wait split) and what is counted as unseen; cross-rank behaviour is in
``test_coverage_frameworks.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

import stepscope
from stepscope.analysis.run import analyze_run
from stepscope.instrument import collective_timing as collectives


def _colls(rec: dict[str, Any]) -> dict[tuple[Any, str], dict[str, Any]]:
    return {(c["phase"], c["op"]): c for c in rec.get("collectives", [])}


def test_funcol_ops_are_timed_from_issue_to_wait(world1: Any, mem_tracer: Any) -> None:
    tr = mem_tracer(auto=False)
    g = dist.group.WORLD
    x = torch.ones(16)  # 64 bytes
    funcol.all_reduce(x, "sum", g).wait()  # torch's first functional collective takes seconds
    with tr.step():
        with tr.phase("tp"):
            y = funcol.all_reduce(x, "sum", g)
            time.sleep(0.03)  # overlapped work between issue and first use: not collective time
            assert float(y.sum()) == 16.0  # first use waits
            funcol.all_gather_single(x, 0, g).wait()
            funcol.reduce_scatter_single(x, "sum", 0, g).wait()
        moe = funcol.all_to_all_single(torch.ones(6, 4), [6], [6], g)  # 6 rows of 16 bytes
        funcol.wait_tensor(moe)
    tr.finish()
    (rec,) = tr.sink.records
    got = _colls(rec)
    assert set(got) == {("tp", "all_reduce"), ("tp", "all_gather_into_tensor"),
                        ("tp", "reduce_scatter_tensor"), (None, "all_to_all_single")}
    ar = got[("tp", "all_reduce")]
    assert (ar["bytes"], ar["pg"], ar["pg_size"], ar["count"]) == (64, "world", 1, 1)
    assert ar["ms"] < 25.0  # the 30 ms of overlapped work is the gap, not time in it
    a2a = got[(None, "all_to_all_single")]
    assert (a2a["bytes"], a2a["recv_bytes"], a2a["recv_max_bytes"]) == (96, 96, 96)
    seqs = sorted(c["seq_first"] for c in got.values())
    assert seqs == [1, 2, 3, 4]


def test_funcol_patch_is_removed_with_the_last_tracer() -> None:
    orig = funcol.all_reduce, funcol.wait_tensor, funcol.all_to_all_single
    remove = collectives.install_patch()
    assert funcol.all_reduce is not orig[0] and funcol.wait_tensor is not orig[1]
    remove()
    assert (funcol.all_reduce, funcol.wait_tensor, funcol.all_to_all_single) == orig


def test_unseen_paths_are_counted_and_reported(world1: Any, tmp_path: Path) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = funcol.all_reduce(x, "sum", dist.group.WORLD)
        return out

    out = tmp_path / "run"
    tr = stepscope.Tracer(stepscope.Config(out_dir=str(out), auto=set()))
    t = torch.ones(8)
    for _ in range(3):
        with tr.step():
            with dist._coalescing_manager():  # real work at the block's exit, in C++
                dist.all_reduce(t)
            make_fx(fn)(t)  # captured into a graph: runs there
            dist.all_reduce(t)  # seen
    tr.finish()
    doc = analyze_run(out)
    blind = {b["path"]: b for b in doc["blind"]}
    assert set(blind) == {"coalesced", "traced"}
    assert blind["coalesced"]["calls_per_step"] == 1.0 and blind["coalesced"]["ranks"] == [0]
    (v,) = [v for v in doc["verdicts"] if v["kind"] == "blind_collectives"]
    assert v["severity"] == "warning" and "coalesced" in v["evidence"] and "traced" in v["evidence"]
    assert [o["op"] for o in doc["collectives"]["ops"]] == ["all_reduce"]


def test_funcol_wait_is_recorded_in_the_phase_that_waited(world1: Any, mem_tracer: Any) -> None:
    # Tensor parallel's row-parallel output is often first used outside the model (the loss):
    # the rank's time in the collective is there, not in forward.
    tr = mem_tracer(auto=False)
    g = dist.group.WORLD
    x = torch.ones(16)
    funcol.all_reduce(x, "sum", g).wait()
    with tr.step():
        with tr.phase("forward"):
            y = funcol.all_reduce(x, "sum", g)
        with tr.phase("loss"):
            assert float(y.sum()) == 16.0  # first use: waits here
    tr.finish()
    (rec,) = tr.sink.records
    assert set(_colls(rec)) == {("loss", "all_reduce")}


def _traced_run(tmp_path: Path, backend: str, with_collective: bool, compile_in_step: bool) -> Any:
    torch._dynamo.reset()
    g = dist.group.WORLD

    def fn(x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        if with_collective:
            x = funcol.all_reduce(x, "sum", g)
        return x + 1

    compiled = torch.compile(fn, backend=backend)
    out = tmp_path / "run"
    tr = stepscope.Tracer(stepscope.Config(out_dir=str(out), auto=set()))
    t = torch.ones(8)
    if not compile_in_step:
        compiled(t)  # compiled before any step: counted at the next step's collective
    for _ in range(4):
        with tr.step():
            assert float(compiled(t).sum()) == 24.0
            dist.all_reduce(t.clone())  # seen
    tr.finish()
    return analyze_run(out)


@pytest.mark.parametrize("compile_in_step", [True, False])
def test_collectives_in_compiled_graphs_are_reported_blind(world1: Any, tmp_path: Path,
                                                           compile_in_step: bool) -> None:
    doc = _traced_run(tmp_path, "eager", True, compile_in_step)
    blind = {b["path"]: b for b in doc["blind"]}
    assert set(blind) == {"compiled"}
    assert blind["compiled"]["calls"] == 1 and blind["compiled"]["ranks"] == [0]
    (v,) = [v for v in doc["verdicts"] if v["kind"] == "blind_collectives"]
    assert "inside compiled graphs" in v["evidence"] and "not attributed" in v["evidence"]
    assert "1 collective call(s) traced into compiled graphs" in v["evidence"]
    assert "balanced" not in {v["kind"] for v in doc["verdicts"]}
    # Only the eager all_reduce is timed; the compiled one runs in the graph.
    assert [(o["op"], o["calls_per_step"]) for o in doc["collectives"]["ops"]] == [("all_reduce", 1.0)]


def test_compiled_graph_without_collectives_is_not_blind(world1: Any, tmp_path: Path) -> None:
    doc = _traced_run(tmp_path, "eager", False, True)
    assert "blind" not in doc
    assert "blind_collectives" not in {v["kind"] for v in doc["verdicts"]}


@pytest.mark.slow
def test_collectives_in_inductor_graphs_are_reported_blind(world1: Any, tmp_path: Path) -> None:
    # inductor (C++ compiler on CPU): the graph's all_reduce runs from generated code.
    doc = _traced_run(tmp_path, "inductor", True, True)
    assert {b["path"] for b in doc["blind"]} == {"compiled"}


def test_all_to_all_bytes_count_rows_a_rank_receives_while_sending_none() -> None:
    # A fully skewed router: this rank routes no token away (0 rows in) but gets 6 rows back.
    from stepscope.instrument.funcol import _split_bytes

    assert _split_bytes(torch.empty(0, 4), [6], 1) == 96
    assert _split_bytes(torch.empty(3, 2, 2), [1, 2], 2) == 48


def test_collectives_bound_by_name_before_init_are_timed(world1: Any, tmp_path: Path) -> None:
    # torchtitan's token dispatcher: `from torch.distributed._functional_collectives import
    # all_to_all_single`, at import, long before stepscope.init.
    import sys
    import types

    user = types.ModuleType("user_dispatcher")
    user.all_to_all_single = funcol.all_to_all_single  # type: ignore[attr-defined]
    user.all_reduce = dist.all_reduce  # type: ignore[attr-defined]
    originals = (funcol.all_to_all_single, dist.all_reduce)
    sys.modules["user_dispatcher"] = user
    try:
        out = tmp_path / "run"
        tr = stepscope.Tracer(stepscope.Config(out_dir=str(out), auto=set()))
        assert user.all_to_all_single is not originals[0]  # type: ignore[attr-defined]
        for _ in range(3):
            with tr.step():
                funcol.wait_tensor(user.all_to_all_single(torch.ones(6, 4), [6], [6], dist.group.WORLD))  # type: ignore[attr-defined]
                user.all_reduce(torch.ones(4))  # type: ignore[attr-defined]
        tr.finish()
        assert (user.all_to_all_single, user.all_reduce) == originals  # type: ignore[attr-defined]
    finally:
        del sys.modules["user_dispatcher"]
    ops = {o["op"]: o for o in analyze_run(out)["collectives"]["ops"]}
    assert set(ops) == {"all_to_all_single", "all_reduce"}, ops
