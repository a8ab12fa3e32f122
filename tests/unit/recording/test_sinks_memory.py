"""What the recording side holds does not grow with the number of steps.

Memory is measured with ``tracemalloc`` (what Python allocated and still holds), not RSS,
which the allocator and the load of the machine make noisy. Two cases: a writer that keeps
up holds nothing per step once its records are written; a writer that cannot keep up (a
slow file system, or a loop of tiny steps that outruns it) holds at most a bounded number of
steps, and what it could not hold is counted as lost, never silently.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest

from stepscope.common.errors import StepscopeWarning
from stepscope.recording.config import Config
from stepscope.recording.schema import read_run
from stepscope.recording.sinks import JsonlSink
from stepscope.tracer import Tracer

MB = 1 << 20


def _steps(tr: Tracer, n: int, settle_every: int = 0) -> None:
    for i in range(n):
        with tr.step(tokens=8), tr.phase("compute"):
            pass
        if settle_every and i % settle_every == 0:
            tr.settle(10)  # the writer keeps up, however loaded the machine


def _settle(tr: Tracer) -> None:
    """Every record handed over and written (the writer may lag on a loaded machine)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        tr.settle(10)
        if tr.resolver.ready_count() == 0 and tr._outbox.writer.is_idle():
            break
        time.sleep(0.05)
    gc.collect()


def test_a_writer_that_keeps_up_holds_nothing_per_step(tmp_path: Path) -> None:
    tr = Tracer(Config(out_dir=str(tmp_path), auto=False, heartbeat_s=0))
    _steps(tr, 5_000, settle_every=2_000)
    _settle(tr)
    tracemalloc.start(1)
    try:
        before = tracemalloc.get_traced_memory()[0]
        _steps(tr, 10_000, settle_every=2_000)
        _settle(tr)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    tr.finish()
    assert len(read_run(tmp_path)) == 15_000
    assert grown < 1 * MB, f"{grown / MB:.1f} MB held after 10,000 more steps"


class _SlowSink(JsonlSink):
    """A file system that takes 20 ms per write: the loop outruns the writer for good."""

    def write(self, records: Any) -> None:
        time.sleep(0.02)
        super().write(records)


def test_a_writer_that_falls_behind_holds_a_bounded_number_of_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("stepscope.recording.sinks.MAX_QUEUED_STEPS", 512, raising=False)  # a short test
    monkeypatch.setattr("stepscope.recording.outbox.MAX_HELD_STEPS", 256)
    # A hand-over at every step end: what is held between two hand-overs is then one step, not
    # however many steps the machine runs in 0.1 s (a fast or a loaded host moved it by MBs).
    monkeypatch.setattr("stepscope.recording.outbox.HANDOVER_EVERY_S", 0.0)
    cfg = Config(out_dir=str(tmp_path), auto=False, heartbeat_s=0)
    tr = Tracer(cfg, sink=_SlowSink(tmp_path, 0))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _steps(tr, 2_000)
        tracemalloc.start(1)
        try:
            before = tracemalloc.get_traced_memory()[0]
            _steps(tr, 20_000)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        tr.finish()
    # 512 queued, 256 held and one batch being built: ~800 steps of ~1 KB (0.75 MB measured); all
    # 20,000 held was ~16 MB.
    assert grown < 3 * MB, f"{grown / MB:.1f} MB held by a writer behind its queue"
    recs = read_run(tmp_path)
    lost = sum(int((r.get("dropped") or {}).get("writer_queue_full", 0)) for r in recs)
    assert lost > 0 and len(recs) + lost == 22_000  # nothing lost silently
    assert [w for w in said if issubclass(w.category, StepscopeWarning) and "behind" in str(w.message)]
