"""Quiet when healthy: clean real gloo runs report ``balanced`` with no WARNING or CRITICAL.

The fast suite keeps one clean run per rank count for the plain DDP demo; the soak suite
(``-m soak``) repeats every framework path (DDP at 2, 4 and 8 ranks, FSDP2 at 2, 4 and 8,
Lightning and the HF Trainer at 2 and 4, ``torch.distributed.pipelining`` GPipe with 2 and 4
stages) ``SOAK_RUNS`` times. Severity
follows cost (analysis/cost.py): a finding must cost the job at least 1% of its time to be a
warning, so scheduling noise on a busy host stays a note at most.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepscope.analysis.run import analyze_run

demo = pytest.importorskip("stepscope.demo")
harness = pytest.importorskip("dist_harness")

SOAK_RUNS = int(os.environ.get("STEPSCOPE_SOAK_RUNS", "20"))


def _assert_quiet(doc: dict[str, Any]) -> None:
    loud = [(v["severity"], v["kind"], v["evidence"]) for v in doc["verdicts"]
            if v["severity"] != "info"]
    assert not loud, loud
    assert "balanced" in [v["kind"] for v in doc["verdicts"]], doc["verdicts"]
    # No fault; where goodput lost a tenth or more, the headline says to what instead.
    lost = 1.0 - float((doc.get("goodput") or {}).get("goodput") or 1.0)
    start = "No fault found" if lost >= 0.10 else "No costly finding"
    assert doc["run"]["headline"].startswith(start), doc["run"]["headline"]


def _lightning(out: Path, ranks: int) -> Path:
    pl = pytest.importorskip("dist_lightning")
    return Path(pl.launch_lightning(out, ranks=ranks, steps=60))


def _pipeline(out: Path, ranks: int) -> Path:
    fw = pytest.importorskip("dist_frameworks")
    # GPipe, one stage per rank, each with a few ms of compute per micro-batch
    return Path(fw.launch_pipeline(out, ranks=ranks, steps=60, dim=1024))


def _hf(out: Path, ranks: int) -> Path:
    pytest.importorskip("transformers")
    return Path(harness.launch_hf(out, ranks=ranks, steps=60))


PATHS: dict[str, Callable[[Path, int], Path]] = {
    "ddp": lambda out, ranks: Path(demo.launch(out, ranks=ranks, steps=80, seed=7)),
    "fsdp2": lambda out, ranks: Path(harness.launch_fsdp(out, ranks=ranks, steps=60)),
    "lightning": _lightning,
    "hf": _hf,
    "pipeline": _pipeline,
}


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_clean_ddp_run_is_quiet(tmp_path: Path, ranks: int) -> None:
    _assert_quiet(analyze_run(PATHS["ddp"](tmp_path / "run", ranks)))


@pytest.mark.soak
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("path", "ranks"), [("ddp", 2), ("ddp", 4), ("ddp", 8), ("fsdp2", 2),
                                             ("fsdp2", 4), ("fsdp2", 8), ("lightning", 2),
                                             ("lightning", 4), ("hf", 2), ("hf", 4),
                                             ("pipeline", 2), ("pipeline", 4)])
def test_soak_clean_runs_never_warn(tmp_path: Path, path: str, ranks: int) -> None:
    loud = []
    for i in range(SOAK_RUNS):
        doc = analyze_run(PATHS[path](tmp_path / f"run{i}", ranks))
        loud += [(i, v["severity"], v["kind"], v["evidence"]) for v in doc["verdicts"]
                 if v["severity"] != "info"]
    assert not loud, f"{len(loud)} false alarm(s) in {SOAK_RUNS} clean runs: {loud}"
