"""Two builds of the tracer in one process, on one model: what a change costs or saves per step.

Two processes (``overhead.py --baseline-src``) differ by where each one's model and
interpreter state sit in memory, which moves a ~3 ms step by about as much as the change
being measured. Here both builds run in one process, on the *same* model and optimizer: the
working tree's ``stepscope`` (``PYTHONPATH``) and a copy of the package at ``--baseline``
(a git commit), extracted with ``git archive`` and imported as ``stepscope_baseline`` (its
imports rewritten). Blocks of ``--steps`` steps run bare, under this build and under the
baseline (a new tracer per block, every automatic instrument, the memory sink, the CPU clock),
in an order shuffled per block; each traced block is compared with the bare block of the same
round, and the result is the median over rounds of (this − baseline), in µs of the training
thread's CPU time per step; the same in wall time (which also holds waits for the GIL while
the writer builds records) and the writer thread's CPU time per step are reported beside it.

A block must span several hand-overs to the writer (``outbox.HANDOVER_EVERY_S``, 0.1 s): the
records of a block's last hand-over period are built at ``finish()``, outside the timing, so
a short block leaves the writer's share (its wakes, its record building while the training
thread wants the GIL) out. The default, 400 steps of ~2.4 ms, leaves out ~10% of it.

A bias remains (which package was imported first, where each one's code landed): run it
twice, the second time with the roles swapped (``--swap``: the baseline plays "this"); a
real difference changes sign with the roles, a bias does not.

``--every-n-steps N`` records one step in N (``0``: none after the first, what a step that
records nothing costs).

    python benchmarks/paired_builds.py --baseline 5554766
    python benchmarks/paired_builds.py --baseline 5554766 --swap
    python benchmarks/paired_builds.py --baseline 5554766 --every-n-steps 10
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import hot_path  # noqa: E402  (benchmarks/ on sys.path)

NAME = "stepscope_baseline"


def extract(commit: str, into: Path) -> None:
    """``src/stepscope`` at ``commit`` as package ``NAME`` under ``into``."""
    raw = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", commit, "src/stepscope"],
        check=True, capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=raw, check=True)
    pkg = into / NAME
    (into / "src" / "stepscope").rename(pkg)
    pattern = re.compile(r"\b(from|import) stepscope\b|\"stepscope\.")
    for f in pkg.rglob("*.py"):
        text = f.read_text()
        new = pattern.sub(lambda m: m.group(0).replace("stepscope", NAME), text)
        if new != text:
            f.write_text(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git commit of the baseline build")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=640, help="MLP width (0: the tiny model)")
    ap.add_argument("--swap", action="store_true", help="the baseline plays 'this' and vice versa")
    ap.add_argument("--every-n-steps", type=int, default=1,
                    help="record one step in N (0: only the first step of a block)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hot_path.HIDDEN = args.hidden
    with tempfile.TemporaryDirectory() as tmp:
        extract(args.baseline, Path(tmp))
        sys.path.insert(0, tmp)
        parts = ("tracer", "config", "clock", "sinks")
        builds = {name: {m: importlib.import_module(f"{pkg}.{m}") for m in parts}
                  for name, pkg in (("this", "stepscope"), ("baseline", NAME))}
        if args.swap:
            builds = {"this": builds["baseline"], "baseline": builds["this"]}
        print(json.dumps(run(builds, args)))


def run(builds: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    model, opt, x = hot_path._job()
    step = hot_path._step
    for _ in range(30):
        step(model, opt, x)
    clock_ns = time.thread_time_ns
    per: dict[str, list[float]] = {"bare": [], "this": [], "baseline": []}
    walls: dict[str, list[float]] = {"bare": [], "this": [], "baseline": []}
    writer: dict[str, list[float]] = {"this": [], "baseline": []}
    kinds = list(per)
    for _ in range(args.blocks):
        random.shuffle(kinds)
        for kind in kinds:
            tracer = None
            if kind != "bare":
                m = builds[kind]
                every = args.every_n_steps or 1 << 40
                tracer = m["tracer"].Tracer(
                    m["config"].Config(out_dir="unused", every_n_steps=every), model=model, optimizer=opt,
                    clock=m["clock"].CpuClock(), sink=m["sinks"].MemorySink(),
                )
            hot_path._run(tracer, model, opt, x, 5)
            t0 = clock_ns()
            wall0 = time.perf_counter_ns()
            w0 = hot_path._writer_cpu_ns()
            hot_path._run(tracer, model, opt, x, args.steps)
            per[kind].append((clock_ns() - t0) / args.steps / 1e3)
            walls[kind].append((time.perf_counter_ns() - wall0) / args.steps / 1e3)
            if tracer is not None:
                writer[kind].append((hot_path._writer_cpu_ns() - w0) / args.steps / 1e3)
                tracer.finish()
    med = statistics.median
    bare = per["bare"]

    def diff(a: list[float], b: list[float]) -> float:
        return round(med(p - q for p, q in zip(a, b, strict=True)), 1)

    return {
        "benchmark": "paired_builds", "baseline": args.baseline, "swap": args.swap,
        "hidden": args.hidden, "steps": args.steps, "blocks": args.blocks,
        "every_n_steps": args.every_n_steps,
        "loadavg_1m": round(os.getloadavg()[0], 2), "bare_step_us": round(med(bare), 1),
        "this_added_us": diff(per["this"], bare),
        "baseline_added_us": diff(per["baseline"], bare),
        "this_minus_baseline_us": diff(per["this"], per["baseline"]),
        "wall": {"this_added_us": diff(walls["this"], walls["bare"]),
                 "baseline_added_us": diff(walls["baseline"], walls["bare"]),
                 "this_minus_baseline_us": diff(walls["this"], walls["baseline"])},
        "writer_cpu_us": {k: round(med(v), 1) for k, v in writer.items()},
    }


if __name__ == "__main__":
    main()
