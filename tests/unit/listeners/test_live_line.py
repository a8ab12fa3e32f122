"""The live line: printed exactly every N steps, and through tqdm while a tqdm bar is open."""

from __future__ import annotations

import io
import re
import time

import pytest


def _steps(tracer, n: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(n):
        with tracer.step(), tracer.phase("dataloader"):
            time.sleep(0.001)


def test_line_exactly_every_n_steps(mem_tracer) -> None:  # type: ignore[no-untyped-def]
    # Exchange cadence (7) differs from the log cadence (5): lines must still come every 5.
    tracer = mem_tracer(log_every_n_steps=5, flush_every_n_steps=7)
    view = tracer.live
    _steps(tracer, 43)
    tracer.finish()
    cadence = [ln for ln in view.lines if "(final)" not in ln]
    steps = [int(re.match(r"stepscope step (\d+) ", ln).group(1)) for ln in cadence]  # type: ignore[union-attr]
    assert steps == list(range(4, 43, 5))  # steps 4, 9, ..., 39 (0-based): every 5th, none skipped
    for ln in cadence:  # every line either has numbers or says why it has none
        assert "ranks" in ln or "no cross-rank numbers yet" in ln


def test_line_goes_through_tqdm_when_a_bar_is_open(mem_tracer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tqdm = pytest.importorskip("tqdm")
    written: list[str] = []
    monkeypatch.setattr(tqdm.tqdm, "write", classmethod(lambda cls, s, file=None, end="\n", nolock=False:
                                                           written.append(s)))
    tracer = mem_tracer(log_every_n_steps=5, flush_every_n_steps=5)
    view = tracer.live
    view._console.file = io.StringIO()  # what the console would print directly
    bar = tqdm.tqdm(total=20, file=io.StringIO())
    try:
        _steps(tracer, 20)
        tracer.finish()  # drains the writer: every line is printed while the bar is open
    finally:
        bar.close()
    assert len(written) >= 4 and all(w.startswith("stepscope step") for w in written)
    assert view._console.file.getvalue() == ""  # nothing printed around the bar


def test_phase_name_with_markup_prints_literally() -> None:
    from rich.text import Text

    from stepscope.listeners.live import format_line

    s = {"step": 9, "ranks": 2, "world_size": 2, "step_ms_median": 10.0, "step_ms_max": 12.0,
         "step_ms_max_rank": 1, "slowest_rank": 1, "slowest_phase": "load[/]\\[bold]x",
         "slowest_phase_ms": 5.0, "slowest_phase_excess_ms": 2.0, "h2d_share": 0.1,
         "dataloader_share": 0.2}
    assert "r1: load[/]\\[bold]x 5.0 ms" in Text.from_markup(format_line(s)).plain
