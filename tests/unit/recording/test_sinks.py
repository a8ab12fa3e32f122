"""Files on disk: JSONL and SQLite round trips, torn files, and failures that must not kill the job."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import stepscope
from stepscope.recording.schema import ReadReport, iter_jsonl, read_run, read_sqlite
from stepscope.recording.sinks import JsonlSink


def _train(steps: int, model=None, opt=None) -> None:
    for _ in range(steps):
        with stepscope.step():
            if model is not None:
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
            with stepscope.phase("metrics"):
                pass


@pytest.mark.parametrize("sink", ["jsonl", "sqlite"])
def test_round_trip_through_files(tmp_path, sink):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepscope.init(out_dir=str(tmp_path), model=model, optimizer=opt, sink=sink, flush_every_n_steps=3)
    _train(7, model, opt)
    stepscope.finish()
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["config"]["sink"] == sink and meta["torch"] == torch.__version__
    recs = read_run(tmp_path)
    assert [r["step"] for r in recs] == list(range(7))
    assert {p["name"] for p in recs[0]["phases"]} == {"forward", "backward", "optimizer", "metrics"}
    assert all(r["run_id"] == meta["run_id"] and r["world_size"] == 1 for r in recs)
    if sink == "sqlite":
        import sqlite3

        con = sqlite3.connect(tmp_path / "rank0.sqlite")
        n = con.execute("SELECT count(*) FROM step_time_samples").fetchone()[0]
        con.close()
        assert n == 7 and read_sqlite(tmp_path / "rank0.sqlite") == recs


def test_reader_tolerates_a_torn_last_line_and_counts_corrupt_lines(tmp_path):
    sink = JsonlSink(tmp_path, 0)
    good = {"schema": 1, "rank": 0, "step": 0, "start_unix_ns": 1, "clock": "cpu", "step_ms": 1.0,
            "phases": []}
    sink.write([good, {**good, "step": 1}])
    sink.close()
    with open(tmp_path / "rank0.jsonl", "a") as fh:
        fh.write("not json\n")
        fh.write(json.dumps({**good, "step": 2}) + "\n")
        fh.write('{"schema": 1, "rank": 0, "st')
    rep = ReadReport(tmp_path / "rank0.jsonl")
    steps = [r["step"] for r in iter_jsonl(tmp_path / "rank0.jsonl", rep)]
    assert steps == [0, 1, 2]
    assert rep.bad_lines == [3] and rep.truncated_tail and rep.records == 3


def test_appends_never_rewrite(tmp_path):
    for _ in range(2):
        stepscope.init(out_dir=str(tmp_path))
        _train(2)
        stepscope.finish()
    assert [r["step"] for r in read_run(tmp_path)] == [0, 1, 0, 1]


def test_unwritable_directory_disables_with_one_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(stepscope.StepscopeWarning, match="could not start"):
        tr = stepscope.init(out_dir=str(blocker / "sub"))
    assert isinstance(tr, stepscope.NullTracer)
    _train(3)  # the job goes on
    stepscope.finish()


class BrokenSink:
    def __init__(self):
        self.calls = 0

    def write(self, records):
        self.calls += 1
        raise OSError(28, "No space left on device")

    def close(self):
        pass


def test_full_disk_warns_once_and_training_goes_on():
    from stepscope.recording.config import Config
    from stepscope.tracer import Tracer

    sink = BrokenSink()
    tr = Tracer(Config(out_dir="x", flush_every_n_steps=1), sink=sink)
    with pytest.warns(stepscope.StepscopeWarning, match="No space left on device") as warned:
        for _ in range(20):
            with tr.step(), tr.phase("work"):
                pass
            time.sleep(0.005)
        tr.finish()
    assert len([w for w in warned if issubclass(w.category, stepscope.StepscopeWarning)]) == 1
    assert sink.calls == 1 and not tr.enabled


def test_error_inside_instrumentation_disables_timing_not_the_job(mem_tracer):
    tr = mem_tracer(auto=False)

    class ExplodingClock:
        kind = "cpu"
        device = "cpu"

        def mark(self):
            raise RuntimeError("clock broke")

    tr.clock = ExplodingClock()
    with pytest.warns(stepscope.StepscopeWarning, match="clock broke"):
        for _ in range(3):
            with tr.step(), tr.phase("x"):
                pass
    assert not tr.enabled


def test_bad_model_argument_raises(tmp_path):
    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        stepscope.init(out_dir=str(tmp_path), model="resnet")
    assert not os.listdir(tmp_path)
