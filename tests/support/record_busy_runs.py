"""Record the busy-host gloo runs kept under ``fixtures/busy_*`` (not a test: run it by hand).

Two ranks of a DDP MLP (the demo model, widened) over gloo, with busy loops beside them so
the host's load is 5 or more on a 2-core machine: a clean run, or one rank sleeping in one
phase for 40 steps (``time.sleep``: waiting on nothing, not on a CPU). Each run keeps only
its ``rank*.jsonl`` and ``meta.json``.

    python tests/support/record_busy_runs.py OUT_DIR [--hogs 3] [--warm 60]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import dist_harness
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from stepscope import demo
from stepscope.recording.dist import spawn_local

STEPS = 100
#: name -> (slow rank, phase, ms, first step, end step) or None for a clean run.
RUNS: dict[str, tuple[int, str, float, int, int] | None] = {
    "busy_sleep_optimizer": (1, "optimizer", 25.0, 40, 80),
    "busy_sleep_dataloader": (0, "dataloader", 20.0, 30, 70),
    "busy_clean_a": None,
    "busy_clean_b": None,
    "busy_comm_heavy": None,
}
#: name -> (hidden width, batch, steps) where not the default (512, 64, STEPS): a wide layer
#: and a tiny batch make a step mostly all-reduce.
SHAPES = {"busy_comm_heavy": (4096, 1, 30)}


def _worker(rank: int, world: int, port: int, out_dir: str, steps: int,
            slow: tuple[demo.SlowSpec, ...], hidden: int, batch: int) -> None:
    torch.set_num_threads(1)
    with dist_harness.gloo_group(rank, world, port):
        torch.manual_seed(0)
        injector = demo._Injector(rank, slow)
        model = DDP(demo.DemoModel(injector, hidden=hidden))
        dist_harness.train(out_dir, "busy", model, injector,
                           dist_harness.loader(rank, batch * 16, batch), steps)


def record(out: Path, name: str, spec: tuple[int, str, float, int, int] | None) -> Path:
    slow = () if spec is None else (demo.SlowSpec(spec[0], spec[1], spec[3], spec[4], spec[2]),)
    hidden, batch, steps = SHAPES.get(name, (512, 64, STEPS))
    with tempfile.TemporaryDirectory() as tmp:
        run = spawn_local(_worker, 2, Path(tmp) / "run", steps, slow, hidden, batch)
        dst = out / name
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for f in run.glob("rank*.jsonl"):
            shutil.copy(f, dst / f.name)
        # The run's folder was a temporary one: the fixture says "run" instead.
        meta = (run / "meta.json").read_text().replace(json.dumps(str(run))[1:-1], "run")
        (dst / "meta.json").write_text(meta)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hogs", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--warm", type=float, default=60.0,
                    help="seconds the busy loops run before the first job (the load average lags)")
    args = ap.parse_args(argv)
    hogs: list[Any] = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                       for _ in range(args.hogs)]
    try:
        time.sleep(args.warm)
        for name, spec in RUNS.items():
            if args.only and name not in args.only:
                continue
            print(name, record(args.out, name, spec), "load", os.getloadavg(), flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


if __name__ == "__main__":
    main()
