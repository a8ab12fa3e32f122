"""The Parquet store: incremental compaction, equivalence with the JSONL path, remote globs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import pytest
from documents import analysed_doc
from synth_runs import Slow, SynthRun, make_records, write_run

from stepscope.analysis import store as st
from stepscope.analysis.load import load_run
from stepscope.cli import main
from stepscope.common.errors import AnalysisError


def _damaged_run(root: Path) -> Path:
    run = write_run(root, SynthRun(ranks=4, steps=40, slow=(Slow(2, "forward", 6.0),),
                                   comm_child=True))
    with open(run / "rank1.jsonl", "a") as fh:
        fh.write("{not json\n")
    with open(run / "rank3.jsonl", "a") as fh:
        fh.write('{"schema": 1, "rank": 3, "st')  # torn last line
    return run


def test_parquet_path_equals_jsonl_path(tmp_path: Path) -> None:
    run = _damaged_run(tmp_path / "run")
    direct = analysed_doc(run, store=False)
    assert not (run / st.STORE_DIR).exists()
    stored = analysed_doc(run)  # compacts, then reads Parquet
    assert (run / st.STORE_DIR / st.RECORDS).is_dir()
    assert stored == direct
    assert any("truncated last line" in s for s in stored["run"]["skipped"])
    assert any("rank1.jsonl: 1 corrupt" in s for s in stored["run"]["skipped"])
    assert stored["stragglers"] and stored["stragglers"][0]["rank"] == 2
    # Read again from the store alone (its directory, as if copied elsewhere): same findings.
    copy = tmp_path / "elsewhere"
    shutil.copytree(run / st.STORE_DIR, copy)
    alone = analysed_doc(copy)
    assert alone["stragglers"] == direct["stragglers"]
    assert alone["phases"] == direct["phases"]


def test_compaction_is_incremental_and_leaves_a_torn_line(tmp_path: Path) -> None:
    recs = make_records(SynthRun(ranks=2, steps=30))
    run = tmp_path / "run"
    run.mkdir()
    lines = {r: [json.dumps(x) + "\n" for x in rs] for r, rs in recs.items()}
    for r, ls in lines.items():
        (run / f"rank{r}.jsonl").write_text("".join(ls[:20]) + ls[20][:15])  # torn line 21
    first = st.compact(run)
    assert first.new_files == 2 and not first.rebuilt
    assert all(fs.torn for fs in first.files.values())
    size20 = len("".join(lines[0][:20]).encode())
    assert first.files["rank0.jsonl"].offset == size20  # the torn line is not consumed
    again = st.compact(run)
    assert again.new_bytes == 0 and again.new_files == 0
    for r, ls in lines.items():  # the writer finishes its line and adds the rest
        with open(run / f"rank{r}.jsonl", "a") as fh:
            fh.write(ls[20][15:] + "".join(ls[21:]))
    third = st.compact(run)
    assert third.new_bytes == sum(len("".join(ls[20:]).encode()) for ls in lines.values())
    con = duckdb.connect()
    n = con.execute(f"SELECT count(*), count(DISTINCT (rank, step)) FROM "
                    f"{st.parquet_source(str(run / st.STORE_DIR))}").fetchone()
    assert n == (60, 60)  # every record once: no line read twice, none lost
    assert analysed_doc(run) == analysed_doc(run, store=False)
    # A rewritten (shorter) file triggers a rebuild.
    (run / "rank1.jsonl").write_text("".join(lines[1][:10]))
    assert st.compact(run).rebuilt


def test_remote_and_glob_locations_build_the_same_query(tmp_path: Path) -> None:
    assert st.parquet_glob("s3://bucket/run/") == "s3://bucket/run/**/records/*/*.parquet"
    src = st.parquet_source("s3://bucket/run")
    assert "read_parquet('s3://bucket/run/**/records/*/*.parquet'" in src
    assert "hive_partitioning=true" in src
    assert st.is_remote("gs://b/r") and st.is_remote("hf://datasets/x/y")
    run = write_run(tmp_path / "run", SynthRun(ranks=3, steps=20, slow=(Slow(1, "dataloader"),)))
    direct = analysed_doc(run, store=False)
    st.compact(run)
    # The same SQL over a local glob: what `stepscope report s3://bucket/run/` runs remotely.
    via_glob = analysed_doc(str(tmp_path / "run" / "parquet" / "records" / "*"))
    assert via_glob["stragglers"] == direct["stragglers"]
    with pytest.raises(AnalysisError, match="no Parquet records"):
        load_run(str(tmp_path / "nothing-here" / "*"))


def test_compact_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", SynthRun(ranks=2, steps=12))
    assert main(["compact", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_files"] == 2 and out["new_bytes"] > 0
    assert main(["compact", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_bytes"] == 0
    assert main(["compact", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main(["report", str(run), "--json", "--threads", "1", "--memory-limit", "300MB"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["ranks"] == 2


def _redone_run(root: Path) -> Path:
    """A run relaunched from a checkpoint (steps 20..29 done twice, the same run id: a
    launcher whose job id outlives the relaunch), with a corrupt line, a torn last line and
    a record outside the timed filter."""
    first = make_records(SynthRun(ranks=3, steps=30, seed=1))
    again = make_records(SynthRun(ranks=3, steps=20, seed=2))
    end = max(r[-1]["start_unix_ns"] for r in first.values()) + 60 * 10**9
    root.mkdir(parents=True)
    for rank, rows in first.items():
        for rec in again[rank]:
            rec["step"] += 20
            rec["start_unix_ns"] += end
        lines = [json.dumps(r) for r in rows + again[rank]]
        if rank == 1:
            lines.insert(5, "{not json")
            lines.append(json.dumps({**rows[3], "untimed": True, "step": 3}))
        text = "\n".join(lines) + "\n"
        if rank == 2:
            text += '{"schema": 1, "rank": 2, "st'  # torn
        (root / f"rank{rank}.jsonl").write_text(text)
    return root


@pytest.mark.parametrize("store", [True, False])
def test_goodput_reads_no_rank_file_twice(tmp_path: Path, store: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Goodput's rows come from the lines the load read (table ``timed_records``), equal to what its
    own re-read of the rank files gives; the files are not read a second time."""
    from stepscope.analysis import goodput
    from stepscope.analysis.run import analyze_run

    run = _redone_run(tmp_path / "run")
    reread = goodput._read_light

    def no_reread(*a: Any, **k: Any) -> Any:
        raise AssertionError("goodput re-read the rank files")

    monkeypatch.setattr(goodput, "_read_light", no_reread)
    doc = analyze_run(run, store=store, keep=True)
    data = doc.pop("_data")
    try:
        gp = doc["goodput"]
        assert gp["runs"] and len(gp["runs"]) == 2  # the relaunch is a segment of its own
        assert gp["lost_gpu_hours"]["restarts"] > 0
        # The old path (re-reading the files) gives the same section.
        monkeypatch.setattr(goodput, "_read_light", reread)
        data.con.execute("DROP TABLE timed_records")
        assert goodput.compute_goodput(data.con, run, doc["run"]["warmup"]) == gp
        # Whole ranks a block at a time (one each): the relaunch's segments, the re-done
        # steps and every sum are the same.
        monkeypatch.setattr(goodput, "BLOCK_ROWS", 1)
        assert goodput.compute_goodput(data.con, run, doc["run"]["warmup"]) == gp
    finally:
        data.close()


def test_no_progress_bar_on_stdout(tmp_path: Path) -> None:
    # DuckDB draws a progress bar on stdout for a query over 2 s, even when stdout is a
    # file: it would corrupt ``report --json > out.json`` on a large run. (Checked in a
    # child: DuckDB's default depends on the process it runs in.)
    import os
    import subprocess
    import sys

    run = write_run(tmp_path / "run", SynthRun(ranks=2, steps=6))
    code = ("import sys; from stepscope.analysis.load import load_run; d = load_run(sys.argv[1]); "
            "print(d.con.execute(\"SELECT current_setting('enable_progress_bar')\").fetchone()[0])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True,
                         env=env, check=True, timeout=300)
    assert out.stdout.strip() == "False"


def test_a_run_directory_rewritten_by_a_longer_run_is_rebuilt(tmp_path: Path) -> None:
    """A new run written over an old one's rank files (``stepscope demo`` twice into one
    directory) must not be read as the old run plus appended lines: the files grew, but
    they begin with other records."""
    old = write_run(tmp_path, SynthRun(ranks=2, steps=20, seed=1))
    st.compact(old)
    for f in old.glob("rank*.jsonl"):
        f.unlink()
    new = write_run(tmp_path, SynthRun(ranks=2, steps=30, slow=(Slow(1, "forward", 6.0),)))
    assert new == old
    again = st.compact(new)
    assert again.rebuilt
    con = duckdb.connect()
    got = con.execute(f"SELECT count(*), count(DISTINCT (rank, step)) FROM "
                      f"{st.parquet_source(str(new / st.STORE_DIR))}").fetchone()
    assert got == (60, 60)  # the new run's records only, each once
    assert analysed_doc(new) == analysed_doc(new, store=False)
    # Appending to the same file is still incremental.
    assert not st.compact(new).rebuilt
