"""Numbers given to ``step()`` and ``count()`` never stop the training job.

An int count in 0..2^53 (numpy ints too) is recorded as it is; a larger one as a float, with
one warning; anything else (negative, bool, float, NaN, inf, not a number, an int too large
for a float) is dropped with one warning. A bad ``step(index)`` is warned about once and the
step counter goes on. Every record is written either way.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stepscope
from stepscope.common.errors import StepscopeWarning
from stepscope.recording.schema import read_run


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


BAD = [-1, True, 1.5, float("nan"), float("inf"), "3", None.__class__, 10**5000, -(2**70),
       _BadRepr(), np.float64(3.0), np.int64(-4)]


def _train(out: Path, steps: int, **step_kw: Any) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        stepscope.init(str(out), auto=False, flush_every_n_steps=5, heartbeat_s=0)
        for _ in range(steps):
            with stepscope.step(**step_kw), stepscope.phase("compute"):
                torch.ones(4).sum()
        stepscope.finish()
    return [w for w in got if issubclass(w.category, StepscopeWarning)]


def test_a_count_past_2_pow_53_is_recorded_as_a_float_warned_once(tmp_path: Path) -> None:
    got = _train(tmp_path / "run", 20, tokens=2**70, samples=np.int64(8))
    assert [str(w.message) for w in got if "tokens" in str(w.message)] == [
        "stepscope: tokens=1180591620717411303424 is past 2^53 per step; recorded as a float "
        "(rounded to 53 bits)"]
    recs = read_run(tmp_path / "run")
    assert len(recs) == 20
    assert all(r["throughput"]["tokens"] == 2.0**70 for r in recs)
    assert all(r["throughput"]["samples"] == 8 for r in recs)


@pytest.mark.parametrize("bad", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_a_bad_count_is_dropped_warned_once_and_recording_goes_on(tmp_path: Path, bad: Any) -> None:
    got = _train(tmp_path / "run", 10, tokens=bad, samples=4)
    msgs = [str(w.message) for w in got]
    assert len([m for m in msgs if "tokens must be" in m]) == 1, msgs
    recs = read_run(tmp_path / "run")
    assert len(recs) == 10
    assert all("tokens" not in r["throughput"] and r["throughput"]["samples"] == 4 for r in recs)


def test_count_with_a_bad_or_huge_number_never_raises(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        tr = stepscope.init(str(tmp_path / "run"), auto=False, heartbeat_s=0)
        for bad in BAD:
            with tr.step():
                stepscope.count("tokens", 100)
                stepscope.count("tokens", bad)
        with tr.step():
            stepscope.count("tokens", np.uint32(7))
            stepscope.count("tokens", 2**60)
        stepscope.finish()
    recs = read_run(tmp_path / "run")
    assert [r["throughput"]["tokens"] for r in recs] == [100] * len(BAD) + [7 + 2.0**60]
    assert len([w for w in got if "tokens must be" in str(w.message)]) == 1


def test_a_bad_step_index_is_warned_once_and_the_counter_goes_on(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        stepscope.init(str(tmp_path / "run"), auto=False, heartbeat_s=0)
        for index in (np.int64(10), -1, 2**70, True, 1.5, "12"):
            with stepscope.step(index):
                pass
        stepscope.finish()
    assert [r["step"] for r in read_run(tmp_path / "run")] == [10, 11, 12, 13, 14, 15]
    assert len([w for w in got if "step index" in str(w.message)]) == 1


def test_the_no_op_tracer_takes_any_count() -> None:
    stepscope.finish()
    with stepscope.step(tokens=2**70, samples=float("nan")):
        stepscope.count("tokens", -5)
