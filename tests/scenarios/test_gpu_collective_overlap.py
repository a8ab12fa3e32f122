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
from stepscope.report import collective_view

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
    table = "\n".join(collective_view.markdown_lines(doc))
    assert "hidden ms/step" in table and f"{op['hidden_ms_per_step']:.2f}" in table


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


def test_an_async_side_call_waited_from_the_compute_stream_is_exposed_for_that_wait(
        cuda_sim, tmp_path):
    """``async_op=True`` on a side stream, ``wait()`` from the compute stream after 100 ms of
    compute: WorkNCCL's wait holds the compute stream until the 150 ms call ends. An async
    call's ``ms`` leaves out the span between issue and ``wait()`` already (the overlapped
    work): the 50 ms left are the wait, all exposed."""
    sim = cuda_sim()
    x = torch.zeros(1024, device="cuda")
    stepscope.init(out_dir=str(tmp_path), auto=False, flush_every_n_steps=1)
    with sim.nccl_group(ms=150.0):
        rs = torch.cuda.Stream()
        for _ in range(2):
            sim.kernel(GATE_MS)
            with stepscope.step(), stepscope.phase("backward"):
                rs.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(rs):
                    work = dist.all_reduce(x, async_op=True)
                sim.kernel(100.0)
                work.wait()
            sim.host_tick()
        sim.drain()
    stepscope.finish()
    calls = [c for r in read_run(tmp_path) for c in r.get("collectives") or ()]
    assert len(calls) == 2
    for c in calls:
        assert c["ms"] == pytest.approx(50.0, abs=1.0)
        assert c["exposed_ms"] == pytest.approx(50.0, abs=1.0)
        assert c["hidden_ms"] == pytest.approx(0.0, abs=1.0)


def test_an_error_while_splitting_turns_timing_off_once_and_the_wait_still_holds(
        cuda_sim, tmp_path, monkeypatch):
    from stepscope.common.errors import StepscopeWarning
    from stepscope.instrument import collective_timing
    from stepscope.recording.recorder import Recorder

    def broken(self: Any, before: Any, after: Any, joined: Any) -> None:
        raise RuntimeError("split broken")

    monkeypatch.setattr(Recorder, "add_stream_wait", broken)
    sim = cuda_sim()
    with pytest.warns(StepscopeWarning, match="split broken") as caught:
        records = _job(sim, tmp_path, 150.0)
    assert len([w for w in caught if "split broken" in str(w.message)]) == 1
    assert collective_timing.disabled
    for r in records:  # the compute stream still waited for the all-gather
        fwd = next(p for p in r["phases"] if p["name"] == "forward")
        assert fwd["ms"] == pytest.approx(150.0, abs=2.0)


def test_a_side_call_whose_join_is_not_seen_stays_all_exposed(cuda_sim, tmp_path):
    """Joined through an event recorded with ``Event.record`` (not ``Stream.record_event``):
    the wait is not seen, so nothing is called hidden (the time counts as before)."""
    sim = cuda_sim()
    x = torch.zeros(1024, device="cuda")
    gathered = torch.zeros(1024, device="cuda")
    stepscope.init(out_dir=str(tmp_path), auto=False, flush_every_n_steps=1)
    with sim.nccl_group(ms=60.0):
        ag = torch.cuda.Stream()
        for _ in range(2):
            sim.kernel(GATE_MS)
            with stepscope.step(), stepscope.phase("forward"):
                compute = torch.cuda.current_stream()
                ag.wait_stream(compute)
                with torch.cuda.stream(ag):
                    dist.all_gather_single(gathered, x)
                event = torch.cuda.Event()
                event.record(ag)
                sim.kernel(100.0)
                compute.wait_event(event)
            sim.host_tick()
        sim.drain()
    stepscope.finish()
    for c in _gathers(read_run(tmp_path)):
        assert c["ms"] == pytest.approx(60.0, abs=1.0)
        assert c["exposed_ms"] == c["ms"] and c["hidden_ms"] == 0.0
