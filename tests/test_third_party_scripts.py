"""Third-party training scripts run under stepscope (2-3 gloo ranks on CPU), one rank slowed.

Each framework path is run twice over: from the script itself when its repository has been
fetched (``/work/.mirror``; skipped otherwise, as in CI) and from this repository's
re-creation of the script's usage pattern (``tests/third_party_scripts``, always run). The
scripts are executed as written; :mod:`third_party` repeats their training loop under
``stepscope.step()`` and injects the slowness (see there).
"""

from __future__ import annotations

from typing import Any

import pytest

from stepscope.analysis.run import analyze_run

third_party = pytest.importorskip("third_party")
pytestmark = pytest.mark.slow

MS = 40.0  # per step, far above a busy 2-core machine's jitter


def _tp_mirror() -> Any:
    return third_party.from_mirror(
        "pytorch/examples", "distributed/tensor_parallelism/tensor_parallel_example.py",
        ("distributed/tensor_parallelism/log_utils.py",))


def _pp_mirror() -> Any:
    return third_party.from_mirror("pytorch/PiPPy", "examples/basic/example_train.py")


def _script(source: str, which: str) -> Any:
    if source == "recreation":
        return third_party.recreation({"tp": "tp_mlp", "pp": "pp_split"}[which])
    script = _tp_mirror() if which == "tp" else _pp_mirror()
    if script is None:
        pytest.skip(f"the {which} script's repository is not fetched under {third_party.MIRRORS}")
    return script


def _culprit(doc: dict[str, Any]) -> dict[str, Any]:
    assert doc["stragglers"], doc["verdicts"]
    top = doc["verdicts"][0]
    assert top["kind"] == "straggler", doc["verdicts"]
    s: dict[str, Any] = doc["stragglers"][0]
    assert f"rank {s['rank']}" in top["evidence"]
    assert "host_overhead" not in {v["kind"] for v in doc["verdicts"]}
    return s


# ------------------------------------------------------------------ tensor parallel


@pytest.mark.parametrize(("source", "slow"), [
    ("recreation", (1, "forward")),
    ("recreation", None),
    ("mirror", (1, "forward")),
    ("mirror", (0, "backward")),
    ("mirror", None),
])
def test_tensor_parallel_script(tmp_path: Any, source: str, slow: tuple[int, str] | None) -> None:
    script = _script(source, "tp")
    doc = analyze_run(third_party.launch(script, tmp_path, ranks=2, steps=20,
                                         slow=None if slow is None else (*slow, MS)))
    ops = {(o["op"], o["pg"]) for o in doc["collectives"]["ops"]}
    assert ("all_reduce", "world") in ops  # DTensor's row-parallel all-reduce, through funcol
    assert "ddp_allreduce" not in {o["op"] for o in doc["collectives"]["ops"]}
    assert "pipeline" not in doc and "experts" not in doc
    if slow is None:
        assert doc["stragglers"] == [] and doc["windows"] == [], doc["verdicts"]
        assert all(v["severity"] == "info" for v in doc["verdicts"]), doc["verdicts"]
        return
    s = _culprit(doc)
    assert (s["rank"], s["phase"]) == slow
    assert 0.7 * MS < s["excess_ms"] < 1.4 * MS
    assert s["victims"] == [1 - slow[0]]


# ------------------------------------------------------------------ pipeline parallel


@pytest.mark.parametrize(("source", "slow_stage"), [
    ("recreation", 0), ("recreation", None), ("mirror", 1), ("mirror", None)])
def test_pipeline_script(tmp_path: Any, source: str, slow_stage: int | None) -> None:
    script = _script(source, "pp")
    ranks = 2 if source == "recreation" else 3  # PiPPy's example splits into 3 stages
    micro = 4  # both scripts run 4 micro-batches: the stage's forward runs 4 times a step
    doc = analyze_run(third_party.launch(
        script, tmp_path, ranks=ranks, steps=20,
        slow=None if slow_stage is None else (slow_stage, "forward", MS / micro)))
    pipe = doc["pipeline"]
    assert [s["rank"] for s in pipe["stages"]] == list(range(ranks))
    assert "host_overhead" not in {v["kind"] for v in doc["verdicts"]}
    assert "grad_sync" not in doc["phases"]
    if slow_stage is None:
        assert doc["stragglers"] == [] and doc["windows"] == [], doc["verdicts"]
        assert all(v["severity"] == "info" for v in doc["verdicts"]), doc["verdicts"]
        return
    s = _culprit(doc)
    assert (s["rank"], s["phase"]) == (slow_stage, "forward")
    assert 0.7 * MS < s["excess_ms"] < 1.4 * MS
    assert pipe["bottleneck_stage"] == slow_stage
    assert any(v["kind"] == "pipeline_bubble" for v in doc["verdicts"])
