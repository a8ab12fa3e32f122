"""False-alarm rate: clean real gloo runs, counting runs whose report has a WARNING or CRITICAL.

    PYTHONPATH=src:tests python benchmarks/false_alarms.py --path ddp --ranks 4 --runs 10 --hog 1
    PYTHONPATH=src python benchmarks/false_alarms.py --reanalyze runs/false-alarms/ddp-4   # re-analyze

Fresh runs are recorded by default (``--hog N`` keeps N busy-looping processes running on the
machine while they record, and ends them afterwards); each run is kept under ``--out`` so a
later analysis can be re-run on the same recordings with ``--reanalyze``. Paths: ``ddp``
(the demo, 80 steps), ``fsdp2``, ``hf``, ``lightning`` (60 steps) and ``pipeline``
(``torch.distributed.pipelining``, one stage per rank, GPipe, 60 steps).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PATHS = ("ddp", "fsdp2", "hf", "lightning", "pipeline")


def _launch(path: str, out: Path, ranks: int, seed: int) -> Path:
    if path == "ddp":
        from stepscope import demo

        return Path(demo.launch(out, ranks=ranks, steps=80, seed=seed))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    if path == "fsdp2":
        import dist_harness

        return Path(dist_harness.launch_fsdp(out, ranks=ranks, steps=60))
    if path == "hf":
        import dist_harness

        return Path(dist_harness.launch_hf(out, ranks=ranks, steps=60))
    if path == "lightning":
        import dist_lightning

        return Path(dist_lightning.launch_lightning(out, ranks=ranks, steps=60))
    if path == "pipeline":
        import dist_frameworks

        # Stages with real compute (1024 wide), as the soak test: a 64-wide toy stage spends a
        # true ~27% of its step in the schedule's own Python (a real host_overhead).
        return Path(dist_frameworks.launch_pipeline(out, ranks=ranks, steps=60, dim=1024))
    raise ValueError(f"--path must be one of {', '.join(PATHS)}; got {path!r}")


def _loud(run: Path) -> list[tuple[str, str, str]]:
    from stepscope.analysis.run import analyze_run

    doc: dict[str, Any] = analyze_run(run)
    return [(v["severity"], v["kind"], v["evidence"]) for v in doc["verdicts"]
            if v["severity"] != "info"]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--path", default="ddp", choices=PATHS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--hog", type=int, default=0,
                    help="busy-looping processes to run alongside the fresh runs (default 0)")
    ap.add_argument("--out", default=None, help="where runs are kept (default: runs/false-alarms/PATH-RANKS)")
    ap.add_argument("--reanalyze", default=None, help="only analyze the runs under this directory")
    args = ap.parse_args()
    if args.runs < 1 or args.ranks < 1 or args.hog < 0:
        raise ValueError(f"--runs and --ranks must be >= 1 and --hog >= 0; got {args.runs}, "
                         f"{args.ranks}, {args.hog}")
    if args.reanalyze:
        runs = sorted(p for p in Path(args.reanalyze).iterdir() if p.is_dir())
    else:
        root = Path(args.out or f"runs/false-alarms/{args.path}-{args.ranks}")
        hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.hog)]
        runs = []
        try:
            for i in range(args.runs):
                t = time.time()
                runs.append(_launch(args.path, root / f"r{i}", args.ranks, seed=i))
                print(f"run {i}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
    loud = {str(r): _loud(r) for r in runs}
    print(json.dumps({"path": args.path, "ranks": args.ranks, "hog": args.hog, "runs": len(runs),
                      "runs_with_warning_or_critical": sum(bool(v) for v in loud.values()),
                      "warnings": sum(1 for v in loud.values() for x in v if x[0] == "warning"),
                      "criticals": sum(1 for v in loud.values() for x in v if x[0] == "critical"),
                      "loud": {k: v for k, v in loud.items() if v}}, indent=1))


if __name__ == "__main__":
    main()
