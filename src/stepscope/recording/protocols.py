"""The seams of the recording core: what instruments and listeners see of it, and what it
needs of them.

- :class:`Recorder` is what an instrument (hooks, H2D, the loader wrapper, collectives, the
  prefetcher) sees: open, close or discard a phase, a side span, a counter, a collective,
  whether this step is sampled. :class:`~stepscope.recording.recorder.Recorder` implements it.
- :class:`Run` is what a listener (the live view, auto-profiling, exports, the heartbeat) sees
  of the run it observes; :class:`Listener` is what it implements (any of its methods).
- :class:`Instruments` is what the session needs of the instrument side: the face hands one
  in, so the core imports no instrument.

Instruments and listeners import these protocols (and ``stepscope.common``), never the
``Tracer`` facade.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from stepscope.recording.clock import Clock
    from stepscope.recording.config import Config
    from stepscope.recording.dist import RankInfo
    from stepscope.recording.resolver import Summarizer
    from stepscope.recording.step import Span

__all__ = ["Instruments", "Listener", "PerStep", "Recorder", "ResourceMonitor", "Run",
           "RunQueueReader"]


class Recorder(Protocol):
    """What an instrument sees: the phases, counters and collectives of the sampled step.

    ``open_phase`` returns a token (``None``: not timed) that ``close_phase`` or
    ``discard_phase`` takes. Nothing here raises into the training job: a timing error turns
    timing off (``fail``).
    """

    @property
    def clock(self) -> Clock: ...

    #: The thread that owns the open sampled step, 0 when none: what the per-step hooks
    #: compare ``threading.get_ident()`` with before asking the gate.
    sampled_owner: int

    @property
    def recording(self) -> bool:
        """True when the current step (or the next one, between steps) is sampled."""

    @property
    def in_step(self) -> bool:
        """True while a sampled step is open."""

    @property
    def step_index(self) -> int:
        """Index of the current step inside ``step()``, else of the next one."""

    def open_step_index(self) -> int | None: ...

    def current_path(self) -> str | None: ...

    def open_phase(self, name: str, host: bool = False, others: bool = True) -> Span | None: ...

    def close_phase(self, token: Span | None) -> None: ...

    def discard_phase(self, token: Span | None) -> None: ...

    def drop_unconsumed(self, token: Span | None) -> None: ...

    def add_side_span(self, name: str, start: Any, end: Any) -> None: ...

    def add_counter(self, name: str, value: float) -> None: ...

    def add_collective(
        self, op: str, pg: str, pg_size: int, nbytes: int, start: Any, end: Any,
        phase_path: str | None, *, seq: int = 0, gap: tuple[Any, Any] | None = None,
        recv_bytes: int | None = None, side: Any = None,
    ) -> None: ...

    def step_stream(self) -> Any: ...

    def add_stream_wait(self, before: Any, after: Any, joined: Any) -> None: ...

    def set_step_fields(self, fields: dict[str, Any]) -> None: ...

    def enter_autograd(self) -> bool: ...

    def leave_autograd(self) -> None: ...

    def leave_autograd_threads(self) -> None: ...

    def note_raise(self, exc: BaseException) -> None: ...

    def fail(self, exc: BaseException) -> None: ...

    def warn(self, msg: str, key: str | None = None) -> None: ...


class Run(Protocol):
    """What a listener sees of the run it observes (the session, through the face)."""

    config: Config
    rank: RankInfo
    run_id: str
    #: Observers the face attached (the profiler window, the live view, auto-profiling).
    profiler: Any
    live: Any
    autoprofile: Any

    def add_listener(self, listener: Any) -> None: ...

    def recent_records(self) -> list[dict[str, Any]]: ...

    def state(self) -> dict[str, Any]: ...

    def submit_background(self, job: Callable[[], Any]) -> None: ...

    def cuda_device(self) -> int | None: ...

    def fail(self, exc: BaseException) -> None: ...

    def warn(self, msg: str, key: str | None = None) -> None: ...

    def finish(self) -> None: ...

    def unrecorded_losses(self) -> dict[str, int]:
        """Steps lost by reason that no written record counts (the heartbeat carries them)."""
        ...


class Listener(Protocol):
    """An observer of a run. ``add_listener`` takes any object with *any* of these methods
    (and a plain callable as ``on_record``); a listener defines only those it needs.

    ``on_step_end`` and ``on_finish`` run on the training thread, ``on_record`` on the writer
    thread; ``on_exception(run, exc_type, exc, phase_stack)`` when a step raises,
    ``on_closed(run)`` after the last record was written, and ``on_stream(run, stream)`` when
    a timed phase opens on another CUDA stream than the phase before it (on the thread that
    opens it, before the phase's work is queued; it must be cheap and must not raise), are
    optional too.
    """

    def on_step_end(self, run: Run, index: int) -> None: ...

    def on_record(self, record: dict[str, Any]) -> None: ...

    def on_finish(self, run: Run) -> None: ...


class PerStep(Protocol):
    """An instrument the session puts on before a sampled step and takes off after it (on the
    training thread, between steps); ``off()`` may keep it on (a compiled model's hooks)."""

    def on(self) -> None: ...

    def off(self) -> None: ...

    def remove(self) -> None: ...


class ResourceMonitor(Protocol):
    """Per-step throughput, FLOPs, memory and device health, as the session drives it."""

    @property
    def starts_pending(self) -> bool: ...

    def on_step_start(self, index: int) -> None: ...

    def on_step_end(self, index: int) -> Any: ...

    def step_fields(
        self, index: int, start_unix_ns: int, step_ms: float, counters: dict[str, float], res: Any
    ) -> dict[str, Any]: ...

    def stop_counter(self) -> None: ...

    def close(self) -> None: ...


class RunQueueReader(Protocol):
    """The training thread's run-queue wait per step (CPU clock only)."""

    @property
    def reason(self) -> str | None: ...

    def step_end(self, thread: int | None = None, wall_ns: int | None = None) -> float | None: ...

    def close(self) -> None: ...


class Instruments(Protocol):
    """What the session needs of the instrument side; the face hands one in."""

    def install(
        self, recorder: Any, config: Config, model: Any, optimizer: Any, warn: Callable[[str], None],
    ) -> tuple[list[Callable[[], None]], set[str], list[PerStep]]:
        """Install what ``config`` asks for: ``(uninstallers, auto phases, per-step ones)``."""

    def watch_captures(self) -> tuple[Callable[[], None], Callable[[], bool]]:
        """On CUDA: ``(uninstall, capturing)``, where ``capturing()`` says whether any thread
        of the process captures a CUDA graph in global mode now."""

    def resources(self, config: Config, device: str, warn: Callable[..., None]) -> ResourceMonitor:
        """The resource monitor ``config`` asks for on ``device``."""

    def run_queue(self, clock_kind: str) -> RunQueueReader | None:
        """The run-queue reader for a clock of this kind, or ``None``."""

    @property
    def summarize_collectives(self) -> Summarizer: ...

    def blocked_in(self, thread_id: int) -> tuple[str, float] | None:
        """The collective ``thread_id`` is blocked in now (op, since when), or ``None``."""
