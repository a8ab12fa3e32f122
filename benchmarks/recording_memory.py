"""Memory a recording job holds over many tiny steps, every step recorded.

Runs ``--steps`` (default 10**6) steps of an empty CPU loop with one user phase and a token
count, every step recorded to JSONL, and prints one JSON line: the process RSS after the
warm-up (``--warmup`` steps), at its highest while stepping (read every 10,000 steps), and
at the loop's end; the growth from the warm-up (the figure the goal reads: <= 50 MB at
10**6 steps); records written and steps counted as lost, by reason (a writer that cannot
keep up with a loop this fast drops batches past its bound and counts them, rather than
holding them); and whether every step is accounted for (written or counted).

    python benchmarks/recording_memory.py [--steps 1000000] [--warmup 20000] [--out DIR]
    python benchmarks/recording_memory.py --record benchmarks/results   # also write a record
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

TITLE = "Job memory over 10^6 recorded tiny steps (RSS growth; goal <= 50 MB)"
NOTES = ("An empty CPU loop with one phase and a token count, every step recorded to JSONL. "
         "rss_growth_mb is the highest RSS after the warm-up less the RSS after it. A loop "
         "this fast outruns the writer thread: the batches past the writer's bound are dropped "
         "and counted (steps_lost_by_reason), so every step is either written or counted.")


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(steps: int, warmup: int, out: str) -> dict[str, object]:
    """Run the loop into ``out`` and return the figures."""
    import stepscope
    from stepscope.recording.schema import read_run

    stepscope.init(out, auto=False, heartbeat_s=0)
    step, phase = stepscope.step, stepscope.phase
    rss_warm = peak = 0.0
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        with step(tokens=8), phase("compute"):
            pass
        if i == warmup:
            rss_warm = peak = _rss_mb()
        elif i > warmup and i % 10_000 == 0:
            peak = max(peak, _rss_mb())
    loop_s = time.perf_counter() - t0
    rss_end = _rss_mb()
    stepscope.finish()
    recs = read_run(out)
    lost: dict[str, int] = {}
    for r in recs:
        dropped = r.get("dropped")
        for k, n in (dropped.items() if isinstance(dropped, dict) else ()):
            lost[k] = lost.get(k, 0) + int(n)
    total = warmup + steps
    return {
        "benchmark": "recording_memory",
        "steps": total, "loop_s": round(loop_s, 1), "us_per_step": round(loop_s / total * 1e6, 1),
        "rss_after_warmup_mb": round(rss_warm, 1), "rss_peak_mb": round(peak, 1),
        "rss_end_mb": round(rss_end, 1), "rss_growth_mb": round(max(peak, rss_end) - rss_warm, 1),
        "records_written": len(recs), "steps_lost_by_reason": dict(sorted(lost.items())),
        "accounted": len(recs) + sum(lost.values()) == total,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10**6)
    ap.add_argument("--warmup", type=int, default=20_000)
    ap.add_argument("--out", help="run directory (default: a temporary one, removed)")
    ap.add_argument("--record", metavar="DIR", help="also write the result as a record in DIR "
                    "(benchmarks/results)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0; got {args.steps}, {args.warmup}")

    load_before = None
    if args.record:
        import _results  # benchmarks/_results.py: the record format

        load_before = _results.load()
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(args.steps, args.warmup, args.out or str(Path(tmp) / "run"))
    print(json.dumps(figures))
    if args.record:
        command = shlex.join(["python", "benchmarks/recording_memory.py",
                              "--steps", str(args.steps), "--warmup", str(args.warmup)])
        record = _results.make_record("recording_memory", command,
                                      {k: v for k, v in figures.items() if k != "benchmark"},
                                      title=TITLE, load_before=load_before)
        record["notes"] = NOTES
        path = _results.write_record(record, args.record)
        print(f"record written: {os.path.relpath(path)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
