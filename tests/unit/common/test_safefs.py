"""Nothing outside a run directory is written or read through links planted in it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from synth_runs import SynthRun, write_run

from stepscope.analysis import store as st
from stepscope.analysis.load import load_run
from stepscope.cli import main


def _victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    v = tmp_path / "outside" / name
    v.parent.mkdir(exist_ok=True)
    v.write_text("precious\n")
    return v


def _run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", SynthRun(ranks=2, steps=12))


def _report(run: Path, *extra: str) -> int:
    return main(["report", str(run), "--json", *extra])


@pytest.mark.parametrize("name", ["_lock", "_state.json", "_writing"])
@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_store_files_planted_as_links_are_not_written_through(
        tmp_path: Path, name: str, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    victim = _victim(tmp_path)
    (run / st.STORE_DIR).mkdir()
    planted = run / st.STORE_DIR / name
    if kind == "symlink":
        planted.symlink_to(victim)
    else:
        os.link(victim, planted)
    assert _report(run) == 0
    assert victim.read_text() == "precious\n"
    assert list(victim.parent.iterdir()) == [victim]


def test_state_tmp_planted_as_a_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    victim = _victim(tmp_path)
    (run / st.STORE_DIR).mkdir()
    (run / st.STORE_DIR / "_state.json.tmp").symlink_to(victim)
    assert _report(run) == 0
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("where", ["store", "records", "phases", "block"])
def test_store_directories_planted_as_links(tmp_path: Path, where: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    store = run / st.STORE_DIR
    if where == "store":
        store.symlink_to(outside, target_is_directory=True)
    else:
        store.mkdir()
        if where == "block":
            (store / st.RECORDS).mkdir()
            (store / st.RECORDS / "rank_block=0").symlink_to(outside, target_is_directory=True)
        else:
            (store / {"records": st.RECORDS, "phases": st.PHASES}[where]).symlink_to(
                outside, target_is_directory=True)
    assert _report(run) == 0
    assert list(outside.iterdir()) == []  # nothing created there


def test_a_part_linked_to_an_outside_file_is_not_read(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    other = write_run(tmp_path / "other", SynthRun(ranks=2, steps=12, seed=5))
    st.compact(other)
    outside_part = next((other / st.STORE_DIR / st.RECORDS).glob("*/*.parquet"))
    run = _run(tmp_path)
    st.compact(run)
    part = next((run / st.STORE_DIR / st.RECORDS).glob("*/*.parquet"))
    part.unlink()
    part.symlink_to(outside_part)
    direct = load_run(run, store=False)
    stored = load_run(run)
    try:
        assert stored.records == direct.records
        assert any("rebuilt" in n for n in stored.store_notes)
    finally:
        direct.close()
        stored.close()
    assert not part.is_symlink()
    assert outside_part.exists()


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_report_outputs_refuse_planted_links(tmp_path: Path, kind: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    victims = [_victim(tmp_path, "a.txt"), _victim(tmp_path, "b.txt")]
    for out, v in zip(("summary.md", "report.html"), victims, strict=True):
        if kind == "symlink":
            (run / out).symlink_to(v)
        else:
            os.link(v, run / out)
    rc = main(["report", str(run), "--markdown", str(run / "summary.md"),
               "--html", str(run / "report.html")])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "link" in err
    assert all(v.read_text() == "precious\n" for v in victims)


def test_report_outputs_written_normally(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    (run / "summary.md").write_text("old")
    assert main(["report", str(run), "--markdown", str(run / "summary.md"),
                 "--html", str(run / "report.html")]) == 0
    assert (run / "summary.md").read_text().startswith("#")
    assert (run / "report.html").stat().st_size > 1000
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []


def test_outputs_are_readable_by_others(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    assert main(["report", str(run), "--markdown", str(tmp_path / "s.md")]) == 0
    assert (tmp_path / "s.md").stat().st_mode & 0o777 == 0o644
