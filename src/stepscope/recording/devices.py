"""The one device resolver: which CUDA device this rank's timing, prefetching and memory are on.

``torch.cuda.current_device()`` is the wrong answer in the DDP tutorial pattern
(``model.to(rank)``, no ``torch.cuda.set_device``): every rank's current device stays 0, so
events recorded there land on GPU 0's idle stream (a context per rank on GPU 0, meaningless
times). The rank's device is, in order:

1. the device asked for explicitly (``device=``);
2. the device of the model's first CUDA parameter (or buffer);
3. ``cuda:LOCAL_RANK`` when that device exists (torchrun's one-GPU-per-rank layout; when
   ``CUDA_VISIBLE_DEVICES`` already narrowed the view, ``LOCAL_RANK`` is out of range and
   falls through);
4. the current device.

Work is then recorded on *that* device's current stream (``current_stream(index)``), never on
the current device's. When the resolved device is not the current one, one
:class:`~stepscope.common.errors.StepscopeWarning` says so: the job's own ``torch.cuda`` calls
without a device still go to the current device.

Everything here is host-side: no call creates a CUDA context on a device other than the one
resolved, and none synchronises.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

from stepscope.common.errors import warn

__all__ = ["CudaRuntime", "current_stream", "local_rank_index", "model_device_index", "resolve"]


class CudaRuntime(Protocol):
    """The three ``torch.cuda`` calls the resolver makes (tests pass fakes)."""

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def current_device(self) -> int: ...


# (resolved, current) pairs already warned about in this process: one warning each.
_warned: set[tuple[int, int]] = set()
_warned_lock = threading.Lock()


def model_device_index(model: Any) -> int | None:
    """The index of the first CUDA parameter or buffer of ``model`` (a ``torch.nn.Module``), else None."""
    if model is None:
        return None
    for getter in ("parameters", "buffers"):
        fn = getattr(model, getter, None)
        if not callable(fn):
            continue
        for t in fn():
            dev = getattr(t, "device", None)
            if dev is not None and dev.type == "cuda":
                return int(dev.index) if dev.index is not None else None
    return None


def local_rank_index(device_count: int, environ: Any = None) -> int | None:
    """``LOCAL_RANK`` when it names an existing device, else None."""
    env = os.environ if environ is None else environ
    raw = str(env.get("LOCAL_RANK", "")).strip()
    if raw.isdigit() and int(raw) < device_count:
        return int(raw)
    return None


def _explicit_index(device: Any, runtime: CudaRuntime) -> int | None:
    """The CUDA index named by ``device`` (int, "cuda:N", torch.device), None for "cuda"."""
    import torch

    if isinstance(device, bool) or not isinstance(device, int | str | torch.device):
        raise TypeError(f"device must be a torch.device, str, int or None; got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0; got {device}")
        return device
    dev = torch.device(device)  # raises RuntimeError on garbage: re-raised as ValueError below
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device to record CUDA events on; got {device!r}")
    return dev.index


def resolve(model: Any = None, device: Any = None, *, runtime: CudaRuntime | None = None,
            warn: bool = True) -> int | None:
    """The CUDA device index this rank works on, or None when CUDA is not available.

    ``model`` is the user's model (its parameters' device decides), ``device`` an explicit
    choice (int, ``"cuda:N"``, ``torch.device``) that wins over everything. With ``warn``, a
    resolved device other than the current one gives one ``StepscopeWarning`` per process.

    Example::

        index = stepscope.recording.devices.resolve(model)      # 1 on rank 1 after model.to(1)
        stream = stepscope.recording.devices.current_stream(index)
    """
    if runtime is None:
        import torch

        runtime = torch.cuda
    explicit = None
    if device is not None:
        try:
            explicit = _explicit_index(device, runtime)
        except RuntimeError as exc:
            raise ValueError(f"device {device!r} is not a device torch understands: {exc}") from None
    if not runtime.is_available():
        return None
    count = int(runtime.device_count())
    current = int(runtime.current_device())
    if explicit is not None:
        if explicit >= count:
            raise ValueError(f"device cuda:{explicit} does not exist; {count} CUDA device(s) visible")
        index, why = explicit, "asked for"
    elif (idx := model_device_index(model)) is not None:
        index, why = idx, "the model's parameters"
    elif (idx := local_rank_index(count)) is not None:
        index, why = idx, "LOCAL_RANK"
    else:
        index, why = current, "current"
    if warn and index != current:
        _warn_mismatch(index, current, why)
    return index


def _warn_mismatch(index: int, current: int, why: str) -> None:
    with _warned_lock:
        if (index, current) in _warned:
            return
        _warned.add((index, current))
    warn(f"timing on cuda:{index} ({why}) while the current CUDA device is cuda:{current}; "
         f"call torch.cuda.set_device({index}) early so the job's own device-less CUDA calls go "
         "there too", stacklevel=3)


def current_stream(index: int) -> Any:
    """The current stream of device ``index`` (where events for that device are recorded)."""
    import torch

    return torch.cuda.current_stream(index)
