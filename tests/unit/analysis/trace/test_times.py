"""Column-wise time conversion equals the per-value conversion, text by text."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from stepscope.analysis.trace import analyze_trace
from stepscope.analysis.trace.events import _BadEvent, _time, _TimeColumn
from stepscope.analysis.trace.times import parse_ns

_EDGES = [b"1712195495519689.047", b"0", b"-5", b"-0.5", b"1.05", b"12.3456789",
          b"4600000000000000", b"4600000000000001", b"-9999999999999999",
          b"9223372036854775.5", b"9999999999999999.9", b"99999999999999999.1", b"1e3",
          b"1.5E2", b"", b"abc", b"-", b".5", b"5.", b"1.2.3", b"--1", b"1-2", b"00012.5",
          b"123456789012345678901234567", b'"12.5"', b"null", b"[1]", b"-0", b"7"]


def _reference(text: bytes) -> int | None:
    try:
        return _time(text, "ts")
    except _BadEvent:
        return None


def _texts(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    out = list(_EDGES)
    for _ in range(n):
        s = str(rng.randint(0, 10 ** rng.randint(0, 17)))
        if rng.random() < 0.7:
            s += "." + str(rng.randint(0, 10 ** rng.randint(0, 6))).zfill(rng.randint(1, 6))
        if rng.random() < 0.2:
            s = "-" + s
        out.append(s.encode())
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_parse_ns_equals_per_value(seed: int) -> None:
    texts = _texts(seed, 5000)
    ns, ok = parse_ns(b"\n".join(texts), len(texts))
    assert ok.sum() > 0.8 * len(texts)  # the plain form is converted here
    for text, v, converted in zip(texts, ns.tolist(), ok.tolist(), strict=True):
        if converted:
            assert v == _reference(text), text
    # The plain form (Kineto's) is always converted here, never left to the slow path.
    plain = re.compile(rb"-?[0-9]{1,15}(\.[0-9]+)?")
    for text, converted in zip(texts, ok.tolist(), strict=True):
        if plain.fullmatch(text):
            assert converted, text


def test_time_column_matches_and_reports_bad_rows() -> None:
    col = _TimeColumn()
    texts = [b"10.5", b"-3", b"[1,\n 2]", b"abc", b"1712195495519689.047", b"1e3"]
    for t in texts[:3]:
        col.batch.append(t)
    col.flush()  # a value with a line break must not shift the rows after it
    for t in texts[3:]:
        col.batch.append(t)
    ns, errors = col.array("ts")
    assert errors is not None
    assert ns[0] == 10_500 and ns[1] == -3_000 and ns[4] == 1712195495519689047
    assert ns[5] == 1_000_000
    assert errors[0] is None and errors[4] is None and errors[5] is None
    assert errors[2] == "ts is not a number" and errors[3] is not None


def test_bad_device_times_are_skipped_in_place(tmp_path: Path) -> None:
    """A kernel with a bad ts or a negative dur is skipped and counted; the others keep
    their exact times (the columns stay aligned)."""
    ev = [
        {"ph": "X", "cat": "kernel", "name": "k0", "ts": "1712195495519689.047", "dur": 5.5,
         "args": {"stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": "soon", "dur": 5,
         "args": {"stream": 7, "correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 1712195495519699, "dur": -1,
         "args": {"stream": 7, "correlation": 3}},
        {"ph": "X", "cat": "kernel", "name": "k3", "ts": "1712195495519700.5", "dur": 2.25,
         "args": {"stream": 7, "correlation": 4}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
         "ts": "1712195495519680.001", "dur": 1, "args": {"correlation": 4}},
    ]
    p = tmp_path / "rank0.pt.trace.json"
    # Times written as text: a Python float would round 1712195495519689.047.
    text = json.dumps({"traceEvents": ev})
    for t in ("1712195495519689.047", "1712195495519700.5", "1712195495519680.001"):
        text = text.replace(f'"{t}"', t)
    p.write_text(text)
    with pytest.warns(Warning, match="skipped 2 malformed"):
        r = analyze_trace(p, workers=1).ranks[0]
    assert r.skipped_events == 2
    from stepscope.analysis.trace.events import parse_trace

    pt = parse_trace(p)
    assert [(d.name, d.start, d.end) for d in pt.device_events] == [
        ("k0", 1712195495519689047, 1712195495519694547),
        ("k3", 1712195495519700500, 1712195495519702750),
    ]
    assert pt.launches == {4: 1712195495519680001}


def test_head_meta_native_equals_partial(tmp_path: Path) -> None:
    """The head decoded in one native call gives what the key-by-key reader gives; a head
    cut mid-value still yields the keys before the cut."""
    from stepscope.analysis.trace.reader import _head_meta_partial, _read_head_meta

    head = ('{"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 3, '
            '"world_size": 8}, "deviceProperties": [{"id": 0, "name": "H100", "x": 1.25}], '
            '"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2}]}')
    p = tmp_path / "t.json"
    p.write_text(head)
    meta = _read_head_meta(p)
    cut = head.find('"traceEvents"')
    assert meta == _head_meta_partial((head[:cut] + '"traceEvents": []}').encode())
    assert meta["distributedInfo"]["rank"] == 3 and "traceEvents" not in meta
    assert str(meta["deviceProperties"][0]["x"]) == "1.25"  # exact, as ijson gives it
    broken = tmp_path / "broken.json"
    broken.write_text('{"distributedInfo": {"rank": 5}, "deviceProperties": [{"id": 0, "na')
    assert _read_head_meta(broken) == {"distributedInfo": {"rank": 5}}


def test_times_past_int64_ns_are_skipped_not_raised(tmp_path: Path) -> None:
    """A time inside the per-value bounds (< 1e16 µs) but past int64 ns, and a start plus
    duration past int64 ns, skip their events (counted) instead of raising."""
    ev = [
        {"ph": "X", "cat": "kernel", "name": "k_big_ts", "ts": "T1", "dur": 2, "pid": 0,
         "tid": 7, "args": {"stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "k_sum", "ts": "T2", "dur": "T2", "pid": 0,
         "tid": 7, "args": {"stream": 7, "correlation": 3}},
        {"ph": "X", "cat": "kernel", "name": "k_ok", "ts": 1000, "dur": 2, "pid": 0, "tid": 7,
         "args": {"stream": 7, "correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": "T1", "dur": 1,
         "pid": 0, "tid": 1, "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 990, "dur": 1,
         "pid": 0, "tid": 1, "args": {"correlation": 2}},
    ]
    text = json.dumps({"traceEvents": ev})
    # 9.9e18 ns does not fit int64; 9e18 does, twice that does not.
    text = text.replace('"T1"', "9999999999999999.5").replace('"T2"', "9000000000000000")
    p = tmp_path / "rank0.pt.trace.json"
    p.write_text(text)
    from stepscope.analysis.trace.events import parse_trace

    pt = parse_trace(p)
    assert [d.name for d in pt.device_events] == ["k_ok"]
    assert pt.launches == {2: 990_000}
    assert pt.skipped_events == 3
    assert pt.first_skip_reason == "ts is out of range"
    with pytest.warns(Warning, match="skipped 3 malformed"):
        r = analyze_trace(p, workers=1).ranks[0]
    assert r.device_events == 1 and r.total is not None and r.total.kernel_count == 1
