"""Benchmark: CUDA marks per step and host microseconds per mark, on the simulated CUDA runtime.

    PYTHONPATH=src python benchmarks/marks.py --steps 300 --phases 4 --reps 5

A loop of ``--steps`` steps, each with ``--phases`` phases (one of them on a side stream),
run on the simulator of ``tests/support/cudasim.py`` (no GPU needed), interleaved ``--reps`` times
with a bare loop doing the same work without stepscope. Reports, as one JSON line:

- ``marks_per_step``: CUDA events stepscope recorded per step (counted by the simulator);
- ``host_us_per_mark``: (traced - bare) host time per step / marks per step, median over
  repetitions: what a mark costs the training thread, everything per step included
  (phase bookkeeping, the step exit's readiness checks), spread over the marks;
- ``mark_us`` / ``mark_us_uncached``: ``CudaClock.mark()`` alone in a tight loop, with the
  per-stream cache of the current stream and with ``torch.cuda.current_stream`` called per
  mark (what a mark did before the cache).

The event calls here are the simulator's Python code, not CUDA's: the figures compare
stepscope's own host work between versions and settings; a GPU run gives the real cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))  # cudasim lives in the test support


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=HERE, check=True).stdout.strip()
    except Exception:  # not a checkout: the figures still stand
        return "unknown"


def _loop(sim: Any, steps: int, phases: int, traced: bool) -> float:
    import torch

    import stepscope

    side = torch.cuda.Stream()
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        with stepscope.step() if traced else _null():
            for p in range(phases - 1):
                with stepscope.phase(f"p{p}") if traced else _null():
                    sim.kernel(0.0)
            with torch.cuda.stream(side), stepscope.phase("side") if traced else _null():
                sim.kernel(0.0)
    return (time.perf_counter_ns() - t0) / 1e3 / steps  # µs per step


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _mark_us(clock: Any, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        clock.release(clock.mark())
    return (time.perf_counter_ns() - t0) / 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.steps < 1 or args.phases < 1 or args.reps < 1:
        print(f"steps, phases and reps must be >= 1; got {vars(args)}", file=sys.stderr)
        raise SystemExit(2)

    import cudasim
    import torch

    import stepscope
    from stepscope.recording.clock import CudaClock

    with cudasim.CudaSim() as sim, tempfile.TemporaryDirectory() as out:
        diffs, marks_per_step = [], []
        for rep in range(args.reps):
            bare = _loop(sim, args.steps, args.phases, traced=False)
            stepscope.init(out_dir=os.path.join(out, f"r{rep}"), heartbeat_s=0)
            before = sim.records
            try:
                traced = _loop(sim, args.steps, args.phases, traced=True)
                marks_per_step.append((sim.records - before) / args.steps)
            finally:
                stepscope.finish()
            diffs.append(traced - bare)
            sim.drain()
        mps = statistics.median(marks_per_step)
        n = 20_000
        cached = statistics.median(_mark_us(CudaClock(), n) for _ in range(args.reps))
        uncached = statistics.median(
            _mark_us(CudaClock(current_stream=torch.cuda.current_stream), n)
            for _ in range(args.reps))
    figures = {
        "steps": args.steps, "phases": args.phases, "reps": args.reps,
        "marks_per_step": round(mps, 2),
        "host_us_per_step_over_bare": round(statistics.median(diffs), 2),
        "host_us_per_mark": round(statistics.median(diffs) / mps, 3) if mps else None,
        "mark_us": round(cached, 3),
        "mark_us_uncached": round(uncached, 3),
    }
    print(json.dumps({
        "benchmark": "marks",
        "command": "python benchmarks/marks.py " + " ".join(sys.argv[1:]),
        "commit": _commit(),
        "machine": "simulated CUDA runtime (tests/support/cudasim.py) on " + (os.uname().machine),
        "load": round(os.getloadavg()[0], 2),
        "figures": figures,
    }), flush=True)


if __name__ == "__main__":
    main()
