"""Compaction by rank block: plain writes per block, rank files parsed in place, and the
longest-line check of the combined file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pytest
from documents import analysed_doc
from synth_runs import SynthRun, make_records, write_run

from stepscope.analysis import record_files
from stepscope.analysis import store as st


def _block_ranks(run: Path) -> dict[str, set[int]]:
    """The ranks each rank-block directory of the store holds."""
    out: dict[str, set[int]] = {}
    for part in (run / st.STORE_DIR / st.RECORDS).glob("*/*.parquet"):
        ranks = duckdb.execute(f"SELECT DISTINCT rank FROM read_parquet('{part}')").fetchall()
        out.setdefault(part.parent.name, set()).update(r for (r,) in ranks)
    return out


def test_blocks_in_place_files_and_misfits_store_what_the_jsonl_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(st, "RANK_BLOCK", 2)
    monkeypatch.setattr(st, "_IN_PLACE_BYTES", 1)  # every file read whole is read in place
    run = write_run(tmp_path / "run", SynthRun(ranks=6, steps=20))
    with open(run / "rank3.jsonl", "a") as fh:  # rank 5's record in rank 3's file, a bad line
        rec = make_records(SynthRun(ranks=6, steps=21))[5][20]
        fh.write(json.dumps(rec) + "\n{not json\n")
    with open(run / "rank4.jsonl", "a") as fh:
        fh.write('{"schema": 1, "rank": 4, "st')  # torn: copied, not read in place
    copied: list[str] = []
    take = st._take_lines

    def spy(fh: Any, name: str, *a: Any) -> Any:
        copied.append(name)
        return take(fh, name, *a)

    monkeypatch.setattr(st, "_take_lines", spy)
    stored = analysed_doc(run)
    assert copied == ["rank4.jsonl"]
    assert stored == analysed_doc(run, store=False)
    # Every record sits in its rank's block, the misfit included (its block was partitioned).
    blocks = _block_ranks(run)
    assert blocks["rank_block=2"] == {4, 5}
    assert all(r is None or f"rank_block={r // 2}" == b for b, rs in blocks.items() for r in rs)
    assert any("rank3.jsonl: 1 corrupt" in s for s in stored["run"]["skipped"])


def test_a_file_that_grows_while_read_in_place_is_stored_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(st, "_IN_PLACE_BYTES", 1)
    recs = make_records(SynthRun(ranks=2, steps=30))
    run = tmp_path / "run"
    run.mkdir()
    for r, rs in recs.items():
        (run / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rs[:20]))
    reader = record_files.json_reader
    grown: list[bool] = []

    def growing(files: list[Path], *a: Any, **k: Any) -> str:
        if not grown:  # the job appends a step just as DuckDB starts reading
            grown.append(True)
            with open(run / "rank0.jsonl", "a") as fh:
                fh.write(json.dumps(recs[0][20]) + "\n")
        return reader(files, *a, **k)

    monkeypatch.setattr(st, "json_reader", growing)
    first = st.compact(run)
    monkeypatch.setattr(st, "json_reader", reader)
    src = st.parquet_source(str(run / st.STORE_DIR))
    assert duckdb.execute(f"SELECT count(*) FROM {src}").fetchone() == (40,)
    assert first.files["rank0.jsonl"].offset < (run / "rank0.jsonl").stat().st_size
    st.compact(run)  # the appended line now, once
    n = duckdb.execute(f"SELECT count(*), count(DISTINCT (rank, step)) FROM {src}").fetchone()
    assert n == (41, 41)
    assert analysed_doc(run) == analysed_doc(run, store=False)


@pytest.mark.parametrize("data", [
    b'{"a":1}\n', b'{"a":1}\n{"b":2}\n', b'{"a":1}\n\n{"b":2}\n', b' {"a":1}\n',
    b'{"a":"0123456789"}\n', b'{"a":1}\n{"a":"0123456789"}\n{"c":3}\n', b'{"a":"012345"}\n',
    b'{"a":"0123456"}\n', b'{"a":1}\n[1]\n', b'{"abcdefghijklm', b'{"a":1}\n{"abcdefghijklm',
])
def test_regular_is_the_split_rule(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(st, "MAX_LINE_BYTES", 14)
    n_lines = data.count(b"\n")
    by_split = (data.startswith(b"{") and data.count(b"\n{") == n_lines - 1
                and len(data) <= 14 * max(1, n_lines)
                and max(map(len, data.split(b"\n"))) <= 14)
    assert st._regular(data) == by_split
