"""False-alarm rate: clean real gloo runs, counting runs whose report has a WARNING or CRITICAL.

    python -c "while 1: pass" &           # load the machine (kill it afterwards)
    PYTHONPATH=src:tests python benchmarks/false_alarms.py --path ddp --ranks 4 --runs 10
    PYTHONPATH=src python benchmarks/false_alarms.py --reanalyze /tmp/fa-ddp4   # same runs, new analysis

Each run is kept under ``--out`` so a later analysis can be re-run on the same recordings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def _launch(path: str, out: Path, ranks: int, seed: int) -> Path:
    if path == "ddp":
        from stepscope import demo

        return Path(demo.launch(out, ranks=ranks, steps=80, seed=seed))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    if path == "fsdp2":
        import dist_harness

        return Path(dist_harness.launch_fsdp(out, ranks=ranks, steps=60))
    if path == "hf":
        import dist_harness

        return Path(dist_harness.launch_hf(out, ranks=ranks, steps=60))
    if path == "lightning":
        import dist_lightning

        return Path(dist_lightning.launch_lightning(out, ranks=ranks, steps=60))
    raise ValueError(f"--path must be ddp, fsdp2, hf or lightning; got {path!r}")


def _loud(run: Path) -> list[tuple[str, str]]:
    from stepscope.analysis.run import analyze_run

    doc: dict[str, Any] = analyze_run(run)
    return [(v["severity"], v["kind"]) for v in doc["verdicts"] if v["severity"] != "info"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="ddp")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", default=None, help="where runs are kept (default: /tmp/fa-PATH-RANKS)")
    ap.add_argument("--reanalyze", default=None, help="only analyse the runs under this directory")
    args = ap.parse_args()
    if args.reanalyze:
        runs = sorted(p for p in Path(args.reanalyze).iterdir() if p.is_dir())
    else:
        root = Path(args.out or f"/tmp/fa-{args.path}-{args.ranks}")
        runs = []
        for i in range(args.runs):
            t = time.time()
            runs.append(_launch(args.path, root / f"r{i}", args.ranks, seed=i))
            print(f"run {i}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    loud = {str(r): _loud(r) for r in runs}
    print(json.dumps({"runs": len(runs), "runs_with_warning_or_critical": sum(bool(v) for v in loud.values()),
                      "loud": {k: v for k, v in loud.items() if v}}, indent=1))


if __name__ == "__main__":
    main()
