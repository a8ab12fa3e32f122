"""Write a corpus of varied run directories for ``analysis_scale.py --equivalence``.

Synthetic DDP, FSDP, HF and accumulation shapes (slow ranks, windows, multi-host clock
offsets, a CUDA clock, sampled steps, hidden H2D), a run with hostile lines (a duplicate
record, a corrupt line, a missing step, a torn last line) and the recorded busy-host fixture::

    python benchmarks/equivalence_corpus.py OUT
    python benchmarks/analysis_scale.py --sizes 10000x3 256x400 --dir OUT --keep
    python benchmarks/analysis_scale.py --equivalence BASE/src $(ls -d OUT/*)

Copy OUT before each comparison: reading a run writes its Parquet store into it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "support"), str(ROOT / "src")]

import synth_collectives as sc  # noqa: E402
from synth_runs import Slow, SynthRun, write_run  # noqa: E402

RUNS = {
    "balanced4": SynthRun(),
    "slowdl": SynthRun(ranks=8, steps=80, slow=(Slow(3, "dataloader", 12.0),)),
    "slowfwd_window": SynthRun(ranks=6, steps=120, slow=(Slow(2, "forward", 20.0, 40, 60),)),
    "slowopt": SynthRun(ranks=4, steps=90, slow=(Slow(1, "optimizer", 10.0),), comm_child=True),
    "multihost": SynthRun(ranks=16, steps=60, hosts=4, host_offset_ms=37.0,
                          slow=(Slow(9, "forward", 8.0),)),
    "hidden": SynthRun(ranks=4, steps=50, h2d_hidden_ms=1.5, slow=(Slow(0, "h2d", 5.0),)),
    "every5": SynthRun(ranks=8, steps=300, every=5, slow=(Slow(5, "backward", 9.0),)),
    "commslow_cuda": SynthRun(ranks=8, steps=80, comm_slow=((30, 39, 10.0),), clock="cuda",
                              comm_child=True),
    "noisy": SynthRun(ranks=12, steps=100, noise_ms=1.5, seed=7),
    "big": SynthRun(ranks=64, steps=200, slow=(Slow(17, "dataloader", 6.0, 50, 150),),
                    comm_child=True),
}
COLL_RUNS = {
    "ddp_accum": sc.CollRun(sc.ddp_program(micro=4), ranks=4, slow=(Slow(2, "forward", 5.0),)),
    "fsdp": sc.CollRun(sc.fsdp_program(), ranks=8, slow=(Slow(6, "backward", 6.0),)),
    "hf": sc.CollRun(sc.hf_program(), ranks=4, slow=(Slow(1, "dataloader", 8.0),)),
    "ddp_clean": sc.CollRun(sc.ddp_program(), ranks=8, steps=100),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the folder to write the corpus runs into")
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in RUNS.items():
        shutil.rmtree(out / name, ignore_errors=True)
        write_run(out / name, spec)
    for name, coll in COLL_RUNS.items():
        shutil.rmtree(out / name, ignore_errors=True)
        sc.write(out / name, sc.make_records(coll))
    hostile = out / "hostile"
    shutil.rmtree(hostile, ignore_errors=True)
    write_run(hostile, SynthRun(ranks=4, steps=60, slow=(Slow(3, "forward", 9.0),)))
    lines = (hostile / "rank1.jsonl").read_text().splitlines(True)
    # A duplicate record, a corrupt line, step 30 missing, a torn last line.
    (hostile / "rank1.jsonl").write_text(
        "".join([*lines[:10], lines[9], "{not json\n", *lines[10:30], *lines[31:]])
        + '{"schema": 1, "ra')
    shutil.copytree(ROOT / "tests" / "fixtures" / "busy_host_balanced",
                    out / "busy_host_balanced", dirs_exist_ok=True)
    print(" ".join(sorted(p.name for p in out.iterdir())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
