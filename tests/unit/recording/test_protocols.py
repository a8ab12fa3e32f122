"""The recording core's seams: an instrument written against the Recorder protocol alone, and a
listener written against the Listener protocol, plug into a session with no Tracer and no
module of ``stepscope.instrument`` or ``stepscope.listeners``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from stepscope.common.errors import StepscopeWarning
from stepscope.recording.clock import CpuClock
from stepscope.recording.config import Config
from stepscope.recording.dist import RankInfo
from stepscope.recording.protocols import Instruments, PerStep, Recorder, Run
from stepscope.recording.session import Session
from stepscope.recording.sinks import MemorySink


class FakeLoss:
    """An instrument: times each call as a ``loss`` phase, counts its calls, through the
    recorder protocol only."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def __call__(self, value: float) -> float:
        token = self.rec.open_phase("loss")
        try:
            return value * 2
        finally:
            self.rec.close_phase(token)
            self.rec.add_counter("loss_calls", 1)


class NoResources:
    starts_pending = False

    def on_step_start(self, index: int) -> None:
        return None

    def on_step_end(self, index: int) -> Any:
        return None

    def step_fields(self, index: int, start_unix_ns: int, step_ms: float,
                    counters: dict[str, float], res: Any) -> dict[str, Any]:
        return {}

    def stop_counter(self) -> None:
        return None

    def close(self) -> None:
        return None


class FakeInstruments:
    """The instrument side as a session sees it: here, only :class:`FakeLoss`."""

    def __init__(self) -> None:
        self.loss: FakeLoss | None = None
        self.removed = False

    def install(self, recorder: Any, config: Config, model: Any, optimizer: Any,
                warn: Callable[[str], None]) -> tuple[list[Callable[[], None]], set[str], list[PerStep]]:
        self.loss = FakeLoss(recorder)

        def remove() -> None:
            self.removed = True

        return [remove], set(), []

    def watch_captures(self) -> tuple[Callable[[], None], Callable[[], bool]]:
        raise AssertionError("a CPU clock watches no CUDA-graph capture")

    def resources(self, config: Config, device: str, warn: Callable[..., None]) -> NoResources:
        return NoResources()

    def run_queue(self, clock_kind: str) -> None:
        return None

    @property
    def summarize_collectives(self) -> Callable[..., list[dict[str, Any]]]:
        return lambda entries, elapsed_ms: []

    def blocked_in(self, thread_id: int) -> tuple[str, float] | None:
        return None


class StepCounter:
    """A listener: what it sees of the run, at each step end and for each record."""

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.records: list[dict[str, Any]] = []
        self.finished: list[str] = []

    def on_step_end(self, run: Run, index: int) -> None:
        self.ends.append(index)

    def on_record(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def on_finish(self, run: Run) -> None:
        self.finished.append(run.run_id)


def test_a_fake_instrument_on_the_recorder_protocol_records_a_phase() -> None:
    instruments = FakeInstruments()
    listener = StepCounter()
    sink = MemorySink()
    session = Session(Config(out_dir="unused", heartbeat_s=0), CpuClock(),
                      RankInfo(0, 0, 1, "host"), "run-a", sink, instruments)
    as_seen: tuple[Recorder, Instruments] = (session, instruments)  # the protocols fit (mypy)
    assert as_seen[0] is session
    session._start(None, None, lambda run: run.add_listener(listener))
    loss = instruments.loss
    assert loss is not None
    for _ in range(3):
        session._enter_step()  # what ``with tracer.step():`` calls
        assert loss(1.5) == 3.0
        session._exit_step()
    with pytest.warns(StepscopeWarning, match="outside a step is not timed"):
        assert loss(1.0) == 2.0  # between steps: not a pre-step phase, not timed
    assert session.enabled
    session.finish()

    assert [r["step"] for r in sink.records] == [0, 1, 2]
    for record in sink.records:
        [phase] = record["phases"]
        assert (phase["name"], phase["path"], phase["calls"]) == ("loss", "loss", 1), record
        assert 0 <= phase["start_ms"] <= phase["end_ms"] <= record["step_ms"]
        assert record["counters"]["loss_calls"] == 1
    assert listener.ends == [0, 1, 2]
    assert [r["step"] for r in listener.records] == [0, 1, 2]
    assert listener.finished == ["run-a"]
    assert instruments.removed


def test_the_core_loads_without_instruments_listeners_or_the_face() -> None:
    code = """
        import sys
        import stepscope.recording.session, stepscope.recording.protocols
        print(sorted(m for m in sys.modules if m.startswith(("stepscope.instrument",
              "stepscope.listeners", "stepscope.tracer", "stepscope.lifecycle"))))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
