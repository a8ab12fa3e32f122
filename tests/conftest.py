"""Shared fixtures: tracers writing to memory or to tmp dirs, and the shared trace folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepscope.clock import CpuClock
from stepscope.config import Config
from stepscope.sinks import MemorySink
from stepscope.tracer import Tracer

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture
def mem_tracer():
    """Factory: ``mem_tracer(**config_kwargs, model=..., optimizer=..., clock=...)``."""
    made: list[Tracer] = []

    def make(model=None, optimizer=None, clock=None, **cfg):
        cfg.setdefault("out_dir", "unused")
        sink = MemorySink()
        tracer = Tracer(
            Config(**cfg), model=model, optimizer=optimizer, clock=clock or CpuClock(), sink=sink
        )
        tracer.sink = sink  # type: ignore[attr-defined]
        made.append(tracer)
        return tracer

    yield make
    for t in made:
        t.finish()
