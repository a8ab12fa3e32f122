"""Slow windows found whole in real gloo DDP runs: true bounds (± 2 steps), true excess (± 10%).

Each rank's own-work gap series goes through change-point detection
(:mod:`stepscope.analysis.changepoint`), so a noisy stretch inside the window neither splits
nor shortens it, and the excess is the window's level, not the mean of its highest steps.
"""

from __future__ import annotations

from typing import Any

import pytest

from stepscope.analysis.run import analyze_run

demo = pytest.importorskip("stepscope.demo")
pytestmark = pytest.mark.slow

STEPS = 90
FIRST, END = 30, 60  # the window: steps [30, 60)
MS = 30.0


def _window_doc(tmp_path: Any, ranks: int, phase: str, rank: int) -> dict[str, Any]:
    spec = demo.SlowSpec(rank, phase, start_step=FIRST, end_step=END, ms=MS)
    return analyze_run(demo.launch(tmp_path / f"{phase}{ranks}", ranks=ranks, steps=STEPS,
                                   slow=(spec,), seed=3))


def _check_whole(doc: dict[str, Any], rank: int, phase: str) -> None:
    hits = [s for s in doc["stragglers"] if (s["rank"], s["phase"]) == (rank, phase)]
    assert len(hits) == 1, doc["stragglers"]  # one window, not split in two
    s = hits[0]
    assert s["persistence"] == "window"
    assert abs(s["first_step"] - FIRST) <= 2 and abs(s["last_step"] - (END - 1)) <= 2, s
    # sleep() overshoots by a fraction of a millisecond on a busy host, never by 3 ms.
    assert 0.9 * MS <= s["excess_ms"] <= 1.1 * MS, s
    top = doc["verdicts"][0]
    assert top["kind"] == "straggler" and f"rank {rank}" in top["evidence"]
    c = top["cost"]
    assert abs(c["steps"] - (END - FIRST)) <= 2 and c["ms_per_step"] == s["excess_ms"]
    # Every rank waits for it: the GPU-hours it cost are its excess times the world size.
    assert c["gpu_ms"] == pytest.approx(c["lost_ms"] * doc["run"]["world_size"], rel=1e-3)
    assert doc["run"]["headline"].startswith("The run lost") and f"rank {rank}" in doc["run"]["headline"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_ddp_backward_window_found_whole(tmp_path: Any, ranks: int) -> None:
    _check_whole(_window_doc(tmp_path, ranks, "backward", 1), 1, "backward")


@pytest.mark.soak
@pytest.mark.parametrize("phase", ["forward", "optimizer", "dataloader"])
def test_window_found_whole_in_every_phase(tmp_path: Any, phase: str) -> None:
    _check_whole(_window_doc(tmp_path, 2, phase, 0), 0, phase)
