"""The one verdict type: its report form (today's keys, optional ones left out), its checks,
the trace report's form, and the one-fault-one-finding fold on it."""

from __future__ import annotations

import ast
import dataclasses
import json
from typing import Any

import paths  # tests/support: where the repository is
import pytest
from synth_runs import Slow, SynthRun, write_run

from stepscope.analysis import cost
from stepscope.analysis.run import analyze_run
from stepscope.analysis.verdict import KINDS, SEVERITIES, Consequence, Verdict

#: Every key a run verdict in the JSON report may have.
REPORT_KEYS = {"kind", "severity", "cost", "subject", "evidence", "suggestion", "rank", "phase",
               "consequences"}
JOB = {"total_ms": 10_000.0, "world_size": 4, "median_step_ms": 100.0}


def _straggler(c: dict[str, Any]) -> Verdict:
    return Verdict(kind="straggler", severity="critical", evidence="rank 3 is late",
                   suggestion="look at rank 3", cost=c, subject="rank 3 slow in dataloader",
                   rank=3, phase="dataloader")


def test_a_full_verdict_serialises_to_the_report_keys_and_back() -> None:
    v = _straggler(cost.price(JOB, 20.0, 50, 4))
    v.consequences.append(Consequence(kind="comm_wait", subject="waiting in backward",
                                      evidence="ranks 0, 1 and 2 wait"))
    d = v.to_dict()
    assert list(d) == ["kind", "severity", "cost", "subject", "evidence", "suggestion", "rank",
                       "phase", "consequences"]
    assert d["consequences"] == [{"kind": "comm_wait", "subject": "waiting in backward",
                                  "evidence": "ranks 0, 1 and 2 wait"}]
    assert d["cost"] is v.cost  # shared, not copied: the report prices one fault once
    back = Verdict.from_dict(json.loads(json.dumps(d)))
    assert back.to_dict() == d


def test_absent_optional_keys_are_left_out_not_null() -> None:
    d = Verdict(kind="balanced", severity="info", evidence="e", suggestion="s").to_dict()
    assert d == {"kind": "balanced", "severity": "info", "evidence": "e", "suggestion": "s"}
    assert Verdict.from_dict(d).to_dict() == d


@pytest.mark.parametrize("bad", ["fatal", "Critical", "", None, 2])
def test_an_unknown_severity_is_a_value_error_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match=f"severity must be one of critical, warning, info; got {bad!r}"):
        Verdict(kind="straggler", severity=bad, evidence="", suggestion="")


def test_a_severity_lowered_later_is_checked_too() -> None:
    v = _straggler(cost.no_cost(JOB))
    v.severity = "info"
    assert v.to_dict()["severity"] == "info"
    with pytest.raises(ValueError, match="got 'minor'"):
        v.severity = "minor"
    assert v.severity == "info"


@pytest.mark.parametrize("bad", ["stragler", "STRAGGLER", ""])
def test_an_unknown_kind_is_a_value_error_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match=f"verdict kind must be one of .*; got {bad!r}"):
        Verdict(kind=bad, severity="info", evidence="", suggestion="")
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        Consequence(kind=bad, subject="", evidence="")


def test_the_trace_form_is_rank_kind_message() -> None:
    v = Verdict(kind="exposed_comm", severity="warning", evidence="rank 1: 40% exposed.",
                suggestion="Overlap it.", rank=1)
    assert v.to_trace_dict() == {"rank": "1", "kind": "exposed_comm",
                                 "message": "rank 1: 40% exposed. Overlap it."}
    whole = Verdict(kind="compute_bound", severity="info", evidence="No dominant stall.",
                    suggestion="")
    assert whole.to_trace_dict() == {"rank": "", "kind": "compute_bound",
                                     "message": "No dominant stall."}


def test_fold_keeps_the_cause_and_says_its_consequences() -> None:
    c = cost.price(JOB, 20.0, 50, 4)
    cause = _straggler(c)
    wait = Verdict(kind="comm_wait", severity="critical", evidence="ranks wait",
                   suggestion="fix the late rank", cost=c, subject="waiting in backward")
    note = Verdict(kind="compute_bound", severity="info", evidence="compute", suggestion="",
                   cost=cost.no_cost(JOB))
    kept = cost.fold([wait, note, cause])
    assert kept == [note, cause]
    assert [x.to_dict() for x in cause.consequences] == [
        {"kind": "comm_wait", "subject": "waiting in backward", "evidence": "ranks wait"}]


def test_fold_makes_a_host_overhead_the_cause_of_a_residual_straggler() -> None:
    c = cost.price(JOB, 20.0, 50, 4)
    late = dataclasses.replace(_straggler(c), phase="residual", consequences=[])
    host = Verdict(kind="host_overhead", severity="warning", evidence="untimed work",
                   suggestion="time it", cost=c, subject="untimed host work between phases")
    assert cost.fold([late, host]) == [host]
    assert host.severity == "critical"  # the straggler's, the higher
    assert [x.kind for x in host.consequences] == ["straggler"]


def test_order_sorts_by_severity_then_time_lost() -> None:
    small, big = cost.price(JOB, 1.0, 50, 4), cost.price(JOB, 30.0, 50, 4)
    made = [Verdict(kind=k, severity=s, evidence="", suggestion="", cost=c)
            for k, s, c in (("balanced", "info", None), ("comm_bound", "warning", small),
                            ("straggler", "warning", big), ("memory_pressure", "critical", None))]
    cost.order(made)
    assert [v.kind for v in made] == ["memory_pressure", "straggler", "comm_bound", "balanced"]
    assert [v.severity for v in made] == sorted((v.severity for v in made), key=SEVERITIES.index)
    assert all(text for text in KINDS.values())


@pytest.fixture(scope="module")
def straggler_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = write_run(tmp_path_factory.mktemp("v") / "run",
                    SynthRun(ranks=4, steps=60, slow=(Slow(2, "dataloader", 12.0),)))
    return analyze_run(run)


def test_the_report_holds_plain_verdicts_with_todays_keys(straggler_report: dict[str, Any]) -> None:
    verdicts = straggler_report["verdicts"]
    assert verdicts and all(isinstance(v, dict) for v in verdicts)
    for v in verdicts:
        assert set(v) <= REPORT_KEYS, v
        assert {"kind", "severity", "evidence", "suggestion"} <= set(v)
        assert None not in (v.get(k, "") for k in REPORT_KEYS), v  # absent, never null
        assert Verdict.from_dict(v).to_dict() == v
    (s,) = [v for v in verdicts if v["kind"] == "straggler"]
    assert (s["rank"], s["phase"]) == (2, "dataloader")
    assert [c["kind"] for c in s.get("consequences", [])]  # the waits, folded into it
    assert json.loads(json.dumps(verdicts)) == verdicts  # plain JSON, nothing else inside


ANALYSIS = paths.SRC / "stepscope" / "analysis"


def _hand_made_verdicts(source: str) -> list[int]:
    """Lines of dict literals shaped like a verdict: a ``severity`` key, or ``kind`` beside
    ``evidence`` or ``message``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if "severity" in keys or ("kind" in keys and keys & {"evidence", "message"}):
                lines.append(node.lineno)
    return lines


def test_no_analysis_module_builds_a_verdict_as_a_dict() -> None:
    assert _hand_made_verdicts('v = {"kind": "straggler", "severity": "info"}') == [1]
    found = {str(p.relative_to(ANALYSIS)): _hand_made_verdicts(p.read_text())
             for p in ANALYSIS.rglob("*.py") if p.name != "verdict.py"}
    assert {k: v for k, v in found.items() if v} == {}
