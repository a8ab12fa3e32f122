"""input_bound judges the steady cost of the input pipeline, not a one-off first batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from synth_runs import Slow, SynthRun, write_run

from stepscope.analysis.run import analyze_run

# A small model's step (~5 ms here) whose batches take 0.25 ms: input is ~5% of the step.
BASE = {"dataloader": 0.25, "h2d": 0.05, "forward": 0.8, "backward": 1.2, "optimizer": 0.3}


def _kinds(tmp_path: Path, slow: tuple[Slow, ...]) -> dict[str, dict[str, Any]]:
    spec = SynthRun(ranks=2, steps=80, base_ms=dict(BASE), noise_ms=0.02, residual_ms=0.3,
                    slow=slow)
    doc = analyze_run(write_run(tmp_path, spec))
    return {v["kind"]: v for v in doc["verdicts"]}


def test_a_slow_first_batch_is_not_input_bound(tmp_path: Path) -> None:
    # The first batch builds the iterator (and starts workers): 60 ms once, on every rank.
    # Over 80 ~5 ms steps that alone makes the dataloader 18% of the run (a CRITICAL before).
    first = tuple(Slow(r, "dataloader", 60.0, 0, 0) for r in range(2))
    kinds = _kinds(tmp_path, first)
    assert "input_bound" not in kinds or kinds["input_bound"]["severity"] == "info", kinds


def test_stalls_that_recur_are_still_input_bound(tmp_path: Path) -> None:
    # A pipeline that cannot keep up stalls again and again: every 10th batch takes 25 ms.
    stalls = tuple(Slow(r, "dataloader", 25.0, s, s) for r in range(2) for s in range(5, 80, 10))
    kinds = _kinds(tmp_path, stalls)
    assert kinds["input_bound"]["severity"] in ("warning", "critical"), kinds
    assert "num_workers" in kinds["input_bound"]["suggestion"]
