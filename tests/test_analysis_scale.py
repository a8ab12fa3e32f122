"""Report memory stays linear in ranks: many ranks, few steps (issue 21 item 14)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest
from tests.synth_runs import Slow, SynthRun, write_run

from stepscope.analysis.run import analyze_run

_CHILD = """
import json, resource, sys
from stepscope.analysis.run import analyze_run
doc = analyze_run(sys.argv[1], threads=2, memory_limit="500MB")
print(json.dumps({"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "ranks": doc["run"]["ranks"], "steps": doc["run"]["steps"]}))
"""


def test_many_ranks_few_steps_stays_small(tmp_path: Path) -> None:
    # 2,000 ranks x 4 steps: the old "median of the other ranks" joined every row to its
    # step's full list of values (ranks^2 cells) and peaked above 2 GB here.
    run = write_run(tmp_path / "run", SynthRun(ranks=2000, steps=4, slow=(Slow(7, "forward"),)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(run)], capture_output=True,
                         text=True, env=env, check=True, timeout=600)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ranks"] == 2000 and res["steps"] == 4
    assert res["rss_mb"] < 700, res


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_median_of_the_other_ranks_is_exact(tmp_path: Path, ranks: int) -> None:
    # The three-middle-values form of "median of the others" against a brute force.
    doc = analyze_run(write_run(tmp_path / "run", SynthRun(ranks=ranks, steps=12, seed=ranks)),
                      keep=True)
    data = doc["_data"]
    try:
        rows = data.con.execute("SELECT rank, step, name, own, others FROM ex").fetchall()
    finally:
        data.close()
    own: dict[tuple[int, str], dict[int, float]] = {}
    for rank, step, name, o, _ in rows:
        own.setdefault((step, name), {})[rank] = o
    assert rows
    for rank, step, name, _, others in rows:
        rest = [v for r, v in own[(step, name)].items() if r != rank]
        assert others == pytest.approx(median(rest)), (rank, step, name)


def test_median_of_the_others_with_ties_and_ragged_steps() -> None:
    # build_own on hand-made tables: steps with 1..9 ranks, tied values (coarse rounding).
    import random

    import duckdb

    from stepscope.analysis.stragglers import build_own

    rng = random.Random(3)
    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE phases (rank INTEGER, step BIGINT, name VARCHAR, "
                    "parent VARCHAR, ms DOUBLE, path VARCHAR)")
        con.execute("CREATE TABLE steps (rank INTEGER, step BIGINT, residual_ms DOUBLE)")
        con.execute("CREATE TABLE cw (rank INTEGER, step BIGINT, phase VARCHAR, ms DOUBLE, "
                    "wait DOUBLE)")
        ph, st = [], []
        for step in range(40):
            for rank in range(1 + step % 9):
                ph.append((rank, step, "forward", None, float(rng.randint(0, 4)), "forward"))
                st.append((rank, step, round(rng.uniform(0, 1), 1)))
        con.executemany("INSERT INTO phases VALUES (?, ?, ?, ?, ?, ?)", ph)
        con.executemany("INSERT INTO steps VALUES (?, ?, ?)", st)
        build_own(con)
        rows = con.execute("SELECT rank, step, name, own, others, excess FROM ex").fetchall()
    finally:
        con.close()
    assert len(rows) == 2 * len(ph)
    vals: dict[tuple[int, str], dict[int, float]] = {}
    for rank, step, name, o, *_ in rows:
        vals.setdefault((step, name), {})[rank] = o
    for rank, step, name, o, others, excess in rows:
        rest = [v for r, v in vals[(step, name)].items() if r != rank]
        if not rest:
            assert others is None and excess is None
            continue
        assert others == pytest.approx(median(rest)), (rank, step, name)
        assert excess == pytest.approx(o - median(rest))
