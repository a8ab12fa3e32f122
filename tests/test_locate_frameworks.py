"""Real 2-rank gloo runs of framework paths: FSDP2 ``fully_shard`` and the HF Trainer under DDP.

These need collective timing (instrument/collectives.py): FSDP2's all-gathers and
reduce-scatters, and the Trainer's cross-rank gather while fetching a batch, are where the
fast rank waits. Injections are 25-30 ms, far above a busy 2-core machine's jitter.
"""

from __future__ import annotations

from typing import Any

import pytest

from stepscope.analysis.run import analyze_run

demo = pytest.importorskip("stepscope.demo")
harness = pytest.importorskip("dist_harness")
pytestmark = pytest.mark.slow

MS = 25.0


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("fsdp2")
    runs = {"balanced": (), "forward": (demo.SlowSpec(1, "forward", ms=MS),),
            "backward": (demo.SlowSpec(1, "backward", ms=MS),)}
    return {name: analyze_run(harness.launch_fsdp(root / name, ranks=2, steps=60, slow=slow))
            for name, slow in runs.items()}


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_fsdp2_slow_rank_is_named(fsdp: dict[str, dict[str, Any]], phase: str) -> None:
    doc = fsdp[phase]
    assert doc["stragglers"], doc["verdicts"]
    s = doc["stragglers"][0]
    assert (s["rank"], s["phase"]) == (1, phase)
    assert 0.8 * MS < s["excess_ms"] < 1.3 * MS
    assert s["victims"] == [0] and s["wait_phase"] == phase  # waits inside the same phase
    assert all(o["excess_ms"] < 0.3 * MS for o in doc["stragglers"][1:])
    assert doc["run"]["alignment"]["wait_source"] == "collectives"
    ops = {o["op"] for o in doc["collectives"]["ops"]}
    assert any(op.startswith("all_gather") for op in ops)
    assert any(op.startswith("reduce_scatter") for op in ops)
    top = doc["verdicts"][0]
    assert top["kind"] == "straggler" and "rank 1" in top["evidence"]


def test_fsdp2_balanced_is_quiet(fsdp: dict[str, dict[str, Any]]) -> None:
    doc = fsdp["balanced"]
    assert doc["stragglers"] == [] and doc["windows"] == []
    assert "balanced" in [v["kind"] for v in doc["verdicts"]]
    assert all(v["severity"] == "info" for v in doc["verdicts"])
