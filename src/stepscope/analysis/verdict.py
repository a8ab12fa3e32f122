"""A verdict: one finding of the analysis (what happened, what it cost, what to do).

Every verdict producer (the run's diagnosis, resources, pipeline, experts, coverage and the
trace analyser) makes :class:`Verdict` objects; the JSON report holds their
:meth:`Verdict.to_dict` form, whose keys are the contract::

    {"kind": "straggler", "severity": "critical", "cost": {...}, "subject": "rank 3 slow in
     dataloader", "evidence": "...", "suggestion": "...", "rank": 3, "phase": "dataloader",
     "consequences": [{"kind": "comm_wait", "subject": "...", "evidence": "..."}]}

``cost``, ``subject``, ``rank``, ``phase`` and ``consequences`` are left out when absent.
The trace report (``stepscope trace``) holds the shorter :meth:`Verdict.to_trace_dict` form:
``{"rank": "3", "kind": ..., "message": ...}``.

Example::

    v = Verdict(kind="balanced", severity="info", evidence="4 rank(s) stay within noise",
                suggestion="No straggler to fix")
    doc["verdicts"].append(v.to_dict())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Severities, most severe first (the report's order).
SEVERITIES = ("critical", "warning", "info")

#: Every kind of finding, with what it means.
KINDS = {
    # The run's findings (``stepscope report``).
    "straggler": "a rank (or every rank of a host) spends longer than the others in a phase",
    "comm_wait": "ranks wait in a collective for the last rank to arrive",
    "input_bound": "the dataloader takes a large share of step time",
    "h2d_bound": "host-to-device copies take (or a PrefetchLoader hides) step time",
    "host_overhead": "untimed host work between phases takes a large share of step time",
    "comm_bound": "exposed communication is the largest part of the time held",
    "compute_bound": "model compute dominates the step",
    "balanced": "no rank or step window costs the job a noticeable share of its time",
    "goodput_loss": "a large goodput loss that no finding accounts for",
    "goodput": "the goodput a straggler cost (a consequence only)",
    "expert_imbalance": "one rank receives more of the all-to-all's routed tokens",
    "memory_pressure": "the CUDA caching allocator retried or ran out of memory",
    "memory_creep": "memory rises steadily over the run (a leak)",
    "throttled_device": "a device runs at a lower clock or power than its peers",
    "pipeline_bubble": "pipeline stages wait on the bottleneck stage",
    "blind_collectives": "collectives the job issues that stepscope cannot time",
    # The trace analyser's findings (``stepscope trace``).
    "exposed_comm": "communication not hidden behind compute takes a large share of step time",
    "launch_bound": "many tiny kernels: the step is bound by kernel launches",
    "memcpy_heavy": "memory copies and sets alone take a large share of step time",
    "idle_heavy": "the GPU is idle for a large share of step time",
}


_CHECKED: dict[str, Any] = {"kind": KINDS, "severity": SEVERITIES}


def _check(name: str, value: object, allowed: Any) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"verdict {name} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(kw_only=True, eq=False)
class Consequence:
    """Another finding priced on a cause's cost: the same fault seen from elsewhere."""

    kind: str
    subject: str
    evidence: str

    def __post_init__(self) -> None:
        _check("kind", self.kind, KINDS)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "subject": self.subject, "evidence": self.evidence}


@dataclass(kw_only=True, eq=False)
class Verdict:
    """One finding. ``cost`` is the block of :func:`stepscope.analysis.cost.price`; findings
    that are one fault seen from several places share the same cost object (identity, not
    equality: :func:`stepscope.analysis.cost.fold` groups on it)."""

    kind: str
    severity: str
    evidence: str
    #: What to do; empty where the evidence says it all (some trace findings).
    suggestion: str
    cost: dict[str, Any] | None = None
    #: What the finding is about, in words ("rank 3 slow in dataloader").
    subject: str | None = None
    #: The rank (and phase) of a rank's straggler finding.
    rank: int | None = None
    phase: str | None = None
    #: Findings folded into this one (the cause): see :func:`stepscope.analysis.cost.fold`.
    consequences: list[Consequence] = field(default_factory=list)

    def __setattr__(self, name: str, value: Any) -> None:
        # Checked on every assignment: a later stage may lower a finding's severity.
        if name in _CHECKED:
            _check(name, value, _CHECKED[name])
        super().__setattr__(name, value)

    def to_dict(self) -> dict[str, Any]:
        """The report's form: optional keys left out when absent."""
        out: dict[str, Any] = {"kind": self.kind, "severity": self.severity}
        if self.cost is not None:
            out["cost"] = self.cost
        if self.subject is not None:
            out["subject"] = self.subject
        out["evidence"] = self.evidence
        out["suggestion"] = self.suggestion
        if self.rank is not None:
            out["rank"] = self.rank
        if self.phase is not None:
            out["phase"] = self.phase
        if self.consequences:
            out["consequences"] = [c.to_dict() for c in self.consequences]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        """The inverse of :meth:`to_dict` (a verdict read back from a report)."""
        return cls(kind=d["kind"], severity=d["severity"], evidence=d["evidence"],
                   suggestion=d["suggestion"], cost=d.get("cost"), subject=d.get("subject"),
                   rank=d.get("rank"), phase=d.get("phase"),
                   consequences=[Consequence(**c) for c in d.get("consequences") or ()])

    def to_trace_dict(self) -> dict[str, str]:
        """The trace report's form: the rank as text (empty for the whole job) and one
        message, the evidence then the suggestion."""
        return {"rank": "" if self.rank is None else str(self.rank), "kind": self.kind,
                "message": f"{self.evidence} {self.suggestion}" if self.suggestion
                else self.evidence}
