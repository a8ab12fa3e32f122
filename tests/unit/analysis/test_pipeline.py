"""``pipeline_bubble`` is its bottleneck straggler's price seen from the other stages.

Seen in a clean 2-stage GPipe run next to a CPU hog: stage 0 descheduled for 5 steps was a
WARNING straggler (2.6% of the job), but the bubble verdict it caused was a CRITICAL with no
cost. The bubble now carries the straggler's cost and severity (counted once, as comm_wait).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stepscope.analysis import cost
from stepscope.analysis.pipeline import BUBBLE_SHARE, pipeline_verdicts
from stepscope.analysis.verdict import Verdict


def _section(bubble_share: float) -> dict[str, Any]:
    return {"bottleneck_stage": 0, "bottleneck_rank": 0, "stages": [
        {"stage": 0, "rank": 0, "bubble_share": 0.05, "waited_on_ms": 23.3},
        {"stage": 1, "rank": 1, "bubble_share": bubble_share, "waited_on_ms": 0.0},
    ]}


def _straggler(severity: str) -> Verdict:
    c = {"lost_ms": 127.0, "share": 0.026, "per_step_ms": 25.4, "steps": 5}
    return Verdict(kind="straggler", severity=severity, cost=c,
                   subject="rank 0 slow in backward", evidence="...", suggestion="")


def test_bubble_takes_the_straggler_cost_and_severity() -> None:
    s = _straggler("warning")
    [v] = pipeline_verdicts(_section(0.53), [s])
    assert v.severity == "warning"  # not critical: 2.6% of the job
    assert v.cost is s.cost  # one cost object: the headline counts it once
    assert "its cost is the straggler's" in v.evidence
    verdicts = [s, v]
    cost.order(verdicts)
    assert {x.kind for x in verdicts} == {"straggler", "pipeline_bubble"}


def test_a_costly_straggler_keeps_the_bubble_critical() -> None:
    [v] = pipeline_verdicts(_section(0.53), [_straggler("critical")])
    assert v.severity == "critical"


def test_other_ranks_stragglers_are_not_taken() -> None:
    other = dataclasses.replace(_straggler("info"), subject="rank 10 slow in forward")
    [v] = pipeline_verdicts(_section(max(BUBBLE_SHARE[1], 0.53)), [other])
    assert v.severity == "critical" and "cost" not in v.to_dict()  # the bubble's own rule


def test_small_bubble_no_verdict() -> None:
    assert pipeline_verdicts(_section(BUBBLE_SHARE[0] / 2), [_straggler("critical")]) == []
