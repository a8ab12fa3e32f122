"""PrefetchLoader: copy the next batch to the GPU on a side stream while this one computes."""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from stepscope import lifecycle
from stepscope.common.errors import warn
from stepscope.instrument.batch import iter_tensors, map_tensors
from stepscope.instrument.h2d import auto_h2d_suppressed
from stepscope.recording.devices import resolve

__all__ = ["PrefetchLoader"]

DeviceLike = torch.device | str | int


class PrefetchLoader:
    """Wrap an iterable of batches so batch N+1 is copied to the GPU while batch N computes.

    Nested batches (dict/Mapping, list, tuple, namedtuple, dataclass, objects with
    ``.to()``) are moved leaf by leaf on one dedicated copy stream per loader; the
    consuming stream waits on an event, so the host never blocks. Iteration semantics
    are those of the wrapped loader: same batches, same order, ``len()`` forwarded,
    source exceptions re-raised unchanged at their turn. Without CUDA, or with a CPU
    target, it is a pass-through. When stepscope is recording, each step gets the
    exposed wait (``h2d``), the copy time on the copy stream (``h2d_copy``) and the
    bytes copied (``h2d_bytes``).

    A batch is ready on the stream that is current when it is handed over (the ``for``
    statement's ``next()``) and, while stepscope records, on every other stream a timed phase
    of the step runs on (``with torch.cuda.stream(s): with stepscope.phase("work"): ...``, or
    a model whose forward is timed): that stream waits for the copy when the phase opens, and
    for every later batch's copy at hand-over. Work on another stream that stepscope does not
    see (no phase around it, or stepscope not recording) may read a batch before its copy
    ended: iterate inside ``with torch.cuda.stream(s):``, or make that stream wait first
    (``s.wait_stream(torch.cuda.current_stream())``). Each handed-over batch is kept alive
    until every stream it was made ready on has passed its last use, so its memory is never
    reused while a kernel there still reads it.

    Example::

        loader = DataLoader(dataset, batch_size=64, num_workers=4, pin_memory=True)
        for batch in stepscope.PrefetchLoader(loader):   # batch already on the GPU
            loss = model(batch["x"]).loss
            ...
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: DeviceLike | None = None,
        non_blocking: bool = True,
        pin_memory: bool = True,
        *,
        tracer: Any = None,
        _backend: Any = None,
    ) -> None:
        if not isinstance(loader, Iterable):
            raise TypeError(f"loader must be an iterable of batches, got {type(loader).__name__}")
        if device is not None and not isinstance(device, (torch.device, str, int)):
            raise TypeError(f"device must be a torch.device, str, int or None, got {device!r}")
        self.loader = loader
        self.non_blocking = non_blocking
        self.pin_memory = pin_memory
        self._device_arg = device
        self._tracer = tracer
        self._backend = _backend if _backend is not None else _CudaBackend()
        self._device: torch.device | None = None
        # One copy stream per device, created on first use and reused across epochs:
        # a stream per epoch keeps growing the allocator's reserved memory (timm #2781).
        self._streams: dict[torch.device, Any] = {}
        # The step-end listener on the tracer (one per loader and tracer; see _StepEndHook).
        self._hook: tuple[weakref.ref[Any], _StepEndHook] | None = None
        self._warned: set[str] = set()

    @property
    def device(self) -> torch.device:
        """The target device, resolved on first use (after the user had a chance to set it)."""
        if self._device is None:
            self._device = self._resolve_device(self._tracer)
        return self._device

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Forward dataset/sampler/batch_size etc., so `loader.sampler.set_epoch(e)` works.
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        tracer = self._tracer
        if self._device is None and self._backend.is_available():
            tracer = tracer if tracer is not None else _current_tracer()
            self._device = self._resolve_device(tracer)
        device = self.device
        if device.type == "cuda" and self._backend.is_available():
            tracer = tracer if tracer is not None else _current_tracer()
            return _CudaPrefetchIter(self, device, self._copy_stream(device), tracer)
        return _PassIter(iter(self.loader), device, self.non_blocking)

    # ----------------------------------------------------------------- internals

    def _resolve_device(self, tracer: Any) -> torch.device:
        be = self._backend
        arg = self._device_arg
        if arg is None:
            if not be.is_available():
                return torch.device("cpu")
            arg = "cuda"
        dev = torch.device("cuda", arg) if isinstance(arg, int) else torch.device(arg)
        if dev.type == "cuda" and not be.is_available():
            # Same script on a CPU-only machine: a pass-through, so the job still runs.
            return torch.device("cpu")
        if dev.type == "cuda" and dev.index is None:
            # The tracer's device (resolved from the model) when it has one, else the one
            # resolver's answer (LOCAL_RANK, else current): batches go where timing is.
            index = getattr(getattr(tracer, "clock", None), "device_index", None)
            if not isinstance(index, int) or isinstance(index, bool):
                index = resolve(runtime=be)
            dev = torch.device("cuda", index if index is not None else int(be.current_device()))
        return dev

    def _step_end_hook(self, tracer: Any) -> _StepEndHook | None:
        """This loader's listener on ``tracer`` (added once), or None when it takes none."""
        add = getattr(tracer, "add_listener", None)
        if not callable(add) or not getattr(tracer, "enabled", False):
            return None
        if self._hook is not None and self._hook[0]() is tracer:
            return self._hook[1]
        hook = _StepEndHook()
        add(hook)
        self._hook = (weakref.ref(tracer), hook)
        return hook

    def _warn_once(self, key: str, msg: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warn(f"PrefetchLoader: {msg}", stacklevel=4)

    def _copy_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            with self._backend.device(device):
                stream = self._backend.new_stream(device)
            self._streams[device] = stream
        return stream


def _current_tracer() -> Any:
    return lifecycle.current_tracer()  # looked up at each call: tests replace it


class _PassIter:
    """CPU / non-CUDA target: the source's own iterator, batches moved only if needed."""

    def __init__(self, src: Iterator[Any], device: torch.device, non_blocking: bool) -> None:
        self._src = src
        self._device = device
        self._non_blocking = non_blocking

    def __iter__(self) -> _PassIter:
        return self

    def __next__(self) -> Any:
        batch = next(self._src)
        dev = self._device
        if all(t.device == dev for t in iter_tensors(batch)):
            return batch  # the very same object: a true pass-through
        return map_tensors(
            lambda t: t if t.device == dev else t.to(dev, non_blocking=self._non_blocking), batch
        )


@dataclass
class _Staged:
    """A batch whose copy has been queued on the copy stream."""

    batch: Any
    done: Any  # event recorded on the copy stream after the last copy
    start: Any | None  # timing start event, only when a tracer was enabled
    nbytes: int
    keepalive: list[Any] = field(default_factory=list)  # pinned sources of the copies


@dataclass
class _Failed:
    exc: Exception


_END = object()
#: Side streams a loader remembers making batches ready on (see _CudaPrefetchIter.on_stream).
_MAX_READERS = 8


class _CudaPrefetchIter:
    """One epoch: batch N is handed over while batch N+1 is already being copied.

    When batch N+1 is fetched and its copy queued:

    * in a loop with one stepscope step per batch (``for b in loader: with step(): ...``),
      when step N ends (a listener on the tracer). The fetch then falls between step N and
      step N+1, so a ``dataloader`` wait timed around it (``PrefetchLoader(wrap_loader(...))``)
      is batch N+1's and goes to step N+1, batch 0's to step 0; and the caller has dropped
      batch N-1 by then, so at most two batches (N and N+1) live on the device;
    * otherwise (no tracer, timing off, several batches per step, a loop without steps), right
      after handing batch N over, before it is returned: the caller still holds batch N-1
      while N+1 is allocated, so up to three batches live on the device for a moment.
    """

    def __init__(self, owner: PrefetchLoader, device: torch.device, stream: Any, tracer: Any) -> None:
        self._closed = True  # until the source iterator exists, there is nothing to close
        self._owner = owner
        self._be = owner._backend
        self._device = device
        self._stream = stream
        self._tracer = tracer
        self._pending: _Staged | _Failed | object | None = None
        # Copies handed over but maybe still running: their pinned sources stay alive here.
        self._inflight: deque[tuple[Any, list[Any]]] = deque()
        #: The batch handed over last (its device memory), its copy's end event, and the
        #: streams it was made ready on (the consumer stream first).
        self._current: tuple[Any, Any, list[Any]] | None = None
        #: Other streams timed phases ran on (see on_stream): each later batch is made ready
        #: on them too. Bounded: a job that makes a stream per step must not grow it.
        self._readers: deque[Any] = deque(maxlen=_MAX_READERS)
        #: Handed-over batches kept alive until the consumer stream passed an event recorded
        #: after their last use (see _retire_current).
        self._in_use: deque[tuple[Any, Any]] = deque()
        hook = owner._step_end_hook(tracer)
        if hook is not None:
            hook.it = weakref.ref(self)
        self._hooked = hook is not None
        self._deferred = False  # batch N+1 waits for the step end (see the class doc)
        self._no_steps = False  # a deferral saw no step end: stage at hand-over from now on
        self._src: Iterator[Any] | None = iter(owner.loader)
        self._closed = False

    def __iter__(self) -> _CudaPrefetchIter:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        # Our copies are timed on the copy stream; the automatic Tensor.to timing must not
        # count them a second time as exposed H2D.
        with self._be.device(self._device), auto_h2d_suppressed():
            self._release_finished()
            if self._deferred and self._pending is None:
                self._no_steps = True  # no step ended since the last batch: not step-per-batch
            self._deferred = False
            cur = self._pending if self._pending is not None else self._stage()
            self._pending = None
            if cur is _END:
                self.close()
                raise StopIteration
            if isinstance(cur, _Failed):
                # Raised at the failing batch's turn; the next call asks the source again,
                # exactly as a caller iterating the source itself would.
                raise cur.exc
            assert isinstance(cur, _Staged)
            consumer = self._be.current_stream(self._device)
            self._hand_over(cur, consumer)
            tracer = self._tracer
            if (self._hooked and not self._no_steps and getattr(tracer, "enabled", False)
                    and not getattr(tracer, "in_step", False)):
                self._deferred = True  # queued when this batch's step ends (on_step_end)
            else:
                # Queue batch N+1's copy now so it runs while the caller computes on batch N.
                self._pending = self._stage()
            return cur.batch

    def on_step_end(self) -> None:
        """A step ended (training thread): fetch the next batch and queue its copy now."""
        if self._closed or not self._deferred or self._pending is not None:
            return
        self._deferred = False
        try:
            with self._be.device(self._device), auto_h2d_suppressed():
                self._release_finished()
                self._pending = self._stage()
        except Exception as exc:  # not swallowed: re-raised at this batch's turn in __next__
            self._pending = _Failed(exc)

    def on_stream(self, stream: Any) -> None:
        """A timed phase opened on ``stream`` (any thread, before its work is queued): make
        the batch in use ready there too, and every later batch."""
        cur = self._current
        if cur is None or self._closed:
            return
        _batch, done, ready = cur
        if stream in ready:
            return
        stream.wait_event(done)
        ready.append(stream)
        if stream not in self._readers:
            self._readers.append(stream)

    def close(self) -> None:
        """End the epoch: drop the prefetched batch, wait out copies still reading pinned memory."""
        if self._closed:
            return
        self._closed = True
        pending, self._pending, self._src = self._pending, None, None
        if isinstance(pending, _Staged):
            self._inflight.append((pending.done, pending.keepalive))
        self._retire_current()
        # Batches still in use are let go without waiting: the next copy on this stream (the
        # next epoch's, the only allocations that may reuse their memory) waits for their
        # last use on the GPU instead. One wait per epoch, no host sync.
        while self._in_use:
            used, _batch = self._in_use.popleft()
            if not used.query():
                self._stream.wait_event(used)
        while self._inflight:
            done, _keep = self._inflight.popleft()
            if not done.query():
                # Sync point, only at epoch end or `break`: a pinned source must outlive
                # the copy reading it; waiting one batch copy keeps nothing in flight.
                done.synchronize()

    def __del__(self) -> None:
        # `break` out of a for loop drops the iterator: free the prefetched batch now.
        if not getattr(self, "_closed", True):
            self.close()

    # ----------------------------------------------------------------- internals

    def _release_finished(self) -> None:
        # query() never blocks: sources are dropped as soon as their copy is seen done.
        while self._inflight and self._inflight[0][0].query():
            self._inflight.popleft()
        in_use = self._in_use
        while in_use and in_use[0][0].query():  # in order of recording
            in_use.popleft()

    def _retire_current(self) -> None:
        """The last handed-over batch stays alive until the consumer stream has run every
        kernel queued so far (an event recorded now): the caching allocator gives a freed
        block to the next allocation on the copy stream at once, so a batch the caller drops
        while its kernels are still queued would otherwise be overwritten by a later copy.
        The same guarantee as ``Tensor.record_stream(consumer)`` for every leaf, for any
        batch type (objects with their own ``.to()`` included), and read by the same one
        non-blocking query per step as the copies."""
        cur, self._current = self._current, None
        if cur is None:
            return
        batch, _done, streams = cur
        for stream in streams:  # the consumer, and every other stream it was made ready on
            used = self._be.new_event(enable_timing=False)
            used.record(stream)
            self._in_use.append((used, batch))

    def _stage(self) -> _Staged | _Failed | object:
        assert self._src is not None
        try:
            raw = next(self._src)
        except StopIteration:
            return _END
        except Exception as exc:  # not swallowed: re-raised unchanged at this batch's turn
            return _Failed(exc)
        be, dev, stream, owner = self._be, self._device, self._stream, self._owner
        try:
            # Pin first, on the host, so the copy span below times the copies alone.
            src = map_tensors(self._pinned, raw, leaf=self._pinned_object) if owner.pin_memory else raw
        except Exception as exc:  # e.g. pinned OOM: batch N still goes out, this one fails
            return _Failed(exc)
        # Time every copy while a tracer lives; whether it is reported is decided at
        # hand-over, for the step that consumes the batch (sampling may differ by then).
        timing = bool(getattr(self._tracer, "enabled", False))
        # The copy stream waits for nothing on the consumer stream: that wait would order
        # this copy after every kernel queued so far (all of the current step's, when the
        # batch is staged at a step end), so nothing would overlap. Reuse safety comes from
        # keeping each handed-over batch alive until the consumer stream has passed its last
        # use (see _hand_over): its memory returns to the copy stream's pool only then.
        start = be.new_event(enable_timing=True) if timing else None
        done = be.new_event(enable_timing=timing)
        keep: list[Any] = []
        nbytes = 0

        def copy(t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes
            if be.is_on(t, dev):
                return t
            if t.device.type == "cpu" and owner.non_blocking and not be.is_pinned(t):
                owner._warn_once("pageable", "a batch tensor is not in pinned memory "
                                 "(pin_memory=False): its copy blocks the host until the GPU has "
                                 "caught up, so nothing overlaps. Pass pin_memory=True (or pin in "
                                 "the DataLoader).")
            keep.append(t)
            nbytes += t.numel() * t.element_size()
            return be.copy(t, dev, owner.non_blocking)

        def other(obj: Any) -> Any:
            to = getattr(obj, "to", None)
            if not callable(to):
                return obj
            if owner.non_blocking and not owner.pin_memory:
                owner._warn_once("pageable-object", f"{type(obj).__qualname__} is moved by its own "
                                 ".to() from pageable memory (pin_memory=False): the copy blocks the "
                                 "host. Pass pin_memory=True.")
            keep.append(obj)
            return to(dev, non_blocking=owner.non_blocking)

        with be.stream(stream):
            if start is not None:
                start.record(stream)
            try:
                batch = map_tensors(copy, src, leaf=other)
            except Exception as exc:  # a failing .to() or device OOM: deferred to its turn too
                done.record(stream)
                self._inflight.append((done, keep))
                return _Failed(exc)
            done.record(stream)
        return _Staged(batch, done, start, nbytes, keep)

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        be = self._be
        if be.is_on(t, self._device) or t.device.type != "cpu" or be.is_pinned(t):
            return t  # already pinned (e.g. DataLoader pin_memory=True): used as it is
        return be.pin(t)

    def _pinned_object(self, obj: Any) -> Any:
        """An object with its own ``.to()``: pinned through its ``pin_memory()`` (the
        DataLoader's protocol for custom batch types), else copied from pageable memory."""
        if not callable(getattr(obj, "to", None)):
            return obj
        pin = getattr(obj, "pin_memory", None)
        if callable(pin):
            return pin()
        self._owner._warn_once(
            f"object:{type(obj).__qualname__}",
            f"{type(obj).__qualname__} has .to() but no pin_memory(): its copy is from pageable "
            "memory and blocks the host. Give it a pin_memory() method (as DataLoader "
            "pin_memory=True expects) or return plain tensors.")
        return obj

    def _hand_over(self, cur: _Staged, consumer: Any) -> None:
        # Everything queued for the previous batch is on the consumer stream by now.
        self._retire_current()
        ready = [consumer]
        self._current = (cur.batch, cur.done, ready)
        tracer = self._tracer
        if tracer.recording:
            token = tracer.open_phase("h2d")
            consumer.wait_event(cur.done)
            tracer.close_phase(token)
            if cur.start is not None:
                tracer.add_side_span("h2d_copy", cur.start, cur.done)
            tracer.add_counter("h2d_bytes", cur.nbytes)
        else:
            consumer.wait_event(cur.done)
        for stream in self._readers:  # streams earlier steps' phases ran on
            if stream not in ready:
                stream.wait_event(cur.done)
                ready.append(stream)
        self._inflight.append((cur.done, cur.keepalive))
        cur.keepalive = []


class _StepEndHook:
    """A tracer listener forwarding step ends to the loader's current epoch (weakly held)."""

    def __init__(self) -> None:
        self.it: weakref.ref[_CudaPrefetchIter] | None = None

    def on_step_end(self, tracer: Any, index: int) -> None:
        it = self.it() if self.it is not None else None
        if it is not None:
            it.on_step_end()

    def on_stream(self, tracer: Any, stream: Any) -> None:
        it = self.it() if self.it is not None else None
        if it is None:
            return
        try:
            it.on_stream(stream)
        except Exception as exc:  # protect the job: the batch stays ready on its consumer
            it._owner._warn_once("on-stream", f"could not make a batch ready on a side "
                                 f"stream: {type(exc).__name__}: {exc}")


class _CudaBackend:
    """The CUDA calls PrefetchLoader makes; tests substitute fakes to check their order."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        # Pinning, stream and event creation all run under the target device, so no
        # CUDA context is ever created on another GPU (e.g. cuda:0 on every rank).
        return torch.cuda.device(device)

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def stream(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self, enable_timing: bool) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=enable_timing)

    def is_on(self, t: torch.Tensor, device: torch.device) -> bool:
        return t.device == device

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def copy(self, t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
        return t.to(device, non_blocking=non_blocking)
