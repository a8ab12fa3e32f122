"""Beyond time: throughput, FLOPs/MFU, memory and device health for each sampled step.

The tracer owns one :class:`ResourceMonitor` and calls it at three points:

* ``on_step_start(index)`` (training thread, sampled steps only): on the step chosen for
  FLOP counting, starts the counter.
* ``on_step_end(index) -> snapshot`` (training thread): stops the counter and reads the
  allocator's peak/current bytes and the process RSS. The tracer keeps the snapshot on the step.
* ``step_fields(index, start_unix_ns, step_ms, counters, snapshot) -> dict`` (writer thread,
  at resolve time): builds the record's ``throughput``/``flops``/``memory``/``device``
  sections (and ``untimed`` for the FLOP-counted step). It pops ``tokens``/``samples`` from
  ``counters`` (filled by ``step(tokens=, samples=)`` and ``count(...)``).

What is read where, and why none of it waits for the GPU:

* CUDA memory: ``torch.cuda.memory_stats_as_nested_dict`` (the dict ``max_memory_allocated``,
  ``max_memory_reserved`` and ``memory_allocated`` are flattened from) only reads the caching
  allocator's host-side counters under its mutex (``CUDACachingAllocator``'s
  ``getDeviceStats``): no ``cudaDeviceSynchronize``, no event query, no stream wait. The peak
  counters are never reset: they are process-wide, and the job's own memory metrics (HF's
  ``TrainerMemoryTracker``, torchtitan's ``DeviceMemoryMonitor``) reset and read them on their
  own schedule. So ``peak_allocated_mb``/``peak_reserved_mb`` are the running high-water marks
  (since the process started or the job last reset them) read at the step's end, and
  ``allocated_mb`` is what the step left allocated; a step that sets a new high shows it as a
  rise of the peak. The allocator keeps no second peak counter to reset privately.
  The counters describe allocations as the host issued them, which is what
  limits memory. ``tests/unit/instrument/test_resource_sampler.py`` runs this code against fakes whose
  ``synchronize`` raises. Alloc retries and OOMs are read on the writer thread at flush cadence.
* Host memory: process RSS at each sampled step's end from one ``pread`` of
  ``/proc/self/statm`` (~1.5 µs; elsewhere psutil on the writer thread, at most every
  ``RSS_EVERY_S``), and the summed RSS of DataLoader worker processes (psutil, writer thread,
  every ``WORKERS_EVERY_S``; the children come from ``/proc/self/task/*/children``).
* Device health (NVML, extra ``gpu``): a daemon thread samples utilisation, SM clock, power
  and temperature every ``NVML_INTERVAL_S``; a step gets the mean of the samples taken during
  it, or else the sample nearest to it in time (within one interval). Without NVML the
  ``device`` section is absent; a metric whose NVML call fails stops alone.

Fields never measured are absent, never 0.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from stepscope.common.errors import warn
from stepscope.common.robust import median
from stepscope.instrument.flops import FlopCount, device_key, peak_tflops, warn_unknown_peak
from stepscope.recording.devices import resolve

MB = float(1 << 20)
#: Seconds between NVML samples.
NVML_INTERVAL_S = 0.5
#: Minimum seconds between process RSS reads (writer thread).
RSS_EVERY_S = 0.05
#: Minimum seconds between DataLoader worker scans (psutil per worker).
WORKERS_EVERY_S = 1.0
#: Minimum seconds between reads of alloc retries / OOMs (writer thread, flush cadence).
ALLOC_STATS_EVERY_S = 0.05

COUNT_NAMES = ("tokens", "samples")


# --------------------------------------------------------------------- validation


#: Largest count per step accepted (2^53: exact as a float in every JSON reader).
MAX_COUNT = 1 << 53
#: Counts from here on have no float (past ~1.8e308): dropped.
MAX_FLOAT_COUNT = 1 << 1024


def _flop_count(flops: float) -> int | float:
    """An int while JSON readers hold it in 64 bits, else a float (4e19 FLOPs is real)."""
    return int(flops) if flops < 2**63 else float(flops)


def shown_value(value: Any) -> str:
    """A bad argument in a warning: short, and never an error itself (``str(10**5000)`` is)."""
    if isinstance(value, int):
        return f"{value}" if abs(value) < 10**40 else f"an int of {value.bit_length()} bits"
    try:
        return repr(value)[:40]
    except Exception:  # protect the job: a value whose repr fails is named by its type
        return f"a {type(value).__name__}"


def check_count(name: str, value: Any, warn_once: Callable[[str, str], None]) -> int | float | None:
    """``value`` as the count to record, or ``None`` to record none; never raises.

    An int in ``0..2^53`` (numpy ints too) is kept; a larger one is kept as a float (no JSON
    reader holds more exactly), warned once. Anything else (negative, a bool, a float, NaN, not
    a number) is dropped, warned once: a bad count must never stop the training job.
    """
    if type(value) is int and 0 <= value <= MAX_COUNT:  # the usual case
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        count = int(value)
        if 0 <= count <= MAX_COUNT:
            return count
        if MAX_COUNT < count < MAX_FLOAT_COUNT:
            warn_once(f"{name}={shown_value(count)} is past 2^53 per step; recorded as a float "
                      f"(rounded to 53 bits)", f"count-float:{name}")
            return float(count)
    warn_once(f"{name} must be an int in 0..2^53 per step; got {shown_value(value)} "
              f"({type(value).__name__}); not counted", f"count-bad:{name}")
    return None


def check_counts(tokens: Any, samples: Any, warn_once: Callable[[str, str], None]
                 ) -> tuple[int | float | None, int | float | None] | None:
    """``step(tokens=, samples=)`` as counts (:func:`check_count`); ``None`` when neither was given."""
    if tokens is None and samples is None:
        return None
    return (
        None if tokens is None else check_count("tokens", tokens, warn_once),
        None if samples is None else check_count("samples", samples, warn_once),
    )


def warn_outside_step(name: str) -> None:
    warn(f"count({name!r}, ...) called outside a step; ignored (call it inside "
         "`with stepscope.step():`)", stacklevel=3)


# --------------------------------------------------------------------- back ends


class CudaMemory(Protocol):
    def read(self) -> tuple[int, int, int]: ...  # peak allocated, peak reserved, allocated

    def alloc_stats(self) -> tuple[int, int]: ...  # alloc retries, OOMs (cumulative)


class TorchCudaMemory:
    """The caching allocator's counters for one device (host-side reads only, see module doc)."""

    def __init__(self, index: int) -> None:
        import torch

        self.index = index
        self._cuda = torch.cuda

    def read(self) -> tuple[int, int, int]:
        # One C++ call returning the nested dict; max_memory_allocated() & co. each build and
        # flatten this same dict, so reading it once costs a third.
        s = self._cuda.memory_stats_as_nested_dict(self.index)
        alloc = s["allocated_bytes"]["all"]  # KeyError before CUDA init: the monitor stops it
        return int(alloc["peak"]), int(s["reserved_bytes"]["all"]["peak"]), int(alloc["current"])

    def alloc_stats(self) -> tuple[int, int]:
        s = self._cuda.memory_stats(self.index)
        return int(s.get("num_alloc_retries", 0)), int(s.get("num_ooms", 0))


class HostMemory:
    """Process RSS and DataLoader workers' RSS through psutil."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.proc = psutil.Process()
        try:
            self._cmd = self.proc.cmdline()
        except Exception:  # an unreadable cmdline only weakens worker matching
            self._cmd = []

        # /proc/self/statm read with one pread (~1.5 µs, vs ~10 µs for psutil): cheap enough
        # for the training thread, so each step gets its own RSS at its end (Linux only).
        self._statm: int | None = None
        self._page = 4096
        with contextlib.suppress(Exception):
            self._page = os.sysconf("SC_PAGE_SIZE")
            self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        self.fast_rss = self._fast_rss if self._statm is not None else None

    def _fast_rss(self) -> int:
        return int(os.pread(self._statm, 128, 0).split()[1]) * self._page  # type: ignore[arg-type]

    def rss_bytes(self) -> int:
        return int(self.proc.memory_info().rss)

    def close(self) -> None:
        if self._statm is not None:
            with contextlib.suppress(OSError):
                os.close(self._statm)
            self._statm = None
            self.fast_rss = None

    def _children(self) -> list[Any]:
        """This process's children. Linux lists them per thread in ``/proc/self/task/*/children``
        (a few small reads); psutil's ``children()`` reads every process's stat in ``/proc``
        (~3 ms on a busy host, on the writer thread while it holds the GIL)."""
        try:
            pids: list[int] = []
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/children", "rb") as fh:
                    pids.extend(int(p) for p in fh.read().split())
        except OSError:  # no such file (not Linux, or a kernel without it): the slow scan
            return list(self.proc.children(recursive=False))
        out = []
        for pid in pids:
            try:
                out.append(self._psutil.Process(pid))
            except self._psutil.Error:
                continue  # exited meanwhile
        return out

    def workers_rss_bytes(self) -> int | None:
        """Summed RSS of child processes that look like DataLoader workers; ``None`` if none.

        Workers are forked (same command line as this process) or spawned through
        ``multiprocessing``; compile workers and other helpers are left out. Shared pages
        count once per worker, so the sum overstates unique memory.
        """
        total, seen = 0, 0
        for child in self._children():
            try:
                cmd = child.cmdline()
                if "compile_worker" in " ".join(cmd):
                    continue
                if cmd != self._cmd and not any("multiprocessing" in c for c in cmd):
                    continue
                total += int(child.memory_info().rss)
                seen += 1
            except self._psutil.Error:
                continue  # exited meanwhile
        return total if seen else None


# --------------------------------------------------------------------- NVML sampler

_NVML_METRICS = ("util_pct", "sm_clock_mhz", "power_w", "temp_c")


def _nvml_readers(nvml: Any, handle: Any) -> dict[str, Callable[[], float]]:
    return {
        "util_pct": lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        "sm_clock_mhz": lambda: float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # mW
        "temp_c": lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
    }


def _nvml_handle(nvml: Any, index: int) -> Any:
    """NVML's handle for CUDA device ``index`` (by UUID: CUDA_VISIBLE_DEVICES renumbers)."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
    except Exception:  # fall back to the index through CUDA_VISIBLE_DEVICES
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        phys = int(ids[index]) if index < len(ids) and ids[index].isdigit() else index
        return nvml.nvmlDeviceGetHandleByIndex(phys)


class NvmlSampler:
    """Background thread sampling NVML every ``interval_s``; ``window()`` averages a time span.

    Every reader runs in its own ``try``: one failing metric is dropped (with one warning),
    the others go on; when none is left the thread ends.
    """

    def __init__(self, readers: dict[str, Callable[[], float]], interval_s: float = NVML_INTERVAL_S,
                 maxlen: int = 1200) -> None:
        self.readers = dict(readers)
        self.interval_s = interval_s
        self.interval_ns = int(interval_s * 1e9)
        self.samples: deque[tuple[int, dict[str, float]]] = deque(maxlen=maxlen)
        self.failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepscope-nvml", daemon=True)

    def start(self) -> NvmlSampler:
        self._thread.start()
        return self

    def sample_once(self) -> None:
        vals: dict[str, float] = {}
        for name, read in list(self.readers.items()):
            try:
                vals[name] = read()
            except Exception as exc:  # protect the job: this metric stops alone
                del self.readers[name]
                self.failed[name] = repr(exc)
                warn(f"NVML {name} stopped after an error: {exc!r}", stacklevel=2)
        if vals:
            with self._lock:
                self.samples.append((time.time_ns(), vals))

    def _run(self) -> None:
        while not self._stop.is_set() and self.readers:
            self.sample_once()
            self._stop.wait(self.interval_s)

    def window(self, start_ns: int, end_ns: int) -> dict[str, float]:
        """Mean of the samples taken in ``[start_ns, end_ns]``, else the nearest one within an interval."""
        with self._lock:
            samples = list(self.samples)
        inside = [v for t, v in samples if start_ns <= t <= end_ns]
        if not inside:
            best: tuple[int, dict[str, float]] | None = None
            for t, v in samples:
                d = start_ns - t if t < start_ns else t - end_ns
                if d <= self.interval_ns and (best is None or d < best[0]):
                    best = (d, v)
            inside = [best[1]] if best else []
        out: dict[str, float] = {}
        for name in _NVML_METRICS:
            vals = [v[name] for v in inside if name in v]
            if vals:
                out[name] = round(sum(vals) / len(vals), 1)
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


def start_nvml(index: int, nvml: Any = None, interval_s: float = NVML_INTERVAL_S) -> NvmlSampler | None:
    """A started sampler for CUDA device ``index``; ``None`` when NVML is missing or fails."""
    try:
        if nvml is None:
            import pynvml  # from nvidia-ml-py (extra "gpu")

            nvml = pynvml
        nvml.nvmlInit()
        handle = _nvml_handle(nvml, index)
    except Exception:  # no NVML (not installed, no driver): the section is absent
        return None
    sampler = NvmlSampler(_nvml_readers(nvml, handle), interval_s)
    sampler.sample_once()
    return sampler.start() if sampler.readers else None


# --------------------------------------------------------------------- the monitor


def _sig(x: float, digits: int = 5) -> float:
    """``x`` rounded to ``digits`` significant digits (TFLOP/s spans 1e-6 on CPU to 1e3)."""
    return float(f"{x:.{digits}g}")


def _cuda_index(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    _, _, idx = device.partition(":")
    if idx.isdigit():
        return int(idx)
    # The rank's device (LOCAL_RANK, else current), as the clock and PrefetchLoader pick it.
    return resolve(warn=False)


class ResourceMonitor:
    """Per-step throughput, FLOPs/MFU, memory and device health for one tracer.

    ``flops_per_step``/``model_flops``/``peak_tflops`` come from ``Config``. The back ends
    (``cuda``, ``host``, ``nvml``) are injectable for tests; by default CUDA memory and NVML
    are used when ``device`` is ``cuda[:N]``, and host memory always (when psutil imports).

    Example::

        mon = ResourceMonitor(flops_per_step=6e9, device="cpu", peak_tflops=1.0)
        mon.on_step_start(0); ...; snap = mon.on_step_end(0)
        rec.update(mon.step_fields(0, t0_ns, 12.5, {"tokens": 4096}, snap))
    """

    def __init__(
        self,
        *,
        device: str,
        flops_per_step: float | None = None,
        model_flops: str | None = None,
        peak_tflops: float | None = None,
        device_name: str | None = None,
        cuda: CudaMemory | None = None,
        host: Any = None,
        nvml: Any = None,
        nvml_interval_s: float = NVML_INTERVAL_S,
    ) -> None:
        self.device = device
        index = _cuda_index(device)
        if cuda is None and index is not None:
            cuda = TorchCudaMemory(index)
        self.cuda = cuda
        if host is None:
            with contextlib.suppress(Exception):  # psutil missing: host memory is absent
                host = HostMemory()
        self.host = host
        self._fast_rss: Callable[[], int] | None = getattr(host, "fast_rss", None) if host else None
        self._rss_at = -1e9
        self._rss_last: int | None = None
        self._rss_snap: tuple[None, int | None, bool] = (None, None, False)
        self.sampler: NvmlSampler | None = None
        if index is not None or nvml is not None:
            self.sampler = start_nvml(index or 0, nvml, nvml_interval_s)
        if device_name is None:
            device_name = "cpu"
            if index is not None:
                import torch

                device_name = torch.cuda.get_device_name(index)
        self.device_name = device_name
        # FLOPs: the user's number, or counted on the first sampled step.
        self.flops_per_step: float | None = flops_per_step
        self.peak: float | None = peak_tflops
        want_flops = flops_per_step is not None or model_flops == "auto"
        known_device = device_key(device_name) is not None
        self._known_device = known_device
        # Counting also tells the dtype the peak depends on: needed for a table lookup.
        #: True while :meth:`on_step_start` has work to do (the step chosen for the FLOP
        #: count): the session calls it only then, not on every step.
        self.starts_pending = want_flops and (
            model_flops == "auto" or (self.peak is None and known_device)
        )
        self._set_total = model_flops == "auto"
        self._counter: FlopCount | None = None
        self.counted_step: int | None = None
        if want_flops and self.peak is None and not known_device:
            warn_unknown_peak(device_name, None)
        self._rss: tuple[float, int | None] = (0.0, None)
        self._workers: tuple[float, int | None] = (-1e9, None)
        self._alloc: tuple[float, tuple[int, int] | None] = (0.0, None)

    # ---------------------------------------------------------------- hot path

    def on_step_start(self, index: int) -> None:
        """Training thread, at a sampled step's entry."""
        if self.starts_pending:
            self.starts_pending = False
            try:
                counter = FlopCount()
                counter.start()
                self._counter, self.counted_step = counter, index
            except Exception as exc:  # protect the job: no FLOP count, timing goes on
                self._stop_metric("FLOP counting", exc)

    def _stop_metric(self, what: str, exc: BaseException) -> None:
        warn(f"{what} stopped after an error: {exc!r}", stacklevel=3)

    def on_step_end(self, index: int) -> Any:
        """Training thread, at a sampled step's exit; the returned snapshot goes to ``step_fields``."""
        counted = False
        if self._counter is not None:
            counter, self._counter = self._counter, None
            try:
                counter.stop()
                counted = True
                self._counted(counter)
            except Exception as exc:  # protect the job
                self._stop_metric("FLOP counting", exc)
        mem = None
        if self.cuda is not None:
            try:
                mem = self.cuda.read()
            except Exception as exc:  # protect the job: memory fields stop, timing goes on
                self.cuda = None
                self._stop_metric("CUDA memory", exc)
        rss = None
        if self._fast_rss is not None:
            # At most one read per RSS_EVERY_S: short steps reuse the last value (memory
            # creep is a trend over the run), so the read stays off most steps' hot path.
            now = time.monotonic()
            if now - self._rss_at < RSS_EVERY_S:
                rss = self._rss_last
            else:
                try:
                    rss = self._rss_last = self._fast_rss()
                    self._rss_at = now
                except Exception:  # protect the job: RSS falls back to the writer thread's psutil
                    self._fast_rss = None
        if mem is None and not counted:
            if rss is None:
                return None
            # The usual CPU step: the same RSS as the last read (rate-limited): the same
            # (immutable) snapshot, not a new tuple per step.
            snap = self._rss_snap
            if snap[1] is not rss:
                snap = self._rss_snap = (None, rss, False)
            return snap
        return (mem, rss, counted)

    def _counted(self, counter: FlopCount) -> None:
        if self._set_total:
            self.flops_per_step = float(counter.total or 0) or None
        if self.peak is None and self._known_device:
            peak = peak_tflops(self.device_name, counter.dtype) if counter.dtype else None
            if peak is None:
                warn_unknown_peak(self.device_name, counter.dtype)
            self.peak = peak

    # ------------------------------------------------------------- writer side

    def step_fields(
        self,
        index: int,
        start_unix_ns: int,
        step_ms: float,
        counters: dict[str, float],
        snapshot: Any,
    ) -> dict[str, Any]:
        """The record's ``throughput``/``flops``/``memory``/``device`` (and ``untimed``) keys."""
        out: dict[str, Any] = {}
        mem, rss, counted = snapshot if snapshot is not None else (None, None, False)
        secs = step_ms / 1000.0
        thr: dict[str, Any] = {}
        for name in COUNT_NAMES:
            if name in counters:
                n = int(counters.pop(name))
                thr[name] = n
                if secs > 0 and not counted:
                    thr[f"{name}_per_s"] = round(n / secs, 3)
        if thr:
            out["throughput"] = thr
        if counted:
            out["untimed"] = True
            if self.flops_per_step is not None:
                out["flops"] = {"per_step": _flop_count(self.flops_per_step), "counted_step": True}
        elif self.flops_per_step is not None and secs > 0 and (
            self.counted_step is None or index > self.counted_step or not self._set_total
        ):
            tflops = self.flops_per_step / secs / 1e12
            fl: dict[str, Any] = {"per_step": _flop_count(self.flops_per_step), "tflops": _sig(tflops)}
            if self.peak:
                fl["mfu"] = _sig(tflops / self.peak)
            out["flops"] = fl
        memory: dict[str, Any] = {}
        if mem is not None:
            memory["peak_allocated_mb"] = round(mem[0] / MB, 3)
            memory["peak_reserved_mb"] = round(mem[1] / MB, 3)
            memory["allocated_mb"] = round(mem[2] / MB, 3)
            stats = self._alloc_stats()
            if stats is not None:
                memory["alloc_retries"], memory["ooms"] = stats
        self._host_fields(memory, rss)
        if memory:
            out["memory"] = memory
        if self.sampler is not None:
            dev = self.sampler.window(start_unix_ns, start_unix_ns + int(step_ms * 1e6))
            if dev:
                # The record's device *name* is ``device_name``; ``device`` is health only.
                out["device"] = dict(dev)
        return out

    def _alloc_stats(self) -> tuple[int, int] | None:
        now = time.monotonic()
        if self._alloc[1] is None or now - self._alloc[0] >= ALLOC_STATS_EVERY_S:
            try:
                self._alloc = (now, self.cuda.alloc_stats() if self.cuda is not None else None)
            except Exception:  # protect the job: these two fields go missing
                self._alloc = (now, None)
        return self._alloc[1]

    def _host_fields(self, memory: dict[str, Any], rss: int | None) -> None:
        if not self.host:  # None (psutil missing, or stopped after an error) or False (off)
            return
        now = time.monotonic()
        try:
            if rss is not None:  # read at the step's end on the training thread
                self._rss = (now, rss)
            elif self._rss[1] is None or now - self._rss[0] >= RSS_EVERY_S:
                self._rss = (now, self.host.rss_bytes())
            if now - self._workers[0] >= WORKERS_EVERY_S:
                self._workers = (now, self.host.workers_rss_bytes())
        except Exception:  # protect the job: host memory stops, training goes on
            self.host = None
            return
        if self._rss[1] is not None:
            memory["rss_mb"] = round(self._rss[1] / MB, 3)
        if self._workers[1] is not None:
            memory["workers_rss_mb"] = round(self._workers[1] / MB, 3)

    def close(self) -> None:
        """Stop the NVML thread and any counter left open by an aborted step."""
        if self.sampler is not None:
            self.sampler.stop()
        # The fd stays open until here: records still resolving at finish need no RSS read.
        self._fast_rss = None
        if self.host and hasattr(self.host, "close"):
            with contextlib.suppress(Exception):
                self.host.close()
        self.stop_counter()

    def stop_counter(self) -> None:
        """Leave the FLOP counter's dispatch mode if a step left it entered; never raises."""
        counter, self._counter = self._counter, None
        if counter is not None:
            with contextlib.suppress(Exception):  # protect the job: the mode is popped regardless
                counter.stop()


def monitor_for(config: Any, device: str, warn: Callable[..., None]) -> ResourceMonitor:
    """The monitor a tracer's config asks for on ``device``; on a device whose metrics cannot
    be read, ``warn`` once and monitor the host only."""

    def build(dev: str) -> ResourceMonitor:
        return ResourceMonitor(device=dev, flops_per_step=config.flops_per_step,
                               model_flops=config.model_flops, peak_tflops=config.peak_tflops)

    try:
        return build(device)
    except Exception as exc:  # protect the job: device metrics are optional, timing is not
        warn(f"device memory and health are not recorded: {exc!r}", key="resources")
        return build("cpu")


# --------------------------------------------------------------------- live view / summary()


def summarize_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of tokens/s, samples/s, TFLOP/s, MFU and the max peak memory over ``records``.

    Keys are present only for what the records measured (for ``stepscope.summary()``).
    """
    out: dict[str, Any] = {}
    for key, sec, name in (("tokens_per_s", "throughput", "tokens_per_s"),
                           ("samples_per_s", "throughput", "samples_per_s"),
                           ("tflops", "flops", "tflops"), ("mfu", "flops", "mfu")):
        vals = [r[sec][name] for r in records if name in (r.get(sec) or {})]
        if vals:
            out[key] = median(vals)
    for key in ("peak_allocated_mb", "rss_mb"):
        vals = [r["memory"][key] for r in records if key in (r.get("memory") or {})]
        if vals:
            out[key] = max(vals)
    return out


#: Short payload keys for the live exchange (the payload is capped at 1 KiB).
_PAYLOAD_KEYS = {"tokens_per_s": "tps", "samples_per_s": "sps", "mfu": "mfu", "peak_allocated_mb": "pam",
                 "rss_mb": "rss"}


def payload_fields(summary: dict[str, Any]) -> dict[str, float]:
    """This rank's resource numbers for the cross-rank live exchange."""
    return {short: round(float(summary[k]), 5) for k, short in _PAYLOAD_KEYS.items() if k in summary}


def cross_rank_fields(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """Job tokens/s and samples/s (sum over ranks), mean MFU, max peak memory (and its rank)."""
    out: dict[str, Any] = {}
    got = [(p.get("r"), p.get("t") or {}) for p in payloads]
    for key, short in (("tokens_per_s", "tps"), ("samples_per_s", "sps")):
        vals = [t[short] for _, t in got if short in t]
        if vals and len(vals) == len(got):
            out[key] = sum(vals)
    mfus = [t["mfu"] for _, t in got if "mfu" in t]
    if mfus:
        out["mfu"] = sum(mfus) / len(mfus)
    for key, short in (("peak_allocated_mb", "pam"), ("rss_mb", "rss")):
        ranked = [(t[short], r) for r, t in got if short in t]
        if ranked:
            value, rank = max(ranked)
            out[key], out[f"{key}_rank"] = value, rank
    return out


def line_suffix(s: dict[str, Any]) -> str:
    """`` | 12,345 tok/s MFU 41% | peak 30.1 GB (r3)`` for the live line; empty when unmeasured."""
    parts = []
    if "tokens_per_s" in s:
        parts.append(f"{s['tokens_per_s']:,.0f} tok/s")
    elif "samples_per_s" in s:
        parts.append(f"{s['samples_per_s']:,.1f} samples/s")
    if "mfu" in s:
        parts.append(f"MFU {100 * s['mfu']:.1f}%")
    if "peak_allocated_mb" in s:
        where = f" (r{s['peak_allocated_mb_rank']})" if "peak_allocated_mb_rank" in s else ""
        parts.append(f"peak mem {s['peak_allocated_mb'] / 1024:.1f} GB{where}")
    elif "rss_mb" in s:
        parts.append(f"RSS {s['rss_mb'] / 1024:.2f} GB")
    return (" | " + " ".join(parts)) if parts else ""


def record_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's resource numbers as flat ``section/name`` scalars (TensorBoard, W&B)."""
    out: dict[str, float] = {}
    for sec, names in (("throughput", ("tokens_per_s", "samples_per_s")),
                       ("flops", ("tflops", "mfu")),
                       ("memory", ("peak_allocated_mb", "peak_reserved_mb", "allocated_mb", "rss_mb",
                                   "workers_rss_mb", "alloc_retries", "ooms")),
                       ("device", ("util_pct", "sm_clock_mhz", "power_w", "temp_c"))):
        body = record.get(sec)
        if isinstance(body, dict):
            for name in names:
                if isinstance(body.get(name), int | float):
                    out[f"{sec}/{name}"] = float(body[name])
    return out


def batch_counts(batch: Any) -> tuple[int | None, int | None]:
    """``(tokens, samples)`` of a batch, without waiting for the GPU.

    Samples: the first dimension of ``input_ids`` (or of the batch's first tensor). Tokens:
    only for batches with ``input_ids``/``attention_mask`` — the mask's sum when it is on the
    CPU, else ``input_ids.numel()`` (padded positions count: summing a GPU mask would
    synchronise the host with the device).
    """
    import torch

    def first_tensor(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, dict):
            for v in x.values():
                t = first_tensor(v)
                if t is not None:
                    return t
        if isinstance(x, list | tuple):
            for v in x:
                t = first_tensor(v)
                if t is not None:
                    return t
        return None

    ids = mask = None
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        with contextlib.suppress(Exception):
            ids = batch.get("input_ids")
            mask = batch.get("attention_mask")
    tokens: int | None = None
    if isinstance(mask, torch.Tensor) and mask.device.type == "cpu":
        tokens = int(mask.sum())
    elif isinstance(ids, torch.Tensor):
        tokens = int(ids.numel())
    elif isinstance(mask, torch.Tensor):
        tokens = int(mask.numel())
    lead = ids if isinstance(ids, torch.Tensor) else first_tensor(batch)
    samples = int(lead.shape[0]) if isinstance(lead, torch.Tensor) and lead.dim() > 0 else None
    return tokens, samples
