"""Real multi-process runs: gloo ranks through the real init/step path, and a killed rank."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from stepscope.demo import SlowSpec, launch
from stepscope.recording.schema import ReadReport, iter_jsonl, read_run

pytestmark = pytest.mark.slow


def test_two_gloo_ranks_record_their_own_files(tmp_path):
    out = launch(tmp_path / "run", ranks=2, steps=30,
                 slow=(SlowSpec(rank=1, phase="forward", start_step=10, end_step=20, ms=10),))
    recs = read_run(out)
    by_rank = {r: [x for x in recs if x["rank"] == r] for r in (0, 1)}
    for rank, rs in by_rank.items():
        assert [x["step"] for x in rs] == list(range(30))
        assert {x["world_size"] for x in rs} == {2}
        assert {x["local_rank"] for x in rs} == {rank}
        names = [p["name"] for p in rs[5]["phases"] if p["parent"] is None]
        assert names[:5] == ["dataloader", "h2d", "forward", "backward", "optimizer"], names
        nested = {p["name"]: p["parent"] for p in rs[5]["phases"] if p["parent"] is not None}
        assert nested == {"grad_sync": "backward"}
    assert len({x["run_id"] for x in recs}) == 1
    # The injected 10 ms forward on rank 1, steps 10-19, and nowhere else.
    fwd = {(x["rank"], x["step"]): next(p["ms"] for p in x["phases"] if p["name"] == "forward")
           for x in recs}
    assert min(fwd[(1, s)] for s in range(10, 20)) >= 10.0
    assert statistics.median(fwd[(0, s)] for s in range(30)) < 5.0
    assert statistics.median(fwd[(1, s)] for s in [*range(10), *range(20, 30)]) < 5.0
    # DDP equalises steps: rank 0 waits for rank 1 inside backward (the all-reduce).
    bwd0 = [next(p["ms"] for p in x["phases"] if p["name"] == "backward") for x in by_rank[0][10:20]]
    assert sorted(bwd0)[len(bwd0) // 2] >= 5.0
    # Step starts on one host are on one timeline: the same step starts close together.
    starts = {(x["rank"], x["step"]): x["start_unix_ns"] for x in recs}
    gaps = [abs(starts[(0, s)] - starts[(1, s)]) / 1e6 for s in range(30)]
    assert statistics.median(gaps) < 20.0, gaps


KILLED_JOB = textwrap.dedent(
    """
    import sys, time, torch, stepscope
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stepscope.init(out_dir=sys.argv[1], model=model, optimizer=opt, flush_every_n_steps=5)
    step = 0
    while True:
        with stepscope.step():
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        step += 1
        time.sleep(0.002)
    """
)


def test_killed_rank_leaves_a_readable_file(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(KILLED_JOB)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(out)])
    path = out / "rank0.jsonl"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if path.exists() and path.read_bytes().count(b"\n") >= 40:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the job never wrote 40 records")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    rep = ReadReport(path)
    recs = list(iter_jsonl(path, rep))
    assert len(recs) >= 40 and rep.bad_lines == []
    # Records arrive in whole flushes of 5, in step order, none lost before the last flush.
    assert [r["step"] for r in recs] == list(range(len(recs)))
