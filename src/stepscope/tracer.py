"""Tracer: the public face of a recording run on one rank.

``Tracer`` is the :class:`~stepscope.recording.session.Session` (resolver, writer, listeners,
instruments, failures) over the :class:`~stepscope.recording.recorder.Recorder` (marks, steps,
per-thread phase stacks, the recorder protocol instruments call), plus the user-facing API:
``step()``, ``phase()``, ``count()``, ``wrap_loader()``, ``wrap_h2d()``, ``summary()``.

This is the face: it hands the session the automatic instruments
(:data:`~stepscope.instrument.install.AUTOMATIC`) and attaches the observers the config asks
for (:func:`wire`); the recording core imports neither.

Steps belong to the thread that opened them. A ``step()`` nested in another, or opened by a
second thread while one is open, is not timed and warns once: the job is never interrupted.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from stepscope.common import escape
from stepscope.common.errors import InstrumentationError
from stepscope.instrument import unwrap
from stepscope.instrument.h2d import H2DProxy
from stepscope.instrument.install import AUTOMATIC
from stepscope.instrument.loader import TimedLoader
from stepscope.instrument.resource_sampler import check_count, check_counts, shown_value, warn_outside_step
from stepscope.listeners.autoprofile import attach_autoprofile
from stepscope.listeners.export import attach_exporters
from stepscope.listeners.heartbeat import attach_heartbeat
from stepscope.listeners.live import attach_live, local_summary
from stepscope.listeners.profiler import Profiler
from stepscope.phase import PhaseContext, check_phase_name
from stepscope.recording import devices
from stepscope.recording.clock import Clock, default_clock
from stepscope.recording.config import Config
from stepscope.recording.dist import RankInfo, agree_at_init, rank_info
from stepscope.recording.session import FINISH_TIMEOUT_S, RECENT_RECORDS, Session
from stepscope.recording.sinks import Sink

__all__ = ["FINISH_TIMEOUT_S", "RECENT_RECORDS", "PhaseContext", "Tracer", "check_phase_name", "wire"]


class _StepContext:
    """What ``step()`` returns. Each tracer gets its own subclass (:func:`_step_context`) whose
    ``__enter__``/``__exit__`` are the tracer's bound step entry and exit themselves: the
    ``with`` statement calls them directly, one Python frame fewer at each step boundary."""

    __slots__ = ("_tracer",)

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def __enter__(self) -> _StepContext:
        self._tracer._enter_step()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._tracer._exit_step(exc_type, exc, tb)


def _step_context(tracer: Tracer) -> _StepContext:
    # A bound method is no descriptor: looked up on the class, it is called as it is, so the
    # with statement's (exc_type, exc, tb) go straight to Session._exit_step.
    cls = type("_StepContext", (_StepContext,), {
        "__slots__": (), "__enter__": tracer._enter_step, "__exit__": tracer._exit_step,
    })
    return cls(tracer)  # type: ignore[no-any-return]


class Tracer(Session):
    """Times the phases of each training step on one rank and records sampled steps.

    Example::

        tracer = stepscope.Tracer(Config(out_dir="runs/a"), model=model, optimizer=opt)
        for batch in tracer.wrap_loader(loader):
            with tracer.step():
                ...
        tracer.finish()
    """

    def __init__(
        self,
        config: Config,
        *,
        model: Any = None,
        optimizer: Any = None,
        clock: Clock | None = None,
        sink: Sink | None = None,
        rank: RankInfo | None = None,
    ) -> None:
        model, optimizer = unwrap.module(model), unwrap.optimizer(optimizer)  # framework wrappers
        check_targets(model, optimizer)
        #: What the recording ranks agreed at init: one run id, and whether the live side group
        #: exists (created on every member or on none, whatever each rank's config says).
        self.agreement = agree_at_init(
            run_id=config.run_id, ranks=config.ranks,
            # Exports rank the ranks through the exchange (which publish per-rank series).
            wants_side_group=bool(config.log_every_n_steps or config.auto_profile or config.otel
                                  or config.prometheus_port is not None),
        )
        super().__init__(
            config,
            # One device resolver (the model's device, else LOCAL_RANK, else current) picks the
            # device whose current stream the events go to.
            clock if clock is not None else default_clock(devices.resolve(model)),
            rank if rank is not None else rank_info(),
            self.agreement.run_id,
            sink,
            AUTOMATIC,
        )
        self._step_cm: _StepContext = _step_context(self)
        self._start(model, optimizer, wire)

    def step(
        self, index: int | None = None, *, tokens: int | None = None, samples: int | None = None
    ) -> _StepContext:
        """Context manager around one optimizer step; ``index`` overrides the step counter.

        ``tokens``/``samples`` (non-negative ints) give the step's throughput numbers.
        A bad count or index never raises: it is warned about once and not used.
        """
        # Checked at the call, applied when the step opens.
        self._step_counts = (None if tokens is None and samples is None
                             else check_counts(tokens, samples, self.warn))
        if index is not None:
            if type(index) is not int or not 0 <= index <= MAX_STEP_INDEX:
                index = _step_index(index, self.warn)
            if index is not None and not self._in_step:
                self._move_to(index)
        return self._step_cm

    def phase(self, name: str, *, host: bool = False) -> PhaseContext:
        """A user-named (or manual canonical) phase: a context manager and a decorator.

        ``host=True`` marks a phase with no GPU work of its own (waiting on a queue, a file,
        a remote service): on GPU its record carries the host time too (``host_ms``).
        Opened outside a step, only ``dataloader`` and ``h2d`` are timed (for the next step).
        """
        name = check_phase_name(name)
        if name in self._auto_active:
            raise InstrumentationError(
                f"phase {name!r} is already timed automatically; time it either automatically "
                f"or with phase({name!r}), not both (pass auto=False or auto={{...}} without "
                f"{name!r} to init() to time it manually)"
            )
        return PhaseContext(self, name, host)

    def count(self, name: str, n: int) -> None:
        """Add ``n`` (int >= 0) to the open step's ``tokens``/``samples`` (or any counter).

        Outside a step: a warning, nothing counted.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"counter name must be a non-empty string; got {name!r}")
        name = escape.name(name)
        value = check_count(name, n, self.warn)
        if value is None:
            return
        if not self._in_step:
            warn_outside_step(name)
            return
        cur = self._cur
        if cur is not None:
            cur.counters[name] = cur.counters.get(name, 0) + value

    def wrap_loader(self, loader: Iterable[Any]) -> Any:
        """Time the wait for each next batch as ``dataloader``."""
        if "dataloader" not in self.config.auto:
            raise InstrumentationError(
                "wrap_loader() times 'dataloader' automatically, but 'dataloader' is not in "
                "auto; use phase('dataloader') instead or enable it"
            )
        self._auto_active.add("dataloader")
        return TimedLoader(loader, self)

    def wrap_h2d(self, batch: Any) -> Any:
        """Return a proxy whose next ``.to(device)``/``.cuda()`` is timed as ``h2d``."""
        if "h2d" in self._auto_active:
            raise InstrumentationError(
                "wrap_h2d() times 'h2d' manually, but host-to-device copies are already timed "
                "automatically; pass auto=False (or an auto set without 'h2d') to init()"
            )
        return H2DProxy(batch, self)

    def cuda_device(self) -> int | None:
        """The CUDA device this tracer times: the resolved one, else the one of its first mark
        (None before that, and without CUDA). What anything that must run a CUDA call on
        the rank's own device (a profiler's synchronize) asks."""
        index = getattr(self.clock, "device_index", None)
        return index if isinstance(index, int) and not isinstance(index, bool) else None

    def summary(self) -> dict[str, Any]:
        """Per-phase medians over the records resolved so far on this rank (plain dict).

        Called between steps on the training thread, it first waits (at most
        ``sinks.DELIVERY_BOUND_S``) for the writer thread to build the records handed to it.
        """
        self.settle()

        return local_summary(self)


#: Largest step index taken from ``step(index)`` (exact as a float in every JSON reader).
MAX_STEP_INDEX = 1 << 53


def _step_index(index: Any, warn_once: Callable[[str, str], None]) -> int | None:
    """``step(index)`` as an int (numpy ints too), or ``None`` (warned once: the step counter
    goes on): a bad index must never stop the training job."""
    if (isinstance(index, numbers.Integral) and not isinstance(index, bool)
            and 0 <= int(index) <= MAX_STEP_INDEX):
        return int(index)
    warn_once(f"step index must be an int in 0..2^53; got {shown_value(index)} "
              f"({type(index).__name__}); the step counter is used instead", "step-index")
    return None


def check_targets(model: Any, optimizer: Any) -> None:
    """``ValueError`` unless ``model`` is a ``torch.nn.Module`` (or None) and ``optimizer`` a
    ``torch.optim.Optimizer`` (or None)."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or None; got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__name__}"
        )


class _StepProfiler:
    """Drives a ``profile_steps`` window of :class:`stepscope.Profiler` from step boundaries."""

    def __init__(self, prof: Any) -> None:
        self.prof = prof

    def on_step_end(self, tracer: Any, index: int) -> None:
        self.prof.step()

    def on_finish(self, tracer: Any) -> None:
        self.prof.stop()


def wire(tracer: Tracer) -> None:
    """Attach the observers ``tracer.config`` asks for (a ``profile_steps`` profiler, the live
    view, auto-profiling, exports, the heartbeat) as listeners; called once from
    ``Tracer.__init__``."""
    config = tracer.config
    if config.profile_steps is not None:
        start, end = config.profile_steps
        prof = Profiler(
            out_dir=os.path.join(config.out_dir, "traces"), start_step=start, end_step=end,
            ranks=config.ranks, device=tracer.cuda_device,
        )
        prof.start()
        tracer.profiler = prof
        tracer.add_listener(_StepProfiler(prof))
    if config.log_every_n_steps or tracer.agreement.side_group:  # every member exchanges, even silent ones
        attach_live(tracer)
    if config.auto_profile:
        attach_autoprofile(tracer)
    if config.otel or config.prometheus_port is not None:  # [export] after the live view
        attach_exporters(tracer)
    if config.heartbeat_s and tracer.writes_files:
        attach_heartbeat(tracer)
