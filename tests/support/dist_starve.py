"""A real gloo DDP run in which one rank is starved of CPU for a stretch of steps.

Each rank is pinned to one CPU (rank r to the r-th allowed CPU, wrapping). A busy-loop child
pinned to the starved rank's CPU waits on a pipe from the start (so its start-up costs no
step) and spins from ``first`` to ``last`` (steps, inclusive): the rank is runnable all that
time but gets about half of its CPU, as when another job lands on its core. The job's code
does not change; the demo's model, loader and slow-injection points are reused, so a
``SlowSpec`` can add a real (sleep) window too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from dist_harness import gloo_group, loader, train
from torch.nn.parallel import DistributedDataParallel as DDP

from stepscope import demo
from stepscope.recording.dist import spawn_local

HIDDEN = 1024
BATCH = 128
_HOG = ("import os, sys\nos.sched_setaffinity(0, {%d})\nsys.stdin.buffer.read(1)\n"
        "while True:\n    pass\n")


def _worker(rank: int, world: int, port: int, out_dir: str, steps: int,
            slow: tuple[demo.SlowSpec, ...], starve: tuple[int, int, int] | None) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[rank % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    hog = None
    if starve is not None and starve[0] == rank:
        hog = subprocess.Popen([sys.executable, "-c", _HOG % cpu], stdin=subprocess.PIPE)

    def pace_hog(step: int) -> None:
        nonlocal hog
        if hog is None or starve is None:
            return
        if step == starve[1]:
            assert hog.stdin is not None
            hog.stdin.write(b"x")
            hog.stdin.flush()
        elif step == starve[2] + 1:
            hog.kill()
            hog.wait()
            hog = None

    try:
        with gloo_group(rank, world, port):
            torch.manual_seed(0)
            injector = demo._Injector(rank, slow)
            # Wider than the demo's (~10 ms of compute per step on one core): being descheduled
            # costs a share of a step, as in the soak's false alarms (+22-25 ms on ~45 ms steps).
            model = DDP(demo.DemoModel(injector, hidden=HIDDEN))
            train(out_dir, "starve", model, injector, loader(rank, 2048, BATCH), steps,
                  before_step=pace_hog)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def launch(out_dir: str | Path, ranks: int = 2, steps: int = 60,
           slow: tuple[demo.SlowSpec, ...] = (), starve: tuple[int, int, int] | None = None) -> Path:
    """Run the job; ``starve=(rank, first, last)`` shares that rank's CPU with a busy loop
    on steps first..last. Returns the run directory."""
    return spawn_local(_worker, ranks, out_dir, steps, slow, starve)
