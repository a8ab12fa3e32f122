"""Compute HTA's temporal breakdown for the shared real traces, as a reference for the tests.

Run once, in a throwaway venv that has HTA (PyPI ``traceinsight``) installed, never in the
project's own venv::

    python3 -m venv hta-venv && hta-venv/bin/pip install traceinsight
    hta-venv/bin/python benchmarks/hta_reference.py --traces ../shared/traces \
        --write tests/fixtures/hta_reference.json

Prints one JSON line per (trace folder, rank, mode). ``include_last_profiler_step`` is run
both ways: HTA drops kernels launched in the last ProfilerStep by default, which makes its
window differ from "the whole trace"; with ``True`` it keeps every kernel launched up to the
end of the last step, which is what stepscope's whole-trace totals cover.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any


def _measure(trace_dir: Path, include_last: bool) -> list[dict[str, Any]]:
    from hta.trace_analysis import TraceAnalysis  # type: ignore[import-not-found]

    # HTA logs chattily to stdout/stderr; keep our one-JSON-line-per-measurement output clean.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        analysis = TraceAnalysis(
            trace_dir=str(trace_dir), include_last_profiler_step=include_last
        )
        df = analysis.get_temporal_breakdown(visualize=False)
        try:
            overlap = analysis.get_comm_comp_overlap(visualize=False)
            # HTA writes NaN for ranks without communication; JSON has no NaN, use null.
            overlap_by_rank = {
                int(r["rank"]): float(r["comp_comm_overlap_pctg"])
                for _, r in overlap.iterrows() if r["comp_comm_overlap_pctg"] == r["comp_comm_overlap_pctg"]
            }
        except Exception:  # HTA raises on traces without comm kernels; overlap is optional
            overlap_by_rank = {}
    rows = []
    for _, r in df.iterrows():
        rank = int(r["rank"])
        rows.append(
            {
                "trace": trace_dir.name,
                "rank": rank,
                "include_last_profiler_step": include_last,
                "idle_time_us": float(r["idle_time(us)"]),
                "compute_time_us": float(r["compute_time(us)"]),
                "non_compute_time_us": float(r["non_compute_time(us)"]),
                "kernel_time_us": float(r["kernel_time(us)"]),
                "comm_comp_overlap_pct": overlap_by_rank.get(rank),
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    default = Path(__file__).resolve().parents[2] / "shared" / "traces"
    p.add_argument("--traces", default=str(default))
    p.add_argument("--write", metavar="FILE", help="also write all rows as a JSON fixture")
    args = p.parse_args()
    logging.disable(logging.CRITICAL)
    # HTA rounds float (sub-µs) timestamps inward (ceil start, floor end), shrinking every
    # kernel by up to 2 µs; turn that off so both tools measure the same intervals.
    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    import hta  # type: ignore[import-not-found]

    version = getattr(getattr(hta, "version", None), "__version__", "unknown")
    rows: list[dict[str, Any]] = []
    for d in sorted(Path(args.traces).iterdir()):
        if not d.is_dir():
            continue
        for include_last in (False, True):
            try:
                got = _measure(d, include_last)
            except Exception as e:  # a trace HTA itself cannot analyze is recorded, not fatal
                got = [{"trace": d.name, "include_last_profiler_step": include_last,
                        "error": f"{type(e).__name__}: {e}"[:300]}]
            for row in got:
                print(json.dumps(row), flush=True)
            rows.extend(got)
    if args.write:
        doc = {"tool": "HolisticTraceAnalysis (PyPI traceinsight)", "version": version,
               "unit": "us", "env": {"HTA_DISABLE_NS_ROUNDING": "1"}, "rows": rows}
        Path(args.write).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
