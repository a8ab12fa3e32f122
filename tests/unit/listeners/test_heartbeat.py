"""The heartbeat listener on a tracer that writes files: what it costs a step, and a caught
exception that is not a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from frames import calls_of

from stepscope.recording.clock import CpuClock
from stepscope.recording.config import Config
from stepscope.tracer import Tracer


def _tracer(tmp_path: Path, **cfg: Any) -> Tracer:
    # A heartbeat interval longer than the test: the file changes only at crash and finish.
    return Tracer(Config(out_dir=str(tmp_path), heartbeat_s=600.0, **cfg), clock=CpuClock())


def test_an_unsampled_step_calls_no_heartbeat_code(tmp_path):
    tr = _tracer(tmp_path, every_n_steps=1000, auto=False)
    try:
        assert tr.writes_files

        def one() -> None:
            with tr.step():
                pass

        for _ in range(3):
            one()
        assert calls_of(one, package=True) == ["step", "_enter_step", "_exit_step"]
    finally:
        tr.finish()


def test_an_exception_the_loop_caught_is_not_a_crash_at_finish(tmp_path):
    tr = _tracer(tmp_path, every_n_steps=1000, auto=False)
    status = tmp_path / "rank0.status.json"
    with tr.step():
        pass
    with pytest.raises(ValueError), tr.step():
        raise ValueError("bad batch")
    assert json.loads(status.read_text())["state"] == "crashed"
    with tr.step():  # the loop caught it and went on (an unsampled step)
        pass
    tr.finish()
    doc = json.loads(status.read_text())
    assert doc["state"] == "finished" and doc["last_step"] == 2
    assert doc["last_error"]["message"] == "bad batch" and doc["last_error"]["step"] == 1
