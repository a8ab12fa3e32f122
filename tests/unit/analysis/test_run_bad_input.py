"""Bad run directories: a clear message, a partial report where data remains, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synth_runs import Slow, SynthRun, make_records, write_run

from stepscope.analysis.run import analyze_run
from stepscope.cli.report_cmd import report_command
from stepscope.common.errors import AnalysisError


def _write(root: Path, recs: dict[int, list[dict]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rank, rows in recs.items():
        (root / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _json_report(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    rc = report_command(str(run_dir), as_json=True, markdown=None, html=None)
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else {}), err


@pytest.mark.parametrize("make", ["missing", "empty_dir", "empty_files", "all_corrupt", "file"])
def test_unusable_input_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: str
) -> None:
    run = tmp_path / "run"
    if make != "missing":
        run.mkdir() if make != "file" else run.write_text("x")
    if make == "empty_files":
        (run / "rank0.jsonl").write_text("")
    if make == "all_corrupt":
        (run / "rank0.jsonl").write_text("{not json\n[1, 2]\n")
    rc = report_command(str(run), as_json=False, markdown=None, html=None)
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("stepscope report: ") and "Traceback" not in err + out
    with pytest.raises(AnalysisError):
        analyze_run(run)


def test_corrupt_and_truncated_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", SynthRun(slow=(Slow(1, "dataloader"),)))
    lines = (run / "rank0.jsonl").read_text().splitlines(keepends=True)
    lines[5] = "{garbage\n"
    lines[9] = '{"schema": 1, "rank": 0}\n'  # valid JSON, not a step record
    (run / "rank0.jsonl").write_text("".join(lines))
    with open(run / "rank2.jsonl", "a") as fh:
        fh.write('{"schema": 1, "rank": 2, "step": 60, "start_un')  # killed mid-write
    rc, doc, err = _json_report(run, capsys)
    assert rc == 0
    skipped = " | ".join(doc["run"]["skipped"])
    assert "rank0.jsonl: 2 corrupt" in skipped and "rank2.jsonl: truncated last line" in skipped
    assert doc["run"]["partial"] is True and "skipped" in err
    assert [(s["rank"], s["phase"]) for s in doc["stragglers"]] == [(1, "dataloader")]


def test_mixed_schema_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = make_records(SynthRun(slow=(Slow(3, "h2d"),)))
    for r in recs[0][:10]:
        r["schema"] = 7  # written by a future stepscope
    rc, doc, _ = _json_report(_write(tmp_path / "run", recs), capsys)
    assert rc == 0
    assert any("schema version 7" in s for s in doc["run"]["skipped"])
    assert doc["stragglers"][0]["rank"] == 3


def test_only_unknown_schema(tmp_path: Path) -> None:
    recs = make_records(SynthRun(ranks=2, steps=10))
    for rows in recs.values():
        for r in rows:
            r["schema"] = 99
    with pytest.raises(AnalysisError, match="schema"):
        analyze_run(_write(tmp_path / "run", recs))


def test_different_step_sets_and_missing_rank(tmp_path: Path) -> None:
    recs = make_records(SynthRun(ranks=4, steps=60, slow=(Slow(2, "forward"),)))
    recs[1] = recs[1][:50]  # rank 1 stopped early
    del recs[3]  # rank 3's file is missing
    doc = analyze_run(_write(tmp_path / "run", recs))
    skipped = " | ".join(doc["run"]["skipped"])
    assert "rank(s) 3" in skipped and "world size 4" in skipped
    assert "different step sets" in skipped and "rank 0: 10" in skipped
    assert doc["run"]["steps"] == 50 and doc["run"]["ranks"] == 3
    assert [(s["rank"], s["phase"]) for s in doc["stragglers"]] == [(2, "forward")]


def test_duplicate_records(tmp_path: Path) -> None:
    recs = make_records(SynthRun(ranks=2, steps=20))
    recs[0] = recs[0] + recs[0][:3]
    doc = analyze_run(_write(tmp_path / "run", recs))
    assert any("3 duplicate" in s for s in doc["run"]["skipped"])
    assert doc["run"]["records"] == 40


def test_terminal_report_shows_partial(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = make_records(SynthRun(ranks=3, steps=30))
    del recs[2]
    rc = report_command(str(_write(tmp_path / "run", recs)), as_json=False, markdown=None,
                        html=None)
    out = capsys.readouterr().out
    assert rc == 0 and "Partial report" in out and "rank(s) 2" in out
