"""Heartbeat files, crash evidence and ``stepscope status``: real processes, real files."""

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

from stepscope.analysis.hangs import analyze_status, is_collective
from stepscope.cli import main
from stepscope.recording.dist import free_port

SRC = str(paths.SRC)

SINGLE = textwrap.dedent(
    """
    import sys, time, torch, stepscope
    mode = sys.argv[2]
    stepscope.init(out_dir=sys.argv[1], auto=False, heartbeat_s=0.3, dump_stacks_after_s=1.0,
                   flush_every_n_steps=1000)
    for i in range(100000):
        try:
            with stepscope.step():
                with stepscope.phase("compute"):
                    torch.ones(8).sum()
                if i == 5:
                    with stepscope.phase("outer"):
                        with stepscope.phase("inner"):
                            if mode == "raise" or mode == "caught":
                                raise ValueError("bad batch at five")
                            print("ready", flush=True)
                            time.sleep(600)
        except ValueError:
            if mode != "caught":
                raise
        if mode == "caught" and i == 8:
            print("ready", flush=True)
            time.sleep(600)
    """
)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("STEPSCOPE_HEARTBEAT_S", None)
    return env


def _status(run: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["status", str(run), "--json", *extra])
    out = capsys.readouterr().out
    return rc, (json.loads(out) if out.strip() else {})


def _single(tmp_path: Path, mode: str) -> tuple[Path, subprocess.Popen[str]]:
    script = tmp_path / "job.py"
    script.write_text(SINGLE)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run), mode], env=_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    return run, proc


def _wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.poll() is not None else "")


def test_exception_leaving_step_is_recorded_with_its_phase_and_propagates(tmp_path, capsys):
    run, proc = _single(tmp_path, "raise")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "ValueError: bad batch at five" in err  # the user's exception, untouched
    rc, doc = _status(run, capsys=capsys)
    assert rc == 0
    assert rc == 0
    (r,) = doc["ranks"]
    assert r["state"] == "crashed"
    assert r["step"] == 5
    assert r["phase_stack"] == ["outer", "inner"]
    assert "ValueError" in r["error"] and "bad batch at five" in r["error"]
    # Resolved records of the steps before the crash reached the file (flushed on raise/exit).
    steps = [json.loads(x)["step"] for x in (run / "rank0.jsonl").read_text().splitlines()]
    assert list(range(5)) == steps[:5]
    # `stepscope report` says it too.
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "rank 0 raised ValueError in outer/inner at step 5: bad batch at five" in out


def test_caught_exception_is_not_a_crash(tmp_path, capsys):
    run, proc = _single(tmp_path, "caught")
    try:
        _wait_ready(proc)
        deadline = time.monotonic() + 60
        hb = json.loads((run / "rank0.status.json").read_text())
        while hb["step"] < 9 and time.monotonic() < deadline:  # the heartbeat after step 8
            time.sleep(0.1)
            hb = json.loads((run / "rank0.status.json").read_text())
        rc, doc = _status(run, capsys=capsys)
        assert rc == 0
        (r,) = doc["ranks"]
        assert r["state"] == "running", r
        assert hb["last_error"]["message"] == "bad batch at five"
        assert hb["last_error"]["phase_stack"] == ["outer", "inner"]
    finally:
        proc.kill()
        proc.communicate(timeout=60)


def test_sigterm_records_the_phase_and_still_kills(tmp_path, capsys):
    run, proc = _single(tmp_path, "hang")
    try:
        _wait_ready(proc)
        deadline = time.monotonic() + 60
        while not (run / "rank0.stacks.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        rc, doc = _status(run, "--stalled-after", "0.5", capsys=capsys)
        (r,) = doc["ranks"]
        assert r["state"] == "stalled" and r["phase_stack"] == ["outer", "inner"], r
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM  # default action re-raised after the write
    rc, doc = _status(run, capsys=capsys)
    assert rc == 0
    (r,) = doc["ranks"]
    assert r["state"] == "crashed" and "SIGTERM" in r["error"]
    assert r["phase_stack"] == ["outer", "inner"] and r["step"] == 5
    # The stack dump shows the main thread sleeping inside the job's step.
    stacks = (run / "rank0.stacks.txt").read_text()
    assert "job.py" in stacks and "main thread" in stacks


def test_sigkill_leaves_a_dead_rank(tmp_path, capsys):
    run, proc = _single(tmp_path, "hang")
    _wait_ready(proc)
    deadline = time.monotonic() + 60
    while "inner" not in (run / "rank0.status.json").read_text() and time.monotonic() < deadline:
        time.sleep(0.1)  # the heartbeat after the phase opened
    proc.kill()
    proc.communicate(timeout=60)
    rc, doc = _status(run, capsys=capsys)
    assert rc == 0
    assert rc == 0
    (r,) = doc["ranks"]
    assert r["state"] == "dead" and "is gone" in r["reason"]
    assert r["phase_stack"] == ["outer", "inner"]


HANG_JOB = textwrap.dedent(
    """
    import os, sys, time, datetime, torch, torch.distributed as dist, stepscope
    torch.set_num_threads(1)
    rank, world, mode = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    stepscope.init(out_dir=sys.argv[1], auto=False, heartbeat_s=0.5, run_id="hang-test",
                   dump_stacks_after_s=2.0)
    t = torch.ones(16)
    for i in range(1000000):
        with stepscope.step():
            with stepscope.phase("compute"):
                time.sleep(0.005)
            if i == 5 and rank == 2:
                with stepscope.phase("stuck"):
                    if mode == "raise":
                        raise RuntimeError("rank 2 exploded")
                    time.sleep(3600)
            with stepscope.phase("sync"):
                dist.all_reduce(t)
    """
)


def _launch(tmp_path: Path, mode: str, world: int = 4) -> tuple[Path, list[subprocess.Popen[bytes]]]:
    script = tmp_path / "hang.py"
    script.write_text(HANG_JOB)
    run = tmp_path / "run"
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, str(script), str(run), mode], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return run, procs


def _poll(run: Path, until, capsys, timeout: float = 180.0, *extra: str) -> dict:
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline:
        if (run / "rank0.status.json").exists():
            rc, doc = _status(run, *extra, capsys=capsys)
            if rc == 0 and until(doc):
                return doc
        time.sleep(1.0)
    raise AssertionError(f"status never reached the expected state: {json.dumps(doc, indent=1)}")


@pytest.mark.slow
def test_hung_rank_is_named_and_the_others_wait_then_sigkill_makes_it_dead(tmp_path, capsys):
    run, procs = _launch(tmp_path, "hang")
    try:
        def named(doc: dict) -> bool:
            c = doc.get("culprit")
            # The others pass the stall threshold a few ms before rank 2 (they entered step 5
            # first): the culprit is named then, while rank 2 itself is still "running".
            return (len(doc["ranks"]) == 4 and c is not None and c["rank"] == 2
                    and all(r["state"] == "waiting" for r in doc["ranks"] if r["rank"] != 2)
                    and {r["rank"]: r for r in doc["ranks"]}[2]["state"] == "stalled")

        doc = _poll(run, named, capsys, 180.0)  # default thresholds: max(5 s, 2 beats, 10 steps)
        cul = doc["culprit"]
        # Stalled counts from the step's start; "stuck" began about 5 ms later.
        assert cul["phase"] == "stuck" and cul["step"] == 5 and cul["since_s"] >= 4.9
        assert doc["run"] == {"id": "hang-test", "world_size": 4, "dir": str(run)}
        by_rank = {r["rank"]: r for r in doc["ranks"]}
        assert by_rank[2]["state"] == "stalled"
        for r in (0, 1, 3):
            assert by_rank[r]["phase_stack"] == ["sync"] and by_rank[r]["step"] == 5
            assert by_rank[r]["collective"] == "all_reduce"  # the timed collective it is blocked in
        assert "collective" not in by_rank[2]
        # The culprit's stack dump (written after 2 s in the step) shows where it sleeps.
        doc = _poll(run, lambda d: bool((d["culprit"] or {}).get("stack_top")), capsys, 60.0,
                    "--stalled-after", "3")
        assert any("hang.py" in f for f in doc["culprit"]["stack_top"]), doc["culprit"]

        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(timeout=60)
        doc = _poll(run, lambda d: {r["rank"]: r for r in d["ranks"]}[2]["state"] == "dead",
                    capsys, 60.0, "--stalled-after", "3")
        assert doc["culprit"]["rank"] == 2 and doc["culprit"]["state"] == "dead"
        assert doc["culprit"]["phase"] == "stuck"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=60)


@pytest.mark.slow
def test_exception_in_one_rank_is_the_culprit_with_its_phase(tmp_path, capsys):
    run, procs = _launch(tmp_path, "raise", world=3)
    try:
        def crashed(doc: dict) -> bool:
            return len(doc["ranks"]) == 3 and any(
                r["rank"] == 2 and r["state"] == "crashed" for r in doc["ranks"])

        doc = _poll(run, crashed, capsys, 180.0, "--stalled-after", "3")
        r2 = {r["rank"]: r for r in doc["ranks"]}[2]
        assert "RuntimeError" in r2["error"] and "rank 2 exploded" in r2["error"]
        assert r2["phase_stack"] == ["stuck"] and r2["step"] == 5
        assert doc["culprit"]["rank"] == 2 and doc["culprit"]["phase"] == "stuck"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=60)


# ----------------------------------------------------------------- bad heartbeat files


def _beat(run: Path, rank: int, **kw: object) -> None:
    now = time.time()
    doc = {
        "kind": "stepscope-heartbeat", "schema": 1, "run_id": "r1", "rank": rank, "world_size": 4,
        "host": "elsewhere", "pid": 1, "interval_s": 1.0, "started_unix": now - 100,
        "updated_unix": now, "state": "running", "step": 10, "in_step": True,
        "phase_stack": ["sync"], "phase_since_unix": now - 1, "step_since_unix": now - 1,
        "in_phase_s": 1.0, "last_step": 9, "last_step_unix": now - 1, "last_step_s": 0.1,
        "error": None,
    }
    doc.update(kw)
    run.mkdir(exist_ok=True)
    (run / f"rank{rank}.status.json").write_text(json.dumps(doc))


def test_torn_foreign_and_missing_heartbeats_give_a_partial_answer(tmp_path, capsys):
    run = tmp_path / "run"
    _beat(run, 0)
    _beat(run, 1, run_id="older-run", updated_unix=time.time() - 3600)  # left by an earlier run
    (run / "rank2.status.json").write_text('{"kind": "stepscope-heart')
    rc, doc = _status(run, capsys=capsys)
    assert rc == 0
    assert rc == 0
    assert [r["rank"] for r in doc["ranks"]] == [0]
    assert doc["missing_ranks"] == [1, 2, 3]
    notes = " ".join(doc["notes"])
    assert "torn" in notes and "older-run" in notes and "rank(s) 1, 2, 3" in notes


def test_stale_heartbeat_on_another_host_is_dead_and_blocks_the_others(tmp_path, capsys):
    run = tmp_path / "run"
    now = time.time()
    for r in (0, 1, 3):
        _beat(run, r, step_since_unix=now - 60, in_phase_s=60.0)
    _beat(run, 2, updated_unix=now - 45, phase_stack=["forward"], step_since_unix=now - 105)
    rc, doc = _status(run, capsys=capsys)
    assert rc == 0
    by_rank = {r["rank"]: r for r in doc["ranks"]}
    assert by_rank[2]["state"] == "dead" and "heartbeat stopped" in by_rank[2]["reason"]
    assert {by_rank[r]["state"] for r in (0, 1, 3)} == {"waiting"}
    assert doc["culprit"]["rank"] == 2 and doc["culprit"]["phase"] == "forward"


def test_rank_behind_at_an_older_step_is_the_culprit(tmp_path, capsys):
    run = tmp_path / "run"
    now = time.time()
    for r in (0, 2, 3):
        _beat(run, r, step=11, phase_stack=["backward", "grad_sync"], step_since_unix=now - 30)
    _beat(run, 1, step=10, phase_stack=["data"], step_since_unix=now - 31, in_phase_s=29.0)
    rc, doc = _status(run, capsys=capsys)
    assert rc == 0
    assert doc["culprit"]["rank"] == 1 and doc["culprit"]["step"] == 10
    assert "behind" in doc["culprit"]["why"]


def test_healthy_run_has_no_culprit_and_nothing_readable_exits_2(tmp_path, capsys):
    run = tmp_path / "run"
    for r in range(4):
        _beat(run, r)
    rc, doc = _status(run, capsys=capsys)
    assert rc == 0
    assert rc == 0 and doc["culprit"] is None
    assert {r["state"] for r in doc["ranks"]} == {"running"}
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "rank0.status.json").write_text("")
    assert main(["status", str(empty)]) == 2
    assert "no readable heartbeat" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "nope")]) == 2


def test_collective_names():
    assert is_collective("grad_sync") and is_collective("backward/grad_sync")
    assert is_collective("all_reduce") and is_collective("sync") and is_collective("wait_peers")
    assert not is_collective("forward") and not is_collective("stuck") and not is_collective(None)


def test_analyze_status_reads_the_stack_dump_of_the_culprit(tmp_path):
    run = tmp_path / "run"
    now = time.time()
    for r in (0, 1):
        _beat(run, r, step_since_unix=now - 60, world_size=3)
    _beat(run, 2, world_size=3, phase_stack=["forward"], step_since_unix=now - 60,
          stacks={"path": "rank2.stacks.txt", "step": 10})
    (run / "rank2.stacks.txt").write_text(
        "# main thread: 0x00000000000000aa\n"
        "Thread 0x00000000000000bb (most recent call first):\n  File \"other.py\", line 1 in x\n\n"
        "Thread 0x00000000000000aa (most recent call first):\n"
        "  File \"train.py\", line 42 in forward\n  File \"train.py\", line 99 in <module>\n"
    )
    doc = analyze_status(run)
    assert doc["culprit"]["rank"] == 2
    assert doc["culprit"]["stack_top"] == [
        'File "train.py", line 42 in forward', 'File "train.py", line 99 in <module>'
    ]


def test_heartbeat_config_validation_and_env(tmp_path):
    from stepscope.common.errors import ConfigError
    from stepscope.recording.config import Config, env_overrides

    assert Config(heartbeat_s=0).heartbeat_s == 0
    for bad in (-1, float("nan"), "5", True, float("inf")):
        with pytest.raises(ConfigError):
            Config(heartbeat_s=bad)
    with pytest.raises(ConfigError):
        Config(dump_stacks_after_s=0)
    env = env_overrides({"STEPSCOPE_HEARTBEAT_S": "0.5", "STEPSCOPE_DUMP_STACKS_AFTER_S": "30"})
    assert env == {"heartbeat_s": 0.5, "dump_stacks_after_s": 30.0}
    with pytest.raises(ConfigError):
        env_overrides({"STEPSCOPE_HEARTBEAT_S": "soon"})


def test_heartbeat_off_writes_no_file_and_on_writes_running_then_finished(tmp_path):
    import stepscope

    off = tmp_path / "off"
    stepscope.init(out_dir=str(off), auto=False, heartbeat_s=0)
    with stepscope.step(), stepscope.phase("work"):
        pass
    stepscope.finish()
    assert not list(off.glob("*.status.json"))

    on = tmp_path / "on"
    tr = stepscope.init(out_dir=str(on), auto=False, heartbeat_s=0.2)
    with stepscope.step(), stepscope.phase("outer"), stepscope.phase("inner"):
        st = tr.state()
        assert st["phase_stack"] == ["outer", "inner"] and st["in_step"] and st["step"] == 0
        time.sleep(0.5)
        deadline = time.monotonic() + 30
        hb = json.loads((on / "rank0.status.json").read_text())
        while hb["in_phase_s"] < 0.15 and time.monotonic() < deadline:  # a beat 0.15 s in
            time.sleep(0.05)
            hb = json.loads((on / "rank0.status.json").read_text())
        assert hb["state"] == "running" and hb["phase_stack"] == ["outer", "inner"]
        assert hb["in_phase_s"] >= 0.15 and hb["step"] == 0
    stepscope.finish()
    hb = json.loads((on / "rank0.status.json").read_text())
    assert hb["state"] == "finished" and hb["last_step"] == 0 and hb["last_step_s"] >= 0.4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler removed at finish


def test_forked_child_killed_by_sigterm_does_not_touch_the_rank_file(tmp_path):
    import stepscope

    run = tmp_path / "run"
    stepscope.init(out_dir=str(run), auto=False, heartbeat_s=30.0)
    try:
        with stepscope.step(), stepscope.phase("work"):
            pass
        before = json.loads((run / "rank0.status.json").read_text())
        pid = os.fork()
        if pid == 0:  # child: inherits the Python SIGTERM handler, as a DataLoader worker does
            try:
                time.sleep(30)
            finally:
                os._exit(3)
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        after = json.loads((run / "rank0.status.json").read_text())
        assert after["state"] == "running" and after["pid"] == before["pid"] == os.getpid()
    finally:
        stepscope.finish()
