"""The metric catalogue and the listener that turns finished records into current metric values.

One :class:`MetricsListener` per tracer keeps a :class:`MetricState`: the latest value of
every series, under a lock. Backends (:mod:`stepscope.listeners.export.otel`,
:mod:`stepscope.listeners.export.prometheus`) read that state on their own threads (an OTLP export
interval, a Prometheus scrape); the listener only writes it, on the tracer's writer thread
(``on_record``) and the live view's gather callback. Nothing here runs on the training
thread, does I/O, or touches a device.

The set of series is bounded: the catalogue is fixed, and each label takes a bounded set of
values (phase names: the canonical phases, ``residual`` and up to ``MAX_LABEL_VALUES`` user
names, then ``other``; collective ops likewise).

**Series that do not grow with the world.** By default (``top_ranks``, ``TOP_RANKS``) a rank
publishes its own series (:data:`OWN`: step, phases, collectives, throughput, memory) only
while it is one of the ``top_ranks`` most outlying ranks of the latest cross-rank exchange (or
while the world has no more ranks than that); every member ranks the same payloads the same
way (:func:`outlying_ranks`), so no extra communication decides it. The rank that prints the
exchange publishes the aggregates across ranks (:func:`rank_aggregates`): for the job and for
the ``top_ranks`` most outlying nodes, the median and the max of the ranks' median step and
phase durations, and which rank is the max. With ``top_ranks=None`` every rank publishes its
own series (one endpoint's worth per rank) and every node its aggregates.

Series at ``top_ranks = 8``, ``P`` phases in the exchange and ``S`` own series of one rank
(``S = 3 + P + ops + throughput, FLOP and memory series``): job ``3 + 3P``, nodes
``min(8, nodes) × (3 + 3P)``, waits ``min(8, ranks)``, findings 3, the run info of each
publishing rank, own ``min(8, ranks) × S``. Counted (``tests/unit/listeners/test_export.py``) with ``P = 5``
(dataloader, forward, backward, optimizer, residual), one collective op, throughput and memory
(``S = 15``), 8 ranks a node: 8 ranks 168 series, 1,000 ranks 294, 100,000 ranks 294. With
``top_ranks=None``: 1,000 ranks ~17,500; 100,000 ranks ~1.7 million (``100,000 × S`` plus
12,500 nodes' aggregates).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from statistics import median
from typing import TYPE_CHECKING, Any

from stepscope.common.escape import one_line
from stepscope.common.waits import waits  # the one wait rule (pure, as the live view uses)
from stepscope.listeners.live import cross_rank_summary
from stepscope.recording.schema import CANONICAL_PHASES

if TYPE_CHECKING:
    from stepscope.recording.protocols import Run

#: Distinct user-named values one label takes before the rest are folded into ``other``.
MAX_LABEL_VALUES = 16
#: Ranks published by the cross-rank findings with ``top_ranks=None`` (the first by rank id).
MAX_RANK_SERIES = 256
#: Default ``top_ranks``: the outlying ranks (and nodes) that publish per-rank (per-node) series.
TOP_RANKS = 8
OTHER = "other"

PHASE = "stepscope.phase"
OP = "stepscope.collective.op"
RANK = "stepscope.rank"
MEMORY_KIND = "stepscope.memory.kind"
SCOPE = "stepscope.scope"  # "job" or "node"
NODE = "stepscope.node"  # the host name ("" for the job)
STAT = "stepscope.stat"  # "median" or "max" across the scope's ranks


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

RANKS_STEP_DURATION = Metric(
    "stepscope.ranks.step.duration", "gauge", "s",
    "Across the ranks of the job or of one node: median and max of the ranks' median step "
    "duration, per the latest cross-rank exchange.", (SCOPE, NODE, STAT))
RANKS_STEP_MAX_RANK = Metric(
    "stepscope.ranks.step.max_rank", "gauge", "{rank}",
    "The rank with the longest median step duration in the job or node.", (SCOPE, NODE))
RANKS_PHASE_DURATION = Metric(
    "stepscope.ranks.phase.duration", "gauge", "s",
    "Across the ranks of the job or of one node: median and max of the ranks' median duration "
    "of each phase.", (SCOPE, NODE, PHASE, STAT))
RANKS_PHASE_MAX_RANK = Metric(
    "stepscope.ranks.phase.max_rank", "gauge", "{rank}",
    "The rank with the longest median duration of each phase in the job or node.", (SCOPE, NODE, PHASE))

CATALOGUE: tuple[Metric, ...] = (
    STEPS, STEP_DURATION, PHASE_DURATION, COLLECTIVE_DURATION, TOKENS_RATE, SAMPLES_RATE, TFLOPS, MFU,
    DEVICE_MEMORY, PROCESS_MEMORY, WAIT_DURATION, SLOWEST_RANK, SLOWEST_EXCESS, JOB_STEP_DURATION,
    RANKS_STEP_DURATION, RANKS_STEP_MAX_RANK, RANKS_PHASE_DURATION, RANKS_PHASE_MAX_RANK,
)
#: A rank's own series: published by every rank (``top_ranks=None``) or by the outlying ones.
OWN = frozenset(m.name for m in (STEPS, STEP_DURATION, PHASE_DURATION, COLLECTIVE_DURATION,
                                  TOKENS_RATE, SAMPLES_RATE, TFLOPS, MFU, DEVICE_MEMORY,
                                  PROCESS_MEMORY))

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
        v = one_line(value)  # a label value a scraper or collector shows: nothing invisible
        if v in self.known or v in self.extra:
            return v
        if len(self.extra) < self.cap and len(v) <= 64:
            self.extra.add(v)
            return v
        return OTHER


class MetricState:
    """The current value of every series, keyed by metric name, read by the backends."""

    def __init__(self, rank: int, run_id: str, hostname: str, world_size: int,
                 top_ranks: int | None = TOP_RANKS) -> None:
        if top_ranks is not None and (isinstance(top_ranks, bool) or not isinstance(top_ranks, int)
                                      or top_ranks < 0):
            raise ValueError(f"top_ranks must be an int >= 0 or None; got {top_ranks!r}")
        self.rank = rank
        self.run_id = one_line(run_id)  # label values and resource attributes
        self.hostname = one_line(hostname)
        self.world_size = world_size
        self.top_ranks = top_ranks
        #: Whether this rank's own series (:data:`OWN`) are published now: always in a world of
        #: at most ``top_ranks`` ranks, else while the latest exchange ranks it among them.
        self.publish_own = top_ranks is None or world_size <= top_ranks
        #: Whether this rank publishes the cross-rank series (it prints the exchange).
        self.publisher = False
        self._lock = threading.Lock()
        self._values: dict[str, Series] = {m.name: {} for m in CATALOGUE}

    @property
    def publishing(self) -> bool:
        """Whether this rank publishes any series now (the run info goes with them)."""
        return self.publish_own or self.publisher

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
        """A copy of every published series (the backends' threads read this)."""
        with self._lock:
            own = self.publish_own
            return {k: dict(v) if own or k not in OWN else {} for k, v in self._values.items()}


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
        """The live view's cross-rank exchange (writer thread, every member): whether this
        rank publishes its own series; on the publisher, the findings and aggregates."""
        if self.broken:
            return
        try:
            state = self.state
            top = state.top_ranks
            if top is None or not (state.publisher or state.world_size > top):
                ranked = []
            else:
                ranked = ranked_outliers(payloads)
            if top is not None and state.world_size > top:
                state.publish_own = state.rank in ranked[:top]
            if state.publisher:
                self._findings(payloads, ranked)
        except Exception as exc:  # protect the job: the live view's exchange must go on
            self._break(exc)

    def _findings(self, payloads: list[dict[str, Any] | None], ranked: list[int]) -> None:
        got = [p for p in payloads if p]
        summary = cross_rank_summary(list(payloads), self.state.world_size)
        if summary is None:
            return
        per_rank: dict[int, float] = {int(p["r"]): 0.0 for p in got}
        if len(got) > 1 and all(p.get("c") for p in got):
            for key in set.intersection(*(set(p["c"]) for p in got)):
                for r, w in waits({int(p["r"]): float(p["c"][key]) for p in got}).items():
                    per_rank[r] += w
        top = self.state.top_ranks
        ranks = sorted(per_rank)[:MAX_RANK_SERIES] if top is None else sorted(ranked[:top])
        ranks = [r for r in ranks if r in per_rank]
        self.state.replace(rank_aggregates(payloads, self._finding_phases, top, ranked))
        self.state.replace({
            WAIT_DURATION.name: {((RANK, str(r)),): per_rank[r] / 1000.0 for r in ranks},
            SLOWEST_RANK.name: _one(summary["slowest_rank"]),
            SLOWEST_EXCESS.name: {((PHASE, self._finding_phases(summary["slowest_phase"])),):
                                  max(0.0, float(summary["slowest_phase_excess_ms"])) / 1000.0},
            JOB_STEP_DURATION.name: _one(float(summary["step_ms_median"]) / 1000.0),
        })

    # ------------------------------------------------------------ finish

    def on_closed(self, tracer: Run) -> None:
        """After ``finish()`` wrote the last record: a final export, then the backends stop."""
        for b in self.backends:
            b.close()


def attach_gather(tracer: Run, fn: Callable[[list[dict[str, Any] | None]], None]) -> bool:
    """Register ``fn`` for the live view's exchanges on every member, and this rank's host name
    in its payload (``e.h``: the node aggregates); True on the rank that prints them (the one
    that publishes the cross-rank series)."""
    view = tracer.live
    if view is None or not getattr(view, "distributed", False):
        return False
    host = tracer.rank.hostname
    view.payload_extras.append(lambda: {"h": host})
    view.gather_callbacks.append(fn)
    return bool(getattr(view, "printer", False))


# ------------------------------------------------------------ across ranks


def _rank_values(p: dict[str, Any]) -> dict[str, float]:
    """One payload's median step (``""``) and phase durations, in ms."""
    out = {"": float(p["m"])}
    for name, v in (p.get("p") or {}).items():
        out[name] = float(v[0])
    return out


def ranked_outliers(payloads: list[dict[str, Any] | None]) -> list[int]:
    """Every rank of the exchange, the one whose median step or phase durations lie furthest
    from the median across ranks first (in ms; ties by rank id). Deterministic: every member,
    given the same payloads, ranks them the same way."""
    got = [p for p in payloads if p]
    if not got:
        return []
    vals = {int(p["r"]): _rank_values(p) for p in got}
    names = {n for v in vals.values() for n in v}
    mids = {n: median([v.get(n, 0.0) for v in vals.values()]) for n in names}
    score = {r: max(abs(v.get(n, 0.0) - mids[n]) for n in names) for r, v in vals.items()}
    return sorted(score, key=lambda r: (-score[r], r))


def outlying_ranks(payloads: list[dict[str, Any] | None], k: int) -> list[int]:
    """The ``k`` most outlying ranks of :func:`ranked_outliers`."""
    return ranked_outliers(payloads)[:max(k, 0)]


def _stats(values: dict[int, float]) -> tuple[float, float, int]:
    top = max(values, key=lambda r: (values[r], -r))
    return median(values.values()), values[top], top


def rank_aggregates(payloads: list[dict[str, Any] | None], phase_label: Callable[[Any], str],
                    top_nodes: int | None, ranked: list[int] | None = None) -> dict[str, Series]:
    """Median, max and the max's rank of the ranks' median step and phase durations, for the
    job and per node (host name from ``e.h``; the ``top_nodes`` most outlying nodes, all with
    ``None``), as the :data:`RANKS_STEP_DURATION` … :data:`RANKS_PHASE_MAX_RANK` series.
    ``ranked``: :func:`ranked_outliers` of these payloads, when the caller has it."""
    got = [p for p in payloads if p]
    step: Series = {}
    step_rank: Series = {}
    phase: Series = {}
    phase_rank: Series = {}
    if not got:
        return {RANKS_STEP_DURATION.name: step, RANKS_STEP_MAX_RANK.name: step_rank,
                RANKS_PHASE_DURATION.name: phase, RANKS_PHASE_MAX_RANK.name: phase_rank}
    vals = {int(p["r"]): _rank_values(p) for p in got}
    hosts: dict[str, list[int]] = {}
    for p in got:
        hosts.setdefault(str((p.get("e") or {}).get("h") or "?"), []).append(int(p["r"]))
    scopes: list[tuple[str, str, list[int]]] = [("job", "", list(vals))]
    if top_nodes is None:
        nodes = sorted(hosts)
    else:
        outlying = ranked if ranked else ranked_outliers(payloads)
        order = {r: i for i, r in enumerate(outlying)}
        nodes = sorted(hosts, key=lambda h: (min(order[r] for r in hosts[h]), h))[:top_nodes]
    scopes += [("node", h, hosts[h]) for h in nodes]
    for scope, node, ranks in scopes:
        names: dict[str, None] = {}
        for r in ranks:
            names.update(dict.fromkeys(vals[r]))
        for name in names:
            per = {r: vals[r][name] for r in ranks if name in vals[r]}
            mid, high, who = _stats(per)
            if name == "":
                step[((SCOPE, scope), (NODE, node), (STAT, "median"))] = mid / 1000.0
                step[((SCOPE, scope), (NODE, node), (STAT, "max"))] = high / 1000.0
                step_rank[((SCOPE, scope), (NODE, node))] = float(who)
            else:
                label = (PHASE, phase_label(name))
                phase[((SCOPE, scope), (NODE, node), label, (STAT, "median"))] = mid / 1000.0
                phase[((SCOPE, scope), (NODE, node), label, (STAT, "max"))] = high / 1000.0
                phase_rank[((SCOPE, scope), (NODE, node), label)] = float(who)
    return {RANKS_STEP_DURATION.name: step, RANKS_STEP_MAX_RANK.name: step_rank,
            RANKS_PHASE_DURATION.name: phase, RANKS_PHASE_MAX_RANK.name: phase_rank}
