"""Hostile arguments and faults on the training side."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

import stepscope
from stepscope.common.errors import ConfigError, StepscopeWarning
from stepscope.listeners.profiler import Profiler
from stepscope.recording.config import Config
from stepscope.recording.sinks import JsonlSink, SqliteSink

# ----------------------------------------------------------------------------- item 12


@pytest.mark.parametrize("kwargs,named", [
    ({"profile_steps": 5}, "profile_steps"),
    ({"profile_steps": (True, 2)}, "profile_steps"),
    ({"profile_steps": "0:5"}, "profile_steps"),
    ({"profile_steps": (3, 1)}, "profile_steps"),
    ({"run_id": 123}, "run_id"),
    ({"run_id": ""}, "run_id"),
    ({"run_id": "x" * 1000}, "run_id"),
])
def test_bad_init_arguments_raise_value_error_naming_the_value(tmp_path: Path, kwargs: dict[str, Any],
                                                                named: str) -> None:
    with pytest.raises(ValueError, match=named) as info:
        stepscope.init(str(tmp_path / "run"), **kwargs)
    assert isinstance(info.value, ConfigError)
    value = next(iter(kwargs.values()))
    assert repr(value)[:40] in str(info.value)  # the offending value is shown
    with pytest.raises(ConfigError, match=named):
        Config(out_dir=str(tmp_path), **kwargs)


def test_good_profile_steps_and_run_id_still_accepted(tmp_path: Path) -> None:
    c = Config(out_dir=str(tmp_path), profile_steps=[2, 4], run_id="exp-1")
    assert c.profile_steps == (2, 4) and c.run_id == "exp-1"


# ----------------------------------------------------------------------------- item 13


def test_profiler_failure_warns_with_stepscope_warning(tmp_path: Path) -> None:
    prof = Profiler(tmp_path, start_step=0, end_step=2)

    class Broken:
        def step(self) -> None:
            raise RuntimeError("boom")

    prof._prof = Broken()  # a torch.profiler that fails at run time
    with pytest.warns(StepscopeWarning, match="profiling is off"):
        prof.step()
    assert prof.enabled is False


# ----------------------------------------------------------------------------- item 15


@pytest.mark.parametrize("sink_cls", [JsonlSink, SqliteSink])
def test_output_directory_deleted_mid_run_warns_once(tmp_path: Path, sink_cls: type) -> None:
    out = tmp_path / "run"
    sink = sink_cls(out, 0)
    rec = {"schema": 2, "rank": 0, "step": 0, "step_ms": 1.0, "phases": []}
    sink.write([rec])
    shutil.rmtree(out)
    with pytest.warns(StepscopeWarning, match="deleted") as got:
        sink.write([{**rec, "step": 1}])
        sink.write([{**rec, "step": 2}])
    assert len([w for w in got if issubclass(w.category, StepscopeWarning)]) == 1
    sink.close()
    # The records after the deletion are in the recreated file.
    if sink_cls is JsonlSink:
        steps = [json.loads(x)["step"] for x in (out / "rank0.jsonl").read_text().splitlines()]
        assert steps == [1, 2]
    else:
        import sqlite3

        con = sqlite3.connect(out / "rank0.sqlite")
        assert [r[0] for r in con.execute("SELECT step FROM step_time_samples ORDER BY step")] == [1, 2]
        con.close()


def test_intact_output_directory_does_not_warn(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "run", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            sink.write([{"step": i}])
    sink.close()
