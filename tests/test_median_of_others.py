"""The SQL median of the *other* ranks (analysis/own.build_own) against Python's.

It keeps three sorted values per step instead of every rank's list (memory linear in ranks);
with two ranks an off-by-one there compared each rank with itself and hid every straggler.
"""

from __future__ import annotations

import random
import statistics

import duckdb
import pytest

from stepscope.analysis.own import build_own


@pytest.mark.parametrize("n", range(1, 10))
def test_median_of_the_other_ranks_matches_python(n):
    rng = random.Random(n)
    con = duckdb.connect()
    for trial in range(10):
        vals = [round(rng.uniform(0, 100), 3) for _ in range(n)]
        if trial == 0 and n > 1:
            vals[-1] = vals[0]  # ties
        con.execute("CREATE OR REPLACE TABLE phases"
                    "(rank INT, step INT, path VARCHAR, parent VARCHAR, ms DOUBLE)")
        con.execute("CREATE OR REPLACE TABLE cw(rank INT, step INT, phase VARCHAR, wait DOUBLE, ms DOUBLE)")
        con.execute("CREATE OR REPLACE TABLE steps(rank INT, step INT, residual_ms DOUBLE)")
        con.executemany("INSERT INTO phases VALUES (?, 0, 'forward', NULL, ?)", list(enumerate(vals)))
        con.executemany("INSERT INTO steps VALUES (?, 0, 0.0)", [(r,) for r in range(n)])
        build_own(con)
        got = dict(con.execute("SELECT rank, others FROM ex WHERE name = 'forward'").fetchall())
        for r in range(n):
            others = vals[:r] + vals[r + 1:]
            if not others:
                assert got[r] is None
            else:
                assert got[r] == pytest.approx(statistics.median(others)), (vals, r)
