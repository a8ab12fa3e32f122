"""Plain-language verdicts from the per-rank breakdowns and the cross-rank view."""

from __future__ import annotations

from typing import Any

from stepscope.analysis import kernels as K
from stepscope.analysis.trace.breakdown import Breakdown, RankResult
from stepscope.analysis.verdict import Verdict

# Thresholds, as shares of step (or trace) wall time, above which a symptom is worth a line.
EXPOSED_COMM_PCT = 15.0
MEMORY_PCT = 15.0
IDLE_PCT = 30.0
TINY_KERNEL_US = 10.0
LAUNCH_BOUND_KERNELS = 200


def _windows(r: RankResult) -> list[Breakdown]:
    if r.total is None:  # a CPU-only trace: no GPU breakdown to diagnose
        return []
    return r.steps or [r.total]


def diagnose(results: list[RankResult], cross: dict[str, Any] | None) -> list[Verdict]:
    """Short plain-language verdicts, each with the rank, the evidence and what to try.

    Each symptom over its threshold is a warning; "no dominant stall" is a note (the trace
    report's form, :meth:`Verdict.to_trace_dict`, carries no severity)."""
    out: list[Verdict] = []
    for r in results:
        ws = _windows(r)
        if not ws:
            continue
        wall = sum(w.wall_us for w in ws) or 1.0

        def pct(attr: str, ws: list[Breakdown] = ws, wall: float = wall) -> float:
            return 100.0 * float(sum(getattr(w, attr) for w in ws)) / wall

        exposed, mem, idle = pct("exposed_comm_us"), pct("exposed_memory_us"), pct("idle_us")
        host = pct("idle_host_wait_us")
        kernels = sum(w.kernel_count for w in ws)
        ksum = sum(w.kernel_sum_us - w.by_category_us.get(K.MEMORY, 0.0) for w in ws)
        mean_kernel = ksum / kernels if kernels else 0.0
        per_window = kernels / len(ws)
        tag = f"rank {r.rank}"
        if exposed >= EXPOSED_COMM_PCT:
            out.append(_symptom(r.rank, "exposed_comm",
                                f"{tag}: {exposed:.0f}% of step time is communication not hidden "
                                "behind compute.",
                                "Overlap it (bucketed/async all-reduce, FSDP prefetch) or reduce "
                                "what is communicated."))
        if mean_kernel and mean_kernel < TINY_KERNEL_US and per_window >= LAUNCH_BOUND_KERNELS:
            out.append(_symptom(r.rank, "launch_bound",
                                f"{tag}: {per_window:.0f} kernels per step averaging "
                                f"{mean_kernel:.1f} µs: launch-bound.",
                                "Fuse them with torch.compile or capture the step in CUDA graphs."))
        if mem >= MEMORY_PCT:
            out.append(_symptom(r.rank, "memcpy_heavy",
                                f"{tag}: {mem:.0f}% of step time is memory copies/sets alone.",
                                "Pin host memory, copy with non_blocking=True and prefetch the "
                                "next batch."))
        if idle >= IDLE_PCT:
            where = ("the host did not enqueue work in time: input- or host-bound (dataloader, "
                     "Python overhead, synchronisation)" if host >= idle / 2 else
                     "queued work waited on dependencies or synchronisation")
            out.append(_symptom(r.rank, "idle_heavy",
                                f"{tag}: the GPU is idle {idle:.0f}% of step time ({host:.0f}% "
                                f"host wait); {where}."))
    if cross and cross.get("last_arriving_rank") is not None and cross.get("collectives_matched"):
        waits = ", ".join(f"rank {k} {float(w) / 1e3:,.1f} ms"
                          for k, w in sorted(cross["collective_wait_us"].items(),
                                             key=lambda kv: int(kv[0])))
        out.append(_symptom(int(cross["last_arriving_rank"]), "straggler",
                            f"rank {cross['last_arriving_rank']} arrives last at most collectives; "
                            f"the others wait for it (collective wait: {waits})."))
    if not out and any(_windows(r) for r in results):
        out.append(Verdict(kind="compute_bound", severity="info",
                           evidence="No dominant stall: the GPU is mostly busy with compute.",
                           suggestion="Speed-ups now come from the kernels themselves "
                           "(precision, fusion, larger batches)."))
    return out


def _symptom(rank: int, kind: str, evidence: str, suggestion: str = "") -> Verdict:
    return Verdict(kind=kind, severity="warning", evidence=evidence, suggestion=suggestion,
                   rank=rank)
