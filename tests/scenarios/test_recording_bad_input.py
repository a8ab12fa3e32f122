"""Hostile input and faults on the recording side, round two."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import paths  # tests/support: where the repository is
import pytest
import torch

import stepscope
from stepscope.cli import main
from stepscope.common.errors import StepscopeWarning
from stepscope.recording.config import Config
from stepscope.recording.schema import read_run
from stepscope.recording.sinks import JsonlSink, SqliteSink
from stepscope.tracer import Tracer

SRC = str(paths.SRC)


def _steps(tracer: Any, n: int, **kw: Any) -> None:
    for _ in range(n):
        with tracer.step(**kw), tracer.phase("compute"):
            torch.ones(4).sum()


# ----------------------------------------------------------------------------- item 5


def test_flops_past_2_pow_64_keep_every_record(tmp_path: Path) -> None:
    flops = 6 * 405 * 10**9 * 16 * 2**20  # a 405B model at 16M tokens per step: ~4e19 > 2^64
    assert flops >= 2**64
    tr = stepscope.init(str(tmp_path / "run"), auto=False, flops_per_step=flops, peak_tflops=989.0,
                        flush_every_n_steps=5)
    _steps(tr, 20)
    stepscope.finish()
    recs = read_run(tmp_path / "run")
    assert len(recs) == 20
    assert all(r["flops"]["per_step"] == pytest.approx(float(flops)) for r in recs)


@pytest.mark.parametrize("bad", [2**70, 2**53 + 1, -1])
def test_step_counts_out_of_range_warn_and_recording_goes_on(tmp_path: Path, bad: int) -> None:
    tr = stepscope.init(str(tmp_path / "run"), auto=False, flush_every_n_steps=1)
    _steps(tr, 5, tokens=1024)
    with pytest.warns(StepscopeWarning, match="tokens"):
        _steps(tr, 1, tokens=bad)  # never an exception: a bad count must not stop training
    _steps(tr, 14, tokens=1024)
    stepscope.finish()
    assert len(read_run(tmp_path / "run")) == 20


@pytest.mark.parametrize("bad", [1e31, float("inf"), 10**400])
def test_absurd_flops_per_step_is_rejected_at_init(tmp_path: Path, bad: float) -> None:
    with pytest.raises(ValueError, match="flops_per_step"):
        Config(out_dir=str(tmp_path), flops_per_step=bad)


@pytest.mark.parametrize("sink_cls", [JsonlSink, SqliteSink])
def test_one_bad_field_does_not_stop_the_sink(tmp_path: Path, sink_cls: type) -> None:
    sink = sink_cls(tmp_path, 0)
    base = {"schema": 2, "rank": 0, "step": 0, "start_unix_ns": 1, "clock": "cpu", "step_ms": 1.0,
            "phases": []}
    sink.write([{**base, "step": 0}, {**base, "step": 1, "throughput": {"tokens": 2**70}, "x": {1: {2}}},
                {**base, "step": 2, "world_size": 2**80}])
    sink.write([{**base, "step": 3}])
    sink.close()
    recs = read_run(tmp_path)
    assert sorted(r["step"] for r in recs) == [0, 1, 2, 3] and sink.unwritable == 0
    if sink_cls is JsonlSink:
        # Every line is strict JSON (no NaN, no 2^70 integer some readers cannot hold).
        for line in (tmp_path / "rank0.jsonl").read_text().splitlines():
            json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
        assert recs[1]["throughput"]["tokens"] == pytest.approx(2.0**70)


# ----------------------------------------------------------------------------- item 6


class _SlowSink(JsonlSink):
    """A JSONL sink on a file system that takes 30 ms per write."""

    def write(self, records: Any) -> None:
        time.sleep(0.03)
        super().write(records)


def test_slow_file_system_loses_nothing_while_the_hold_lasts(tmp_path: Path) -> None:
    """A writer behind its queue: resolved steps wait with the resolver, none is dropped."""
    run = tmp_path / "run"
    cfg = Config(out_dir=str(run), auto=False, flush_every_n_steps=1, heartbeat_s=0)
    tr = Tracer(cfg, sink=_SlowSink(run, 0))
    tr._outbox.every_s = 0.0  # a hand-over at every step end: the writer's queue fills up
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _steps(tr, 400)
        tr.finish()
    assert not [w for w in got if "behind" in str(w.message)]
    recs = read_run(run)
    assert [r["step"] for r in recs] == list(range(400))
    assert tr._writer.lost["writer_queue_full"] == 0


def test_slow_file_system_drops_are_counted_warned_once_and_reported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the hold (small here), batches go to the full queue and are dropped: counted.
    monkeypatch.setattr("stepscope.recording.outbox.MAX_HELD_STEPS", 4)
    run = tmp_path / "run"
    cfg = Config(out_dir=str(run), auto=False, flush_every_n_steps=1, heartbeat_s=0)
    tr = Tracer(cfg, sink=_SlowSink(run, 0))
    tr._outbox.every_s = 0.0  # a hand-over at every step end: the writer's queue overruns
    n = 400
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _steps(tr, n)
        tr.finish()
    drop_warnings = [w for w in got
                     if issubclass(w.category, StepscopeWarning) and "behind" in str(w.message)]
    assert len(drop_warnings) == 1
    recs = read_run(run)
    counted = sum(int((r.get("dropped") or {}).get("writer_queue_full", 0)) for r in recs)
    assert counted > 0, "the test must overrun the writer queue"
    assert len(recs) + counted == n  # every step is either written or counted
    assert counted == tr._writer.lost["writer_queue_full"]
    capsys.readouterr()
    assert main(["report", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run"]["recording_lost"]["writer_queue_full"] == counted
    assert any("writer_queue_full" in s for s in doc["run"]["skipped"])
    assert main(["report", str(run)]) == 0
    assert "writer_queue_full" in capsys.readouterr().out


def test_clean_run_reports_no_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tr = stepscope.init(str(tmp_path / "run"), auto=False, flush_every_n_steps=4)
    _steps(tr, 12)
    stepscope.finish()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["recording_lost"] == {}


# ----------------------------------------------------------------------------- item 7


@pytest.mark.parametrize("sink", ["jsonl", "sqlite"])
def test_output_dir_deleted_later_steps_are_kept(tmp_path: Path, sink: str) -> None:
    run = tmp_path / "run"
    tr = stepscope.init(str(run), auto=False, sink=sink, flush_every_n_steps=9, heartbeat_s=60)
    _steps(tr, 9)
    # Steps 0-8 are on disk before the directory goes (the writer thread's pace is not ours).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(read_run(run)) < 9:
        time.sleep(0.02)
    assert len(read_run(run)) == 9
    shutil.rmtree(run)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _steps(tr, 21)  # must not raise
        stepscope.finish()  # the final heartbeat goes into the removed directory
    assert tr.enabled, [str(w.message) for w in got]
    assert not [w for w in got if "disabled" in str(w.message)]
    assert sorted(r["step"] for r in read_run(run)) == list(range(9, 30))
    assert json.loads((run / "rank0.status.json").read_text())["state"] == "finished"


def test_fifo_at_the_rank_file_does_not_block_init(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "rank0.jsonl")
    code = textwrap.dedent(f"""
        import warnings, torch, stepscope
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            tr = stepscope.init({str(run)!r}, auto=False)
        print([str(w.message) for w in got])
        for i in range(3):
            with stepscope.step():
                torch.ones(2).sum()
        stepscope.finish()
        print("done")
    """)
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "not a regular file" in proc.stdout and "done" in proc.stdout


def test_fifo_with_a_reader_is_still_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "rank0.jsonl")
    fd = os.open(tmp_path / "rank0.jsonl", os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError, match="not a regular file"):
            JsonlSink(tmp_path, 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("env,named", [
    ({"RANK": "-3", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"RANK": "-3", "WORLD_SIZE": "4"}, "RANK"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2000000"}, "WORLD_SIZE"),
    ({"RANK": "one", "WORLD_SIZE": "4"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "-2"}, "LOCAL_RANK"),
])
def test_bad_rank_env_is_a_value_error_at_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               env: dict[str, str], named: str) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=named) as info:
        stepscope.init(str(tmp_path / "run"), auto=False)
    assert env["RANK"] in str(info.value) or env.get("LOCAL_RANK", "x") in str(info.value)
    assert not (tmp_path / "run" / "rank-3.jsonl").exists()


def test_good_rank_env_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    tr = stepscope.init(str(tmp_path / "run"), auto=False)
    assert (tr.rank.rank, tr.rank.local_rank, tr.rank.world_size) == (3, 1, 4)
    stepscope.finish()


# ----------------------------------------------------------------------------- item 9


def _modes() -> list[Any]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def test_flop_counter_is_removed_when_the_counted_step_fails(tmp_path: Path) -> None:
    model = torch.nn.Linear(16, 16)
    calls = {"n": 0}

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("bad batch")  # the model's forward raises once, in the counted step
        return model(x)

    class RaisingListener:
        def on_exception(self, *args: Any) -> None:
            raise KeyError("listener broke")  # stepscope fails internally while the step unwinds

    tr = stepscope.init(str(tmp_path / "run"), auto=False, model_flops="auto", peak_tflops=100.0)
    tr.add_listener(RaisingListener())
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for _ in range(4):
            try:
                with stepscope.step():
                    forward(torch.randn(4, 16)).sum().backward()
            except RuntimeError:
                pass
            assert _modes() == []  # no FLOP counter left entered after the failing step
    stepscope.finish()
    assert _modes() == []


def test_flop_counter_removed_after_a_plain_forward_error(tmp_path: Path) -> None:
    model = torch.nn.Linear(16, 16)
    tr = stepscope.init(str(tmp_path / "run"), auto=False, model_flops="auto", peak_tflops=100.0,
                        flush_every_n_steps=1)
    for i in range(6):
        try:
            with tr.step():
                if i == 0:
                    raise RuntimeError("once")
                model(torch.randn(4, 16)).sum().backward()
        except RuntimeError:
            pass
        assert _modes() == []
    stepscope.finish()
    assert len(read_run(tmp_path / "run")) == 6
