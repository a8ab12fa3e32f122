"""The metric catalogue and the listener that turns finished records into current metric values.

One :class:`MetricsListener` per tracer keeps a :class:`MetricState`: the latest value of
every series, under a lock. Backends (:mod:`stepscope.export.otel`,
:mod:`stepscope.export.prometheus`) read that state on their own threads (an OTLP export
interval, a Prometheus scrape); the listener only writes it, on the tracer's writer thread
(``on_record``) and the live view's gather callback. Nothing here runs on the training
thread, does I/O, or touches a device.

The set of series is bounded: the catalogue is fixed, and each label takes a bounded set of
values (phase names: the canonical phases, ``residual`` and up to ``MAX_LABEL_VALUES`` user
names, then ``other``; collective ops likewise; ranks up to the world size, capped).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stepscope.records import CANONICAL_PHASES

if TYPE_CHECKING:
    from stepscope.tracer import Tracer

#: Distinct user-named values one label takes before the rest are folded into ``other``.
MAX_LABEL_VALUES = 16
#: Ranks published by the cross-rank findings (the first ones by rank id).
MAX_RANK_SERIES = 256
OTHER = "other"

PHASE = "stepscope.phase"
OP = "stepscope.collective.op"
RANK = "stepscope.rank"
MEMORY_KIND = "stepscope.memory.kind"


@dataclass(frozen=True)
class Metric:
    """One instrument: OpenTelemetry name, kind, UCUM unit, description and label keys."""

    name: str
    kind: str  # "gauge" or "counter"
    unit: str
    description: str
    labels: tuple[str, ...] = ()

    @property
    def prometheus_name(self) -> str:
        """The OpenTelemetry → Prometheus translation: dots to underscores, unit suffix, _total."""
        base = self.name.replace(".", "_")
        suffix = {"s": "_seconds", "By": "_bytes", "1": "_ratio", "{token}/s": "_tokens_per_second",
                  "{sample}/s": "_samples_per_second", "TFLOP/s": "_teraflops_per_second",
                  "{step}": ""}.get(self.unit, "")
        if suffix and not base.endswith(suffix):
            base += suffix
        return base + ("_total" if self.kind == "counter" else "")


def prometheus_label(key: str) -> str:
    return key.replace(".", "_")


STEPS = Metric("stepscope.steps", "counter", "{step}", "Sampled training steps recorded by this rank.")
STEP_DURATION = Metric("stepscope.step.duration", "gauge", "s",
                       "Duration of the rank's last recorded training step.")
PHASE_DURATION = Metric("stepscope.phase.duration", "gauge", "s",
                        "Duration of each top-level phase in the last recorded step.", (PHASE,))
COLLECTIVE_DURATION = Metric("stepscope.collective.duration", "gauge", "s",
                             "Time in collectives (wait and transfer) in the last recorded step, by op.",
                             (OP,))
TOKENS_RATE = Metric("stepscope.throughput.tokens", "gauge", "{token}/s",
                     "Tokens per second over the last recorded step.")
SAMPLES_RATE = Metric("stepscope.throughput.samples", "gauge", "{sample}/s",
                      "Samples per second over the last recorded step.")
TFLOPS = Metric("stepscope.compute.flops", "gauge", "TFLOP/s",
                "Achieved TFLOP/s over the last recorded step (flops_per_step / step time).")
MFU = Metric("stepscope.compute.utilization", "gauge", "1",
             "Model FLOPs utilisation: achieved over peak FLOP/s of one device.")
DEVICE_MEMORY = Metric("stepscope.device.memory.usage", "gauge", "By",
                       "Device memory of the last recorded step: peak allocated, peak reserved, allocated.",
                       (MEMORY_KIND,))
PROCESS_MEMORY = Metric("process.memory.usage", "gauge", "By",
                        "Resident set size of the rank's process (OpenTelemetry semantic convention).")
WAIT_DURATION = Metric("stepscope.wait.duration", "gauge", "s",
                       "Per rank: median time per step spent waiting in collectives for later ranks "
                       "(cross-rank finding, from the live view's exchange).", (RANK,))
SLOWEST_RANK = Metric("stepscope.finding.slowest_rank", "gauge", "1",
                      "The rank the others wait for, per the latest cross-rank exchange.")
SLOWEST_EXCESS = Metric("stepscope.finding.excess.duration", "gauge", "s",
                        "How much longer the slowest rank's phase takes than the other ranks' median.",
                        (PHASE,))
JOB_STEP_DURATION = Metric("stepscope.job.step.duration", "gauge", "s",
                           "Median step duration across ranks, per the latest cross-rank exchange.")

CATALOGUE: tuple[Metric, ...] = (
    STEPS, STEP_DURATION, PHASE_DURATION, COLLECTIVE_DURATION, TOKENS_RATE, SAMPLES_RATE, TFLOPS, MFU,
    DEVICE_MEMORY, PROCESS_MEMORY, WAIT_DURATION, SLOWEST_RANK, SLOWEST_EXCESS, JOB_STEP_DURATION,
)

_MB = 1024 * 1024
_MEMORY_KEYS = (("peak_allocated_mb", "peak_allocated"), ("peak_reserved_mb", "peak_reserved"),
                ("allocated_mb", "allocated"))

Series = dict[tuple[tuple[str, str], ...], float]


class _Bounded:
    """Maps free-form label values into a bounded set: known ones, the first ``cap`` others, ``other``."""

    def __init__(self, known: Iterable[str], cap: int = MAX_LABEL_VALUES) -> None:
        self.known = set(known)
        self.cap = cap
        self.extra: set[str] = set()

    def __call__(self, value: Any) -> str:
        v = str(value)
        if v in self.known or v in self.extra:
            return v
        if len(self.extra) < self.cap and len(v) <= 64:
            self.extra.add(v)
            return v
        return OTHER


class MetricState:
    """The current value of every series, keyed by metric name, read by the backends."""

    def __init__(self, rank: int, run_id: str, hostname: str, world_size: int) -> None:
        self.rank = rank
        self.run_id = run_id
        self.hostname = hostname
        self.world_size = world_size
        self._lock = threading.Lock()
        self._values: dict[str, Series] = {m.name: {} for m in CATALOGUE}

    def replace(self, updates: dict[str, Series]) -> None:
        """Swap in new series for the named metrics (the old label sets of those metrics go)."""
        with self._lock:
            for name, series in updates.items():
                self._values[name] = series

    def add(self, name: str, value: float) -> None:
        with self._lock:
            cur = self._values[name]
            cur[()] = cur.get((), 0.0) + value

    def snapshot(self) -> dict[str, Series]:
        """A copy of every series (the backends' threads read this)."""
        with self._lock:
            return {k: dict(v) for k, v in self._values.items()}


def _one(value: Any) -> Series:
    return {(): float(value)}


class MetricsListener:
    """A tracer listener (``on_record`` on the writer thread) that keeps :class:`MetricState` current.

    Example::

        listener = MetricsListener(state)
        tracer.add_listener(listener)
        PrometheusBackend(state, port=9400).start()
    """

    def __init__(self, state: MetricState, warn: Callable[[str], None] | None = None) -> None:
        self.state = state
        self.backends: list[Any] = []
        self.warn = warn
        self.broken = False
        self._phases = _Bounded([*CANONICAL_PHASES, "residual"])
        self._ops = _Bounded(["all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
                              "all_to_all", "send", "recv"])
        self._finding_phases = _Bounded([*CANONICAL_PHASES, "residual"])

    # ------------------------------------------------------------ writer thread

    def on_record(self, record: dict[str, Any]) -> None:
        if self.broken:
            return
        try:
            self._update(record)
        except Exception as exc:  # protect the job: the writer thread must keep writing records
            self._break(exc)

    def _break(self, exc: BaseException) -> None:
        self.broken = True
        if self.warn is not None:
            self.warn(f"metrics export stopped updating after an internal error: {exc!r}")

    def _update(self, record: dict[str, Any]) -> None:
        if record.get("untimed"):
            return  # the FLOP-counting step is not a timing sample
        upd: dict[str, Series] = {}
        step_ms = record.get("step_ms")
        if isinstance(step_ms, int | float):
            upd[STEP_DURATION.name] = _one(step_ms / 1000.0)
        phases: Series = {}
        for p in record.get("phases") or ():
            if p.get("parent") is None and isinstance(p.get("ms"), int | float):
                key = ((PHASE, self._phases(p.get("name"))),)
                phases[key] = phases.get(key, 0.0) + p["ms"] / 1000.0
        if isinstance(record.get("residual_ms"), int | float):
            phases[((PHASE, "residual"),)] = record["residual_ms"] / 1000.0
        upd[PHASE_DURATION.name] = phases
        colls: Series = {}
        for c in record.get("collectives") or ():
            if isinstance(c.get("ms"), int | float):
                key = ((OP, self._ops(c.get("op"))),)
                colls[key] = colls.get(key, 0.0) + c["ms"] / 1000.0
        upd[COLLECTIVE_DURATION.name] = colls
        thr = record.get("throughput") or {}
        upd[TOKENS_RATE.name] = _one(thr["tokens_per_s"]) if "tokens_per_s" in thr else {}
        upd[SAMPLES_RATE.name] = _one(thr["samples_per_s"]) if "samples_per_s" in thr else {}
        fl = record.get("flops") or {}
        upd[TFLOPS.name] = _one(fl["tflops"]) if "tflops" in fl else {}
        upd[MFU.name] = _one(fl["mfu"]) if "mfu" in fl else {}
        mem = record.get("memory") or {}
        upd[DEVICE_MEMORY.name] = {((MEMORY_KIND, kind),): float(mem[k]) * _MB
                                   for k, kind in _MEMORY_KEYS if isinstance(mem.get(k), int | float)}
        upd[PROCESS_MEMORY.name] = (_one(float(mem["rss_mb"]) * _MB)
                                    if isinstance(mem.get("rss_mb"), int | float) else {})
        self.state.replace(upd)
        self.state.add(STEPS.name, 1.0)

    def on_gather(self, payloads: list[dict[str, Any] | None]) -> None:
        """The live view's cross-rank exchange (writer thread): waits and the slowest rank."""
        if self.broken:
            return
        try:
            self._findings(payloads)
        except Exception as exc:  # protect the job: the live view's exchange must go on
            self._break(exc)

    def _findings(self, payloads: list[dict[str, Any] | None]) -> None:
        from stepscope.common.waits import waits  # the one wait rule (pure, as the live view uses)
        from stepscope.live import cross_rank_summary

        got = [p for p in payloads if p]
        summary = cross_rank_summary(list(payloads), self.state.world_size)
        if summary is None:
            return
        per_rank: dict[int, float] = {int(p["r"]): 0.0 for p in got}
        if len(got) > 1 and all(p.get("c") for p in got):
            for key in set.intersection(*(set(p["c"]) for p in got)):
                for r, w in waits({int(p["r"]): float(p["c"][key]) for p in got}).items():
                    per_rank[r] += w
        ranks = sorted(per_rank)[:MAX_RANK_SERIES]
        self.state.replace({
            WAIT_DURATION.name: {((RANK, str(r)),): per_rank[r] / 1000.0 for r in ranks},
            SLOWEST_RANK.name: _one(summary["slowest_rank"]),
            SLOWEST_EXCESS.name: {((PHASE, self._finding_phases(summary["slowest_phase"])),):
                                  max(0.0, float(summary["slowest_phase_excess_ms"])) / 1000.0},
            JOB_STEP_DURATION.name: _one(float(summary["step_ms_median"]) / 1000.0),
        })

    # ------------------------------------------------------------ finish

    def on_closed(self, tracer: Tracer) -> None:
        """After ``finish()`` wrote the last record: a final export, then the backends stop."""
        for b in self.backends:
            b.close()


def attach_gather(tracer: Tracer, fn: Callable[[list[dict[str, Any] | None]], None]) -> bool:
    """Register ``fn`` for the live view's exchanges on the rank that prints them (one publisher)."""
    view = tracer.live
    if view is None or not getattr(view, "distributed", False) or not getattr(view, "printer", False):
        return False
    view.gather_callbacks.append(fn)
    return True
