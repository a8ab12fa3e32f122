"""stepscope: why is my PyTorch training step slow?

Example::

    import stepscope
    stepscope.init(out_dir="runs/exp1", model=model, optimizer=opt)
    for batch in stepscope.wrap_loader(loader):
        with stepscope.step():
            loss = model(batch.to(device))
            loss.backward()
            opt.step(); opt.zero_grad()
    stepscope.finish()

The module-level functions forward to one default tracer; everything also works on an
explicit :class:`Tracer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from stepscope.common.errors import (
    AnalysisError,
    ConfigError,
    InstrumentationError,
    StepscopeError,
    StepscopeWarning,
)
from stepscope.common.version import __version__
from stepscope.phase import PhaseContext, check_phase_name

if TYPE_CHECKING:
    from stepscope.lifecycle import NullTracer
    from stepscope.recording.config import Config
    from stepscope.tracer import Tracer


def _bind_lifecycle() -> Tracer | NullTracer:
    """Import the recording side's lifecycle on first use and bind its functions here.

    ``import stepscope`` stays light this way: ``stepscope trace`` and ``report`` import the
    package for its CLI and never need the config, sinks or records modules (`import
    stepscope` 0.063 -> 0.026 s of CPU, 10 fresh processes).
    After the first call the module-level functions call lifecycle's directly.
    """
    global _current_tracer, _set_current, _Null
    from stepscope.lifecycle import NullTracer, current_tracer, set_current

    _current_tracer, _set_current, _Null = current_tracer, set_current, NullTracer
    return current_tracer()


def _unbound_set_current(tracer: Tracer | NullTracer) -> None:
    _bind_lifecycle()
    _set_current(tracer)


# Rebound to stepscope.lifecycle's by _bind_lifecycle() on the first call.
_current_tracer: Callable[[], Tracer | NullTracer] = _bind_lifecycle
_set_current: Callable[[Tracer | NullTracer], None] = _unbound_set_current
_Null: type[NullTracer] | None = None

__all__ = [
    "AnalysisError",
    "AutoProfileConfig",
    "Config",
    "ConfigError",
    "InstrumentationError",
    "NullTracer",
    "PrefetchLoader",
    "Profiler",
    "StepscopeError",
    "StepscopeWarning",
    "Tracer",
    "__version__",
    "count",
    "current",
    "finish",
    "init",
    "phase",
    "step",
    "summary",
    "wrap_h2d",
    "wrap_loader",
]


def init(
    out_dir: str = "runs/stepscope",
    model: Any = None,
    optimizer: Any = None,
    *,
    start_step: int = 0,
    end_step: int | None = None,
    every_n_steps: int = 1,
    flush_every_n_steps: int = 10,
    ranks: Iterable[int] | None = None,
    sink: str = "jsonl",
    auto: bool | Iterable[str] = True,
    enabled: bool = True,
    profile_steps: tuple[int, int] | None = None,
    log_every_n_steps: int = 0,
    auto_profile: Any = False,
    run_id: str | None = None,
    collectives: bool = True,
    heartbeat_s: float = 5.0,
    dump_stacks_after_s: float | None = None,
    flops_per_step: float | None = None,
    model_flops: str | None = None,
    peak_tflops: float | None = None,
    otel: bool = False,
    prometheus_port: int | None = None,
    prometheus_addr: str = "0.0.0.0",
    export_top_ranks: int | None = 8,
) -> Tracer | NullTracer:
    """Start recording this rank's steps; returns the tracer (a no-op one when disabled).

    Bad arguments raise ``ValueError`` (:class:`ConfigError`); trouble at run time (an
    unwritable directory, a full disk) disables timing with one warning instead. ``STEPSCOPE_*``
    environment variables override the arguments (``STEPSCOPE_DISABLE=1`` turns it off).
    An earlier default tracer is finished first.
    """
    args: dict[str, Any] = dict(
        out_dir=out_dir,
        start_step=start_step,
        end_step=end_step,
        every_n_steps=every_n_steps,
        flush_every_n_steps=flush_every_n_steps,
        ranks=ranks,
        sink=sink,
        auto=auto,
        enabled=enabled,
        profile_steps=profile_steps,
        log_every_n_steps=log_every_n_steps,
        auto_profile=auto_profile,
        run_id=run_id,
        collectives=collectives,
        heartbeat_s=heartbeat_s,
        dump_stacks_after_s=dump_stacks_after_s,
        flops_per_step=flops_per_step,
        model_flops=model_flops,
        peak_tflops=peak_tflops,
        otel=otel, prometheus_port=prometheus_port, prometheus_addr=prometheus_addr,  # [export]
        export_top_ranks=export_top_ranks,
    )
    # Imported here so `import stepscope` stays light (see _bind_lifecycle).
    from stepscope.lifecycle import create
    from stepscope.recording.config import Config, env_overrides

    args.update(env_overrides())
    config = Config(**args)
    _current_tracer().finish()
    tracer = create(config, model=model, optimizer=optimizer)
    _set_current(tracer)
    return tracer


def current() -> Tracer | NullTracer:
    """The default tracer (a no-op one before ``init()``)."""
    return _current_tracer()


def step(index: int | None = None, *, tokens: int | None = None, samples: int | None = None) -> Any:
    """Context manager around one training step of the default tracer.

    ``tokens``/``samples``: the step's batch size in tokens / samples (ints >= 0), for the
    per-step throughput. A bad count never raises: past 2^53 it is recorded as a float, anything
    else is not counted; either is warned about once.
    """
    return _current_tracer().step(index, tokens=tokens, samples=samples)


def count(name: str, n: int) -> None:
    """Add ``n`` to the current step's ``"tokens"`` or ``"samples"`` (when known only later).

    Outside a step it warns (``StepscopeWarning``) and counts nothing.
    """
    _current_tracer().count(name, n)


def phase(name: str, *, host: bool = False) -> Any:
    """Time a named region inside a step; a context manager and a decorator.

    The default tracer is looked up each time the region is entered, so a function decorated
    at import time (before ``init()``) is timed once ``init()`` has run.
    """
    tracer = _current_tracer()
    name = check_phase_name(name)
    if not (_Null is None or isinstance(tracer, _Null)):  # bound by the call above
        tracer.phase(name, host=host)  # validates the manual/automatic split now
    return PhaseContext(None, name, host, current)


def wrap_loader(loader: Any) -> Any:
    """Time the wait for each batch of ``loader`` as ``dataloader``."""
    return _current_tracer().wrap_loader(loader)


def wrap_h2d(batch: Any) -> Any:
    """Proxy whose next ``.to(device)`` is timed as ``h2d`` (manual mode)."""
    return _current_tracer().wrap_h2d(batch)


def summary() -> dict[str, Any]:
    """Recent per-phase medians of this rank as a plain dict (for ``wandb.log`` etc.)."""
    return _current_tracer().summary()


def finish() -> None:
    """Resolve pending events, flush and close the default tracer."""
    tracer = _current_tracer()
    tracer.finish()
    from stepscope.lifecycle import NullTracer  # here: `import stepscope` stays light

    _set_current(NullTracer())


def __getattr__(name: str) -> Any:
    # Imported on first use so `import stepscope` stays light (the analysis side and the
    # CLI never import torch).
    if name in ("Config", "env_overrides"):
        from stepscope.recording import config

        return getattr(config, name)
    if name in ("NullTracer", "create", "current_tracer", "set_current"):
        from stepscope import lifecycle

        return getattr(lifecycle, name)
    if name == "Tracer":
        from stepscope.tracer import Tracer

        return Tracer
    if name == "PrefetchLoader":
        from stepscope.prefetch import PrefetchLoader

        return PrefetchLoader
    if name == "AutoProfileConfig":
        from stepscope.recording.config import AutoProfileConfig

        return AutoProfileConfig
    if name == "Profiler":
        from stepscope.listeners.profiler import Profiler

        return Profiler
    raise AttributeError(f"module 'stepscope' has no attribute {name!r}")
