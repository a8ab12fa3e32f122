"""Init agreement across ranks (dist.agree_at_init): real 2-rank gloo jobs started by mp.spawn.

Ranks configured differently must not hang or shift
the job's own process-group counter, and a job launched without torchrun gets one run id.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from stepscope.cli import main
from stepscope.recording.dist import JOB_ID_VARS, agree_at_init, free_port, launcher_run_id, run_then_exit

#: Generous for a loaded 2-core machine; the defects hang for 120 s or until the deadline.
JOB_DEADLINE_S = 150.0


def _clean_env() -> None:
    """A plain mp.spawn job: no launcher ids, no torchrun variables, no env overrides."""
    for names in JOB_ID_VARS:
        for name in names:
            os.environ.pop(name, None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "STEPSCOPE_LOG_EVERY_N_STEPS", "STEPSCOPE_HEARTBEAT_S"):
        os.environ.pop(name, None)


def _spawn(fn: Any, *args: Any) -> None:
    """Run ``fn(rank, *args)`` on 2 ranks; fail (not hang) when the job outlives the deadline."""
    ctx = mp.spawn(run_then_exit, args=(fn, *args), nprocs=2, join=False)  # type: ignore[attr-defined]
    deadline = time.monotonic() + JOB_DEADLINE_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"2-rank job still running after {JOB_DEADLINE_S:.0f} s (hang)")


def _different_configs(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import stepscope

    _clean_env()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t0 = time.perf_counter()
    # The pattern from the issue: only rank 0 asks for the live line.
    tracer = stepscope.init(out_dir=out, auto=False, heartbeat_s=0,
                            log_every_n_steps=5 if rank == 0 else 0, flush_every_n_steps=5)
    init_s = time.perf_counter() - t0
    # The job's own group, created after stepscope's: a collective on it must pair up.
    t1 = time.perf_counter()
    mine = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=mine)
    own_s = time.perf_counter() - t1
    for _ in range(30):
        with stepscope.step(), stepscope.phase("forward"):
            time.sleep(0.004 if rank == 1 else 0.001)
    dist.barrier()  # the test's own sync, so the last exchange completes for both ranks
    stepscope.finish()
    view = tracer.live
    result = {
        "init_s": init_s, "own_s": own_s, "sum": float(x.item()),
        "live": view is not None, "distributed": bool(view is not None and view.distributed),
        "exchanges": view.exchanges_done if view is not None else 0,
        "lines": list(view.lines) if view is not None else [],
        "run_id": tracer.run_id,
    }
    Path(out, f"result{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_ranks_with_different_live_configs_neither_hang_nor_break_the_jobs_own_group(tmp_path):
    _spawn(_different_configs, free_port(), str(tmp_path))
    r = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in (0, 1)]
    for res in r:
        # Before: rank 0 stalled in stepscope's new_group until rank 1's own new_group paired
        # with it, and the job's own group then hung on rank 0.
        assert res["init_s"] < 20.0, res
        assert res["own_s"] < 20.0, res
        assert res["sum"] == 3.0  # the job's own all_reduce went through on its own group
        # Rank 1 asked for no line but takes part in the exchange the ranks agreed on.
        assert res["live"] and res["distributed"], res
        assert res["exchanges"] >= 2, res
    assert r[1]["lines"] == []
    assert r[0]["lines"] and "2/2 ranks" in r[0]["lines"][-1], r[0]["lines"]
    assert r[0]["run_id"] == r[1]["run_id"]


def _plain_spawn_job(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import stepscope

    _clean_env()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    stepscope.init(out_dir=out, auto=False, heartbeat_s=0.2)
    for _ in range(6):
        with stepscope.step(), stepscope.phase("forward"):
            time.sleep(0.002)
    dist.barrier()
    stepscope.finish()


@pytest.mark.slow
def test_plain_mp_spawn_job_gets_one_run_id_and_status_lists_both_ranks(tmp_path, capsys):
    _spawn(_plain_spawn_job, free_port(), str(tmp_path))
    ids = set()
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        assert lines
        ids |= {json.loads(line)["run_id"] for line in lines}
    assert len(ids) == 1, ids
    capsys.readouterr()
    rc = main(["status", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert out["run"]["id"] == ids.pop()
    assert sorted(v["rank"] for v in out["ranks"]) == [0, 1], out
    assert out["missing_ranks"] == []
    assert not any("ignored" in n for n in out["notes"]), out["notes"]


def test_launcher_run_id_from_env():
    assert launcher_run_id({}) is None
    assert launcher_run_id({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}) == "4242-3"
    assert launcher_run_id({"SLURM_JOB_ID": "4242"}) == "4242"
    # torchrun's id wins over the scheduler's (it is what torchrun's restarts share).
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "te", "SLURM_JOB_ID": "1"}) == "te"
    assert launcher_run_id({"STEPSCOPE_RUN_ID": "mine", "TORCHELASTIC_RUN_ID": "te"}) == "mine"
    assert launcher_run_id({"PBS_JOBID": "  "}) is None


def test_agreement_without_a_process_group_is_this_ranks_own(monkeypatch):
    for names in JOB_ID_VARS:
        for name in names:
            monkeypatch.delenv(name, raising=False)
    a = agree_at_init(run_id=None, wants_side_group=True, ranks=None)
    assert not a.agreed and not a.side_group and a.run_id
    assert agree_at_init(run_id="given", wants_side_group=False, ranks=None).run_id == "given"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert agree_at_init(run_id=None, wants_side_group=False, ranks=None).run_id == "77"
    with pytest.raises(ValueError, match="timeout_s"):
        agree_at_init(run_id=None, wants_side_group=False, ranks=None, timeout_s=0)
