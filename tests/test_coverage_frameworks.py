"""Real gloo runs of accelerate, tensor parallel, pipeline and expert parallel jobs.

Each checks what a user would: the slow rank (or stage) and phase named with about the
injected excess, a balanced run quiet, and no verdict or row for a mechanism the job does not
use. Injections are 25-40 ms, far above a busy 2-core machine's jitter.
"""

from __future__ import annotations

from typing import Any

import pytest

from stepscope.analysis.run import analyze_run

demo = pytest.importorskip("stepscope.demo")
frameworks = pytest.importorskip("dist_frameworks")
pytestmark = pytest.mark.slow

MS = 25.0


def _kinds(doc: dict[str, Any]) -> list[str]:
    return [v["kind"] for v in doc["verdicts"]]


def test_accelerate_prepared_optimizer_is_timed(tmp_path: Any) -> None:
    pytest.importorskip("accelerate")
    doc = analyze_run(frameworks.launch_accelerate(
        tmp_path, ranks=2, steps=30, slow=(demo.SlowSpec(1, "optimizer", ms=MS),)))
    assert {"forward", "backward", "optimizer"} <= set(doc["phases"])
    s = doc["stragglers"][0]
    assert (s["rank"], s["phase"]) == (1, "optimizer")
    assert 0.7 * MS < s["excess_ms"] < 1.4 * MS
    assert s["victims"] == [0]
    assert doc["verdicts"][0]["kind"] == "straggler"
