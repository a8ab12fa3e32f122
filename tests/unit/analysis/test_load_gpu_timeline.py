"""The analysis reads the GPU timeline: ``gpu_start_unix_ns`` places steps,
and on a CUDA clock the dataloader's time is the host's wait (``host_ms``), not GPU idle."""

from __future__ import annotations

import json

import pytest

from stepscope.analysis.load import load_run

T0 = 1_700_000_000_000_000_000


def _rec(rank: int, step: int, *, host_lag_ms: float, gpu: bool) -> dict:
    start = T0 + step * 20_000_000
    rec = {
        "schema": 2, "run_id": "r", "rank": rank, "local_rank": rank, "world_size": 2,
        "hostname": "h", "step": step, "clock": "cuda" if gpu else "cpu",
        "device_name": f"cuda:{rank}" if gpu else "cpu",
        # The host enters the step ahead of its GPU by its own lag.
        "start_unix_ns": start - int(host_lag_ms * 1e6), "step_ms": 18.0, "residual_ms": 1.0,
        "phases": [
            # GPU idle while the host waited for data: 0.5 ms; the host waited 6 ms.
            {"name": "dataloader", "path": "dataloader", "parent": None, "ms": 0.5, "calls": 1,
             "start_ms": 0.0, "end_ms": 0.5, "host_ms": 6.0},
            {"name": "forward", "path": "forward", "parent": None, "ms": 16.5, "calls": 1,
             "start_ms": 0.5, "end_ms": 17.0},
        ],
        "dropped": {},
    }
    if gpu:
        rec["gpu_start_unix_ns"] = start
    return rec


@pytest.mark.parametrize("gpu", [True, False])
def test_steps_are_placed_by_the_gpu_start_and_the_dataloader_is_the_hosts_wait(tmp_path, gpu):
    lags = {0: 3.0, 1: 40.0}  # rank 1's GPU lags its host by 40 ms, rank 0's by 3 ms
    for rank, lag in lags.items():
        with open(tmp_path / f"rank{rank}.jsonl", "w") as fh:
            for step in range(10):
                fh.write(json.dumps(_rec(rank, step, host_lag_ms=lag, gpu=gpu)) + "\n")
    data = load_run(tmp_path, store=False)
    try:
        t0 = dict(data.con.execute("SELECT rank, t0 FROM steps WHERE step = 5").fetchall())
        dl = dict(data.con.execute(
            "SELECT rank, ms FROM phases WHERE step = 5 AND name = 'dataloader'").fetchall())
    finally:
        data.close()
    if gpu:
        assert t0[0] == pytest.approx(t0[1]), "the GPU timeline puts both ranks' step 5 together"
        assert dl == {0: pytest.approx(6.0), 1: pytest.approx(6.0)}
    else:
        # Host clock: host entry time is the timeline, and the dataloader span is the wait.
        assert t0[1] - t0[0] == pytest.approx(-37.0)
        assert dl == {0: pytest.approx(0.5), 1: pytest.approx(0.5)}
