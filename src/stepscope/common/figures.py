"""What the report's figures draw beyond the JSON document, as typed data the analysis makes.

:class:`PlotData` feeds the heat maps, bars and series (markdown PNGs, the HTML page);
:class:`Timeline` feeds the Perfetto export. The analysis builds them from the loaded run
(:mod:`stepscope.analysis.heatmaps`, :mod:`stepscope.analysis.timeline`); the command hands
them to the renderers, which never see the run's tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

#: One heat map: a row per shown rank, a cell per step bucket (None: no sample there).
Grid = list[list[float | None]]


@dataclass(frozen=True)
class ColorScale:
    """The scale of a heat map, robust to warm-up and outliers: cells of the first
    ``warmup`` sampled steps are ignored, ``hi`` is the ``pct`` percentile of the rest and
    ``clipped`` counts the cells above it (drawn in the top colour)."""

    lo: float
    hi: float
    clipped: int
    pct: float
    warmup: int


@dataclass(frozen=True)
class PlotData:
    """Everything the plots draw, steps bucketed and ranks subsampled (the field order is
    the order of the HTML page's JSON)."""

    ranks: list[int]
    #: First step of each bucket of ``bucket_width`` consecutive sampled steps.
    steps: list[int]
    bucket_width: int
    step_ms: Grid
    #: The phase worth a heat map (the top straggler's, else the biggest), its own time.
    phase: str
    phase_ms: Grid
    #: ``median`` and ``max`` over ranks of the step time, per bucket.
    series: dict[str, list[float]]
    #: Run-median ms per shown rank, per phase with a share of the step.
    bars: dict[str, list[float]]
    windows: list[dict[str, Any]]
    stragglers: list[int]
    warmup_steps: int
    #: The scales of ``step_ms`` and ``phase_ms``, by those names.
    scale: dict[str, ColorScale]


class Slice(NamedTuple):
    """One step of one rank (``name`` None) or one phase inside it; times in ms on the
    aligned timeline."""

    rank: int
    step: int
    start_ms: float
    dur_ms: float
    name: str | None
    parent: str | None


@dataclass(frozen=True)
class Timeline:
    """Every rank's slices in time order, a step before the phases in it and a top-level
    phase before its children (read while iterated: the run stays open until they are
    consumed); and the aligned start (ms) of each of the document's windows, in order."""

    slices: Iterator[Slice]
    window_start_ms: list[float]
