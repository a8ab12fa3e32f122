"""Metrics export against the real libraries: an OTLP/HTTP receiver, the SDK's in-memory
reader, a Prometheus endpoint scraped over HTTP, a dead collector, and two gloo ranks."""

from __future__ import annotations

import http.server
import json
import statistics
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stepscope
from stepscope.common.errors import StepscopeWarning
from stepscope.listeners.export.metrics import (
    CATALOGUE,
    MAX_LABEL_VALUES,
    PHASE_DURATION,
    MetricsListener,
    MetricState,
)
from stepscope.recording.dist import free_port

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("prometheus_client")


# ------------------------------------------------------------------ helpers


def _train(out: Path, steps: int, sleep_s: float = 0.0, **init_kw: Any) -> Any:
    """A real model, optimizer and loop in this process; returns the tracer (finished)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = stepscope.init(out_dir=str(out), model=model, optimizer=opt, heartbeat_s=0,
                            flush_every_n_steps=2, **init_kw)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    for _ in range(steps):
        with stepscope.step(tokens=512):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if sleep_s:
                time.sleep(sleep_s)
    return tracer


def _records(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / f"rank{rank}.jsonl").read_text().splitlines()]


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP metrics receiver: decodes the protobuf body with opentelemetry-proto."""

    got: list[Any]

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
            ExportMetricsServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportMetricsServiceRequest()
        req.ParseFromString(body)
        type(self).got.append((self.path, req))
        out = ExportMetricsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[int, list[Any]]]:
    handler = type("Handler", (_Receiver,), {"got": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server.server_address[1], handler.got  # type: ignore[attr-defined]
    server.shutdown()
    server.server_close()


def _otlp_points(req: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    """metric name -> [(attributes, value)] from one ExportMetricsServiceRequest."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                data = m.gauge if m.HasField("gauge") else m.sum
                for dp in data.data_points:
                    attrs = {kv.key: kv.value.string_value for kv in dp.attributes}
                    val = dp.as_double if dp.HasField("as_double") else float(dp.as_int)
                    out.setdefault(m.name, []).append((attrs, val))
    return out


def _resource(req: Any) -> dict[str, Any]:
    rm = req.resource_metrics[0]
    return {kv.key: (kv.value.string_value or kv.value.int_value) for kv in rm.resource.attributes}


# ------------------------------------------------------------------ OTLP


def test_otlp_http_receiver_gets_the_records_values(tmp_path: Path, receiver: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    port, got = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{port}/v1/metrics")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "60000")  # only the final export at finish
    out = tmp_path / "run"
    _train(out, steps=12, otel=True)
    stepscope.finish()
    assert got, "no OTLP export reached the receiver"
    path, req = got[-1]
    assert path == "/v1/metrics"
    pts = _otlp_points(req)
    recs = _records(out)
    last = recs[-1]
    assert len(recs) == 12
    res = _resource(req)
    assert res["service.name"] == "stepscope" and res["stepscope.run.id"] == last["run_id"]
    assert res["service.instance.id"] == f"{last['run_id']}/rank0"
    (attrs, step_s), = pts["stepscope.step.duration"]
    assert attrs == {"stepscope.rank": "0"}
    assert step_s == pytest.approx(last["step_ms"] / 1000.0, rel=1e-6)
    (_, steps), = pts["stepscope.steps"]
    assert steps == 12
    phases = {a["stepscope.phase"]: v for a, v in pts["stepscope.phase.duration"]}
    want = {p["name"]: p["ms"] / 1000.0 for p in last["phases"] if p["parent"] is None}
    assert set(want) <= set(phases) and {"forward", "backward", "optimizer"} <= set(want)
    for name, v in want.items():
        assert phases[name] == pytest.approx(v, rel=1e-6)
    (_, tps), = pts["stepscope.throughput.tokens"]
    assert tps == pytest.approx(last["throughput"]["tokens_per_s"], rel=1e-6)
    (_, rss), = pts["process.memory.usage"]
    assert rss == pytest.approx(last["memory"]["rss_mb"] * 1024 * 1024, rel=1e-6)


def test_in_memory_reader_flops_mfu_and_memory_kinds() -> None:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from stepscope.listeners.export.otel import OtelBackend

    state = MetricState(rank=3, run_id="r", hostname="h", world_size=4)
    listener = MetricsListener(state)
    reader = InMemoryMetricReader()
    backend = OtelBackend(state, reader=reader)
    rec = {"step": 5, "step_ms": 250.0, "residual_ms": 1.5,
           "phases": [{"name": "forward", "parent": None, "ms": 100.0},
                      {"name": "h2d", "parent": "forward", "ms": 20.0},
                      {"name": "backward", "parent": None, "ms": 140.0}],
           "collectives": [{"op": "all_reduce", "ms": 30.0}, {"op": "all_reduce", "ms": 10.0},
                           {"op": "broadcast", "ms": 2.0}],
           "flops": {"tflops": 12.5, "mfu": 0.4},
           "memory": {"peak_allocated_mb": 1000.0, "peak_reserved_mb": 1200.0, "allocated_mb": 800.0}}
    listener.on_record(rec)
    listener.on_record({**rec, "untimed": True, "step_ms": 9999.0})  # not a timing sample
    data = reader.get_metrics_data()
    pts: dict[str, list[tuple[dict[str, Any], float]]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                pts[m.name] = [(dict(p.attributes or {}), p.value) for p in m.data.data_points]
    assert pts["stepscope.step.duration"] == [({"stepscope.rank": "3"}, 0.25)]
    assert dict((a["stepscope.phase"], v) for a, v in pts["stepscope.phase.duration"]) == {
        "forward": 0.1, "backward": 0.14, "residual": 0.0015}
    assert dict((a["stepscope.collective.op"], v) for a, v in pts["stepscope.collective.duration"]) == {
        "all_reduce": pytest.approx(0.04), "broadcast": pytest.approx(0.002)}
    assert pts["stepscope.compute.flops"][0][1] == 12.5
    assert pts["stepscope.compute.utilization"][0][1] == 0.4
    mem = {a["stepscope.memory.kind"]: v for a, v in pts["stepscope.device.memory.usage"]}
    assert mem == {"peak_allocated": 1000.0 * 2**20, "peak_reserved": 1200.0 * 2**20,
                   "allocated": 800.0 * 2**20}
    assert pts["stepscope.steps"][0][1] == 1
    assert "stepscope.throughput.tokens" not in pts  # nothing measured: no series
    backend.close()


def test_label_cardinality_is_bounded() -> None:
    state = MetricState(rank=0, run_id="r", hostname="h", world_size=1)
    listener = MetricsListener(state)
    for i in range(200):
        listener.on_record({"step": i, "step_ms": 10.0, "phases": [
            {"name": f"user_phase_{i}_{j}", "parent": None, "ms": 1.0} for j in range(5)]})
    seen: set[str] = set()
    listener2 = MetricsListener(state)
    for i in range(200):
        listener2.on_record({"step": i, "step_ms": 10.0, "phases": [
            {"name": f"user_phase_{i}", "parent": None, "ms": 1.0}]})
        seen |= {dict(k)["stepscope.phase"] for k in state.snapshot()[PHASE_DURATION.name]}
    assert len(seen) <= MAX_LABEL_VALUES + 2  # the first 16 user names, residual, other
    assert "other" in seen
    assert len(CATALOGUE) == len({m.name for m in CATALOGUE})


def test_a_malformed_record_stops_the_listener_not_the_writer() -> None:
    state = MetricState(rank=0, run_id="r", hostname="h", world_size=1)
    said: list[str] = []
    listener = MetricsListener(state, warn=said.append)
    listener.on_record({"step": 1, "step_ms": 5.0, "phases": "not a list of dicts"})  # no raise
    assert listener.broken and len(said) == 1 and "internal error" in said[0]
    listener.on_record({"step": 2, "step_ms": 5.0, "phases": []})
    assert len(said) == 1


def test_dead_collector_one_warning_job_finishes_step_time_unaffected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = free_port()  # nothing listens there
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{dead}/v1/metrics")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    base = tmp_path / "base"
    _train(base, steps=40, sleep_s=0.01)
    stepscope.finish()
    with pytest.warns(StepscopeWarning) as caught:
        tracer = _train(tmp_path / "dead", steps=40, sleep_s=0.01, otel=True)
        deadline = time.monotonic() + 30
        listener = next(x for x in tracer._listeners if isinstance(x, MetricsListener))
        while not listener.backends[0].guard.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        stepscope.finish()
        finish_s = time.monotonic() - t0
    msgs = [str(w.message) for w in caught if "OpenTelemetry" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "export failed" in msgs[0]
    assert finish_s < 7.0
    # Export runs on its own thread: the 10 ms steps stay about 10 ms (an export on the training
    # thread would add its 1 s timeout and retries to steps). The 10th percentile, with a wide
    # margin, because other jobs on 2 shared cores inflate the median of either run at random.
    p10_base = statistics.quantiles([r["step_ms"] for r in _records(base)], n=10)[0]
    p10_dead = statistics.quantiles([r["step_ms"] for r in _records(tmp_path / "dead")], n=10)[0]
    assert p10_dead < 2.0 * p10_base + 10.0
    assert len(_records(tmp_path / "dead")) == 40


# ------------------------------------------------------------------ Prometheus


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def test_prometheus_endpoint_scraped_over_http(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "run"
    tracer = _train(out, steps=10, prometheus_port=port, prometheus_addr="127.0.0.1")
    tracer.flush()
    deadline = time.monotonic() + 30
    got: dict[str, Any] = {}
    while time.monotonic() < deadline:
        got = _scrape(port)
        if got.get("stepscope_steps_total", [({}, 0.0)])[0][1] == 10:
            break
        time.sleep(0.05)
    stepscope.finish()
    recs = _records(out)
    last = recs[-1]
    assert got["stepscope_steps_total"] == [({"stepscope_rank": "0"}, 10.0)]
    assert got["stepscope_step_duration_seconds"] == [
        ({"stepscope_rank": "0"}, pytest.approx(last["step_ms"] / 1000.0, rel=1e-6))]
    phases = {lab["stepscope_phase"]: v for lab, v in got["stepscope_phase_duration_seconds"]}
    for p in last["phases"]:
        if p["parent"] is None:
            assert phases[p["name"]] == pytest.approx(p["ms"] / 1000.0, rel=1e-6)
    (_, tps), = got["stepscope_throughput_tokens_tokens_per_second"]
    assert tps == pytest.approx(last["throughput"]["tokens_per_s"], rel=1e-6)
    (info, one), = got["stepscope_run_info"]
    assert one == 1.0 and info["run_id"] == last["run_id"] and info["stepscope_rank"] == "0"
    with pytest.raises(OSError):  # the endpoint is gone after finish()
        _scrape(port)


def test_prometheus_port_taken_warns_and_the_job_runs(tmp_path: Path) -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        with pytest.warns(StepscopeWarning, match="Prometheus endpoint on 127.0.0.1"):
            _train(tmp_path / "run", steps=5, prometheus_port=port, prometheus_addr="127.0.0.1")
            stepscope.finish()
    finally:
        sock.close()
    assert len(_records(tmp_path / "run")) == 5


def test_config_rejects_bad_export_settings() -> None:
    from stepscope.common.errors import ConfigError
    from stepscope.recording.config import Config, env_overrides

    with pytest.raises(ConfigError, match="prometheus_port"):
        Config(prometheus_port=70000)
    with pytest.raises(ConfigError, match="otel must be a bool"):
        Config(otel="yes")
    assert env_overrides({"STEPSCOPE_OTEL": "1", "STEPSCOPE_PROMETHEUS_PORT": "9400"}) == {
        "otel": True, "prometheus_port": 9400}
    with pytest.raises(ConfigError, match="STEPSCOPE_PROMETHEUS_PORT"):
        env_overrides({"STEPSCOPE_PROMETHEUS_PORT": "x"})


def test_import_stepscope_pulls_no_exporter() -> None:
    import subprocess
    import sys

    code = ("import sys, stepscope; bad = [m for m in sys.modules if m.startswith(("
            "'opentelemetry', 'prometheus_client', 'stepscope.listeners.export'))]; print(bad)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


# ------------------------------------------------------------------ two gloo ranks


def test_two_gloo_ranks_one_port_each_and_the_slow_rank_finding(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stepscope.demo import SlowSpec, launch

    base = free_port(span=2)  # base and base + 1, one per rank
    monkeypatch.setenv("STEPSCOPE_PROMETHEUS_PORT", str(base))
    last: dict[int, dict[str, Any]] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for r in (0, 1):
                try:
                    got = _scrape(base + r)
                except OSError:
                    continue
                if "stepscope_finding_slowest_rank_ratio" in got or r == 1 or r not in last:
                    last[r] = got
            time.sleep(0.05)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StepscopeWarning)
            launch(tmp_path / "run", ranks=2, steps=60, log_every_n_steps=10,
                   slow=(SlowSpec(rank=1, phase="forward", ms=25.0),))
    finally:
        stop.set()
        t.join(5)
    assert set(last) == {0, 1}
    for r in (0, 1):
        assert last[r]["stepscope_steps_total"][0][0]["stepscope_rank"] == str(r)
        assert last[r]["stepscope_steps_total"][0][1] > 0
    finding = last[0]
    (_, slow_rank), = finding["stepscope_finding_slowest_rank_ratio"]
    assert slow_rank == 1.0
    waits = {lab["stepscope_rank"]: v for lab, v in finding["stepscope_wait_duration_seconds"]}
    assert waits["0"] > waits["1"]  # rank 0 waits for the slow rank 1
    assert "stepscope_finding_slowest_rank_ratio" not in last[1]  # one publisher of findings
    job = {lab["stepscope_stat"]: v for lab, v in finding["stepscope_ranks_step_duration_seconds"]
           if lab["stepscope_scope"] == "job"}
    assert set(job) == {"median", "max"} and job["max"] >= job["median"] > 0
    node_phases = {(lab["stepscope_phase"], lab["stepscope_stat"])
                   for lab, _ in finding["stepscope_ranks_phase_duration_seconds"]
                   if lab["stepscope_scope"] == "node"}
    assert ("forward", "max") in node_phases


# ------------------------------------------------------------------ which process exports


def _file_exporter(path: Path) -> Any:
    """A metric exporter that appends ``pid points`` per export to ``path`` (fork-safe: O_APPEND)."""
    import os

    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        MetricExporter,
        MetricExportResult,
    )

    class FileExporter(MetricExporter):
        def __init__(self) -> None:
            super().__init__(preferred_temporality={}, preferred_aggregation={})
            self._temporality = AggregationTemporality.CUMULATIVE

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kw: Any) -> Any:
            points = sum(len(m.data.data_points) for rm in metrics_data.resource_metrics
                         for sm in rm.scope_metrics for m in sm.metrics)
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {points}\n")
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kw: Any) -> None:
            pass

    return FileExporter()


def test_a_forked_child_exports_nothing(tmp_path: Path) -> None:
    """The SDK restarts its reader thread in a forked child (a DataLoader worker); the child's
    copy of the state must not reach the collector (its step counter would go backwards)."""
    import os

    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    from stepscope.listeners.export.otel import OtelBackend

    log = tmp_path / "exports.log"
    state = MetricState(0, "run", "host", 1)
    state.add("stepscope.steps", 5.0)
    reader = PeriodicExportingMetricReader(_file_exporter(log), export_interval_millis=50)
    backend = OtelBackend(state, reader=reader)
    try:
        pid = os.fork()
        if pid == 0:  # the child: let its reader thread run a few intervals, then leave at once
            time.sleep(0.6)
            os._exit(0)
        os.waitpid(pid, 0)
    finally:
        backend.close()
    rows = [line.split() for line in log.read_text().splitlines()]
    by_pid: dict[int, int] = {}
    for p, n in rows:
        by_pid[int(p)] = by_pid.get(int(p), 0) + int(n)
    assert by_pid.get(os.getpid(), 0) > 0  # the parent exported
    assert by_pid.get(pid, 0) == 0, rows  # the child sent no data point


def test_finish_does_not_wait_for_a_collector_that_already_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused collector: the first export is still retrying (for the exporter's 10 s) when the
    job finishes. finish() neither waits for it nor tries a last export."""
    from stepscope.listeners.export.otel import OtelBackend

    dead = free_port()  # nothing listens there: connections are refused
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{dead}/v1/metrics")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "10")
    state = MetricState(0, "run", "host", 1)
    state.add("stepscope.steps", 1.0)
    backend = OtelBackend(state, warn=lambda m: None)
    guard = backend.guard
    assert guard is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
            guard.busy_since is not None and time.monotonic() - guard.busy_since > 1.2):  # past STUCK_S
        time.sleep(0.05)
    assert guard.busy_since is not None  # an export is retrying against the refused port
    t0 = time.monotonic()
    backend.close()
    assert time.monotonic() - t0 < 2.0  # not FINISH_WAIT_S (5 s)


# ------------------------------------------------------------------ series that do not grow with the world

_PHASES = ("dataloader", "forward", "backward", "optimizer", "residual")


def _payloads(world: int, per_node: int = 8, slow: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """What the live view's exchange gathers from ``world`` ranks (``per_node`` a host): every
    rank alike but for small jitter, the ``slow`` ranks 40 ms longer in forward."""
    out = []
    for r in range(world):
        jitter = (r * 7919 % 1000) / 1000.0
        fwd = 100.0 + jitter + (40.0 if r in slow else 0.0)
        ph = {"dataloader": [5.0, 0.02, 0.0], "forward": [fwd, 0.4, 5.0],
              "backward": [120.0 + jitter, 0.5, 110.0], "optimizer": [10.0, 0.04, 240.0],
              "residual": [1.0, 0.004, 1e9]}
        out.append({"r": r, "s": 50, "n": 10, "m": 236.0 + jitter, "x": 240.0, "p": ph,
                    "e": {"h": f"node{r // per_node:05d}"}})
    return out


def _own_series(world: int, rank: int) -> int:
    """Series one rank serves of its own (Prometheus), after one record."""
    from stepscope.listeners.export.prometheus import _Collector

    state = MetricState(rank=rank, run_id="r", hostname="h", world_size=world)
    MetricsListener(state).on_record({
        "step": 1, "step_ms": 236.0, "residual_ms": 1.0,
        "phases": [{"name": n, "parent": None, "ms": 10.0} for n in _PHASES if n != "residual"],
        "collectives": [{"op": "all_reduce", "ms": 30.0}],
        "throughput": {"tokens_per_s": 1e5, "samples_per_s": 100.0},
        "memory": {"peak_allocated_mb": 1.0, "peak_reserved_mb": 2.0, "allocated_mb": 1.0, "rss_mb": 5.0}})
    state.publish_own = True
    return sum(len(f.samples) for f in _Collector(state).collect())


def _publisher_series(payloads: list[dict[str, Any]], top: int | None) -> tuple[int, Any]:
    from stepscope.listeners.export.prometheus import _Collector

    world = len(payloads)
    state = MetricState(rank=0, run_id="r", hostname="node00000", world_size=world, top_ranks=top)
    state.publisher = True
    listener = MetricsListener(state)
    listener.on_gather(list(payloads))
    state.publish_own = False  # count the cross-rank series alone
    return sum(len(f.samples) for f in _Collector(state).collect()), state


def test_export_series_are_bounded_at_100000_ranks() -> None:
    """At the default export_top_ranks (8) the whole job serves at most: the publisher's
    aggregates (job and 8 nodes: 3 + 3P each), 8 waits, 3 findings, the run info, plus the own
    series of 8 outlying ranks; the same bound at 1,000 and 100,000 ranks."""
    from stepscope.listeners.export.metrics import TOP_RANKS, outlying_ranks

    P = len(_PHASES)
    own = _own_series(100_000, 5)
    bound = (1 + TOP_RANKS) * (3 + 3 * P) + TOP_RANKS + 3 + 1 + TOP_RANKS * own
    slow = (337, 77_001)
    for world in (1_000, 100_000):
        payloads = _payloads(world, slow=slow)
        pub, state = _publisher_series(payloads, TOP_RANKS)
        outliers = outlying_ranks(list(payloads), TOP_RANKS)
        assert len(outliers) == TOP_RANKS
        if world == 100_000:
            assert set(slow) <= set(outliers)  # the slow ranks publish their own series
        else:
            assert 337 in outliers
        total = pub + len(outliers) * own
        assert total <= bound, (world, pub, own, total, bound)
        snap = state.snapshot()
        job = {dict(k)["stepscope.stat"]: v for k, v in snap["stepscope.ranks.phase.duration"].items()
               if dict(k)["stepscope.scope"] == "job" and dict(k)["stepscope.phase"] == "forward"}
        assert job["max"] > job["median"] + 0.03  # the slow ranks' 40 ms
        (who,) = [v for k, v in snap["stepscope.ranks.phase.max_rank"].items()
                  if dict(k)["stepscope.scope"] == "job" and dict(k)["stepscope.phase"] == "forward"]
        assert int(who) in slow
    assert bound < 400


def test_a_rank_serves_its_own_series_only_while_it_is_outlying() -> None:
    from stepscope.listeners.export.prometheus import _Collector

    world = 20
    payloads: list[dict[str, Any] | None] = list(_payloads(world, slow=(13,)))
    served = {}
    for rank in (13, 4):
        state = MetricState(rank=rank, run_id="r", hostname="h", world_size=world, top_ranks=1)
        listener = MetricsListener(state)
        listener.on_record({"step": 1, "step_ms": 10.0,
                            "phases": [{"name": "forward", "parent": None, "ms": 5.0}]})
        assert sum(len(f.samples) for f in _Collector(state).collect()) == 0  # no exchange yet
        listener.on_gather(payloads)
        served[rank] = sum(len(f.samples) for f in _Collector(state).collect())
    assert served[4] == 0 and served[13] > 0
    # export_top_ranks=None: every rank serves its own series, as in a small world.
    state = MetricState(rank=4, run_id="r", hostname="h", world_size=world, top_ranks=None)
    MetricsListener(state).on_record({"step": 1, "step_ms": 10.0, "phases": []})
    assert sum(len(f.samples) for f in _Collector(state).collect()) > 0


def test_every_node_with_top_ranks_none_and_bad_values_refused() -> None:
    payloads = _payloads(1_000)
    pub_all, _ = _publisher_series(payloads, None)
    pub_top, _ = _publisher_series(payloads, 8)
    assert pub_all > 10 * pub_top  # 125 nodes' aggregates and 256 waits
    with pytest.raises(ValueError, match="top_ranks must be an int >= 0 or None"):
        MetricState(rank=0, run_id="r", hostname="h", world_size=1, top_ranks=-1)
    from stepscope.recording.config import Config, ConfigError

    with pytest.raises(ConfigError, match="export_top_ranks must be"):
        Config(export_top_ranks="8")
