"""Where the tracer's per-step host time goes: a trivial step under every automatic instrument.

Runs ``--steps`` steps of a tiny model (``Linear(8, 8)``, SGD) inside ``tracer.step()``, with
forward, backward, optimizer and h2d hooks, collective timing, the resource monitor and the
JSONL writer (as ``init()`` builds them; no heartbeat unless ``--heartbeat``), and reports:

- ``--mode time`` (default): µs/step of the training thread (wall and thread CPU) and the
  writer thread's CPU per step, against the same loop without a tracer (interleaved blocks;
  the bare blocks run a second copy of the model and optimizer that carries no hook).
- ``--mode cprofile``: a cProfile of the training thread over ``--steps`` steps (top 30 by
  own time).
- ``--mode wakes``: µs/step (wall, training-thread CPU) with ``flush_every_n_steps`` 1, 10
  and 100, hand-overs not rate-limited by time, and the default (10, at most one per
  ``outbox.HANDOVER_EVERY_S``), against the bare loop, interleaved: each flush wakes the
  writer thread, so the difference between 1 and 10 is ~0.9 wakes per step.
- ``--mode build``: the writer thread's µs per record, building (``Resolver.build``) and
  encoding (orjson), from 4,000 resolved steps (minimum over chunks of 500).
- ``--mode cycle``: wall minus training-thread CPU per step by its place in the flush cycle,
  with the writer thread as ``SCHED_BATCH`` and as ``SCHED_OTHER`` (interleaved blocks): where
  a woken writer takes the CPU from the training thread.
- ``--mode handover``: the wall time of each hand-over call (``Outbox.submit``) on the
  training thread: median, p90, p99, mean (once per build, by ``PYTHONPATH``).
- ``--mode floor``: what torch's own hook mechanisms cost with hooks that do nothing (no
  stepscope): training-thread CPU µs/step added over the bare loop by each layer, cumulative
  (module forward pre/post hooks, which put ``Module.__call__`` on its slow path; a wrapper
  on ``torch.autograd.backward``, the backward timing; the optimizer's pre/post hooks; one
  ``pread`` of ``/proc/thread-self/schedstat``), next to
  the tracer with every automatic instrument (JSONL), interleaved blocks in one process:
  the part of the tracer's cost that no bookkeeping cut can remove.
- ``--mode callsite``: forward timed by module hooks against an instance-level ``forward``
  wrapper, and the ``torch.autograd.backward`` wrapper (no-op work, training-thread CPU
  µs/step over bare blocks on the same model, each installed for its block only;
  ``--hidden 640`` for the cold step).
- ``--mode parts``: the tracer's own bookkeeping without torch work or hooks, training-thread
  CPU µs/step, minimum over ``--blocks`` blocks: an empty ``step()`` (the step boundary: open,
  close, run-queue read, resolver poll, resource snapshot, hand-over), the same step with
  three phases opened and closed through the recorder protocol (what the hooks call), and
  four ``gate.current()`` reads (what the hooks ask): how much of the tracer's cost a
  bookkeeping cut can reach at most.
- ``--mode neighbour``: what CPU work on *another* thread costs the training thread's CPU time
  on this host: a helper thread woken every 10 steps burns a fixed slice of CPU (``--burn-us``
  per step on average), once with the GIL released (hashing a buffer) and once holding it (a
  Python loop), beside the tracer (whose writer thread does its work the same way: woken every
  10 steps). Reports µs/step added to the training thread per µs/step burned: on a host whose
  cores are shared (2 vCPUs here), the writer's CPU shows up on the training thread even
  though it runs on the other core.
- ``--mode cold``: where the tracer's cost goes on a step long enough to evict its caches
  (``--hidden``, default 640 here): the step boundary's entry and exit timed directly around
  the ``with`` statement's calls, and the whole step, in blocks with a tracer (a new one per
  block, built and finished outside the timing) in turn with bare blocks on the *same*
  model and optimizer (two copies of a model differ by their memory placement, ~1% of a step
  here). Reports medians in µs: the step's added cost (the tracer's marginal cost), entry,
  exit, the rest (hooks, the backward wrapper, phases) and the same entry plus exit timed warm
  (an empty step in a tight loop): the ratio of cold to warm is what the torch step's eviction
  multiplies. Entry and exit timed in place also refill what the torch step evicted (the
  interpreter's own code and data), which the bare loop pays at its next Python line instead:
  they are upper bounds of the step boundary's share, and ``rest_us`` a lower bound. A third
  kind of block, ``minimal_added_us``, runs a tracer that only appends a tag and a clock
  read at the same hook points (and reads the run queue at the step end): the floor of any
  design that times these phases through these hooks and reads the run queue at every step
  end (stepscope reads the file only after 0.05 ms off the CPU, ``instrument/sched.py``).
- ``--mode sampling``: what leaving the tracer on costs when it records one step in N, on the
  cold step (``--hidden``, default 640): training-thread CPU µs/step added over bare blocks on
  the *same* model, for ``every_n_steps`` 1, 10 and 100 (every automatic instrument, the memory
  sink), and for steps that are never sampled with each instrument alone, none (the step
  boundary only) and all. Kinds shuffled per round, each traced block paired with a bare
  block run next to it (before or after, in turn, with no tracer alive), medians over
  rounds. An unsampled step still runs the hook mechanisms (``Module.__call__``'s slow path)
  and the step boundary: what a sampled run pays on its other steps.
- ``--mode calls``: Python-level calls (``sys.setprofile``'s ``call`` and ``c_call`` events) that
  one step adds over the bare step, for a step that is never sampled and for a recorded one
  (the tiny model unless ``--hidden``; minimum over 9 steps). Deterministic, so it compares
  builds on a loaded host where timings cannot; it does not see C-level costs such as
  ``Module.__call__``'s slow path.
- ``--mode alternate``: what a step that records nothing costs, by alternating steps: one step
  inside a never-sampled tracer's ``step()``, one without, in turn (which goes first alternates),
  ``--steps`` pairs; the median and quartiles of the per-pair training-thread CPU difference
  (µs), on the cold step (``--hidden``, default 640). Slow drift of the host cancels within a
  pair. Valid only for a build whose hooks are off between unsampled steps (on an older build
  the "bare" steps run the hooks too, and only the step boundary is measured).
- ``--mode alternate-tiny``: the same on the tiny model (a ~0.1 ms step), where the step
  boundary is a larger share of the step and the per-pair spread is smaller.
- ``--mode boundary``: the step boundary alone, warm: an empty ``with tracer.step()`` (never
  sampled) against an empty ``with`` statement, ``--steps`` steps per block, blocks in turn
  (``--blocks`` pairs); median, quartiles and the median's ~95% precision (µs per step).
- ``--mode cold-boundary``: the step boundary as a real step leaves it: cold. Per round, in a
  shuffled order, a never-sampled tracer and an empty ``with`` statement each time one step of
  the ~3 ms MLP (``--hidden``, default 640), each after one bare step; the training-thread CPU
  of the entry (``step()`` and ``__enter__``), the step body and the exit is read apart, so
  the boundary's cold cost comes with a precision of ~0.1 µs where ``alternate``'s whole-step
  difference has ±10 µs. Prints, per part (entry, body, exit, and the boundary: entry plus
  exit), the median of tracer minus empty ``with`` (``*_added_us``) and its precision
  (``*_pm_us``), over ``--steps`` rounds. ``--heartbeat``: the tracer writes files and
  runs the heartbeat, as a default ``init()`` does.
- ``--mode cold-recorded``: as ``cold-boundary`` for a step that is recorded (every step
  sampled, every automatic instrument, the memory sink): entry and exit (the step boundary
  with the step's open, close, run-queue read, resource snapshot and hand-over to the
  resolver) to ~1–2 µs over 400 rounds, and the body (the module, backward and optimizer
  hooks and their phases) only to the precision the torch step's spread allows (±60 µs and
  more on a loaded host). The exit includes the run-queue file's read when the thread was
  off the CPU (most rounds on a loaded host) and the rate-limited RSS read in some rounds.
- ``--mode to-steps``: what a loop that moves its batch with two ``Tensor.to`` calls a step
  pays, one step in ``--every-n-steps`` recorded (every automatic instrument, the memory sink),
  on the ~3 ms MLP: per step, the training-thread CPU of the entry, the two ``.to()`` calls and
  the exit (the step body apart). Prints the median of that per place in the recording cycle,
  the median over steps that are neither recorded nor the step before one
  (``unsampled_us``), the two ``.to()`` calls alone there (``to_calls_us``), and the mean over
  a cycle (``cycle_mean_us``: the swaps and the recorded step's boundary included), over
  ``--steps`` steps. ``--control``: an empty ``with`` statement and no tracer, the same calls.
  Compare builds in alternated processes: within one, the patch is process-wide.
- ``--mode ddp-calls``: as ``calls`` for a step of 2 gloo ranks under DDP (rank 0, a small MLP
  with small buckets), recorded and never sampled, plus the calls inside the two hooks DDP
  adds on recorded steps: the untimed-groups look (which counts the C++-issued bucket
  all-reduces) and the grad_sync marker.
- ``--mode alloc``: tracemalloc's count of memory blocks still alive per step (records the
  writer and the recent-records buffer keep included), by allocation site.

    python benchmarks/hot_path.py --steps 100000 --mode cprofile
    python benchmarks/hot_path.py --mode alloc
    python benchmarks/hot_path.py --mode cold --steps 40 --blocks 30   # the ~3 ms step, per part
    python benchmarks/hot_path.py --mode wakes       # what waking the writer costs the training thread
    py-spy record --native -r 1000 -o hot.svg -- python benchmarks/hot_path.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from stepscope.recording.clock import CpuClock
from stepscope.recording.config import Config
from stepscope.tracer import Tracer

#: ``--hidden``: 0 = the tiny model (``Linear(8, 8)``, batch 2); N = a three-layer MLP of width
#: N on a batch of 64 (``overhead.py``'s job: ~4 ms a step at 640 on one thread here).
HIDDEN = 0


def _job() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    if HIDDEN:
        from overhead import make_job  # benchmarks/ is on sys.path when this file runs

        mlp, mlp_opt, data = make_job(HIDDEN, 64)
        return mlp, mlp_opt, data[0]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    y = x.to(torch.float32)
    out = model(y)
    (out.square().mean() if HIDDEN else out.sum()).backward()
    opt.step()
    opt.zero_grad()


def _run(tracer: Tracer | None, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
         steps: int) -> None:
    """``steps`` steps, each inside ``tracer.step()`` (bare when ``tracer`` is None)."""
    for _ in range(steps):
        if tracer is None:
            _step(model, opt, x)
        else:
            with tracer.step():
                _step(model, opt, x)


def _cpu_us(tracer: Tracer | None, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
            steps: int) -> float:
    """Training-thread CPU µs per step of :func:`_run` over ``steps`` steps."""
    t0 = time.thread_time_ns()
    _run(tracer, model, opt, x, steps)
    return (time.thread_time_ns() - t0) / steps / 1e3


def _paired(kinds: list[str], rounds: int, bare: Callable[[], float],
            traced: Callable[[str], float]) -> tuple[list[float], dict[str, list[float]]]:
    """Per round, each kind in a shuffled order: ``traced(kind)`` (which sets the kind up, times
    a block and takes it down again) paired with a ``bare()`` block run right before or after
    it, in turn. The host's speed drifts by more than the costs measured here over the
    seconds a round takes. Returns the bare blocks and, per kind, traced minus bare."""
    added: dict[str, list[float]] = {k: [] for k in kinds}
    bares: list[float] = []
    order = list(kinds)
    for r in range(rounds):
        random.shuffle(order)
        for kind in order:
            b = bare() if r % 2 else 0.0
            t = traced(kind)
            if not r % 2:
                b = bare()
            bares.append(b)
            added[kind].append(t - b)
    return bares, added


#: ``--every-n-steps``: record one step in N (the others are unsampled: what they cost).
EVERY_N_STEPS = 1


def _tracer(out: str, model: torch.nn.Module, opt: torch.optim.Optimizer, heartbeat: bool) -> Tracer:
    cfg = Config(out_dir=out, heartbeat_s=5.0 if heartbeat else 0.0, max_pending_steps=1 << 20,
                 every_n_steps=EVERY_N_STEPS)
    return Tracer(cfg, model=model, optimizer=opt, clock=CpuClock())


def _writer_cpu_ns() -> int:
    """CPU time of the live stepscope writer thread so far (ns; 0 when there is none)."""
    for t in threading.enumerate():
        if t.name == "stepscope-writer" and t.ident is not None:
            return time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
    return 0


def time_mode(steps: int, blocks: int, heartbeat: bool) -> dict[str, float]:
    # Two copies of the job: the tracer hooks one (module and optimizer hooks stay on it for
    # the whole run); the bare blocks run the other, which carries none. Bare blocks also put
    # torch.autograd.backward back; the one patch left over them is Tensor.to's (a dtype-only
    # cast takes its first branch).
    model, opt, x = _job()
    bmodel, bopt, bx = _job()
    for _ in range(200):
        _step(model, opt, x)
        _step(bmodel, bopt, bx)
    bare_w, bare_c, inst_w, inst_c, writer_c = [], [], [], [], []
    import torch.autograd as autograd

    real_backward = autograd.backward
    with tempfile.TemporaryDirectory() as out:
        tracer = _tracer(out, model, opt, heartbeat)
        for b in range(blocks):
            for on in ((True, False) if b % 2 else (False, True)):
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                wr0 = _writer_cpu_ns() if on else 0
                if on:
                    for _ in range(steps):
                        with tracer.step():
                            _step(model, opt, x)
                    tracer.flush()
                else:
                    # Bare: without the tracer's torch.autograd.backward wrapper too.
                    tracers, autograd.backward = autograd.backward, real_backward
                    for _ in range(steps):
                        _step(bmodel, bopt, bx)
                    autograd.backward = tracers
                dw = (time.perf_counter_ns() - w0) / steps / 1e3
                dc = (time.thread_time_ns() - c0) / steps / 1e3
                if on:
                    time.sleep(0.05)  # let the writer finish this block's records
                    inst_w.append(dw)
                    inst_c.append(dc)
                    writer_c.append((_writer_cpu_ns() - wr0) / steps / 1e3)
                else:
                    bare_w.append(dw)
                    bare_c.append(dc)
        tracer.finish()
    med = statistics.median
    return {
        "bare_step_us": round(med(bare_w), 2),
        "added_wall_us": round(med(inst_w) - med(bare_w), 2),
        "added_thread_cpu_us": round(med(inst_c) - med(bare_c), 2),
        "added_thread_cpu_us_min": round(min(inst_c) - min(bare_c), 2),
        "ratio_wall": round(med(inst_w) / med(bare_w), 4),
        "ratio_thread_cpu": round(med(inst_c) / med(bare_c), 4),
        "writer_cpu_us_per_step": round(med(writer_c), 2),
    }


class _MinimalTracer:
    """The floor of a hook-based tracer, for ``--mode cold``: the same hook points as
    stepscope's (module forward pre/post, a ``torch.autograd.backward`` wrapper, optimizer
    pre/post) and the run-queue ``pread`` at the step end, each appending a tag and a
    ``perf_counter_ns`` to one list. No phase stack, no thread check, no record: what any
    design that times these phases through these hooks pays at least."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        import torch.autograd as autograd

        log: list[Any] = []
        self.log = log
        self.on = False
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        pc = time.perf_counter_ns
        real = self.real = autograd.backward
        me = self

        def mark(tag: int) -> Any:
            def hook(*args: Any) -> None:
                if me.on:
                    log.append((tag, pc()))
            return hook

        def backward(*args: Any, **kwargs: Any) -> Any:
            if not me.on:
                return real(*args, **kwargs)
            log.append((3, pc()))
            try:
                return real(*args, **kwargs)
            finally:
                log.append((4, pc()))

        self.handles = [model.register_forward_pre_hook(mark(1), prepend=True),
                        model.register_forward_hook(mark(2)),
                        opt.register_step_pre_hook(mark(5)), opt.register_step_post_hook(mark(6))]
        autograd.backward = backward  # type: ignore[assignment]

    def __enter__(self) -> None:
        self.on = True
        self.log.append((0, time.perf_counter_ns()))

    def __exit__(self, *exc: Any) -> None:
        self.on = False
        t = time.perf_counter_ns()
        self.log.append((7, t, int(os.pread(self.fd, 64, 0).split()[1])))
        if len(self.log) > 100_000:
            self.log.clear()

    def remove(self) -> None:
        import torch.autograd as autograd

        for h in self.handles:
            h.remove()
        autograd.backward = self.real  # type: ignore[assignment]
        os.close(self.fd)


def cold_mode(steps: int, blocks: int) -> dict[str, Any]:
    from stepscope.recording.sinks import MemorySink

    model, opt, x = _job()
    for _ in range(30):
        _step(model, opt, x)
    pc = time.perf_counter_ns
    bare: list[float] = []
    floor: list[float] = []
    whole: list[float] = []
    enter: list[float] = []
    leave: list[float] = []
    warm: list[float] = []
    med = statistics.median
    kinds = ["bare", "minimal", "stepscope"]
    for b in range(blocks):
        for kind in kinds[b % 3:] + kinds[:b % 3]:  # each kind first, second, third in turn
            if kind == "bare":
                for _ in range(3):
                    _step(model, opt, x)
                got = []
                for _ in range(steps):
                    t0 = pc()
                    _step(model, opt, x)
                    got.append(pc() - t0)
                bare.append(med(got))
                continue
            if kind == "minimal":
                mt = _MinimalTracer(model, opt)
                for _ in range(3):
                    with mt:
                        _step(model, opt, x)
                got = []
                for _ in range(steps):
                    t0 = pc()
                    with mt:
                        _step(model, opt, x)
                    got.append(pc() - t0)
                mt.remove()
                floor.append(med(got))
                continue
            tracer = Tracer(Config(out_dir="unused", max_pending_steps=1 << 20), model=model,
                            optimizer=opt, clock=CpuClock(), sink=MemorySink())
            for _ in range(3):
                with tracer.step():
                    _step(model, opt, x)
            w, e, lv = [], [], []
            for _ in range(steps):
                cm = tracer.step()
                t0 = pc()
                cm.__enter__()
                t1 = pc()
                _step(model, opt, x)
                t2 = pc()
                cm.__exit__(None, None, None)
                t3 = pc()
                w.append(t3 - t0)
                e.append(t1 - t0)
                lv.append(t3 - t2)
            ws = []
            for _ in range(500):
                t0 = pc()
                with tracer.step():
                    pass
                ws.append(pc() - t0)
            tracer.finish()
            whole.append(med(w))
            enter.append(med(e))
            leave.append(med(lv))
            warm.append(med(ws))
    # Paired by block (the three kinds of one block ran within ~0.5 s of each other): the
    # machine's drift between blocks cancels.
    added = med(w - b for w, b in zip(whole, bare, strict=True))
    return {
        "bare_step_us": round(med(bare) / 1e3, 1),
        "added_us": round(added / 1e3, 1),
        "minimal_added_us": round(med(f - b for f, b in zip(floor, bare, strict=True)) / 1e3, 1),
        "enter_us": round(med(enter) / 1e3, 2),
        "exit_us": round(med(leave) / 1e3, 2),
        "rest_us": round((added - med(enter) - med(leave)) / 1e3, 1),
        "warm_enter_exit_us": round(med(warm) / 1e3, 2),
    }


def sampling_mode(steps: int, blocks: int) -> dict[str, Any]:
    from stepscope.recording.sinks import MemorySink

    never = 1 << 40  # every_n_steps of a run whose steps (after the first) are never sampled
    kinds: dict[str, tuple[int, frozenset[str] | None]] = {
        "every_1": (1, None), "every_10": (10, None), "every_100": (100, None),
        "unsampled_none": (never, frozenset()), "unsampled_all": (never, None),
        **{f"unsampled_{p}": (never, frozenset({p})) for p in ("forward", "backward", "optimizer", "h2d")},
    }
    model, opt, x = _job()
    for _ in range(30):
        _step(model, opt, x)

    def traced(kind: str) -> float:
        every, auto = kinds[kind]
        extra = {} if auto is None else {"auto": auto}
        cfg = Config(out_dir="unused", every_n_steps=every, max_pending_steps=1 << 20, **extra)
        tracer = Tracer(cfg, model=model, optimizer=opt, clock=CpuClock(), sink=MemorySink())
        _run(tracer, model, opt, x, 5)  # step 0 is sampled in every kind: out of the timing
        got = _cpu_us(tracer, model, opt, x, steps)
        tracer.finish()  # the bare blocks run with no tracer alive (no hooks on the model)
        return got

    bare, added = _paired(list(kinds), blocks, lambda: _cpu_us(None, model, opt, x, steps), traced)
    med = statistics.median
    return {"bare_step_us": round(med(bare), 1),
            **{f"{k}_added_us": round(med(v), 1) for k, v in added.items()}}


def calls_mode() -> dict[str, int]:
    import sys

    from stepscope.recording.sinks import MemorySink

    model, opt, x = _job()
    for _ in range(3):
        _step(model, opt, x)

    def count(fn: Callable[[], None]) -> int:
        n = [0]

        def prof(frame: Any, event: str, arg: Any) -> None:
            if event in ("call", "c_call"):
                n[0] += 1

        sys.setprofile(prof)
        fn()
        sys.setprofile(None)
        return n[0] - 1  # setprofile(None) itself

    bare = min(count(functools.partial(_run, None, model, opt, x, 1)) for _ in range(9))
    out = {"bare_calls": bare}
    for every, name in ((1 << 40, "unsampled"), (1, "recorded")):
        cfg = Config(out_dir="unused", every_n_steps=every, max_pending_steps=1 << 20)
        tracer = Tracer(cfg, model=model, optimizer=opt, clock=CpuClock(), sink=MemorySink())
        _run(tracer, model, opt, x, 3)
        one = functools.partial(_run, tracer, model, opt, x, 1)
        out[f"{name}_added_calls"] = min(count(one) for _ in range(9)) - bare
        tracer.finish()
    return out


class _Control:
    """``--control``: stands where the tracer would, its ``step()`` an empty ``with``."""

    def step(self) -> _NoOp:
        return _NOOP

    def finish(self) -> None:
        return None


def alternate_mode(pairs: int, control: bool = False) -> dict[str, Any]:
    from stepscope.recording.sinks import MemorySink

    model, opt, x = _job()
    for _ in range(20):
        _step(model, opt, x)
    cfg = Config(out_dir="unused", every_n_steps=1 << 40, max_pending_steps=1 << 20)
    tracer: Any = (_Control() if control else
                   Tracer(cfg, model=model, optimizer=opt, clock=CpuClock(), sink=MemorySink()))
    _run(tracer, model, opt, x, 5)  # step 0 is sampled: out of the timing
    clock = time.thread_time_ns
    diffs = []
    for i in range(pairs):
        for traced in ((False, True) if i % 2 else (True, False)):
            t0 = clock()
            _run(tracer if traced else None, model, opt, x, 1)
            if traced:
                a = clock() - t0
            else:
                b = clock() - t0
        diffs.append((a - b) / 1e3)
    tracer.finish()
    return _spread("unsampled_added_us", diffs)


def _spread(name: str, diffs: list[float]) -> dict[str, Any]:
    """Median and quartiles of ``diffs`` (µs), and the precision of the median: the
    half-width of its ~95% interval, 1.57 × IQR / √n (McGill's notch)."""
    q = statistics.quantiles(diffs, n=4)
    return {name: round(q[1], 2), "quartiles_us": [round(q[0], 2), round(q[2], 2)],
            "median_pm_us": round(1.57 * (q[2] - q[0]) / len(diffs) ** 0.5, 2), "n": len(diffs)}


def boundary_mode(blocks: int, steps: int) -> dict[str, Any]:
    """An empty step: ``steps`` steps inside a never-sampled tracer's ``step()`` against as
    many bare loop turns, block by block in turn (which goes first alternates); the
    training-thread CPU µs per step of traced minus bare, per pair of blocks. Nothing but
    the step boundary runs, so this is its warm cost alone."""
    from stepscope.recording.sinks import MemorySink

    cfg = Config(out_dir="unused", every_n_steps=1 << 40, max_pending_steps=1 << 20)
    tracer = Tracer(cfg, clock=CpuClock(), sink=MemorySink())
    with tracer.step():  # step 0 is sampled: out of the timing
        pass
    clock = time.thread_time_ns
    step = tracer.step
    rng = range(steps)

    def traced() -> int:
        t0 = clock()
        for _ in rng:
            with step():
                pass
        return clock() - t0

    def bare() -> int:
        t0 = clock()
        for _ in rng:
            with _NOOP:
                pass
        return clock() - t0

    diffs = []
    for i in range(blocks):
        if i % 2:
            b, a = bare(), traced()
        else:
            a, b = traced(), bare()
        diffs.append((a - b) / steps / 1e3)
    tracer.finish()
    return _spread("unsampled_boundary_us", diffs)


def cold_boundary_mode(rounds: int, every: int = 1 << 40, heartbeat: bool = False) -> dict[str, Any]:
    """``--mode cold-boundary`` (``every``: never after step 0), and ``--mode cold-recorded``
    (``every`` 1: every step recorded, its hooks and phases in the body)."""
    from stepscope.recording.sinks import MemorySink

    model, opt, x = _job()
    for _ in range(20):
        _step(model, opt, x)
    tmp = tempfile.TemporaryDirectory() if heartbeat else None
    cfg = Config(out_dir="unused" if tmp is None else tmp.name, every_n_steps=every,
                 max_pending_steps=1 << 20, heartbeat_s=5.0)  # a memory sink has no heartbeat
    # --heartbeat: files and the heartbeat, as a default init() has them.
    tracer = Tracer(cfg, model=model, optimizer=opt, clock=CpuClock(),
                    sink=None if heartbeat else MemorySink())
    _run(tracer, model, opt, x, 5)  # step 0 is sampled: out of the timing
    arms: dict[str, Any] = {"tracer": tracer, "control": _Control()}
    clock = time.thread_time_ns

    def parts(owner: Any) -> tuple[int, int, int]:
        _step(model, opt, x)  # a bare step first: the caches as a training step leaves them
        t0 = clock()
        cm = owner.step()
        cm.__enter__()
        t1 = clock()
        _step(model, opt, x)
        t2 = clock()
        cm.__exit__(None, None, None)
        t3 = clock()
        return t1 - t0, t2 - t1, t3 - t2

    got: dict[str, list[tuple[int, int, int]]] = {k: [] for k in arms}
    order = list(arms)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            got[name].append(parts(arms[name]))
    tracer.finish()
    if tmp is not None:
        tmp.cleanup()
    out: dict[str, Any] = {}
    pairs = list(zip(got["tracer"], got["control"], strict=True))
    for part, diffs in (("entry", [a[0] - b[0] for a, b in pairs]), ("body", [a[1] - b[1] for a, b in pairs]),
                        ("exit", [a[2] - b[2] for a, b in pairs]),
                        ("boundary", [a[0] + a[2] - b[0] - b[2] for a, b in pairs])):
        spread = _spread("added_us", [d / 1e3 for d in diffs])
        out[f"{part}_added_us"] = spread["added_us"]
        out[f"{part}_pm_us"] = spread["median_pm_us"]
    out["n"] = len(pairs)
    return out


def to_steps_mode(steps: int, every: int, control: bool) -> dict[str, Any]:
    """``--mode to-steps``: per step, entry + two ``.to()`` calls + exit, training-thread CPU µs."""
    from stepscope.recording.sinks import MemorySink

    model, opt, x = _job()
    batch = (torch.randn(64, HIDDEN), torch.randint(0, 10, (64,)))
    for _ in range(20):
        _step(model, opt, x)
    cfg = Config(out_dir="unused", every_n_steps=every, max_pending_steps=1 << 20)
    owner: Any = _Control() if control else Tracer(cfg, model=model, optimizer=opt, clock=CpuClock(),
                                                   sink=MemorySink())
    clock = time.thread_time_ns
    got: list[tuple[int, int]] = []
    for _ in range(steps):
        t0 = clock()
        cm = owner.step()
        cm.__enter__()
        t1 = clock()
        batch[0].to("cpu", non_blocking=True)  # the batch's move, as a loop on a device does
        batch[1].to("cpu", non_blocking=True)
        t2 = clock()
        _step(model, opt, x)
        t3 = clock()
        cm.__exit__(None, None, None)
        t4 = clock()
        got.append((t1 - t0 + t2 - t1 + t4 - t3, t2 - t1))
    owner.finish()
    got = got[every:]  # the first cycle (the tracer's start) out
    got = got[: len(got) // every * every]
    by_place = [statistics.median(g[0] for g in got[i::every]) / 1e3 for i in range(every)]
    # Neither recorded (place 0) nor the step before one (place every - 1): the plain steps.
    plain = [g for i, g in enumerate(got) if every > 2 and 0 < i % every < every - 1]
    cycles = [sum(g[0] for g in got[i:i + every]) / every / 1e3 for i in range(0, len(got), every)]
    out: dict[str, Any] = {"by_place_us": [round(v, 2) for v in by_place]}
    if plain:
        out["unsampled_us"] = _spread("us", [g[0] / 1e3 for g in plain])
        out["to_calls_us"] = _spread("us", [g[1] / 1e3 for g in plain])
    out["cycle_mean_us"] = _spread("us", cycles)
    return out


class _NoOp:
    """The bare side of ``boundary`` mode: a ``with`` statement that does nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NOOP = _NoOp()


#: ``--mode ddp-calls``: the hooks whose call subtrees are counted apart (file:function), and
#: the name of each in the output.
DDP_HOOKS = {"untimed.py:on_step_end": "untimed_look", "hooks.py:_on_last_grad": "grad_sync_hook"}


def _ddp_counts(fn: Callable[[], None]) -> tuple[int, dict[str, int]]:
    """Python calls (``call`` and ``c_call``) that ``fn()`` makes, and those made inside each
    of :data:`DDP_HOOKS` (the hook's own frame included)."""
    import sys

    total = [0]
    sub = dict.fromkeys(DDP_HOOKS, 0)
    root: list[Any] = [None, 0]  # the hook being counted, its call depth

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            total[0] += 1
            if root[0] is None and event == "call":
                name = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
                if name in sub:
                    root[0], root[1] = name, 0
            if root[0] is not None:
                sub[root[0]] += 1
                if event == "call":
                    root[1] += 1
        elif event == "return" and root[0] is not None:
            root[1] -= 1
            if root[1] == 0:
                root[0] = None

    sys.setprofile(prof)
    fn()
    sys.setprofile(None)
    return total[0] - 1, sub  # setprofile(None) itself


def _ddp_rank(rank: int, port: int, every: int, out: str) -> None:
    import torch.distributed as dist

    from stepscope.recording.sinks import MemorySink

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 64)
    for _ in range(3):
        _step(model, opt, x)
    bare = min(_ddp_counts(functools.partial(_run, None, model, opt, x, 1))[0] for _ in range(5))
    cfg = Config(out_dir="unused", every_n_steps=every, max_pending_steps=1 << 20)
    tracer = Tracer(cfg, model=model, optimizer=opt, clock=CpuClock(), sink=MemorySink())
    _run(tracer, model, opt, x, 4)
    got = [_ddp_counts(functools.partial(_run, tracer, model, opt, x, 1)) for _ in range(5)]
    tracer.finish()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"added_calls": min(n for n, _ in got) - bare,
                       **{f"{v}_calls": min(s[k] for _, s in got) for k, v in DDP_HOOKS.items()}}, f)
    dist.destroy_process_group()


def ddp_calls_mode() -> dict[str, Any]:
    """``--mode ddp-calls``: 2 gloo ranks, DDP over a 3-layer MLP of width 64 (small buckets):
    calls a recorded and a never-sampled step add over the bare DDP step on rank 0 (minimum
    over 5 steps), and those inside the untimed-groups look and the grad_sync hook."""
    import torch.multiprocessing as mp

    from stepscope.recording.dist import free_port

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for every, name in ((1, "recorded"), (1 << 40, "unsampled")):
            path = os.path.join(tmp, f"{name}.json")
            mp.spawn(_ddp_rank, args=(free_port(), every, path), nprocs=2)  # type: ignore[attr-defined]
            with open(path) as f:
                out.update({f"{name}_{k}": v for k, v in json.load(f).items()})
    return out


def cprofile_mode(steps: int, heartbeat: bool) -> None:
    import cProfile
    import pstats

    model, opt, x = _job()
    with tempfile.TemporaryDirectory() as out:
        tracer = _tracer(out, model, opt, heartbeat)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            with tracer.step():
                _step(model, opt, x)
        prof.disable()
        tracer.finish()
    stats = pstats.Stats(prof)
    # Deterministic (load-independent): Python calls into stepscope per step on this thread.
    ours = sum(v[1] for k, v in stats.stats.items() if "stepscope" in k[0])  # type: ignore[attr-defined]
    every = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(json.dumps({"steps": steps, "stepscope_calls_per_step": round(ours / steps, 2),
                      "all_calls_per_step": round(every / steps, 2)}))
    stats.sort_stats("tottime").print_stats(30)


def wakes_mode(steps: int, blocks: int) -> dict[str, Any]:
    model, opt, x = _job()
    for _ in range(200):
        _step(model, opt, x)
    from stepscope.recording import outbox

    default_every_s = outbox.HANDOVER_EVERY_S
    # "1", "10", "100": a hand-over every N steps, not rate-limited by time (what a wake costs);
    # "10_limited": the default, every 10 steps and at most once per HANDOVER_EVERY_S.
    got: dict[str, list[tuple[float, float]]] = {
        k: [] for k in ("bare", "1", "10", "100", "10_limited")}
    with tempfile.TemporaryDirectory() as out:
        for b in range(blocks):
            for k in (list(got) if b % 2 else list(got)[::-1]):
                tracer = None
                if k != "bare":
                    cfg = Config(out_dir=f"{out}/{k}", heartbeat_s=0.0,
                                 flush_every_n_steps=int(k.split("_")[0]), max_pending_steps=1 << 20)
                    outbox.HANDOVER_EVERY_S = default_every_s if k.endswith("_limited") else 0.0
                    tracer = Tracer(cfg, model=model, optimizer=opt, clock=CpuClock())
                    outbox.HANDOVER_EVERY_S = default_every_s
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                _run(tracer, model, opt, x, steps)
                got[k].append(((time.perf_counter_ns() - w0) / steps / 1e3,
                               (time.thread_time_ns() - c0) / steps / 1e3))
                if tracer is not None:
                    tracer.finish()
    med = statistics.median
    return {f"flush_{k}" if k != "bare" else "bare": {"wall_us": round(med(a for a, _ in v), 1),
                                                      "thread_cpu_us": round(med(c for _, c in v), 1)}
            for k, v in got.items()}


def cycle_mode(steps: int, blocks: int) -> dict[str, Any]:
    """Where the wall time beyond thread CPU goes in the flush cycle: per step, wall minus the
    training thread's CPU time, by the step's place in the cycle (the hand-over, which wakes
    the writer, is at the exit of place 9 with the default ``flush_every_n_steps=10``), with
    the writer thread as ``SCHED_BATCH`` (a woken writer waits for a free CPU) and as
    ``SCHED_OTHER`` (the default: a woken writer preempts the training thread), interleaved
    blocks on one tracer."""
    model, opt, x = _job()
    for _ in range(200):
        _step(model, opt, x)
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    got: dict[str, list[list[float]]] = {"batch": [[] for _ in range(10)], "other": [[] for _ in range(10)]}
    with tempfile.TemporaryDirectory() as out:
        tracer = _tracer(out, model, opt, False)
        writer = next(t for t in threading.enumerate() if t.name == "stepscope-writer")
        assert writer.native_id is not None
        for b in range(blocks):
            for mode in (("batch", "other") if b % 2 else ("other", "batch")):
                policy = os.SCHED_BATCH if mode == "batch" else os.SCHED_OTHER
                os.sched_setscheduler(writer.native_id, policy, os.sched_param(0))
                tracer.flush()
                time.sleep(0.05)
                base = tracer.step_index
                for _ in range(steps):
                    place = (tracer.step_index - base) % 10
                    w0, c0 = pc(), tt()
                    with tracer.step():
                        _step(model, opt, x)
                    got[mode][place].append((pc() - w0 - (tt() - c0)) / 1e3)
        tracer.finish()
    out_: dict[str, Any] = {}
    for mode, places in got.items():
        out_[mode] = {
            "mean_wall_minus_cpu_us_by_place": [round(statistics.fmean(v), 1) for v in places],
            "p90_wall_minus_cpu_us_by_place": [round(sorted(v)[int(len(v) * 0.9)], 1) for v in places],
        }
    return out_


def handover_mode(steps: int, blocks: int) -> dict[str, Any]:
    """What the hand-over itself costs the training thread: the wall time of each call that
    queues a batch for the writer (``Outbox.submit``, once per ``flush_every_n_steps`` steps),
    over ``blocks`` x ``steps`` steps of the tiny model. Run it once per build (``PYTHONPATH``)
    to compare: the call is the same in both."""
    model, opt, x = _job()
    for _ in range(200):
        _step(model, opt, x)
    took: list[float] = []
    pc = time.perf_counter_ns
    with tempfile.TemporaryDirectory() as out:
        tracer = _tracer(out, model, opt, False)
        outbox = tracer._outbox
        real = outbox.submit

        def timed() -> bool:
            t0 = pc()
            done = real()
            took.append((pc() - t0) / 1e3)
            return done

        outbox.submit = timed  # type: ignore[method-assign]
        for _ in range(blocks):
            for _ in range(steps):
                with tracer.step():
                    _step(model, opt, x)
            time.sleep(0.05)
        outbox.submit = real  # type: ignore[method-assign]
        tracer.finish()
    took.sort()
    n = len(took)
    return {"handovers": n, "median_us": round(took[n // 2], 1), "p90_us": round(took[int(n * 0.9)], 1),
            "p99_us": round(took[int(n * 0.99)], 1), "mean_us": round(statistics.fmean(took), 1)}


def build_mode(chunks: int = 8, size: int = 500) -> dict[str, float]:
    """Writer-thread µs per record: ``Resolver.build`` and orjson encoding (min over chunks)."""
    import gc

    from stepscope.recording import sinks
    from stepscope.recording.sinks import encode_record

    model, opt, x = _job()
    sinks.IDLE_TICK_S = None  # type: ignore[assignment]  # the writer must not take these steps itself
    with tempfile.TemporaryDirectory() as out:
        cfg = Config(out_dir=out, heartbeat_s=0.0, flush_every_n_steps=1 << 30, max_pending_steps=1 << 20)
        tracer = Tracer(cfg, model=model, optimizer=opt, clock=CpuClock())
        for _ in range(chunks * size):
            with tracer.step():
                _step(model, opt, x)
        tracer.resolver.poll(1 << 30)
        steps = tracer.resolver.take_ready()
        build, enc = [], []
        for k in range(chunks):
            chunk = steps[k * size:(k + 1) * size]
            gc.disable()
            c0 = time.thread_time_ns()
            records = tracer.resolver.build(chunk)
            c1 = time.thread_time_ns()
            for r in records:
                encode_record(r)
            c2 = time.thread_time_ns()
            gc.enable()
            build.append((c1 - c0) / size / 1e3)
            enc.append((c2 - c1) / size / 1e3)
        tracer.finish()
    return {"build_us_per_record": round(min(build), 2), "encode_us_per_record": round(min(enc), 2)}


def _noop(*_: Any) -> None:
    return None


def _noop_wrapper(real: Any) -> Any:
    """``real`` behind a wrapper that makes a no-op call before and after it (what a call-site
    timer costs before it records anything)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _noop()
        try:
            return real(*args, **kwargs)
        finally:
            _noop()

    return wrapped


def floor_mode(steps: int, blocks: int) -> dict[str, Any]:
    """Training-thread CPU µs/step each no-op hook layer adds (cumulative), and the tracer."""

    noop = _noop
    import torch.autograd as autograd

    real_backward = autograd.backward
    wrapped_backward = _noop_wrapper(real_backward)

    def job(layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, Any]:
        model, opt, x = _job()
        end: Any = None
        if layers >= 1:
            model.register_forward_pre_hook(noop, prepend=True)
            model.register_forward_hook(noop)
        if layers >= 3:
            opt.register_step_pre_hook(noop)
            opt.register_step_post_hook(noop)
        if layers >= 4 and os.path.exists("/proc/thread-self/schedstat"):
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

            def end() -> None:
                int(os.pread(fd, 64, 0).split()[1])
        return model, opt, x, end

    names = ("forward_hooks", "+backward_wrapper", "+optimizer_hooks", "+runq_read")
    jobs = {"bare": job(0), **{n: job(i + 1) for i, n in enumerate(names)}}
    got: dict[str, list[float]] = {k: [] for k in (*jobs, "tracer_all")}
    with tempfile.TemporaryDirectory() as out:
        tmodel, topt, tx = _job()
        tracer = _tracer(out, tmodel, topt, False)
        for b in range(blocks):
            order = list(got) if b % 2 else list(got)[::-1]
            for k in order:
                c0 = time.thread_time_ns()
                if k == "tracer_all":
                    for _ in range(steps):
                        with tracer.step():
                            _step(tmodel, topt, tx)
                else:
                    model, opt, x, end = jobs[k]
                    # The no-op wrapper from layer 2 on; the tracer's own wrapper is out of the
                    # way for these blocks and back for the tracer's.
                    tracers = autograd.backward
                    autograd.backward = (real_backward if k in ("bare", "forward_hooks")
                                         else wrapped_backward)
                    try:
                        for _ in range(steps):
                            _step(model, opt, x)
                            if end is not None:
                                end()
                    finally:
                        autograd.backward = tracers
                got[k].append((time.thread_time_ns() - c0) / steps / 1e3)
        tracer.finish()
    bare = min(got["bare"])
    return {"bare_step_thread_cpu_us": round(bare, 1),
            **{f"{k}_added_us": round(min(v) - bare, 1) for k, v in got.items() if k != "bare"}}


def neighbour_mode(steps: int, blocks: int, burn_us: float) -> dict[str, Any]:
    """Training-thread CPU µs/step added by CPU work on another thread (see the module doc)."""
    import hashlib

    buf = b"\0" * (1 << 16)  # hashlib releases the GIL for buffers over 2 KiB
    slice_ns = int(burn_us * 10 * 1e3)  # one wake per 10 steps, like the writer's hand-over

    def gil_free() -> None:
        t0 = time.thread_time_ns()
        while time.thread_time_ns() - t0 < slice_ns:
            hashlib.sha256(buf)

    def gil_holding() -> None:
        t0 = time.thread_time_ns()
        while time.thread_time_ns() - t0 < slice_ns:
            pass

    bell = threading.Semaphore(0)
    work: list[Any] = [None]

    def helper() -> None:
        while True:
            bell.acquire()
            fn = work[0]
            if fn is None:
                return
            fn()

    th = threading.Thread(target=helper, name="neighbour", daemon=True)
    th.start()
    model, opt, x = _job()
    for _ in range(200):
        _step(model, opt, x)
    got: dict[str, list[float]] = {k: [] for k in ("bare", "gil_free", "gil_holding", "tracer_all")}
    writer: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        tmodel, topt, tx = _job()
        tracer = _tracer(out, tmodel, topt, False)
        for b in range(blocks):
            for k in (list(got) if b % 2 else list(got)[::-1]):
                c0 = time.thread_time_ns()
                if k == "tracer_all":
                    wr0 = _writer_cpu_ns()
                    for _ in range(steps):
                        with tracer.step():
                            _step(tmodel, topt, tx)
                    tracer.flush()
                else:
                    work[0] = {"bare": None, "gil_free": gil_free, "gil_holding": gil_holding}[k]
                    for i in range(steps):
                        _step(model, opt, x)
                        if work[0] is not None and i % 10 == 9:
                            bell.release()
                got[k].append((time.thread_time_ns() - c0) / steps / 1e3)
                time.sleep(0.05)  # the helper (or the writer) finishes this block's work
                if k == "tracer_all":
                    writer.append((_writer_cpu_ns() - wr0) / steps / 1e3)
        tracer.finish()
    work[0] = None
    bell.release()
    med = statistics.median
    bare = med(got["bare"])
    added = {k: med(v) - bare for k, v in got.items() if k != "bare"}
    return {"bare_step_thread_cpu_us": round(bare, 1), "burn_us_per_step": burn_us,
            **{f"{k}_added_us": round(v, 1) for k, v in added.items()},
            "gil_free_us_per_burned_us": round(added["gil_free"] / burn_us, 2),
            "gil_holding_us_per_burned_us": round(added["gil_holding"] / burn_us, 2),
            "tracer_writer_cpu_us_per_step": round(med(writer), 1)}


def callsite_mode(steps: int, blocks: int) -> dict[str, Any]:
    """Training-thread CPU µs/step of two ways to time forward, and of the backward call-site
    wrapper, with hooks that do nothing (no stepscope), on one model:

    - forward: (a) module forward pre/post hooks (``Module.__call__``'s slow path, what
      stepscope uses), against (b) an instance-level ``forward`` attribute that wraps the
      class's ``forward``;
    - backward: a wrapper installed on ``torch.autograd.backward`` (which ``Tensor.backward``
      calls through the module attribute) that does its work before and after the call.

    Each kind is installed on the model for its block and removed after it; each block is
    paired with a bare block run next to it (before or after, in turn), kinds shuffled per
    round, medians over rounds: all kinds run on one model, since two copies of a model differ
    by their memory placement (~1% of an MLP step). A gradient hook on the output with queued
    end-of-backward callbacks is not timed: on one MLP model it moved the bare blocks after it
    by hundreds of µs either way.
    """
    import torch.autograd as autograd

    real_backward = autograd.backward
    wrapped_backward = _noop_wrapper(real_backward)
    noop = _noop
    model, opt, x = _job()

    def install(fwd: str, bwd: str) -> Callable[[], None]:
        handles = []
        if fwd == "hooks":
            handles.append(model.register_forward_pre_hook(noop, prepend=True))
            handles.append(model.register_forward_hook(noop))
        elif fwd == "instance":
            model.forward = _noop_wrapper(type(model).forward.__get__(model))  # type: ignore[method-assign]
        if bwd == "callsite":
            autograd.backward = wrapped_backward

        def remove() -> None:
            for h in handles:
                h.remove()
            if fwd == "instance":
                del model.forward
            autograd.backward = real_backward

        return remove

    def block() -> float:
        return _cpu_us(None, model, opt, x, steps)

    def traced(kind: str) -> float:
        remove = install(*kinds[kind])
        try:
            return block()
        finally:
            remove()

    kinds = {"fwd_hooks": ("hooks", "none"), "fwd_instance": ("instance", "none"),
             "bwd_callsite": ("none", "callsite"), "hooks_callsite": ("hooks", "callsite"),
             "instance_callsite": ("instance", "callsite")}
    for _ in range(30):
        _step(model, opt, x)
    bare, got = _paired(list(kinds), blocks, block, traced)
    med = statistics.median
    added = {k: med(v) for k, v in got.items()}
    return {"bare_step_thread_cpu_us": round(med(bare), 1),
            **{f"{k}_added_us": round(v, 1) for k, v in added.items()},
            "forward_saved_us": round(added["fwd_hooks"] - added["fwd_instance"], 1),
            "both_saved_us": round(added["hooks_callsite"] - added["instance_callsite"], 1)}


def parts_mode(steps: int, blocks: int) -> dict[str, Any]:
    from stepscope.recording import gate

    with tempfile.TemporaryDirectory() as out:
        cfg = Config(out_dir=out, heartbeat_s=0.0, max_pending_steps=1 << 20, every_n_steps=EVERY_N_STEPS)
        tracer = Tracer(cfg, clock=CpuClock())

        def bare() -> None:
            for _ in range(steps):
                pass

        def step() -> None:
            for _ in range(steps):
                with tracer.step():
                    pass

        def phases() -> None:
            op, cl = tracer.open_phase, tracer.close_phase
            for _ in range(steps):
                with tracer.step():
                    cl(op("forward"))
                    cl(op("backward"))
                    cl(op("optimizer"))

        def gate_reads() -> None:
            cur = gate.current
            with tracer.step():
                for _ in range(steps):
                    cur()
                    cur()
                    cur()
                    cur()

        parts = {"bare": bare, "step": step, "step_3_phases": phases, "gate_reads_4": gate_reads}
        best = {k: float("inf") for k in parts}
        for _ in range(blocks):
            for name, fn in parts.items():
                c0 = time.thread_time_ns()
                fn()
                best[name] = min(best[name], (time.thread_time_ns() - c0) / steps / 1e3)
                tracer.settle()  # the writer catches up between parts: no record dropped
        dropped = sum(tracer.resolver.dropped.values())
        tracer.finish()
    floor = best.pop("bare")
    return {**{f"{k}_us": round(v - floor, 2) for k, v in best.items()}, "resolver_dropped": dropped}


def alloc_mode(steps: int, heartbeat: bool) -> None:
    import tracemalloc

    model, opt, x = _job()
    with tempfile.TemporaryDirectory() as out:
        tracer = _tracer(out, model, opt, heartbeat)
        for _ in range(50):
            with tracer.step():
                _step(model, opt, x)
        tracer.flush()
        time.sleep(0.2)
        # Bare loop first: what the step itself allocates, to subtract.
        tracemalloc.start(3)
        s0 = tracemalloc.take_snapshot()
        for _ in range(steps):
            _step(model, opt, x)
        s1 = tracemalloc.take_snapshot()
        for _ in range(steps):
            with tracer.step():
                _step(model, opt, x)
        s2 = tracemalloc.take_snapshot()
        tracemalloc.stop()
        tracer.finish()

    def live(a: tracemalloc.Snapshot, b: tracemalloc.Snapshot) -> int:
        return sum(d.count_diff for d in b.compare_to(a, "traceback") if d.count_diff > 0)

    filt = [tracemalloc.Filter(False, tracemalloc.__file__)]
    s0, s1, s2 = (s.filter_traces(filt) for s in (s0, s1, s2))
    print(json.dumps({"steps": steps, "bare_live_blocks_per_step": live(s0, s1) / steps,
                      "traced_live_blocks_per_step": live(s1, s2) / steps}))
    for d in s2.compare_to(s1, "lineno")[:25]:
        print(f"{d.count_diff / steps:8.2f} blocks/step {d.size_diff / steps:9.1f} B/step  {d.traceback}")


def main() -> None:
    ap = argparse.ArgumentParser()
    modes = ("time", "cprofile", "alloc", "wakes", "build", "cycle", "handover", "floor", "callsite",
             "parts", "neighbour", "cold", "sampling", "calls", "alternate", "alternate-tiny", "boundary",
             "ddp-calls", "cold-boundary", "cold-recorded", "to-steps")
    ap.add_argument("--mode", choices=modes, default="time")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=11)
    ap.add_argument("--heartbeat", action="store_true")
    ap.add_argument("--control", action="store_true",
                    help="alternate modes: an empty with statement in place of the tracer (an A/A "
                         "run: its median should be 0 within its precision)")
    ap.add_argument("--burn-us", type=float, default=20.0,
                    help="neighbour mode: µs of CPU per step the helper thread burns")
    ap.add_argument("--every-n-steps", type=int, default=1,
                    help="record one step in N (time, cprofile, floor modes): what unsampled steps cost")
    ap.add_argument("--hidden", type=int, default=0,
                    help="time and cold modes: an MLP of this width, batch 64, instead of the tiny "
                         "model (640: the issue's ~4 ms CPU step; use fewer --steps); cold mode's "
                         "default is 640")
    args = ap.parse_args()
    global EVERY_N_STEPS, HIDDEN
    EVERY_N_STEPS = args.every_n_steps
    HIDDEN = args.hidden
    torch.set_num_threads(1)
    if args.mode == "cprofile":
        cprofile_mode(args.steps, args.heartbeat)
    elif args.mode == "wakes":
        print(json.dumps({"benchmark": "hot_path_wakes", "steps": args.steps, "blocks": args.blocks,
                          "loadavg_1m": round(os.getloadavg()[0], 2),
                          **wakes_mode(args.steps, args.blocks)}))
    elif args.mode == "build":
        print(json.dumps({"benchmark": "hot_path_build", **build_mode()}))
    elif args.mode == "floor":
        print(json.dumps({"benchmark": "hot_path_floor", "steps": args.steps, "blocks": args.blocks,
                          "loadavg_1m": round(os.getloadavg()[0], 2), **floor_mode(args.steps, args.blocks)}))
    elif args.mode == "callsite":
        print(json.dumps({"benchmark": "hot_path_callsite", "steps": args.steps, "blocks": args.blocks,
                          "loadavg_1m": round(os.getloadavg()[0], 2),
                          **callsite_mode(args.steps, args.blocks)}))
    elif args.mode == "neighbour":
        print(json.dumps({"benchmark": "hot_path_neighbour", "steps": args.steps, "blocks": args.blocks,
                          "loadavg_1m": round(os.getloadavg()[0], 2),
                          **neighbour_mode(args.steps, args.blocks, args.burn_us)}))
    elif args.mode == "parts":
        print(json.dumps({"benchmark": "hot_path_parts", "steps": args.steps, "blocks": args.blocks,
                          "loadavg_1m": round(os.getloadavg()[0], 2), **parts_mode(args.steps, args.blocks)}))
    elif args.mode == "cold":
        HIDDEN = args.hidden or 640
        print(json.dumps({"benchmark": "hot_path_cold", "hidden": HIDDEN, "steps": args.steps,
                          "blocks": args.blocks, "loadavg_1m": round(os.getloadavg()[0], 2),
                          **cold_mode(args.steps, args.blocks)}))
    elif args.mode == "sampling":
        HIDDEN = args.hidden or 640
        print(json.dumps({"benchmark": "hot_path_sampling", "hidden": HIDDEN, "steps": args.steps,
                          "blocks": args.blocks, "loadavg_1m": round(os.getloadavg()[0], 2),
                          **sampling_mode(args.steps, args.blocks)}))
    elif args.mode == "alternate":
        HIDDEN = args.hidden or 640
        print(json.dumps({"benchmark": "hot_path_alternate", "hidden": HIDDEN, "pairs": args.steps,
                          "loadavg_1m": round(os.getloadavg()[0], 2), "control": args.control,
                          **alternate_mode(args.steps, args.control)}))
    elif args.mode == "alternate-tiny":
        HIDDEN = 0
        print(json.dumps({"benchmark": "hot_path_alternate_tiny", "hidden": 0, "pairs": args.steps,
                          "loadavg_1m": round(os.getloadavg()[0], 2), "control": args.control,
                          **alternate_mode(args.steps, args.control)}))
    elif args.mode == "boundary":
        print(json.dumps({"benchmark": "hot_path_boundary", "blocks": args.blocks, "steps": args.steps,
                          "loadavg_1m": round(os.getloadavg()[0], 2),
                          **boundary_mode(args.blocks, args.steps)}))
    elif args.mode == "cold-boundary":
        HIDDEN = args.hidden or 640
        print(json.dumps({"benchmark": "hot_path_cold_boundary", "hidden": HIDDEN, "rounds": args.steps,
                          "loadavg_1m": round(os.getloadavg()[0], 2),
                          **({"heartbeat": True} if args.heartbeat else {}),
                          **cold_boundary_mode(args.steps, heartbeat=args.heartbeat)}))
    elif args.mode == "cold-recorded":
        HIDDEN = args.hidden or 640
        print(json.dumps({"benchmark": "hot_path_cold_recorded", "hidden": HIDDEN, "rounds": args.steps,
                          "loadavg_1m": round(os.getloadavg()[0], 2),
                          **cold_boundary_mode(args.steps, every=1)}))
    elif args.mode == "to-steps":
        HIDDEN = args.hidden or 640
        print(json.dumps({"benchmark": "hot_path_to_steps", "hidden": HIDDEN, "steps": args.steps,
                          "every_n_steps": args.every_n_steps, "control": args.control,
                          "loadavg_1m": round(os.getloadavg()[0], 2),
                          **to_steps_mode(args.steps, args.every_n_steps, args.control)}))
    elif args.mode == "ddp-calls":
        print(json.dumps({"benchmark": "hot_path_ddp_calls", **ddp_calls_mode()}))
    elif args.mode == "calls":
        print(json.dumps({"benchmark": "hot_path_calls", "hidden": HIDDEN, **calls_mode()}))
    elif args.mode == "alloc":
        alloc_mode(args.steps, args.heartbeat)
    elif args.mode == "handover":
        got = handover_mode(args.steps, args.blocks)
        print(json.dumps({"benchmark": "hot_path_handover", "steps": args.steps, "blocks": args.blocks,
                          "loadavg_1m": round(os.getloadavg()[0], 2), **got}))
    elif args.mode == "cycle":
        print(json.dumps({"benchmark": "hot_path_cycle", "steps": args.steps, "blocks": args.blocks,
                          "loadavg_1m": round(os.getloadavg()[0], 2), **cycle_mode(args.steps, args.blocks)}))
    else:
        print(json.dumps({"benchmark": "hot_path", "steps": args.steps, "blocks": args.blocks,
                          "every_n_steps": args.every_n_steps, "hidden": args.hidden,
                          "loadavg_1m": round(os.getloadavg()[0], 2),
                          **time_mode(args.steps, args.blocks, args.heartbeat)}))


if __name__ == "__main__":
    main()
