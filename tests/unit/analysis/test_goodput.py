"""Goodput against runs with known injected losses: synthetic records and one real gloo run."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from synth_runs import COMM_MS, Slow, SynthRun, make_records

from stepscope.analysis.goodput import MS_PER_HOUR
from stepscope.analysis.run import analyze_run

DAY_NS = 86_400 * 10**9


def _write(root: Path, recs: dict[int, list[dict[str, Any]]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rank, rows in recs.items():
        with open(root / f"rank{rank}.jsonl", "a") as fh:
            for rec in rows:
                fh.write(json.dumps(rec) + "\n")
    return root


def _ms(doc: dict[str, Any], cat: str) -> float:
    return float(doc["lost_gpu_hours"][cat]) * MS_PER_HOUR


def test_straggler_and_input_stall_losses(tmp_path: Path) -> None:
    # Rank 1's loader is 20 ms slower on 20 steps: 3 ranks wait 20 ms each time (stragglers);
    # every rank's loader and h2d (2 + 1 ms a step) plus the 400 ms stall are input stalls.
    spec = SynthRun(ranks=4, steps=60, slow=(Slow(rank=1, phase="dataloader", ms=20.0,
                                                 start_step=20, end_step=39),))
    run = _write(tmp_path / "run", make_records(spec))
    gp = analyze_run(run)["goodput"]
    assert _ms(gp, "stragglers") == pytest.approx(3 * 20 * 20, rel=0.08)
    assert _ms(gp, "input_stalls") == pytest.approx(4 * 60 * 3.0 + 20 * 20, rel=0.03)
    assert _ms(gp, "host_overhead") == pytest.approx(4 * 60 * 0.3, rel=0.03)
    for cat in ("warmup", "restarts", "exposed_comm"):
        assert _ms(gp, cat) == 0.0
    assert _ms(gp, "outside_steps") < 1.0
    # Everything adds up to the ranks' wall time.
    recs = make_records(spec)
    wall = sum(r[-1]["start_unix_ns"] / 1e6 + r[-1]["step_ms"] - r[0]["start_unix_ns"] / 1e6
               for r in recs.values())
    assert gp["gpu_hours"] * MS_PER_HOUR == pytest.approx(wall, rel=1e-3)
    lost = sum(gp["lost_gpu_hours"].values())
    assert gp["productive_gpu_hours"] + lost == pytest.approx(gp["gpu_hours"], rel=1e-4)
    assert 0.5 < gp["goodput"] < 0.8
    assert len(gp["runs"]) == 1 and gp["runs"][0]["ranks"] == 4
    assert json.loads(json.dumps(gp, allow_nan=False)) == gp


def test_exposed_comm_from_collective_timing(tmp_path: Path) -> None:
    # Noise-free: each rank's own backward compute is 9 ms, so its time in the all-reduce is
    # backward - 9 ms = its wait + the 2 ms transfer. Rank 2 is 10 ms late in forward.
    spec = SynthRun(ranks=4, steps=40, noise_ms=0.0,
                    slow=(Slow(rank=2, phase="forward", ms=10.0, start_step=0, end_step=39),))
    recs = make_records(spec)
    for rows in recs.values():
        for rec in rows:
            bw = next(p for p in rec["phases"] if p["name"] == "backward")
            rec["collectives"] = [{"phase": "backward", "op": "all_reduce", "pg": "g0", "pg_size": 4,
                                   "count": 1, "bytes": 4096, "ms": bw["ms"] - 9.0}]
    gp = analyze_run(_write(tmp_path / "run", recs))["goodput"]
    assert _ms(gp, "exposed_comm") == pytest.approx(4 * 40 * COMM_MS, rel=0.02)
    assert _ms(gp, "stragglers") == pytest.approx(3 * 40 * 10.0, rel=0.02)


def test_warmup_restart_and_days(tmp_path: Path) -> None:
    # Run A: steps 0..59 with 8 slow warm-up steps on every rank (+40 ms forward).
    # It dies; 2 minutes later the job is relaunched with the same job id and resumes
    # from the checkpoint at step 50: steps 50..59 are done again (lost), then 60..89.
    # The relaunch falls on the next UTC day.
    warm = tuple(Slow(rank=r, phase="forward", ms=40.0, start_step=0, end_step=7) for r in range(2))
    a = make_records(SynthRun(ranks=2, steps=60, slow=warm, seed=1))
    b = make_records(SynthRun(ranks=2, steps=40, seed=2))
    t0 = a[0][0]["start_unix_ns"]
    day_end = (t0 // DAY_NS + 1) * DAY_NS
    a_end = max(r[-1]["start_unix_ns"] + int(r[-1]["step_ms"] * 1e6) for r in a.values())
    # shift run A to end just before midnight, run B starts 120 s later (after midnight)
    shift_a = day_end - 5 * 10**9 - a_end
    gap_ns = 120 * 10**9
    for rows in a.values():
        for rec in rows:
            rec["start_unix_ns"] += shift_a
    b_first = min(r[0]["start_unix_ns"] for r in b.values())
    shift_b = (a_end + shift_a + gap_ns) - b_first
    for rows in b.values():
        for rec in rows:
            rec["start_unix_ns"] += shift_b
            rec["step"] += 50
    run = _write(tmp_path / "run", a)
    _write(run, b)
    doc = analyze_run(run)
    gp = doc["goodput"]
    assert doc["run"]["warmup"] is not None
    # Warm-up: 8 steps × 40 ms on 2 ranks, measured as the excess over the typical step.
    assert _ms(gp, "warmup") == pytest.approx(2 * 8 * 40.0, rel=0.1)
    # Restarts: each rank's gap to the relaunch (~120 s ± the ranks' end skew) plus
    # 10 re-done steps of ~21.3 ms.
    redo = sum(rec["step_ms"] for rows in b.values() for rec in rows if rec["step"] < 60)
    assert _ms(gp, "restarts") == pytest.approx(2 * 120_000 + redo, rel=0.01)
    assert [r["segment"] for r in gp["runs"]] == [0, 1]
    assert gp["runs"][1]["lost_gpu_hours"]["restarts"] > 0.066  # 2 × 120 s = 0.0667 GPU-h
    assert gp["runs"][0]["lost_gpu_hours"]["restarts"] == 0.0
    assert [d["day"] for d in gp["days"]] == sorted({d["day"] for d in gp["days"]})
    assert len(gp["days"]) == 2
    assert gp["days"][0]["lost_gpu_hours"]["warmup"] > 0
    assert gp["days"][1]["lost_gpu_hours"]["restarts"] > 0
    total = sum(d["gpu_hours"] for d in gp["days"])
    assert total == pytest.approx(gp["gpu_hours"], rel=1e-4)


def test_sampled_steps_are_estimated_not_outside(tmp_path: Path) -> None:
    spec = SynthRun(ranks=2, steps=60, every=3)
    gp = analyze_run(_write(tmp_path / "run", make_records(spec)))["goodput"]
    # Two of every three steps are not recorded: their time is estimated as steps, not gaps.
    assert _ms(gp, "outside_steps") < 0.02 * gp["gpu_hours"] * MS_PER_HOUR
    assert _ms(gp, "input_stalls") == pytest.approx(2 * 58 * 3.0, rel=0.05)


def test_real_gloo_run_with_dataloader_stall(tmp_path: Path) -> None:
    """Two real gloo ranks; rank 1's loader sleeps 40 ms on 15 steps."""
    from stepscope.demo import SlowSpec, launch

    stall_ms, n = 40.0, 15
    run = launch(tmp_path / "run", ranks=2, steps=40,
                 slow=(SlowSpec(rank=1, phase="dataloader", start_step=15, end_step=15 + n, ms=stall_ms),))
    doc = analyze_run(run)
    gp = doc["goodput"]
    injected = stall_ms * n
    # The stall itself is rank 1's input time; rank 0 spends it waiting in the all-reduce.
    # Sleeps overshoot on a loaded machine (never undershoot): the bounds are one-sided wide.
    assert 0.9 * injected < _ms(gp, "input_stalls")
    assert 0.6 * injected < _ms(gp, "stragglers") < 3.0 * injected
    per_rank: dict[int, float] = {}
    for rank in (0, 1):
        rows = [json.loads(x) for x in (run / f"rank{rank}.jsonl").read_text().splitlines()]
        dl = sum(p["ms"] for r in rows for p in r["phases"] if p["name"] == "dataloader")
        per_rank[rank] = dl
    assert per_rank[1] - per_rank[0] > 0.9 * injected
    assert gp["productive_gpu_hours"] + sum(gp["lost_gpu_hours"].values()) == pytest.approx(
        gp["gpu_hours"], rel=1e-3)
    assert len(gp["runs"]) == 1 and gp["runs"][0]["ranks"] == 2


def test_terminal_report_shows_goodput(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from stepscope.report.terminal import render_terminal

    spec = SynthRun(ranks=2, steps=40, slow=(Slow(rank=1, phase="dataloader", ms=20.0,
                                                 start_step=10, end_step=29),))
    doc = analyze_run(_write(tmp_path / "run", make_records(spec)))
    buf = io.StringIO()
    render_terminal(doc, Console(file=buf, width=120, color_system=None))
    text = buf.getvalue()
    assert f"Goodput {doc['goodput']['goodput']:.1%}" in text
    assert "lost to waiting for stragglers" in text and "lost to input stalls" in text
    assert "restarts" not in text  # nothing lost there: no line

    from stepscope.report.markdown import render_markdown

    md = render_markdown(doc)
    assert "## Goodput" in md and "| waiting for stragglers |" in md


def test_steps_filled_by_their_phases_leave_exactly_no_productive_time(tmp_path: Path) -> None:
    # Every step is all input (loader + copy, whose milliseconds add up to the step's): the
    # float sum of the parts falls a few ulps short of the step now and then, which read as
    # ~1e-20 productive GPU hours whose last digits changed with DuckDB's summing order.
    rnd = random.Random(3)
    recs = make_records(SynthRun(ranks=2, steps=40, noise_ms=0.0))
    for rows in recs.values():
        for rec in rows:
            a, b = round(rnd.uniform(1, 9), 3), round(rnd.uniform(1, 9), 3)
            rec["step_ms"] = round(a + b, 3)
            rec["phases"] = [dict(p, ms=v) for p, v in zip(
                [q for q in rec["phases"] if q["name"] in ("dataloader", "h2d")], (a, b),
                strict=True)]
    gp = analyze_run(_write(tmp_path / "run", recs))["goodput"]
    assert gp["productive_gpu_hours"] == 0.0
    assert gp["goodput"] == 0.0
    assert _ms(gp, "input_stalls") > 0.9 * sum(r["step_ms"] for rows in recs.values() for r in rows)


@pytest.mark.parametrize(("clock", "unit"), [("cpu", "CPU-hours"), ("cuda", "GPU-hours")])
def test_the_unit_follows_the_clock(tmp_path: Path, clock: str, unit: str) -> None:
    """A rank on a CPU clock holds a CPU process, not a GPU: the unit says which."""
    doc = analyze_run(_write(tmp_path / clock, make_records(SynthRun(ranks=2, steps=30, clock=clock))))
    assert doc["goodput"]["unit"].startswith(unit), doc["goodput"]["unit"]
