"""A simulated CUDA runtime for the tests: stepscope believes it runs on CUDA, tensors stay on CPU.

Nobody on this project has a GPU. This module patches the parts of ``torch.cuda`` (and of
``torch.Tensor``/``nn.Module``/``torch.autograd``) that stepscope's recording side touches, so
that ``torch.cuda.is_available()`` is true, the CUDA-event clock is chosen, and real torch models
train on CPU while the *timing* behaves like a GPU:

* every device has in-order streams; the host only *enqueues* work (event records, copies,
  waits, simulated kernels) and the simulated GPU runs it later, ``lag_steps`` host steps
  behind (the test says what a step is by calling :meth:`CudaSim.host_tick`) and/or
  ``lag_ns`` behind;
* an event completes when its stream reaches it; ``elapsed_time`` on an unfinished or
  unrecorded event raises ``RuntimeError``; ``wait_event`` orders a stream after an event;
* backward runs on a separate per-device worker thread while the caller blocks;
* copies from pageable memory block the host until the stream drains;
* every synchronisation and blocking read is counted in :attr:`CudaSim.syncs`.

The busy GPU (``CudaSim(tflops=...)``): every op on a simulated-device tensor enqueues a kernel
costed by FLOPs or bytes (a dispatch mode on the training and autograd threads), a bounded
launch queue blocks a host that is too far ahead. Always on: CUDA contexts per device
(:attr:`CudaSim.contexts`), per-stream capture in global / thread_local / relaxed mode
(:class:`CUDAGraph`, ``torch.cuda.graph``, :meth:`CudaSim.capture`), NCCL-style collectives
on a communication stream (:meth:`CudaSim.collective`; a one-rank ``torch.distributed``
group running them, :meth:`CudaSim.nccl_group`), and a caching-allocator block model
that raises :class:`UseAfterReuse` when a kernel reads memory a later copy overwrote. Each
rule's docstring names the CUDA / PyTorch behaviour it models; ``docs/gpu-semantics.md``
lists them with their tests.

Usage::

    with CudaSim(devices=2, lag_steps=100) as sim:   # or the ``cuda_sim`` fixture
        model = nn.Linear(4, 4).to("cuda:1")          # parameters report cuda:1, data on CPU
        for batch in data:
            ...
            sim.host_tick()                            # one host step
        assert sim.syncs == 0, sim.sync_log

In a spawned gloo worker: ``cudasim.install(devices=world)`` (one simulated device per rank).

Limits (what is NOT simulated; see README "GPU claims"):

* Only tensors that went through ``.to("cuda")``/``.cuda()``/``Module.to``/:meth:`CudaSim.place`
  or a patched factory (``torch.zeros(..., device="cuda")``...) report a CUDA device; tensors
  computed from them report ``cpu`` (no op-level propagation). ``.item()``/``.tolist()``/
  ``.cpu()`` are counted as syncs only on such tagged tensors.
* Host compute is real CPU time; the GPU timeline is the host timeline shifted by the lag,
  plus explicit :meth:`CudaSim.kernel` durations, copy durations (bytes / bandwidth) and, on
  the busy GPU, op costs. Concurrent kernels do not compete for SMs or bandwidth. A blocked
  host (a sync, a full launch queue) waits at most ``sync_sleep_limit_s`` of real time: the
  awaited work is completed on the GPU timeline instead.
* The whole backward runs on the device thread (the real engine runs CPU-only nodes on the
  caller's thread; here every node "is on the device"). Its device: the device of the last
  placed module, else the caller's current device.
* CUDA graphs: capture rules and captured work only (a replay is one kernel of the captured
  cost; no graph memory pools). No real NCCL, no multi-process shared devices (each process
  has its own simulated devices). ``torch.accelerator`` covers availability, device index,
  streams and memory. The allocator model reuses blocks per stream and exact size (no
  splitting); a view keeps its base's block only while the base tensor object lives.
* Faults on demand: :meth:`CudaSim.inject_query_errors`.
* Collectives are not on the simulated streams: gloo runs them on the host, on CPU tensors.
  Use ``lag_steps=0`` for multi-rank gloo runs whose cross-rank timing matters: a gloo
  collective on CUDA tensors copies them to the host (a stream sync), so the GPU cannot stay
  behind across it, and each rank's lag-shifted GPU timeline would otherwise disagree with
  the others' at the collectives (NCCL's end at the same instant on every GPU).
* ``torch.backends.cuda.is_built()`` stays False (the CPU build); FSDP2/DDP keep their CPU
  code paths for the collectives (gloo).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

DEFAULT_NAME = "NVIDIA H100 80GB HBM3"
DEFAULT_TOTAL_MEMORY = 85_045_395_456  # what torch reports for an H100 80GB HBM3
H2D_BYTES_PER_NS = 25.0  # ~25 GB/s, a PCIe 5 x16 pinned host-to-device copy
HBM_BYTES_PER_NS = 3000.0  # ~3 TB/s, an H100's HBM3: what a bandwidth-bound kernel moves
LAUNCH_QUEUE = 1024  # pending launches per stream before a launch blocks the host
_BLOCK = 2 << 20  # the caching allocator rounds large segments to 2 MiB

_BLK = "_cudasim_block"  # attribute on a simulated-device tensor: its allocator block
_TAG = "_cudasim_device"  # attribute on a CPU tensor saying which simulated device it is on
_PIN = "_cudasim_pinned"  # attribute on a CPU tensor saying it lives in page-locked memory

_ACTIVE: CudaSim | None = None


def active() -> CudaSim | None:
    """The installed simulator, if any."""
    return _ACTIVE


def install(**kwargs: Any) -> CudaSim:
    """Install a simulator for the rest of this process (e.g. inside a spawned gloo worker)."""
    sim = CudaSim(**kwargs)
    sim.install()
    return sim


# --------------------------------------------------------------------------------------------
# The GPU: streams of work items that complete later
# --------------------------------------------------------------------------------------------


_SEQ = itertools.count()


class _Item:
    """One piece of work enqueued on a stream (an event record, a copy, a wait, a kernel)."""

    __slots__ = ("_writes", "captured", "cost_ns", "dep", "done", "end_ns", "host_ns", "kind",
                 "reads", "seq", "stream", "tick")

    def __init__(self, stream: _Stream, kind: str, host_ns: int, tick: int, cost_ns: int,
                 dep: _Item | None) -> None:
        self.stream = stream
        self.kind = kind
        self.host_ns = host_ns
        self.tick = tick
        self.cost_ns = cost_ns
        self.dep = dep
        self.done = False
        self.end_ns = 0
        self.seq = next(_SEQ)  # order of enqueueing, over all streams
        #: The memory blocks (block, generation) this item reads / writes (reuse detection).
        self.reads: tuple[tuple[_Block, int], ...] = ()
        self._writes: tuple[tuple[_Block, int], ...] = ()
        #: The capture this item was recorded into (it never runs as such), else None.
        self.captured: _Capture | None = None

    @property
    def start_ns(self) -> int:
        return self.end_ns - self.cost_ns

    @property
    def writes(self) -> tuple[tuple[_Block, int], ...]:
        return self._writes

    @writes.setter
    def writes(self, writes: tuple[tuple[_Block, int], ...]) -> None:
        # Known to the block from the enqueue on, so a read that completes first still sees
        # that its data was not written yet.
        self._writes = writes
        for block, gen in writes:
            block.writes = [(w, g) for w, g in block.writes if g >= gen - 1] + [(self, gen)]


class _Block:
    """A block of the simulated caching allocator: one allocation's memory, reused later.

    c10/cuda/CUDACachingAllocator.cpp: a freed block goes back to the pool of the stream it
    was allocated on and the next allocation *on that stream* may take it at once, with no
    synchronisation: stream order alone makes that safe on the allocating stream. Work on
    another stream that still reads the block is ordered by nothing, unless the tensor was
    ``record_stream``-ed for that stream: then ``free`` records an event on each such stream
    (``insert_events``) and the block returns to the pool only once they all completed
    (``process_events``, at a later allocation). ``gen`` counts the block's reuses.
    """

    __slots__ = ("device", "events", "gen", "nbytes", "reads", "stream", "uses", "writes")

    def __init__(self, device: int, nbytes: int, stream: _Stream) -> None:
        self.device = device
        self.nbytes = nbytes
        self.stream = stream
        self.gen = 0
        self.uses: set[_Stream] = set()  # record_stream's streams for the current allocation
        self.events: list[_Item] = []  # free-time events it waits for before reuse
        self.reads: list[tuple[_Item, int]] = []
        self.writes: list[tuple[_Item, int]] = []


class UseAfterReuse(RuntimeError):
    """A kernel read a block whose memory a later allocation's work overwrote (or the other
    way round), or read it before the work filling it had finished: the data it read was
    not the tensor it was given."""


class _Capture:
    """One stream capture (``cudaStreamBeginCapture``): its mode, thread and state."""

    def __init__(self, mode: str, thread: int) -> None:
        self.mode = mode
        self.thread = thread
        self.invalidated: str | None = None  # why, once a prohibited call broke it
        self.cost_ns = 0  # the GPU time of the captured work (what a replay costs)
        self.ended = False


class _Stream:
    """A simulated CUDA stream: a FIFO of items that complete in order (CUDA stream semantics)."""

    def __init__(self, sim: CudaSim, device: int, sid: int, priority: int = 0) -> None:
        self.sim = sim
        self.device = device
        self.sid = sid
        self.priority = priority
        self.pending: deque[_Item] = deque()
        self.last: _Item | None = None  # the most recently enqueued item
        self.last_end_ns = 0
        self.last_host_ns = 0  # when the host enqueued the most recently completed item


class _Device:
    def __init__(self, sim: CudaSim, index: int) -> None:
        self.index = index
        self.streams: list[_Stream] = []
        self.default = sim._new_stream(self, 0)
        self.pool: dict[tuple[_Stream, int], list[_Block]] = {}  # freed blocks by stream, size
        self.deferred: list[_Block] = []  # freed blocks waiting on record_stream events
        self.comm: _Stream | None = None  # the communication stream (see CudaSim.collective)
        self.allocated = 0
        self.peak_allocated = 0
        self.reserved = 0
        self.peak_reserved = 0
        self.uuid = uuid.UUID(int=(0x5EED << 64) | index)


# --------------------------------------------------------------------------------------------
# torch.cuda stand-ins
# --------------------------------------------------------------------------------------------


class Stream:
    """Stand-in for ``torch.cuda.Stream`` (``Stream(device=None, priority=0)``)."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        sim = _sim()
        if "_wrap" in kwargs:
            self = object.__new__(cls)
            self._s = kwargs["_wrap"]
            return self
        idx = sim._index(device) if device is not None else sim.current_device()
        with sim._lock:
            # cudaStreamCreateWithPriority runs in the device's primary context: creates it.
            sim._ctx(idx, "Stream()")
            s = sim._new_stream(sim._dev(idx), priority)
        self = object.__new__(cls)
        self._s = s
        return self

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        pass

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._s.device)

    @property
    def device_index(self) -> int:
        return self._s.device

    device_type = 1  # DeviceType::CUDA, as torch.cuda.Stream reports it

    @property
    def stream_id(self) -> int:
        return self._s.sid

    @property
    def cuda_stream(self) -> int:
        return 0 if self._s.sid == 0 else 0x7F000000 + self._s.sid  # default stream is 0

    @property
    def priority(self) -> int:
        return self._s.priority

    def query(self) -> bool:
        # cudaStreamQuery: non-blocking, True once every item enqueued so far has completed.
        sim = self._s.sim
        with sim._lock:
            sim._prohibit("Stream.query", stream=self._s)
            sim._advance()
            return self._s.last is None or self._s.last.done

    def is_capturing(self) -> bool:
        return self._s in self._s.sim._captures

    def synchronize(self) -> None:
        # cudaStreamSynchronize blocks the host until the stream has drained: a host sync.
        sim = self._s.sim
        sim._prohibit("Stream.synchronize", stream=self._s)
        sim._count("stream.synchronize")
        sim._drain_to(self._s.last)

    def wait_event(self, event: Event) -> None:
        # torch/cuda/streams.py: ``Stream.wait_event(event)`` is ``event.wait(self)`` (so is
        # ``wait_stream``, through it): a patch of ``Event.wait`` sees every such join.
        event.wait(self)

    def _wait_event(self, event: Event) -> None:
        # cudaStreamWaitEvent: later work on this stream starts only after the event's work;
        # waiting on a never-recorded event is a no-op (torch's CUDAEvent::block checks isCreated).
        sim = self._s.sim
        with sim._lock:
            target = event._item
            if target is None:
                return
            cap = target.captured
            if cap is not None:
                # A wait on an event recorded in a capture (fork/join of a multi-stream graph,
                # as torch.cuda.graph users do with side streams) makes this stream join that
                # capture while it lasts; once it ended the event stands for no executed work.
                if cap.ended:
                    raise RuntimeError("CUDA error: operation not permitted on an event last "
                                       "recorded in a capturing stream (the capture has ended)")
                sim._captures[self._s] = cap
                return
            sim._enqueue(self._s, "wait", dep=target)

    def wait_stream(self, stream: Stream) -> None:
        # torch: ``self.wait_event(stream.record_event())``.
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        if event is None:
            event = Event()
        event.record(self)
        return event

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other._s is self._s

    def __hash__(self) -> int:
        return hash((self._s.device, self._s.sid))

    def __enter__(self) -> Stream:
        # torch.Stream.__enter__ (CUDA builds): makes the stream current, like torch.cuda.stream.
        ctx = _stream_context(self)
        ctx.__enter__()
        self.__dict__.setdefault("_ctx", []).append(ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.__dict__["_ctx"].pop().__exit__(None, None, None)

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:{self._s.device} cuda_stream={self.cuda_stream:#x}>"


class ExternalStream(Stream):
    pass


class Event:
    """Stand-in for ``torch.cuda.Event``: records a point in a stream, completes when reached."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False) -> None:
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._item: _Item | None = None
        self._device: int | None = None  # fixed at the first record, like torch's lazy create
        sim = _sim()
        self._sim = sim
        self.cuda_event = next(sim._ids)

    @property
    def device(self) -> torch.device | None:
        return None if self._device is None else torch.device("cuda", self._device)

    def record(self, stream: Stream | None = None) -> None:
        sim = self._sim
        if stream is None:
            # torch.cuda.Event.record: ``stream = torch.cuda.current_stream()`` (current device).
            stream = sim.current_stream()
        with sim._lock:
            s = stream._s
            if self._device is not None and self._device != s.device:
                # CUDAEvent::record: TORCH_CHECK(device_index_ == stream.device_index(), ...)
                raise RuntimeError(
                    f"Event device {self._device} does not match recording stream's device "
                    f"{s.device}."
                )
            self._device = s.device
            self._item = sim._enqueue(s, "event")
            sim.records += 1

    def _usable(self) -> None:
        item = self._item
        if item is not None and item.captured is not None:
            # CUDA Programming Guide, Stream Capture, "Prohibited and Unhandled Operations": it is
            # invalid to synchronize or query the execution status of a captured event (it
            # stands for a graph node, not for work scheduled for execution).
            raise RuntimeError("CUDA error: operation not permitted on an event last recorded "
                               "in a capturing stream")

    def query(self) -> bool:
        # CUDAEvent::query: true if never recorded; else cudaEventQuery (non-blocking).
        sim = self._sim
        with sim._lock:
            sim.queries += 1
            if self._item is not None:
                sim._prohibit("Event.query")
            self._usable()
            if sim._query_errors:
                sim._query_errors -= 1
                # cudaEventQuery returning an error code (not cudaErrorNotReady) -> C10_CUDA_CHECK.
                raise RuntimeError(sim._query_error_message)
            if self._item is None:
                return True
            sim._advance()
            return self._item.done

    def elapsed_time(self, end_event: Event) -> float:
        sim = self._sim
        with sim._lock:
            self._usable()
            end_event._usable()
            if self._item is None or end_event._item is None:
                # CUDAEvent::elapsed_time: TORCH_CHECK(is_created_ && other.isCreated(), ...)
                raise RuntimeError(
                    "Both events must be recorded before calculating elapsed time."
                )
            if not (self.enable_timing and end_event.enable_timing):
                # cudaEventElapsedTime on events created with cudaEventDisableTiming.
                raise RuntimeError("CUDA error: invalid resource handle")
            if self._device != end_event._device:
                # cudaEventElapsedTime on events of two devices: cudaErrorInvalidResourceHandle.
                raise RuntimeError("CUDA error: invalid resource handle (events on two devices)")
            sim._advance()
            if not (self._item.done and end_event._item.done):
                # cudaEventElapsedTime returns cudaErrorNotReady if either event has not
                # completed (it never waits) -> torch raises RuntimeError.
                raise RuntimeError("CUDA error: device not ready")
            sim.reads += 1
            return float((end_event._item.end_ns - self._item.end_ns) / 1e6)

    def synchronize(self) -> None:
        # cudaEventSynchronize blocks the host until the event completes: a host sync.
        sim = self._sim
        if self._item is not None:
            sim._prohibit("Event.synchronize")
            self._usable()
        sim._count("event.synchronize")
        if self._item is not None:
            sim._drain_to(self._item)

    def wait(self, stream: Stream | None = None) -> None:
        # torch.cuda.Event.wait: the current stream when none is given, then
        # CUDAEvent::block -> cudaStreamWaitEvent.
        if stream is None:
            stream = self._sim.current_stream()
        stream._wait_event(self)

    def ipc_handle(self) -> Any:
        raise RuntimeError("the CUDA simulator does not share events across processes")

    def __repr__(self) -> str:
        return f"<torch.cuda.Event {self.cuda_event:#x}>"


def _block_of(t: torch.Tensor) -> _Block:
    blk = getattr(t, _BLK, None)
    if blk is None:
        raise ValueError("not a simulated-device tensor (no allocator block)")
    return blk


class Work:
    """What a simulated NCCL collective returns (``torch.distributed.Work`` on NCCL)."""

    def __init__(self, end: Event) -> None:
        self.end = end

    def wait(self, timeout: Any = None) -> bool:
        # WorkNCCL::wait -> synchronizeStream: the current stream waits for the end event
        # (cudaStreamWaitEvent in C++, not through the Python ``Event.wait``).
        _sim().current_stream()._wait_event(self.end)
        return True

    def is_completed(self) -> bool:
        return self.end.query()


SIM_NCCL = "cudasim_nccl"  # the backend name :func:`sim_nccl_group` is registered under


def _register_sim_nccl() -> None:
    import torch.distributed as dist

    if SIM_NCCL not in dist.Backend.backend_list:
        dist.Backend.register_backend(SIM_NCCL, lambda store, rank, size, timeout:
                                      sim_nccl_group(rank, size), devices=["cpu", "cuda"])


def _sim_nccl_class() -> type:
    import torch.distributed as dist

    class SimWork(dist._Work):  # type: ignore[misc,name-defined]
        """``WorkNCCL`` on the simulator: ``wait()`` is ``WorkNCCL::synchronizeStream``, the
        caller's current stream waits (in C++, cudaStreamWaitEvent) for the end event; the
        host does not block (blockingWait off, the default)."""

        def __init__(self, end: Event) -> None:
            super().__init__()
            self.end = end

        wait = Work.wait  # the same stream wait as the plain simulated Work
        is_completed = Work.is_completed

    class SimNcclGroup(dist.ProcessGroup):  # type: ignore[misc]
        """A process group whose collectives run like ProcessGroupNCCL's on the simulator
        (a Python process group, as pytorch's test_c10d_pypg.py writes them): each call is
        :meth:`CudaSim.collective` with ``async_op=True`` (ProcessGroupNCCL::collective:
        syncStream makes the NCCL stream wait for the caller's current stream, the kernel
        and the end event go on the NCCL stream, the host returns at once), and
        ``torch.distributed`` calls ``wait()`` on the returned work for a synchronous call.
        Data are not moved (one rank: outputs keep what they hold). ``ms``: GPU time of
        each call, a number or ``ms(op)``."""

        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)
            self.ms: float | Callable[[str], float] = 0.0
            self.calls: list[str] = []
            self._name = ""

        def getBackendName(self) -> str:
            return SIM_NCCL

        # A Python group keeps its own name (c10d sets it at init_process_group).
        def setGroupName(self, name: str) -> None:
            self._name = name

        def getGroupName(self) -> str:
            return self._name

        def _run(self, op: str, tensors: tuple[torch.Tensor, ...]) -> Any:
            self.calls.append(op)
            ms = self.ms(op) if callable(self.ms) else self.ms
            sim = _sim()
            tagged = tuple(t for t in tensors if getattr(t, _BLK, None) is not None)
            return SimWork(sim.collective(float(ms), tensors=tagged, async_op=True).end)

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return self._run("allreduce", tuple(tensors))

        def all_gather_single(self, out: Any, inp: Any, opts: Any = None) -> Any:
            return self._run("all_gather_single", (out, inp))

        def reduce_scatter_single(self, out: Any, inp: Any, opts: Any = None) -> Any:
            return self._run("reduce_scatter_single", (out, inp))

        def broadcast(self, tensors: Any, opts: Any = None) -> Any:
            return self._run("broadcast", tuple(tensors))

    return SimNcclGroup


_SIM_NCCL_CLS: type | None = None


def sim_nccl_group(rank: int, size: int) -> Any:
    """A :class:`SimNcclGroup` (built on first use: ``torch.distributed`` is imported then)."""
    global _SIM_NCCL_CLS
    if _SIM_NCCL_CLS is None:
        _SIM_NCCL_CLS = _sim_nccl_class()
    return _SIM_NCCL_CLS(rank, size)


class CUDAGraph:
    """Stand-in for ``torch.cuda.CUDAGraph``: capture_begin/capture_end/replay."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._cap: _Capture | None = None
        self._cost_ns: int | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        sim = _sim()
        self._cap = sim._begin_capture(sim.current_stream()._s, capture_error_mode)

    def capture_end(self) -> None:
        assert self._cap is not None, "capture_end without capture_begin"
        cap, self._cap = self._cap, None
        self._cost_ns = _sim()._end_capture(cap)

    def replay(self) -> None:
        if self._cost_ns is None:
            raise RuntimeError("CUDAGraph::replay called before a successful capture")
        _sim().kernel(self._cost_ns / 1e6)  # one graph launch on the current stream

    def reset(self) -> None:
        self._cost_ns = None

    def pool(self) -> tuple[int, int]:
        return (0, id(self))


class _GraphContext:
    """``torch.cuda.graph(cuda_graph, pool=None, stream=None, capture_error_mode="global")``.

    Like torch/cuda/graphs.py: synchronize the device and empty the cache first, then make
    the capture stream (a side stream by default) current and begin the capture.
    """

    def __init__(self, cuda_graph: CUDAGraph, pool: Any = None, stream: Stream | None = None,
                 capture_error_mode: str = "global") -> None:
        self.graph = cuda_graph
        self.stream = stream if stream is not None else Stream()
        self.mode = capture_error_mode
        self._ctx: Any = None

    def __enter__(self) -> None:
        import torch as t

        t.cuda.synchronize()
        self._ctx = _stream_context(self.stream)
        self._ctx.__enter__()
        try:
            self.graph.capture_begin(capture_error_mode=self.mode)
        except BaseException:
            self._ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.graph.capture_end()
        finally:
            self._ctx.__exit__(None, None, None)


class _DeviceProperties:
    """Stand-in for ``torch._C._CudaDeviceProperties`` (H100 SXM values)."""

    CLOCK_RATE_KHZ = 1_980_000

    def __init__(self, name: str, total_memory: int, index: int, dev_uuid: uuid.UUID) -> None:
        self.name = name
        self.total_memory = total_memory
        self.major, self.minor = 9, 0
        self.multi_processor_count = 132
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.L2_cache_size = 50 << 20
        self.clock_rate = self.CLOCK_RATE_KHZ
        self.memory_clock_rate = 2_619_000
        self.warp_size = 32
        self.max_threads_per_multi_processor = 2048
        self.gcnArchName = "NVIDIA"
        self.uuid = dev_uuid
        self.pci_bus_id = 0x18 + index
        self.pci_device_id = 0
        self.pci_domain_id = 0

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major=9, minor=0, "
                f"total_memory={self.total_memory >> 20}MB, multi_processor_count=132)")


# --------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------


def _sim() -> CudaSim:
    if _ACTIVE is None:
        raise RuntimeError("the CUDA simulator is not installed")
    return _ACTIVE


class CudaSim:
    """The simulated CUDA runtime; a context manager that patches torch and restores it.

    ``devices``: how many GPUs ``device_count()`` reports. ``lag_steps``: the GPU is that many
    host steps behind (steps end at each :meth:`host_tick`): work enqueued during host step
    ``k`` runs, with the same spacing, while the host does step ``k + lag_steps - 1``, and has
    all completed once the host ends that step; 0 = the GPU keeps up (work completes as soon
    as it is enqueued). ``lag_ns``: a constant extra delay of the GPU behind the host.
    ``idle_drain_s``: once the host has not ticked for this long, the GPU (which does not wait
    for the host) works through its queue at the recent step pace; None: only ticks advance it.
    ``name``: what ``get_device_name()`` returns.
    ``sync_sleep_limit_s``: the longest a simulated blocking call sleeps to let GPU time pass.
    ``tflops``: the busy GPU: ops on simulated-device tensors cost FLOPs / (tflops x 1e12)
    seconds of GPU time (1e-3 is 1 FLOP per ns), or their bytes / ``hbm_gbps`` GB/s when
    larger; None (default): ops cost nothing. ``launch_queue``: pending launches per stream
    before a launch blocks the host (default 1024 on the busy GPU, else unbounded).
    """

    def __init__(self, devices: int = 1, *, lag_steps: int = 0, lag_ns: int = 0,
                 name: str = DEFAULT_NAME, total_memory: int = DEFAULT_TOTAL_MEMORY,
                 copy_bytes_per_ns: float = H2D_BYTES_PER_NS,
                 idle_drain_s: float | None = 0.25,
                 sync_sleep_limit_s: float = 0.05,
                 tflops: float | None = None, hbm_gbps: float = HBM_BYTES_PER_NS,
                 launch_queue: int | None = None) -> None:
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices must be an int >= 1; got {devices!r}")
        if not isinstance(lag_steps, int) or lag_steps < 0:
            raise ValueError(f"lag_steps must be an int >= 0; got {lag_steps!r}")
        if not isinstance(lag_ns, int) or lag_ns < 0:
            raise ValueError(f"lag_ns must be an int >= 0; got {lag_ns!r}")
        self.n_devices = devices
        self.lag_steps = lag_steps
        self.lag_ns = lag_ns
        self.name = name
        self.total_memory = total_memory
        self.copy_bytes_per_ns = copy_bytes_per_ns
        self.sync_sleep_limit_s = sync_sleep_limit_s
        if idle_drain_s is not None and not idle_drain_s > 0:
            raise ValueError(f"idle_drain_s must be > 0 or None; got {idle_drain_s!r}")
        self.idle_drain_s = idle_drain_s
        if tflops is not None and not tflops > 0:
            raise ValueError(f"tflops must be > 0 or None; got {tflops!r}")
        if not hbm_gbps > 0:
            raise ValueError(f"hbm_gbps must be > 0; got {hbm_gbps!r}")
        if launch_queue is None and tflops is not None:
            launch_queue = LAUNCH_QUEUE
        if launch_queue is not None and (not isinstance(launch_queue, int) or launch_queue < 1):
            raise ValueError(f"launch_queue must be an int >= 1 or None; got {launch_queue!r}")
        self.flops_per_ns = None if tflops is None else tflops * 1e3
        self.op_bytes_per_ns = float(hbm_gbps)
        self.launch_queue = launch_queue
        self._lock = threading.RLock()
        self._ids = itertools.count(0x1000)
        self._sids = itertools.count(1)
        self._tls = threading.local()
        self._devices: list[_Device] | None = None
        self._tick = 0
        self._tick_ns: list[int] = []
        self._patches: list[tuple[Any, str, Any, bool]] = []
        self._workers: dict[int, _DeviceWorker] = {}
        self._placed: int | None = None
        self._captures: dict[_Stream, _Capture] = {}
        self._mode: Any = None  # the op-cost dispatch mode, while installed (tflops set)
        #: device index -> what created its CUDA context first (see :meth:`_ctx`).
        self.contexts: dict[int, str] = {}
        self.kernels = 0  # kernels enqueued by ops on simulated-device tensors
        self.launch_waits = 0  # times the host blocked on a full launch queue
        #: every use-after-reuse found (also raised where found; kept here because the code
        #: under test may swallow the exception to protect the job).
        self.reuse_errors: list[str] = []
        self._query_errors = 0
        self._query_error_message = ""
        #: every host sync, in order: ``(kind, thread name)``.
        self.sync_log: list[tuple[str, str]] = []
        self.records = 0  # events recorded
        self.queries = 0  # Event.query calls
        self.reads = 0  # successful elapsed_time reads
        self.copies: list[tuple[str, int, bool]] = []  # (direction, bytes, blocking)
        self.backward_threads: list[str] = []  # the thread name of every engine run

    # ---- counters -----------------------------------------------------------------------

    @property
    def syncs(self) -> int:
        """How many times the host blocked on the GPU since install / :meth:`reset_counts`."""
        return len(self.sync_log)

    def reset_counts(self) -> None:
        with self._lock:
            self.sync_log.clear()
            self.copies.clear()
            self.records = self.queries = self.reads = 0

    def _count(self, kind: str) -> None:
        with self._lock:
            self.sync_log.append((kind, threading.current_thread().name))

    # ---- host progress ------------------------------------------------------------------

    def host_tick(self, n: int = 1) -> None:
        """The host finished ``n`` steps (call once per iteration of the training loop)."""
        with self._lock:
            for _ in range(n):
                self._tick += 1
                self._tick_ns.append(time.perf_counter_ns())

    @property
    def tick(self) -> int:
        return self._tick

    def kernel(self, ms: float, stream: Stream | None = None, *,
               reads: tuple[torch.Tensor, ...] = (), writes: tuple[torch.Tensor, ...] = ()) -> None:
        """Enqueue ``ms`` of simulated GPU work (a kernel) on ``stream`` (default: current)
        that reads / writes the memory of the given simulated-device tensors."""
        if not ms >= 0:
            raise ValueError(f"ms must be >= 0; got {ms!r}")
        s = (stream or self.current_stream())._s
        with self._lock:
            item = self._enqueue(s, "kernel", cost_ns=int(ms * 1e6))
            item.reads = tuple((b, b.gen) for b in map(_block_of, reads))
            item.writes = tuple((b, b.gen) for b in map(_block_of, writes))

    def comm_stream(self, device: Any = None) -> Stream:
        """The device's communication stream: ProcessGroupNCCL runs every collective of a
        device on one stream of its own, taken from the high-priority pool
        (getStreamFromPool(/*isHighPriority=*/true)), beside the compute streams."""
        d = self._dev(self._index(device))
        with self._lock:
            if d.comm is None:
                self._ctx(d.index, "comm stream")
                d.comm = self._new_stream(d, -1)
            return Stream(_wrap=d.comm)

    def collective(self, ms: float, *, stream: Stream | None = None,
                   tensors: tuple[torch.Tensor, ...] = (), async_op: bool = False) -> Work:
        """An NCCL-style collective of ``ms`` GPU time on a communication stream.

        ProcessGroupNCCL::collective: ``syncStream`` records an event on the caller's current
        stream and makes the NCCL stream wait for it (the inputs are ready), the kernel runs
        on the NCCL stream (``stream``: one of the caller's own, as FSDP2 passes its
        all-gather / reduce-scatter streams), and an end event is recorded there. The host
        does not wait. ``Work.wait()`` (WorkNCCL::synchronizeStream) makes the current
        stream wait for the end event; ``async_op=False`` does that at once, as the
        synchronous call does. Until then compute runs beside the collective.
        """
        cur = self.current_stream()
        comm = stream if stream is not None else self.comm_stream(cur.device_index)
        ready = Event()
        ready.record(cur)
        comm._wait_event(ready)  # C++ (syncStream): not through the Python Event.wait
        self.kernel(ms, comm, reads=tensors, writes=tensors)
        end = Event(enable_timing=True)
        end.record(comm)
        work = Work(end)
        if not async_op:
            work.wait()
        return work

    @contextlib.contextmanager
    def nccl_group(self, ms: float | Callable[[str], float] = 0.0) -> Iterator[Any]:
        """``torch.distributed``'s default group, of one rank, backed by :func:`sim_nccl_group`:
        every collective costs ``ms`` (or ``ms(op)``) of GPU time on the device's
        communication stream, as :meth:`collective` runs it. Destroyed at exit."""
        import torch.distributed as dist

        _register_sim_nccl()
        dist.init_process_group(SIM_NCCL, store=dist.HashStore(), rank=0, world_size=1)
        try:
            pg = dist.distributed_c10d._get_default_group()
            pg.ms = ms
            yield pg
        finally:
            dist.destroy_process_group()

    def drain(self) -> None:
        """Let the GPU finish everything enqueued so far (test helper: NOT counted as a sync)."""
        for d in self._devs():
            for s in d.streams:
                self._drain_to(s.last)

    def pending(self) -> int:
        """Items enqueued but not yet completed, over all streams."""
        with self._lock:
            self._advance()
            return sum(len(s.pending) for d in self._devs() for s in d.streams)

    def inject_query_errors(self, n: int = 1,
                            message: str = "CUDA error: unspecified launch failure") -> None:
        """Make the next ``n`` ``Event.query()`` calls raise ``RuntimeError(message)``."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0; got {n!r}")
        with self._lock:
            self._query_errors = n
            self._query_error_message = message

    @property
    def capturing(self) -> bool:
        """True while any stream of the process is being captured."""
        return bool(self._captures)

    @contextlib.contextmanager
    def capture(self, stream: Stream | None = None, mode: str = "global") -> Iterator[CUDAGraph]:
        """Capture ``stream`` (default: the current one) into a graph, as ``torch.cuda.graph``
        does; exiting ends the capture and raises if a prohibited call invalidated it."""
        g = CUDAGraph()
        with _stream_context(stream):
            g.capture_begin(capture_error_mode=mode)
            try:
                yield g
            finally:
                g.capture_end()

    def _begin_capture(self, s: _Stream, mode: str) -> _Capture:
        if mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode must be 'global', 'thread_local' or 'relaxed'; "
                             f"got {mode!r}")
        with self._lock:
            if s in self._captures:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                                   "(the stream is already capturing)")
            self._prohibit("cudaStreamBeginCapture")
            cap = self._captures[s] = _Capture(mode, threading.get_ident())
            return cap

    def _end_capture(self, cap: _Capture) -> int:
        with self._lock:
            for st in [st for st, c in self._captures.items() if c is cap]:
                del self._captures[st]
            cap.ended = True
            if cap.invalidated is not None:
                # cudaStreamEndCapture returns cudaErrorStreamCaptureInvalidated once a
                # prohibited call broke the sequence; torch raises it from capture_end().
                raise RuntimeError("CUDA error: operation failed due to a previous error during "
                                   f"capture (cudaErrorStreamCaptureInvalidated: {cap.invalidated})")
            return cap.cost_ns

    def _prohibit(self, what: str, *, stream: _Stream | None = None,
                  device: int | None = None) -> None:
        """Raise (and invalidate the capture) if ``what`` is a prohibited call now.

        cudaStreamCaptureMode (CUDA Runtime API, cudaStreamBeginCapture and
        cudaThreadExchangeStreamCaptureMode): a thread is prohibited from potentially unsafe
        calls (event/stream query and synchronize, device synchronize, legacy-stream use)
        while *it* has a capture that is not ``relaxed``, or while *any other thread* has a
        ``global`` capture; a ``relaxed`` capture prohibits nothing. A prohibited call fails
        and invalidates the capture. Querying or synchronizing the capturing stream itself,
        or its device (cudaDeviceSynchronize), is invalid in every mode (Programming Guide,
        "Prohibited and Unhandled Operations"). torch.cuda.graphs.graph's docstring:
        "global" is the default, "thread_local" / "relaxed" for other threads' sync calls.
        """
        caps = self._captures
        if not caps:
            return
        me = threading.get_ident()
        for st, cap in caps.items():
            own = cap.thread == me
            if ((own and cap.mode != "relaxed") or (not own and cap.mode == "global")
                    or st is stream or (device is not None and st.device == device)):
                thread = "this thread" if own else "another thread"
                cap.invalidated = f"{what} while {thread} captured in {cap.mode} mode"
                raise RuntimeError(f"CUDA error: operation not permitted when stream is "
                                   f"capturing ({cap.invalidated})")

    # ---- devices and streams ------------------------------------------------------------

    def _devs(self) -> list[_Device]:
        if self._devices is None:
            with self._lock:
                if self._devices is None:
                    self._devices = [_Device(self, i) for i in range(self.n_devices)]
        return self._devices

    def _dev(self, index: int) -> _Device:
        return self._devs()[index]

    def _new_stream(self, dev: _Device, priority: int) -> _Stream:
        s = _Stream(self, dev.index, 0 if not dev.streams and not hasattr(dev, "default")
                    else next(self._sids), priority)
        dev.streams.append(s)
        return s

    def _index(self, device: Any, *, optional: bool = False) -> int:
        """A device index from an int / "cuda:i" / torch.device, like torch's _get_device_index."""
        if device is None:
            return self.current_device()
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            idx = self.current_device() if device.index is None else device.index
        elif isinstance(device, int) and not isinstance(device, bool):
            idx = device
        else:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, "
                             f"but got:{device!r}")
        if not 0 <= idx < self.n_devices:
            # cudaSetDevice / cudaGetDeviceProperties with a bad ordinal.
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {idx}, "
                               f"{self.n_devices} simulated)")
        return idx

    def current_device(self) -> int:
        # The current device is per host thread (cudaSetDevice), 0 in a fresh thread.
        return getattr(self._tls, "device", 0)

    def set_device(self, device: Any) -> None:
        if isinstance(device, int) and device < 0:
            return  # torch.cuda.set_device ignores negative indices
        self._devs()
        idx = self._index(device)
        if idx != self.current_device():
            # c10::cuda::SetDevice calls cudaSetDevice when the device changes, and since
            # CUDA 12 cudaSetDevice initialises the primary context of its target.
            self._ctx(idx, "set_device")
        self._tls.device = idx

    def _ctx(self, idx: int, why: str) -> None:
        """Device ``idx`` gets its CUDA context (the first reason is kept).

        A primary context (~300-500 MB of device memory) is created by the first runtime call
        that needs one on the current device: a launch, a copy, an event record, a stream,
        an allocation, cudaDeviceSynchronize. Calls that only read driver state do not:
        device count and properties, and torch's device guards (c10::cuda::MaybeSetDevice
        switches only to devices that already have one). ``Event.query`` on an event never
        recorded makes no CUDA call at all (CUDAEvent::query returns true when not created).
        """
        if idx not in self.contexts:
            self.contexts[idx] = why

    def current_stream(self, device: Any = None) -> Stream:
        # PyTorch's current stream is thread-local, one per device, default stream at first.
        idx = self.current_device() if device is None else self._index(device)
        streams = self._thread_streams()
        s = streams.get(idx)
        if s is None:
            s = self._dev(idx).default
        return Stream(_wrap=s)

    def current_raw_stream(self, device: int) -> int:
        # A plain lookup, like the C call it stands for (no Stream object is built).
        s = self._thread_streams().get(device) or self._dev(device).default
        return 0 if s.sid == 0 else 0x7F000000 + s.sid

    def default_stream(self, device: Any = None) -> Stream:
        idx = self.current_device() if device is None else self._index(device)
        return Stream(_wrap=self._dev(idx).default)

    def _thread_streams(self) -> dict[int, _Stream]:
        d = getattr(self._tls, "streams", None)
        if d is None:
            d = self._tls.streams = {}
        return d

    def set_stream(self, stream: Stream) -> None:
        # torch.cuda.set_stream (THCPModule_setStream) also makes the stream's device current.
        if stream is None:
            return
        self._tls.device = stream._s.device
        self._thread_streams()[stream._s.device] = stream._s

    # ---- the GPU clock ------------------------------------------------------------------

    def _enqueue(self, s: _Stream, kind: str, *, cost_ns: int = 0, dep: _Item | None = None) -> _Item:
        # Called with the lock held. The host only appends; the GPU runs it later.
        item = _Item(s, kind, time.perf_counter_ns(), self._tick, cost_ns, dep)
        cap = self._captures.get(s)
        if cap is not None:
            # Work issued to a capturing stream is recorded into the graph, not run: it never
            # completes as such, and the stream's executed work is unchanged.
            item.captured = cap
            cap.cost_ns += cost_ns
            return item
        self._ctx(s.device, kind)
        limit = self.launch_queue
        if limit is not None and len(s.pending) >= limit:
            # The launch queue is bounded (on the order of a thousand pending launches per
            # stream): a host that is that far ahead blocks inside the launch until the GPU
            # retires the oldest item. Not a sync the code asked for; counted apart.
            self.launch_waits += 1
            self._drain_to(s.pending[len(s.pending) - limit], sleep=False)
        s.pending.append(item)
        s.last = item
        return item

    def _step_bounds(self, k: int) -> tuple[int, int]:
        """Host ns at which step ``k`` began and ended (it must have ended)."""
        return (self._tick_ns[k - 1] if k else self._t0), self._tick_ns[k]

    def _start_ns(self, item: _Item, s: _Stream, now: int) -> int | None:
        """When the GPU starts ``item``, or None while its host step is not due yet."""
        lag = self.lag_steps
        if lag == 0:
            base = item.host_ns  # a GPU that keeps up runs the work as soon as it is enqueued
        elif self._tick >= item.tick + lag:
            # Work of host step k runs while the host does step k+lag-1, with the same relative
            # spacing, so it has all completed when the host ends step k+lag-1 (host_tick).
            h0, h1 = self._step_bounds(item.tick)
            g0, g1 = self._step_bounds(item.tick + lag - 1)
            base = g0 + (item.host_ns - h0) * (g1 - g0) // (h1 - h0) if h1 > h0 else g0
        elif self.idle_drain_s is not None and now - self._last_tick_ns() >= self.idle_drain_s * 1e9:
            # The host stopped ticking (end of the loop, an eval, a hang): the GPU keeps going
            # on its own and works through its queue at the recent pace of a step.
            base = item.host_ns + lag * self._recent_step_ns()  # done once the host is there
            # The work between two marks takes the GPU as long as the host took to issue it
            # (the model's stand-in for kernel time, as in the lagging case above): a GPU that
            # is behind never runs a step's kernels in zero time. Without this, a host stall
            # under load squeezed three whole steps onto one instant (step_ms 0.0).
            gap = max(0, item.host_ns - s.last_host_ns) if s.last_host_ns else 0
            base = max(base, s.last_end_ns + gap)
        else:
            return None
        start = max(s.last_end_ns, base + self.lag_ns)  # in order: after the previous item
        if item.dep is not None:
            start = max(start, item.dep.end_ns)  # ordered after the awaited event
        return start

    def _last_tick_ns(self) -> int:
        return self._tick_ns[-1] if self._tick_ns else self._t0

    def _recent_step_ns(self) -> int:
        t = self._tick_ns[-17:]
        if len(t) < 2:
            return t[0] - self._t0 if t else 0
        return (t[-1] - t[0]) // (len(t) - 1)

    def _advance(self) -> None:
        """Complete every item whose time has come (lock held). In order per stream."""
        now = time.perf_counter_ns()
        progress = True
        while progress:
            progress = False
            for d in self._devs():
                for s in d.streams:
                    q = s.pending
                    while q:
                        item = q[0]
                        if item.dep is not None and not item.dep.done:
                            break
                        start = self._start_ns(item, s, now)
                        if start is None or start + item.cost_ns > now:
                            break
                        self._complete(q, s, start + item.cost_ns)
                        progress = True

    def _complete(self, q: deque[_Item], s: _Stream, end: int) -> None:
        item = q.popleft()
        item.end_ns = end
        item.done = True
        s.last_end_ns = end
        s.last_host_ns = item.host_ns
        if item.reads or item.writes:
            self._check_reuse(item)

    def _check_reuse(self, item: _Item) -> None:
        """Use-after-reuse: a read of generation g of a block that overlaps (or follows) the
        run of a write of a later generation, or a write that runs before an earlier
        generation's read ended. Stream order and event waits are what order them on a real
        GPU; here their result, the items' GPU intervals, is compared."""
        start, end = item.start_ns, item.end_ns
        bad = None
        for block, gen in item.reads:
            for w, wgen in block.writes:
                if (wgen == gen and w.seq < item.seq
                        and (not w.done or w.end_ns > start)):
                    # Read before written: the reading stream was not ordered after the
                    # stream that fills the memory (no wait_event / wait_stream).
                    bad = (f"{item.kind} on stream {item.stream.sid} read a "
                           f"{block.nbytes}-byte block before {w.kind} on stream "
                           f"{w.stream.sid} had written it")
                if wgen > gen and w.done and w.start_ns < end:
                    bad = (f"{item.kind} on stream {item.stream.sid} read generation {gen} of a "
                           f"{block.nbytes}-byte block that {w.kind} on stream {w.stream.sid} "
                           f"had overwritten for generation {wgen}")
            block.reads.append((item, gen))
        for block, gen in item.writes:
            keep = []
            for r, rgen in block.reads:
                if rgen < gen and (not r.done or r.end_ns > start):
                    bad = (f"{item.kind} on stream {item.stream.sid} overwrote a "
                           f"{block.nbytes}-byte block (generation {gen}) while {r.kind} on "
                           f"stream {r.stream.sid} still read generation {rgen}")
                if not (r.done and rgen < gen):
                    keep.append((r, rgen))
            block.reads = keep
        if bad is not None:
            self.reuse_errors.append(bad)
            raise UseAfterReuse(f"use after reuse: {bad}")

    def _drain_to(self, target: _Item | None, *, sleep: bool = True) -> None:
        """Block the host until ``target`` (and everything before it, and its deps) ran."""
        if target is None or target.captured is not None:
            return
        with self._lock:
            self._advance()
            now = time.perf_counter_ns()
            pending = [i.host_ns for d in self._devs() for st in d.streams for i in st.pending]
            # The queued work runs from now on, with the spacing the host gave it (a real GPU
            # needs that long; the host waits at most sync_sleep_limit_s here).
            shift = max(0, now - min(pending)) if pending else 0
            latest = self._force(target, now, shift)
        wait_s = (latest - time.perf_counter_ns()) / 1e9
        if wait_s > 0 and sleep:
            # The host waits for GPU time to pass (e.g. a long simulated kernel).
            time.sleep(min(wait_s, self.sync_sleep_limit_s))

    def _force(self, target: _Item, now: int, shift: int) -> int:
        """Complete items up to ``target`` now, ignoring the lag (the host waits for them)."""
        s = target.stream
        q = s.pending
        latest = 0
        while not target.done:
            item = q[0]
            if item.dep is not None and not item.dep.done:
                latest = max(latest, self._force(item.dep, now, shift))
            start = self._start_ns(item, s, now)
            if start is None:
                # Not due yet: the GPU gets to it now, while the host waits.
                start = max(s.last_end_ns, item.host_ns + self.lag_ns + shift)
                if item.dep is not None:
                    start = max(start, item.dep.end_ns)
            self._complete(q, s, start + item.cost_ns)
            latest = max(latest, start + item.cost_ns)
        return latest

    # ---- memory -------------------------------------------------------------------------

    def _alloc(self, t: torch.Tensor, idx: int) -> None:
        n = t.untyped_storage().nbytes() if t.layout == torch.strided else t.numel() * t.element_size()
        d = self._dev(idx)
        with self._lock:
            self._ctx(idx, "alloc")
            d.allocated += n
            d.peak_allocated = max(d.peak_allocated, d.allocated)
            need = -(-d.allocated // _BLOCK) * _BLOCK
            if need > d.reserved:  # the caching allocator keeps what it reserved
                d.reserved = need
                d.peak_reserved = max(d.peak_reserved, d.reserved)
            block = self._take_block(d, n)
        setattr(t, _BLK, block)
        weakref.finalize(t, self._free, idx, n, block)

    def _take_block(self, d: _Device, n: int) -> _Block:
        """A block for ``n`` bytes on the current stream: a freed one of that stream when the
        pool has one (CUDACachingAllocator's get_free_block, after process_events returned
        the blocks whose record_stream events completed), else a new one."""
        stream = self._thread_streams().get(d.index) or d.default
        if d.deferred:
            self._advance()
            still = []
            for b in d.deferred:
                if all(e.done for e in b.events):
                    b.events = []
                    d.pool.setdefault((b.stream, b.nbytes), []).append(b)
                else:
                    still.append(b)
            d.deferred = still
        free = d.pool.get((stream, n))
        if free:
            b = free.pop()
            b.gen += 1
            return b
        return _Block(d.index, n, stream)

    def _free(self, idx: int, n: int, block: _Block) -> None:
        if self._devices is None:
            return
        with self._lock:
            d = self._devices[idx]
            d.allocated -= n
            uses, block.uses = block.uses, set()
            if uses:
                # CUDACachingAllocator::free -> insert_events: an event on every stream the
                # block was record_stream-ed for; reuse waits until they completed.
                block.events = [self._enqueue(s, "event") for s in uses]
                d.deferred.append(block)
            else:
                d.pool.setdefault((block.stream, block.nbytes), []).append(block)

    @contextlib.contextmanager
    def _raw(self) -> Iterator[None]:
        """The sim's own tensor work (copies, reads): not costed as kernels by the op mode."""
        tls = self._tls
        prev = getattr(tls, "raw", False)
        tls.raw = True
        try:
            yield
        finally:
            tls.raw = prev

    # ---- kernels from ops -----------------------------------------------------------------

    def _op_kernel(self, func: Any, args: Any, kwargs: Any, out: Any, ins: list[torch.Tensor]) -> None:
        """The kernel an op on simulated-device tensors enqueues: its outputs are on the
        device of its first device input, it reads its device inputs, writes its outputs,
        and costs max(FLOPs / rate, bytes moved / memory bandwidth) of GPU time.

        The FLOP count is torch.utils.flop_counter's formula for the op (matmuls,
        convolutions, attention: the ops that dominate a training step); every other op is
        bandwidth-bound. It runs on the current stream of that device, like every ATen CUDA
        kernel (at::cuda::getCurrentCUDAStream).
        """
        from torch.utils._pytree import tree_flatten
        from torch.utils.flop_counter import flop_registry

        idx = getattr(ins[0], _TAG)
        by_ptr = {}
        for t in ins:
            blk = getattr(t, _BLK, None)
            if blk is not None:
                with contextlib.suppress(Exception):
                    by_ptr[t.untyped_storage().data_ptr()] = (blk, t)
        nbytes = sum(t.numel() * t.element_size() for t in ins)
        writes = []
        for o in tree_flatten(out)[0]:
            if not isinstance(o, torch.Tensor):
                continue
            nbytes += o.numel() * o.element_size()
            blk = getattr(o, _BLK, None)
            if blk is None:
                try:
                    shared = by_ptr.get(o.untyped_storage().data_ptr())
                except Exception:
                    shared = None
                if shared is not None:  # a view or an in-place result: the input's memory
                    setattr(o, _TAG, idx)
                    setattr(o, _BLK, shared[0])
                    blk = shared[0]
                else:
                    self._tag(o, idx)
                    blk = getattr(o, _BLK)
            writes.append((blk, blk.gen))
        flops = 0
        f = flop_registry.get(getattr(func, "_overloadpacket", None))
        if f is not None:
            with contextlib.suppress(Exception):
                flops = int(f(*args, **kwargs, out_val=out))
        assert self.flops_per_ns is not None
        cost = int(max(flops / self.flops_per_ns, nbytes / self.op_bytes_per_ns))
        reads = tuple({id(b): (b, b.gen) for b, _t in by_ptr.values()}.values())
        with self._lock:
            s = self._thread_streams().get(idx) or self._dev(idx).default
            item = self._enqueue(s, "kernel", cost_ns=cost)
            item.reads, item.writes = reads, tuple(writes)
            self.kernels += 1

    def _push_op_mode(self) -> Any:
        """Make ops on this thread cost GPU time (a TorchDispatchMode: it sees every ATen op,
        forward, backward and optimizer alike). None when no FLOP rate is configured."""
        if self.flops_per_ns is None:
            return None
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        sim = self

        class _OpCost(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if getattr(sim._tls, "raw", False):
                    return out
                ins = [a for a in tree_flatten((args, kwargs))[0]
                       if isinstance(a, torch.Tensor) and getattr(a, _TAG, None) is not None]
                if ins:
                    sim._op_kernel(func, args, kwargs, out, ins)
                return out

        mode = _OpCost()
        mode.__enter__()
        return mode

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        d = self._dev(self._index(device))
        out: dict[str, int] = {}
        for kind, cur, peak in (("allocated_bytes", d.allocated, d.peak_allocated),
                                ("reserved_bytes", d.reserved, d.peak_reserved),
                                ("active_bytes", d.allocated, d.peak_allocated)):
            for pool in ("all", "large_pool", "small_pool"):
                full = pool == "all" or pool == "large_pool"
                out[f"{kind}.{pool}.current"] = cur if full else 0
                out[f"{kind}.{pool}.peak"] = peak if full else 0
                out[f"{kind}.{pool}.allocated"] = peak if full else 0
                out[f"{kind}.{pool}.freed"] = 0
        out["num_alloc_retries"] = 0
        out["num_ooms"] = 0
        out["num_device_alloc"] = 0
        out["num_device_free"] = 0
        return out

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        nested: dict[str, Any] = {}
        for key, value in self.memory_stats(device).items():
            node = nested
            parts = key.split(".")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = value
        return nested

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        d = self._dev(self._index(device))
        with self._lock:
            d.peak_allocated = d.allocated
            d.peak_reserved = d.reserved

    # ---- placement ----------------------------------------------------------------------

    def place(self, obj: Any, index: int = 0) -> Any:
        """Make a module's parameters/buffers, or a tensor, report ``cuda:index`` (no copy)."""
        idx = self._index(index)
        if isinstance(obj, nn.Module):
            for t in itertools.chain(obj.parameters(), obj.buffers()):
                self._tag(t, idx)
            self._placed = idx
            return obj
        if isinstance(obj, torch.Tensor):
            self._tag(obj, idx)
            return obj
        raise TypeError(f"place() takes an nn.Module or a torch.Tensor; got {type(obj).__name__}")

    def _tag(self, t: torch.Tensor, idx: int) -> torch.Tensor:
        if getattr(t, _TAG, None) != idx:
            setattr(t, _TAG, idx)
            self._alloc(t, idx)
        return t

    # ---- backward on a device thread ------------------------------------------------------

    def _backward_device(self) -> int:
        # The CUDA engine runs a node on the worker thread of its inputs' device; the sim does
        # not know a CPU tensor's device, so: the placed model's device, else the current one.
        return self._placed if self._placed is not None else self.current_device()

    def _worker(self, idx: int) -> _DeviceWorker:
        with self._lock:
            w = self._workers.get(idx)
            if w is None:
                w = self._workers[idx] = _DeviceWorker(self, idx)
            return w

    # ---- install / uninstall ------------------------------------------------------------

    def __enter__(self) -> CudaSim:
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner)
        self._patches.append((owner, name, vars(owner).get(name), had))
        setattr(owner, name, value)

    def install(self) -> CudaSim:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a CUDA simulator is already installed")
        self._t0 = time.perf_counter_ns()
        self._devs()
        _ACTIVE = self
        try:
            _install_patches(self)
            self._mode = self._push_op_mode()
        except BaseException:
            self.uninstall()
            raise
        return self

    def uninstall(self) -> None:
        global _ACTIVE
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        for w in list(self._workers.values()):
            w.stop()
        self._workers.clear()
        while self._patches:
            owner, name, old, had = self._patches.pop()
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        if _ACTIVE is self:
            _ACTIVE = None


class _DeviceWorker:
    """The autograd engine's worker thread for one device (one per device, like CUDA's)."""

    def __init__(self, sim: CudaSim, index: int) -> None:
        self.sim = sim
        self.index = index
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"cudasim-autograd-{index}",
                                       daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        # The CUDA engine's device thread calls set_device(device) once at start.
        self.sim._tls.device = self.index
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()

    def run(self, fn: Callable[[], Any]) -> Any:
        sim = self.sim
        grad_mode = torch.is_grad_enabled()
        streams = dict(sim._thread_streams())
        box: dict[str, Any] = {}
        done = threading.Event()

        def job() -> None:
            # Backward ops run on the streams their forward ops used (here: the caller's
            # current streams); grad mode travels with the engine's ThreadLocalState. Python
            # thread-locals of the caller do not.
            sim._tls.streams = streams
            sim._tls.device = self.index
            sim.backward_threads.append(threading.current_thread().name)
            mode = sim._push_op_mode()  # backward kernels cost GPU time too
            try:
                with torch.set_grad_enabled(grad_mode):
                    box["value"] = fn()
            except BaseException as exc:  # handed back to the caller, like the engine does
                box["error"] = exc
            finally:
                if mode is not None:
                    mode.__exit__(None, None, None)
                sim._tls.streams = {}
                done.set()

        self.jobs.put(job)
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)


# --------------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------------


class _DeviceContext:
    """``torch.cuda.device(d)``: switch the thread's current device for a block."""

    def __init__(self, device: Any) -> None:
        sim = _sim()
        if device is None or (isinstance(device, int) and device < 0):
            self.idx = -1
        else:
            self.idx = sim._index(device)
        self.prev = -1

    def __enter__(self) -> _DeviceContext:
        if self.idx >= 0:
            sim = _sim()
            self.prev = sim.current_device()
            sim._tls.device = self.idx
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.idx >= 0:
            _sim()._tls.device = self.prev


@contextlib.contextmanager
def _stream_context(stream: Stream | None) -> Iterator[Stream | None]:
    # torch.cuda.StreamContext: sets the stream (and its device) current, restores both after.
    if stream is None:
        yield None
        return
    sim = _sim()
    prev_device = sim.current_device()
    streams = sim._thread_streams()
    prev_stream = streams.get(stream._s.device)
    sim.set_stream(stream)
    try:
        yield stream
    finally:
        if prev_stream is None:
            streams.pop(stream._s.device, None)
        else:
            streams[stream._s.device] = prev_stream
        sim._tls.device = prev_device


def _cuda_index_of(device: Any) -> int | None:
    """The simulated index if ``device`` names CUDA, else None (CPU, meta...)."""
    if device is None:
        return None
    if isinstance(device, torch.Tensor):
        return getattr(device, _TAG, None)
    if isinstance(device, int) and not isinstance(device, bool):
        return _sim()._index(device)  # Tensor.to(0) means cuda:0
    dev = torch.device(device) if isinstance(device, str) else device
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return _sim()._index(dev)
    return None


def _parse_to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, bool, Any]:
    """``torch._C._nn._parse_to`` that also takes an int device (cuda:i) on the CPU build."""
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        args = (torch.device("cuda", args[0]), *args[1:])
    dev = kwargs.get("device")
    if isinstance(dev, int) and not isinstance(dev, bool):
        kwargs["device"] = torch.device("cuda", dev)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, bool(non_blocking), memory_format


def _install_patches(sim: CudaSim) -> None:
    cuda = torch.cuda
    p = sim._patch
    p(cuda, "is_available", lambda: True)
    p(cuda, "is_initialized", lambda: True)
    p(cuda, "init", lambda: None)
    p(cuda, "_lazy_init", lambda: None)
    p(cuda, "device_count", lambda: sim.n_devices)
    p(cuda, "current_device", sim.current_device)
    p(cuda, "set_device", sim.set_device)
    p(cuda, "device", _DeviceContext)
    p(cuda, "Stream", Stream)
    p(cuda, "ExternalStream", ExternalStream)
    p(cuda, "Event", Event)
    p(cuda, "current_stream", sim.current_stream)
    # torch._C._cuda_getCurrentRawStream(device): the cudaStream_t of the current stream.
    p(torch._C, "_cuda_getCurrentRawStream", sim.current_raw_stream)
    p(cuda, "default_stream", sim.default_stream)
    p(cuda, "set_stream", sim.set_stream)
    p(cuda, "stream", _stream_context)
    # torch.cuda.is_current_stream_capturing: cudaStreamIsCapturing on the current stream of
    # the calling thread only; another thread's capture is invisible to it.
    p(cuda, "is_current_stream_capturing", lambda: sim.current_stream()._s in sim._captures)
    p(cuda, "CUDAGraph", CUDAGraph)
    p(cuda, "graph", _GraphContext)

    def synchronize(device: Any = None) -> None:
        # torch.cuda.synchronize: ``with torch.cuda.device(device): cudaDeviceSynchronize()``,
        # the host waits for every stream of that device (the current one by default); it
        # creates the device's context if it had none.
        idx = sim._index(device)
        sim._prohibit("cudaDeviceSynchronize", device=idx)
        sim._ctx(idx, "synchronize")
        sim._count("device.synchronize")
        for s in sim._dev(idx).streams:
            sim._drain_to(s.last)

    p(cuda, "synchronize", synchronize)

    def _sleep(cycles: int) -> None:
        # torch.cuda._sleep: a kernel that spins ``cycles`` GPU clock cycles (clock_rate kHz).
        sim.kernel(cycles / (_DeviceProperties.CLOCK_RATE_KHZ * 1e3) * 1e3)

    p(cuda, "_sleep", _sleep)

    def get_device_name(device: Any = None) -> str:
        sim._index(device)
        return sim.name

    def get_device_properties(device: Any = None) -> _DeviceProperties:
        idx = sim._index(device)
        return _DeviceProperties(sim.name, sim.total_memory, idx, sim._dev(idx).uuid)

    p(cuda, "get_device_name", get_device_name)
    p(cuda, "get_device_properties", get_device_properties)
    def get_device_capability(device: Any = None) -> tuple[int, int]:
        sim._index(device)
        return (9, 0)

    p(cuda, "get_device_capability", get_device_capability)
    p(cuda, "memory_stats", sim.memory_stats)
    p(cuda, "memory_stats_as_nested_dict", sim.memory_stats_as_nested_dict)
    p(cuda, "reset_peak_memory_stats", sim.reset_peak_memory_stats)
    p(cuda, "reset_max_memory_allocated", sim.reset_peak_memory_stats)
    p(cuda, "memory_allocated", lambda device=None: sim._dev(sim._index(device)).allocated)
    p(cuda, "max_memory_allocated",
      lambda device=None: sim._dev(sim._index(device)).peak_allocated)
    p(cuda, "memory_reserved", lambda device=None: sim._dev(sim._index(device)).reserved)
    p(cuda, "max_memory_reserved", lambda device=None: sim._dev(sim._index(device)).peak_reserved)

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        d = sim._dev(sim._index(device))
        sim._ctx(d.index, "mem_get_info")  # cudaMemGetInfo runs in the device's context
        return (sim.total_memory - d.reserved, sim.total_memory)

    p(cuda, "mem_get_info", mem_get_info)
    p(cuda, "empty_cache", lambda: None)

    # torch.accelerator: the device-generic API (DataLoader pinning, DDP's copy streams).
    acc = torch.accelerator
    p(acc, "is_available", lambda: True)
    p(acc, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    p(acc, "device_count", lambda: sim.n_devices)
    p(acc, "current_device_index", sim.current_device)
    p(acc, "current_device_idx", sim.current_device)
    p(acc, "set_device_index", sim.set_device)
    p(acc, "set_device_idx", sim.set_device)
    p(acc, "synchronize", synchronize)
    p(acc, "current_stream", sim.current_stream)
    p(acc, "set_stream", sim.set_stream)
    p(acc, "memory_allocated", cuda.memory_allocated)
    p(acc, "max_memory_allocated", cuda.max_memory_allocated)
    p(acc, "memory_reserved", cuda.memory_reserved)
    p(acc, "max_memory_reserved", cuda.max_memory_reserved)
    p(acc, "memory_stats", sim.memory_stats)
    p(acc, "reset_peak_memory_stats", sim.reset_peak_memory_stats)
    p(acc, "empty_cache", lambda: None)

    _patch_tensor(sim)
    _patch_module(sim)
    _patch_factories(sim)
    _patch_autograd(sim)
    _patch_import_time_copies(sim)


def _patch_import_time_copies(sim: CudaSim) -> None:
    """Point copies of torch functions that stepscope took at import time at the sim's.

    ``stepscope/instrument/h2d.py`` keeps ``_orig_to = torch.Tensor.to`` (and ``_orig_cuda``,
    ``_parse_to``) from its import, calls them inside a step, and its ``_restore()`` assigns
    them back to ``torch.Tensor``. Imported before the sim, they would bypass it (a CPU-build
    ``to("cuda")`` raises); imported during it, they would keep the sim's methods after
    uninstall. So: import the instrument modules now (their copies are the real functions),
    then swap every module-level copy found in a loaded ``stepscope`` module for the run.
    """
    import importlib
    import pkgutil
    import sys

    try:
        import stepscope.instrument as instrument
    except ImportError:
        return
    for info in pkgutil.iter_modules(instrument.__path__, "stepscope.instrument."):
        try:
            importlib.import_module(info.name)
        except Exception:  # a module that needs an optional extra: it copies nothing we need
            continue
    T = torch.Tensor
    swaps = {
        id(_REAL["to"]): T.to,
        id(_REAL["cuda"]): T.cuda,
        id(torch._C._nn._parse_to): lambda *a, **k: _parse_to(a, k),
    }
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "stepscope" or name.startswith("stepscope.")):
            continue
        for attr, value in list(vars(mod).items()):
            new = swaps.get(id(value))
            if new is not None and value is not new:
                sim._patch(mod, attr, new)


_REAL = {"to": torch._C.TensorBase.to, "cuda": torch._C.TensorBase.cuda}


def _patch_tensor(sim: CudaSim) -> None:
    T = torch.Tensor
    p = sim._patch
    base_device = torch._C.TensorBase.device
    orig_to = T.to
    orig_is_pinned = T.is_pinned
    orig_item, orig_tolist, orig_numpy = T.item, T.tolist, T.numpy
    orig_get_device = T.get_device

    def device(self: torch.Tensor) -> torch.device:
        idx = getattr(self, _TAG, None)
        if idx is None:
            return base_device.__get__(self)
        return torch.device("cuda", idx)

    p(T, "device", property(device))
    p(T, "is_cuda", property(lambda self: getattr(self, _TAG, None) is not None))
    p(T, "get_device", lambda self: getattr(self, _TAG, None)
      if getattr(self, _TAG, None) is not None else orig_get_device(self))

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = args[0] if args else kwargs.get("device", kwargs.get("other"))
        if isinstance(target, torch.dtype) or (target is None and "device" not in kwargs
                                               and "other" not in kwargs):
            src = getattr(self, _TAG, None)
            out = orig_to(self, *args, **kwargs)
            if src is not None and out is not self:
                sim._tag(out, src)
            return out
        if isinstance(target, torch.Tensor):
            idx = getattr(target, _TAG, None)
            dtype = target.dtype
            non_blocking = bool(args[1] if len(args) > 1 else kwargs.get("non_blocking", False))
            copy = bool(args[2] if len(args) > 2 else kwargs.get("copy", False))
            memory_format = None
        else:
            dev, dtype, non_blocking, memory_format = _parse_to(args, kwargs)
            copy = bool(kwargs.get("copy", False))
            if dev is None or dev.type not in ("cuda", "cpu"):
                return orig_to(self, *args, **kwargs)
            idx = _cuda_index_of(dev)
        return _move(sim, self, idx, dtype=dtype, non_blocking=bool(non_blocking), copy=copy,
                     memory_format=memory_format)

    p(T, "to", to)

    def cuda_(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
              memory_format: Any = torch.preserve_format) -> torch.Tensor:
        idx = sim._index(device)
        return _move(sim, self, idx, dtype=None, non_blocking=non_blocking, copy=False,
                     memory_format=memory_format)

    p(T, "cuda", cuda_)
    p(T, "cpu", lambda self, memory_format=torch.preserve_format: _move(
        sim, self, None, dtype=None, non_blocking=False, copy=False, memory_format=memory_format))

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        # Tensor.pin_memory returns a copy in page-locked host memory (self if already pinned).
        if getattr(self, _TAG, None) is not None:
            raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
        if getattr(self, _PIN, False):
            return self
        out = self.clone()
        setattr(out, _PIN, True)
        return out

    p(T, "pin_memory", pin_memory)
    p(T, "is_pinned", lambda self, device=None: bool(getattr(self, _PIN, False))
      if getattr(self, _TAG, None) is None else False)
    del orig_is_pinned

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        # Tensor.record_stream tells the caching allocator a stream uses the block; no timing.
        if not isinstance(stream, Stream):
            raise TypeError(f"record_stream expects a torch.cuda.Stream; got {type(stream).__name__}")
        blk = getattr(self, _BLK, None)
        if blk is not None and stream._s is not blk.stream:
            # CUDACachingAllocator::recordStream: a use on another stream than the block's
            # own (ignored for that one); free() then defers the reuse (see _Block).
            blk.uses.add(stream._s)

    p(T, "record_stream", record_stream)

    def blocking_read(orig: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            idx = getattr(self, _TAG, None)
            if idx is not None:
                # A D2H read (.item(), .tolist()) waits for the current stream: a host sync.
                sim._count(kind)
                sim._drain_to(sim.current_stream(idx)._s.last)
            with sim._raw():
                return orig(self, *args, **kwargs)

        return read

    p(T, "item", blocking_read(orig_item, "item"))
    p(T, "tolist", blocking_read(orig_tolist, "tolist"))

    def numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        idx = getattr(self, _TAG, None)
        if idx is not None:
            raise TypeError(f"can't convert cuda:{idx} device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first.")
        return orig_numpy(self, *args, **kwargs)

    p(T, "numpy", numpy)
    sim._orig_to = orig_to  # type: ignore[attr-defined]


def _move(sim: CudaSim, t: torch.Tensor, idx: int | None, *, dtype: Any, non_blocking: bool,
          copy: bool, memory_format: Any) -> torch.Tensor:
    """``t`` moved to simulated device ``idx`` (None: host), with the copy's GPU work."""
    orig_to = sim._orig_to  # type: ignore[attr-defined]
    src = getattr(t, _TAG, None)
    kw: dict[str, Any] = {}
    if memory_format is not None:
        kw["memory_format"] = memory_format
    if src == idx:
        # Same place: torch returns self unless a dtype change or copy=True asks otherwise.
        out = orig_to(t, dtype=dtype if dtype is not None else t.dtype, copy=copy, **kw)
        if out is not t and idx is not None:
            sim._tag(out, idx)
        return out
    with sim._raw():
        out = orig_to(t, dtype=dtype if dtype is not None else t.dtype, copy=True, **kw)
    nbytes = t.numel() * t.element_size()
    cost = int(nbytes / sim.copy_bytes_per_ns)
    if idx is not None and src is None:
        # Host to device, enqueued on the target device's current stream, into memory the
        # caching allocator gives out on that stream (a freed block of it may be reused).
        stream = sim.current_stream(idx)
        sim._tag(out, idx)
        blk = getattr(out, _BLK)
        with sim._lock:
            item = sim._enqueue(stream._s, "h2d", cost_ns=cost)
            item.writes = ((blk, blk.gen),)
        pinned = bool(getattr(t, _PIN, False))
        blocking = not (pinned and non_blocking)
        sim.copies.append(("h2d", nbytes, blocking))
        if blocking:
            # copy_(non_blocking=False) ends with cudaStreamSynchronize; a pageable source
            # makes cudaMemcpyAsync synchronous (staged through a bounce buffer): both block
            # the host until the stream has drained up to the copy.
            sim._count("h2d.pageable" if not pinned else "h2d.blocking")
            sim._drain_to(item)
        sim._tag(out, idx)
        return out
    if idx is not None and src is not None:
        # Device to device (peer copy): async on the current stream of the target device.
        stream = sim.current_stream(idx)
        sim._tag(out, idx)
        blk = getattr(out, _BLK)
        with sim._lock:
            item = sim._enqueue(stream._s, "d2d", cost_ns=cost)
            item.writes = ((blk, blk.gen),)
            item.reads = tuple((b, b.gen) for b in [getattr(t, _BLK, None)] if b is not None)
        sim.copies.append(("d2d", nbytes, False))
        return out
    # Device to host.
    assert src is not None
    sim.copies.append(("d2h", nbytes, not non_blocking))
    stream = sim.current_stream(src)
    with sim._lock:
        item = sim._enqueue(stream._s, "d2h", cost_ns=cost)
        item.reads = tuple((b, b.gen) for b in [getattr(t, _BLK, None)] if b is not None)
    if not non_blocking:
        sim._count("d2h")  # copy to pageable host memory: the host waits for the stream
        sim._drain_to(item)
    return out


def _patch_module(sim: CudaSim) -> None:
    M = nn.Module
    orig_to, orig_cpu = M.to, M.cpu

    def tensors(m: nn.Module) -> Iterator[torch.Tensor]:
        return itertools.chain(m.parameters(), m.buffers())

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        dev, dtype, _non_blocking, memory_format = _parse_to(args, kwargs)
        idx = _cuda_index_of(dev)
        if idx is None:
            if dev is not None and dev.type == "cpu":
                _untag_module(sim, self)
            return orig_to(self, *args, **kwargs)
        keep: list[Any] = [] if dtype is None else [dtype]
        if dtype is not None or memory_format is not None:
            orig_to(self, *keep, **({"memory_format": memory_format} if memory_format else {}))
        for t in tensors(self):
            if getattr(t, _TAG, None) is None:
                # Module.to copies every parameter from pageable memory: each one blocks.
                sim._count("h2d.pageable")
                sim.copies.append(("h2d", t.numel() * t.element_size(), True))
            sim._tag(t, idx)
        sim._placed = idx
        return self

    def cuda_(self: nn.Module, device: Any = None) -> nn.Module:
        return to(self, torch.device("cuda", sim._index(device)))

    def cpu(self: nn.Module) -> nn.Module:
        _untag_module(sim, self)
        return orig_cpu(self)

    sim._patch(M, "to", to)
    sim._patch(M, "cuda", cuda_)
    sim._patch(M, "cpu", cpu)


def _untag_module(sim: CudaSim, m: nn.Module) -> None:
    for t in itertools.chain(m.parameters(), m.buffers()):
        if getattr(t, _TAG, None) is not None:
            sim._count("d2h")
            delattr(t, _TAG)


_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "tensor",
              "as_tensor", "empty_strided", "linspace", "randperm")
_LIKE = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like")


def _patch_factories(sim: CudaSim) -> None:
    """``torch.zeros(..., device="cuda")`` and friends: a CPU tensor tagged with the device."""

    def wrap(orig: Callable[..., torch.Tensor], like: bool) -> Callable[..., torch.Tensor]:
        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            dev = kwargs.get("device")
            idx = _cuda_index_of(dev) if dev is not None else None
            if dev is None and like and args and isinstance(args[0], torch.Tensor):
                idx = getattr(args[0], _TAG, None)
            if idx is not None:
                kwargs["device"] = "cpu"
            pin = kwargs.get("pin_memory", False)
            if pin:
                kwargs["pin_memory"] = False
            out = orig(*args, **kwargs)
            if idx is not None:
                sim._tag(out, idx)
            elif pin:
                setattr(out, _PIN, True)
            return out

        return factory

    for name in _FACTORIES:
        sim._patch(torch, name, wrap(getattr(torch, name), False))
    for name in _LIKE:
        sim._patch(torch, name, wrap(getattr(torch, name), True))


def _patch_autograd(sim: CudaSim) -> None:
    import torch.autograd as autograd
    import torch.autograd.graph as graph

    orig = autograd._engine_run_backward

    def engine_run_backward(*args: Any, **kwargs: Any) -> Any:
        here = threading.current_thread()
        if any(w.thread is here for w in list(sim._workers.values())):
            # Re-entrant backward (e.g. reentrant checkpointing) runs on the same device thread.
            return orig(*args, **kwargs)
        # torch.autograd.backward/grad (and Tensor.backward through them) hand the graph to
        # the engine; on CUDA the device's worker thread runs it while the caller blocks.
        return sim._worker(sim._backward_device()).run(lambda: orig(*args, **kwargs))

    sim._patch(autograd, "_engine_run_backward", engine_run_backward)
    sim._patch(graph, "_engine_run_backward", engine_run_backward)


__all__ = ["CUDAGraph", "CudaSim", "Event", "Stream", "UseAfterReuse", "Work", "active", "install"]

