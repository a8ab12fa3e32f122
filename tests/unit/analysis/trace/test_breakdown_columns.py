"""The breakdown's column form gives what the event-by-event form gave: ties in start time
keep file order, categories appear in first-seen order, a kernel name seen under two
categories is reported with the last one, copies are summed in event order."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from stepscope.analysis import kernels as K
from stepscope.analysis.trace import analyze_parsed, parse_trace


def _ev(name: str, cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
            "args": {"stream": 7, **args}}


def _trace(tmp_path: Path) -> Path:
    ev: list[dict[str, Any]] = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 500,
         "pid": 0, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 500, "dur": 500,
         "pid": 0, "tid": 1},
    ]
    for i in range(40):
        t = 10.0 + 23.5 * i
        ev.append(_ev("ampere_sgemm_128x64_nn", "kernel", t, 7.25, correlation=i))
        ev.append(_ev("vectorized_elementwise_kernel", "kernel", t, 3.5))  # same start
        if i % 5 == 0:
            ev.append(_ev("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", t + 8, 1.125,
                          bytes=4096 * (i + 1)))
            ev.append(_ev("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", t + 9.5, 0.5,
                          bytes=100))
        if i % 7 == 0:  # one name under two categories: the last one is reported
            ev.append(_ev("ncclDevKernel_AllReduce_Sum_f32", "kernel", t + 12, 2.0))
            ev.append(_ev("odd_name", "gpu_memset" if i < 20 else "kernel", t + 15, 0.75))
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5,
               "dur": 1, "pid": 0, "tid": 1, "args": {"correlation": 3}})
    p = tmp_path / "rank0.pt.trace.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    return p


def _reference(pt: Any, w0: int, w1: int) -> tuple[dict[str, float], int, int, int]:
    ev = sorted(pt.device_events, key=lambda d: d.start)
    cats: dict[str, float] = defaultdict(float)
    kcount = h2d = h2d_bytes = 0
    for d in ev:
        if not w0 <= d.start < w1:
            continue
        cats[d.category] += d.end - d.start
        if d.category != K.MEMORY:
            kcount += 1
        elif d.copy_kind == "HtoD":
            h2d += 1
            h2d_bytes += d.nbytes
    return dict(cats), kcount, h2d, h2d_bytes


def test_columns_equal_event_by_event(tmp_path: Path) -> None:
    pt = parse_trace(_trace(tmp_path))
    r = analyze_parsed(pt)
    assert len(r.steps) == 2
    for s in r.steps:
        w0 = round(s.start_us * 1000)
        cats, kcount, h2d, h2d_bytes = _reference(pt, w0, w0 + round(s.wall_us * 1000))
        assert list(s.by_category_us) == [c for c, _ in sorted(cats.items(), key=lambda x: -x[1])]
        assert s.by_category_us == {c: round(v / 1000.0, 3) for c, v in cats.items()}
        assert (s.kernel_count, s.h2d_count, s.h2d_bytes) == (kcount, h2d, h2d_bytes)
        assert s.h2d_count > 0 and s.kernel_count > 0
    # Top kernels: totals, counts, and the category of a name's last event.
    ev = sorted(pt.device_events, key=lambda d: d.start)
    names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    last_cat: dict[str, str] = {}
    for d in ev:
        names[d.name][0] += 1
        names[d.name][1] += d.end - d.start
        last_cat[d.name] = d.category
    want = [(n, last_cat[n], int(v[0])) for n, v in sorted(names.items(), key=lambda x: -x[1][1])]
    got = [(k["name"], k["category"], k["count"]) for k in r.top_kernels]
    assert got == want[: len(got)]
    got_cat = {k["name"]: k["category"] for k in r.top_kernels}
    assert got_cat["odd_name"] == K.classify("odd_name", "kernel") != K.MEMORY
    assert got_cat["ampere_sgemm_128x64_nn"] == K.GEMM
    assert r.copies["HtoD"]["count"] == 8 and r.copies["DtoH"]["bytes"] == 800


def _launch(corr: Any, ts: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "pid": 0, "tid": 1, "args": {"correlation": corr}}


def _launch_trace(tmp_path: Path, big: int | None) -> Path:
    ev: list[dict[str, Any]] = [
        _launch(1, 100), _launch(2, 110), _launch(1, 150),  # id 1 twice: the later one counts
        _launch("3", 160),  # an id written as text
        _launch(4, 170),
    ]
    if big is not None:
        ev.append(_launch(big, 180))
    for i, corr in enumerate([1, 2, 3, 5] + ([big] if big is not None else [])):
        ev.append(_ev(f"k{i}", "kernel", 1000 + 10 * i, 2, correlation=corr))
    p = tmp_path / f"rank0.{big is not None}.pt.trace.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    return p


def test_launch_columns_match_the_launch_of_each_correlation(tmp_path: Path) -> None:
    """Launch times found from the int64 columns are those of the id -> launch mapping (an id
    launched twice: the later launch), also with an id past 64 bits beside them."""
    from stepscope.analysis.trace.breakdown import _launch_times

    for big in (None, (1 << 63) + 5):
        pt = parse_trace(_launch_trace(tmp_path, big))
        expect = {1: 150_000, 2: 110_000, 3: 160_000, 4: 170_000}
        if big is not None:
            expect[big] = 180_000
            assert pt.launch_odd == {big: 180_000}
        assert pt.launches == expect
        ev = sorted(pt.device_events, key=lambda d: d.start)
        launch, found = _launch_times(ev, pt)
        got = {d.correlation: int(t) for d, t, f in zip(ev, launch, found, strict=True) if f}
        want = {c: min(t, (1 << 63) - 1) for c, t in expect.items()
                if c in {d.correlation for d in ev}}
        assert got == want
        assert [bool(f) for f in found] == [d.correlation != 5 for d in ev]
