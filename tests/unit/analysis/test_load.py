"""Loading reads the records as few times as it can, and what it keeps stays the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlspy import SqlSpy
from synth_runs import Slow, SynthRun, make_records, write_run

from stepscope.analysis import load

#: The statement that lists the runs of a directory (analysis/launches.py).
RUN_CENSUS = "SELECT coalesce(run_id, ''), count(*), min(start_unix_ns)"

def _load(run: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[Any, list[str]]:
    sqls: list[str] = []
    connect = load._connect
    monkeypatch.setattr(load, "_connect", lambda *a: SqlSpy(connect(*a), sqls, squash=True))
    return load.load_run(run, **kw), sqls


@pytest.mark.parametrize("store", [True, False])
def test_one_validation_pass_and_no_copy_of_the_phase_lists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: bool) -> None:
    # The lines per file, the schema versions and the implausible records were three scans
    # of every record (the last one evaluating the plausibility rule over each phase list,
    # and the copy into ``kept_records`` a second time); ``kept_records`` held every phase list, copied again
    # into ``phases``. Now: one grouped pass, one evaluation of the rule, no list copy.
    run = write_run(tmp_path / "run", SynthRun(ranks=3, steps=12, comm_child=True,
                                               slow=(Slow(1, "forward", 5.0),)))
    data, sqls = _load(run, monkeypatch, store=store)
    try:
        n_phases = data.con.execute("SELECT count(*) FROM phases").fetchone()[0]
    finally:
        data.close()
    assert n_phases > 3 * 12
    # Besides the validation pass, one scan of three columns finds the runs the directory
    # holds (analysis/launches.py: which run to show); it reads no phase list.
    runs = [s for s in sqls if s.startswith(RUN_CENSUS)]
    assert len(runs) == 1 and "phases" not in runs[0], runs
    grouped = [s for s in sqls if "FROM raw_records" in s and "GROUP BY" in s and s not in runs]
    assert len(grouped) == 1, grouped
    # The rule over the phase lists is evaluated once: on a clean run, on each element as
    # ``phases`` is built (the grouped pass then reads no list at all; the rule per list,
    # ``lists_ok``, is only declared in the view of the records).
    assert all(s.startswith("CREATE VIEW raw_records ") for s in sqls if "list_bool_and" in s)
    assert "phases" not in grouped[0] and "lists_ok" not in grouped[0], grouped
    built = [s for s in sqls if s.startswith("CREATE TABLE phases ")]
    if store:  # the store's flat copy: the rule was evaluated at compaction; a view over it
        assert not built and not any("unnest(" in s and "FROM raw_records" in s for s in sqls), built
        assert len([s for s in sqls if s.startswith("CREATE VIEW phases ")]) == 1
    else:  # the rows of ``raw_phases``, each element's rule (``ok``) checked while built
        assert len(built) == 1 and "error(" in built[0] and "NOT coalesce(ok," in built[0], built
        assert "isfinite(p.ms)" in " ".join(s for s in sqls if s.startswith("CREATE VIEW raw_phases "))
    rec = [s for s in sqls if s.startswith(("CREATE TABLE kept_records ", "CREATE VIEW kept_records "))]
    assert len(rec) == 1 and "SELECT *" not in rec[0] and ", phases" not in rec[0], rec


def _tables(data: Any) -> dict[str, list[tuple[Any, ...]]]:
    con = data.con
    return {t: con.execute(f"SELECT * FROM {t} ORDER BY ALL").fetchall()
            for t in ("steps", "phases", "collectives", "unseen_collectives", "step_resources",
                      "lost_steps")}


def test_implausible_and_duplicate_records_keep_the_same_rows(tmp_path: Path) -> None:
    # A record with an implausible phase time is dropped whole (its phases too), and of two
    # records of one (rank, step) the earlier one is kept with its own phase list.
    spec = SynthRun(ranks=3, steps=10, comm_child=True)
    recs = make_records(spec)
    bad = json.loads(json.dumps(recs[1][4]))
    bad["phases"][0]["ms"] = 1e12  # over MAX_MS: implausible
    bad["step"] = 99  # a step of its own: the rest of the run keeps 10 common steps
    later = json.loads(json.dumps(recs[2][6]))
    later["start_unix_ns"] += 1_000_000
    for p in later["phases"]:
        p["ms"] += 100.0
    run = write_run(tmp_path / "run", spec)
    with open(run / "rank1.jsonl", "a") as fh:
        fh.write(json.dumps(bad) + "\n")
    with open(run / "rank2.jsonl", "a") as fh:
        fh.write(json.dumps(later) + "\n")
    clean = write_run(tmp_path / "clean", spec)
    for store in (True, False):
        data = load.load_run(run, store=store)
        try:
            got = _tables(data)
            skipped = list(data.skipped)
        finally:
            data.close()
        ref = load.load_run(clean, store=store)
        try:
            want = _tables(ref)
        finally:
            ref.close()
        assert got == want, store
        assert any("1 record(s) with implausible values" in s for s in skipped), skipped
        assert any("1 duplicate (rank, step)" in s for s in skipped), skipped


@pytest.mark.parametrize("store", [True, False])
def test_duplicate_paths_counted_a_block_of_ranks_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: bool) -> None:
    # phase_dups checks every record (rank, step): a block of steps at a time scanned every
    # row of ``phases`` per block (its rows lie rank by rank); a block of ranks reads its own.
    # The store's flat copy lies step by step within each rank block: blocks of steps there.
    from stepscope.analysis import blocks

    spec = SynthRun(ranks=4, steps=6, comm_child=True)
    recs = make_records(spec)
    twice = json.loads(json.dumps(recs[2][3]))
    twice["phases"].append(dict(twice["phases"][0]))  # one path listed twice
    recs[2][3] = twice
    monkeypatch.setattr(blocks, "BLOCK_RECORDS", 6)  # one rank (6 records) per block
    n, sqls = _phase_dups(tmp_path, recs, monkeypatch, store)
    assert n == 1
    per_block = [s for s in sqls if "bit_count(bit_or(" in s]
    by, n_blocks, twice_in = ("step", 6, 3) if store else ("rank", 4, 2)
    assert len(per_block) == n_blocks and all(f"{by} BETWEEN" in s for s in per_block), per_block
    # Only the block holding the twice-listed path is grouped by the keys themselves.
    by_key = [s for s in sqls if "HAVING count(*) > 1" in s]
    assert len(by_key) == 1 and f"{by} BETWEEN {twice_in} AND {twice_in}" in by_key[0], by_key


def _phase_dups(tmp_path: Path, recs: dict[int, list[dict[str, Any]]],
                monkeypatch: pytest.MonkeyPatch, store: bool) -> tuple[int, list[str]]:
    """Write ``recs`` as a run, load it; the duplicate-path count and the statements run."""
    run = tmp_path / "run"
    run.mkdir()
    for r, rows in recs.items():
        (run / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    data, sqls = _load(run, monkeypatch, store=store)
    try:
        return int(data.con.execute("SELECT n FROM duplicate_paths").fetchone()[0]), sqls
    finally:
        data.close()


@pytest.mark.parametrize("store", [True, False])
def test_duplicate_paths_counted_by_keys_where_the_run_has_over_64_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: bool) -> None:
    # The per-record check sets one bit per distinct path of the run: with more than 64
    # there are not enough bits, and every block is counted by the keys themselves.
    spec = SynthRun(ranks=2, steps=4)
    recs = make_records(spec)
    many = recs[0][1]
    top = many["phases"][0]
    many["phases"] += [{**top, "name": f"user{k}", "parent": None} for k in range(70)]
    twice = recs[1][2]
    twice["phases"].append(dict(twice["phases"][0]))  # one path listed twice
    n, sqls = _phase_dups(tmp_path, recs, monkeypatch, store)
    assert n == 1
    assert not any("bit_count(bit_or(" in s for s in sqls)
    assert len([s for s in sqls if "HAVING count(*) > 1" in s]) >= 1


@pytest.mark.parametrize("store", [True, False])
def test_records_copied_without_decoding_the_phase_lists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: bool) -> None:
    # ``kept_records`` tested "phases IS NOT NULL": at 10^8 samples that decoded every phase list
    # once more (~8 s CPU). The grouped pass counts the records whose only missing field
    # is the list; with none, nothing but the phases table reads the lists.
    run = write_run(tmp_path / "run", SynthRun(ranks=3, steps=8, comm_child=True))
    data, sqls = _load(run, monkeypatch, store=store)
    data.close()
    # Nor is every record's every column copied: ``kept_records`` is a view of the rows kept.
    rec = [s for s in sqls if s.startswith(("CREATE TABLE kept_records ", "CREATE VIEW kept_records "))]
    assert rec == [s for s in rec if s.startswith("CREATE VIEW kept_records ")], rec
    assert len(rec) == 1 and "phases" not in rec[0], rec
    reading = [s for s in sqls if "phases" in s and "FROM raw_records" in s]
    assert not reading, reading  # the lists' rows are read from ``raw_phases`` alone
    built = [s for s in sqls if "FROM raw_phases" in s]
    if store:  # the store's flat copy is read instead
        assert not built, built
    else:
        assert len(built) == 1 and built[0].startswith("CREATE TABLE phases "), built


@pytest.mark.parametrize("store", [True, False])
def test_a_record_without_its_phase_list_is_still_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: bool) -> None:
    spec = SynthRun(ranks=3, steps=10, comm_child=True)
    recs = make_records(spec)
    bare = json.loads(json.dumps(recs[0][2]))
    bare["phases"] = None
    bare["step"] = 77  # its own step: the other steps stay common to every rank
    run = write_run(tmp_path / "run", spec)
    with open(run / "rank0.jsonl", "a") as fh:
        fh.write(json.dumps(bare) + "\n")
    clean = write_run(tmp_path / "clean", spec)
    data, sqls = _load(run, monkeypatch, store=store)
    try:
        got, skipped = _tables(data), list(data.skipped)
    finally:
        data.close()
    # The records checked up front (the record's own step is on one rank only): the kept
    # ones are those with a list.
    rec = [s for s in sqls if s.startswith(("CREATE TABLE kept_records ", "CREATE VIEW kept_records "))]
    assert rec and " listed " in rec[-1], rec
    ref = load.load_run(clean, store=store)
    try:
        assert got == _tables(ref)
    finally:
        ref.close()
    assert any("rank0.jsonl: 1 corrupt or incomplete line(s)" in s for s in skipped), skipped


def _hostile(kind: str, spec: SynthRun) -> dict[int, list[dict[str, Any]]]:
    recs = make_records(spec)
    rec = recs[1][4]
    if kind == "phase_ms":
        rec["phases"][0]["ms"] = 1e12  # over MAX_MS
    elif kind == "unnamed":  # an element the phases table leaves out is still checked
        rec["phases"].append({"name": None, "parent": None, "ms": float("inf")})
    elif kind == "no_list":
        rec["phases"] = None
    elif kind == "untimed_bad":  # left out anyway, but still counted as implausible
        rec["untimed"] = True
        rec["phases"][0]["start_ms"] = -1e10
    elif kind == "partial_step":  # a step not on every rank (a live job's last one)
        del recs[2][-1]
    elif kind == "partial_bad":  # ... whose phase list is implausible
        del recs[2][-1]
        recs[1][-1]["phases"][1]["end_ms"] = float("nan")
    return recs


@pytest.mark.parametrize("kind", ["clean", "phase_ms", "unnamed", "no_list", "untimed_bad",
                                  "partial_step", "partial_bad"])
@pytest.mark.parametrize("store", [True, False])
def test_lists_checked_in_phases_gives_what_checking_first_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, store: bool) -> None:
    # Loading assumes every phase list present and plausible and checks it while building
    # ``phases``; where the assumption fails it loads again with the checks up front. Both
    # must give the same tables and the same notes.
    recs = _hostile(kind, SynthRun(ranks=3, steps=8, comm_child=True))
    got: dict[bool, Any] = {}
    for fast in (True, False):
        run = tmp_path / f"run-{fast}"
        run.mkdir()
        for r, rows in recs.items():
            (run / f"rank{r}.jsonl").write_text(
                "".join(json.dumps(x, allow_nan=True) + "\n" for x in rows))
        monkeypatch.setattr(load, "CHECK_LISTS_IN_PHASES", fast)
        data, sqls = _load(run, monkeypatch, store=store)
        try:
            got[fast] = (_tables(data), [s.replace(f"run-{fast}", "run") for s in data.skipped])
        finally:
            data.close()
        if fast:
            first = [s for s in sqls if "FROM raw_records" in s and "GROUP BY" in s
                     and not s.startswith(RUN_CENSUS)]
            # The grouped pass again, with the lists, only where the assumption failed.
            assert len(first) == (1 if kind in ("clean", "partial_step") else 2), first
    assert got[True] == got[False]
    notes = " | ".join(got[True][1])
    if kind.startswith("partial"):
        assert "not present on every rank skipped" in notes, notes
    if kind in ("phase_ms", "unnamed", "untimed_bad", "partial_bad"):
        assert "rank1.jsonl: 1 record(s) with implausible values" in notes, notes
    if kind == "no_list":
        assert "rank1.jsonl: 1 corrupt or incomplete line(s)" in notes, notes
