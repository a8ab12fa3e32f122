"""Metrics export: OpenTelemetry (OTLP/HTTP) and a Prometheus endpoint, fed from finished records.

Off by default; ``init(otel=True)`` and/or ``init(prometheus_port=9400)`` (or
``STEPSCOPE_OTEL=1`` / ``STEPSCOPE_PROMETHEUS_PORT=9400``) turn them on. A missing extra
(``pip install stepscope[otel]`` / ``[prometheus]``), a taken port or a dead collector gives
one ``StepscopeWarning`` and the job goes on. See :mod:`stepscope.listeners.export.metrics` for the
metric catalogue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepscope.listeners.export.metrics import CATALOGUE, MetricsListener, MetricState, attach_gather
from stepscope.listeners.export.otel import OtelBackend
from stepscope.listeners.export.prometheus import PrometheusBackend

if TYPE_CHECKING:
    from stepscope.recording.protocols import Run

__all__ = ["CATALOGUE", "MetricState", "MetricsListener", "attach_exporters"]


def attach_exporters(tracer: Run) -> MetricsListener | None:
    """Start the exporters ``tracer.config`` asks for and plug their listener into the tracer."""
    cfg = tracer.config
    info = tracer.rank
    state = MetricState(info.rank, tracer.run_id, info.hostname, info.world_size,
                        top_ranks=cfg.export_top_ranks)
    listener = MetricsListener(state, warn=lambda m: tracer.warn(m, key="export"))
    if cfg.otel:
        try:
            listener.backends.append(OtelBackend(state, warn=lambda m: tracer.warn(m, key="otel-export")))
        except ImportError as exc:
            tracer.warn(f"OpenTelemetry export is off: {exc} (pip install 'stepscope[otel]')", key="otel")
        except Exception as exc:  # protect the job: a bad OTEL_* setting only disables export
            tracer.warn(f"OpenTelemetry export is off: {exc!r}", key="otel")
    if cfg.prometheus_port is not None:
        port = cfg.prometheus_port + info.local_rank
        try:
            listener.backends.append(PrometheusBackend(state, port, cfg.prometheus_addr).start())
        except ImportError as exc:
            tracer.warn(f"Prometheus endpoint is off: {exc} (pip install 'stepscope[prometheus]')",
                        key="prometheus")
        except Exception as exc:  # protect the job: a taken port only disables the endpoint
            tracer.warn(f"Prometheus endpoint on {cfg.prometheus_addr}:{port} is off: {exc!r}",
                        key="prometheus")
    if not listener.backends:
        return None
    tracer.add_listener(listener)
    state.publisher = attach_gather(tracer, listener.on_gather)
    return listener
