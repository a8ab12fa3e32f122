"""Loss is always said: records a full disk kept off the rank file, and the steps run after it
turned timing off, are counted on the recording side, carried by the heartbeat file, and
shown with their count by ``stepscope report`` and ``stepscope status``."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

import stepscope
from stepscope.cli import main
from stepscope.recording.sinks import JsonlSink

STEPS = 200
FITS = 40  # records the disk takes before it is full


def _fill_disk_after(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The rank file's writes fail with ENOSPC once ``n`` records went in (a full disk)."""
    real = JsonlSink.write
    written = [0]

    def write(self: JsonlSink, records: Any) -> None:
        if written[0] + len(records) > n:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, records)
        written[0] += len(records)

    monkeypatch.setattr(JsonlSink, "write", write)


def _run(out: Path) -> None:
    with pytest.warns(stepscope.StepscopeWarning, match="No space left on device"):
        stepscope.init(out_dir=str(out), auto=False, heartbeat_s=0.05, flush_every_n_steps=5)
        for _ in range(STEPS):
            with stepscope.step(), stepscope.phase("forward"):
                pass
        stepscope.finish()


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    rc = main([*argv, "--json"])
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert rc == 0, doc
    return doc


def test_a_full_disk_is_counted_and_said_by_report_and_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _fill_disk_after(monkeypatch, FITS)
    _run(tmp_path)
    monkeypatch.undo()
    on_disk = len((tmp_path / "rank0.jsonl").read_text().splitlines())
    assert on_disk <= FITS
    lost = STEPS - on_disk

    rep = _json(capsys, "report", str(tmp_path))["run"]
    assert sum(rep["recording_lost"].values()) == lost, rep["recording_lost"]
    assert rep["partial"] and any(f"{lost} steps lost while recording" in s for s in rep["skipped"])
    assert main(["report", str(tmp_path)]) == 0
    assert f"{lost} steps lost while recording" in capsys.readouterr().out

    st = _json(capsys, "status", str(tmp_path))
    assert sum(st["lost"].values()) == lost, st["lost"]
    assert st["ranks"][0]["lost"] == st["lost"]
    assert any(f"{lost} steps lost while recording" in n for n in st["notes"])
    assert main(["status", str(tmp_path)]) == 0
    assert f"{lost} steps lost while recording" in capsys.readouterr().out
