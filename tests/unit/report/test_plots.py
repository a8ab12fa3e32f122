"""Plots: a warm-up outlier cannot set the colour scale; every figure is written and sane."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from synth_runs import Slow, SynthRun, write_run

from stepscope.analysis.heatmaps import plot_data
from stepscope.analysis.run import open_analyzed_run
from stepscope.report import plots


@pytest.fixture(scope="module")
def doc_with_data(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    # Step 0 is a 400 ms warm-up on every rank; rank 2's dataloader is 12 ms slow in 40-59.
    spec = SynthRun(ranks=4, steps=120, slow=(
        *(Slow(r, "forward", 400.0, 0, 0) for r in range(4)), Slow(2, "dataloader", 12.0, 40, 59)))
    run = open_analyzed_run(write_run(tmp_path_factory.mktemp("p") / "run", spec))
    yield run
    run.close()


def test_colour_scale_ignores_warmup_and_shows_the_window(doc_with_data) -> None:  # type: ignore[no-untyped-def]
    pd = plot_data(doc_with_data.doc, doc_with_data.data)
    sc = pd.scale["step_ms"]
    first = pd.step_ms[0][0]
    assert first is not None and first > 300  # the warm-up step is in the data ...
    assert sc.hi < 100 and sc.warmup >= 1  # ... but not in the scale
    row = dict(zip(pd.steps, pd.phase_ms[2], strict=True))
    psc = pd.scale["phase_ms"]
    # The slow window's cells reach the top half of the dataloader scale.
    assert row[50] is not None and row[50] >= psc.lo + 0.5 * (psc.hi - psc.lo)
    assert "warm-up" in plots.scale_note(sc) and "p99" in plots.scale_note(sc)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", head[16:24])
    return int(w), int(h)


def test_every_figure_written_with_sane_size(doc_with_data, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    pd = plot_data(doc_with_data.doc, doc_with_data.data)
    assert pd.stragglers == [2] and pd.windows
    files = plots.write_pngs(pd, tmp_path, "s")
    assert sorted(p.name for p in files) == ["s_heatmap_phase.png", "s_heatmap_step.png",
                                             "s_phases.png", "s_series.png"]
    for p in files:
        size = p.stat().st_size
        assert 8_000 < size < 400_000, (p.name, size)
        w, h = _png_size(p)
        assert 600 <= w <= 1600 and 200 <= h <= 1200, (p.name, w, h)
