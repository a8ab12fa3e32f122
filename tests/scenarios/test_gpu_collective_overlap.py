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
from stepscope.analysis.run import analyze_run
from stepscope.recording.schema import read_run

GATE_MS = 2000.0  # queued ahead of each step: everything the step enqueues waits behind it


def _job(sim: Any, out: Path, gather_ms: float, side: bool = True,
         steps: int = 3) -> list[dict[str, Any]]:
    """Forward computes 100 ms while an all-gather of ``gather_ms`` runs on its own stream,
    issued at forward's start and joined at forward's end (FSDP2's pattern); ``side=False``:
    the all-gather is issued on the compute stream itself, synchronously."""
    x = torch.zeros(1024, device="cuda")
    gathered = torch.zeros(1024, device="cuda")
    stepscope.init(out_dir=str(out), auto=False, flush_every_n_steps=1)
    with sim.nccl_group(ms=gather_ms):
        ag = torch.cuda.Stream()
        for _ in range(steps):
            sim.kernel(GATE_MS)
            with stepscope.step(), stepscope.phase("forward"):
                compute = torch.cuda.current_stream()
                if side:
                    ag.wait_stream(compute)  # FSDP2: the all-gather's inputs are ready
                    with torch.cuda.stream(ag):
                        dist.all_gather_single(gathered, x)
                        event = ag.record_event()
                    sim.kernel(100.0)
                    compute.wait_event(event)  # wait_for_unshard
                else:
                    dist.all_gather_single(gathered, x)
                    sim.kernel(100.0)
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
    records = _job(sim, tmp_path, gather_ms)
    for c in _gathers(records):
        assert c["phase"] == "forward"
        assert c["ms"] == pytest.approx(gather_ms, abs=1.0)
        assert c["exposed_ms"] == pytest.approx(exposed, abs=1.0)
        assert c["hidden_ms"] == pytest.approx(gather_ms - exposed, abs=1.0)
    for r in records:
        fwd = next(p for p in r["phases"] if p["name"] == "forward")
        assert fwd["ms"] == pytest.approx(100.0 + exposed, abs=2.0)
    # The analysis takes only the exposed part from forward: its work is the 100 ms computed.
    doc = analyze_run(str(tmp_path))
    assert doc["phases"]["forward"]["work_share"] == pytest.approx(100.0 / (100.0 + exposed),
                                                                   abs=0.02)
    (op,) = doc["collectives"]["ops"]
    assert op["ms_per_step"] == pytest.approx(gather_ms, abs=1.0)
    assert op["hidden_ms_per_step"] == pytest.approx(gather_ms - exposed, abs=1.0)


def test_a_synchronous_all_gather_on_the_compute_stream_is_all_exposed(cuda_sim, tmp_path):
    sim = cuda_sim()
    records = _job(sim, tmp_path, 60.0, side=False)
    for c in _gathers(records):
        assert c["ms"] == pytest.approx(60.0, abs=1.0)
        assert c["exposed_ms"] == c["ms"] and c["hidden_ms"] == 0.0
    doc = analyze_run(str(tmp_path))
    assert doc["phases"]["forward"]["work_share"] == pytest.approx(100.0 / 160.0, abs=0.02)


def test_the_split_adds_no_host_sync(cuda_sim, tmp_path):
    """Bracketing the compute stream's waits records events; it never blocks the host."""
    sim = cuda_sim()
    records_before = sim.records
    _job(sim, tmp_path, 150.0, steps=4)
    assert sim.syncs == 0, sim.sync_log
    assert sim.records > records_before
