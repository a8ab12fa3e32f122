"""Collectives on a communication stream, on the simulated GPU: exposed and hidden time.

FSDP2 issues its all-gathers under ``with torch.cuda.stream(all_gather_stream)`` and joins
them from the compute stream with ``wait_event`` (``wait_for_unshard``). Only the part of
such a collective during which the compute stream waited is taken from the phase; the rest
ran beside compute. Each step is queued behind a 2 s kernel, so the GPU times below are
the simulated timeline's, whatever the load of the machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import stepscope
from stepscope.recording.schema import read_run

GATE_MS = 2000.0  # queued ahead of each step: everything the step enqueues waits behind it


def _side_job(sim: Any, out: Path, gather_ms: float, steps: int = 3) -> list[dict[str, Any]]:
    """Forward computes 100 ms while an all-gather of ``gather_ms`` runs on its own stream,
    issued at forward's start and joined at forward's end (FSDP2's pattern)."""
    x = torch.zeros(1024, device="cuda")
    gathered = torch.zeros(1024, device="cuda")
    stepscope.init(out_dir=str(out), auto=False, flush_every_n_steps=1)
    with sim.nccl_group(ms=gather_ms):
        ag = torch.cuda.Stream()
        for _ in range(steps):
            sim.kernel(GATE_MS)
            with stepscope.step(), stepscope.phase("forward"):
                compute = torch.cuda.current_stream()
                ag.wait_stream(compute)  # FSDP2: the all-gather's inputs are ready
                with torch.cuda.stream(ag):
                    dist.all_gather_single(gathered, x)
                    event = ag.record_event()
                sim.kernel(100.0)
                compute.wait_event(event)  # wait_for_unshard
            sim.host_tick()
        sim.drain()
    stepscope.finish()
    return read_run(out)


def _gathers(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [c for r in records for c in r.get("collectives") or () if c["op"] == "all_gather_single"]
    assert out, records
    return out


@pytest.mark.parametrize(("gather_ms", "exposed"), [(60.0, 0.0), (150.0, 50.0)])
def test_an_all_gather_beside_compute_is_hidden_but_what_compute_waited(cuda_sim, tmp_path,
                                                                       gather_ms, exposed):
    sim = cuda_sim()
    records = _side_job(sim, tmp_path, gather_ms)
    for c in _gathers(records):
        assert c["phase"] == "forward"
        assert c["ms"] == pytest.approx(gather_ms, abs=1.0)
        assert c["exposed_ms"] == pytest.approx(exposed, abs=1.0)
        assert c["hidden_ms"] == pytest.approx(gather_ms - exposed, abs=1.0)
    for r in records:
        fwd = next(p for p in r["phases"] if p["name"] == "forward")
        assert fwd["ms"] == pytest.approx(100.0 + exposed, abs=2.0)
