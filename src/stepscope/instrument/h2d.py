"""Host-to-device copies: step-scoped ``Tensor.to``/``Tensor.cuda`` timing, and ``wrap_h2d``.

While a tracer with automatic H2D timing records, ``torch.Tensor.to`` and ``torch.Tensor.cuda``
are replaced (reference counted) by versions that first read a thread-local: outside a
sampled ``step()`` on that thread they go straight to the original method (model init,
checkpoint loading and the step before a sampled one are never counted). Inside, only CPU →
accelerator copies are timed; dtype casts and CPU → CPU moves take the original path
untouched, and so does anything traced by ``torch.compile``.

The patch is a per-step instrument (:class:`StepPatch`): put on with the model's hooks, at
the end of the step before a sampled one, and taken off after it. An unsampled step between
them calls torch's own methods. Each swap assigns to ``torch.Tensor``, which invalidates
CPython's method caches: ~18 µs a swap pair (warm), 25–60 µs as a ~3 ms step leaves the
caches, paid once per sampled step; the next step's torch calls pay at most ~10 µs more to
refill them. Against that, a patched ``.to()`` costs ~5–8 µs of CPU more than torch's on
every step (two Python calls, cold). On the ~3 ms MLP with two ``.to()`` calls a step and
one step in 10 sampled (``hot_path.py --mode to-steps``, 6 paired processes): an unsampled
step ~15 µs cheaper (6 of 6 pairs), the two calls as cheap as without stepscope, the mean
over a cycle ~12 µs a step cheaper (5 of 6 pairs). With every step sampled the patch stays
on: no swap.

Once dynamo has compiled a frame in the process the patch also stays on (``off()`` keeps
it): compiled code guards on the type of ``x.to`` (a bound Python method, or torch's
builtin), so a swap would recompile it. No graph breaks either way: dynamo traces the
patched method to torch's.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from stepscope.instrument.batch import map_tensors
from stepscope.instrument.patch import SharedPatch
from stepscope.recording import gate

if TYPE_CHECKING:
    from stepscope.recording.protocols import Recorder

#: Device types a copy *to* counts as host-to-device. Tests add "meta" to drive the logic
#: on machines without an accelerator.
TARGET_DEVICE_TYPES: set[str] = {"cuda"}



class _ThreadState(threading.local):
    suppressed = False


_tls = _ThreadState()
_orig_to = torch.Tensor.to
_orig_cuda = torch.Tensor.cuda
_parse_to = torch._C._nn._parse_to
_is_compiling = torch.compiler.is_dynamo_compiling  # why not is_compiling: see hooks.py
_gate_here = gate.here


def set_step_tracer(tracer: Recorder | None) -> None:
    """Raise (tracer) or lower (None) this thread's in-step gate (see :mod:`.gate`)."""
    gate.set_current(tracer)


@contextmanager
def auto_h2d_suppressed() -> Iterator[None]:
    """Turn automatic H2D timing off on this thread (for copies timed another way)."""
    prev = _tls.suppressed
    _tls.suppressed = True
    try:
        yield
    finally:
        _tls.suppressed = prev


def _timed_copy(tracer: Recorder, src: torch.Tensor, copy: Callable[[], torch.Tensor]) -> torch.Tensor:
    token = tracer.open_phase("h2d")
    try:
        return copy()
    finally:
        tracer.close_phase(token)
        if token is not None:
            tracer.add_counter("h2d_bytes", src.numel() * src.element_size())


def _active() -> Recorder | None:
    """The recorder a host-to-device copy on this thread would be timed for now, or None."""
    # is_compiling first: while dynamo traces, it folds to True and nothing else is touched.
    if _is_compiling():
        return None
    tracer: Recorder | None = gate.current()
    if tracer is None or _tls.suppressed:
        return None
    return tracer


def _patched_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if args and isinstance(args[0], torch.dtype):  # the common dtype-only cast, fast
        return _orig_to(self, *args, **kwargs)
    # is_compiling first: while dynamo traces, it folds to True and nothing else is touched.
    # Then the gate down on this thread and no backward running: the usual case outside
    # sampled steps, decided without a call.
    if _is_compiling() or (_gate_here.raised is None and gate.backward_owner is None):
        return _orig_to(self, *args, **kwargs)
    tracer = gate.current()
    if tracer is None or _tls.suppressed or self.device.type != "cpu":
        return _orig_to(self, *args, **kwargs)
    try:
        device = _parse_to(*args, **kwargs)[0]
    except Exception:  # let torch raise its own error for bad arguments
        return _orig_to(self, *args, **kwargs)
    if device is None or device.type not in TARGET_DEVICE_TYPES:
        return _orig_to(self, *args, **kwargs)
    return _timed_copy(tracer, self, lambda: _orig_to(self, *args, **kwargs))


def _patched_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if _is_compiling() or (_gate_here.raised is None and gate.backward_owner is None):
        return _orig_cuda(self, *args, **kwargs)  # as in _patched_to
    tracer = gate.current()
    if tracer is None or _tls.suppressed or self.device.type != "cpu":
        return _orig_cuda(self, *args, **kwargs)
    return _timed_copy(tracer, self, lambda: _orig_cuda(self, *args, **kwargs))


def _apply() -> None:
    torch.Tensor.to = _patched_to  # type: ignore[method-assign,assignment]
    torch.Tensor.cuda = _patched_cuda  # type: ignore[method-assign,assignment]


def _restore() -> None:
    torch.Tensor.to = _orig_to  # type: ignore[method-assign]
    torch.Tensor.cuda = _orig_cuda  # type: ignore[method-assign]


_patch = SharedPatch(_apply, _restore)


def _dynamo_compiled() -> bool:
    """Whether dynamo has compiled a frame in this process. Compiled code guards on the type
    of ``x.to`` (a plain ``x.to(device)`` on an input does), so swapping the patch would
    recompile it: from then on the patch stays on."""
    utils = sys.modules.get("torch._dynamo.utils")  # never imported: nothing compiled yet
    if utils is None:
        return False
    try:
        return bool(utils.counters.get("frames", {}).get("ok", 0))
    except Exception:  # protect the job: unknown dynamo internals, keep the patch on
        return True


class StepPatch:
    """The patch as a per-step instrument (:class:`~stepscope.recording.protocols.PerStep`):
    installed while on (it starts on), removed while off and at :meth:`remove`. Once dynamo
    has compiled anything, ``off()`` keeps it on (see :func:`_dynamo_compiled`)."""

    __slots__ = ("_release",)

    def __init__(self) -> None:
        self._release: Callable[[], None] | None = _patch.acquire()

    def on(self) -> None:
        if self._release is None:
            self._release = _patch.acquire()

    def off(self) -> None:
        if not _dynamo_compiled():
            self._drop()

    def remove(self) -> None:
        self._drop()
        if gate.current() is not None:
            set_step_tracer(None)

    def _drop(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class H2DProxy:
    """What ``wrap_h2d(batch)`` returns: its next ``.to(...)``/``.cuda(...)`` is timed as ``h2d``.

    The call returns the moved batch itself (same nested structure: dict, list, tuple,
    namedtuple, dataclass; objects with ``.to()`` are moved with their own method; other
    leaves pass through). Any other attribute is read from the wrapped batch.

    Example::

        x = stepscope.wrap_h2d(batch).to(device, non_blocking=True)
    """

    __slots__ = ("_batch", "_tracer")

    def __init__(self, batch: Any, tracer: Recorder) -> None:
        self._batch = batch
        self._tracer = tracer

    def to(self, *args: Any, **kwargs: Any) -> Any:
        return self._move(lambda t: _orig_to(t, *args, **kwargs), "to", args, kwargs)

    def cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self._move(lambda t: _orig_cuda(t, *args, **kwargs), "cuda", args, kwargs)

    def _move(
        self, fn: Callable[[torch.Tensor], Any], method: str, args: Any, kwargs: Any
    ) -> Any:
        tracer = self._tracer
        token = tracer.open_phase("h2d")
        nbytes = 0

        def move(t: torch.Tensor) -> Any:
            nonlocal nbytes
            if t.device.type == "cpu":
                nbytes += t.numel() * t.element_size()
            return fn(t)

        def leaf(obj: Any) -> Any:
            m = getattr(obj, method, None)
            return m(*args, **kwargs) if callable(m) else obj

        try:
            with auto_h2d_suppressed():
                return map_tensors(move, self._batch, leaf=leaf)
        finally:
            tracer.close_phase(token)
            if token is not None and nbytes:
                tracer.add_counter("h2d_bytes", nbytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def __repr__(self) -> str:
        return f"H2DProxy({self._batch!r})"
