"""OpenTelemetry metrics: the :class:`MetricState` as observable instruments, exported over OTLP/HTTP.

The exporter is the SDK's own ``OTLPMetricExporter``: the endpoint, headers, timeout and
compression come from the standard ``OTEL_EXPORTER_OTLP_*`` variables (``..._METRICS_...``
ones first), the interval from ``OTEL_METRIC_EXPORT_INTERVAL`` (ms, default 60000). Export
runs on the SDK's reader thread; the callbacks only copy the state. A failing export (no
collector, a refused connection) gives one ``StepscopeWarning``; the job never waits for it
beyond ``FINISH_WAIT_S`` at ``finish()``, and not at all once an export has failed.

Only the process that built the backend exports: the SDK restarts its reader thread in a
forked child (a DataLoader worker), whose copy of the state would send the parent's series
again, its step counter behind the parent's. In a child the callbacks observe nothing and the
exporter sends nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from stepscope.common.errors import warn
from stepscope.common.version import __version__
from stepscope.listeners.export.metrics import CATALOGUE, RANK, Metric, MetricState

#: Longest ``finish()`` waits for the last export (seconds); a dead collector is not waited for.
FINISH_WAIT_S = 5.0
#: An export still running after this many seconds is retrying against a collector that
#: refused or does not answer: ``finish()`` treats the collector as failed.
STUCK_S = 1.0
INSTRUMENTATION_SCOPE = "stepscope"


def resource_attributes(state: MetricState) -> dict[str, Any]:
    """Resource attributes (semantic conventions ``service.*``, ``host.name``) plus the run's own."""
    return {
        "service.name": "stepscope",
        "service.version": __version__,
        "service.instance.id": f"{state.run_id}/rank{state.rank}",
        "host.name": state.hostname,
        "stepscope.run.id": state.run_id,
        "stepscope.world_size": state.world_size,
    }


class _Guard:
    """Counts failed exports; the first one gives the warning."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self.failed = 0
        #: Set by ``close()`` after a failed export: the last export is not even tried.
        self.closing = False
        #: ``time.monotonic()`` when the export running now began (None: none runs). One that
        #: has run for ``STUCK_S`` is retrying against a collector that does not answer.
        self.busy_since: float | None = None
        self.pid = os.getpid()  # the process that exports (not a forked child)

    def note(self, why: str) -> None:
        self.failed += 1
        if self.failed == 1:
            self.warn(f"OpenTelemetry metrics export failed ({why}); training goes on, "
                      "export keeps retrying on its own thread")


def guarded_otlp_exporter(guard: _Guard) -> Any:
    """The SDK's ``OTLPMetricExporter`` (configured by ``OTEL_EXPORTER_OTLP_*``), failures to ``guard``."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import MetricExportResult

    class GuardedOTLPMetricExporter(OTLPMetricExporter):
        def export(self, metrics_data: Any, timeout_millis: float | None = 10_000, **kw: Any) -> Any:
            if os.getpid() != guard.pid:  # a forked child (DataLoader worker): the parent exports
                return MetricExportResult.SUCCESS
            if guard.closing:  # the collector already failed: the job's exit does not wait for it
                return MetricExportResult.FAILURE
            guard.busy_since = time.monotonic()
            try:
                result = super().export(metrics_data, timeout_millis=timeout_millis, **kw)
            except Exception as exc:  # protect the job: a broken exporter only loses this export
                guard.note(repr(exc))
                return MetricExportResult.FAILURE
            finally:
                guard.busy_since = None
            if result != MetricExportResult.SUCCESS:
                guard.note("the collector did not accept the metrics or could not be reached")
            return result

    return GuardedOTLPMetricExporter()


class OtelBackend:
    """Publishes :class:`MetricState` through an OpenTelemetry ``MeterProvider``.

    ``reader`` defaults to a ``PeriodicExportingMetricReader`` around ``OTLPMetricExporter``
    (configured by the ``OTEL_EXPORTER_OTLP_*`` variables); pass an ``InMemoryMetricReader``
    to read the metrics in process.

    Example::

        backend = OtelBackend(state)   # OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318
        ...
        backend.close()
    """

    def __init__(self, state: MetricState, reader: Any = None,
                 warn: Callable[[str], None] | None = None) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource

        self.state = state
        self._warn = warn or _warn
        self.guard: _Guard | None = None
        self._exporter: Any = None
        if reader is None:
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            self.guard = _Guard(self._warn)
            self._exporter = guarded_otlp_exporter(self.guard)
            reader = PeriodicExportingMetricReader(self._exporter)
        self.reader = reader
        self.provider = MeterProvider(metric_readers=[reader],
                                      resource=Resource.create(resource_attributes(state)))
        meter = self.provider.get_meter(INSTRUMENTATION_SCOPE)
        for m in CATALOGUE:
            make = meter.create_observable_counter if m.kind == "counter" else meter.create_observable_gauge
            make(m.name, callbacks=[self._callback(m)], unit=m.unit, description=m.description)

    def _callback(self, metric: Metric) -> Callable[[Any], Iterable[Any]]:
        from opentelemetry.metrics import Observation

        rank = str(self.state.rank)
        pid = os.getpid()

        def observe(options: Any) -> Sequence[Any]:
            if os.getpid() != pid:  # a forked child: only the process that called init() exports
                return []
            series = self.state.snapshot().get(metric.name, {})
            out = []
            for labels, value in series.items():
                attrs = dict(labels)
                attrs.setdefault(RANK, rank)  # findings carry the rank they are about
                out.append(Observation(value, attrs))
            return out

        return observe

    def close(self) -> None:
        """Export once more and stop, waiting at most ``FINISH_WAIT_S`` (a dead collector is left)."""
        # The collector already failed (an export failed, or one is still retrying): do not
        # hold the exit for it.
        guard = self.guard
        failed = guard is not None and (
            guard.failed > 0
            or (guard.busy_since is not None and time.monotonic() - guard.busy_since >= STUCK_S))
        if failed:
            assert guard is not None
            guard.closing = True
            # protect the job: stopping the exporter ends the retries of the export in flight
            with contextlib.suppress(Exception):
                self._exporter.shutdown()
        timeout_ms = 500.0 if failed else FINISH_WAIT_S * 1000.0

        def stop() -> None:
            # protect the job: a failure at shutdown only loses the last export
            with contextlib.suppress(Exception):
                self.provider.shutdown(timeout_millis=timeout_ms)

        t = threading.Thread(target=stop, name="stepscope-otel-shutdown", daemon=True)
        t.start()
        t.join(0.5 if failed else FINISH_WAIT_S)


def _warn(msg: str) -> None:
    warn(msg, stacklevel=2)
