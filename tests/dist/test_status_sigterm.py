"""SIGTERM to a rank blocked in a collective ends it at once: real gloo ranks."""

from __future__ import annotations

import paths  # tests/support: where the repository is

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stepscope.recording.dist import free_port

SRC = str(paths.SRC)

RANK = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist, stepscope
    out, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    stepscope.init(out_dir=out, auto=False, heartbeat_s=0.5, run_id="term")
    x = torch.ones(4)
    for _ in range(3):
        with stepscope.step(), stepscope.phase("sync"):
            dist.all_reduce(x)
    if rank == 0:
        print("idle", flush=True)
        time.sleep(600)  # never enters the next all_reduce
    with stepscope.step(), stepscope.phase("sync"):
        print("blocking", flush=True)
        dist.all_reduce(x)  # blocks in C until the 300 s timeout
    print("returned", flush=True)
    """
)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("STEPSCOPE_HEARTBEAT_S", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return env


def _wait_for(proc: subprocess.Popen[str], word: str, timeout: float = 120.0) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == word:
            return
        if not line and proc.poll() is not None:
            break
    pytest.fail(f"rank never printed {word!r} (rc={proc.poll()})")


@pytest.mark.slow
def test_sigterm_ends_a_rank_blocked_in_a_collective_within_seconds(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(RANK)
    run = tmp_path / "run"
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(run), str(r), port], env=_env(),
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        _wait_for(procs[0], "idle")
        _wait_for(procs[1], "blocking")
        time.sleep(1.0)  # rank 1 is inside all_reduce now
        t0 = time.monotonic()
        procs[1].send_signal(signal.SIGTERM)
        try:
            procs[1].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 1 still alive 60 s after SIGTERM")
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=60)
    # Before: the handler waited for the collective to time out. Now: the flush deadline (2 s)
    # plus a loaded machine's margin.
    assert took < 10.0, took
    assert procs[1].returncode == -signal.SIGTERM  # still dies of SIGTERM, as without stepscope
    beat = json.loads((run / "rank1.status.json").read_text())
    assert beat["state"] == "crashed" and beat["error"]["type"] == "SIGTERM", beat
    assert beat["phase_stack"] == ["sync"] and beat["step"] == 3, beat
    # The three finished steps reached the file before the process died.
    steps = [json.loads(line)["step"] for line in (run / "rank1.jsonl").read_text().splitlines()]
    assert steps[:3] == [0, 1, 2], steps
