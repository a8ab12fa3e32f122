"""Run-queue wait: how long the training thread was runnable but waiting for a CPU, per step.

On a CPU clock a rank's phase times include the time the kernel kept it off the CPU while it
was ready to run (another process, or another rank, holding the cores). That is not the
job's work, but to a cross-rank comparison it looks like a slow rank. The kernel keeps the
account per thread: ``/proc/<pid>/task/<tid>/schedstat`` holds three numbers, time spent on
the CPU (ns), time spent waiting on a run queue (ns), and the number of timeslices run
(Linux ``Documentation/scheduler/sched-stats.rst``, "/proc/<pid>/schedstat"). A sleep, a
slow data source or slower code does not raise the second number; a process hogging the
cores does. The record's ``counters.runq_ms`` is its rise from the previous step's end to
this step's end (so the dataloader wait before ``step()`` opens is covered, as the step is),
to within ``SLACK_NS`` (0.05 ms), and the figures of consecutive steps add up exactly.

Cost: at each step end, one read of the thread's CPU clock; the file (one ``os.pread`` of
the already open file and one ``int`` parse) only when the thread spent ``SLACK_NS`` or more
off the CPU since the last read, as waiting for a CPU is time off it (a step that stayed on
the CPU cannot have waited more than that). On the ~3 ms MLP step that removed ~7.5 µs of
training-thread CPU a step (``benchmarks/paired_builds.py``, roles swapped: -8.0 and +7.2):
right after a long torch op, the clock read costs ~4 µs and the ``pread`` ~13. A step that
waits off the CPU every step (a DataLoader queue) reads both (1.3–1.4 µs for the ``pread``
alone in a tight loop, ``benchmarks/runq_cost.py``). The session asks only at the end of a
sampled step and of the step before one (the baseline), so unsampled steps between them make
no system call.

GPU runs do not need it: CUDA events time the device's work, which the host's scheduling
does not stretch, so the reader is only built for a CPU clock.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

#: The file read (the calling thread's own schedstat).
PATH = "/proc/thread-self/schedstat"
#: Off-CPU time since the last read (wall time less the thread's CPU time) under which a step
#: end does not read the file. Waiting for a CPU is time off it, so the wait since the last
#: read is no more than that: the step reports 0 and any wait there was goes to the next step
#: that reads. Each step's figure is within this of its own wait; their sum is exact.
SLACK_NS = 50_000

_thread_time_ns = time.thread_time_ns
_perf_ns = time.perf_counter_ns


class RunQueueReader:
    """Run-queue wait of one thread, in ms, between successive :meth:`step_end` calls.

    Bound to the thread that first calls :meth:`step_end` (the training thread; ``/proc/
    thread-self`` resolves when opened). Off (``reason`` says why) where the file is missing
    or unreadable; never raises into the job.

    Example::

        rq = RunQueueReader()
        rq.step_end()            # baseline
        ...                      # a step
        runq_ms = rq.step_end()  # None while off
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self._fd: int | None = None
        self._thread: int | None = None
        self._last = -1
        self._wall = self._cpu = 0  # perf_counter_ns and thread CPU ns at the last read
        if not sys.platform.startswith("linux"):
            self.reason = f"run-queue wait needs Linux schedstat ({sys.platform} has none)"
        elif not os.path.exists(PATH):
            self.reason = f"run-queue wait off: {PATH} missing (kernel without CONFIG_SCHEDSTATS?)"

    @property
    def on(self) -> bool:
        return self.reason is None

    def _open(self) -> None:
        try:
            fd = os.open(PATH, os.O_RDONLY)
            self._cpu, self._wall = _thread_time_ns(), _perf_ns()
            self._last = int(os.pread(fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError) as exc:  # protect the job: no runq, say why
            self.reason = f"run-queue wait off: {PATH} unreadable ({exc!r})"
            return
        self._fd = fd
        self._thread = threading.get_ident()

    def step_end(self, thread: int | None = None, wall_ns: int | None = None) -> float | None:
        """Run-queue wait (ms) since the last call on this thread; ``None`` when off or on
        the first call (the baseline). ``thread``: ``threading.get_ident()`` of the caller, and
        ``wall_ns``: ``time.perf_counter_ns()`` at the step's end, where the caller knows them
        already (the session: the step's owner and its end mark on the host clock)."""
        fd = self._fd
        if fd is None:
            if self.reason is None:
                self._open()
            return None
        if (threading.get_ident() if thread is None else thread) != self._thread:
            # Steps moved to another thread (init() ran elsewhere): follow them.
            self.close()
            self._open()
            return None
        cpu = _thread_time_ns()
        wall = _perf_ns() if wall_ns is None else wall_ns
        if wall - self._wall - (cpu - self._cpu) < SLACK_NS:
            return 0.0  # on the CPU all but SLACK_NS since the last read: no system call
        try:
            now = int(os.pread(fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError) as exc:  # protect the job: stop reading, say why
            self.reason = f"run-queue wait off: {PATH} read failed ({exc!r})"
            self.close()
            return None
        self._cpu, self._wall = cpu, wall
        ns, self._last = now - self._last, now
        return ns / 1e6

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            # Already closed (fork/exit races): nothing left to release.
            with contextlib.suppress(OSError):
                os.close(fd)


def reader_for(clock_kind: str) -> RunQueueReader | None:
    """A reader for a CPU clock; ``None`` for a device clock (device work is event-timed)."""
    return RunQueueReader() if clock_kind == "cpu" else None
