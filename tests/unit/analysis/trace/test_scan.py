"""The chunked traceEvents scan: same items as a full JSON parse, and long strings bounded."""

from __future__ import annotations

import gzip
import json
import random
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stepscope.analysis.trace import analyze_trace
from stepscope.analysis.trace.scan import (
    MAX_EVENT_BYTES,
    Args,
    Event,
    EventScan,
    Malformed,
    Mark,
    Span,
    TraceEvent,
)
from stepscope.common.errors import StepscopeWarning


def _kernel(i: int, name: str = "volta_sgemm") -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": 1000.5 + 10 * i, "dur": 4.25,
            "args": {"stream": 7, "correlation": i}}


def _scan(doc: bytes, piece: int) -> list[Any]:
    scan = EventScan(64)
    out: list[Any] = []
    for i in range(0, len(doc), piece):
        out.extend(scan.feed(doc[i:i + piece]))
    out.extend(scan.finish())
    return out


def _plain(x: Any) -> Any:
    """A decoded item back as plain JSON values (an event keeps only the args keys read;
    an event of a phase other than "X" from the fast path keeps only its phase)."""
    if isinstance(x, Mark):
        return {"ph": x.__struct_config__.tag}
    if isinstance(x, (TraceEvent, Event)) and isinstance(x.ph, str) and x.ph != "X":
        return {"ph": x.ph}
    if isinstance(x, (TraceEvent, Event, Span)):
        out = {f: (json.loads(bytes(v)) if isinstance(v, msgspec.Raw) else v)
               for f in x.__struct_fields__
               if (v := getattr(x, f)) is not msgspec.UNSET and not (isinstance(v, msgspec.Raw)
                                                                     and not len(v))}
        if isinstance(x, Span):
            out["ph"] = "X"
        if isinstance(x, (Event, Span)) and x.args is not None:
            out["args"] = json.loads(msgspec.json.encode(x.args))  # UNSET keys are left out
        return out
    return x


_ARG_KEYS = set(json.loads(msgspec.json.encode(Args(*range(len(Args.__struct_fields__))))))


def _as_read(x: Any) -> Any:
    """An item as the scan keeps it: an event's args reduced to the keys the analysis reads,
    an event of another phase than "X" reduced to its phase."""
    if isinstance(x, dict) and isinstance(x.get("ph"), str) and x["ph"] != "X":
        return {"ph": x["ph"]}
    if isinstance(x, dict) and isinstance(x.get("args"), dict):
        return {**x, "args": {k: v for k, v in x["args"].items() if k in _ARG_KEYS}}
    return x


def _tricky_doc(seed: int, odd: bool = True) -> tuple[bytes, list[Any]]:
    rng = random.Random(seed)
    names = ['a"b', "back\\slash\\", '\\"}],{[', "ünïcödé", "x" * 3000, "\\\\", '{"traceEvents": [1]}']
    items: list[Any] = []
    for i in range(400):
        r = rng.random()
        if r < 0.05 and odd:
            items.append(rng.choice([5, "str", None, [1, [2]], True]))
        else:
            ev = _kernel(i, rng.choice(names))
            if r < 0.3:
                ev["args"]["nested"] = {"deep": [[{"k": "],}"}]], "n": None}
            elif r < 0.45:  # a flow or instant event: the fast path keeps only its phase
                ev = {"ph": "fsiM"[i % 4], "id": i, "name": ev["name"], "ts": ev["ts"],
                      "cat": "ac2g", "args": {"nested": [{"a": 1}]}}
            items.append({k: ev[k] for k in rng.sample(list(ev), len(ev))})
    head = {"deviceProperties": [{"name": "[{x"}], "distributedInfo": {"rank": 3}}
    sep = rng.choice([",", ", ", ",\n  ", " ,\r\n"])
    body = sep.join(json.dumps(x, indent=rng.choice([None, 1])) for x in items)
    text = '{"schemaVersion": 1, "a": [' + json.dumps(head) + '],\n "traceEvents" :\t[' + body
    text += '], "tail": {"traceEvents": "not this one"}}'
    return text.encode(), items


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("piece", [7, 4093, 1 << 20])
def test_scan_yields_exactly_the_items_of_a_full_parse(seed: int, piece: int) -> None:
    doc, items = _tricky_doc(seed)
    assert json.loads(doc)["traceEvents"] == items  # the document itself is valid JSON
    got = [_plain(x) for x in _scan(doc, piece)]
    assert got == [_as_read(x) for x in items]


def test_truncated_document_keeps_whole_events_and_raises() -> None:
    doc = json.dumps({"traceEvents": [_kernel(i) for i in range(50)]}).encode()
    cut = doc[: len(doc) // 2]
    scan = EventScan(64)
    got: list[Any] = list(scan.feed(cut))
    with pytest.raises(Malformed):
        got.extend(scan.finish())
    assert 20 <= len(got) < 50
    assert all(isinstance(x, Event) and x.cat == "kernel" for x in got)


def test_depth_is_bounded_while_scanning() -> None:
    deep = "[" * 200 + "]" * 200
    doc = ('{"traceEvents": [' + json.dumps(_kernel(0)) + ', {"args": ' + deep + "}]}").encode()
    scan = EventScan(64)
    got = list(scan.feed(doc))
    assert len(got) == 1 and scan.stopped and "deeper than 64" in scan.stopped


def test_a_huge_kernel_name_is_skipped_counted_and_cheap(tmp_path: Path) -> None:
    # One 200 MiB name took 142 s and a 1 MB gzip inflating to a 1 GiB
    # name ran past 20 minutes. 256 MiB of name in a small gzip: skipped, counted, the
    # events around it kept, in linear time.
    p = tmp_path / "rank0.pt.trace.json.gz"
    before = ",".join(json.dumps(_kernel(i)) for i in range(5))
    after = ",".join(json.dumps(_kernel(i)) for i in range(5, 8))
    with gzip.open(p, "wb", compresslevel=1) as f:
        f.write(('{"traceEvents": [' + before + ', {"ph": "X", "cat": "kernel", "name": "').encode())
        chunk = b"A" * (1 << 24)
        for _ in range(16):
            f.write(chunk)
        f.write(('", "ts": 1, "dur": 1}, ' + after + "]}").encode())
    assert p.stat().st_size < 2 << 20
    t0 = time.perf_counter()
    with pytest.warns(StepscopeWarning):
        r = analyze_trace(p).ranks[0]
    elapsed = time.perf_counter() - t0
    assert r.device_events == 8
    assert r.skipped_events == 1
    assert r.events_seen == 9
    assert any(f"longer than {MAX_EVENT_BYTES >> 20} MiB" in w for w in r.warnings), r.warnings
    assert elapsed < 120, elapsed  # linear: seconds; the old parser took many minutes


def test_a_long_name_inside_one_block_is_skipped_too(tmp_path: Path) -> None:
    p = tmp_path / "rank0.pt.trace.json"
    evs = [_kernel(0), {**_kernel(1), "name": "B" * (MAX_EVENT_BYTES + 10)}, _kernel(2)]
    p.write_text(json.dumps({"traceEvents": evs}))
    with pytest.warns(StepscopeWarning):
        r = analyze_trace(p).ranks[0]
    assert (r.device_events, r.skipped_events, r.events_seen) == (2, 1, 3)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fast_bytes", [400, 700, 5000])
def test_fast_path_yields_the_same_items(seed: int, fast_bytes: int) -> None:
    # Small fast slices, so the fast path runs many times on the tricky document: cut
    # candidates inside strings ('\\"}],{[' names), nested args (items that are no events
    # send a slice to the exact scan, so they are left out here).
    doc, items = _tricky_doc(seed, odd=False)
    for piece in (997, 8191):
        scan = EventScan(64, fast_bytes=fast_bytes)
        got: list[Any] = []
        for i in range(0, len(doc), piece):
            for batch in scan.feed_batches(doc[i:i + piece]):
                got.extend(batch)
        for batch in scan.finish_batches():
            got.extend(batch)
        assert [_plain(x) for x in got] == [_as_read(x) for x in items]
        assert scan.fast_items > 0


def test_fast_path_leaves_deep_nesting_to_the_exact_scan() -> None:
    # A deep value after many ordinary events: the fast path must not decode past it.
    head = ",".join(json.dumps(_kernel(i)) for i in range(2000))
    deep = '{"ph": "X", "args": {"a": ' + "[" * 100 + "]" * 100 + "}}"
    doc = ('{"traceEvents": [' + head + ", " + deep + ", " + head + "]}").encode()
    scan = EventScan(64, fast_bytes=4096)
    got: list[Any] = []
    for i in range(0, len(doc), 8192):
        for batch in scan.feed_batches(doc[i:i + 8192]):
            got.extend(batch)
    assert scan.stopped and "deeper than 64" in scan.stopped
    assert len(got) == 2000
    assert scan.fast_items > 1000


def test_fast_path_hands_the_array_end_and_a_truncation_to_the_exact_scan() -> None:
    evs = [_kernel(i) for i in range(3000)]
    doc = json.dumps({"traceEvents": evs, "deviceProperties": [{"a": 1}, {"b": 2}]}).encode()
    scan, got = _scan_fast(doc)
    assert len(got) == 3000 and scan.fast_items > 2000
    with pytest.raises(Malformed):
        _scan_fast(doc[: len(doc) // 2])


def _scan_fast(doc: bytes) -> tuple[EventScan, list[Any]]:
    scan = EventScan(64, fast_bytes=2048)
    out: list[Any] = []
    for i in range(0, len(doc), 16384):
        for batch in scan.feed_batches(doc[i:i + 16384]):
            out.extend(batch)
    for batch in scan.finish_batches():
        out.extend(batch)
    return scan, out


def test_time_conversion_is_exact_decimal_arithmetic() -> None:
    # The fast conversion of a raw µs number must give int(Decimal(text) * 1000) exactly.
    from decimal import Decimal

    from stepscope.analysis.trace.events import _time

    rng = random.Random(5)
    texts = ["0", "7", "1.5", "-1.5", "-0.0005", "0.001", "12.3456789", "1712195495505583.0",
             "4203669613175.703", "0001.25", "1e3", "1.5E2", "-12", "9999999999999999.999"]
    for _ in range(2000):
        whole = str(rng.randrange(0, 10 ** rng.randrange(1, 17)))
        frac = "".join(rng.choice("0123456789") for _ in range(rng.randrange(1, 7)))
        texts.append(("-" if rng.random() < 0.2 else "") + whole + "." + frac)
    for t in texts:
        assert _time(msgspec.Raw(t.encode()), "ts") == int(Decimal(t) * 1000), t


def test_fast_path_gives_up_on_a_trace_whose_slices_keep_failing() -> None:
    # An item that is no event in every slice: each fast try is a wasted decode, so after a
    # few the scan stops trying (same items, exact scan only).
    items: list[Any] = []
    for i in range(3000):
        items.append(_kernel(i))
        if i % 10 == 9:
            items.append(i)
    doc = json.dumps({"traceEvents": items}).encode()
    scan = EventScan(64, fast_bytes=2048)
    got: list[Any] = []
    for i in range(0, len(doc), 4096):
        for batch in scan.feed_batches(doc[i:i + 4096]):
            got.extend(batch)
    for batch in scan.finish_batches():
        got.extend(batch)
    assert [_plain(x) for x in got] == [_as_read(x) for x in items]
    assert scan.fast_items == 0 and scan._fast_failures == 8


def test_events_of_unknown_or_missing_phase_do_not_change_the_result(tmp_path: Path) -> None:
    # The fast path decodes by phase (a tagged union on "ph"): an unknown phase, a missing
    # one or a non-string one fails its slice, which the exact scan then reads. The kernels
    # (one with a numeric name, classified as its text) must come out the same either way.
    kernels = [_kernel(i) for i in range(3000)] + [{**_kernel(3000), "name": 12345}]
    odd = [{"ph": "Z", "name": "x", "ts": 1}, {"name": "no phase", "ts": 2},
           {"ph": 7, "cat": "kernel", "name": "k", "ts": 3, "dur": 1}]
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    plain.mkdir()
    mixed.mkdir()
    (plain / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": kernels}))
    evs = kernels[:1000] + odd + kernels[1000:2000] + odd + kernels[2000:]
    (mixed / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": evs}))
    a, b = analyze_trace(plain).ranks[0], analyze_trace(mixed).ranks[0]
    assert a.device_events == b.device_events == 3001
    assert b.events_seen == a.events_seen + 2 * len(odd)
    assert a.total == b.total and a.top_kernels == b.top_kernels
    assert any(k["name"] == "12345" for k in a.top_kernels)


def test_correlation_ids_past_64_bits_split_idle_time_as_small_ones(tmp_path: Path) -> None:
    # Launch times are matched to kernels by a sorted int64 search; ids past 64 bits (legal
    # JSON, msgspec reads them up to 2**64) take the per-event path and must agree with it.
    def doc(base: int) -> dict[str, Any]:
        evs: list[dict[str, Any]] = []
        for i in range(6):
            k = _kernel(i)
            k["args"]["correlation"] = base + i
            evs.append(k)
            # Kernel i starts at 1000.5 + 10 i; its launch 3 µs before (late ones make host wait).
            evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                        "ts": 1000.5 + 10 * i - (3 if i % 2 else 9), "dur": 1,
                        "args": {"correlation": base + i}})
        return {"traceEvents": evs}

    small, big = tmp_path / "small", tmp_path / "big"
    for d, base in ((small, 7), (big, 2**63 + 5)):
        d.mkdir()
        (d / "rank0.pt.trace.json").write_text(json.dumps(doc(base)))
    a, b = analyze_trace(small).ranks[0], analyze_trace(big).ranks[0]
    assert a.total is not None and b.total is not None
    assert a.total.idle_host_wait_us > 0 and a.total.idle_kernel_wait_us > 0
    assert (a.total, a.steps) == (b.total, b.steps)
