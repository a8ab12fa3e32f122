"""torch.profiler capture over a window of training steps, one trace file per rank.

Also :func:`unobserved`, which stepscope's own asynchronous collectives go through so that
no profiler session (ours or the user's) can be reached from a gloo thread after it stops.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from stepscope.common.errors import ConfigError, warn


def current_rank() -> int:
    """This process's rank: torch.distributed if initialised, else env ``RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # protect the job: rank detection must never fail a training run
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Run stepscope's own torch calls unseen by any RecordFunction observer (torch.profiler).

    Why this exists (a SIGSEGV right after ``profiler_stop``): a gloo
    collective issued with ``async_op=True`` while torch.profiler records on this thread
    builds an *active* RecordFunction, so the Work copies this thread's thread-local state
    (which owns the profiler's per-session state) into callbacks that a gloo worker thread
    runs when the collective executes and completes. When the peer is late, that is after
    the profiler stopped: the gloo thread writes into a record queue that ``stop()`` is
    finalising, and the Work's destructor (on whichever thread drops it) frees the state
    again. The live view's side-group all-gather is exactly such a collective, and
    auto-profiling starts and stops the profiler between them.

    RecordFunction is switched off on this thread only, for the duration of the block, so
    the Work is built with an inactive RecordFunction and captures nothing. Use it around
    every collective stepscope issues; never around user code. It is switched back on
    afterwards (torch has no getter for the flag; it is on unless a user turned it off).
    """
    import torch

    enable = torch._C._autograd._enable_record_function
    enable(False)
    try:
        yield
    finally:
        enable(True)


#: A CUDA device index, a function giving it when asked (None: unknown yet), or None.
DeviceSpec = int | Callable[[], int | None] | None


@contextlib.contextmanager
def on_device(device: DeviceSpec) -> Iterator[None]:
    """Run a torch.profiler call with ``device`` current.

    torch.profiler's stop calls ``torch.cuda.synchronize()`` (autograd.profiler.profile
    ``__exit__``; ``torch.accelerator.synchronize()`` with the CUPTI monitor) on the *current*
    device. On a rank that never called ``set_device`` that is GPU 0, whose CUDA context it
    then creates: hundreds of MB on GPU 0 from every rank. Nothing is switched when the
    device is unknown or CUDA is not available.
    """
    index = device() if callable(device) else device
    if index is None:
        yield
        return
    import torch

    if not torch.cuda.is_available() or torch.cuda.current_device() == index:
        yield
        return
    with torch.cuda.device(index):
        yield


def trace_name(rank: int, compress: bool = True) -> str:
    """The file a rank's trace is written to (not Kineto's default hostname_pid name)."""
    return f"rank{rank}.pt.trace.json" + (".gz" if compress else "")


class Profiler:
    """Capture steps ``start_step <= step < end_step`` with ``torch.profiler``.

    Steps are counted from 0 by calls to :meth:`step`, one at the end of each training step.
    The ``warmup`` steps before ``start_step`` run the profiler without recording, as
    torch.profiler recommends. On ranks not in ``ranks`` (``None`` means every rank) the
    object is a no-op, so user code needs no ``if``. ``device``: the CUDA device the
    profiler's calls run on (its stop synchronises the current device; default: whichever
    is current at the time).

    Example::

        with stepscope.Profiler("runs/x/traces", start_step=10, end_step=13) as prof:
            for batch in loader:
                train_step(batch)
                prof.step()
        # runs/x/traces/rank0.pt.trace.json.gz
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        start_step: int,
        end_step: int,
        warmup: int = 1,
        record_shapes: bool = True,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_flops: bool = True,
        ranks: Iterable[int] | None = None,
        *,
        compress: bool = True,
        device: DeviceSpec = None,
    ) -> None:
        if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
            raise ConfigError(f"out_dir must be a non-empty path; got {out_dir!r}")
        for name, v in (("start_step", start_step), ("end_step", end_step), ("warmup", warmup)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an int >= 0; got {v!r}")
        if end_step <= start_step:
            raise ConfigError(
                f"end_step must be > start_step; got start_step={start_step}, end_step={end_step}"
            )
        rank_set: frozenset[int] | None = None
        if ranks is not None:
            try:
                rank_set = frozenset(int(r) for r in ranks)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"ranks must be None or an iterable of ints; got {ranks!r}") from e
            if any(r < 0 for r in rank_set):
                raise ConfigError(f"ranks must be >= 0; got {sorted(rank_set)}")
        self.out_dir = Path(out_dir)
        self.start_step = start_step
        self.end_step = end_step
        # Warm-up steps must come before start_step; there are only start_step of them.
        self.warmup = min(warmup, start_step)
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.with_flops = with_flops
        self.compress = compress
        if device is not None and not callable(device) and (
                isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise ConfigError(f"device must be a CUDA device index >= 0 or None; got {device!r}")
        #: The CUDA device the profiler's calls run on (its stop synchronises that device).
        self.device = device
        self.rank = current_rank()
        self.enabled = rank_set is None or self.rank in rank_set
        self.trace_path = self.out_dir / trace_name(self.rank, compress)
        self.step_num = 0
        self._prof: Any = None
        self._started = False

    # -------------------------------------------------------------- lifecycle

    def start(self) -> Profiler:
        """Begin counting steps (and, when enabled, the torch.profiler schedule)."""
        if self._started:
            return self
        self._started = True
        if not self.enabled:
            return self
        try:
            self._prof = self._build()
            with on_device(self.device):
                self._prof.start()
        except Exception as exc:  # protect the job: a profiler that cannot start is skipped
            self._disable(f"torch.profiler could not start: {exc!r}")
        return self

    def step(self) -> None:
        """Mark the end of one training step."""
        self.step_num += 1
        if self._prof is None:
            return
        try:
            with on_device(self.device):  # the step that ends the window stops the profiler
                self._prof.step()
        except Exception as exc:  # protect the job: losing the trace beats losing the run
            self._disable(f"torch.profiler failed at step {self.step_num}: {exc!r}")

    def stop(self) -> None:
        """Stop; a window still recording is written out as it is."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        try:
            with on_device(self.device):
                prof.stop()
        except Exception as exc:  # protect the job
            self._disable(f"torch.profiler failed to stop: {exc!r}")

    def __enter__(self) -> Profiler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -------------------------------------------------------------- internals

    def _build(self) -> Any:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with warnings.catch_warnings():
            # A window starting at step 0 has no room for warm-up; torch warns about that
            # every time, and the caller already chose it.
            warnings.filterwarnings("ignore", message=".*warmup.*", category=UserWarning)
            sched = schedule(
                wait=self.start_step - self.warmup,
                warmup=self.warmup,
                active=self.end_step - self.start_step,
                repeat=1,
            )
        return profile(
            activities=activities,
            schedule=sched,
            on_trace_ready=self._on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
        )

    def _on_trace_ready(self, prof: Any) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # torch writes .gz itself when the name ends in .gz; write to a temporary name and
        # rename so a reader never sees a half-written trace.
        tmp = self.trace_path.with_name(".tmp." + self.trace_path.name)
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, self.trace_path)

    def _disable(self, msg: str) -> None:
        self._prof = None
        self.enabled = False
        warn(f"{msg}; profiling is off", stacklevel=3)

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return (f"Profiler(rank={self.rank}, steps=[{self.start_step}, {self.end_step}), "
                f"{state}, out={self.trace_path})")
