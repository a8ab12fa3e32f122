"""Run data cannot drive the terminal or inject markdown.

Every name a run or trace carries (op and group names, hosts, phases, run ids, paths, crash
messages, kernel names) goes through one escaper per format: terminal control sequences
(ESC/CSI/OSC, C1, BEL, backspace, CR) are shown as text, rich markup prints as text, and
markdown keeps its tables and gets no raw HTML or links.
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.text import Text
from synth_collectives import CollRun, make_records, write

from stepscope.cli import main
from stepscope.common import escape

# Clear screen, set the window title, an OSC 8 hyperlink, a one-byte C1 CSI, BEL, backspace,
# CR, rich markup (balanced, unbalanced, a link), markdown/HTML injection, a line separator.
ATTACK = ("\x1b[2J\x1b[H\x1b]0;pwned\x07\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"
          "\x9b31m\x08\x08\rX\x00\x7f[bold]B[/bold][/][link=http://evil.example]L[/link]"
          "|<script>alert(1)</script>[a](javascript:alert(1))<javascript:alert(2)>\u2028\u202eZ")
OP = "all_gather" + ATTACK
PG = "pg" + ATTACK
PHASE = "forward" + ATTACK
HOST = "node" + ATTACK

#: Control characters that a terminal obeys (newline and tab excepted: rich prints those).
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e]")


def _no_control(text: str) -> None:
    bad = RAW_CONTROL.findall(text)
    assert not bad, f"raw control characters reached the output: {sorted(set(map(repr, bad)))}"


def _md_safe(md: str) -> None:
    _no_control(md)
    assert "\r" not in md
    text = re.sub(r"(?<!\\)(`+)(?!`).*?(?<!`)\1(?!`)", "", md)  # code spans are literal text
    assert not re.search(r"(?<!\\)<\s*script", text, re.I), "raw <script> in markdown"
    assert not re.search(r"(?<!\\)\]\(\s*javascript:", text, re.I), "a javascript: link in markdown"
    assert not re.search(r"(?<!\\)<javascript:", text, re.I), "a javascript: autolink in markdown"
    for block in (b for b in md.split("\n\n") if b.lstrip().startswith("|")):
        rows = [re.split(r"(?<!\\)\|", ln.strip())[1:-1] for ln in block.splitlines() if ln.startswith("|")]
        assert len({len(r) for r in rows}) == 1, f"a data cell broke the table:\n{block}"


def _coll_run(root: Path, seed: int = 0, extra_ms: float = 0.0) -> Path:
    prog = [("open", "dataloader"), ("work", "dataloader", 1.5), ("close", "dataloader"),
            ("open", PHASE), ("coll", PHASE, OP, PG, 4 << 20, 0.4), ("work", PHASE, 6.0 + extra_ms),
            ("close", PHASE), ("open", "backward"), ("work", "backward", 9.0),
            ("coll", "backward", OP, PG, 4 << 20, 0.4), ("close", "backward")]
    recs = make_records(CollRun(program=prog, ranks=2, steps=40, seed=seed))
    for rows in recs.values():
        for r in rows:
            r["hostname"] = HOST
            r["run_id"] = "run" + ATTACK
    return write(root, recs)


@pytest.mark.parametrize("s", [ATTACK, "\x1b]8;;x\x1b\\", "\x9b2J", "a\rb", "\x07", "[link=x]y[/link]",
                               "[/]"])
def test_the_terminal_escaper_is_inert_and_keeps_the_text_visible(s: str) -> None:
    out = escape.term(s)
    _no_control(out)
    if "\x1b" in s:
        assert "\x1b" not in out and "\\x1b" in out  # shown as text
    printed = Text.from_markup(f"[bold]{escape.rich(s)}[/]").plain  # never a MarkupError
    _no_control(printed)
    assert printed == escape.term(s)


def test_report_terminal_json_and_markdown_with_names_carrying_markup(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = _coll_run(tmp_path / "run")
    assert main(["report", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ops = (doc.get("collectives") or {}).get("ops") or []
    assert any(o["op"] == OP and o["pg"] == PG for o in ops), "the fixture must reach the collectives table"
    assert main(["report", str(run)]) == 0  # no MarkupError
    out = capsys.readouterr().out
    _no_control(out)
    assert "[link=http://evil.example]L[/link]" in out  # markup printed as text
    md_path = tmp_path / "report.md"
    assert main(["report", str(run), "--markdown", str(md_path)]) == 0
    capsys.readouterr()
    md = md_path.read_text()
    assert "## Collectives" in md
    _md_safe(md)


def test_collectives_section_renders_data_as_text(tmp_path: Path) -> None:
    from stepscope.report.collective_view import markdown_lines, print_terminal

    doc = {"collectives": {"source": "collectives", "wait_rule": "w", "ops": [
        {"op": OP, "pg": PG, "pg_size": 2, "ranks": 2, "phases": [PHASE, "a|b"], "calls_per_step": 1.0,
         "bytes_per_step": 1e6, "ms_per_step": 1.0, "wait_ms_per_step": 0.5, "wait_share": 0.5,
         "bus_gbps": 1.0}]}}
    buf = io.StringIO()
    print_terminal(doc, Console(file=buf, width=4000, color_system=None))
    _no_control(buf.getvalue())
    _md_safe("\n".join(markdown_lines(doc)))


def test_compare_terminal_and_markdown_with_names_carrying_markup(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    a = _coll_run(tmp_path / "a" / ("dir" + ATTACK.replace("/", "_").replace("\x00", "")))
    b = _coll_run(tmp_path / "b", seed=1, extra_ms=3.0)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    _no_control(out)
    assert "[bold]B[/bold]" in out
    md_path = tmp_path / "cmp.md"
    assert main(["compare", str(a), str(b), "--json", "--markdown", str(md_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert any(p["name"] == PHASE for p in doc["phases"])
    _md_safe(md_path.read_text())


def _beat(rank: int, **over: Any) -> dict[str, Any]:
    now = time.time()
    beat = {"kind": "stepscope-heartbeat", "schema": 1, "run_id": "r" + ATTACK, "rank": rank,
            "world_size": 2, "host": HOST, "pid": 999_999_99, "interval_s": 1.0,
            "updated_unix": now, "state": "running", "step": 7, "in_step": True,
            "phase_stack": [PHASE, OP], "step_since_unix": now - 100, "in_phase_s": 100.0,
            "last_step": 6, "last_step_s": 0.1, "collective": {"op": OP}}
    beat.update(over)
    return beat


def test_status_terminal_with_heartbeats_carrying_markup(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank1.stacks.txt").write_text(
        "# main thread: 0x0000000000000001\nThread 0x0000000000000001 (most recent call first):\n"
        f'  File "/x{ATTACK}.py", line 1 in f\n')
    (run / "rank0.status.json").write_text(json.dumps(_beat(0, step=8, phase_stack=["data" + ATTACK],
                                                            collective=None)))
    (run / "rank1.status.json").write_text(json.dumps(_beat(
        1, state="crashed", error={"type": "Error" + ATTACK, "message": "boom" + ATTACK, "step": 7,
                                   "phase_stack": [PHASE], "where": "step", "unix": time.time()},
        stacks={"path": "rank1.stacks.txt"})))
    assert main(["status", str(run)]) == 0  # no MarkupError
    out = capsys.readouterr()
    _no_control(out.out)
    _no_control(out.err)
    assert "[link=http://evil.example]L[/link]" in out.out
    assert main(["status", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    _no_control(captured.err)
    doc = json.loads(captured.out)
    assert doc["culprit"]["rank"] == 1 and doc["culprit"]["stack_top"]


def test_trace_terminal_with_a_kernel_name_carrying_markup(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def x(name: str, cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": args.get("stream", 1),
                "ts": ts, "dur": dur, "args": args}

    events = [x("ProfilerStep#1", "user_annotation", 0, 300),
              x("cudaLaunchKernel", "cuda_runtime", -10, 1, correlation=1),
              x("kern" + ATTACK, "kernel", 0, 100, stream=7, correlation=1),
              x("nccl:" + OP, "kernel", 120, 50, stream=8, correlation=2)]
    t = tmp_path / "t.json"
    t.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    md_path = tmp_path / "t.md"
    assert main(["trace", str(t), "--markdown", str(md_path)]) == 0
    out = capsys.readouterr()
    _no_control(out.out)
    _no_control(out.err)
    _md_safe(md_path.read_text())
