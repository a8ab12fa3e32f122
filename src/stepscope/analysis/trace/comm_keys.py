"""The key that matches one collective kernel across ranks: (process group, collective, seq)."""

from __future__ import annotations

from collections import Counter

from stepscope.analysis.trace.events import DeviceEvent

CommKey = tuple[str, str, int]


def kernel_key(d: DeviceEvent, comm_seq: dict[int, CommKey]) -> CommKey | str:
    """The match key of one NCCL kernel: its group and sequence number where known."""
    key = d.comm
    if key is not None and key[2] < 0:
        key = comm_seq.get(d.external_id, key)
    return key if key is not None else _collective_key(d.name)


def match_keys(items: list[tuple[int, int, CommKey | str]]) -> list[tuple[CommKey, float]]:
    """Durations with a cross-rank match key each, in time order.

    Collectives on one process group are issued in the same order on every rank, so where
    the sequence number is missing the k-th call on the same group (or, lacking a group,
    of the same name) is the same collective.
    """
    seen: Counter[tuple[str, str]] = Counter()
    out: list[tuple[CommKey, float]] = []
    for s, e, key in sorted(items, key=lambda x: x[0]):
        if isinstance(key, str):
            group, coll, seq = "", key, -1
        else:
            group, coll, seq = key
        if seq < 0:
            seq = seen[(group, coll)]
            seen[(group, coll)] += 1
            group = group or ""
            key = (group, coll + "#k", seq)
        else:
            key = (group, coll, seq)
        out.append((key, (e - s) / 1000.0))
    return out


def _collective_key(name: str) -> str:
    # "ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)" -> "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    return name.split("(", 1)[0]
