"""The GPU check's dry mode runs every check's code path on CPU and says it measured nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import paths  # tests/support: where the repository is

ROOT = paths.ROOT
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CHECKS = ["sync_debug", "run_ahead", "overhead_3ms", "overhead_30ms", "records", "prefetch",
          "profiler_trace"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def test_dry_run_prints_one_honest_line_per_check(tmp_path: Path) -> None:
    record = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--record", str(record)],
                          capture_output=True, text=True, timeout=240, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert [ln["check"] for ln in lines] == [*CHECKS, "summary"]
    for ln in lines:
        assert ln["ok"] is True, ln
        assert ln["device"] == "dry-run" and ln["measured"] is False
        assert "nothing was measured on a GPU" in ln["note"]
    by = {ln["check"]: ln for ln in lines}
    # Each check's code path ran: records were written and checked, the trace CLI read the window.
    assert by["sync_debug"]["records_on_disk"] == by["sync_debug"]["steps_done"] == 20
    assert by["records"]["records_found"] == by["records"]["records_expected"] > 20
    assert by["records"]["identity_violations"] == 0
    assert by["overhead_3ms"]["bare_ms"] is not None and by["overhead_3ms"]["one_in_10_ms"] is not None
    assert by["profiler_trace"]["trace_rc"] == 0 and by["profiler_trace"]["steps_in_trace"] == 3
    rec = json.loads(record.read_text())
    assert rec["benchmark"] == "gpu_check" and rec["measured"] is False
    assert set(rec["figures"]) == {*CHECKS, "summary"}


def test_without_cuda_it_fails_fast_in_one_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        return  # this machine has a GPU: the real check applies, not this one
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env=_env(), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "no CUDA device" in proc.stderr


def test_its_dependency_list_is_pyprojects() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M)
    assert block is not None
    declared = {re.split(r"[<>=!~ ]", d)[0] for d in re.findall(r'"([^"]+)"', block.group(1))}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--list-deps"], capture_output=True, text=True,
                          timeout=60)
    listed = set(proc.stdout.split())
    assert declared - {"torch"} <= listed
    assert "torch" not in listed
