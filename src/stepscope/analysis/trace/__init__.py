"""Kineto trace analysis: per-rank, per-step GPU time breakdown from torch.profiler traces.

A package: ``reader`` (bytes, bounds, head), ``events`` (the pass over events), ``intervals``,
``breakdown`` (per rank), ``comm_keys`` (a collective's cross-rank key), ``comm_kernels``
(collectives across ranks) and ``trace_verdicts`` (verdicts).
"""

from __future__ import annotations

import gc
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stepscope.analysis import kernels as K
from stepscope.analysis.trace.breakdown import Breakdown, CpuStep, RankResult, analyze_parsed
from stepscope.analysis.trace.captures import find_traces
from stepscope.analysis.trace.comm_kernels import cross_rank
from stepscope.analysis.trace.events import CpuOps, DeviceEvent, ParsedTrace, parse_trace
from stepscope.analysis.trace.intervals import Interval, intersect, merge
from stepscope.analysis.trace.reader import MAX_DEPTH, MAX_INFLATED_BYTES
from stepscope.analysis.trace.trace_verdicts import diagnose
from stepscope.common.errors import AnalysisError, StepscopeWarning

SCHEMA = "stepscope.trace/1"

__all__ = [
    "MAX_DEPTH",
    "MAX_INFLATED_BYTES",
    "SCHEMA",
    "Breakdown",
    "CpuOps",
    "CpuStep",
    "DeviceEvent",
    "Interval",
    "ParsedTrace",
    "RankResult",
    "TraceReport",
    "analyze_parsed",
    "analyze_trace",
    "cross_rank",
    "diagnose",
    "find_traces",
    "intersect",
    "iter_breakdowns",
    "merge",
    "parse_trace",
    "trace_files",
]



@dataclass
class TraceReport:
    """The analysis of one or more rank traces: the JSON contract of ``stepscope trace``."""

    schema: str
    taxonomy_version: str
    ranks: list[RankResult]
    cross_rank: dict[str, Any] | None
    diagnosis: list[dict[str, str]]
    warnings: list[str]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r in d["ranks"]:
            r.pop("collectives", None)
        return d


def trace_files(path: str | os.PathLike[str]) -> list[Path]:
    """The trace files at `path`: the file itself, the *.json / *.json.gz in a directory, or
    those of the newest capture folder below it (see :func:`find_traces`)."""
    return find_traces(path)[0]


def _analyse_file(path: str, max_bytes: int = MAX_INFLATED_BYTES) -> RankResult:
    # The pass builds hundreds of thousands of small objects and no reference cycles: the
    # cyclic collector's passes over them found nothing and cost 3-6% of the CPU (py-spy on
    # a 295 MB trace), so it is paused here and restored as it was.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return analyze_parsed(parse_trace(path, max_bytes))
    finally:
        if was_enabled:
            gc.enable()


def analyze_trace(path: str | os.PathLike[str], workers: int | None = None,
            max_bytes: int = MAX_INFLATED_BYTES) -> TraceReport:
    """Analyse a trace file or a directory of per-rank traces (ranks in parallel processes).

    ``max_bytes`` caps the JSON read from each file after gzip inflation; a file past it is
    analysed up to the cap, with a warning.
    """
    if max_bytes <= 0:
        raise AnalysisError(f"max_bytes must be positive, got {max_bytes}")
    files, notes = find_traces(path)
    if len(files) > 1 and (workers is None or workers > 1):
        # Imported here: it costs ~30 ms of CPU, a third of a 54 MB trace's own start-up,
        # and one file never needs it.
        from concurrent.futures import ProcessPoolExecutor

        n = min(len(files), workers or os.cpu_count() or 1)
        with ProcessPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(_analyse_file, [str(f) for f in files], [max_bytes] * len(files)))
    else:
        results = [_analyse_file(str(f), max_bytes) for f in files]
    warnings: list[str] = list(notes)
    ranks_seen: Counter[int] = Counter(r.rank for r in results)
    for rank, n in ranks_seen.items():
        if n > 1:
            warnings.append(f"rank {rank} appears in {n} files; ranks are shown per file")
    results.sort(key=lambda r: (r.rank, r.file))
    if all(r.total is None for r in results):
        warnings.append("no GPU activity in any trace: only CPU events were recorded")
    skipped = sum(r.skipped_events for r in results)
    if skipped:
        import warnings as _w


        _w.warn(f"stepscope trace: skipped {skipped} malformed event(s) in {path}; "
                "see the per-rank warnings", StepscopeWarning, stacklevel=2)
    cross = cross_rank(results) if len(results) > 1 else None
    return TraceReport(SCHEMA, K.TAXONOMY_VERSION, results, cross,
                       [v.to_trace_dict() for v in diagnose(results, cross)], warnings)


def iter_breakdowns(report: TraceReport) -> Iterator[tuple[int, Breakdown]]:
    """Every (rank, GPU step breakdown) pair, for renderers."""
    for r in report.ranks:
        for s in r.steps:
            if isinstance(s, Breakdown):
                yield r.rank, s
