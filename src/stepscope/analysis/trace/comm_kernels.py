"""Collectives matched across ranks, and each instance split into wait and transfer."""

from __future__ import annotations

from collections import Counter
from typing import Any

from stepscope.analysis.trace.breakdown import RankResult
from stepscope.common.waits import last_arriver, most_often_last, waits


def cross_rank(results: list[RankResult]) -> dict[str, Any]:
    """Ranks side by side, and collective wait vs transfer.

    Collectives are matched across ranks by (process group, collective, sequence number)
    where the trace carries them (Kineto's NCCL kernel and ``record_param_comms`` args);
    without a sequence number, the k-th call on the same process group is the same
    collective (calls on one group are issued in the same order on every rank), and without
    a group, the k-th call of the same name. Each matched instance is split by the one wait
    rule (:func:`stepscope.common.waits.waits`): the shortest time across ranks is the
    transfer, the rest of each rank's time is waiting for the last rank to arrive, which is
    the rank with the shortest time. No clocks are compared across ranks.
    """
    rows = []
    for r in results:
        if r.total is None:
            walls = [s.wall_us for s in r.steps]
            if r.cpu is not None:
                rows.append({"rank": r.rank,
                             "mean_step_us": round(sum(walls) / len(walls), 3) if walls else None,
                             "collective_us": r.cpu["collective_us"],
                             "dataloader_us": r.cpu["dataloader_us"]})
            continue
        walls = [s.wall_us for s in r.steps]
        rows.append({
            "rank": r.rank,
            "mean_step_us": round(sum(walls) / len(walls), 3) if walls else None,
            "busy_us": r.total.busy_us, "compute_us": r.total.compute_us,
            "exposed_comm_us": r.total.exposed_comm_us, "idle_us": r.total.idle_us,
            "wall_us": r.total.wall_us,
        })
    by_rank: dict[int, dict[tuple[str, str, int], float]] = {}
    for r in results:
        if r.rank in by_rank:  # the same rank in two files: keep the first
            continue
        by_rank[r.rank] = dict(r.collectives)
    ranks = [k for k, v in by_rank.items() if v]
    wait: dict[int, float] = dict.fromkeys(ranks, 0.0)
    transfer = 0.0
    last: Counter[int] = Counter()
    matched = 0
    by_seq = 0
    mismatched = False
    if len(ranks) > 1:
        keys = set.intersection(*(set(by_rank[k]) for k in ranks))
        union = set.union(*(set(by_rank[k]) for k in ranks))
        mismatched = len(keys) != len(union)
        for key in keys:
            durs = {k: by_rank[k][key] for k in ranks}
            transfer += min(durs.values())
            for k, w in waits(durs).items():
                wait[k] += w
            lr = last_arriver(durs)
            if lr is not None:
                last[lr] += 1
            matched += 1
            by_seq += not key[1].endswith("#k")
    return {
        "per_rank": rows,
        "collectives_matched": matched,
        "collectives_matched_by": ("process group and sequence number" if matched and by_seq == matched
                                   else "process group (or name) and order" if matched and not by_seq
                                   else "mixed" if matched else None),
        "collective_counts_differ": mismatched,
        "collective_transfer_us": round(transfer, 3),
        "collective_wait_us": {str(k): round(v, 3) for k, v in wait.items()},
        # A tie (6 times rank 0, 6 times rank 1) names nobody.
        "last_arriving_rank": most_often_last(last),
        "last_arrivals": {str(k): v for k, v in sorted(last.items())},
    }

