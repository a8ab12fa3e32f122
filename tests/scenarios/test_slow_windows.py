"""Slow windows found whole in real gloo DDP runs: true bounds (± 3 steps; the end up to 5
late), true excess (± 10%).

Each rank's own-work gap series goes through change-point detection
(:mod:`stepscope.analysis.changepoint`), so a noisy stretch inside the window neither splits
nor shortens it, and the excess is the window's level, not the mean of its highest steps.
"""

from __future__ import annotations

from typing import Any

import pytest
from probes import sleep_probe

from stepscope.analysis.run import analyze_run

demo = pytest.importorskip("stepscope.demo")
pytestmark = pytest.mark.slow

STEPS = 90
FIRST, END = 30, 60  # the window: steps [30, 60)
MS = 30.0




def _window_doc(tmp_path: Any, ranks: int, phase: str, rank: int) -> tuple[dict[str, Any], float]:
    spec = demo.SlowSpec(rank, phase, start_step=FIRST, end_step=END, ms=MS)
    taken: list[float] = []
    with sleep_probe(taken, MS):
        run = demo.launch(tmp_path / f"{phase}{ranks}", ranks=ranks, steps=STEPS, slow=(spec,),
                          seed=3)
    taken.sort()
    return analyze_run(run), taken[len(taken) // 2] if taken else MS


def _check_whole(doc: dict[str, Any], rank: int, phase: str, true_ms: float = MS) -> None:
    hits = [s for s in doc["stragglers"] if (s["rank"], s["phase"]) == (rank, phase)]
    assert len(hits) == 1, doc["stragglers"]  # one window, not split in two
    s = hits[0]
    assert s["persistence"] == "window"
    # ± 3 at the start, the end up to 5 late: the other ranks' own work can run short just after.
    assert abs(s["first_step"] - FIRST) <= 3 and -3 <= s["last_step"] - (END - 1) <= 5, s
    # true_ms: what the injected sleep took on this machine during the run (MS when idle).
    # At least 90% of what was asked for, at most 110% of what a sleep took meanwhile.
    assert 0.9 * MS <= s["excess_ms"] <= 1.1 * max(MS, true_ms), (s, true_ms)
    top = doc["verdicts"][0]
    assert top["kind"] == "straggler" and f"rank {rank}" in top["evidence"]
    c = top["cost"]
    # The cost counts the finding's own steps (its ends are allowed some slack above; beside
    # other suites, 4 ranks on 2 cores once priced 33 steps for the 30 slowed).
    assert c["steps"] <= s["last_step"] - s["first_step"] + 1 and c["ms_per_step"] == s["excess_ms"]
    assert -3 <= c["steps"] - (END - FIRST) <= 5
    # Every rank waits for it: the GPU-hours it cost are its excess times the world size.
    assert c["gpu_ms"] == pytest.approx(c["lost_ms"] * doc["run"]["world_size"], rel=1e-3)
    assert doc["run"]["headline"].startswith("The run lost") and f"rank {rank}" in doc["run"]["headline"]


# 4 ranks on 2 shared cores (load 13-27): once in soak the start came out 6 steps early,
# not seen again; with each rank's run-queue wait taken out (instrument/sched.py) 10 of 10
# runs found 30/31-59 at 28.97-32.38 ms, and one under-priced window (26.9 ms, the net
# level alone) led to pricing a net window from the raw series too.
@pytest.mark.parametrize("ranks", [2, 4])
def test_ddp_backward_window_found_whole(tmp_path: Any, ranks: int) -> None:
    doc, true_ms = _window_doc(tmp_path, ranks, "backward", 1)
    _check_whole(doc, 1, "backward", true_ms)


@pytest.mark.soak
@pytest.mark.parametrize("phase", ["forward", "optimizer", "dataloader"])
def test_window_found_whole_in_every_phase(tmp_path: Any, phase: str) -> None:
    doc, true_ms = _window_doc(tmp_path, 2, phase, 0)
    _check_whole(doc, 0, phase, true_ms)
