"""Benchmark records and the page rendered from them stay in step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import paths  # tests/support: where the repository is
import pytest

ROOT = paths.ROOT
sys.path.insert(0, str(ROOT / "benchmarks"))

import _results  # noqa: E402
import render_results  # noqa: E402


def test_docs_benchmarks_page_is_rendered_from_the_records() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == render_results.render(), "run: python benchmarks/render_results.py"


def test_every_record_has_the_fields_and_names_its_command() -> None:
    records = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert records
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for p in records:
        r = json.loads(p.read_text(encoding="utf-8"))
        assert set(_results.FIELDS) <= set(r), p.name
        assert p.stem == r["benchmark"]
        assert r["command"].split()[0] in {"python", "make", "bash", "pytest", "stepscope"}, p.name
        assert isinstance(r["figures"], dict) and r["figures"], p.name
        assert f"Command: `{r['command']}`" in page


def test_a_new_record_shows_on_the_page_with_its_command(tmp_path: Path) -> None:
    rec = _results.make_record("probe", "python benchmarks/probe.py --x 1", {"a_us": 1.5, "b": {"c": 2}})
    path = _results.write_record(rec, tmp_path)
    assert path.name == "probe.json"
    text = render_results.render(tmp_path)
    assert "Command: `python benchmarks/probe.py --x 1`" in text
    assert "| a_us | 1.5 |" in text and "| b / c | 2 |" in text


def test_a_record_without_figures_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="figures"):
        _results.make_record("probe", "python x.py", {})


def test_record_flag_writes_what_the_script_printed(tmp_path: Path) -> None:
    script = tmp_path / "bench.py"
    script.write_text('import json; print(json.dumps({"benchmark": "tiny", "x_us": 3}))\n')
    out = tmp_path / "results"
    rc = _results.record_run(str(script), ["--record", str(out)])
    assert rc == 0
    r = json.loads((out / "tiny.json").read_text())
    assert r["figures"] == {"benchmark": "tiny", "x_us": 3}
    assert r["command"].startswith("python ") and r["command"].endswith("bench.py")


def test_render_check_passes_on_the_committed_page() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_results.py"), "--check"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
