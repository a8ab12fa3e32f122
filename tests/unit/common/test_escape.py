"""Names given by the user (phases, counters, hosts, run ids) in every output.

Bidi controls and invisible format characters (Unicode category Cf), C0/C1 controls and line
separators are written out as text (``\\u202e``) by :mod:`stepscope.common.escape` in the
terminal report, markdown, HTML, Perfetto JSON, Prometheus labels, OTLP attributes, the live
line, ``status`` and ``trace``. A lone surrogate (a name made from an undecodable file name) is
written out at the API, so every record is still written and every scrape still answers.
"""

from __future__ import annotations

import json
import os
import time
import unicodedata
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

import stepscope
from stepscope.cli import main
from stepscope.common import escape
from stepscope.recording.config import Config
from stepscope.recording.dist import RankInfo, free_port
from stepscope.recording.schema import read_run
from stepscope.tracer import Tracer

#: Right-to-left override and embedding, isolates, zero-width space/joiner/marks, word joiner,
#: invisible plus, BOM, soft hyphen, a tag character, the Arabic letter mark, ESC and a C1 CSI.
INVISIBLE = ("\u202a", "\u202e", "\u2066", "\u2067", "\u2069", "\u200b", "\u200d", "\u200f",
             "\u2060", "\u2064", "\ufeff", "\u00ad", "\U000e0041", "\u061c", "\x1b", "\x9b")
PHASE = "fwd" + "".join(INVISIBLE) + "x"
HOST = "node\u202e1-\u2066evil\u2069"
SURROGATE = os.fsdecode(b"shard_\xff.bin")  # 'shard_\udcff.bin'
#: Categories written out: controls, format characters, surrogates, line/paragraph separators.
UNSAFE_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _raw(text: str) -> list[str]:
    """The unsafe code points left raw in ``text`` (a line feed and a tab are layout)."""
    return sorted({repr(c) for c in text
                   if c not in "\n\t" and unicodedata.category(c) in UNSAFE_CATEGORIES})


def test_every_control_and_format_character_is_written_out() -> None:
    unsafe = [chr(c) for c in range(0x110000) if chr(c) != "\n"
              and unicodedata.category(chr(c)) in UNSAFE_CATEGORIES]
    assert len(unsafe) > 2000  # C0, C1, Cf, the surrogates and the tags
    text = "".join(unsafe)
    out = escape.term(text)
    assert _raw(out) == [] and out.isascii()
    assert escape.term("\u202e") == "\\u202e" and escape.term("\U000e0041") == "\\U000e0041"
    # Letters, marks, symbols and spaces of every script are kept as they are.
    kept = "".join(chr(c) for c in range(0x20, 0x30000, 7)
                   if unicodedata.category(chr(c)) not in UNSAFE_CATEGORIES | {"Cn", "Co"})
    assert escape.term(kept.replace("\\", "")) == kept.replace("\\", "")
    for fn in (escape.one_line, escape.md, escape.md_code, escape.html_text, escape.rich):
        assert _raw(fn(PHASE)) == [], fn.__name__
    assert _raw(escape.json_for_script({PHASE: [PHASE]})) == []


def test_a_lone_surrogate_is_written_out_at_the_api() -> None:
    assert escape.name(SURROGATE) == "shard_\\udcff.bin"
    assert escape.name("plain") == "plain" and escape.name("d\u00e9j\u00e0") == "d\u00e9j\u00e0"
    assert stepscope.phase(SURROGATE)._name == "shard_\\udcff.bin"  # before init() too
    assert RankInfo(0, 0, 1, "h\udcfe").hostname == "h\\udcfe"
    assert Config(out_dir="x", run_id="r\udcff").run_id == "r\\udcff"


def _run(out: Path, steps: int = 40, **kw: Any) -> Tracer:
    """A recorded run whose host name and phase names are hostile (and one is undecodable)."""
    cfg = Config(out_dir=str(out), auto=False, flush_every_n_steps=5, heartbeat_s=0,
                 run_id="run" + "\u202e\udcff", **kw)
    tr = Tracer(cfg, rank=RankInfo(0, 0, 1, HOST + "\udcff"))
    for _ in range(steps):
        with tr.step(tokens=8), tr.phase(PHASE), tr.phase(SURROGATE):
            tr.count("tok\udcffens", 1)
            torch.ones(4).sum()
    return tr


def test_a_phase_named_from_an_undecodable_file_name_keeps_every_record(tmp_path: Path) -> None:
    tr = _run(tmp_path / "run")
    tr.finish()
    recs = read_run(tmp_path / "run")
    assert len(recs) == 40
    names = {p["name"] for p in recs[0]["phases"]}
    assert names == {PHASE, "shard_\\udcff.bin"}  # the bidi name kept as data, written out at output
    assert recs[0]["hostname"] == HOST + "\\udcff" and recs[0]["run_id"] == "run\u202e\\udcff"


def test_every_output_writes_the_names_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _run(run).finish()
    assert main(["report", str(run)]) == 0
    assert _raw(capsys.readouterr().out) == []
    md, page, trace = tmp_path / "r.md", tmp_path / "r.html", tmp_path / "p.json"
    assert main(["report", str(run), "--markdown", str(md), "--html", str(page)]) == 0
    capsys.readouterr()
    assert "\\u202e" in md.read_text() and _raw(md.read_text()) == []
    assert "\\u202e" in page.read_text() and _raw(page.read_text()) == []
    assert main(["export", str(run), "--perfetto", str(trace)]) == 0
    capsys.readouterr()
    text = trace.read_text()
    assert _raw(text) == [] and _raw(json.dumps(json.loads(text), ensure_ascii=False)) == []
    assert "fwd\\\\u202a" in text  # the name as readable text, not an invisible code point
    assert main(["report", str(run), "--json"]) == 0  # JSON: escaped by the encoder itself
    out = capsys.readouterr().out
    assert _raw(out) == [] and PHASE in json.loads(out)["phases"]

    beat = {"kind": "stepscope-heartbeat", "schema": 1, "run_id": "r\u202e", "rank": 0,
            "world_size": 1, "host": HOST, "pid": 99_999_999, "interval_s": 1.0,
            "updated_unix": time.time(), "state": "running", "step": 7, "in_step": True,
            "phase_stack": [PHASE], "step_since_unix": time.time() - 100, "in_phase_s": 100.0,
            "last_step": 6, "last_step_s": 0.1}
    (run / "rank0.status.json").write_text(json.dumps(beat))
    main(["status", str(run)])
    got = capsys.readouterr()
    assert "\\u202e" in got.out and _raw(got.out + got.err) == []


def test_the_live_line_writes_the_names_out() -> None:
    from rich.text import Text

    from stepscope.listeners.live import format_line

    s = {"step": 10, "ranks": 2, "world_size": 2, "step_ms_median": 10.0, "step_ms_max": 12.0,
         "step_ms_max_rank": 1, "slowest_rank": 1, "slowest_phase": PHASE, "slowest_phase_ms": 5.0,
         "slowest_phase_excess_ms": 2.0, "h2d_share": 0.0, "dataloader_share": 0.0,
         "waited_on_link": "pp\u2066"}
    line = Text.from_markup(format_line(s)).plain
    assert "fwd\\u202a" in line and _raw(line) == []


def test_trace_writes_kernel_names_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def x(name: str, cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": args.get("stream", 1),
                "ts": ts, "dur": dur, "args": args}

    events = [x("ProfilerStep#1", "user_annotation", 0, 300),
              x("cudaLaunchKernel", "cuda_runtime", -10, 1, correlation=1),
              x("kern" + "".join(INVISIBLE), "kernel", 0, 100, stream=7, correlation=1)]
    t = tmp_path / "t.json"
    t.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    md = tmp_path / "t.md"
    assert main(["trace", str(t), "--markdown", str(md)]) == 0
    got = capsys.readouterr()
    assert _raw(got.out + got.err) == [] and _raw(md.read_text()) == []


def test_metric_labels_and_otlp_attributes_write_the_names_out() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from stepscope.listeners.export.metrics import MetricsListener, MetricState
    from stepscope.listeners.export.otel import OtelBackend, resource_attributes

    state = MetricState(rank=0, run_id="r\u2066\udcff", hostname=HOST, world_size=1)
    listener = MetricsListener(state)
    reader = InMemoryMetricReader()
    backend = OtelBackend(state, reader=reader)
    listener.on_record({"step": 1, "step_ms": 10.0, "residual_ms": 1.0, "phases": [
        {"name": "fwd\u202ax\u200b", "parent": None, "ms": 4.0},
        {"name": "a\udcffb", "parent": None, "ms": 5.0}]})
    attrs = [dict(p.attributes or {}) for rm in reader.get_metrics_data().resource_metrics
             for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points]
    backend.close()
    shown = json.dumps([attrs, resource_attributes(state)], ensure_ascii=False)
    assert "fwd\\\\u202a" in shown and "a\\\\udcffb" in shown and _raw(shown) == []


def _scrape(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_prometheus_answers_every_scrape_with_the_names_written_out(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    port = free_port()
    tr = _run(tmp_path / "run", steps=10, prometheus_port=port, prometheus_addr="127.0.0.1")
    tr.flush()
    got = []
    for i in range(6):
        with tr.step(), tr.phase(SURROGATE if i % 2 else PHASE):
            torch.ones(4).sum()
        tr.flush()
        got.append(_scrape(port))
    tr.finish()
    assert [code for code, _ in got] == [200] * 6
    text = "".join(body for _, body in got)
    assert 'stepscope_phase="shard_\\\\udcff.bin"' in text and "node\\\\u202e1" in text
    assert _raw(text) == []
