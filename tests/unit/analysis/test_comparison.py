"""``stepscope compare``: real demo runs for the slowed phase, synthetic runs for the statistics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepscope.analysis.comparison import bootstrap_change, compare_runs, parse_steps
from stepscope.cli import main
from stepscope.demo import SlowSpec, launch

PHASES = {"dataloader": 2.0, "forward": 10.0, "backward": 20.0, "optimizer": 3.0}


def write_run(
    d: Path, seed: int, *, slow: dict[str, float] | None = None, n: int = 120, world: int = 2,
    phases: dict[str, float] | None = None,
) -> Path:
    """Schema-1 records with gamma noise around fixed phase times (plus ``slow`` ms)."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    base = phases or PHASES
    for rank in range(world):
        with open(d / f"rank{rank}.jsonl", "w") as fh:
            for step in range(n):
                t = 0.0
                recs = []
                for name, ms in base.items():
                    v = ms + rng.gamma(4, 0.1 * ms / 4 + 0.05) + (slow or {}).get(name, 0.0)
                    recs.append({"name": name, "parent": None, "ms": v, "calls": 1,
                                 "start_ms": t, "end_ms": t + v})
                    t += v
                fh.write(json.dumps({
                    "schema": 1, "run_id": d.name, "rank": rank, "local_rank": rank,
                    "world_size": world, "hostname": "h", "device": "cpu", "step": step,
                    "start_unix_ns": 10**18 + step * 10**8, "clock": "cpu", "step_ms": t + 0.5,
                    "phases": recs, "residual_ms": 0.5,
                }) + "\n")
    return d


@pytest.mark.slow
def test_slowed_phase_on_one_rank_is_named_with_a_ci_excluding_zero(tmp_path, capsys):
    # 2 gloo ranks; in B rank 1's forward sleeps 30 ms more (>= 3x a CPU demo step).
    a = launch(tmp_path / "a", ranks=2, steps=60)
    b = launch(tmp_path / "b", ranks=2, steps=60, slow=(SlowSpec(rank=1, phase="forward", ms=30.0),))
    assert main(["compare", str(a), str(b), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["a"]["dir"] == str(a) and doc["b"]["dir"] == str(b)
    assert doc["a"]["id"] and doc["b"]["id"]
    step = doc["step"]
    assert step["significant"] and step["ci_low_pct"] > 0
    assert step["b_ms"] - step["a_ms"] > 15.0
    fwd = next(p for p in doc["phases"] if p["name"] == "forward")
    assert fwd["significant"] and fwd["ci_low_pct"] > 0 < fwd["ci_high_pct"]
    assert fwd["b_ms"] - fwd["a_ms"] > 20.0
    assert "slower" in doc["verdict"] and "forward rose" in doc["verdict"], doc["verdict"]
    assert {r["rank"] for r in doc["per_rank"]} == {0, 1}
    # The terminal view says the same.
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "forward rose" in out


def test_identical_distributions_give_no_significant_difference(tmp_path, capsys):
    a = write_run(tmp_path / "a", seed=1)
    b = write_run(tmp_path / "b", seed=2)
    assert main(["compare", str(a), str(b), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"].startswith("no significant difference"), doc["verdict"]
    assert not doc["step"]["significant"]
    # Two seeds of one distribution may even give an interval just off 0; the effect floor
    # (3%) keeps such a sub-percent shift from being called a change.
    assert abs(doc["step"]["change_pct"]) < 3.0
    assert doc["step"]["ci_low_pct"] < 1.0 and doc["step"]["ci_high_pct"] > -1.0
    assert not any(p["significant"] for p in doc["phases"])


def test_faster_run_verdict_names_the_phase_and_change_is_on_medians(tmp_path):
    a = write_run(tmp_path / "a", seed=1, slow={"dataloader": 9.0})
    b = write_run(tmp_path / "b", seed=2)
    doc = compare_runs(a, b)
    s = doc["step"]
    assert s["change_pct"] == pytest.approx((s["b_ms"] - s["a_ms"]) / s["a_ms"] * 100, abs=0.02)
    assert s["significant"] and s["ci_high_pct"] < 0
    assert doc["verdict"].startswith("B is ") and "faster per step (CI" in doc["verdict"]
    assert "dataloader fell from" in doc["verdict"] and "within noise" in doc["verdict"]
    # Warm-up: the first 10% of 120 steps left out by default.
    assert doc["step"]["a_samples"] == 108 and doc["method"]["warmup"]


def test_verdict_names_collective_waits_that_moved_instead_of_calling_them_noise():
    from stepscope.analysis.comparison import verdict

    def ph(name: str, a: float, b: float, sig: bool) -> dict[str, Any]:
        return {"name": name, "a_ms": a, "b_ms": b, "significant": sig}

    step = {"change_pct": -57.4, "significant": True, "ci_low_pct": -60.9, "ci_high_pct": -52.0,
            "a_ms": 23.3, "b_ms": 9.9}
    # The demo's shape: the data fix removes 15 ms of dataloader on one rank; the others'
    # all-reduce wait inside backward falls with it.
    phases = [ph("dataloader", 15.3, 0.2, True), ph("forward", 0.48, 0.47, False),
              ph("backward", 21.6, 9.2, True), ph("backward/grad_sync", 20.9, 8.8, True),
              ph("optimizer", 0.14, 0.14, False)]
    text = verdict(step, phases)
    assert text.startswith("B is 57% faster per step (CI 52–61%): dataloader fell from 15.3 to 0.2 ms")
    assert "within noise" not in text, text
    assert text.endswith("; waits on other ranks changed too: "
                         "backward/grad_sync fell from 20.9 to 8.8 ms"), text
    # Several drivers: "every other phase moved less than ..." would hide the 12 ms wait.
    phases.append(ph("forward/attn", 0.30, 0.10, True))
    phases[1] = ph("forward", 0.48, 0.28, True)
    text = verdict(step, phases)
    assert "every other phase's own time moved less than 1.3 ms" in text, text
    assert text.endswith("waits on other ranks changed too: backward/grad_sync fell from 20.9 to 8.8 ms")
    # Without a collective that moved, the rest is noise, as before.
    quiet = [ph("dataloader", 15.3, 0.2, True), ph("backward/grad_sync", 20.9, 20.8, False)]
    assert verdict(step, quiet).endswith("; the rest is within noise")


def test_steps_range_and_nothing_in_range(tmp_path, capsys):
    a = write_run(tmp_path / "a", seed=1)
    b = write_run(tmp_path / "b", seed=2)
    doc = compare_runs(a, b, steps="100:")
    assert doc["step"]["a_samples"] == 20 and doc["method"]["steps"] == [100, None]
    assert main(["compare", str(a), str(b), "--steps", "500:"]) == 2
    assert "no steps in the range" in capsys.readouterr().err
    assert main(["compare", str(a), str(b), "--steps", "9:3"]) == 2
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2
    assert "stepscope compare:" in capsys.readouterr().err


def test_different_world_sizes_and_phases_compare_what_they_share(tmp_path):
    a = write_run(tmp_path / "a", seed=1, world=2)
    b = write_run(tmp_path / "b", seed=2, world=3,
                  phases={"forward": 10.0, "backward": 20.0, "metrics": 1.0})
    doc = compare_runs(a, b)
    assert doc["per_rank"] is None
    names = {p["name"] for p in doc["phases"]}
    assert {"forward", "backward"} <= names and "metrics" not in names and "dataloader" not in names
    assert doc["only_in_a"] == ["dataloader", "optimizer"] and doc["only_in_b"] == ["metrics"]
    notes = " ".join(doc["notes"])
    assert "world sizes differ" in notes and "only in B: metrics" in notes


def test_markdown_output(tmp_path, capsys):
    a = write_run(tmp_path / "a", seed=1)
    b = write_run(tmp_path / "b", seed=2, slow={"forward": 5.0})
    md = tmp_path / "cmp.md"
    assert main(["compare", str(a), str(b), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "| forward |" in text and "forward rose" in text and "yes" in text


def test_parse_steps():
    assert parse_steps("100:") == (100, None)
    assert parse_steps(":50") == (None, 50)
    assert parse_steps("3") == (3, 4)
    assert parse_steps(None) == (None, None)
    with pytest.raises(ValueError):
        parse_steps("a:b")


def test_bootstrap_interval_covers_a_known_shift():
    rng = np.random.default_rng(7)
    a = 10 + rng.gamma(4, 0.5, 400)
    b = a * 1.2  # exactly 20% slower, same noise shape
    lo, hi = bootstrap_change(a, rng.permutation(b))
    assert lo < 20.0 < hi and hi - lo < 8.0
    assert bootstrap_change(a[:2], b) is None


@pytest.mark.slow
def test_demo_writes_a_fixed_run_and_compares_it(tmp_path, capsys):
    from stepscope.demo import run_demo

    out = tmp_path / "demo"
    assert run_demo(str(out), ranks=2, steps=40, slow_rank=1) == 0
    fixed = tmp_path / "demo-fixed"
    assert sorted(p.name for p in fixed.glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]
    text = capsys.readouterr().out
    assert f"$ stepscope compare {out} {fixed} --steps 16:28" in text
    assert "faster per step" in text and "dataloader fell" in text, text[-2000:]
