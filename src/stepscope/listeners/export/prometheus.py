"""A Prometheus endpoint: the :class:`MetricState` served by ``prometheus-client`` on one port per rank.

Each rank listens on ``base port + local rank`` (so one node's ranks never collide and a
scrape config lists ``base..base+ranks_per_node-1`` per node). The server runs on
``prometheus-client``'s own thread; a scrape copies the state under its lock. Names follow
the OpenTelemetry → Prometheus translation (``stepscope.step.duration`` in seconds →
``stepscope_step_duration_seconds``); every series carries ``stepscope_rank``, and
``stepscope_run_info`` (value 1) carries the run id, host and world size. Which series a rank
serves (its own, the aggregates across ranks, or none) is decided in
:mod:`stepscope.listeners.export.metrics` (``export_top_ranks``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from stepscope.listeners.export.metrics import CATALOGUE, RANK, MetricState, prometheus_label


class _Collector:
    """A ``prometheus_client`` custom collector over :class:`MetricState`."""

    def __init__(self, state: MetricState) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        snap = self.state.snapshot()
        rank = str(self.state.rank)
        if self.state.publishing:  # a rank that publishes nothing now adds no series at all
            yield InfoMetricFamily("stepscope_run", "The run this rank belongs to.", value={
                "run_id": self.state.run_id, "host": self.state.hostname,
                "world_size": str(self.state.world_size), prometheus_label(RANK): rank})
        for m in CATALOGUE:
            series = snap.get(m.name) or {}
            keys = [prometheus_label(k) for k in m.labels]
            if prometheus_label(RANK) not in keys:
                keys.append(prometheus_label(RANK))
            name = m.prometheus_name
            if m.kind == "counter":
                fam: Any = CounterMetricFamily(name.removesuffix("_total"), m.description, labels=keys)
            else:
                fam = GaugeMetricFamily(name, m.description, labels=keys)
            for labels, value in sorted(series.items()):
                d = {prometheus_label(k): v for k, v in labels}
                d.setdefault(prometheus_label(RANK), rank)
                fam.add_metric([d[k] for k in keys], value)
            yield fam


class PrometheusBackend:
    """Serves :class:`MetricState` over HTTP at ``http://addr:port/metrics``.

    Example::

        backend = PrometheusBackend(state, port=9400 + local_rank)
        backend.start()   # OSError when the port is taken
    """

    def __init__(self, state: MetricState, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry

        self.state = state
        self.port = port
        self.addr = addr
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(state))
        self._server: Any = None
        self._thread: Any = None

    def start(self) -> PrometheusBackend:
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(self.port, addr=self.addr, registry=self.registry)
        self.port = int(self._server.server_address[1])  # the real port when 0 was asked for
        return self

    def close(self) -> None:
        server = self._server
        self._server = None
        if server is not None:
            # protect the job: a server that fails to stop is a daemon thread; exit goes on
            with contextlib.suppress(Exception):
                server.shutdown()
                server.server_close()
