"""Run-queue wait can explain a gap away, never make one.

The analysis takes each rank's wait for a CPU (``counters.runq_ms``) out of its phases before
comparing ranks. When the *other* rank is the one that waited, taking its wait out makes the
first rank look slow on steps where both took the same time: a window nobody waited for.
Seen on a clean Lightning run (2 ranks, 60 steps of ~8 ms): rank 1
waited 5–13 ms a step for a CPU on steps 51–55, most of it inside its dataloader (a broadcast
that ran long on both ranks); rank 0 was called a WARNING dataloader straggler of 1.7 ms there,
with a raw gap of 0.2 ms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepscope.analysis.run import analyze_run

synth = pytest.importorskip("synth_runs")

STEPS = 60
#: Lightning-sized phases (ms): a ~6 ms step.
BASE = {"dataloader": 1.0, "h2d": 0.05, "forward": 1.5, "backward": 3.0, "optimizer": 0.3}


def _write(tmp: Path, slow: tuple[Any, ...], runq: dict[tuple[int, int], float], seed: int) -> Path:
    spec = synth.SynthRun(ranks=2, steps=STEPS, base_ms=dict(BASE), noise_ms=0.05, seed=seed,
                          comm_child=True, slow=slow)
    return synth.write_run(tmp, spec, runq, runq_floor_ms=(0.0, 0.5))


def _loud(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(v["severity"], v["kind"], v["evidence"]) for v in doc["verdicts"] if v["severity"] != "info"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_other_ranks_wait_for_a_cpu_names_no_one(tmp_path: Path, seed: int) -> None:
    # Both ranks' dataloader 3 ms longer on steps 51-55 (the same wall time: nobody waits for
    # anybody); rank 1 spent 8 ms a step of it waiting for a CPU, rank 0 1 ms.
    slow = tuple(synth.Slow(r, "dataloader", 3.0, 51, 55) for r in range(2))
    runq = {(r, s): (8.0 if r == 1 else 1.0) for r in range(2) for s in range(51, 56)}
    doc = analyze_run(_write(tmp_path / "run", slow, runq, seed))
    assert doc["stragglers"] == [], doc["stragglers"]
    assert _loud(doc) == [], _loud(doc)
    assert [v["kind"] for v in doc["verdicts"]].count("balanced") == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_a_real_short_window_beside_the_same_wait_is_still_named(tmp_path: Path, seed: int) -> None:
    # Rank 0 really slower (+4 ms of its own, the others wait for it) on the same steps while
    # rank 1 waits for a CPU: the raw gap shows it, so it stays a straggler.
    slow = (synth.Slow(0, "dataloader", 7.0, 46, 55), synth.Slow(1, "dataloader", 3.0, 46, 55))
    runq = {(1, s): 3.0 for s in range(46, 56)}
    doc = analyze_run(_write(tmp_path / "run", slow, runq, seed))
    (s,) = doc["stragglers"]
    assert (s["rank"], s["phase"], s["persistence"]) == (0, "dataloader", "window"), s
    assert abs(s["first_step"] - 46) <= 2 and abs(s["last_step"] - 55) <= 2, s
    assert 3.6 <= s["excess_ms"] <= 7.0 * 1.1, s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_other_ranks_cpu_wait_does_not_stretch_a_window(tmp_path: Path, seed: int) -> None:
    # A recorded 2-rank DDP run (rank 1's backward +30 ms on steps 30-59): on steps
    # 27 and 29 rank 0 waited ~2.2 ms for a CPU inside the gradient all-reduce, which ran
    # that much longer on both ranks (time inside a collective is shared). Taking the wait out
    # of rank 0 alone put rank 1 2 ms behind there, and the window came out as 27-59.
    slow = (synth.Slow(1, "backward", 30.0, 30, 59),
            *(synth.Slow(r, "backward", 2.2, s, s) for r in range(2) for s in (27, 29)))
    runq = {(0, 27): 2.2, (0, 29): 2.5}
    spec = synth.SynthRun(ranks=2, steps=90, base_ms=dict(BASE), noise_ms=0.05, seed=seed,
                          comm_child=True, slow=slow)
    doc = analyze_run(synth.write_run(tmp_path / "run", spec, runq, runq_floor_ms=(0.0, 0.5)))
    (s,) = doc["stragglers"]
    assert (s["rank"], s["phase"], s["persistence"]) == (1, "backward", "window"), s
    assert (s["first_step"], s["last_step"]) == (30, 59), s
    assert 27.0 <= s["excess_ms"] <= 33.0, s
