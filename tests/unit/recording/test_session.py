"""The session's step boundary: what a step known to be unsampled runs, and what it keeps."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from frames import PACKAGE, calls_of

from stepscope.recording.config import Config


def _stepscope_frames(fn: Any) -> list[str]:
    """Names of the Python functions of stepscope that ``fn()`` calls, in order."""
    return calls_of(fn, package=True)


def _warm_unsampled(mem_tracer: Any) -> tuple[Any, Callable[[], None]]:
    """A tracer with model and optimizer hooks that records 1 step in 1000, past its first
    steps, and one empty step of it to run (unsampled until step 999)."""
    model = torch.nn.Linear(2, 2)
    tr = mem_tracer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    every_n_steps=1000)
    for _ in range(3):
        with tr.step():
            pass

    def one() -> None:
        with tr.step():
            pass

    return tr, one


def test_an_unsampled_step_runs_only_the_step_call_and_its_entry_and_exit(mem_tracer):
    tr, one = _warm_unsampled(mem_tracer)
    assert _stepscope_frames(one) == ["step", "_enter_step", "_exit_step"]
    # The step before a sampled one takes the full boundary (hooks on, run-queue baseline).
    for _ in range(995):
        one()
    assert tr.step_index == 999
    assert "_close_step" in _stepscope_frames(one)
    with tr.step():
        assert tr.recording
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [0, 1000]


def test_the_heartbeat_state_follows_unsampled_steps(mem_tracer):
    tr = mem_tracer(every_n_steps=1000, auto=False)
    with tr.step():
        pass
    with tr.step():
        before = time.time()
        st = tr.state()
        assert st["in_step"] and st["step"] == 1
        assert before - 1.0 <= st["step_started"] <= before
        time.sleep(0.02)
    st = tr.state()
    assert not st["in_step"] and st["step"] == 2 and st["step_started"] is None
    assert st["last_step"] == 1
    assert 0.02 <= st["last_step_s"] < 10.0
    assert abs(st["last_step_end"] - time.time()) < 1.0


def test_the_heartbeat_state_follows_recorded_steps(mem_tracer):
    """A recorded step's end, in wall-clock time, comes from its marks on the host clock: it
    falls between the wall clock read before and after the step's exit (to within what a
    preemption between the entry's two clock reads can shift it)."""
    tr = mem_tracer(auto=False)
    with tr.step(), tr.phase("work"):
        time.sleep(0.02)
    for _ in range(3):
        with tr.step():
            time.sleep(0.02)
            before = time.time_ns()
        after = time.time_ns()
        st = tr.state()
        assert st["last_step"] == tr.step_index - 1
        assert 0.02 <= st["last_step_s"] < 10.0
        assert before / 1e9 - 0.5 <= st["last_step_end"] <= after / 1e9 + 0.5  # a loaded host
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [0, 1, 2, 3]


class _Ends:
    def __init__(self, sampled_only: bool) -> None:
        self.sampled_only = sampled_only
        self.seen: list[int] = []

    def on_step_end(self, run: Any, index: int) -> None:
        self.seen.append(index)


def test_a_sampled_only_listener_sees_sampled_steps_and_the_steps_before_them(mem_tracer):
    tr = mem_tracer(every_n_steps=5, auto=False)
    every, sampled = _Ends(False), _Ends(True)
    tr.add_listener(every)
    tr.add_listener(sampled)
    for _ in range(12):
        with tr.step():
            pass
    assert every.seen == list(range(12))
    assert sampled.seen == [0, 4, 5, 9, 10]


def test_step_index_moves_between_unsampled_and_sampled_steps(mem_tracer):
    model = torch.nn.Linear(2, 2)
    tr = mem_tracer(model=model, every_n_steps=10, start_step=3, end_step=45)
    x = torch.ones(1, 2)
    plan = [None, None, 20, None, 13, None, None, 33, None, 40, None, None, 44, None, 70, None]
    for index in plan:
        with tr.step(index=index):
            model(x)
    tr.finish()
    config = Config(every_n_steps=10, start_step=3, end_step=45)
    ran, i = [], 0
    for index in plan:
        i = i if index is None else index
        ran.append(i)
        i += 1
    assert [r["step"] for r in tr.sink.records] == [s for s in ran if config.samples(s)]
    assert all(any(p["name"] == "forward" for p in r["phases"]) for r in tr.sink.records)


def _attributes_used(fn: Any) -> set[str]:
    """Names of the attributes that the stepscope frames ``fn()`` runs load or store (opcode
    tracing: only the instructions that ran)."""
    import dis

    names: set[str] = set()
    ops: dict[Any, dict[int, str]] = {}

    def trace(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            if code not in ops:
                ops[code] = {i.offset: i.argval for i in dis.get_instructions(code)
                             if i.opname in ("LOAD_ATTR", "STORE_ATTR", "LOAD_METHOD")}
            name = ops[code].get(frame.f_lasti)
            if name is not None:
                names.add(name)
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return names


def test_an_unsampled_step_reads_and_writes_only_slots_of_the_tracer(mem_tracer):
    # A long step evicts the caches; the boundary after it then pays for each cache line it
    # touches. Slots sit side by side in the object; instance-dict entries are spread out.
    tr, one = _warm_unsampled(mem_tracer)
    used = _attributes_used(one)
    assert {"_index", "_sample_at", "_in_step", "_step_cm"} <= used
    cls = type(tr)
    not_slots = sorted(n for n in used if n in vars(tr) or not hasattr(cls, n))
    assert not_slots == []
    tr.finish()


def test_a_recorded_step_runs_these_stepscope_frames_and_no_more(mem_tracer):
    """The Python frames of stepscope on a recorded step with module, backward and optimizer
    timing: the boundary, one hook frame and one recorder frame per phase edge, and at the exit
    the run-queue read, the resource snapshot, the resolver's hand-over and the untimed-groups
    look. No span constructor, no clock method (the CPU clock's readiness check is C)."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = mem_tracer(model=model, optimizer=opt)
    x = torch.ones(4, 2)

    def one() -> None:
        with tr.step():
            model(x).sum().backward()
            opt.step()

    for _ in range(4):  # past the first steps' one-off checks (the forward-span warning)
        one()
    assert _stepscope_frames(one) == [
        "step", "_enter_step", "_open_step", "__init__",  # the Step
        "pre", "open_phase", "post", "close_phase",  # forward
        "_timed_backward", "run_backward", "open_phase", "close_phase",  # backward
        "pre", "open_phase", "post", "close_phase",  # optimizer
        "_exit_step", "_close_step", "step_end", "on_step_end", "add", "poll", "on_step_end",
    ]
    tr.finish()
    assert [r["step"] for r in tr.sink.records] == [0, 1, 2, 3, 4]
    assert [p["name"] for p in tr.sink.records[-1]["phases"]] == ["forward", "backward", "optimizer"]


def test_an_unsampled_step_calls_nothing_in_c_but_the_wall_clock_at_entry_and_exit(mem_tracer):
    """The boundary of an unsampled step runs after a long step has evicted the caches, where
    each C call costs ~1 µs: it reads the wall clock once at entry (the heartbeat's
    ``step_started``) and once at exit (``last_step_end``), and does not ask for its thread
    (that of the last full boundary is kept)."""
    tr, one = _warm_unsampled(mem_tracer)
    assert calls_of(one, c=True, package=True) == ["time_ns", "time_ns"]
    st = tr.state()
    assert not st["in_step"] and st["last_step"] == 3
    tr.finish()
