"""Tests of the torch.profiler capture on CPU: window, file naming, ranks, no-op, bad config."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from stepscope.analysis.trace import analyze_trace
from stepscope.common.errors import ConfigError
from stepscope.listeners.profiler import Profiler, current_rank


def _train(prof: Profiler, steps: int) -> None:
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        prof.step()


def _steps_in(path: Path) -> list[int]:
    with gzip.open(path, "rt") as f:
        doc: dict[str, Any] = json.load(f)
    return sorted({int(m.group(1)) for e in doc["traceEvents"]
                   if (m := re.match(r"ProfilerStep#(\d+)", str(e.get("name", ""))))})


def test_captures_the_window_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with Profiler(tmp_path, start_step=2, end_step=4) as prof:
        _train(prof, 6)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rank0.pt.trace.json.gz"]
    assert _steps_in(tmp_path / files[0]) == [2, 3]
    # The analyser reads its own capture: CPU-only, so no GPU breakdown but no error either.
    r = analyze_trace(tmp_path).ranks[0]
    assert r.rank == 0 and r.total is None


def test_rank_from_env_and_ranks_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    assert current_rank() == 3
    skipped = Profiler(tmp_path / "a", 0, 1, ranks=[0, 1])
    assert not skipped.enabled
    with skipped:
        _train(skipped, 3)
    assert not (tmp_path / "a").exists()
    kept = Profiler(tmp_path / "b", 0, 1, ranks=[3], compress=False)
    kept.start()
    _train(kept, 2)
    kept.stop()
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["rank3.pt.trace.json"]


def test_stop_mid_window_still_writes(tmp_path: Path) -> None:
    prof = Profiler(tmp_path, start_step=1, end_step=10, warmup=5)
    assert prof.warmup == 1  # only one step exists before start_step
    prof.start()
    _train(prof, 3)
    prof.stop()
    steps = _steps_in(next(tmp_path.iterdir()))
    # Steps 1 and 2 were recorded; torch opens a (near-empty) marker for the step in progress.
    assert steps[:2] == [1, 2] and 0 not in steps


@pytest.mark.parametrize(
    "kwargs",
    [
        {"start_step": 5, "end_step": 5},
        {"start_step": -1, "end_step": 2},
        {"start_step": 0, "end_step": 2, "warmup": -1},
        {"start_step": 1.5, "end_step": 2},
        {"start_step": 0, "end_step": 2, "ranks": ["x"]},
        {"start_step": 0, "end_step": 2, "ranks": [-1]},
    ],
)
def test_bad_config_raises_config_error(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as ei:
        Profiler(tmp_path, **kwargs)
    assert isinstance(ei.value, ValueError)


def test_bad_out_dir() -> None:
    with pytest.raises(ConfigError):
        Profiler("", 0, 1)


def test_step_timer_drives_the_profiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    from stepscope.lifecycle import create
    from stepscope.recording.config import Config

    tracer = create(Config(out_dir=str(tmp_path), profile_steps=(1, 3), auto=False))
    model = torch.nn.Linear(8, 2)
    for _ in range(5):
        with tracer.step():
            model(torch.randn(4, 8)).sum().backward()
    tracer.finish()
    trace = tmp_path / "traces" / "rank0.pt.trace.json.gz"
    assert trace.exists()
    assert _steps_in(trace) == [1, 2]


def test_unobserved_hides_calls_from_a_running_profiler_and_restores_recording():
    from torch.profiler import ProfilerActivity, profile

    from stepscope.listeners.profiler import unobserved

    a = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with unobserved():
            torch.cumsum(a, 0)  # stepscope's own call: not in the user's trace
        torch.cumprod(a, 0)  # after the block the profiler sees ops again
    names = {e.name for e in prof.events()}
    assert "aten::cumprod" in names
    assert "aten::cumsum" not in names
