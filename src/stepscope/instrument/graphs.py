"""CUDA-graph captures in progress anywhere in the process, so the resolver can stay quiet.

The resolver queries CUDA events at step exit. While a CUDA graph is being captured in
``global`` mode (torch's default: ``torch.cuda.graph(..., capture_error_mode="global")``),
such a query from *any* thread is a prohibited call that invalidates the capture
(cudaStreamCaptureModeGlobal; pytorch/pytorch#104487, #105182). Another thread's capture is
invisible to ``torch.cuda.is_current_stream_capturing()``, which looks only at the calling
thread's current stream, so this module counts the global-mode captures itself: while a
tracer lives, ``torch.cuda.CUDAGraph.capture_begin`` / ``capture_end`` (which
``torch.cuda.graph`` and ``make_graphed_callables`` go through) are wrapped, reference
counted, to keep that count. A capture begun before the wrap went in is not seen.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from stepscope.instrument.patch import SharedPatch

_lock = threading.Lock()
_global_captures = 0  # global-mode captures begun and not yet ended, in any thread
_originals: dict[str, Any] = {}


def capturing_globally() -> bool:
    """True while any thread of the process captures a CUDA graph in global mode."""
    return _global_captures > 0


def probe() -> Callable[[], bool]:
    """``() -> bool``: may the resolver not query events now? True while the current stream
    is capturing (in any mode) or any thread captures in global mode."""
    import torch

    if not torch.cuda.is_available():
        return lambda: False
    current = torch.cuda.is_current_stream_capturing
    return lambda: _global_captures > 0 or current()


def _count(delta: int) -> None:
    global _global_captures
    with _lock:
        _global_captures += delta


def _apply() -> None:
    import torch

    cls = torch.cuda.CUDAGraph
    begin, end = cls.capture_begin, cls.capture_end
    _originals.update(cls=cls, capture_begin=begin, capture_end=end)

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode = kwargs.get("capture_error_mode", args[1] if len(args) > 1 else "global")
        counted = mode == "global"
        if counted:
            _count(1)  # before the capture begins: no query may slip in between
        try:
            out = begin(self, *args, **kwargs)
        except BaseException:
            if counted:
                _count(-1)
            raise
        self._stepscope_global = counted
        return out

    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return end(self, *args, **kwargs)
        finally:
            if getattr(self, "_stepscope_global", False):
                self._stepscope_global = False
                _count(-1)

    setattr(cls, "capture_begin", capture_begin)  # noqa: B010 (a patch of torch's class)
    setattr(cls, "capture_end", capture_end)  # noqa: B010


def _restore() -> None:
    cls = _originals.pop("cls", None)
    if cls is None:
        return
    setattr(cls, "capture_begin", _originals.pop("capture_begin"))  # noqa: B010
    setattr(cls, "capture_end", _originals.pop("capture_end"))  # noqa: B010


_PATCH = SharedPatch(_apply, _restore)


def install_patch() -> Callable[[], None]:
    """Start counting global-mode captures; returns the remover (reference counted)."""
    return _PATCH.acquire()
