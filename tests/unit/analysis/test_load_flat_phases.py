"""The store's flat copy of the phase lists (their only copy in the store): ``phases`` is a
view over it where loading keeps every record, the kept records' rows otherwise, with the
rows, columns and types the table built from the rank files' lists has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from synth_runs import Slow, SynthRun, make_records

from stepscope.analysis import store as st
from stepscope.analysis.load import load_run
from stepscope.common.errors import AnalysisError


def _write(run: Path, recs: dict[int, list[dict[str, Any]]], upto: int | None = None) -> None:
    run.mkdir(exist_ok=True)
    for r, rs in recs.items():
        (run / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rs[:upto]))


def _phases(run: Path, flat: bool) -> tuple[str, Any, Any, list[str]]:
    """(how ``phases`` was made, its rows, its columns and types, the skipped notes);
    ``flat``: from the store, else from the rank files' lists."""
    data = load_run(run, store=flat)
    try:
        con = data.con
        kind = con.execute("SELECT table_type FROM information_schema.tables "
                           "WHERE table_name = 'phases'").fetchone()[0]
        rows = con.execute("SELECT * FROM phases ORDER BY ALL").fetchall()
        cols = con.execute("SELECT column_name, data_type FROM information_schema.columns "
                           "WHERE table_name = 'phases' ORDER BY ordinal_position").fetchall()
        dups = con.execute("SELECT n FROM duplicate_paths").fetchone()[0]
        return kind, rows, (cols, dups), list(data.skipped)
    finally:
        data.close()


def test_phases_view_over_two_compactions_equals_the_table(tmp_path: Path) -> None:
    recs = make_records(SynthRun(ranks=3, steps=30, slow=(Slow(1, "forward", 6.0),),
                                 comm_child=True, clock="cuda"))
    recs[2][5]["phases"].append(dict(recs[2][5]["phases"][0]))  # a path listed twice
    recs[0].append({**recs[0][-1], "step": 30})  # a step on one rank only: not analysed
    run = tmp_path / "run"
    _write(run, recs, 20)
    st.compact(run)
    _write(run, recs)  # the rest: a second compaction adds its own flat files
    st.compact(run)
    assert len(list((run / st.STORE_DIR / st.PHASES).rglob("*.parquet"))) == 2  # one rank block
    view = _phases(run, flat=True)
    table = _phases(run, flat=False)
    assert (view[0], table[0]) == ("VIEW", "BASE TABLE")
    assert view[1:] == table[1:]
    assert view[2][1] == 1 and all(r[1] <= 29 for r in view[1])


@pytest.mark.parametrize("damage", ["implausible", "no_list"])
def test_a_damaged_list_gives_what_the_lists_give(tmp_path: Path, damage: str) -> None:
    recs = make_records(SynthRun(ranks=2, steps=20))
    if damage == "implausible":
        recs[1][7]["phases"][0]["ms"] = 1e12
    else:
        del recs[1][7]["phases"]
    run = tmp_path / "run"
    _write(run, recs)
    view = _phases(run, flat=True)
    table = _phases(run, flat=False)
    assert view[0] == table[0] == "BASE TABLE"
    assert view[1:] == table[1:] and view[3]  # the record is noted and skipped


def test_a_store_directory_another_version_compacted_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write(run, make_records(SynthRun(ranks=2, steps=20)))
    st.compact(run)
    copy = tmp_path / "copy"
    shutil.copytree(run / st.STORE_DIR, copy)
    assert _phases(copy, flat=True)[0] == "VIEW"  # a store directory, elsewhere
    state = json.loads((copy / st.STATE).read_text())
    (copy / st.STATE).write_text(json.dumps({**state, "version": st.STATE_VERSION - 1}))
    # Its records may lack their phase rows: one line, not a report without phases.
    with pytest.raises(AnalysisError, match="another stepscope version"):
        load_run(copy)
    # A store without a state file whose records still hold their lists (the older layout).
    (copy / st.STATE).unlink()
    import duckdb

    for part in (copy / st.RECORDS).glob("*/*.parquet"):
        con = duckdb.connect()
        con.execute(f"COPY (SELECT * EXCLUDE (listed, lists_ok) FROM read_parquet('{part}')) "
                    f"TO '{part}.old' (FORMAT parquet)")
        con.close()
        part.unlink()
        part.with_name(part.name + ".old").rename(part)
    with pytest.raises(AnalysisError, match="another stepscope version"):
        load_run(copy)


def _all_tables(data: Any) -> dict[str, list[tuple[Any, ...]]]:
    return {t: data.con.execute(f"SELECT * FROM {t} ORDER BY ALL").fetchall()
            for t in ("steps", "phases", "collectives", "duplicate_paths")}


def test_the_store_holds_each_list_once_and_every_fallback_reads_its_rows(
        tmp_path: Path) -> None:
    # Only the flat dataset holds the phase lists; the loader takes the kept records' rows
    # by their ids where not every record is kept: a duplicate (rank, step) whose lists
    # differ, an implausible record, a torn last line, and an older run in the directory.
    spec = SynthRun(ranks=3, steps=24, comm_child=True, slow=(Slow(2, "forward", 7.0),))
    recs = make_records(spec)
    old = make_records(SynthRun(ranks=3, steps=6))
    for rs in old.values():
        for x in rs:
            x["run_id"], x["start_unix_ns"] = "older", x["start_unix_ns"] - 10**12
    dup = json.loads(json.dumps(recs[1][4]))
    dup["start_unix_ns"] += 1  # the later one: skipped
    dup["phases"][0]["ms"] += 50.0
    recs[1].insert(5, dup)
    recs[0][9]["phases"][0]["ms"] = 1e12  # implausible
    run = tmp_path / "run"
    run.mkdir()
    for r in recs:
        (run / f"rank{r}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in old[r] + recs[r])
            + ('{"schema": 1, "ra' if r == 2 else ""))
    got = {}
    for run_id in (None, "older"):
        for stored in (True, False):
            data = load_run(run, store=stored, run_id=run_id)
            try:
                got[run_id, stored] = (_all_tables(data), list(data.skipped))
            finally:
                data.close()
        assert got[run_id, True] == got[run_id, False]
    newest = got[None, True]
    assert any("duplicate" in s for s in newest[1]) and any("implausible" in s for s in newest[1])
    assert any("truncated last line" in s for s in newest[1])
    assert {r[1] for r in got["older", True][0]["steps"]} == set(range(6))
    # The layout: no list beside the records; each flat row names its record.
    import duckdb

    store = run / st.STORE_DIR
    con = duckdb.connect()
    cols = {c for (c,) in con.execute(
        f"SELECT name FROM parquet_schema('{store}/{st.RECORDS}/*/*.parquet')").fetchall()}
    assert "phases" not in cols and {"rec", "listed", "lists_ok"} <= cols
    orphans = con.execute(
        f"""SELECT count(*) FROM read_parquet('{store}/{st.PHASES}/*/*.parquet') p
            ANTI JOIN read_parquet('{store}/{st.RECORDS}/*/*.parquet') r USING (rec)""").fetchone()
    n_recs = con.execute(
        f"SELECT count(*), count(DISTINCT rec) FROM read_parquet('{store}/{st.RECORDS}/*/*.parquet')"
    ).fetchone()
    con.close()
    assert orphans == (0,) and n_recs[0] == n_recs[1] == sum(len(rs) for rs in recs.values()) + 18
