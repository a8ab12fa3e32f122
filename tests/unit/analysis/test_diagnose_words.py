"""Verdict sentences: grammatical agreement, and every number in the text equal to the JSON's."""

from __future__ import annotations

import copy
import re
import statistics
from pathlib import Path
from typing import Any

import pytest
from synth_runs import BASE_MS, Slow, SynthRun, write_run

from stepscope.analysis.run import analyze_run


def _verdict(doc: dict[str, Any], kind: str) -> str:
    found = [v["evidence"] for v in doc["verdicts"] if v["kind"] == kind]
    assert found, [v["kind"] for v in doc["verdicts"]]
    return found[0]


def _pct(x: float) -> str:
    return f"{100.0 * x:.0f}%"


def _listed_ranks(text: str) -> list[int]:
    m = re.match(r"ranks? ([0-9, and]+?) (?:wait|waits|spend|spends)\b", text)
    assert m, text
    return [int(x) for x in re.findall(r"\d+", m.group(1))]


def _agreement_ok(text: str) -> None:
    assert not re.search(r"\branks \d+ (wait|spend)", text), text  # "ranks 0 wait"
    assert not re.search(r"\brank \d+ (wait|spend)\b", text), text  # "rank 0 wait"


@pytest.fixture(scope="module")
def straggler_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    spec = SynthRun(ranks=4, steps=100, slow=(Slow(2, "dataloader", 25.0, 30, 69),))
    return analyze_run(write_run(tmp_path_factory.mktemp("w") / "run", spec))


def test_straggler_sentence_numbers(straggler_doc: dict[str, Any]) -> None:
    doc = straggler_doc
    s = doc["stragglers"][0]
    step_med = doc["run"]["step_ms"]["median"]
    text = _verdict(doc, "straggler")
    _agreement_ok(text)
    assert f"rank {s['rank']}" in text and f"{s['excess_ms']:.1f} ms more" in text
    # the share says what it is of, and is of that
    assert f"({_pct(s['excess_ms'] / step_med)} of the run's median step, {step_med:.1f} ms)" in text
    waiters = _listed_ranks(text.split("; ", 1)[1])
    assert waiters == s["victims"] and s["rank"] not in waiters
    assert f"≈ {s['victim_wait_ms']:.1f} ms per step" in text


def test_one_fault_is_one_finding_with_its_waits_inside(straggler_doc: dict[str, Any]) -> None:
    """The ranks that waited for the straggler are its evidence, not a second alarm."""
    loud = [v for v in straggler_doc["verdicts"] if v["severity"] != "info"]
    assert [v["kind"] for v in loud] == ["straggler"], loud
    assert "comm_wait" in [c["kind"] for c in loud[0]["consequences"]]
    assert straggler_doc["run"]["headline"].endswith(
        f"without it a step would take {loud[0]['cost']['what_if_step_ms']:.1f} ms")


def test_comm_wait_lists_waiters_not_the_culprit(straggler_doc: dict[str, Any]) -> None:
    doc = straggler_doc
    (s,) = [v for v in doc["verdicts"] if v["kind"] == "straggler"]
    text = next(c["evidence"] for c in s["consequences"] if c["kind"] == "comm_wait")
    _agreement_ok(text)
    culprits = {s["rank"] for s in doc["stragglers"]}
    listed = _listed_ranks(text)
    assert listed and not culprits & set(listed)
    share = statistics.median(r["wait_share"] for r in doc["ranks"] if r["rank"] in listed)
    assert f"spend {_pct(share)} of their step time" in text
    assert f"rank {doc['stragglers'][0]['rank']} ({doc['stragglers'][0]['phase']}) arrives last" in text


def test_one_waiting_rank_is_singular(straggler_doc: dict[str, Any]) -> None:
    from stepscope.analysis.diagnose import diagnose

    doc = copy.deepcopy(straggler_doc)
    culprit = doc["stragglers"][0]["rank"]
    for s in doc["stragglers"]:
        s["victims"] = [0]
    for r in doc["ranks"]:  # only rank 0 (and the culprit) wait long
        r["wait_share"] = 0.3 if r["rank"] in (0, culprit) else 0.05
    verdicts = diagnose(doc["run"], doc["phases"], doc["ranks"], doc["stragglers"], doc["windows"])
    text = next(v.evidence for v in verdicts if v.kind == "straggler")
    _agreement_ok(text)
    assert "; rank 0 waits ≈" in text
    cw = next(v.evidence for v in verdicts if v.kind == "comm_wait")
    _agreement_ok(cw)
    assert cw.startswith("rank 0 spends 30% of its step time waiting")


def test_input_bound_share_and_median_agree(tmp_path: Path) -> None:
    base = dict(BASE_MS, dataloader=2.0)
    # Every 4th step waits 40 ms for data: a big share of time, a small median per step.
    slow = tuple(Slow(r, "dataloader", 40.0, st, st) for r in range(3) for st in range(0, 80, 4))
    doc = analyze_run(write_run(tmp_path / "run", SynthRun(ranks=3, steps=80, base_ms=base, slow=slow)))
    text = _verdict(doc, "input_bound")
    ph = doc["phases"]["dataloader"]
    share = statistics.median(p["share"] for p in ph["per_rank"])
    assert f"dataloader takes {_pct(share)} of total step time (median over 3 ranks)" in text
    assert f"a median {ph['median_ms']:.2f} ms and a p90 {ph['p90_ms']:.2f} ms over 80 steps" in text
    # The median step's 2 ms is far below the share of a ~20 ms step: the text says why.
    assert "concentrated in the slow steps" in text
