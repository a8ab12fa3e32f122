"""Wait attribution on schema-2 synthetic runs with collectives, where the culprit is exact.

The simulation (tests/support/synth_collectives.py) makes every collective end together on all ranks
of its group; each test injects extra time into one rank's phase and checks that the report
names that rank and phase with the injected excess.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from synth_collectives import CollRun, ddp_program, fsdp_program, hf_program, make_records, write
from synth_runs import Slow

from stepscope.analysis.run import analyze_run


def _doc(tmp_path: Path, spec: CollRun) -> dict[str, Any]:
    return analyze_run(write(tmp_path / "run", make_records(spec)))


def _culprits(doc: dict[str, Any]) -> list[tuple[int, str]]:
    return [(s["rank"], s["phase"]) for s in doc["stragglers"]]


def _quiet(doc: dict[str, Any]) -> None:
    assert doc["stragglers"] == [] and doc["windows"] == []
    kinds = [v["kind"] for v in doc["verdicts"]]
    assert "balanced" in kinds and "straggler" not in kinds and "comm_wait" not in kinds
    assert all(v["severity"] == "info" for v in doc["verdicts"]), doc["verdicts"]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_fsdp_all_gather_waits_name_the_slow_rank(tmp_path: Path, ranks: int, phase: str) -> None:
    # The fast ranks wait inside their own forward (the next layer's all-gather), so raw
    # forward time is equal on every rank; only own work (minus waits) tells them apart.
    doc = _doc(tmp_path, CollRun(fsdp_program(), ranks=ranks, slow=(Slow(1, phase, 20.0),)))
    assert _culprits(doc) == [(1, phase)]
    s = doc["stragglers"][0]
    assert s["excess_ms"] == pytest.approx(20.0, rel=0.05)
    assert s["persistence"] == "chronic" and s["steps"] == 60 and s["confidence"] >= 0.8
    assert s["victims"] == [r for r in range(ranks) if r != 1]
    raw = {p["rank"]: p["median_ms"] for p in doc["phases"][phase]["per_rank"]}
    # Most of the wait hides in the same phase (all but the last layer's share).
    assert max(raw.values()) - min(raw.values()) < 0.3 * 20.0
    assert doc["run"]["alignment"]["wait_source"] == "collectives"
    top = doc["verdicts"][0]
    assert top["kind"] == "straggler" and "rank 1" in top["evidence"]


def test_accumulation_only_the_synchronising_micro_batch_waits(tmp_path: Path) -> None:
    # 4 micro-batches, no_sync on the first 3: rank 2 is 10 ms slower per micro-batch backward.
    doc = _doc(tmp_path, CollRun(ddp_program(micro=4), ranks=4, slow=(Slow(2, "backward", 40.0),)))
    assert _culprits(doc) == [(2, "backward")]
    s = doc["stragglers"][0]
    assert s["excess_ms"] == pytest.approx(40.0, rel=0.05)
    assert s["victims"] == [0, 1, 3]
    ranks = {r["rank"]: r for r in doc["ranks"]}
    # The others wait the whole 40 ms, in the last micro-batch's all-reduce.
    for r in (0, 1, 3):
        assert ranks[r]["wait_ms"]["median"] == pytest.approx(40.0, abs=3.0)
    assert ranks[2]["wait_ms"]["median"] < 3.0
    ddp = next(o for o in doc["collectives"]["ops"] if o["op"] == "ddp_allreduce")
    assert ddp["calls_per_step"] == pytest.approx(4.0)  # one grad_sync per micro-batch


@pytest.mark.parametrize(("phase", "rank"), [("optimizer", 1), ("dataloader", 0), ("forward", 1)])
def test_two_ranks_excess_is_the_gap(tmp_path: Path, phase: str, rank: int) -> None:
    doc = _doc(tmp_path, CollRun(ddp_program(), ranks=2, slow=(Slow(rank, phase, 30.0),)))
    assert _culprits(doc) == [(rank, phase)]
    s = doc["stragglers"][0]
    assert s["excess_ms"] == pytest.approx(30.0, rel=0.05)
    assert s["victims"] == [1 - rank]
    assert s["wait_phase"] == "backward"  # DDP: the others wait in the gradient all-reduce


def test_window_slowdown_is_the_phase_own(tmp_path: Path) -> None:
    spec = CollRun(ddp_program(), ranks=4, steps=80, slow=(Slow(3, "forward", 15.0, 30, 49),))
    doc = _doc(tmp_path, spec)
    (s,) = doc["stragglers"]
    assert (s["rank"], s["phase"], s["persistence"]) == (3, "forward", "window")
    assert abs(s["first_step"] - 30) <= 1 and abs(s["last_step"] - 49) <= 1
    assert s["excess_ms"] == pytest.approx(15.0, rel=0.05)
    (w,) = doc["windows"]
    assert w["ranks"] == [3] and w["phase"] == "forward"
    # Forward's own slowdown (6 ms -> 21 ms), not the whole step's (about 1.6x).
    assert w["slowdown"] == pytest.approx(21.0 / 6.0, rel=0.1)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_balanced_runs_stay_quiet(tmp_path: Path, ranks: int, seed: int) -> None:
    _quiet(_doc(tmp_path, CollRun(ddp_program(), ranks=ranks, steps=100, noise_ms=0.4, seed=seed)))


@pytest.mark.parametrize("ranks", [2, 8])
def test_balanced_fsdp_stays_quiet(tmp_path: Path, ranks: int) -> None:
    _quiet(_doc(tmp_path, CollRun(fsdp_program(), ranks=ranks, steps=100, noise_ms=0.3, seed=3)))


def test_hf_batch_fetch_gather_is_wait_not_input(tmp_path: Path) -> None:
    # Rank 1's slow optimizer delays its next batch fetch's gather: rank 0 waits *inside its
    # dataloader*. That is waiting, not input time, and rank 1 is the culprit.
    doc = _doc(tmp_path, CollRun(hf_program(), ranks=2, slow=(Slow(1, "optimizer", 30.0),)))
    assert _culprits(doc) == [(1, "optimizer")]
    s = doc["stragglers"][0]
    assert s["excess_ms"] == pytest.approx(30.0, rel=0.05)
    assert s["victims"] == [0] and s["wait_phase"] == "dataloader"
    kinds = {v["kind"] for v in doc["verdicts"]}
    assert "input_bound" not in kinds and "balanced" not in kinds
    dl = doc["phases"]["dataloader"]
    waits = {p["rank"]: p["wait_ms"] for p in dl["per_rank"]}
    assert waits[0] == pytest.approx(30.0, abs=3.0) and waits[1] < 1.0
    assert dl["share"] > 0.3 and dl["own_share"] < 0.15


def test_collectives_view_bus_bandwidth(tmp_path: Path) -> None:
    prog = fsdp_program(layers=4, nbytes=4 << 20)
    prog.insert(-1, ("coll", "optimizer", "all_reduce", "tp", 1 << 20, 0.5))
    # Noise-free, so the same rank arrives last at every call and sums match per call.
    doc = _doc(tmp_path, CollRun(prog, ranks=4, noise_ms=0.0, slow=(Slow(2, "forward", 20.0),)))
    ops = {(o["op"], o["pg"]): o for o in doc["collectives"]["ops"]}
    ag, rs, ar = ops[("all_gather", "0")], ops[("reduce_scatter", "0")], ops[("all_reduce", "tp")]
    assert (ag["calls_per_step"], rs["calls_per_step"], ar["calls_per_step"]) == (8.0, 4.0, 1.0)
    assert ag["bytes_per_step"] == 8 * (4 << 20) and ag["pg_size"] == 4
    # Transfer time is what the last arriver spent: 0.4 ms per all-gather, 0.5 ms all-reduce.
    assert ag["bus_gbps"] == pytest.approx((4 << 20) / 0.4e-3 / 1e9 * 3 / 4, rel=0.01)
    assert ar["bus_gbps"] == pytest.approx((1 << 20) / 0.5e-3 / 1e9 * 2 * 3 / 4, rel=0.01)
    assert ag["wait_share"] > 0.5 > ar["wait_share"]  # the forward gathers wait for rank 2
    assert ag["phases"] == ["forward", "backward"]  # in step order
    assert set(doc) >= {"run", "phases", "ranks", "stragglers", "windows", "verdicts"}


def test_phases_keyed_by_path(tmp_path: Path) -> None:
    recs = make_records(CollRun(ddp_program(), ranks=2, steps=30))
    for rows in recs.values():
        for rec in rows:
            fwd = next(p for p in rec["phases"] if p["path"] == "forward")
            rec["phases"].append({"name": "h2d", "path": "forward/h2d", "parent": "forward",
                                  "ms": 1.0, "calls": 1, "start_ms": fwd["start_ms"],
                                  "end_ms": fwd["start_ms"] + 1.0})
            rec["phases"].insert(0, {"name": "h2d", "path": "h2d", "parent": None, "ms": 0.5,
                                     "calls": 1, "start_ms": 0.0, "end_ms": 0.5})
            rec["residual_ms"] -= 0.5
    doc = analyze_run(write(tmp_path / "run", recs))
    ph = doc["phases"]
    assert ph["h2d"]["median_ms"] == pytest.approx(0.5) and ph["h2d"]["parent"] is None
    assert ph["forward/h2d"]["median_ms"] == pytest.approx(1.0)
    assert ph["forward/h2d"]["parent"] == "forward" and ph["forward/h2d"]["share"] is None
    assert ph["backward/grad_sync"]["parent"] == "backward"
    assert sum(p["share"] for p in ph.values() if p["share"] is not None) == pytest.approx(1.0, abs=1e-3)
    names = list(ph)
    assert names.index("forward") < names.index("forward/h2d") < names.index("backward")


# --------------------------------------------------------------------------- bad input


def test_rank_skipping_a_collective_is_partial_not_a_crash(tmp_path: Path) -> None:
    recs = make_records(CollRun(fsdp_program(), ranks=4, slow=(Slow(1, "forward", 20.0),)))
    for rec in recs[3][10:20]:  # rank 3 made one all-gather fewer in forward on 10 steps
        for c in rec["collectives"]:
            if c["phase"] == "forward" and c["op"] == "all_gather":
                c["count"] -= 1
                c["seq_last"] -= 1
    doc = analyze_run(write(tmp_path / "run", recs))
    assert doc["run"]["partial"]
    assert any("different call counts" in s for s in doc["run"]["skipped"])
    assert _culprits(doc)[0] == (1, "forward")


def test_rank_without_collectives(tmp_path: Path) -> None:
    recs = make_records(CollRun(fsdp_program(), ranks=4, slow=(Slow(1, "backward", 20.0),)))
    for rec in recs[3]:
        del rec["collectives"]  # e.g. an older stepscope on that rank
    doc = analyze_run(write(tmp_path / "run", recs))
    assert any("recorded on 3 rank(s)" in s for s in doc["run"]["skipped"])
    assert _culprits(doc)[0] == (1, "backward")
    assert 3 not in doc["stragglers"][0]["victims"]


def test_missing_rank_file_and_garbage_entries(tmp_path: Path) -> None:
    recs = make_records(CollRun(fsdp_program(), ranks=4, slow=(Slow(2, "forward", 20.0),)))
    del recs[0]
    for rec in recs[1][:5]:
        rec["collectives"].append({"phase": "forward", "op": None, "pg": "0", "ms": 3.0})
        rec["collectives"].append({"phase": "forward", "op": "all_gather", "pg": "x", "ms": -1.0})
    doc = analyze_run(write(tmp_path / "run", recs))
    assert any("rank(s) 0" in s for s in doc["run"]["skipped"])
    assert _culprits(doc)[0] == (2, "forward")
    assert doc["stragglers"][0]["excess_ms"] == pytest.approx(20.0, rel=0.05)


def test_sequence_shift_is_noted(tmp_path: Path) -> None:
    recs = make_records(CollRun(fsdp_program(), ranks=2, steps=30))
    for rec in recs[1]:
        for c in rec["collectives"]:
            c["seq_first"] += 1
            c["seq_last"] += 1
    doc = analyze_run(write(tmp_path / "run", recs))
    assert any("sequence numbers differ" in s for s in doc["run"]["skipped"])
    _quiet(doc)


def test_collectives_terminal_and_markdown_sections(tmp_path: Path) -> None:
    from rich.console import Console

    from stepscope.report.markdown import render_markdown
    from stepscope.report.terminal import render_terminal

    doc = _doc(tmp_path, CollRun(fsdp_program(), ranks=2, slow=(Slow(1, "forward", 20.0),)))
    md = render_markdown(doc)
    assert "## Collectives" in md
    row = next(line for line in md.splitlines() if line.startswith("| all_gather |"))
    assert "0 (n=2)" in row and "forward, backward" in row and "8.0" in row
    con = Console(record=True, width=200)
    render_terminal(doc, con)
    text = con.export_text()
    assert "Collectives (per rank and step)" in text and "reduce_scatter" in text
    assert "wait = time in a matched collective" in text
    # A run without collective timing (schema-1 records, timeline fallback) prints none.
    from synth_runs import SynthRun, write_run

    plain = analyze_run(write_run(tmp_path / "plain", SynthRun(ranks=2, steps=20)))
    assert plain["run"]["alignment"]["wait_source"] == "timeline"
    assert "## Collectives" not in render_markdown(plain)


def test_warmup_is_noted_not_a_window(tmp_path: Path) -> None:
    slow = tuple(Slow(r, "forward", 20.0, 0, 7) for r in range(4))
    doc = _doc(tmp_path, CollRun(ddp_program(), ranks=4, steps=80, slow=slow))
    _quiet(doc)
    w = doc["run"]["warmup"]
    assert (w["start_step"], w["end_step"], w["phase"]) == (0, 7, "forward")


def test_scattered_scheduling_spikes_are_not_a_window(tmp_path: Path) -> None:
    # A busy host deschedules rank 0 now and then (7 ms in a ~1 ms optimizer), four of the
    # hiccups close together: what its own spike rate makes likely, not a slow window.
    spikes = (4, 8, 10, 11, 14, 31, 34, 35, 43, 51)  # as seen on rank 0 of a real run
    slow = tuple(Slow(0, "optimizer", 7.0, s, s) for s in spikes)
    base = ddp_program(opt_ms=0.8)
    _quiet(_doc(tmp_path, CollRun(base, ranks=2, steps=60, slow=slow)))
    # The same density held over a long stretch is a window.
    doc = _doc(tmp_path / "w", CollRun(base, ranks=2, steps=60, slow=(Slow(0, "optimizer", 7.0, 20, 34),)))
    assert [(s["rank"], s["phase"], s["persistence"]) for s in doc["stragglers"]] == [
        (0, "optimizer", "window")]
