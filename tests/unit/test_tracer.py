"""Tracer logic on the CPU clock: phases, residual, nesting, sampling, pre-step spans."""

from __future__ import annotations

import contextlib
import time

import pytest

import stepscope
from stepscope.common.errors import InstrumentationError


def _phases(rec):
    return {p["name"]: p for p in rec["phases"]}


def test_phases_residual_and_absent_phases(mem_tracer):
    tr = mem_tracer(auto=False)
    for i in range(3):
        with tr.step():
            with tr.phase("forward"):
                time.sleep(0.004)
            if i == 1:
                with tr.phase("metrics"):
                    time.sleep(0.002)
            time.sleep(0.003)  # unattributed: residual
    tr.finish()
    recs = tr.sink.records
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert "metrics" not in _phases(recs[0]), "a phase that did not happen must be absent"
    assert _phases(recs[1])["metrics"]["ms"] >= 2.0
    for r in recs:
        fwd = _phases(r)["forward"]
        assert fwd["ms"] >= 4.0 and fwd["calls"] == 1 and fwd["parent"] is None
        assert r["residual_ms"] >= 3.0
        top = sum(p["ms"] for p in r["phases"] if p["parent"] is None)
        assert r["residual_ms"] == pytest.approx(r["step_ms"] - top, abs=0.01)
        assert r["clock"] == "cpu" and r["schema"] == 2
        assert 0 <= fwd["start_ms"] <= fwd["end_ms"] <= r["step_ms"]


def test_nested_phases_and_decorator(mem_tracer):
    tr = mem_tracer(auto=False)

    @tr.phase("inner")
    def work():
        time.sleep(0.002)

    with tr.step(), tr.phase("outer"):
        work()
        work()
    tr.finish()
    ph = _phases(tr.sink.records[0])
    assert ph["inner"]["parent"] == "outer" and ph["inner"]["calls"] == 2
    assert ph["outer"]["ms"] >= ph["inner"]["ms"] >= 4.0
    # Nested time is inside its parent, so it does not reduce the residual twice.
    assert tr.sink.records[0]["residual_ms"] == pytest.approx(
        tr.sink.records[0]["step_ms"] - ph["outer"]["ms"], abs=0.01
    )


def test_sampling_and_explicit_step_index(mem_tracer):
    tr = mem_tracer(start_step=2, end_step=9, every_n_steps=3, auto=False)
    for _ in range(12):
        with tr.step(), tr.phase("x"):
            pass
    with tr.step(index=100):
        pass
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [2, 5, 8]


def test_flush_cadence_hands_records_over_every_n_sampled_steps(mem_tracer):
    tr = mem_tracer(flush_every_n_steps=4, auto=False)
    for _ in range(3):
        with tr.step():
            pass
    time.sleep(0.2)  # give the writer thread a chance: nothing may be handed over yet
    assert tr.sink.records == []
    with tr.step():
        pass
    deadline = time.monotonic() + 5
    while len(tr.sink.records) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r["step"] for r in tr.sink.records] == [0, 1, 2, 3]
    with tr.step():
        pass
    tr.finish()
    assert len(tr.sink.records) == 5 and tr.sink.closed


def test_loader_wait_belongs_to_the_next_step_and_moves_its_start(mem_tracer):
    tr = mem_tracer()

    def slow_source():
        for i in range(3):
            time.sleep(0.005)
            yield i

    seen = []
    for b in tr.wrap_loader(slow_source()):
        with tr.step():
            seen.append(b)
            time.sleep(0.001)
    tr.finish()
    assert seen == [0, 1, 2]
    recs = tr.sink.records
    assert len(recs) == 3
    for r in recs:
        dl = _phases(r)["dataloader"]
        assert dl["start_ms"] == 0.0, "the step starts where its data wait started"
        assert dl["ms"] >= 5.0
        assert r["step_ms"] >= dl["ms"] + 1.0


def test_wrapped_loader_forwards_len_and_attributes(mem_tracer):
    import torch

    tr = mem_tracer()
    dl = torch.utils.data.DataLoader(list(range(10)), batch_size=3)
    wrapped = tr.wrap_loader(dl)
    assert len(wrapped) == 4 and wrapped.batch_size == 3
    assert [b.tolist() for b in wrapped] == [b.tolist() for b in dl]


def test_double_instrumentation_is_a_clear_error(mem_tracer):
    import torch

    model = torch.nn.Linear(2, 2)
    tr = mem_tracer(model=model)
    with pytest.raises(InstrumentationError, match="'forward' is already timed automatically"):
        tr.phase("forward")
    with pytest.raises(InstrumentationError, match="wrap_h2d"):
        tr.wrap_h2d(torch.zeros(1))
    tr.wrap_loader([1])
    with pytest.raises(InstrumentationError, match="'dataloader'"):
        tr.phase("dataloader")
    manual = mem_tracer(auto=False, model=model)
    with manual.step(), manual.phase("forward"):
        model(torch.zeros(2))
    manual.finish()
    assert [p["name"] for p in manual.sink.records[0]["phases"]] == ["forward"]


def test_phase_name_validation(mem_tracer):
    tr = mem_tracer()
    for bad in ("", "residual", 3):
        with pytest.raises(ValueError):
            tr.phase(bad)


def test_nested_step_warns_once_and_the_job_goes_on(mem_tracer):
    tr = mem_tracer(auto=False)
    for _ in range(2):
        with tr.step():
            with pytest.warns(stepscope.StepscopeWarning, match="inside an open step") if _ == 0 \
                    else contextlib.nullcontext(), tr.step(), tr.phase("inner"):
                time.sleep(0.002)
            with tr.phase("outer"):
                pass
    tr.finish()
    recs = tr.sink.records
    assert [r["step"] for r in recs] == [0, 1], "the inner step() neither counted nor recorded"
    assert all({p["name"] for p in r["phases"]} == {"inner", "outer"} for r in recs)


def test_disabled_is_a_no_op_and_writes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "off"
    tr = stepscope.init(out_dir=str(out), enabled=False)
    assert isinstance(tr, stepscope.NullTracer)
    data = [1, 2]
    assert stepscope.wrap_loader(data) is data
    obj = object()
    assert stepscope.wrap_h2d(obj) is obj
    with stepscope.step(), stepscope.phase("x"):
        pass

    @stepscope.phase("y")
    def f():
        return 7

    assert f() == 7 and stepscope.summary() == {}
    stepscope.finish()
    monkeypatch.setenv("STEPSCOPE_DISABLE", "1")
    assert isinstance(stepscope.init(out_dir=str(out)), stepscope.NullTracer)
    stepscope.finish()
    assert not out.exists()


def test_rank_filter_makes_other_ranks_no_ops(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert isinstance(stepscope.init(out_dir=str(tmp_path), ranks=[0, 1]), stepscope.NullTracer)
    stepscope.finish()
    tr = stepscope.init(out_dir=str(tmp_path), ranks=[3])
    with stepscope.step():
        pass
    stepscope.finish()
    assert tr.rank.rank == 3 and tr.rank.world_size == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "rank3.jsonl", "rank3.status.json"]


def test_summary_gives_recent_medians(mem_tracer):
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    for _ in range(5):
        with tr.step(), tr.phase("work"):
            time.sleep(0.002)
    deadline = time.monotonic() + 5
    while tr.summary()["steps"] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)  # records reach the summary at flush cadence, off-thread
    s = tr.summary()
    assert s["steps"] == 5 and s["phases"]["work"]["median_ms"] >= 2.0
    assert 0 < s["phases"]["work"]["share"] <= 1.0


def test_null_tracer_mirrors_the_tracer_interface():
    import inspect

    from stepscope.lifecycle import NullTracer
    from stepscope.tracer import Tracer

    public = {n for n, v in vars(Tracer).items() if not n.startswith("_") and callable(v)}
    missing = {n for n in public if not callable(getattr(NullTracer, n, None))}
    assert not missing, f"NullTracer lacks {sorted(missing)}"
    null = NullTracer()
    for name in public:
        params = inspect.signature(getattr(Tracer, name)).parameters
        args = [object()] * (len([p for p in params.values() if p.default is p.empty]) - 1)
        result = getattr(null, name)(*args)
        returns = {"step", "phase", "wrap_loader", "wrap_h2d", "summary", "recent_records", "state"}
        assert result is None or name in returns
