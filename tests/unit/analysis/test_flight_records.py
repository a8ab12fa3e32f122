"""`stepscope status` reads PyTorch Flight Recorder dumps: a 2-rank gloo job hung on purpose."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from stepscope.analysis.flight_records import analyze_flight
from stepscope.analysis.hangs import analyze_status
from stepscope.recording.dist import free_port

pytest.importorskip("torch.distributed.flight_recorder")

# Rank 1 never reaches the all-reduce of step 4 (it sleeps inside the same "sync" phase the
# other rank waits in, so the heartbeats alone show two ranks in the same place). Collective
# timing is off so the heartbeat cannot tell a collective apart either. Each rank also writes
# PyTorch's own pickled dump through torch's API, as NCCL would on a timeout.
_JOB = textwrap.dedent(
    """
    import datetime, os, sys, threading, time
    import torch, torch.distributed as dist
    import stepscope
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    stepscope.init(out_dir=out, auto=False, collectives=False, heartbeat_s=0.3,
                   dump_stacks_after_s=1.0, run_id="hang")
    sub = dist.new_group([0, 1])

    def torch_dump():
        time.sleep(3.0)
        from torch._C._distributed_c10d import _dump_fr_trace
        d = os.path.join(out, "flight_recorder")
        os.makedirs(d, exist_ok=True)
        data = _dump_fr_trace()  # symbolises stack frames: can take seconds
        with open(os.path.join(d, f".tmp{rank}"), "wb") as fh:
            fh.write(data)
        os.replace(os.path.join(d, f".tmp{rank}"), os.path.join(d, f"nccl_trace_rank_{rank}"))

    t = torch.ones(8)
    for i in range(6):
        with stepscope.step():
            with stepscope.phase("sync"):
                dist.broadcast(t, 0, group=sub)
                if i == 4:
                    threading.Thread(target=torch_dump, daemon=True).start()
                    if rank == 1:
                        time.sleep(600)  # hung here: never enters the all_reduce below
                dist.all_reduce(t)
    """
)


def _start(tmp_path: Path) -> tuple[Path, list[subprocess.Popen[bytes]]]:
    out = tmp_path / "run"
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    port = str(free_port())
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(out)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in (0, 1)]
    return out, procs


def _wait_for(paths: list[Path], procs: list[subprocess.Popen[bytes]], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for pr in procs:
            if pr.poll() is not None:
                err = pr.stderr.read().decode() if pr.stderr else ""
                raise AssertionError(f"a rank exited early (rc {pr.returncode}): {err[-2000:]}")
        assert time.monotonic() < deadline, f"no dumps after {timeout} s: {[p.exists() for p in paths]}"
        time.sleep(0.1)


@pytest.mark.slow
def test_status_names_the_hung_rank_and_collective_from_the_dumps(tmp_path: Path) -> None:
    out, procs = _start(tmp_path)
    try:
        ours = [out / f"rank{r}.flight.json" for r in (0, 1)]
        native = [out / "flight_recorder" / f"nccl_trace_rank_{r}" for r in (0, 1)]
        _wait_for(ours + native, procs)
        time.sleep(0.5)
        assert all(p.poll() is None for p in procs)  # still hung

        doc = analyze_status(out, stalled_after_s=1.0)
        # The heartbeats alone: both ranks at step 4 in "sync" -- no culprit from them.
        assert [v["step"] for v in doc["ranks"]] == [4, 4]
        assert [v["phase_stack"] for v in doc["ranks"]] == [["sync"], ["sync"]]
        fr = doc["flight_recorder"]
        assert fr["source"].startswith("stepscope heartbeat")
        assert fr["culprit_ranks"] == [1]
        un = fr["first_unmatched"]
        assert un["op"] == "gloo:all_reduce" and un["missing_ranks"] == [1]
        assert un["expected_ranks"] == [0, 1] and un["pg_desc"].endswith("default_pg")
        r0, r1 = fr["ranks"]
        assert r0["in_collective"]["op"] == "gloo:all_reduce"
        assert r0["in_collective"]["seq"] == un["seq"]
        assert r1["in_collective"] is None  # rank 1 is in no collective at all
        assert r1["seq_by_pg"][r0["in_collective"]["pg"]] == un["seq"] - 1
        behind = {b["pg"]: b for b in fr["behind"]}[r0["in_collective"]["pg"]]
        assert behind["behind"] == [1]
        cul = doc["culprit"]
        assert cul["rank"] == 1 and cul["source"] == "flight_recorder"
        assert "never entered gloo:all_reduce" in cul["why"] and f"sequence {un['seq']}" in cul["why"]
        assert {v["rank"]: v["state"] for v in doc["ranks"]}[0] == "waiting"
        assert "Flight Recorder" in doc["summary"]

        # Before any rank counts as stalled the dump is only a note, not a culprit.
        calm = analyze_status(out, stalled_after_s=3600.0)
        assert calm["culprit"] is None and calm["flight_recorder"]["culprit_ranks"] == [1]
        assert any("no rank is stalled now" in n for n in calm["notes"])

        # The CLI, JSON and terminal.
        from stepscope.cli.status_cmd import status_command

        buf = io.StringIO()
        with redirect_stdout(buf):
            assert status_command(str(out), as_json=True, stalled_after_s=1.0) == 0
        js = json.loads(buf.getvalue())
        assert js["culprit"]["rank"] == 1 and js["flight_recorder"]["culprit_ranks"] == [1]
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert status_command(str(out), as_json=False, stalled_after_s=1.0) == 0
        text = buf.getvalue()
        assert "culprit: rank 1" in text and "Flight Recorder" in text and "gloo:all_reduce" in text

        # PyTorch's own (pickled) dump files, read by torch's loader, say the same.
        for p in ours:
            p.rename(p.with_suffix(".moved"))
        # Pickles are not loaded unless the reader says it trusts the run directory.
        untrusted = analyze_flight(out, 2)
        assert untrusted is not None and untrusted["culprit_ranks"] == []
        assert any("--trust-flight-dumps" in n for n in untrusted["notes"])
        fr2 = analyze_flight(out, 2, trust_dumps=True)
        assert fr2 is not None and fr2["source"].startswith("PyTorch dump files")
        assert fr2["culprit_ranks"] == [1]
        assert fr2["first_unmatched"]["op"] == "gloo:all_reduce"
        assert fr2["first_unmatched"]["seq"] == un["seq"]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(30)
            if p.stderr is not None:
                p.stderr.close()


def _dump(rank: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}},
            "entries": entries, "stepscope": {"rank": rank}}


def _entry(seq: int, op: str = "gloo:all_reduce", retired: bool = True) -> dict[str, Any]:
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"],
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": op,
            "time_created_ns": seq, "input_sizes": [[4]], "output_sizes": [[4]],
            "input_dtypes": ["Float"], "output_dtypes": ["Float"], "state": "scheduled",
            "time_discovered_started_ns": 0, "time_discovered_completed_ns": 0,
            "retired": retired, "is_p2p": False, "timeout_ms": 1000}


def test_mismatched_op_and_missing_dump(tmp_path: Path) -> None:
    # Rank 2 wrote no dump (it died); ranks 0 and 1 disagree at sequence 3.
    (tmp_path / "rank0.flight.json").write_text(json.dumps(_dump(0, [
        _entry(1), _entry(2), _entry(3, retired=False)])))
    (tmp_path / "rank1.flight.json").write_text(json.dumps(_dump(1, [
        _entry(1), _entry(2), _entry(3, op="gloo:broadcast", retired=False)])))
    fr = analyze_flight(tmp_path, 3)
    assert fr is not None
    assert fr["missing_dumps"] == [2]
    un = fr["first_unmatched"]
    assert un is not None and un["seq"] == 3 and not un["pass_check"]
    assert un["ops_by_rank"] == {"0": "gloo:all_reduce", "1": "gloo:broadcast"}
    assert "does not match across ranks" in fr["why"] and "rank 1: gloo:broadcast" in fr["why"]


def test_no_dump_no_section_and_torn_dump_noted(tmp_path: Path) -> None:
    assert analyze_flight(tmp_path) is None
    (tmp_path / "rank0.flight.json").write_text('{"entries": [')
    torn = analyze_flight(tmp_path)  # a torn dump alone is said, not silently dropped
    assert torn is not None and torn["culprit_ranks"] == [] and torn["ranks"] == []
    assert any("rank0.flight.json" in n for n in torn["notes"])
    (tmp_path / "rank1.flight.json").write_text(json.dumps(_dump(1, [_entry(1), _entry(2)])))
    fr = analyze_flight(tmp_path, 2)
    assert fr is not None and any("rank0.flight.json" in n for n in fr["notes"])
    assert fr["missing_dumps"] == [0]


def test_flight_dumps_outside_the_run_are_not_read(tmp_path):
    """The same rules as every run file: a symlinked dump pointing outside the run is refused,
    and torch's pickled dumps are not loaded without --trust-flight-dumps."""
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(_dump(0, [])))
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.flight.json").symlink_to(outside)
    fr = analyze_flight(run, 1)
    assert fr is not None and fr["ranks"] == []
    assert any("rank0.flight.json" in n for n in fr["notes"])
    (run / "rank0.flight.json").unlink()
    (run / "flight_recorder").mkdir()
    (run / "flight_recorder" / "nccl_trace_rank_0").write_bytes(b"not read at all")
    fr = analyze_flight(run, 1)
    assert fr is not None and fr["culprit_ranks"] == []
    assert any("pickles" in n for n in fr["notes"])
