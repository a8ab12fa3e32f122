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

from collections.abc import Iterable
from typing import Any

from stepscope.config import Config, env_overrides
from stepscope.errors import (
    AnalysisError,
    ConfigError,
    InstrumentationError,
    StepscopeError,
    StepscopeWarning,
)
from stepscope.tracer import NullTracer, Tracer, create, current_tracer, set_current

__version__ = "0.1.0"

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
    )
    args.update(env_overrides())
    config = Config(**args)
    current_tracer().finish()
    tracer = create(config, model=model, optimizer=optimizer)
    set_current(tracer)
    return tracer


def current() -> Tracer | NullTracer:
    """The default tracer (a no-op one before ``init()``)."""
    return current_tracer()


def step(index: int | None = None) -> Any:
    """Context manager around one training step of the default tracer."""
    return current_tracer().step(index)


def phase(name: str) -> Any:
    """Time a named region inside a step; a context manager and a decorator."""
    return current_tracer().phase(name)


def wrap_loader(loader: Any) -> Any:
    """Time the wait for each batch of ``loader`` as ``dataloader``."""
    return current_tracer().wrap_loader(loader)


def wrap_h2d(batch: Any) -> Any:
    """Proxy whose next ``.to(device)`` is timed as ``h2d`` (manual mode)."""
    return current_tracer().wrap_h2d(batch)


def summary() -> dict[str, Any]:
    """Recent per-phase medians of this rank as a plain dict (for ``wandb.log`` etc.)."""
    return current_tracer().summary()


def finish() -> None:
    """Resolve pending events, flush and close the default tracer."""
    tracer = current_tracer()
    tracer.finish()
    set_current(NullTracer())


def __getattr__(name: str) -> Any:
    # Imported on first use so `import stepscope` stays light.
    if name == "PrefetchLoader":
        from stepscope.prefetch import PrefetchLoader

        return PrefetchLoader
    if name == "AutoProfileConfig":
        from stepscope.autoprofile import AutoProfileConfig

        return AutoProfileConfig
    if name == "Profiler":
        from stepscope.profiler import Profiler

        return Profiler
    raise AttributeError(f"module 'stepscope' has no attribute {name!r}")
