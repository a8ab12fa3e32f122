"""The CLI renderings of a run: --json, --markdown (+PNGs), --html, and the Perfetto export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from synth_runs import Slow, SynthRun, write_run

from stepscope.cli import main
from stepscope.report import plots


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = SynthRun(ranks=4, hosts=2, host_offset_ms=25.0, steps=80,
                    slow=(Slow(2, "dataloader", 12.0, 30, 49),))
    return write_run(tmp_path_factory.mktemp("r") / "run", spec)


def test_cli_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(run_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["rank"], s["phase"]) for s in doc["stragglers"]] == [(2, "dataloader")]
    assert doc["windows"][0]["ranks"] == [2]


def test_cli_terminal(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "Verdicts" in out and "straggler" in out and "rank 2" in out


def test_markdown_with_plots(run_dir: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "out" / "summary.md"
    assert main(["report", str(run_dir), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "## Verdicts" in text and "| 2 |" in text and "dataloader" in text
    pngs = sorted(p.name for p in md.parent.glob("*.png"))
    assert pngs == ["summary_heatmap_phase.png", "summary_heatmap_step.png",
                    "summary_phases.png", "summary_series.png"]
    for name in pngs:
        assert f"]({name})" in text
        assert (md.parent / name).read_bytes()[:4] == b"\x89PNG"


def test_markdown_without_matplotlib(run_dir: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import stepscope.report.markdown as md_mod

    monkeypatch.setattr(md_mod, "have_matplotlib", lambda: False)
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    md = tmp_path / "summary.md"
    assert main(["report", str(run_dir), "--markdown", str(md)]) == 0
    assert "install matplotlib" in md.read_text()
    assert not list(tmp_path.glob("*.png"))


def test_html_is_self_contained(run_dir: Path, tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    assert main(["report", str(run_dir), "--html", str(page)]) == 0
    text = page.read_text()
    assert "<script src" not in text and "https://" not in text.split("<script>")[1]
    data = text.split('id="stepscope-data">')[1].split("</script>")[0]
    pd = json.loads(data)["plot"]
    assert pd["ranks"] == [0, 1, 2, 3] and pd["phase"] == "dataloader"
    assert len(pd["step_ms"]) == 4 and len(pd["step_ms"][0]) == len(pd["steps"])
    # The slow rank's dataloader cells inside the window stand out.
    row = dict(zip(pd["steps"], pd["phase_ms"][2], strict=True))
    assert row[40] > row[10] + 8.0


def test_perfetto_export(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert main(["export", str(run_dir), "--perfetto", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(names) == [0, 1, 2, 3] and "straggler: dataloader" in names[2]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in slices} >= {"dataloader", "h2d", "forward", "backward",
                                          "optimizer", "step 0"}
    # One aligned time base: backward of a step ends together on both hosts (offset removed).
    ends = [e["ts"] + e["dur"] for e in slices if e["name"] == "backward" and e["args"]["step"] == 10]
    assert len(ends) == 4 and max(ends) - min(ends) < 1000.0  # µs


def test_export_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "nope"), "--perfetto", str(tmp_path / "t.json")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_recording_side_does_not_import_analysis_deps() -> None:
    code = ("import sys, stepscope; bad = {'duckdb', 'matplotlib', 'rich'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_corrupt_triggers_file_is_reported_not_fatal(tmp_path):
    from stepscope.analysis.triggers import link_triggers

    (tmp_path / "triggers.jsonl").write_text(
        '{"trigger_step": 5, "rank": 1, "trace": "traces/missing.pt.trace.json.gz"}\nnot json\n'
    )
    windows = [{"start_step": 0, "end_step": 9}]
    triggers, skipped = link_triggers(tmp_path, windows)
    assert [t["rank"] for t in triggers] == [1] and triggers[0]["trace_summary"] is None
    assert windows[0]["captures"] == [0]
    assert any("line 2" in s for s in skipped) and any("missing" in s for s in skipped)
