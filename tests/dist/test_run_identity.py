"""Run identity: one id per launch, agreed by the ranks, and two launches into one directory
kept apart by the report. Real two-rank gloo jobs started by ``mp.spawn`` as plain
``torchrun`` leaves them (``TORCHELASTIC_RUN_ID=none``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from stepscope.cli import main
from stepscope.recording.dist import JOB_ID_VARS, free_port, launcher_run_id, run_then_exit

JOB_DEADLINE_S = 150.0  # generous for a loaded 2-core machine


def _plain_torchrun_job(rank: int, port: int, out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import stepscope

    for names in JOB_ID_VARS:
        for name in names:
            os.environ.pop(name, None)
    os.environ["TORCHELASTIC_RUN_ID"] = "none"  # what plain torchrun sets on every launch
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    stepscope.init(out_dir=out, auto=False, heartbeat_s=0)
    for _ in range(steps):
        with stepscope.step(), stepscope.phase("forward"):
            time.sleep(0.002)
    dist.barrier()
    stepscope.finish()
    dist.destroy_process_group()


def _launch(out: Path, steps: int) -> None:
    ctx = mp.spawn(run_then_exit, args=(_plain_torchrun_job, free_port(), str(out), steps),  # type: ignore[attr-defined]
                   nprocs=2, join=False)
    deadline = time.monotonic() + JOB_DEADLINE_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"2-rank job still running after {JOB_DEADLINE_S:.0f} s (hang)")


def _ids_by_rank(out: Path) -> dict[str, set[int]]:
    ids: dict[str, set[int]] = {}
    for rank in (0, 1):
        for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
            ids.setdefault(json.loads(line)["run_id"], set()).add(rank)
    return ids


def _report(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["report", *args, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_a_launcher_that_says_none_gives_no_id() -> None:
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "none"}) is None
    # plain torchrun inside a Slurm allocation: the job id would not tell launches apart
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7"}) is None
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "a1b2"}) == "a1b2"


@pytest.mark.slow
def test_two_plain_torchrun_launches_into_one_directory_are_two_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _launch(tmp_path, 12)
    first = _ids_by_rank(tmp_path)
    _launch(tmp_path, 8)
    ids = _ids_by_rank(tmp_path)
    # One id per launch, the same on both ranks, and not "none".
    assert len(first) == 1 and len(ids) == 2, ids
    assert all(ranks == {0, 1} for ranks in ids.values()), ids
    old = next(iter(first))
    new = next(i for i in ids if i != old)
    assert "none" not in ids

    doc = _report(capsys, str(tmp_path))
    run = doc["run"]
    assert run["run_id"] == new and run["steps"] == 8 and run["records"] == 16
    assert not run["partial"], run["skipped"]
    assert [r["run_id"] for r in run["runs"]] == [old, new]
    assert [r["shown"] for r in run["runs"]] == [False, True]
    assert any(old in n and "2 runs" in n for n in run["notes"]), run["notes"]
    gp = doc["goodput"]
    assert gp["lost_gpu_hours"]["restarts"] == 0.0
    assert [r["run_id"] for r in gp["runs"]] == [new]

    doc = _report(capsys, str(tmp_path), "--run", old)
    assert doc["run"]["run_id"] == old and doc["run"]["steps"] == 12
    assert doc["goodput"]["lost_gpu_hours"]["restarts"] == 0.0

    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Partial report" not in out and "2 runs" in out

    assert main(["report", str(tmp_path), "--run", "no-such-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and old in err and new in err


def _record(out: Path, run_id: str, steps: int) -> None:
    import stepscope

    stepscope.init(out_dir=str(out), run_id=run_id, auto=False, heartbeat_s=0)
    for _ in range(steps):
        with stepscope.step(), stepscope.phase("forward"):
            time.sleep(0.001)
    stepscope.finish()


@pytest.mark.parametrize("store", [True, False], ids=["parquet-store", "jsonl"])
def test_two_runs_in_one_directory_are_analysed_apart(tmp_path: Path, store: bool) -> None:
    from stepscope.analysis.run import analyze_run

    first = "first'run"  # a quote in an id is data, not SQL
    _record(tmp_path, first, 12)
    _record(tmp_path, "second", 6)  # the same rank and steps 0-5 again, a later launch
    doc = analyze_run(tmp_path, store=store)
    run = doc["run"]
    assert run["run_id"] == "second" and run["steps"] == 6, run
    assert not run["partial"] and run["skipped"] == [], run["skipped"]
    assert [(r["run_id"], r["records"], r["ranks"], r["shown"]) for r in run["runs"]] == [
        (first, 12, 1, False), ("second", 6, 1, True)]
    assert doc["goodput"]["lost_gpu_hours"]["restarts"] == 0.0, doc["goodput"]
    doc = analyze_run(tmp_path, store=store, run_id="first")  # a unique prefix
    assert doc["run"]["run_id"] == first and doc["run"]["steps"] == 12
    assert [r["shown"] for r in doc["run"]["runs"]] == [True, False]
    assert "(the newest)" not in doc["run"]["notes"][0] and "second" in doc["run"]["notes"][0]


def test_one_run_lists_itself_and_says_nothing_of_others(tmp_path: Path) -> None:
    from stepscope.analysis.run import analyze_run

    _record(tmp_path, "only", 5)
    run = analyze_run(tmp_path)["run"]
    assert run["runs"] == [{"run_id": "only", "records": 5, "ranks": 1,
                            "start_unix": run["runs"][0]["start_unix"],
                            "last_start_unix": run["runs"][0]["last_start_unix"], "shown": True}]
    assert not any("this report shows run" in n for n in run["notes"]), run["notes"]
