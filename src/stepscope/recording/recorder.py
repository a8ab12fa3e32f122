"""Recorder: clock marks, step and phase state, and who owns them, on one rank.

This is what instruments talk to (:class:`~stepscope.recording.protocols.Recorder`):
``open_phase`` / ``close_phase`` / ``discard_phase`` / ``drop_unconsumed``, ``add_side_span``,
``add_counter``, ``add_collective``, ``current_path``, ``in_step``, ``recording``,
``set_step_fields``, and
``enter_autograd`` / ``leave_autograd_threads`` for the gate and the backward timing, and
``sampled_owner`` (the thread of the open sampled step, which the per-step hooks compare
with their own before asking the gate). It imports no instrument and no observer; finished
steps go to the :class:`~stepscope.recording.resolver.Resolver`.

Ownership, each the fix for a defect seen on GPUs:

- **Steps belong to the thread that opened them** (the *owner*). A ``step()`` nested in an
  open one, or opened by a second thread, is not timed (see :mod:`stepscope.recording.session`).
- **Phase stacks are per thread.** A phase opened by a background thread (a logger, a
  checkpoint writer) is its own top-level span; it never becomes the parent of the owner's
  forward or backward.
- **Autograd work follows its step.** On CUDA, backward runs on a device thread while the
  owner blocks in its (timed) backward call. The first instrumented call on that thread
  during it adopts the thread (the gate calls :meth:`Recorder.enter_autograd`): it shares the
  owner's phase stack and the in-step gate is raised there for that graph task only
  (collectives issued by FSDP2 / tensor-parallel backward are timed; other work on the same
  thread is not).
- **Before a step**, only the step's own input waits (:data:`PRE_STEP_PHASES`: the
  dataloader wait, the host-to-device hand-over) belong to it and move its start back to
  theirs. Any other phase opened outside a step is not timed (warned once): evaluation or
  logging between steps is not charged to the next step.

The hot path takes clock marks and appends small objects to lists; no I/O, no GPU sync. On a
step long enough to evict the caches, its cost is the memory it touches more than the calls
it makes: a phase opened by the owner of the sampled step goes straight to the owner's stack
(no gate, no thread table), and a span on the host clock reads no wall clock (its mark is a
``perf_counter_ns`` value, from which :meth:`Recorder.span_wall` derives it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from stepscope.common.errors import warn
from stepscope.recording import gate
from stepscope.recording.clock import Clock
from stepscope.recording.config import Config
from stepscope.recording.resolver import Resolver
from stepscope.recording.step import STREAM_WAIT, Span, Step

#: Phases that, opened between steps, belong to the next step and move its start back.
PRE_STEP_PHASES = frozenset({"dataloader", "h2d"})

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns
_gate_here = gate.here


class Recorder:
    """Marks, steps and per-thread phase stacks; the base of :class:`~stepscope.tracer.Tracer`."""

    # The fields a step boundary reads, as slots: a step that records nothing touches a few
    # adjacent cache lines instead of hash entries spread over a large instance dict. After
    # a long step has evicted the caches, that is most of what such a boundary costs
    # (``benchmarks/hot_path.py --mode cold-boundary``). Every other field lives in __dict__.
    __slots__ = (
        "__dict__",
        "__weakref__",
        "_cur",
        "_in_step",
        "_index",
        "_next",
        "_owner",
        "_refused",
        "_sample_at",
        "_train_thread",
        "enabled",
    )

    def __init__(self, config: Config, clock: Clock, resolver: Resolver) -> None:
        self.config = config
        self.clock = clock
        self.resolver = resolver
        self.enabled = True
        self._index = 0
        self._cur: Step | None = None  # the open sampled step
        self._next: Step | None = None  # what arrived before the next step opened
        self._stacks: dict[int, list[Span]] = {}  # thread -> its open phases
        self._adopted: dict[int, int] = {}  # autograd thread -> owner, during its backward
        self._owner: int | None = None  # thread that opened the current step
        #: The thread that owns the open *sampled* step, 0 when none (or timing is off): what
        #: the per-step hooks compare ``threading.get_ident()`` with before anything else.
        #: Read by any thread; written by the owner at step open and close only.
        self.sampled_owner = 0
        self._owner_stack: list[Span] = []  # the owner's phase stack while it is sampled_owner
        self._train_thread = _get_ident()  # the last owner (before any step: the creator)
        self._ignored = threading.local()  # per thread: step() entries not timed
        self._refused = 0  # such entries open on any thread (a cheap check before the thread-local)
        self._in_step = False
        #: The first index ``>= _index`` that is sampled (:data:`NEVER` when none is), kept
        #: with ``_index`` (:meth:`_move_to`, :meth:`_close_step`): a step boundary knows
        #: whether a step is sampled by one comparison, without asking the config.
        self._sample_at = _sample_at(config, 0)
        self._every = config.every_n_steps
        self._end_step = NEVER if config.end_step is None else config.end_step
        self._warned: set[str] = set()
        #: Marks are ``perf_counter_ns`` values: a span's wall-clock start follows from its mark.
        self._host_marks = bool(getattr(clock, "host_readable", False))
        #: Called with each phase's start mark once a listener watches the streams phases run
        #: on (:meth:`Session.add_listener`, ``on_stream``); ``None`` costs one check per phase.
        self._phase_opened: Callable[[Any], None] | None = None
        self._gate_up = gate.raised_by(self)  # the gate's value while a step of ours is open

    # ------------------------------------------------------------------ state

    @property
    def recording(self) -> bool:
        """True when the current step (or the next one, between steps) is sampled."""
        if not self.enabled:
            return False
        if self._in_step:
            return self._cur is not None
        return self._index == self._sample_at

    @property
    def in_step(self) -> bool:
        """True while a sampled step is open (on whichever thread asks)."""
        return self._cur is not None

    @property
    def step_index(self) -> int:
        """Index of the current step inside ``step()``, else of the next one."""
        return self._index

    def open_step_index(self) -> int | None:
        """Index of the sampled step open now (on whichever thread asks), else ``None``: what
        ``in_step`` and ``step_index`` say together, in one call (backward-start hooks)."""
        return self._index if self._cur is not None else None

    def _stack_here(self) -> list[Span]:
        """This thread's phase stack (the owner's, for autograd work of the owner's step)."""
        tid = _get_ident()
        adopted = self._adopted
        if adopted:
            tid = adopted.get(tid, tid)
        stack = self._stacks.get(tid)
        if stack is None:
            stack = self._stacks[tid] = []
        return stack

    def owner_stack(self) -> list[Span]:
        """The open phases of the training thread (a copy; safe from any thread)."""
        owner = self._owner
        stack = self._stacks.get(self._train_thread if owner is None else owner)
        return [sp for sp in list(stack or ()) if sp.end is None]

    def span_wall(self, span: Span) -> float:
        """``time.time()`` when ``span`` opened (any thread)."""
        if span.wall is not None:
            return span.wall
        return time.time() - (time.perf_counter_ns() - int(span.start)) / 1e9

    def current_path(self) -> str | None:
        """Path of this thread's innermost open phase (``forward/h2d``); None outside any."""
        stack = self._stack_here()
        return stack[-1].path if stack else None

    # ------------------------------------------------------------ phases

    def open_phase(self, name: str, host: bool = False, others: bool = True) -> Span | None:
        """Start timing ``name``; returns a token for :meth:`close_phase` (``None`` = not timed).

        Between steps, a :data:`PRE_STEP_PHASES` span goes to the next step, whose start moves
        back to the span's start; while it is open the in-step gate is raised on this thread,
        so collectives inside a batch fetch are seen. Other phases between steps are not timed.

        ``others`` False (the per-step hooks): only on the thread that owns the open sampled
        step or whose gate is raised for this recorder (a pre-step phase, an autograd thread
        adopted during the owner's backward); any other thread's phase is not timed.
        """
        step: Step
        try:
            if _get_ident() == self.sampled_owner:
                # The usual case: the owner of the open sampled step (its stack, its step).
                stack, step, pre = self._owner_stack, self._cur, False  # type: ignore[assignment]
            else:
                if not others and gate.current() is not self:
                    return None
                target = self._open_target(name)
                if target is None:
                    return None
                stack, step, pre = target
            parent = stack[-1].path if stack else None
            span = Span()
            span.name = name
            span.parent = parent
            span.path = name if parent is None else f"{parent}/{name}"
            span.start = self.clock.mark()
            span.end = None
            span.host_start = _perf_ns() if host else None
            span.host_end = None
            span.wall = None if self._host_marks else time.time()
            if pre:
                if step.start is None:
                    step.start = span.start
                    step.start_unix_ns = time.time_ns()
                gate.set_current(self)
            step.spans.append(span)
            span.stack = stack
            stack.append(span)
            opened = self._phase_opened
            if opened is not None:
                opened(span.start)
            return span
        except Exception as exc:  # protect the job: timing errors disable timing only
            self.fail(exc)
            return None

    def _open_target(self, name: str) -> tuple[list[Span], Step, bool] | None:
        """Where a phase opened off the owner's sampled step goes: this thread's stack, the
        step (the open one, or the next one for a pre-step phase: ``True``), or ``None``
        (not timed)."""
        if not self.enabled:
            return None
        stack = self._stack_here()
        if self._in_step:
            cur = self._cur
            if cur is None:
                return None
            if self._refused and getattr(self._ignored, "n", 0) and _get_ident() != self._owner:
                return None  # inside a step() refused to this (second) thread
            return stack, cur, False
        if name not in PRE_STEP_PHASES and not stack:
            self.warn(
                f"phase({name!r}) opened outside a step is not timed: only the waits that "
                f"feed a step ({', '.join(sorted(PRE_STEP_PHASES))}) belong to the next one",
                key="pre-step",
            )
            return None
        nxt = self._next_step()
        if nxt is None:
            return None
        return stack, nxt, True

    def close_phase(self, token: Span | None) -> None:
        if token is None or token.end is not None or not self.enabled:
            return
        try:
            token.end = self.clock.mark()
            if token.host_start is not None:
                token.host_end = _perf_ns()
            stack = token.stack
            if stack:
                if stack[-1] is token:
                    stack.pop()
                elif token in stack:
                    stack.remove(token)  # closed out of order (an exception unwound past it)
            if not self._in_step and not stack:
                gate.set_current(None)
        except Exception as exc:  # protect the job
            self.fail(exc)

    def discard_phase(self, token: Span | None) -> None:
        """Forget a span (e.g. the loader's wait that ended in StopIteration)."""
        if token is None:
            return
        stack = token.stack
        if stack is not None and token in stack:
            stack.remove(token)
        for step in (self._next, self._cur):
            if step is not None and token in step.spans:
                step.spans.remove(token)
                self._forget(step, token)
        if not self._in_step and not stack:
            gate.set_current(None)

    def drop_unconsumed(self, token: Span | None) -> None:
        """Forget a pre-step span that no step has adopted (a loader abandoned by ``break``)."""
        nxt = self._next
        if token is not None and nxt is not None and token in nxt.spans:
            self.discard_phase(token)

    # ------------------------------------------------------- autograd ownership

    def enter_autograd(self) -> bool:
        """Called (through the gate) on a thread running the owner's backward: that
        thread shares the owner's phase stack and its gate is raised for this graph task.

        True when this thread was adopted (an autograd device thread): only then has
        :meth:`leave_autograd` anything to do (a CPU backward runs on the owner's thread)."""
        owner = self._owner
        tid = _get_ident()
        if owner is None or tid == owner or self._cur is None:
            return False
        self._adopted[tid] = owner
        gate.set_current(self, autograd=True)
        return True

    def leave_autograd(self) -> None:
        """Called when the owner's backward ends (its final callback), on the same thread."""
        if self._adopted.pop(_get_ident(), None) is not None:
            gate.set_current(None)

    def leave_autograd_threads(self) -> None:
        """Called on the owner when its backward call returns: the threads adopted during it
        stop sharing its phase stack (their gates, raised for that graph task, read closed)."""
        if self._adopted:
            self._adopted.clear()

    # ------------------------------------------------- what a step carries

    def add_side_span(self, name: str, start: Any, end: Any) -> None:
        """A span measured on another stream (e.g. the prefetch copy); not in the step sum."""
        step = self._reporting_step()
        if step is not None:
            foreign = self.clock.foreign
            item = (name, foreign(start), foreign(end))
            if step.side is None:
                step.side = [item]
            else:
                step.side.append(item)

    def add_counter(self, name: str, value: float) -> None:
        """Add ``value`` to the per-step counter ``name`` (e.g. ``h2d_bytes``)."""
        step = self._reporting_step()
        if step is not None:
            step.counters[name] = step.counters.get(name, 0) + value

    def add_collective(
        self, op: str, pg: str, pg_size: int, nbytes: int, start: Any, end: Any,
        phase_path: str | None, *, seq: int = 0, gap: tuple[Any, Any] | None = None,
        recv_bytes: int | None = None, side: Any = None,
    ) -> None:
        """One timed collective (see :mod:`stepscope.instrument.collective_timing`), attached to the
        current step or, during a pre-step phase, to the next one. ``gap`` is the
        ``(issue_end, wait_start)`` marks of an async call: overlapped work, not collective time.
        ``recv_bytes``: bytes this rank received, where it differs from ``nbytes`` (all-to-all).
        ``side``: set for a collective issued on another stream than the step's (kept as given,
        read by the collectives' summary).
        """
        step = self._reporting_step()
        if step is None:
            rel = self.clock.release
            for m in (start, end, *(gap or ())):
                rel(m)
            return
        item = (op, pg, pg_size, nbytes, start, end, phase_path, seq, gap, recv_bytes, side)
        _keep_collective(step, item)

    def step_stream(self) -> Any:
        """The stream the open sampled step started on (its compute stream); None outside a
        sampled step, on the host clock, or where the clock does not say."""
        step = self._cur
        return None if step is None else getattr(step.start, "stream", None)

    def add_stream_wait(self, before: Any, after: Any, joined: Any) -> None:
        """The step's stream held by a wait on another stream's work from mark ``before`` to
        ``after`` (both recorded on it around the wait); ``joined`` names the work waited for.
        Kept among the step's collectives as a :data:`~stepscope.recording.step.STREAM_WAIT`
        entry, in order."""
        step = self._cur
        if step is None:
            self.clock.release(before)
            self.clock.release(after)
            return
        item = (STREAM_WAIT, "", 0, 0, before, after, None, 0, None, None, joined)
        _keep_collective(step, item)

    def set_step_fields(self, fields: dict[str, Any]) -> None:
        """Merge extra top-level record sections (throughput, memory, ...) into the open step."""
        step = self._cur
        if step is not None:
            if step.extra is None:
                step.extra = dict(fields)
            else:
                step.extra.update(fields)

    # ------------------------------------------------------------- step open/close

    def _next_step(self) -> Step | None:
        """The step that things reported between steps belong to (None if not sampled)."""
        nxt = self._next
        if nxt is not None and nxt.index == self._index:
            return nxt
        if nxt is not None:  # the step index moved on (step(index=...)): stale
            self._drop_next()
        if self._index != self._sample_at:
            return None
        nxt = self._next = Step(self._index)
        return nxt

    def _reporting_step(self) -> Step | None:
        if self._in_step:
            return self._cur
        if not self.enabled:
            return None
        return self._next_step()

    def _drop_next(self) -> None:
        nxt, self._next = self._next, None
        if nxt is None:
            return
        for span in nxt.spans:
            stack = span.stack
            if stack is not None and span in stack:
                stack.remove(span)
        rel = self.clock.release
        for m in nxt.marks():
            if m is not None:
                rel(m)

    def _forget(self, step: Step, span: Span) -> None:
        if step.start is span.start:
            step.start = step.spans[0].start if step.spans else None
            if step.start is None:
                step.start_unix_ns = 0
        else:
            self.clock.release(span.start)
        if span.end is not None:
            self.clock.release(span.end)

    def _open_step(self, wall_ns: int | None = None) -> Step | None:
        """Open step ``_index`` on this thread; the sampled step, or None (not sampled).

        ``wall_ns``: ``time.time_ns()`` at entry, when the caller has read it already."""
        self._in_step = True
        tid = self._owner = self._train_thread = _get_ident()
        step: Step | None
        if self._next is None:  # the usual case (no pre-step phase): _next_step's make path
            if self._index != self._sample_at:
                return None
            step = Step(self._index)
        else:
            step = self._next_step()  # made by a pre-step phase, or new; None if not sampled
            if step is None:
                return None
            self._next = None
        if step.start is None:
            step.start = self.clock.mark()
            step.start_unix_ns = time.time_ns() if wall_ns is None else wall_ns
        stack = self._stacks.get(tid)
        if stack is None:
            stack = self._stacks[tid] = []
        elif stack:  # pre-step spans still open (none normally) stay on the stack
            stack[:] = [s for s in stack if s.end is None]
        self._owner_stack = stack
        self._cur = step
        self.sampled_owner = tid
        _gate_here.raised = self._gate_up
        return step

    def _close_step(self) -> Step | None:
        """Close the open step on its owner: end mark, open spans ended, gate lowered."""
        step = self._cur
        self.sampled_owner = 0
        if step is not None:
            _gate_here.raised = None
            end = self.clock.mark()
            for span in step.spans:
                if span.end is None:
                    span.end = end
                    stack = span.stack
                    if stack is not None and span in stack:
                        stack.remove(span)
            step.end = end
        if self._adopted:
            self._adopted.clear()
        self._cur = None
        self._in_step = False
        self._owner = None
        index = self._index = self._index + 1
        at = self._sample_at
        if index > at:  # ``at`` was sampled (and is ``index - 1``): the next one is ``every`` on
            at += self._every
            self._sample_at = at if at < self._end_step else NEVER
        return step

    def _move_to(self, index: int) -> None:
        """Make ``index`` the next step's index (``step(index=...)``)."""
        if index != self._index:
            self._index = index
            self._sample_at = _sample_at(self.config, index)

    def _clear(self) -> None:
        """Forget every open step and phase (timing is being switched off)."""
        self.sampled_owner = 0
        self._in_step = False
        self._cur = None
        self._next = None
        self._stacks.clear()
        self._adopted.clear()
        gate.set_current(None)

    # ---------------------------------------------------------------- reporting

    def fail(self, exc: BaseException) -> None:
        """Turn timing off (the session adds reporting and marshalling)."""
        self.enabled = False
        self._clear()

    def warn(self, msg: str, key: str | None = None) -> None:
        """One ``StepscopeWarning`` per ``key`` (default: the message) for this tracer."""
        key = key or msg
        if key in self._warned:
            return
        self._warned.add(key)
        warn(msg, stacklevel=3)


#: ``Recorder._sample_at`` when no later step is sampled (above any step index).
NEVER = 1 << 62


def _sample_at(config: Config, index: int) -> int:
    nxt = config.next_sampled(index)
    return NEVER if nxt is None else nxt


def _keep_collective(step: Step, item: tuple[Any, ...]) -> None:
    """Append ``item`` to the step's collectives (``None`` until its first: most steps have none)."""
    if step.collectives is None:
        step.collectives = [item]
    else:
        step.collectives.append(item)
