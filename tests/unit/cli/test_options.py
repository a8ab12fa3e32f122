"""Bad options and too little data: one line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from synth_runs import SynthRun, write_run

from stepscope.cli import main


@pytest.mark.parametrize("argv", [
    ["report", "RUN", "--threads", "1000000"],
    ["report", "RUN", "--threads", "0"],
    ["compact", "RUN", "--threads", "-3"],
    ["report", "RUN", "--threads", "many"],
    ["report"],
    ["report", "RUN", "--memory-limit", "abc"],
    ["compact", "RUN", "--memory-limit", "1GB'"],
])
def test_bad_option_is_one_line_exit_2(tmp_path: Path, argv: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", SynthRun(ranks=1, steps=3))
    with pytest.raises(SystemExit) as exc:
        main([str(run) if a == "RUN" else a for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_memory_limit_sizes_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", SynthRun(ranks=1, steps=3))
    for size in ("2GB", "512MiB", "1.5 GB"):
        assert main(["compact", str(run), "--memory-limit", size]) == 0


def test_fail_if_slower_needs_enough_steps(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    a = write_run(tmp_path / "a", SynthRun(ranks=2, steps=40))
    b = write_run(tmp_path / "b", SynthRun(ranks=2, steps=2, seed=1))
    rc = main(["compare", str(a), str(b), "--json", "--fail-if-slower", "5"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "too few steps" in err and "B: 2" in err
    # Enough steps on both sides: the gate decides as before.
    c = write_run(tmp_path / "c", SynthRun(ranks=2, steps=40, seed=2))
    assert main(["compare", str(a), str(c), "--json", "--fail-if-slower", "5"]) == 0
