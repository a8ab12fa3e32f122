"""Real 4-rank DDP runs over gloo, recorded by stepscope, with slowness injected on one rank.

Every run is launched once per module (they cost ~12 s each: process spawn dominates) and
then checked against the known culprit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepscope.analysis.run import analyze_run

demo = pytest.importorskip("stepscope.demo")
pytestmark = pytest.mark.slow

STEPS = 60
MS = 40.0  # well above the scheduling noise of 4 ranks on 2 cores (25 left confidence 0.52-0.68 under load)
SCENARIOS: dict[str, tuple[Any, ...]] = {
    "balanced": (),
    "dataloader": (demo.SlowSpec(1, "dataloader", ms=MS),),
    "h2d": (demo.SlowSpec(2, "h2d", ms=MS),),
    "forward": (demo.SlowSpec(3, "forward", start_step=20, end_step=40, ms=MS),),
    "backward": (demo.SlowSpec(2, "backward", ms=MS),),
    "optimizer": (demo.SlowSpec(0, "optimizer", ms=MS),),
}


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ddp")
    out = {}
    for name, slow in SCENARIOS.items():
        run = demo.launch(root / name, ranks=4, steps=STEPS, slow=slow, seed=1)
        out[name] = analyze_run(run)
    return out


def _culprits(doc: dict[str, Any]) -> list[tuple[int, str]]:
    return [(s["rank"], s["phase"]) for s in doc["stragglers"]]


@pytest.mark.parametrize(("name", "rank"), [("dataloader", 1), ("h2d", 2), ("optimizer", 0)])
def test_chronic_culprit_rank_and_phase(docs: dict[str, dict[str, Any]], name: str, rank: int) -> None:
    doc = docs[name]
    assert _culprits(doc) == [(rank, name)]
    s = doc["stragglers"][0]
    assert s["persistence"] == "chronic" and s["steps"] >= 0.8 * STEPS
    assert MS * 0.6 < s["excess_ms"] < MS * 1.6
    # Confidence falls with the noise (the excess over a threshold that rises with it): 0.7 or
    # more in every earlier CI run, 0.52-0.68 in runs beside two other suites and a busy loop.
    assert s["confidence"] >= 0.5
    # The others wait for it inside backward (the all-reduce); it does not.
    # Scheduling noise on an oversubscribed CPU can hide one victim, never add the culprit.
    assert set(s["victims"]) <= {0, 1, 2, 3} - {rank} and len(s["victims"]) >= 2
    ranks = {r["rank"]: r for r in doc["ranks"]}
    others = sorted(ranks[r]["wait_ms"]["median"] for r in ranks if r != rank)
    assert others[1] > ranks[rank]["wait_ms"]["median"] + 0.4 * MS
    top = doc["verdicts"][0]
    assert top["kind"] == "straggler" and f"rank {rank}" in top["evidence"]
    assert doc["run"]["alignment"]["sync_phase"] == "backward"


def test_window_culprit(docs: dict[str, dict[str, Any]]) -> None:
    doc = docs["forward"]
    assert _culprits(doc) == [(3, "forward")]
    s = doc["stragglers"][0]
    assert s["persistence"] == "window"
    assert abs(s["first_step"] - 20) <= 3 and abs(s["last_step"] - 39) <= 3
    assert any(w["ranks"] == [3] and w["phase"] == "forward"
               and abs(w["start_step"] - 20) <= 3 and abs(w["end_step"] - 39) <= 3
               for w in doc["windows"])


def test_balanced_no_false_alarm(docs: dict[str, dict[str, Any]]) -> None:
    doc = docs["balanced"]
    assert doc["stragglers"] == [] and doc["windows"] == []
    kinds = [v["kind"] for v in doc["verdicts"]]
    assert "balanced" in kinds and "straggler" not in kinds and "comm_wait" not in kinds


def test_backward_compute_straggler_is_named(docs: dict[str, dict[str, Any]]) -> None:
    """A sleep inside backward compute (before the all-reduce) delays all ranks equally.

    Phase ends alone cannot single it out (TraceML #252): every rank leaves backward
    together. The tracer's nested ``grad_sync`` phase marks each rank's arrival at the
    gradient all-reduce, and the late arrival names the culprit.
    """
    doc = docs["backward"]
    assert doc["run"]["alignment"]["arrival"] == "grad_sync"
    assert _culprits(doc) == [(2, "backward")]
    s = doc["stragglers"][0]
    assert s["steps"] >= 0.5 * STEPS and MS * 0.6 < s["excess_ms"] < MS * 1.6
    assert set(s["victims"]) <= {0, 1, 3} and len(s["victims"]) >= 2
    # Everyone's step got slower by about the injected time.
    assert doc["run"]["step_ms"]["median"] > docs["balanced"]["run"]["step_ms"]["median"] + 0.5 * MS


def test_demo_report_names_slow_rank(docs: dict[str, dict[str, Any]], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from stepscope.cli.report_cmd import report_command

    run_dir = docs["dataloader"]["run"]["dir"]
    assert report_command(run_dir, as_json=False, markdown=None, html=None) == 0
    out = capsys.readouterr().out
    assert "straggler" in out and "rank 1" in out and "dataloader" in out
