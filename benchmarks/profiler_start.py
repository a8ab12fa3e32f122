"""How long torch.profiler takes to start: the first session in a process, then later ones.

Auto-profiling starts the profiler mid-run on the rank that triggered; the first start in a
process is the expensive one (Kineto initialisation; CUPTI loading on a GPU), which is why
``stepscope.listeners.autoprofile.warm_profiler`` pays it at ``init()``. Run in a fresh process::

    python benchmarks/profiler_start.py --sessions 3
"""

from __future__ import annotations

import argparse
import json
import time
import warnings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=3, help="start/stop cycles (>= 1)")
    args = ap.parse_args()
    if args.sessions < 1:
        raise SystemExit(f"--sessions must be >= 1; got {args.sessions}")
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(args.sessions):
            prof = profile(activities=activities)
            t0 = time.perf_counter()
            prof.start()
            started = time.perf_counter() - t0
            torch.ones(8).sum()
            t0 = time.perf_counter()
            prof.stop()
            out.append({"start_ms": round(started * 1e3, 2),
                        "stop_ms": round((time.perf_counter() - t0) * 1e3, 2)})
    print(json.dumps({"benchmark": "profiler_start", "cuda": torch.cuda.is_available(),
                      "sessions": out}))


if __name__ == "__main__":
    main()
