"""Data cannot become markup: rich tags, markdown table cells and HTML script in every renderer."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.text import Text
from synth_runs import Slow, SynthRun, write_run

from stepscope.cli import main
from stepscope.common import escape

HOSTILE = ["[/]", "[bold]x[/bold]", "a|b", "line\nbreak", "`tick`", "<img src=x>", "[red", "\\[/]"]


@pytest.mark.parametrize("s", HOSTILE)
def test_rich_escape_prints_the_text_itself(s: str) -> None:
    assert Text.from_markup(f"[bold]{escape.rich(s)}[/]").plain == s


@pytest.mark.parametrize("s", HOSTILE)
def test_md_cell_is_one_cell_on_one_line(s: str) -> None:
    cell = escape.md(s)
    assert "\n" not in cell
    # every '|' left in the cell is escaped, so a table row keeps its column count
    assert not re.search(r"(?<!\\)\|", cell)
    assert not re.search(r"(?<!\\)`", cell)
    code = escape.md_code(s)
    assert "\n" not in code and not re.search(r"(?<!\\)\|", code)


def test_json_for_script_cannot_close_the_element() -> None:
    data = {"name": "</script><script>alert(1)</script>", "x": float("nan"), "s": "\u2028&"}
    text = escape.json_for_script(data)
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    # U+2028, like every control or format character, is written out as text for the page.
    assert json.loads(text) == {"name": data["name"], "x": None, "s": "\\u2028&"}


PHASE = "fwd[/]|x\n[bold]y"
HOST = "node[/]|h\nz"


def _hostile_run(root: Path) -> Path:
    """A synthetic run whose phase name, hostname and a trigger reason hold markup."""
    run = write_run(root, SynthRun(ranks=3, steps=60, slow=(Slow(1, "forward", 30.0, 20, 40),)))
    for f in run.glob("rank*.jsonl"):
        recs = [json.loads(line) for line in f.read_text().splitlines()]
        for r in recs:
            r["hostname"] = HOST
            for p in r["phases"]:
                if p["name"] == "forward":
                    p["name"] = PHASE
        f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "triggers.jsonl").write_text(json.dumps(
        {"trigger_step": 25, "rank": 1, "role": "affected", "status": "captured",
         "reason": "slow [/] step | x\ny", "trace": None}) + "\n")
    return run


def _table_rows(md: str) -> list[list[str]]:
    """Rows of every markdown table, split on unescaped pipes."""
    return [re.split(r"(?<!\\)\|", line.strip())[1:-1]
            for line in md.splitlines() if line.startswith("|")]


def test_terminal_and_markdown_with_names_carrying_markup(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = _hostile_run(tmp_path / "run")
    assert main(["report", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert PHASE in doc["phases"], "the fixture must put the hostile name into the report"
    assert doc["stragglers"] and doc["stragglers"][0]["phase"] == PHASE

    from stepscope.analysis.run import analyze_run
    from stepscope.report.terminal import render_terminal

    buf = io.StringIO()
    render_terminal(analyze_run(run), Console(file=buf, width=400, color_system=None))
    out = buf.getvalue()
    flat = escape.one_line(PHASE)
    assert flat in out and escape.one_line(HOST) in out  # printed literally, not as markup
    assert "slow [/] step | x y" in out  # the trigger reason, in the captures table

    md_path = tmp_path / "summary.md"
    assert main(["report", str(run), "--markdown", str(md_path)]) == 0
    md = md_path.read_text()
    # every data row of each table has as many cells as its header
    tables = [b for b in md.split("\n\n") if b.startswith("|")]
    assert tables
    for block in tables:
        widths = {len(r) for r in _table_rows(block)}
        assert len(widths) == 1, block
    assert "fwd\\[/\\]\\|x \\[bold\\]y" in md


def _trace(path: Path, kernel: str, label: str) -> Path:
    def x(name: str, cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": args.get("stream", 1),
                "ts": ts, "dur": dur, "args": args}

    events = [x(label, "user_annotation", 0, 300),
              x("cudaLaunchKernel", "cuda_runtime", -10, 1, correlation=1),
              x(kernel, "kernel", 0, 100, stream=7, correlation=1)]
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def test_trace_terminal_and_markdown_with_names_carrying_markup(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    kernel = "evil[/]kern|el\n[bold]"
    label = "ProfilerStep#1"
    t = _trace(tmp_path / "t.json", kernel, label)
    md_path = tmp_path / "summary.md"
    assert main(["trace", str(t), "--markdown", str(md_path)]) == 0
    out = capsys.readouterr().out
    assert "evil[/]kern|el [bold]" in out
    md = md_path.read_text()
    for block in (b for b in md.split("\n\n") if b.startswith("|")):
        assert len({len(r) for r in _table_rows(block)}) == 1, block
    assert "evil[/]kern\\|el [bold]" in md


def test_report_json_is_valid_with_non_finite_numbers(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from stepscope.report.render import public

    doc = {"run": {"x": float("nan"), "skipped": []}, "y": [float("inf"), 1.0], "_data": None}
    text = json.dumps(escape.finite(public(doc)), allow_nan=False)
    assert json.loads(text) == {"run": {"x": None, "skipped": []}, "y": [None, 1.0]}
