"""Coverage sections: what the report adds for pipeline, expert parallel and unseen paths.

Called once by :mod:`stepscope.analysis.run` after the wait attribution (tables ``collective_waits`` and
``steps`` exist). Each section is added only when the run uses that mechanism, and its
verdicts join the others, most severe first.
"""

from __future__ import annotations

from typing import Any

from stepscope.analysis import cost
from stepscope.analysis.experts import expert_verdicts, experts_section
from stepscope.analysis.pipeline import explain_host_overhead, pipeline_section, pipeline_verdicts
from stepscope.analysis.verdict import Verdict
from stepscope.common.unseen import UNSEEN


def add_coverage_sections(con: Any, doc: dict[str, Any]) -> None:
    """Add ``pipeline``, ``experts`` and ``blind`` (when present) to ``doc``, and their
    :class:`Verdict` objects to ``doc["verdicts"]`` (the run's, not yet serialised)."""
    added: list[Verdict] = []
    pipe = pipeline_section(con, [int(s["rank"]) for s in doc["stragglers"]])
    if pipe is not None:
        doc["pipeline"] = pipe
        added += pipeline_verdicts(pipe, doc["verdicts"])
        explain_host_overhead(doc["verdicts"])
    experts = experts_section(con, doc["run"]["step_ms"]["median"] or 0.0)
    if experts is not None:
        doc["experts"] = experts
        added += expert_verdicts(experts, doc["run"])
    blind = blind_section(con, doc)
    if blind:
        doc["blind"] = blind
        added += blind_verdicts(blind, doc)
        caveat_unseen_waits(doc["verdicts"], blind)
    if added:
        verdicts = doc["verdicts"] + added
        if any(v.severity != "info" for v in added):
            # A costly imbalance or a blind path contradicts "balanced".
            verdicts = [v for v in verdicts if v.kind != "balanced"]
        cost.order(verdicts)
        doc["verdicts"] = verdicts


def blind_section(con: Any, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Collective paths the job used that stepscope does not time, each with its evidence.

    From the records' ``unseen_<path>`` counters (table ``unseen_collectives``); ``untimed`` (a group that
    carried only C++-issued collectives) not in a DDP job, whose C++ all-reduce is ``grad_sync``.
    (A multi-rank run with
    no collective timing at all already says so in its collectives notes: waits estimated
    from the timeline.)
    """
    out = []
    n_steps = max(1, int(doc["run"]["steps"]))
    # DDP's bucketed all-reduce is issued from C++ on purpose: it is timed as grad_sync.
    ddp = any(str(p).split("/")[-1] == "grad_sync" for p in doc["phases"])
    for path, ranks, calls in con.execute(
        "SELECT path, list(DISTINCT rank ORDER BY rank), sum(n) FROM unseen_collectives GROUP BY 1 ORDER BY 1"
    ).fetchall():
        if path == "untimed" and ddp:
            continue
        # "compiled" counts calls traced into a graph (once per compilation, not per run of it).
        out.append({"path": str(path), "ranks": [int(r) for r in ranks],
                    "calls": int(calls), "calls_per_step": round(float(calls) / n_steps, 3),
                    "what": UNSEEN.get(str(path), str(path))})
    return out


def caveat_unseen_waits(verdicts: list[Verdict], blind: list[dict[str, Any]]) -> None:
    """Collectives issued from C++ (``untimed``) run outside every timed phase, so the time
    ranks wait in them is ``residual``: a residual straggler or ``host_overhead`` may be that
    wait, not host work. Such findings become notes that say so; the late rank, found in the
    phase it really spent longer in, keeps its severity."""
    if not any(b["path"] == "untimed" for b in blind):
        return
    for v in verdicts:
        if v.kind == "host_overhead" or (v.kind == "straggler" and v.phase == "residual"):
            v.severity = "info"
            v.evidence += ("; this time may be waiting in collectives issued from C++, which "
                              "stepscope cannot see (blind_collectives), not host work")


def blind_verdicts(blind: list[dict[str, Any]], doc: dict[str, Any]) -> list[Verdict]:
    """One ``blind_collectives`` warning naming every unseen path."""
    if not blind:
        return []
    paths = "; ".join(f"{b['path']} on rank(s) {', '.join(str(r) for r in b['ranks'][:8])}"
                      + (f" ({b['calls']} collective call(s) traced into compiled graphs)"
                         if b["path"] == "compiled" else f" ({b['calls_per_step']:g} calls per step)")
                      + f": {b['what']}" for b in blind)
    return [Verdict(
        # Its cost is unknown by definition: waits there are not measured.
        kind="blind_collectives", severity="warning",
        cost=cost.no_cost(doc["run"].get("cost") or {}),
        evidence=f"stepscope cannot see every collective this job issues — {paths}. Waits in "
        "those collectives are not attributed to a rank: they count as the calling phase's own "
        "work, so a straggler behind them can be missed or a 'balanced' verdict can be wrong",
        suggestion="Call torch.distributed's Python functions (not torch.ops directly, and "
        "not bound by name before stepscope.init), keep collectives out of compiled regions "
        "while diagnosing, or time the region with stepscope.phase(...)",
    )]
