"""``stepscope compact``: its lines name the run's path, which is the user's, so control and
format characters in it are written out as text on stdout and on stderr."""

from __future__ import annotations

from pathlib import Path

import pytest
from synth_runs import SynthRun, write_run

from stepscope.cli import main

HOSTILE = "run\u202eevil\x1b[31m"


def test_compact_lines_write_out_control_characters_in_the_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / HOSTILE, SynthRun(ranks=2, steps=6))
    assert main(["compact", str(run)]) == 0
    out = capsys.readouterr().out
    assert "updated" in out or "rebuilt" in out
    assert "\u202e" not in out and "\x1b" not in out and "\\u202eevil\\x1b[31m" in out

    assert main(["compact", str(tmp_path / (HOSTILE + "-missing"))]) == 2
    err = capsys.readouterr().err
    assert "no such run directory" in err and err.count("\n") == 1
    assert "\u202e" not in err and "\x1b" not in err and "\\u202eevil" in err
