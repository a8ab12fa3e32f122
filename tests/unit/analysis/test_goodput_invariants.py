"""Goodput's invariants on hostile recordings: productive time plus every loss is the total,
the total is at most ranks x the wall span, and nothing is a restart without a new run id or
a falling step index — under overlapping steps, records written twice, a wall clock stepped
back an hour, and two runs interleaved in one directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from synth_runs import SynthRun, make_records

from stepscope.analysis.goodput import MS_PER_HOUR
from stepscope.analysis.run import analyze_run

HOUR_NS = 3600 * 10**9
Records = dict[int, list[dict[str, Any]]]


def _write(root: Path, lines: dict[int, list[str]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rank, rows in lines.items():
        (root / f"rank{rank}.jsonl").write_text("".join(r + "\n" for r in rows))
    return root


def _lines(recs: Records) -> dict[int, list[str]]:
    return {rank: [json.dumps(r) for r in rows] for rank, rows in recs.items()}


def _span_ms(recs: Records) -> float:
    """The wall span of the records as they ran (before any clock step was applied)."""
    first = min(r["start_unix_ns"] for rows in recs.values() for r in rows)
    last = max(r["start_unix_ns"] + r["step_ms"] * 1e6 for rows in recs.values() for r in rows)
    return (last - first) / 1e6


def _holds(gp: dict[str, Any], ranks: int, span_ms: float) -> None:
    total = gp["gpu_hours"] * MS_PER_HOUR
    parts = gp["productive_gpu_hours"] + sum(gp["lost_gpu_hours"].values())
    assert parts * MS_PER_HOUR == pytest.approx(total, rel=1e-5)
    assert total <= ranks * span_ms * (1 + 1e-5), (total, ranks * span_ms)
    assert gp["lost_gpu_hours"]["restarts"] == 0.0
    assert 0.0 < gp["goodput"] <= 1.0


def test_overlapping_steps_are_counted_once(tmp_path: Path) -> None:
    recs = make_records(SynthRun(ranks=2, steps=40, noise_ms=0.0))
    for rows in recs.values():
        t = rows[0]["start_unix_ns"]
        for r in rows:  # each step starts when 70 % of the previous one is done
            r["start_unix_ns"] = t
            t += int(0.7 * r["step_ms"] * 1e6)
    gp = analyze_run(_write(tmp_path / "run", _lines(recs)))["goodput"]
    _holds(gp, 2, _span_ms(recs))


def test_records_written_twice_count_once(tmp_path: Path) -> None:
    recs = make_records(SynthRun(ranks=2, steps=40))
    once = analyze_run(_write(tmp_path / "once", _lines(recs)))["goodput"]
    twice = {rank: [line for line in rows for _ in (0, 1)] for rank, rows in _lines(recs).items()}
    gp = analyze_run(_write(tmp_path / "twice", twice))["goodput"]
    _holds(gp, 2, _span_ms(recs))
    assert gp["gpu_hours"] == pytest.approx(once["gpu_hours"], rel=1e-5)
    assert gp["productive_gpu_hours"] == pytest.approx(once["productive_gpu_hours"], rel=1e-5)


def test_a_wall_clock_stepped_back_an_hour_is_no_restart(tmp_path: Path) -> None:
    recs = make_records(SynthRun(ranks=2, steps=40))
    span = _span_ms(recs)
    for rows in recs.values():
        for r in rows:
            if r["step"] >= 20:  # NTP steps the clock back an hour before step 20
                r["start_unix_ns"] -= HOUR_NS
    gp = analyze_run(_write(tmp_path / "run", _lines(recs)))["goodput"]
    _holds(gp, 2, span)
    assert gp["gpu_hours"] * MS_PER_HOUR < 2 * span


def test_two_interleaved_runs_are_accounted_apart(tmp_path: Path) -> None:
    a = make_records(SynthRun(ranks=2, steps=30, seed=1))
    b = make_records(SynthRun(ranks=2, steps=30, seed=2))
    half = _span_ms(a) / 2 * 1e6
    t_a = min(r["start_unix_ns"] for rows in a.values() for r in rows)
    t_b = min(r["start_unix_ns"] for rows in b.values() for r in rows)
    for rows in b.values():
        for r in rows:  # run b starts halfway through run a, into the same directory
            r["start_unix_ns"] += int(t_a + half - t_b)
            r["run_id"] = "b"
    for rows in a.values():
        for r in rows:
            r["run_id"] = "a"
    lines = {rank: [x for pair in zip(_lines(a)[rank], _lines(b)[rank], strict=True) for x in pair]
             for rank in a}
    run = _write(tmp_path / "run", lines)
    doc = analyze_run(run)
    assert doc["run"]["run_id"] == "b" and not doc["run"]["partial"], doc["run"]["skipped"]
    _holds(doc["goodput"], 2, _span_ms(b))
    doc = analyze_run(run, run_id="a")
    assert doc["run"]["run_id"] == "a" and doc["run"]["steps"] == 30
    _holds(doc["goodput"], 2, _span_ms(a))
