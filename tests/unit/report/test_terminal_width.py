"""Output that fits: piped output keeps every number whole; narrow terminals drop columns;
slow windows list their auto-profile captures (terminal and markdown)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import paths  # tests/support: where the repository is
import pytest
from synth_runs import Slow, SynthRun, write_run

SRC = str(paths.SRC)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Long phase names make the Ranks table wider than 80 columns.
    run = write_run(tmp_path_factory.mktemp("w") / "run", SynthRun(
        ranks=4, steps=80, slow=(Slow(2, "forward", 30.0, 30, 49),)))
    for f in run.glob("rank*.jsonl"):  # rename phases to something wide
        recs = [json.loads(line) for line in f.read_text().splitlines()]
        for r in recs:
            for p in r["phases"]:
                p["name"] = {"dataloader": "dataloader_with_a_long_name",
                             "optimizer": "optimizer_step_and_zero_grad"}.get(p["name"], p["name"])
        f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "triggers.jsonl").write_text(json.dumps(
        {"trigger_step": 35, "rank": 2, "role": "affected", "status": "captured",
         "reason": "step 3x median", "trace": None}) + "\n")
    return run


def _cli(*args: str, columns: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = SRC
    if columns:
        env["COLUMNS"] = columns
    res = subprocess.run([sys.executable, "-m", "stepscope", *args], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _rank_rows(out: str) -> dict[int, list[str]]:
    table = out.split("Ranks", 1)[1]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if cells and re.fullmatch(r"\d+\*?", cells[0]):
            rows[int(cells[0].rstrip("*"))] = cells[1:]
    return rows


def _expected(doc: dict, rank: dict) -> list[str]:
    top = [n for n, p in doc["phases"].items() if p["parent"] is None and n != "h2d_hidden"]
    per = {n: {p["rank"]: p["median_ms"] for p in doc["phases"][n]["per_rank"]} for n in top}
    vals = [rank["step_ms"]["median"], rank["step_ms"]["p90"], rank["own_ms"]["median"],
            rank["wait_ms"]["median"], *[per[n].get(rank["rank"]) for n in top]]
    return [f"{v:.2f}" for v in vals]


def test_piped_output_keeps_every_number_whole(run_dir: Path) -> None:
    doc = json.loads(_cli("report", str(run_dir), "--json"))
    out = _cli("report", str(run_dir))  # stdout is a pipe, COLUMNS unset
    assert "…" not in out
    rows = _rank_rows(out)
    assert sorted(rows) == [r["rank"] for r in doc["ranks"]]
    for r in doc["ranks"]:
        assert rows[r["rank"]] == _expected(doc, r), r["rank"]
    assert max(len(line) for line in out.splitlines()) > 100  # wider than the old 80 cut
    assert "optimizer_step_and_zero_grad" in out


def test_narrow_terminal_drops_columns_not_digits(run_dir: Path) -> None:
    doc = json.loads(_cli("report", str(run_dir), "--json"))
    out = _cli("report", str(run_dir), columns="70")
    assert max(len(line) for line in out.splitlines()) <= 70
    assert "not shown at this width" in out
    rows = _rank_rows(out)
    for r in doc["ranks"]:
        shown = rows[r["rank"]]
        assert shown and shown == _expected(doc, r)[: len(shown)]  # leading columns, whole


def test_windows_list_their_captures(run_dir: Path, tmp_path: Path) -> None:
    doc = json.loads(_cli("report", str(run_dir), "--json"))
    w = next(w for w in doc["windows"] if w["start_step"] <= 35 <= w["end_step"])
    assert w["captures"] == [0]
    out = _cli("report", str(run_dir))
    window_table = out.split("Slow step windows", 1)[1].split("Auto-profile", 1)[0]
    assert "captures" in window_table and "step 35 r2 (captured)" in window_table
    md = tmp_path / "s.md"
    _cli("report", str(run_dir), "--markdown", str(md))
    section = md.read_text().split("## Slow step windows", 1)[1].split("##", 1)[0]
    assert "| captures |" in section and "step 35 r2 (captured)" in section
