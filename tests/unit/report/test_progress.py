"""Progress: drawn on stderr when it is a terminal (a pty here), absent when piped, never on stdout."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import paths  # tests/support: where the repository is
import pytest
from synth_runs import SynthRun, write_run

SRC = str(paths.SRC)
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")

LOOP = """
import time
from stepscope.report.progress import progress, stage
with progress(40, "crunching files", unit="files") as p:
    for i in range(40):
        time.sleep(0.02)
        p.advance()
        if i == 20:
            stage("second half")
print("RESULT-ON-STDOUT")
"""


def _run(args: list[str], stderr_tty: bool, env_extra: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run with stdout on a pipe and stderr on a pty (or a pipe); returns rc, stdout, stderr."""
    env = {k: v for k, v in os.environ.items() if k != "STEPSCOPE_PROGRESS"}
    env.update(PYTHONPATH=SRC, TERM="xterm-256color", COLUMNS="120", **(env_extra or {}))
    if not stderr_tty:
        res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        return res.returncode, res.stdout, res.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    err = b""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.1)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the pty
                break
            if not chunk:
                break
            err += chunk
        elif proc.poll() is not None:
            break
    assert proc.stdout is not None
    with proc.stdout:
        out = proc.stdout.read().decode()
    rc = proc.wait(timeout=60)
    os.close(master)
    return rc, out, err.decode(errors="replace")


def test_bar_on_a_terminal_only_and_never_on_stdout() -> None:
    rc, out, err = _run([sys.executable, "-c", LOOP], stderr_tty=True)
    assert rc == 0 and out == "RESULT-ON-STDOUT\n"  # stdout: only the program's own output
    assert "crunching files" in err and "/40" in err and "ETA" in err
    assert "second half" in err
    rc, out, err = _run([sys.executable, "-c", LOOP], stderr_tty=False)
    assert rc == 0 and out == "RESULT-ON-STDOUT\n" and err == ""
    # ... and off on a terminal when the user says so
    rc, out, err = _run([sys.executable, "-c", LOOP], stderr_tty=True, env_extra={"STEPSCOPE_PROGRESS": "0"})
    assert rc == 0 and "crunching" not in err


def test_report_json_stays_clean_with_a_terminal_stderr(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", SynthRun(ranks=4, steps=400))
    args = [sys.executable, "-m", "stepscope", "report", str(run), "--json"]
    rc, out, err = _run(args, stderr_tty=True)
    assert rc == 0
    doc = json.loads(out)  # stdout is the JSON document and nothing else
    assert doc["run"]["ranks"] == 4
    assert "reading rank files" in err or "analysing" in err
    rc, out, err = _run(args, stderr_tty=False)
    assert rc == 0 and json.loads(out)["run"]["ranks"] == 4
    assert "reading rank files" not in err and "\x1b[" not in err


def test_helper_is_a_noop_handle_when_off() -> None:
    import io

    from stepscope.report.progress import advance, progress, stage

    buf = io.StringIO()  # not a terminal
    with progress(10, "x", stream=buf) as bar:
        bar.advance(3)
        bar.update(completed=5)
        stage("y")
        advance()
    assert not bar.shown and buf.getvalue() == ""
