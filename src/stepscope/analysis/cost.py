"""What each finding cost the job: time lost, steps affected, share of wall time and GPU-hours.

Every verdict carries a ``cost`` so findings can be ranked by what fixing them would buy,
and severity follows that price rather than how unusual a number looks:

* ``ms_per_step`` — time the job lost per affected step;
* ``steps`` — how many analysed steps it touched;
* ``lost_ms`` — wall time lost over those steps (``ms_per_step * steps``);
* ``share_of_wall`` — ``lost_ms`` over the job's summed step time (the analysed steps);
* ``gpu_ms`` / ``share_of_gpu_hours`` — device time lost: a straggler holds every rank of its
  collective, so it costs its excess times the world size; a phase every rank spends time in
  costs that time on every rank;
* ``what_if_step_ms`` — the median step time had the finding not happened.

A finding at or above ``CRITICAL_SHARE`` of the job is critical, at or above
``WARNING_SHARE`` a warning, anything below a note (``info``). Findings that cost no time
(memory growth, a device that runs slow with nobody waiting for it) keep their own severity
rule and a zero time cost.
"""

from __future__ import annotations

from typing import Any

from stepscope.analysis.verdict import SEVERITIES, Consequence, Verdict

#: Share of the job's time (wall and GPU-hours alike) at or above which a finding is critical.
CRITICAL_SHARE = 0.05
#: At or above this share a finding is a warning; below it, a note.
WARNING_SHARE = 0.01

SEVERITY_ORDER = {s: i for i, s in enumerate(SEVERITIES)}


def thresholds() -> dict[str, Any]:
    """The severity rule as it appears in the JSON report (``run.cost.thresholds``)."""
    return {
        "critical_share": CRITICAL_SHARE,
        "warning_share": WARNING_SHARE,
        "rule": (f"critical when a finding costs >= {100 * CRITICAL_SHARE:g}% of the job's "
                 f"step time (and device time), warning >= {100 * WARNING_SHARE:g}%, "
                 "otherwise a note"),
    }


def severity(share: float) -> str:
    """``critical`` / ``warning`` / ``info`` for a share of the job lost."""
    if share >= CRITICAL_SHARE:
        return "critical"
    if share >= WARNING_SHARE:
        return "warning"
    return "info"


def price(job: dict[str, Any], ms_per_step: float, steps: int, ranks_held: int,
          step_ms: float | None = None) -> dict[str, Any]:
    """The ``cost`` block of one finding.

    ``job`` is ``run["cost"]`` (``total_ms``: summed step time of the analysed steps, the
    median over ranks; ``world_size``; ``median_step_ms``). ``ranks_held`` is how many
    ranks' device time the loss occupies (the world size when everyone waits). ``step_ms``
    is the median step time where the finding acts (the run's median when omitted).
    """
    ms = max(0.0, float(ms_per_step))
    n = max(0, int(steps))
    total = float(job.get("total_ms") or 0.0)
    world = max(1, int(job.get("world_size") or 1))
    lost = ms * n
    gpu = lost * max(1, min(int(ranks_held), world))
    base = float(step_ms if step_ms is not None else job.get("median_step_ms") or 0.0)
    return {
        "ms_per_step": round(ms, 3),
        "steps": n,
        "lost_ms": round(lost, 3),
        "share_of_wall": round(lost / total, 4) if total > 0 else 0.0,
        "gpu_ms": round(gpu, 3),
        "share_of_gpu_hours": round(gpu / (total * world), 4) if total > 0 else 0.0,
        "what_if_step_ms": round(max(0.0, base - ms), 3),
    }


def no_cost(job: dict[str, Any]) -> dict[str, Any]:
    """The cost block of a finding that costs no step time (yet)."""
    return price(job, 0.0, 0, 1)


def share(cost: dict[str, Any]) -> float:
    """The larger of a cost's wall and GPU-hour shares: what severity is judged on."""
    return max(float(cost.get("share_of_wall") or 0.0), float(cost.get("share_of_gpu_hours") or 0.0))


def order(verdicts: list[Verdict]) -> None:
    """Sort in place: severity first, then time lost (most first); notes keep their order."""
    verdicts.sort(key=lambda v: (SEVERITY_ORDER[v.severity], -lost_ms(v)))


#: Kinds that, sharing a cost with another finding, are that finding's consequence: the ranks
#: that waited for it, the pipeline bubble it made, the phase share it raised.
CONSEQUENCE_KINDS = ("comm_wait", "pipeline_bubble", "input_bound", "h2d_bound", "host_overhead")


def _cause(group: list[Verdict]) -> Verdict:
    """The finding that names the fault among those priced on one cost. A straggler, except
    one whose late time lies outside every timed phase (``residual``) while a host-overhead
    finding says what that untimed work is: then that finding, with its fix, is the cause,
    at the straggler's severity, and the late rank is its evidence."""
    straggler = next((v for v in group if v.kind == "straggler"), None)
    host = next((v for v in group if v.kind == "host_overhead"), None)
    if straggler is not None and host is not None and straggler.phase == "residual":
        if SEVERITY_ORDER[straggler.severity] < SEVERITY_ORDER[host.severity]:
            host.severity = straggler.severity
        return host
    if straggler is not None:
        return straggler
    return next((v for v in group if v.kind not in CONSEQUENCE_KINDS), group[0])


def fold(verdicts: list[Verdict]) -> list[Verdict]:
    """One fault, one finding: verdicts that carry another's cost object (the same fault seen
    from elsewhere: the ranks that waited for a straggler, the bubble a slow stage made)
    leave the list and go into that finding's ``consequences`` (``kind``, ``subject``,
    ``evidence``), its evidence, priced once there. The finding kept is the cause: a
    straggler, else the first that is not a :data:`CONSEQUENCE_KINDS` kind. Returns the
    list without the folded verdicts (order kept)."""
    groups: dict[int, list[Verdict]] = {}
    for v in verdicts:
        c = v.cost
        if isinstance(c, dict) and c.get("lost_ms"):
            groups.setdefault(id(c), []).append(v)
    gone: set[int] = set()
    for group in groups.values():
        if len(group) < 2:
            continue
        cause = _cause(group)
        for v in group:
            if v is cause:
                continue
            cause.consequences.append(
                Consequence(kind=v.kind, subject=v.subject or v.kind, evidence=v.evidence))
            gone.add(id(v))
    return [v for v in verdicts if id(v) not in gone]


#: Goodput's loss categories in words, for the headline.
_LOSS_WORDS = {"stragglers": "waiting for late ranks", "exposed_comm": "exposed communication",
               "input_stalls": "input stalls", "host_overhead": "host overhead",
               "warmup": "warm-up", "outside_steps": "time outside steps", "restarts": "restarts"}
#: Goodput lost at or above this share is never headed "No costly finding".
LARGE_LOSS = 0.10


def _largest_loss(goodput: dict[str, Any] | None) -> tuple[str, float] | None:
    if not goodput or not goodput.get("gpu_hours"):
        return None
    lost = goodput.get("lost_gpu_hours") or {}
    if not lost:
        return None
    cat = max(lost, key=lambda k: float(lost[k] or 0.0))
    return cat, float(lost[cat] or 0.0) / float(goodput["gpu_hours"])


def headline(run: dict[str, Any], verdicts: list[Verdict],
             goodput: dict[str, Any] | None = None) -> str:
    """The report's first line: what the run lost and to what (the costliest cause); where no
    fault is found but goodput lost a large share, where that time went instead of "No
    costly finding"."""
    job = run.get("cost") or {}
    total_s = float(job.get("total_ms") or 0.0) / 1000.0
    # A wait verdict that carries its cause's cost is that cause seen from the waiters.
    seen: set[int] = set()
    costly = []
    for v in verdicts:
        c = v.cost or {}
        if c.get("lost_ms") and id(c) not in seen:
            seen.add(id(c))
            costly.append(v)
    loud = [v for v in costly if v.severity != "info"]
    if not loud:
        small = ""
        if costly:
            top = max(costly, key=lost_ms)
            small = (f" (largest note: {top.subject or top.kind}, "
                     f"{100 * share(top.cost or {}):.1f}% of the job)")
        loss = _largest_loss(goodput)
        if goodput and loss and 1.0 - float(goodput.get("goodput") or 0.0) >= LARGE_LOSS:
            cat, part = loss
            by = next((v for v in verdicts if v.subject == f"time lost to {cat}"
                       or v.kind == {"exposed_comm": "comm_bound", "input_stalls": "input_bound",
                                        "host_overhead": "host_overhead"}.get(cat)), None)
            return (f"No fault found (no straggler, slow window or stall cost the run >= "
                    f"{100 * WARNING_SHARE:g}% of its {total_s:.1f} s of step time); goodput "
                    f"{100 * float(goodput.get('goodput') or 0.0):.0f}%, the largest loss "
                    f"{_LOSS_WORDS.get(cat, cat)} ({100 * part:.0f}% of the time held"
                    + (f", see {by.kind}" if by else "") + ")")
        return (f"No costly finding: nothing in the job itself cost the run >= "
                f"{100 * WARNING_SHARE:g}% of its {total_s:.1f} s of step time{small}")
    top = max(loud, key=lost_ms)
    c = top.cost or {}
    return (f"The run lost {c['lost_ms'] / 1000.0:.2f} s ({100 * share(c):.1f}% of its "
            f"{total_s:.1f} s of step time, {c['ms_per_step']:.1f} ms on each of {c['steps']} "
            f"steps) to {top.kind}: {top.subject or top.kind}; without it a step "
            f"would take {c['what_if_step_ms']:.1f} ms")


def lost_ms(v: Verdict) -> float:
    """The wall time a finding lost (0 when it carries no cost)."""
    return float((v.cost or {}).get("lost_ms") or 0.0)
