"""Hostile run directories for `stepscope report`.

Every case is a real run directory (synthetic records written as the recorder writes them)
mutated the way a damaged or malicious file would be; the report must skip the bad part with
a stated reason, report the rest, and print valid JSON.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import paths  # tests/support: where the repository is
import pytest
from synth_runs import SynthRun, make_records, write_run

from stepscope.cli.report_cmd import report_command
from stepscope.recording.schema import SQLITE_COLUMNS, SQLITE_TABLE, record_to_row

SRC = paths.SRC


def _strict_json(text: str) -> dict[str, Any]:
    def no_constants(name: str) -> None:
        raise AssertionError(f"invalid JSON constant {name} in the output")

    return json.loads(text, parse_constant=no_constants)  # type: ignore[no-any-return]


def _report(run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    rc = report_command(str(run), as_json=True, markdown=None, html=None)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Traceback" not in err
    return _strict_json(out), err


def _run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", SynthRun(ranks=2, steps=40))


def _lines(run: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / f"rank{rank}.jsonl").read_text().splitlines()]


def _rewrite(run: Path, rank: int, rows: list[dict[str, Any]] | list[str]) -> None:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    (run / f"rank{rank}.jsonl").write_text(text)


# ----------------------------------------------------------------------------- item 1: paths


def _triggers(run: Path, entries: list[dict[str, Any]]) -> None:
    (run / "triggers.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_trigger_trace_outside_the_run_is_not_read(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "TOP-SECRET", "ts": 1, "dur": 1}]}))
    (run / "link.json").symlink_to(secret)
    _triggers(run, [
        {"rank": 0, "trigger_step": 5, "reason": "slow", "trace": "/etc/passwd"},
        {"rank": 0, "trigger_step": 6, "reason": "slow", "trace": "../secret.json"},
        {"rank": 0, "trigger_step": 7, "reason": "slow", "trace": "link.json"},
    ])
    doc, _ = _report(run, capsys)
    text = json.dumps(doc)
    assert "root:" not in text and "TOP-SECRET" not in text
    skipped = " | ".join(doc["run"]["skipped"])
    assert skipped.count("outside the run directory") == 3, skipped


def test_trigger_trace_fifo_does_not_hang(tmp_path: Path) -> None:
    run = _run(tmp_path)
    os.mkfifo(run / "trace.json")
    _triggers(run, [{"rank": 0, "trigger_step": 5, "reason": "slow", "trace": "trace.json"}])
    # In a child with a deadline: opening a FIFO with no writer blocks forever.
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(SRC)!r})
        from stepscope.cli.report_cmd import report_command
        sys.exit(report_command({str(run)!r}, as_json=True, markdown=None, html=None))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = _strict_json(p.stdout)
    assert any("not a regular file" in s for s in doc["run"]["skipped"]), doc["run"]["skipped"]


def test_trigger_trace_too_large_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from stepscope.analysis import triggers

    run = _run(tmp_path)
    (run / "big.json").write_bytes(b" " * 4096)
    monkeypatch.setattr(triggers, "MAX_TRACE_BYTES", 1024)
    _triggers(run, [{"rank": 0, "trigger_step": 5, "reason": "slow", "trace": "big.json"}])
    doc, _ = _report(run, capsys)
    assert any("larger than" in s for s in doc["run"]["skipped"])


def test_bad_trigger_fields_are_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    _triggers(run, [
        {"rank": 0, "trigger_step": "abc", "reason": "slow"},
        {"rank": 0, "trigger_step": 5, "reason": "slow", "trace": 5},
        {"rank": 0, "trigger_step": 6, "reason": "slow"},
    ])
    doc, _ = _report(run, capsys)
    skipped = " | ".join(doc["run"]["skipped"])
    assert "line 1" in skipped and "line 2" in skipped


# ----------------------------------------------------------------------------- item 4: sizes


@pytest.mark.parametrize("field,value", [("rank", 2**40), ("world_size", 10**12), ("rank", -3),
                                         ("world_size", -1), ("world_size", 0)])
def test_implausible_rank_or_world_size_is_a_bad_record(tmp_path: Path, field: str, value: int) -> None:
    run = _run(tmp_path)
    rows = _lines(run, 1)
    rows[3][field] = value
    _rewrite(run, 1, rows)
    # In a child with a memory limit: set(range(world_size)) took 24 GB before.
    code = textwrap.dedent(f"""
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        sys.path.insert(0, {str(SRC)!r})
        from stepscope.cli.report_cmd import report_command
        sys.exit(report_command({str(run)!r}, as_json=True, markdown=None, html=None))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = _strict_json(p.stdout)
    assert doc["run"]["world_size"] == 2
    assert any("implausible" in s for s in doc["run"]["skipped"]), doc["run"]["skipped"]


# ----------------------------------------------------------------------------- item 7: values


@pytest.mark.parametrize("mutate", ["nan_step", "inf_phase", "huge_step", "start_max", "start_min"])
def test_non_finite_and_out_of_range_values_are_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate: str
) -> None:
    run = _run(tmp_path)
    rows: list[Any] = _lines(run, 0)
    if mutate == "nan_step":
        r = rows[4]
        r["step_ms"] = float("nan")
        rows[4] = json.dumps(r)  # Python writes NaN, as a careless writer would
    elif mutate == "inf_phase":
        r = rows[4]
        r["phases"][0]["ms"] = float("inf")
        rows[4] = json.dumps(r)  # Python writes Infinity, as a careless writer would
    elif mutate == "huge_step":
        rows[4]["step_ms"] = 1e308
    elif mutate == "start_max":
        rows[4]["start_unix_ns"] = 2**63 - 1
    else:
        rows[4]["start_unix_ns"] = -(2**63)
    _rewrite(run, 0, rows)
    doc, _ = _report(run, capsys)
    skipped = " | ".join(doc["run"]["skipped"])
    assert "rank0.jsonl" in skipped and ("1 corrupt" in skipped or "1 record" in skipped), skipped
    assert doc["run"]["partial"] is True


def test_sqlite_phases_not_json_skips_the_record(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    recs = make_records(SynthRun(ranks=2, steps=30))
    run = tmp_path / "run"
    run.mkdir()
    for rank, rows in recs.items():
        con = sqlite3.connect(run / f"rank{rank}.sqlite")
        cols = ", ".join(f'"{n}" {t}' for n, t in SQLITE_COLUMNS)
        con.execute(f"CREATE TABLE {SQLITE_TABLE} ({cols})")
        marks = ", ".join("?" for _ in SQLITE_COLUMNS)
        vals = [list(record_to_row(r)) for r in rows]
        if rank == 1:
            i = [n for n, _ in SQLITE_COLUMNS].index("phases")
            vals[2][i] = "{not json"
        con.executemany(f"INSERT INTO {SQLITE_TABLE} VALUES ({marks})", vals)
        con.commit()
        con.close()
    doc, _ = _report(run, capsys)
    assert any("rank1.sqlite" in s and "1 record" in s for s in doc["run"]["skipped"]), doc["run"]["skipped"]
    assert doc["run"]["world_size"] == 2


def test_one_huge_line_skips_the_line_not_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    rows: list[Any] = _lines(run, 0)
    big = dict(rows[4])
    big["hostname"] = "h" * (80 << 20)  # one 80 MB line (the old limit was 64 MB per object)
    rows[4] = json.dumps(big)
    _rewrite(run, 0, rows)
    t0 = time.perf_counter()
    doc, _ = _report(run, capsys)
    assert time.perf_counter() - t0 < 120
    skipped = " | ".join(doc["run"]["skipped"])
    assert "rank0.jsonl" in skipped and "longer than" in skipped, skipped
    assert doc["run"]["world_size"] == 2


def test_clean_run_reports_nothing_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Guard for the guards: a clean run passes every bound untouched.
    doc, _ = _report(_run(tmp_path), capsys)
    assert doc["run"]["skipped"] == [] and doc["run"]["world_size"] == 2
