"""Who is named a straggler: a gap in one phase must have cost another rank a wait."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from synth_collectives import CollRun, hf_program, make_records, write
from synth_runs import Slow

from stepscope.analysis.run import analyze_run


def _doc(tmp_path: Path, *slow: Slow) -> dict[str, Any]:
    spec = CollRun(hf_program(), ranks=2, steps=60, slow=slow, seed=3)
    return analyze_run(write(tmp_path / "run", make_records(spec)))


def test_a_phase_gap_made_up_elsewhere_is_no_straggler(tmp_path: Path) -> None:
    # Rank 0 spends 3 ms more in forward on every step, rank 1 as much more in backward's own
    # compute: both reach DDP's all-reduce together and no rank waits for the other (on a
    # balanced HF Trainer run on a busy 2-core host, rank 0's forward ran 1.6 ms over rank
    # 1's while rank 0, not rank 1, waited at the all-reduce).
    doc = _doc(tmp_path, Slow(0, "forward", 3.0), Slow(1, "backward", 3.0))
    assert doc["stragglers"] == [] and doc["windows"] == []
    assert all(v["severity"] == "info" for v in doc["verdicts"]), doc["verdicts"]
    gaps = {(u["rank"], u["phase"]): u for u in doc["run"]["unwaited"]}
    assert set(gaps) == {(0, "forward"), (1, "backward")}
    assert 2.0 < gaps[(0, "forward")]["excess_ms"] < 4.0
    assert any("rank 0's forward" in n and "no rank waited" in n for n in doc["run"]["notes"])


def test_the_same_gap_that_others_wait_for_is_named(tmp_path: Path) -> None:
    doc = _doc(tmp_path, Slow(0, "forward", 3.0))
    assert [(s["rank"], s["phase"]) for s in doc["stragglers"]] == [(0, "forward")]
    s = doc["stragglers"][0]
    assert 2.0 < s["excess_ms"] < 4.0 and s["victims"] == [1]
    assert doc["run"]["unwaited"] == []
