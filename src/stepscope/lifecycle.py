"""Lifecycle: building a tracer from a config, the default tracer, and ``meta.json``.

``init()`` → :func:`create` → a :class:`~stepscope.tracer.Tracer` (or the no-op
:class:`NullTracer` when disabled or filtered out by ``ranks=``); the tracer wires the
observers the config asks for (:func:`stepscope.tracer.wire`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stepscope.common.errors import warn
from stepscope.common.version import __version__
from stepscope.recording.config import Config
from stepscope.recording.dist import rank_info
from stepscope.recording.schema import SCHEMA_VERSION
from stepscope.recording.sinks import Sink, write_json_atomic

if TYPE_CHECKING:
    from stepscope.recording.clock import Clock
    from stepscope.tracer import Tracer

F = TypeVar("F", bound=Callable[..., Any])


class NullTracer:
    """What a disabled (or filtered-out rank's) ``init()`` returns: every call is a no-op."""

    enabled = False
    recording = False
    in_step = False
    step_index = 0
    live = None
    autoprofile = None
    profiler = None

    class _Null:
        __slots__ = ()

        def __enter__(self) -> NullTracer._Null:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def __call__(self, fn: F) -> F:
            return fn

    _NULL = _Null()

    def step(
        self, index: int | None = None, *, tokens: int | None = None, samples: int | None = None
    ) -> NullTracer._Null:
        return self._NULL

    def cuda_device(self) -> int | None:
        return None

    def count(self, name: str, n: int) -> None:
        return None

    def phase(self, name: str, *, host: bool = False) -> NullTracer._Null:
        return self._NULL

    def wrap_loader(self, loader: Any) -> Any:
        return loader

    def wrap_h2d(self, batch: Any) -> Any:
        return batch

    def open_phase(self, name: str, host: bool = False) -> None:
        return None

    def close_phase(self, token: Any) -> None:
        return None

    def discard_phase(self, token: Any) -> None:
        return None

    def drop_unconsumed(self, token: Any) -> None:
        return None

    def add_side_span(self, name: str, start: Any, end: Any) -> None:
        return None

    def add_counter(self, name: str, value: float) -> None:
        return None

    def add_collective(self, *args: Any, **kwargs: Any) -> None:
        return None

    def set_step_fields(self, fields: dict[str, Any]) -> None:
        return None

    def current_path(self) -> None:
        return None

    def add_listener(self, listener: Any) -> None:
        return None

    def add_uninstaller(self, fn: Callable[[], None]) -> None:
        return None

    def submit_background(self, job: Callable[[], Any]) -> None:
        return None

    def recent_records(self) -> list[dict[str, Any]]:
        return []

    def state(self) -> dict[str, Any]:
        return {}

    def summary(self) -> dict[str, Any]:
        return {}

    def fail(self, exc: BaseException) -> None:
        return None

    def warn(self, msg: str, key: str | None = None) -> None:
        return None

    def flush(self) -> None:
        return None

    def note_raise(self, exc: BaseException) -> None:
        return None

    def finish(self) -> None:
        return None


NULL_TRACER = NullTracer()
_current: Tracer | NullTracer = NULL_TRACER


def current_tracer() -> Tracer | NullTracer:
    """The default tracer the module-level functions forward to."""
    return _current


def set_current(tracer: Tracer | NullTracer) -> None:
    global _current
    _current = tracer


def create(
    config: Config,
    *,
    model: Any = None,
    optimizer: Any = None,
    clock: Clock | None = None,
    sink: Sink | None = None,
) -> Tracer | NullTracer:
    """Build the tracer ``init()`` asks for, or a no-op one, never raising for runtime trouble.

    Bad arguments were already rejected by ``Config``; what can still go wrong here (an
    unwritable directory, a broken CUDA runtime) disables timing with one warning.
    """
    # Imported here, not at the top: the tracer needs torch, and this module is imported by
    # ``stepscope.phase()``/``current()`` before any init(), which must stay light.
    from stepscope.tracer import Tracer, check_targets

    check_targets(model, optimizer)
    if not config.enabled:
        return NULL_TRACER
    info = rank_info()
    if config.ranks is not None and info.rank not in config.ranks:
        return NULL_TRACER
    try:
        if sink is None:
            Path(config.out_dir).mkdir(parents=True, exist_ok=True)
        tracer = Tracer(config, model=model, optimizer=optimizer, clock=clock, sink=sink, rank=info)
        if sink is None and info.rank == (min(config.ranks) if config.ranks else 0):
            write_json_atomic(Path(config.out_dir) / "meta.json", meta(tracer))
        return tracer
    except Exception as exc:  # protect the job: a bad runtime environment disables timing
        warn(f"timing disabled, could not start: {exc!r}", stacklevel=3)
        return NULL_TRACER


def meta(tracer: Tracer) -> dict[str, Any]:
    """``meta.json``: the run's configuration, versions, devices, and what the times mean."""
    import platform

    import torch

    devices: list[str] = []
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "schema": SCHEMA_VERSION,
        "run_id": tracer.run_id,
        "created_unix_ns": time.time_ns(),
        "world_size": tracer.rank.world_size,
        "hostname": tracer.rank.hostname,
        "clock": tracer.clock.kind,
        "timeline": {
            "start_unix_ns": "host wall clock (time.time_ns) when the step was entered on the host",
            "gpu_start_unix_ns": (
                "CUDA clock only: when the GPU ran the step's start event, on the wall clock "
                "(lower-bound anchor: host time at record minus GPU offset, max over recent steps)"
            ),
            "phase start_ms/end_ms": "offsets from the step start on the record's clock",
            "host_ms": "host wall time of phases with no GPU work of their own (dataloader, host=True)",
        },
        "config": tracer.config.to_json(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "devices": devices,
        "python": platform.python_version(),
        "stepscope": __version__,
    }
