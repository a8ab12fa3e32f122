"""The store's flat copy of the phase lists: ``phases`` is a view over it where loading
keeps every record, with the rows, columns and types the table built from the lists has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from synth_runs import Slow, SynthRun, make_records

from stepscope.analysis import store as st
from stepscope.analysis.load import load_run


def _write(run: Path, recs: dict[int, list[dict[str, Any]]], upto: int | None = None) -> None:
    run.mkdir(exist_ok=True)
    for r, rs in recs.items():
        (run / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rs[:upto]))


def _phases(run: Path, monkeypatch: pytest.MonkeyPatch, flat: bool) -> tuple[str, Any, Any, list[str]]:
    """(how ``phases`` was made, its rows, its columns and types, the skipped notes)."""
    with monkeypatch.context() as m:
        if not flat:  # the table from the lists, as before the flat copy
            m.setattr(st, "flat_phases_files", lambda con, location: [])
        data = load_run(run)
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


def test_phases_view_over_two_compactions_equals_the_table(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
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
    view = _phases(run, monkeypatch, flat=True)
    table = _phases(run, monkeypatch, flat=False)
    assert (view[0], table[0]) == ("VIEW", "BASE TABLE")
    assert view[1:] == table[1:]
    assert view[2][1] == 1 and all(r[1] <= 29 for r in view[1])


@pytest.mark.parametrize("damage", ["implausible", "no_list"])
def test_a_damaged_list_is_read_from_the_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               damage: str) -> None:
    recs = make_records(SynthRun(ranks=2, steps=20))
    if damage == "implausible":
        recs[1][7]["phases"][0]["ms"] = 1e12
    else:
        del recs[1][7]["phases"]
    run = tmp_path / "run"
    _write(run, recs)
    view = _phases(run, monkeypatch, flat=True)
    table = _phases(run, monkeypatch, flat=False)
    assert view[0] == table[0] == "BASE TABLE"
    assert view[1:] == table[1:] and view[3]  # the record is noted and skipped


def test_a_store_another_version_compacted_is_read_from_the_lists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _write(run, make_records(SynthRun(ranks=2, steps=20)))
    st.compact(run)
    copy = tmp_path / "copy"
    shutil.copytree(run / st.STORE_DIR, copy)
    assert _phases(copy, monkeypatch, flat=True)[0] == "VIEW"  # a store directory, elsewhere
    state = json.loads((copy / st.STATE).read_text())
    (copy / st.STATE).write_text(json.dumps({**state, "version": st.STATE_VERSION - 1}))
    assert _phases(copy, monkeypatch, flat=True)[0] == "BASE TABLE"
