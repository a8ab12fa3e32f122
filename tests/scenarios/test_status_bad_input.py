"""``stepscope status`` against hostile run directories.

Item 1: it reads only regular files inside the run, bounded in size, and says what it
skipped (symlinks out of the run, ``stacks.path`` anywhere, ``/dev/zero``, FIFOs).
Item 12: bad heartbeat content gives a partial answer or exit 2, never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paths  # tests/support: where the repository is
import pytest

from stepscope.cli import main

SRC = str(paths.SRC)
SECRET = "TOP-SECRET-0xC0FFEE"


def _beat(who: int, **over: Any) -> dict[str, Any]:
    """A fresh heartbeat from another host (no pid check): stalled for 100 s at step 7 + rank."""
    now = time.time()
    beat: dict[str, Any] = {
        "kind": "stepscope-heartbeat", "schema": 1, "run_id": "r1", "rank": who, "world_size": 2,
        "host": "elsewhere", "pid": 4242, "interval_s": 1.0, "updated_unix": now, "state": "running",
        "step": 7 + (who == 0), "in_step": True, "phase_stack": ["compute"], "step_since_unix": now - 100,
        "in_phase_s": 100.0, "last_step": 6, "last_step_s": 0.1, "collective": None, "error": None,
        "stacks": None,
    }
    beat.update(over)
    return beat


def _run(tmp_path: Path, rank1: Any = None, **over: Any) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "rank0.status.json").write_text(json.dumps(_beat(0)))
    if rank1 is not None:
        path = run / "rank1.status.json"
        if isinstance(rank1, bytes):
            path.write_bytes(rank1)
        else:
            path.write_text(rank1 if isinstance(rank1, str) else json.dumps(rank1))
    else:
        (run / "rank1.status.json").write_text(json.dumps(_beat(1, **over)))
    return run


def _strict(text: str) -> dict[str, Any]:
    def no_constants(name: str) -> None:
        raise AssertionError(f"non-strict JSON constant {name}")

    doc: dict[str, Any] = json.loads(text, parse_constant=no_constants)
    return doc


def _status(run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    """``status --json`` and the terminal view; both must return, never raise."""
    capsys.readouterr()
    rc = main(["status", str(run), "--json"])
    cap = capsys.readouterr()
    doc = _strict(cap.out) if rc == 0 else {}
    assert rc in (0, 2)
    assert "Traceback" not in cap.err
    rc2 = main(["status", str(run)])
    cap2 = capsys.readouterr()
    assert rc2 == rc and "Traceback" not in cap2.err
    return rc, doc, cap.err + cap2.out + cap2.err


# ----------------------------------------------------------------------------- item 12

NOW = time.time()
BAD: list[tuple[str, Callable[[], Any]]] = [
    ("non-utf8", lambda: b"\xff\xfe{\"kind\": \"stepscope-heartbeat\"}"),
    ("pid-string", lambda: _beat(1, pid="4242")),
    ("pid-2^70", lambda: _beat(1, pid=2**70, host=None)),
    ("pid-2^70-same-host", lambda: _beat(1, pid=2**70, host=os.uname().nodename)),
    ("pid-negative", lambda: _beat(1, pid=-5, host=os.uname().nodename)),
    ("numbers-as-strings", lambda: _beat(1, updated_unix=str(NOW), in_phase_s="5", interval_s="1",
                                         step="7", last_step_s="0.1", step_since_unix="12")),
    ("optional-numbers-as-strings", lambda: _beat(1, in_phase_s="5", interval_s="x", step="7",
                                                  last_step_s="0.1", step_since_unix="12")),
    ("wrong-types", lambda: _beat(1, phase_stack={"a": 1}, step=[7], collective=["x"], error="boom",
                                  stacks="rank1.stacks.txt", host=5, world_size="2", last_step={})),
    ("phase-stack-of-ints", lambda: _beat(1, phase_stack=[1, None, {"x": 2}])),
    ("crashed-with-bad-error", lambda: _beat(1, state="crashed", error={"type": 5, "message": ["m"],
                                                                      "step": "7", "phase_stack": "a"})),
    ("world-size-10^12", lambda: _beat(1, world_size=10**12)),
    ("world-size-max-ranks", lambda: _beat(1, world_size=1_000_000)),
    ("future-clock", lambda: _beat(1, updated_unix=NOW + 1e6, step_since_unix=NOW + 1e6)),
    ("clock-2^70", lambda: _beat(1, updated_unix=2**70, step_since_unix=2**70)),
    ("nan-and-inf", lambda: '{"kind": "stepscope-heartbeat", "run_id": "r1", "rank": 1, "pid": 1, '
                            '"step": 7, "state": "running", "updated_unix": NaN, "interval_s": Infinity}'),
    ("nan-optional", lambda: json.dumps(_beat(1)).replace('"interval_s": 1.0', '"interval_s": NaN')
     .replace('"in_phase_s": 100.0', '"in_phase_s": -Infinity')),
    ("huge-floats", lambda: _beat(1, interval_s=1e308, last_step_s=1e308, in_phase_s=1e308)),
    ("int-of-5000-digits", lambda: json.dumps(_beat(1)).replace('"pid": 4242', '"pid": ' + "9" * 5000)),
    ("deep-nesting", lambda: '{"kind": "stepscope-heartbeat", "x": ' + "[" * 200_000 + "]" * 200_000 + "}"),
    ("rank-bool", lambda: _beat(1, rank=True)),
    ("rank-float", lambda: _beat(1, rank=1.0)),
    ("rank-mismatch-huge", lambda: _beat(1, rank=10**30)),
    ("state-unknown", lambda: _beat(1, state="exploded")),
    ("state-list", lambda: _beat(1, state=["running"])),
    ("run-id-dict", lambda: _beat(1, run_id={"a": 1})),
    ("top-level-list", lambda: [_beat(1)]),
    ("top-level-null", lambda: "null"),
    ("empty-file", lambda: ""),
    ("torn", lambda: json.dumps(_beat(1))[:40]),
    ("long-strings", lambda: _beat(1, phase_stack=["p" * 50_000] * 6 + ["q"] * 100, host="h" * 100_000,
                                   run_id="r1", collective={"op": "o" * 100_000})),
    ("stacks-path-not-string", lambda: _beat(1, stacks={"path": 5})),
]


@pytest.mark.parametrize("name,make", BAD, ids=[b[0] for b in BAD])
def test_bad_heartbeat_content_never_crashes_status(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    name: str, make: Callable[[], Any]) -> None:
    run = _run(tmp_path, make())
    rc, doc, text = _status(run, capsys)
    assert rc == 0, text  # rank 0 is fine: a partial answer, not exit 2
    ranks = {v["rank"] for v in doc["ranks"]}
    assert 0 in ranks
    assert len(json.dumps(doc)) < 2_000_000  # bounded output (long strings are cut)
    if 1 not in ranks:
        assert any("rank1.status.json" in n for n in doc["notes"]), doc["notes"]
    for v in doc["ranks"]:
        assert v["updated_s_ago"] >= 0 and v["in_phase_s"] >= 0 and v["step_age_s"] >= 0
    assert len(doc["missing_ranks"]) <= 1000


def test_only_bad_heartbeats_exit_2_with_a_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.status.json").write_bytes(b"\xff\xfe")
    (run / "rank1.status.json").write_text(json.dumps(_beat(1, pid="x", updated_unix="soon")))
    capsys.readouterr()
    assert main(["status", str(run), "--json"]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and "rank1.status.json" in err and "Traceback" not in err


def test_huge_rank_in_a_file_name_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    (run / f"rank{10**30}.status.json").write_text(json.dumps(_beat(1, rank=10**30)))
    (run / "rank9999999.status.json").write_text(json.dumps(_beat(1, rank=9999999)))
    (run / "rank\u0663.status.json").write_text(json.dumps(_beat(3, rank=3)))  # an Arabic-Indic 3
    rc, doc, _ = _status(run, capsys)
    assert rc == 0
    assert {v["rank"] for v in doc["ranks"]} == {0, 1}
    assert doc["run"]["world_size"] == 2
    assert sum("rank out of range" in n for n in doc["notes"]) == 2


def test_world_size_of_a_million_is_listed_not_materialised(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path, world_size=1_000_000)
    rc, doc, _ = _status(run, capsys)
    assert rc == 0
    assert doc["missing_count"] == 999_998 and len(doc["missing_ranks"]) == 1000
    assert doc["missing_ranks"][:3] == [2, 3, 4]


def test_heartbeat_of_1_5_gb_is_not_loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    big = run / "rank1.status.json"
    with open(big, "wb") as fh:  # sparse: 1.5 GB long, no disk used
        fh.write(json.dumps(_beat(1)).encode())
        fh.truncate(1_500_000_000)
    rc, doc, _ = _status(run, capsys)
    assert rc == 0 and {v["rank"] for v in doc["ranks"]} == {0}
    assert any("rank1.status.json" in n and "larger than" in n for n in doc["notes"])


def test_future_clock_gives_no_negative_ages_and_a_note(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path, updated_unix=time.time() + 3600, step_since_unix=time.time() + 3600)
    rc, doc, _ = _status(run, capsys)
    assert rc == 0
    r1 = next(v for v in doc["ranks"] if v["rank"] == 1)
    assert r1["updated_s_ago"] == 0 and r1["step_age_s"] == 0
    assert any("ahead" in n for n in doc["notes"])


# ----------------------------------------------------------------------------- item 1


def _secret_beat(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.json"
    secret.write_text(json.dumps(_beat(1, phase_stack=[SECRET], host=SECRET)))
    return secret


def test_symlinked_heartbeat_outside_the_run_is_not_read(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    secret = _secret_beat(tmp_path)
    run = _run(tmp_path)
    (run / "rank1.status.json").unlink()
    (run / "rank1.status.json").symlink_to(secret)
    rc, doc, text = _status(run, capsys)
    assert rc == 0
    assert SECRET not in json.dumps(doc) and SECRET not in text
    assert any("rank1.status.json" in n and "outside the run" in n for n in doc["notes"])


def test_symlink_inside_the_run_is_still_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    (run / "keep").mkdir()
    os.replace(run / "rank1.status.json", run / "keep" / "b.json")
    (run / "rank1.status.json").symlink_to(run / "keep" / "b.json")
    rc, doc, _ = _status(run, capsys)
    assert rc == 0 and {v["rank"] for v in doc["ranks"]} == {0, 1}


@pytest.mark.parametrize("how", ["absolute", "relative", "symlink"])
def test_stack_dump_outside_the_run_is_not_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   how: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dump = outside / "stacks.txt"
    dump.write_text("# main thread: 0x0000000000000001\nThread 0x0000000000000001 (most recent call first):\n"
                    f'  File "/{SECRET}.py", line 1 in f\n')
    run = _run(tmp_path)
    path = {"absolute": str(dump), "relative": "../outside/stacks.txt", "symlink": "rank1.stacks.txt"}[how]
    if how == "symlink":
        (run / "rank1.stacks.txt").symlink_to(dump)
    (run / "rank1.status.json").write_text(json.dumps(_beat(1, stacks={"path": path})))
    rc, doc, text = _status(run, capsys)
    assert rc == 0
    assert doc["culprit"]["rank"] == 1  # the test reaches the stack-dump reading
    assert doc["culprit"]["stack_top"] == []
    assert SECRET not in json.dumps(doc) and SECRET not in text
    assert any("stack dump" in n and "outside the run" in n for n in doc["notes"])


def test_stack_dump_inside_the_run_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path, stacks={"path": "rank1.stacks.txt"})
    (run / "rank1.stacks.txt").write_text(
        "# main thread: 0x0000000000000001\nThread 0x0000000000000001 (most recent call first):\n"
        '  File "/job/train.py", line 9 in step\n')
    rc, doc, _ = _status(run, capsys)
    assert rc == 0 and doc["culprit"]["stack_top"] == ['File "/job/train.py", line 9 in step']


def test_heartbeat_linked_to_dev_zero_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    (run / "rank1.status.json").unlink()
    (run / "rank1.status.json").symlink_to("/dev/zero")
    rc, doc, _ = _status(run, capsys)
    assert rc == 0 and {v["rank"] for v in doc["ranks"]} == {0}
    assert any("rank1.status.json" in n and "not read" in n for n in doc["notes"])


STATUS_IN_CHILD = """
import json, sys
from stepscope.cli import main
sys.exit(main(["status", sys.argv[1], "--json"]))
"""


@pytest.mark.parametrize("fifo", ["rank1.status.json", "meta.json", "rank1.stacks.txt"])
def test_fifo_does_not_hang_status(tmp_path: Path, fifo: str) -> None:
    run = _run(tmp_path, stacks={"path": "rank1.stacks.txt"})
    if fifo == "rank1.status.json":
        (run / fifo).unlink()
    os.mkfifo(run / fifo)
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run([sys.executable, "-c", STATUS_IN_CHILD, str(run)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = _strict(proc.stdout)
    assert any(fifo in n and "not a regular file" in n for n in doc["notes"]), doc["notes"]


def test_dev_zero_in_a_child_with_bounded_memory(tmp_path: Path) -> None:
    """An unbounded read would need gigabytes; the child is limited to 1 GiB of address space."""
    run = _run(tmp_path, stacks={"path": "rank1.stacks.txt"})
    (run / "rank1.stacks.txt").symlink_to("/dev/zero")
    (run / "meta.json").symlink_to("/dev/zero")
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n" + STATUS_IN_CHILD)
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run([sys.executable, "-c", code, str(run)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = _strict(proc.stdout)
    assert doc["culprit"]["stack_top"] == []


@pytest.mark.parametrize("value", [True, 1.0, "1", 10**30, None])
def test_bad_rank_field_is_read_as_the_file_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 value: Any) -> None:
    run = _run(tmp_path, rank=value)
    rc, doc, _ = _status(run, capsys)
    assert rc == 0 and {v["rank"] for v in doc["ranks"]} == {0, 1}
    assert any("rank1.status.json" in n and "read as rank 1" in n for n in doc["notes"])
