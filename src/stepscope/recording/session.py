"""Session: one recording run on one rank — wiring, the step boundary, failures, finish.

The session builds the resolver and the :mod:`~stepscope.recording.outbox` (the writer), installs the
instruments the config asks for, and hands finished steps from the recorder to the resolver
and resolved steps to the outbox. It reaches the instrument side through the
:class:`~stepscope.recording.protocols.Instruments` the face hands in, and its observers are
*listeners* (see :meth:`Session.add_listener`) the face attaches; no instrument and no
listener is imported here.

**Failures are acted on by the training thread.** An error found on another thread (the
writer's disk error, a hook on an autograd thread) is handed over and applied at the next
step boundary: switching timing off removes hooks, and removing an optimizer hook while the
training thread iterates them (inside the user's ``opt.step()``) would crash the job.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from stepscope.recording import gate
from stepscope.recording.clock import Clock, CudaClock, GpuAnchor
from stepscope.recording.config import Config
from stepscope.recording.dist import RankInfo
from stepscope.recording.outbox import MAX_HELD_STEPS, RECENT_RECORDS, Outbox, RecentRecords
from stepscope.recording.protocols import Instruments, PerStep, ResourceMonitor
from stepscope.recording.recorder import Recorder
from stepscope.recording.resolver import Resolver
from stepscope.recording.sinks import DELIVERY_BOUND_S, Sink, open_sink
from stepscope.recording.step import Step

__all__ = ["FINISH_TIMEOUT_S", "MAX_HELD_STEPS", "RECENT_RECORDS", "Session"]

#: How long ``finish()`` keeps polling CUDA events before giving up on them (seconds).
FINISH_TIMEOUT_S = 5.0
#: The loss reason of steps run after an error turned timing off.
UNTIMED = "timing_off"

_get_ident = threading.get_ident
_time_ns = time.time_ns


class Session(Recorder):
    """The recorder plus its run: resolver, writer, listeners, instruments, failures."""

    # The rest of what a step boundary reads (see Recorder.__slots__).
    __slots__ = (
        "_handed",
        "_hooks_on",
        "_last_step",
        "_rq_read",
        "_step_cm",
        "_step_counts",
        "_step_end",
        "_step_wall_ns",
    )

    def __init__(
        self, config: Config, clock: Clock, rank: RankInfo, run_id: str, sink: Sink | None,
        instruments: Instruments,
    ) -> None:
        self.rank = rank
        self.run_id = run_id
        self._instruments = instruments
        anchor = GpuAnchor(clock) if isinstance(clock, CudaClock) else None
        # On CUDA: know about global-mode graph captures on any thread.
        uncapture, capturing = instruments.watch_captures() if anchor is not None else (None, None)
        resolver = Resolver(
            clock,
            {"run_id": run_id, "rank": rank.rank, "local_rank": rank.local_rank,
             "world_size": rank.world_size, "hostname": rank.hostname},
            config.max_pending_steps,
            anchor,
            capturing,
            self._step_fields,
        )
        super().__init__(config, clock, resolver)
        self._auto_active: set[str] = set()
        self._uninstallers: list[Callable[[], None]] = [] if uncapture is None else [uncapture]
        #: Instruments on for sampled steps only (module and optimizer hooks, the backward
        #: wrapper), and whether they are on now: switched at step boundaries, see _switch.
        self._per_step: list[PerStep] = []
        self._hooks_on = False
        self._since_flush = 0
        self._flush_every = config.flush_every_n_steps
        self._failed = False
        #: Steps run after an error turned timing off (none recorded): a loss the heartbeat says.
        self.untimed_steps = 0
        self._finished = False
        self._handed: BaseException | None = None  # a failure found off the training thread
        self._listeners: list[Any] = []
        self._step_end: list[Callable[[Any, int], None]] = []
        #: ``on_step_end`` of listeners that look only around sampled steps (``sampled_only``).
        self._sampled_end: list[Callable[[Any, int], None]] = []
        self._on_stream: list[Callable[[Any, Any], None]] = []
        self._last_phase_stream: Any = None
        self._forward_seen = False
        self._sampled_seen = 0
        self._step_wall_ns = 0  # time.time_ns() at step entry
        #: The last step ended: its index, time.time_ns() at its end and at its entry.
        self._last_step: tuple[int, int, int] | None = None
        self._raised: tuple[BaseException, list[str]] | None = None
        # Throughput, FLOPs, memory, device health. Built once the clock knows its
        # device (init() often runs before set_device): see _start.
        self._step_counts: tuple[int | float | None, int | float | None] | None = None
        #: What ``with tracer.step() as s`` binds (the tracer sets its context manager).
        self._step_cm: Any = None
        self._resources: ResourceMonitor | None = None
        self.sched = instruments.run_queue(clock.kind)  # run-queue wait per step (CPU clock only)
        self._rq_read = True  # whether the last step exit (or the start) read the run-queue clock
        #: False when records go to a sink passed in (tests): no files beside them (heartbeat).
        self.writes_files = sink is None
        self._recent = RecentRecords()
        self._listeners.append(self._recent)
        self._outbox = Outbox(
            resolver, sink if sink is not None else open_sink(config.sink, config.out_dir, rank.rank),
            self._listeners, on_error=self.fail, batch=config.flush_every_n_steps,
        )
        self._writer = self._outbox.writer
        #: Observers the face attached (opaque here), for users and tests.
        self.profiler: Any = None
        self.live: Any = None
        self.autoprofile: Any = None

    def _start(self, model: Any, optimizer: Any, wire: Callable[[Any], None]) -> None:
        """Install instruments, have ``wire(self)`` attach the observers, register the exit
        flush (end of ``__init__``)."""
        instruments = self._instruments
        # Whoever reports collectives (the patch, a framework integration), their records
        # get the collectives section; the resolver itself imports no instrument.
        self.resolver.summarize_collectives = instruments.summarize_collectives
        removers, active, per_step = instruments.install(self, self.config, model, optimizer, self.warn)
        self._uninstallers.extend(removers)
        self._auto_active |= active
        self._per_step = per_step
        self._hooks_on = True
        if self._index != self._sample_at:
            self._switch(False)
        # Built here, off the first step, when the device is known (the CPU, or a CUDA clock
        # given its device); a CUDA clock that follows the current device knows it at its
        # first mark, so its monitor is built at the first sampled step.
        if self.clock.device != "cuda":
            self._resources = self._new_resources()
        if self.sched is not None:
            self.sched.step_end()  # the first step's baseline
        wire(self)
        ref = weakref.ref(self)

        def _at_exit() -> None:
            session = ref()
            if session is not None:
                session.finish()

        self._at_exit = _at_exit
        atexit.register(_at_exit)

    # ------------------------------------------------------------ listeners

    def add_listener(self, listener: Any) -> None:
        """Register an observer: an object with any of ``on_step_end(tracer, index)``,
        ``on_record(record)``, ``on_exception(tracer, exc_type, exc, phase_stack)``,
        ``on_finish(tracer)``, ``on_stream(tracer, stream)``; a plain
        callable is taken as ``on_record``. ``on_record`` runs on the writer thread.

        A listener whose ``sampled_only`` is true has its ``on_step_end`` called only at the
        end of a sampled step and of the step before one: the steps between cost it nothing."""
        if callable(listener) and not hasattr(listener, "on_record"):
            fn = listener

            class _OnRecord:
                def on_record(self, record: dict[str, Any]) -> None:
                    fn(record)

            listener = _OnRecord()
        self._listeners.append(listener)
        if hasattr(listener, "on_step_end"):
            ends = self._sampled_end if getattr(listener, "sampled_only", False) else self._step_end
            ends.append(listener.on_step_end)
        if hasattr(listener, "on_stream"):
            self._on_stream.append(listener.on_stream)
            self._phase_opened = self._phase_stream

    def _phase_stream(self, mark: Any) -> None:
        """A phase opened (any thread): tell ``on_stream`` listeners when it runs on another
        CUDA stream than the phase opened before it (host marks have no stream)."""
        stream = getattr(mark, "stream", None)
        if stream is None or stream is self._last_phase_stream:
            return
        self._last_phase_stream = stream
        for fn in self._on_stream:
            fn(self, stream)

    def recent_records(self) -> list[dict[str, Any]]:
        """The last resolved records of this rank (oldest first)."""
        return self._recent.snapshot()

    def submit_background(self, job: Callable[[], Any]) -> None:
        """Run ``job()`` on the writer thread (never blocks; no CUDA calls allowed there)."""
        self._outbox.submit_background(job)

    # ------------------------------------------------------------ step boundary

    def _enter_step(self) -> Any:
        """Step entry (the ``with`` statement calls it directly); returns the step's context
        manager, what ``with tracer.step() as s`` binds."""
        if (self._index < self._sample_at and not self._in_step and self._handed is None
                and self.enabled and self._next is None):
            # A step known to be unsampled: what the heartbeat (a hung rank's status) and the
            # next boundary need, nothing more. Its thread is taken as the one of the last
            # full boundary (a sampled step, the step before one), not asked again: a loop
            # that moves to another thread between sampled steps is seen at the next of them.
            self._in_step = True
            self._owner = self._train_thread
            self._step_wall_ns = _time_ns()
            self._step_counts = None  # an unsampled step's throughput numbers are not kept
            return self._step_cm
        if self._handed is not None:
            self._take_handed()
        if not self.enabled:
            return self._step_cm
        if self._in_step:
            tl = self._ignored
            tl.n = getattr(tl, "n", 0) + 1
            self._refused += 1
            if self._owner == _get_ident():
                self.warn("step() entered inside an open step(); the inner one is not timed",
                          key="nested")
            else:
                self.warn("step() entered on a second thread while another thread's step is open; "
                          "steps are per thread, the second one is not timed", key="threads")
            return self._step_cm
        try:
            wall_ns = self._step_wall_ns = _time_ns()  # the heartbeat's and the record's
            step = self._open_step(wall_ns)
            if step is None:
                self._step_counts = None
                return self._step_cm
            if not self._hooks_on:  # the index moved (step(index=...)) onto a sampled one
                self._switch(True)
            self._sampled_seen += 1
            counts = self._step_counts
            if counts is not None:
                self._step_counts = None
                if counts[0] is not None:
                    step.counters["tokens"] = step.counters.get("tokens", 0) + counts[0]
                if counts[1] is not None:
                    step.counters["samples"] = step.counters.get("samples", 0) + counts[1]
            res = self._resources
            if res is None:
                res = self._resources = self._new_resources()
            if res.starts_pending:  # the FLOP-count step only: no call on every other step
                res.on_step_start(step.index)
        except Exception as exc:  # protect the job
            self.fail(exc)
        return self._step_cm

    def _exit_step(self, exc_type: Any = None, exc: BaseException | None = None, tb: Any = None) -> None:
        """Step exit (the ``with`` statement calls it directly: ``exc_type, exc, tb``)."""
        done = self._index
        if (done + 1 < self._sample_at and self._cur is None and self._in_step and exc is None
                and not self._refused and not self._hooks_on):
            # An unsampled step before another one (see _enter_step): the step index moves,
            # the heartbeat learns when it ended, every-step listeners run; no mark, no record.
            try:
                self._in_step = False
                self._owner = None
                self._index = done + 1
                self._rq_read = False
                self._last_step = (done, _time_ns(), self._step_wall_ns)
                for end in self._step_end:
                    end(self, done)
            except Exception as err:  # protect the job
                self.fail(err)
            if self._handed is not None:
                self._take_handed()
            return
        if self._refused:
            tl = self._ignored
            n = getattr(tl, "n", 0)
            if n:  # the matching entry was not timed
                tl.n = n - 1
                self._refused -= 1
                return
        if not self.enabled:
            self._in_step = False
            if self._failed:
                self.untimed_steps += 1  # timing off after an error: a step never recorded
            if self._handed is not None:
                self._take_handed()
            return
        try:
            if exc is not None:
                noted = self._raised
                raised_in = noted[1] if noted is not None and noted[0] is exc else [
                    sp.name for sp in self.owner_stack()
                ]
                self._raised = None
                # Observers see the state as it was when the step raised (step, phases).
                for listener in self._listeners:
                    fn = getattr(listener, "on_exception", None)
                    if fn is not None:
                        fn(self, type(exc), exc, raised_in)
            step = self._close_step()
            sample_next = self._index == self._sample_at
            if sample_next != self._hooks_on:
                self._switch(sample_next)
            sched = self.sched
            rq = None
            if sched is not None:
                # Read at the end of a sampled step (its run-queue wait) and of the step before
                # one (that wait's baseline); between unsampled steps, no system call at all.
                if step is not None or sample_next:
                    # This thread (the owner's) and, on the host clock, the end mark: a
                    # perf_counter_ns value, the reader's wall clock.
                    rq = sched.step_end(self._train_thread,
                                        step.end if step is not None and self._host_marks else None)
                    if not self._rq_read:
                        rq = None  # the previous step's end was not read (the index jumped)
                    self._rq_read = True
                else:
                    self._rq_read = False
            if step is not None:
                if rq is not None:
                    step.counters["runq_ms"] = rq
                res = self._resources
                if res is not None:
                    step.res = res.on_step_end(step.index)
                if not self._forward_seen and "forward" in self._auto_active:
                    self._check_forward(step)
                self._since_flush += 1
            if step is not None and self._host_marks:
                # The end in wall-clock ns from the marks (perf_counter_ns values): no clock read.
                end_ns = step.start_unix_ns + (step.end - step.start)
            else:
                end_ns = _time_ns()
            self._last_step = (done, end_ns, self._step_wall_ns)
            if step is not None:
                self.resolver.add(step, poll=True)
                # An exception may end the job: what is resolved goes to the file now.
                # Otherwise every flush_every_n_steps steps, and no sooner than the outbox's
                # every_s after the last hand-over (each wake costs the training thread).
                # One try per cadence: what is not handed over now (the writer behind, or
                # nothing resolved yet on a lagging GPU) leaves with the next hand-over or the
                # writer's own take (held steps, its idle tick): no retry on every step.
                if exc is not None or (
                    self._since_flush >= self._flush_every
                    and time.monotonic() >= self._outbox.due_at
                ):
                    self._since_flush = 0
                    self._outbox.submit()
            for fn in self._step_end:
                fn(self, done)
            if step is not None or sample_next:
                for end in self._sampled_end:
                    end(self, done)
        except Exception as err:  # protect the job
            self._in_step = False
            self.fail(err)
        if self._handed is not None:
            self._take_handed()

    def _new_resources(self) -> ResourceMonitor:
        return self._instruments.resources(self.config, self.clock.device, self.warn)

    def _step_fields(
        self, index: int, start_unix_ns: int, step_ms: float, counters: dict[str, float], res: Any
    ) -> dict[str, Any]:
        """Record sections from the resource monitor (writer thread); pops tokens/samples."""
        mon = self._resources
        if mon is None:
            return {}
        return mon.step_fields(index, start_unix_ns, step_ms, counters, res)

    def _check_forward(self, step: Step) -> None:
        if any(s.name == "forward" for s in step.spans):
            self._forward_seen = True
        elif self._sampled_seen >= 3:
            self._forward_seen = True  # warn once, then stop checking
            self.warn(
                "three sampled steps had no forward span although a model was passed to init(); "
                "if the model was compiled after init() (torch.compile(model) or model.compile()), "
                "pass the compiled module to init() instead, or time it with phase('forward')",
                key="no-forward",
            )

    # ------------------------------------------------------------ flush / finish

    def flush(self) -> None:
        """Hand every record resolved so far to the writer now (it writes them in order)."""
        if self.enabled and not self._finished:
            self.resolver.poll()
            self._since_flush = 0
            self._outbox.submit()

    def settle(self, timeout: float = DELIVERY_BOUND_S) -> bool:
        """Hand over what is resolved and wait (up to ``timeout`` s) until the writer has built
        it, so records and ``recent_records()`` cover every step resolved so far. On the
        training thread between steps only (``summary()``); elsewhere it does not wait."""
        if not self.enabled or self._finished or self._in_step or _get_ident() != self._train_thread:
            return False
        self.flush()
        return self._writer.wait_written(timeout)

    def finish(self) -> None:
        """Resolve pending events, flush, close files and remove hooks. Idempotent."""
        if self._finished:
            return
        self._finished = True
        atexit.unregister(self._at_exit)
        if self._handed is not None:
            self._take_handed()
        for listener in list(self._listeners):
            fn = getattr(listener, "on_finish", None)
            if fn is not None:
                try:
                    fn(self)
                except Exception as exc:  # protect the job: finishing must never raise into it
                    self._fail_now(exc)
        try:
            self._uninstall()
            if self._resources is not None:
                self._resources.close()
            if self.sched is not None:
                self.sched.close()
        except Exception as exc:  # protect the job
            self._fail_now(exc)
        if self.enabled:
            deadline = time.monotonic() + FINISH_TIMEOUT_S

            def late() -> bool:
                # Polling for late events at finish only; the host never calls synchronize.
                time.sleep(0.001)
                return time.monotonic() >= deadline

            try:
                self.resolver.drain(late)
            except Exception as exc:  # protect the job
                self._fail_now(exc)
        if self._failed:
            # Steps timed (or still pending) when an error turned timing off are never written.
            self.untimed_steps += len(self.resolver.pending) + self.resolver.ready_count()
        closed = self._outbox.close(self.enabled, timeout=FINISH_TIMEOUT_S + 10.0)
        if not closed:
            self.warn("the writer did not finish within its timeout; the last records may be missing")
        for fn in [getattr(x, "on_closed", None) for x in self._listeners]:  # after the last record
            if fn is not None:
                with contextlib.suppress(Exception):  # protect the job: finishing must never raise
                    fn(self)

    # ------------------------------------------------------------ failures

    def fail(self, exc: BaseException) -> None:
        """Report once, turn timing off, and let the training job go on.

        Off the training thread the failure is handed to it and acted on at its next step
        boundary (or at ``finish()``).
        """
        if self._failed:
            return
        if _get_ident() != self._train_thread and not self._finished:
            if self._handed is None:
                self._handed = exc  # one reference store: atomic, no lock needed
            return
        self._fail_now(exc)

    def _take_handed(self) -> None:
        exc, self._handed = self._handed, None
        if exc is not None:
            self._fail_now(exc)

    def _fail_now(self, exc: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        super().fail(exc)
        with contextlib.suppress(Exception):  # protect the job: we are already failing
            self._uninstall()
        if self._resources is not None:
            # A FLOP counter left entered by an aborted step would slow every later step.
            self._resources.stop_counter()
        self.warn(f"timing disabled after an internal error: {exc!r}")

    # ------------------------------------------------------------ instruments

    def add_uninstaller(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the tracer finishes (instruments installed from outside)."""
        self._uninstallers.append(fn)

    def _switch(self, on: bool) -> None:
        """Put the per-step instruments on (before a sampled step: at the end of the step
        before it, so its pre-step phases are seen too) or take them off (after it). Only
        between steps, on the training thread: removing an optimizer hook while another
        thread iterates them would crash it."""
        self._hooks_on = on
        for inst in self._per_step:
            if on:
                inst.on()
            else:
                inst.off()

    def _uninstall(self) -> None:
        self._per_step = []
        if gate.current() is self:
            gate.set_current(None)
        while self._uninstallers:
            try:
                self._uninstallers.pop()()
            except Exception as exc:  # protect the job: a stale hook handle is harmless
                self.warn(f"could not remove a hook: {exc!r}")
        self._auto_active.clear()

    # ------------------------------------------------------------ observers' view

    def state(self) -> dict[str, Any]:
        """A snapshot for observers on other threads (the heartbeat): plain values, no clock
        (no CUDA) call. Phases are known on sampled steps only."""
        stack = self.owner_stack()
        last = self._last_step
        return {
            "step": self._index,
            "in_step": self._in_step,
            "step_started": self._step_wall_ns / 1e9 if self._in_step else None,
            "phase_stack": [sp.name for sp in stack],
            "phase_started": self.span_wall(stack[-1]) if stack else None,
            "last_step": last[0] if last else None,
            "last_step_end": last[1] / 1e9 if last else None,
            "last_step_s": (last[1] - last[2]) / 1e9 if last else None,
            "finished": self._finished,
            "enabled": self.enabled,
            "collective": self._blocked_in(),
            "runq": None if self.sched is None else (self.sched.reason or "on"),
            "lost": self.unrecorded_losses(),
        }

    def unrecorded_losses(self) -> dict[str, int]:
        """Steps lost by reason that no written record counts (the writer's, and the steps run
        after an error turned timing off): what the heartbeat file carries for the report."""
        lost = self._writer.unreported()
        if self.untimed_steps:
            lost[UNTIMED] = self.untimed_steps
        return lost

    def _blocked_in(self) -> dict[str, Any] | None:
        owner = self._owner
        if owner is None or not self.config.collectives:
            return None
        got = self._instruments.blocked_in(owner)
        return None if got is None else {"op": got[0], "since": got[1]}

    def note_raise(self, exc: BaseException) -> None:
        """Remember the open phases where ``exc`` was first seen (for crash evidence)."""
        if self._raised is None or self._raised[0] is not exc:
            self._raised = (exc, [sp.name for sp in self._stack_here() if sp.end is None])
