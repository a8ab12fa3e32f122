"""Cost of the run-queue reader at a step end (:mod:`stepscope.instrument.sched`).

    PYTHONPATH=src python benchmarks/runq_cost.py

Thread CPU time per ``RunQueueReader.step_end()`` call (one ``os.pread`` of the training
thread's schedstat and one ``int`` parse): min and median over batches. CPU time, not wall
time: on a loaded machine the wall time of a batch is mostly the scheduler's.
"""

from __future__ import annotations

import time

from stepscope.instrument.sched import RunQueueReader


def main(batches: int = 30, n: int = 2000) -> None:
    rq = RunQueueReader()
    rq.step_end()
    if not rq.on:
        print(f"off: {rq.reason}")
        return
    per: list[float] = []
    for _ in range(batches):
        t = time.thread_time_ns()
        for _ in range(n):
            rq.step_end()
        per.append((time.thread_time_ns() - t) / n / 1000.0)
    per.sort()
    print(f"step_end: min {per[0]:.2f} us, median {per[len(per) // 2]:.2f} us per step "
          f"(thread CPU time, {batches} batches of {n})")
    rq.close()


if __name__ == "__main__":
    main()
