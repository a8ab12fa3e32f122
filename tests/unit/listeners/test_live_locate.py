"""The live line names the late rank by the wait rule on the exchanged per-rank summaries."""

from __future__ import annotations

import pytest
from synth_collectives import CollRun, ddp_program, fsdp_program, make_records
from synth_runs import Slow

from stepscope.listeners.live import (
    PAYLOAD_BYTES,
    cross_rank_summary,
    decode_payload,
    encode_payload,
    summarize,
)


def _summaries(spec: CollRun) -> list[dict | None]:
    recs = make_records(spec)
    return [decode_payload(encode_payload(summarize(recs[r][-30:]))) for r in sorted(recs)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_forward_late_rank(ranks: int) -> None:
    # FSDP2: the fast ranks wait inside their own forward, so raw forward times tie; only
    # the collective times (the wait rule) tell who is late.
    s = cross_rank_summary(_summaries(CollRun(fsdp_program(), ranks=ranks,
                                              slow=(Slow(1, "forward", 20.0),))), ranks)
    assert s is not None
    assert (s["slowest_rank"], s["slowest_phase"]) == (1, "forward")
    assert s["slowest_phase_excess_ms"] == pytest.approx(20.0, rel=0.1)


@pytest.mark.parametrize(("rank", "phase"), [(0, "optimizer"), (1, "dataloader"), (1, "backward")])
def test_ddp_two_ranks_late_rank_and_phase(rank: int, phase: str) -> None:
    s = cross_rank_summary(_summaries(CollRun(ddp_program(micro=2), ranks=2,
                                              slow=(Slow(rank, phase, 25.0),))), 2)
    assert s is not None
    assert (s["slowest_rank"], s["slowest_phase"]) == (rank, phase)
    assert s["slowest_phase_excess_ms"] == pytest.approx(25.0, rel=0.1)


def test_payload_keeps_collectives_bounded() -> None:
    recs = make_records(CollRun(fsdp_program(), ranks=2, steps=5))
    summary = summarize(recs[0])
    summary["collectives"].update({f"p{i}|all_reduce|g{i}": 0.001 * i for i in range(300)})
    raw = encode_payload(summary)
    assert 0 < len(raw) <= PAYLOAD_BYTES
    body = decode_payload(raw)
    assert body is not None and "forward|all_gather|0" in body["c"]
