"""The JSONL is the truth, the Parquet store a cache: a bad store is dropped and rebuilt.

Each case damages a compacted store and checks the report equals a store-free read of the
same rank files, with one note saying the store was rebuilt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from documents import analysed_doc
from synth_runs import Slow, SynthRun, make_records, write_run

from stepscope.analysis import store as st

_REBUILT = "dropped and rebuilt from the rank files"


def _without_store_notes(d: dict[str, Any]) -> dict[str, Any]:
    d["run"]["skipped"] = [s for s in d["run"]["skipped"] if not s.startswith(f"{st.STORE_DIR}/")]
    return d


def _store_notes(d: dict[str, Any]) -> list[str]:
    return [s for s in d["run"]["skipped"] if s.startswith(f"{st.STORE_DIR}/")]


def _run(root: Path, run_id: str = "run-a", seed: int = 0) -> Path:
    run = write_run(root, SynthRun(ranks=2, steps=20, seed=seed,
                                   slow=(Slow(1, "forward", 6.0),)))
    for f in sorted(run.glob("rank*.jsonl")):  # one run id per run
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        f.write_text("".join(json.dumps({**x, "run_id": run_id}) + "\n" for x in lines))
    return run


def _parts(run: Path) -> list[Path]:
    return sorted((run / st.STORE_DIR / st.RECORDS).glob("*/*.parquet"))


def _check(run: Path) -> dict[str, Any]:
    direct = analysed_doc(run, store=False)
    stored = analysed_doc(run)
    notes = _store_notes(stored)
    assert len(notes) == 1 and _REBUILT in notes[0], stored["run"]["skipped"]
    assert _without_store_notes(stored) == direct
    again = analysed_doc(run)  # rebuilt once: no note the next time
    assert _store_notes(again) == [] and again == direct
    return stored


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_unreadable_part_is_rebuilt(tmp_path: Path, damage: str) -> None:
    run = _run(tmp_path / "run")
    st.compact(run)
    part = _parts(run)[0]
    data = part.read_bytes()
    part.write_bytes({"truncated": data[: len(data) // 2],
                      "garbage": b"\x00garbage" * 100, "empty": b""}[damage])
    _check(run)


def test_part_from_another_run_is_not_analysed(tmp_path: Path) -> None:
    other = _run(tmp_path / "other", run_id="run-b", seed=3)
    st.compact(other)
    run = _run(tmp_path / "run")
    st.compact(run)
    src = _parts(other)[0]
    dest = run / st.STORE_DIR / st.RECORDS / src.parent.name / src.name
    shutil.copy(src, dest)
    stored = _check(run)
    assert stored["run"]["run_id"] == "run-a"


def test_part_replaced_by_another_runs_part(tmp_path: Path) -> None:
    other = _run(tmp_path / "other", run_id="run-b", seed=3)
    st.compact(other)
    run = _run(tmp_path / "run")
    st.compact(run)
    shutil.copy(_parts(other)[0], _parts(run)[0])
    assert _check(run)["run"]["run_id"] == "run-a"


def test_state_rewound_from_a_backup_does_not_double_count(tmp_path: Path) -> None:
    recs = make_records(SynthRun(ranks=2, steps=30))
    run = tmp_path / "run"
    run.mkdir()
    lines = {r: [json.dumps(x) + "\n" for x in rs] for r, rs in recs.items()}
    for r, ls in lines.items():
        (run / f"rank{r}.jsonl").write_text("".join(ls[:15]))
    st.compact(run)
    backup = (run / st.STORE_DIR / st.STATE).read_bytes()
    for r, ls in lines.items():
        with open(run / f"rank{r}.jsonl", "a") as fh:
            fh.write("".join(ls[15:]))
    st.compact(run)
    (run / st.STORE_DIR / st.STATE).write_bytes(backup)  # restored: offsets at 15 steps
    stored = _check(run)
    assert stored["run"]["records"] == 60


def test_rank_file_rewritten_shorter_then_grown(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    st.compact(run)
    f = run / "rank1.jsonl"
    lines = f.read_text().splitlines(keepends=True)
    # Rewritten from step 10 with other timings, and grown past the stored offset.
    later = [json.loads(x) for x in lines[10:]]
    for x in later:
        x["step_ms"] = float(x["step_ms"]) + 50.0
    grown = "".join(lines[:10]) + "".join(json.dumps(x) + "\n" for x in later) * 2
    assert len(grown) > len("".join(lines))
    f.write_text(grown)
    _check(run)


def test_missing_part_is_rebuilt(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    st.compact(run)
    _parts(run)[0].unlink()
    _check(run)


@pytest.mark.parametrize("command", ["report", "compact"])
def test_compaction_out_of_memory_is_one_line_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A run of 10^6 rank files exhausts Python's memory in the compaction; here the run has
    # 300 (a few of them empty) and the scan of each file's new lines runs out at the 200th.
    from stepscope.cli import main

    run = tmp_path / "run"
    run.mkdir()
    line = json.dumps(make_records(SynthRun(ranks=1, steps=1))[0][0]) + "\n"
    for r in range(300):
        (run / f"rank{r}.jsonl").write_text("" if r % 7 == 0 else line.replace(
            '"rank": 0', f'"rank": {r}'))
    real = st._last_newline
    calls = []

    def scan(*a: Any) -> int:
        calls.append(1)
        if len(calls) >= 200:
            raise MemoryError
        return real(*a)

    monkeypatch.setattr(st, "_last_newline", scan)
    assert main([command, str(run)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "out of memory" in err, err


def test_part_damaged_inside_is_read_from_the_jsonl(tmp_path: Path) -> None:
    # Damage the checks do not see (the footer intact): DuckDB's read fails, the store is
    # dropped and the rank files are read directly.
    run = write_run(tmp_path / "run", SynthRun(ranks=2, steps=300))
    st.compact(run)
    part = max(_parts(run), key=lambda p: p.stat().st_size)
    data = bytearray(part.read_bytes())
    assert len(data) > 3 * 4096
    data[4:len(data) - 4096 - 8] = b"\xff" * (len(data) - 4096 - 12)
    part.write_bytes(bytes(data))
    direct = analysed_doc(run, store=False)
    stored = analysed_doc(run)
    notes = _store_notes(stored)
    assert len(notes) == 1 and "read directly" in notes[0]
    assert _without_store_notes(stored) == direct
    assert _store_notes(analysed_doc(run)) == []  # rebuilt by the next read
