"""A report that agrees with itself: advice follows the measured split, every large goodput loss
has a finding, and the units follow the clock."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import paths  # tests/support: where the repository is
import pytest
from synth_runs import SynthRun, write_run

from stepscope.analysis import cost
from stepscope.analysis.diagnose import diagnose, explain_goodput
from stepscope.analysis.run import analyze_run
from stepscope.analysis.verdict import Verdict


@pytest.fixture(scope="module")
def clean_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return analyze_run(write_run(tmp_path_factory.mktemp("c") / "run", SynthRun(ranks=2, steps=40)))


def _goodput(productive: float, **lost: float) -> dict[str, Any]:
    cats = dict.fromkeys(("stragglers", "exposed_comm", "input_stalls", "host_overhead", "warmup",
                          "outside_steps", "restarts"), 0.0)
    cats.update(lost)
    return {"gpu_hours": 1.0, "productive_gpu_hours": productive, "goodput": productive,
            "lost_gpu_hours": cats}


def _diagnose(doc: dict[str, Any], gp: dict[str, Any]) -> list[Verdict]:
    d = copy.deepcopy(doc)
    return diagnose(d["run"], d["phases"], d["ranks"], d["stragglers"], d["windows"], gp)


def test_no_compute_advice_when_exposed_communication_is_the_largest_part(
        clean_doc: dict[str, Any]) -> None:
    """A backward that is mostly all-reduce: 65% of the time exposed communication, 20%
    compute. The advice is the communication's, never "mixed precision, torch.compile"."""
    verdicts = _diagnose(clean_doc, _goodput(0.20, exposed_comm=0.65, stragglers=0.05,
                                             input_stalls=0.05, host_overhead=0.05))
    kinds = [v.kind for v in verdicts]
    assert "compute_bound" not in kinds, kinds
    (c,) = [v for v in verdicts if v.kind == "comm_bound"]
    assert c.severity == "info" and "exposed communication 65%" in c.evidence, c
    assert "no_sync" in c.suggestion and "torch.compile" not in c.suggestion
    assert c.cost["share_of_wall"] == pytest.approx(0.65, abs=0.02), c.cost
    assert not any("mixed precision" in v.suggestion for v in verdicts)
    # Where compute is the largest part, the compute advice stands, with the split.
    verdicts = _diagnose(clean_doc, _goodput(0.80, exposed_comm=0.10))
    (b,) = [v for v in verdicts if v.kind == "compute_bound"]
    assert "compute 80%, exposed communication 10%" in b.evidence, b.evidence
    assert "comm_bound" not in [v.kind for v in verdicts]


def test_a_large_goodput_loss_always_has_a_finding(clean_doc: dict[str, Any]) -> None:
    run = clean_doc["run"]
    gp = _goodput(0.55, outside_steps=0.30, exposed_comm=0.15)
    verdicts = cost.fold(_diagnose(clean_doc, gp))
    added = explain_goodput(run, verdicts, gp)
    assert sorted(v.subject for v in added) == ["time lost to exposed_comm",
                                                  "time lost to outside_steps"], added
    assert all(v.severity == "info" and v.cost["lost_ms"] > 0 for v in added)
    (o,) = [v for v in added if v.subject.endswith("outside_steps")]
    assert o.evidence.startswith("30% of the time the job held went to time between steps")
    # A finding of its kind accounts for it: nothing added.
    comm = Verdict(kind="comm_bound", severity="info", evidence="", suggestion="")
    assert explain_goodput(run, [*verdicts, comm],
                           _goodput(0.85, exposed_comm=0.15)) == []
    # Under a tenth: no note.
    assert explain_goodput(run, verdicts, _goodput(0.91, outside_steps=0.09)) == []
    # The headline of a quiet run says where the time went, not "No costly finding".
    text = cost.headline(run, verdicts + added, gp)
    assert text.startswith("No fault found") and "goodput 55%" in text, text
    assert "time outside steps (30% of the time held, see goodput_loss)" in text, text
    assert cost.headline(run, verdicts, _goodput(0.95, exposed_comm=0.05)).startswith(
        "No costly finding")


@pytest.mark.parametrize(("clock", "unit", "other"), [("cpu", "CPU-", "GPU"), ("cuda", "GPU-", "CPU")])
def test_goodput_units_follow_the_clock(clean_doc: dict[str, Any], clock: str, unit: str,
                                        other: str) -> None:
    from rich.console import Console

    from stepscope.report import goodput_view as render

    doc = copy.deepcopy(clean_doc)
    doc["run"]["clock"] = clock
    out = io.StringIO()
    render.render_terminal(doc, Console(file=out, width=200, color_system=None))
    text = out.getvalue() + "\n".join(render.markdown_lines(doc))
    assert unit in text and other not in text, text


def test_clean_recorded_run_reads_cpu_seconds(tmp_path: Path) -> None:
    import shutil

    from rich.console import Console

    from stepscope.report import terminal

    run = tmp_path / "clean"
    shutil.copytree(paths.FIXTURES / "busy_clean_a", run)
    doc = analyze_run(run)
    out = io.StringIO()
    terminal.render_terminal(doc, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "CPU-s" in text and "GPU-s" not in text and "GPU-h" not in text
    assert "No costly finding" not in text  # goodput lost 39% here: the headline says to what
