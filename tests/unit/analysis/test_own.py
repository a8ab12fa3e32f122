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
        con.execute("CREATE OR REPLACE TABLE collective_waits"
                    "(rank INT, step INT, phase VARCHAR, wait DOUBLE, ms DOUBLE)")
        con.execute("CREATE OR REPLACE TABLE steps(rank INT, step INT, residual_ms DOUBLE)")
        con.executemany("INSERT INTO phases VALUES (?, 0, 'forward', NULL, ?)", list(enumerate(vals)))
        con.executemany("INSERT INTO steps VALUES (?, 0, 0.0)", [(r,) for r in range(n)])
        build_own(con)
        got = dict(con.execute("SELECT rank, others FROM own_excess WHERE name = 'forward'").fetchall())
        for r in range(n):
            others = vals[:r] + vals[r + 1:]
            if not others:
                assert got[r] is None
            else:
                assert got[r] == pytest.approx(statistics.median(others)), (vals, r)


def test_sql_median_is_duckdbs_median_bit_for_bit():
    # phase_waits takes a phase's run-wide median wait from build_own's numpy rows
    # (own.sql_median) instead of a SQL median over the joined rows: the same number.
    import numpy as np

    from stepscope.analysis.own import sql_median

    rng = np.random.default_rng(5)
    con = duckdb.connect()
    for n in [*range(1, 12), 100, 1001]:
        for scale in (1e-3, 7.0, 1e9):
            v = rng.uniform(-1, 1, n) * scale + rng.integers(0, 3, n) * 0.1
            if n > 3:
                v[: n // 3] = 0.0  # rows with no collective: wait 0.0
            got = con.execute("SELECT median(x) FROM (SELECT unnest(?::DOUBLE[]) AS x)",
                              [v.tolist()]).fetchone()[0]
            assert sql_median(v) == got, (n, scale)
    for pair in ([1e308, 1.5e308], [5e-324, 5e-324]):  # overflow, underflow
        got = con.execute("SELECT median(x) FROM (SELECT unnest(?::DOUBLE[]) AS x)",
                          [pair]).fetchone()[0]
        assert sql_median(np.asarray(pair)) == got, pair
    assert sql_median(np.zeros(0)) is None
