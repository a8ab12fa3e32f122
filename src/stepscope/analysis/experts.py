"""Expert parallel: token imbalance seen in the all-to-all that routes tokens to experts.

A mixture-of-experts layer sends each token to the rank holding its expert with an
``all_to_all_single`` whose splits are uneven; the recorder keeps the bytes each rank sent
(``bytes``) and received (``recv_bytes``), and the most one call delivered
(``recv_max_bytes``): the dispatch that hands a popular expert's rank its tokens. (Summed
over a step, dispatch and combine cancel: what a rank receives in one it sends in the
other.) A rank that receives far more than the others (its expert is popular) computes
longer and arrives last at the all-to-all that returns the tokens, so the others wait
there: that wait (from the one rule, table ``collective_waits``) is the cost in time.
"""

from __future__ import annotations

from typing import Any

from stepscope.analysis import cost
from stepscope.analysis.verdict import Verdict
from stepscope.common import robust

#: A rank receiving this many times the median of the other ranks is imbalanced
#: (warning), twice that critical.
IMBALANCE = 1.5
_OPS = "op IN ('all_to_all_single', 'all_to_all')"


def experts_section(con: Any, median_step: float) -> dict[str, Any] | None:
    """The report's ``experts`` section, or None when no all-to-all recorded what it received."""
    rows = con.execute(
        f"""SELECT pg, rank, sum(calls), sum(sent), sum(recv), count(*), median(peak)
            FROM (SELECT pg, rank, step, sum(count) AS calls, sum(bytes) AS sent,
                         sum(recv_bytes) AS recv, max(recv_max_bytes) AS peak
                  FROM collectives WHERE {_OPS} AND recv_bytes IS NOT NULL GROUP BY 1, 2, 3)
            GROUP BY 1, 2 ORDER BY 1, 2"""
    ).fetchall()
    if not rows:
        return None
    waits = {(str(pg), int(r)): float(w or 0.0) for pg, r, w in con.execute(
        f"SELECT pg, rank, sum(wait) FROM collective_waits WHERE {_OPS} GROUP BY 1, 2").fetchall()}
    n_steps = max(1, int(con.execute("SELECT count(DISTINCT step) FROM steps").fetchone()[0]))
    groups: dict[str, list[dict[str, Any]]] = {}
    for pg, rank, calls, sent, recv, steps, peak in rows:
        per = max(1, int(steps))
        groups.setdefault(str(pg), []).append({
            "rank": int(rank),
            "calls_per_step": round(float(calls) / per, 3),
            "sent_bytes_per_step": round(float(sent or 0) / per, 1),
            "recv_bytes_per_step": round(float(recv or 0) / per, 1),
            "max_call_recv_bytes": round(float(peak or 0), 1),
            "wait_ms_per_step": round(waits.get((str(pg), int(rank)), 0.0) / n_steps, 3),
        })
    out = []
    for pg, ranks in groups.items():
        hot = max(ranks, key=lambda r: r["max_call_recv_bytes"])
        others = [r for r in ranks if r is not hot]
        base = robust.median([r["max_call_recv_bytes"] for r in others]) if others else 0.0
        ratio = hot["max_call_recv_bytes"] / base if base > 0 else None
        # The cost: what the other ranks waited per step in this group's all-to-alls.
        lost = robust.median([r["wait_ms_per_step"] for r in others]) if others else 0.0
        out.append({
            "pg": pg, "ranks": ranks,
            "max_recv_rank": hot["rank"],
            "imbalance": None if ratio is None else round(ratio, 3),
            "lost_ms_per_step": round(lost, 3),
            "lost_share": round(lost / median_step, 4) if median_step else None,
        })
    return {"groups": out, "threshold": IMBALANCE,
            "rule": "imbalance = the most one all-to-all call delivers to the busiest rank / the "
            "same for the median other rank (per step, median over steps); time lost = the "
            "other ranks' wait in those all-to-alls (the one wait rule)"}


def expert_verdicts(section: dict[str, Any], run: dict[str, Any]) -> list[Verdict]:
    """``expert_imbalance`` verdicts: one per all-to-all group whose busiest rank is hot,
    priced like every finding (:mod:`stepscope.analysis.cost`): every rank of the group waits."""
    job = run.get("cost") or {}
    out: list[Verdict] = []
    for g in section["groups"]:
        ratio = g["imbalance"]
        if ratio is None or ratio < IMBALANCE:
            continue
        share = g["lost_share"] or 0.0
        c = cost.price(job, g["lost_ms_per_step"], int(run.get("steps") or 0), len(g["ranks"]))
        out.append(Verdict(
            kind="expert_imbalance",
            severity=cost.severity(cost.share(c)),
            cost=c,
            subject=f"rank {g['max_recv_rank']}'s experts",
            evidence=f"rank {g['max_recv_rank']} receives {ratio:.1f}× the tokens (bytes) of "
            f"the median other rank in one all_to_all on group {g['pg']} (its experts get "
            "more of the routed tokens); the other ranks lose "
            f"{g['lost_ms_per_step']:.1f} ms per step ({100.0 * share:.0f}% of the median step) "
            "waiting for it in the all-to-all",
            suggestion="Balance the router: add an auxiliary load-balancing loss, cap expert "
            "capacity (capacity_factor) or drop/reroute overflow tokens, or place popular "
            f"experts on more ranks than rank {g['max_recv_rank']}",
        ))
    return out
