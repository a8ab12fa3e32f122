"""What a sleep injected into a rank really takes on this machine, now."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sleep_probe(taken: list[float], ms: float) -> Iterator[None]:
    """Time ``sleep(ms)`` in a thread while the run records: what the injection really takes.

    On a loaded machine a sleeping process waits for a core after waking: at a load of 8 on
    2 cores a 30 ms sleep took 39-56 ms of the rank's wall time (its own work inside the
    window rose by as much as its gap to the others). That is the true excess; the analysis
    cannot know what was asked for, so the test compares with what a sleep took here, now.
    """
    stop = threading.Event()

    def probe() -> None:
        # Like a rank: some work, then the sleep (a thread that only ever sleeps wakes with
        # the scheduler's favour and under-states the rank's wait for a core).
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < 0.01:
                pass
            t = time.perf_counter()
            time.sleep(ms / 1000.0)
            taken.append(1000.0 * (time.perf_counter() - t))

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()
