"""Pipeline parallel: point-to-point waits between stages, the bubble and the bottleneck stage.

A pipeline stage exchanges activations and gradients with its neighbours through
point-to-point calls (``send``/``recv``/``isend``/``irecv``, also issued by
``batch_isend_irecv`` and ``torch.distributed.pipelining``). The recorder gives each call the
id of its link, ``"<group>:<src>><dst>"`` in global ranks, the same on both ends. A transfer
completes on both ends at about the same moment. All of a stage's time in these calls is
time waiting on its neighbours (its bubble; the transfer is part of it): waits, never host
overhead. Who made whom wait is the rule of :mod:`stepscope.common.waits` applied to the
two ends of a link as to the members of a collective: per step and link, an end's time in
its calls minus the other end's is time it spent waiting for the other end (a receiver for a
late upstream stage, or a sender for a downstream stage that posts its receive late).

The report's ``pipeline`` section: per stage (one rank per stage, ordered by rank), the bubble
(time per step it waited on its neighbours, and its share of the step) and the time the other
stages waited on it; the bottleneck is the stage the straggler analysis names (none when none is).
"""

from __future__ import annotations

from typing import Any

from stepscope.analysis.verdict import Verdict
from stepscope.common import robust
from stepscope.common.waits import sql_wait

P2P_OPS = ("send", "recv", "isend", "irecv")
#: SQL predicate for point-to-point rows (of ``collective_calls``/``collective_waits``).
IS_P2P = "op IN (" + ", ".join(f"'{o}'" for o in P2P_OPS) + ")"


def build_p2p_waits(con: Any) -> int:
    """Tables ``p2p_waits`` (the point-to-point rows of ``collective_calls`` with ``matched``, ``seq_shift``,
    ``wait``; the columns of ``collective_waits``) and ``p2p_blame`` (step, pg, rank, late: the rule's wait).

    All time in a point-to-point call is waiting on the other end (the bubble; the transfer
    itself is part of it). Which end made the other wait is the rule: per step and link, an
    end's time minus the other end's, counted only when both ends recorded the link.
    Returns the number of point-to-point rows.
    """
    con.execute(
        f"""CREATE OR REPLACE TABLE p2p_blame AS
            SELECT step, pg, rank, t,
                   count(*) OVER (PARTITION BY step, pg) = 2 AND NOT contains(pg, '?')
                       AS matched,
                   {sql_wait('t', 'step, pg')} AS late
            FROM (SELECT step, pg, rank, sum(ms) AS t FROM collective_calls WHERE {IS_P2P}
                  GROUP BY 1, 2, 3)"""
    )
    con.execute(
        f"""CREATE OR REPLACE TABLE p2p_waits AS
            SELECT c.*, TRUE AS matched, FALSE AS seq_shift, CAST(c.ms AS DOUBLE) AS wait
            FROM collective_calls c JOIN p2p_blame e USING (step, pg, rank) WHERE c.{IS_P2P}"""
    )
    con.execute("DELETE FROM p2p_blame WHERE NOT matched")
    return int(con.execute("SELECT count(*) FROM p2p_waits").fetchone()[0])


def _peer(pg: str, rank: int) -> int | None:
    """The other end of link ``pg`` (``"<group>:<src>><dst>"``) seen from ``rank``."""
    link = pg.rsplit(":", 1)[-1]
    src, _, dst = link.partition(">")
    try:
        a, b = int(src), int(dst)
    except ValueError:
        return None
    if rank == a:
        return b
    return a if rank == b else None


def pipeline_section(con: Any, culprits: list[int]) -> dict[str, Any] | None:
    """The report's ``pipeline`` section, or None when the run has no point-to-point traffic.

    Needs ``collective_waits`` (waits per row) and ``steps``; ``culprits``: the stragglers' ranks, most
    costly first (the first that is a stage is the bottleneck).
    """
    rows = con.execute(
        f"""SELECT c.rank, c.step, c.pg, sum(c.wait), sum(c.ms), any_value(b.late)
            FROM collective_waits c LEFT JOIN p2p_blame b USING (rank, step, pg) WHERE c.{IS_P2P}
            GROUP BY 1, 2, 3"""
    ).fetchall()
    if not rows:
        return None
    step_ms = {int(r): float(m or 0.0) for r, m in con.execute(
        "SELECT rank, sum(step_ms) FROM steps GROUP BY 1").fetchall()}
    n_steps = {int(r): int(n) for r, n in con.execute(
        "SELECT rank, count(*) FROM steps GROUP BY 1").fetchall()}
    bubble: dict[int, dict[int, float]] = {}  # rank → step → wait
    total: dict[int, float] = {}
    comm: dict[int, float] = {}
    caused: dict[int, float] = {}  # rank → time others waited on it
    for rank, step, pg, wait, ms, late in rows:
        r, w = int(rank), float(wait or 0.0)
        bubble.setdefault(r, {}).setdefault(int(step), 0.0)
        bubble[r][int(step)] += w
        total[r] = total.get(r, 0.0) + w
        comm[r] = comm.get(r, 0.0) + float(ms or 0.0)
        peer = _peer(str(pg), r)
        if peer is not None and late:
            caused[peer] = caused.get(peer, 0.0) + float(late)
    ranks = sorted(set(bubble) | set(caused))
    stages: list[dict[str, Any]] = []
    for i, r in enumerate(ranks):
        n = max(1, n_steps.get(r, 1))
        per_step = list(bubble.get(r, {}).values())
        per_step += [0.0] * max(0, n - len(per_step))
        stages.append({
            "stage": i,
            "rank": r,
            "bubble_ms": round(robust.median(per_step), 3),
            "bubble_share": round(total.get(r, 0.0) / step_ms[r], 4) if step_ms.get(r) else None,
            "p2p_ms": round(comm.get(r, 0.0) / n, 3),
            "waited_on_ms": round(caused.get(r, 0.0) / n, 3),
        })
    # The bottleneck is the stage the straggler analysis found slow (its own work, against
    # its own noise). Who waited on whom alone cannot tell: in a balanced pipeline the
    # schedule's fill and drain make the middle stages look waited on.
    by_rank = {s["rank"]: s for s in stages}
    bottleneck = next((by_rank[r] for r in culprits if r in by_rank), None)
    return {
        "stages": stages,
        "bottleneck_stage": None if bottleneck is None else bottleneck["stage"],
        "bottleneck_rank": None if bottleneck is None else bottleneck["rank"],
        "rule": "bubble = a stage's time in point-to-point transfers with its neighbours; "
        "waited_on = what the other end of each link spent beyond this stage's time in it "
        "(per step and link); the bottleneck is the stage named a straggler (its own work in a "
        "phase above the other stages'), none when no stage is",
    }


#: Share of the waiting stages' step time spent in their bubble (warning / critical).
BUBBLE_SHARE = (0.08, 0.20)


def pipeline_verdicts(section: dict[str, Any],
                      verdicts: list[Verdict] | None = None) -> list[Verdict]:
    """A ``pipeline_bubble`` verdict naming the bottleneck stage, when the bubble is large.

    The bottleneck is a straggler, and the bubble it causes is that straggler's price seen
    from the other stages: counted once, there. The verdict takes the straggler verdict's
    cost and severity (a 5-step descheduling of one stage on a busy host is a warning there,
    so it is one here too), as ``comm_wait`` does.
    """
    b = section.get("bottleneck_stage")
    if b is None:
        return []
    others = [s for s in section["stages"] if s["stage"] != b]
    share = robust.median([s["bubble_share"] or 0.0 for s in others]) if others else 0.0
    if share < BUBBLE_SHARE[0]:
        return []
    worst = next(s for s in section["stages"] if s["stage"] == b)
    waiting = ", ".join(str(s["stage"]) for s in others if (s["bubble_share"] or 0.0) >= BUBBLE_SHARE[0])
    culprit = next((v for v in verdicts or () if v.kind == "straggler"
                    and (v.subject or "").startswith(f"rank {worst['rank']} ")), None)
    severity = "critical" if share >= BUBBLE_SHARE[1] else "warning"
    return [Verdict(
        kind="pipeline_bubble",
        severity=severity if culprit is None else culprit.severity,
        cost=None if culprit is None else culprit.cost,
        evidence=f"stage {b} (rank {worst['rank']}) is the pipeline's bottleneck: its neighbours "
        f"wait {worst['waited_on_ms']:.1f} ms per step on it in send/recv; stage(s) {waiting or '-'} "
        f"spend a median {100.0 * share:.0f}% of their step time in the bubble (waiting on "
        "neighbours), counted as waiting, not host overhead"
        + (" (its cost is the straggler's)" if culprit is not None else ""),
        suggestion=f"Rebalance the stages: move layers off stage {b} (or give it the lighter "
        "end of the model), and use more micro-batches or an interleaved schedule "
        "(ScheduleInterleaved1F1B) to shrink the bubble",
    )]


def explain_host_overhead(verdicts: list[Verdict]) -> None:
    """Say, in a pipeline run's ``host_overhead`` verdict, what that untimed work includes.

    A pipeline schedule's ``step()`` does its own Python around every micro-batch (splitting
    the inputs, the loss, scaling the gradients, its bookkeeping) outside the stage's forward
    and backward: with small stages it is a quarter of the step (64-wide toy stages: 12–29%
    over 20 clean 2-stage runs, highest on a quiet machine). The cost stays as measured; the
    remedy is the schedule's, not a search for stray logging.
    """
    for v in verdicts:
        if v.kind != "host_overhead":
            continue
        v.evidence += ("; in a pipeline run it includes the schedule's own work around each "
                          "micro-batch (splitting inputs, the loss, scaling gradients)")
        v.suggestion = ("Use fewer, larger micro-batches (n_microbatches) or larger stages, so "
                           "the schedule's per-micro-batch work is spread over more compute; time "
                           "your own code around schedule.step() with stepscope.phase(...) to rule "
                           "it out")

