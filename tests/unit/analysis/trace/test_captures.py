"""``stepscope trace`` on a real two-rank gloo capture: where it finds the traces of a run,
how it counts collectives and how it shows them across ranks.

The fixture ``fixtures/gloo_allreduce_cpu`` was captured by ``stepscope.Profiler`` around
three ``dist.all_reduce`` calls on two gloo ranks (CPU): each call shows as a front-end op
(``c10d::allreduce_``) and as the backend's work (``gloo:all_reduce``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import paths  # tests/support: where the repository is
import pytest

from stepscope.analysis.trace import find_traces
from stepscope.cli import main

CAPTURE = paths.FIXTURES / "gloo_allreduce_cpu"


def _capture_into(folder: Path, mtime: float | None = None) -> Path:
    folder.mkdir(parents=True)
    for f in CAPTURE.iterdir():
        shutil.copy(f, folder / f.name)
        if mtime is not None:
            os.utime(folder / f.name, (mtime, mtime))
    return folder


def test_trace_finds_the_capture_under_run_traces_auto(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _capture_into(run / "traces" / "auto" / "step000005")
    (run / "meta.json").write_text(json.dumps({"run_id": "x", "world_size": 2}))
    for where in (run, run / "traces", run / "traces" / "auto"):
        assert main(["trace", str(where), "--json"]) == 0, where
        doc = json.loads(capsys.readouterr().out)
        assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1]
        assert any("step000005" in w for w in doc["warnings"])


def test_each_collective_is_counted_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", str(CAPTURE), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cross_rank"]["collectives_matched"] == 3
    for r in doc["ranks"]:
        assert sum(c["count"] for c in r["cpu"]["collectives"]) == 3, r["cpu"]["collectives"]


def test_terminal_shows_collective_waits_as_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", str(CAPTURE)]) == 0
    out = capsys.readouterr().out
    assert "{'" not in out and "'0':" not in out
    header = next(line for line in out.splitlines() if "collective wait ms" in line)
    assert "rank" in header and "arrived last" in header
    assert "3 collectives matched across ranks" in out


def test_newest_capture_folder_is_analysed_and_the_others_named(tmp_path: Path) -> None:
    old = _capture_into(tmp_path / "traces" / "auto" / "step000005", mtime=1_000_000_000)
    new = _capture_into(tmp_path / "traces" / "auto" / "step000120", mtime=1_000_000_100)
    files, notes = find_traces(tmp_path)
    assert {f.parent for f in files} == {new}
    assert len(notes) == 1 and "auto/step000120" in notes[0] and "auto/step000005" in notes[0]
    # A folder holding traces itself is what the user asked for; the ones below are named.
    _capture_into(tmp_path / "traces" / "own")
    files, notes = find_traces(old)
    assert {f.parent for f in files} == {old} and notes == []


def test_a_folder_without_traces_anywhere_is_one_line_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.txt").write_text("x")
    assert main(["trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sub-folders" in err
