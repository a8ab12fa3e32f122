"""Tests of ``stepscope trace`` in-process: terminal, --json, --markdown, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import paths  # tests/support: where the repository is
import pytest

from stepscope.cli import main

TRACES = paths.TRACES


def _need_traces() -> None:
    if not TRACES.is_dir():
        pytest.skip(paths.traces_missing())


def test_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    _need_traces()
    assert main(["trace", str(TRACES / "trace_filter"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"].startswith("stepscope.trace/")
    assert doc["taxonomy_version"]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    step = doc["ranks"][0]["steps"][0]
    assert step["label"] == "ProfilerStep#551"
    assert step["busy_us"] + step["idle_us"] == pytest.approx(step["wall_us"], abs=0.01)
    assert doc["cross_rank"]["last_arriving_rank"] in (0, 1)
    assert {d["kind"] for d in doc["diagnosis"]} >= {"exposed_comm"}


def test_terminal_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _need_traces()
    md = tmp_path / "summary.md"
    assert main(["trace", str(TRACES / "nccl_parser_config"), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "ProfilerStep#4" in out and "Diagnosis" in out
    text = md.read_text()
    assert text.startswith("# stepscope trace summary")
    assert "| ProfilerStep#4 |" in text and "## Diagnosis" in text and "top kernels" in text


def test_cpu_only_trace_is_not_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    _need_traces()
    assert main(["trace", str(TRACES / "cpu_only"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ranks"][0]["total"] is None and doc["ranks"][0]["rank"] == 34


@pytest.mark.parametrize("content", [None, b"", b"garbage", b"\x1f\x8bnot really gzip"])
def test_bad_input_exits_2_without_traceback(tmp_path: Path, content: bytes | None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "t.json"
    if content is not None:
        p.write_bytes(content)
    assert main(["trace", str(p)]) == 2
    err = capsys.readouterr().err
    assert "stepscope trace:" in err and "Traceback" not in err


def test_empty_directory_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", str(tmp_path)]) == 2
    assert "no .json" in capsys.readouterr().err


_STARTUP_PROBE = """
import json, os, sys
from stepscope.cli import main
rc = main(["trace", "--json", sys.argv[1]])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "duckdb", "rich", "pyarrow")
               or m in ("stepscope.lifecycle", "stepscope.recording.config", "stepscope.recording.sinks",
                        "stepscope.recording.schema", "stepscope.recording.dist"))
print(json.dumps({"rc": rc, "heavy": heavy, "blas": os.environ.get("OPENBLAS_NUM_THREADS")}),
      file=sys.stderr)
"""


@pytest.mark.parametrize("user_setting", [None, "2"])
def test_trace_command_start_up_imports_only_what_it_reads_with(
        tmp_path: Path, user_setting: str | None) -> None:
    """`stepscope trace` pays for no recording-side module (config, lifecycle, sinks: ~0.04 s of
    CPU when `import stepscope` imported them) and for one OpenBLAS thread instead of one per
    core (numpy's import 0.13 -> 0.09 s); a user's OPENBLAS_NUM_THREADS is left as it is."""
    import os
    import subprocess
    import sys

    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 10, "dur": 5, "pid": 0, "tid": 7,
         "args": {"stream": 7, "correlation": 1}}]}))
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if user_setting is not None:
        env["OPENBLAS_NUM_THREADS"] = user_setting
    p = subprocess.run([sys.executable, "-c", _STARTUP_PROBE, str(trace)], capture_output=True,
                       text=True, timeout=120, env=env, check=False)
    got = json.loads(p.stderr.strip().splitlines()[-1])
    assert got == {"rc": 0, "heavy": [], "blas": user_setting or "1"}, p.stderr[-2000:]


_GC_PROBE = """
import gc, json, sys
from stepscope.cli import main
# Collections once the trace command's own imports (the analysis, numpy, msgspec) began;
# argparse's set-up before them is shared by every command.
late = []
gc.callbacks.append(lambda phase, info: phase == "start" and late.append(
    "stepscope.analysis" in sys.modules))
rc = main(["trace", "--json", sys.argv[1]])
gc.callbacks.clear()  # the interpreter's own collection at exit is not the command's
print(json.dumps({"rc": rc, "collections": sum(late), "enabled_after": gc.isenabled()}),
      file=sys.stderr)
"""


def test_trace_command_pauses_the_cyclic_collector_and_restores_it(tmp_path: Path) -> None:
    """The imports the command pays for (numpy, msgspec, the analysis) run without the cyclic
    collector's passes (~0.01 s of CPU that freed nearly nothing), and the collector is on
    again afterwards for whoever called ``main``."""
    import subprocess
    import sys

    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 10, "dur": 5, "pid": 0, "tid": 7,
         "args": {"stream": 7, "correlation": 1}}]}))
    p = subprocess.run([sys.executable, "-c", _GC_PROBE, str(trace)], capture_output=True,
                       text=True, timeout=120, check=False)
    got = json.loads(p.stderr.strip().splitlines()[-1])
    assert got == {"rc": 0, "collections": 0, "enabled_after": True}, p.stderr[-2000:]


_EXIT_PROBE = """
import atexit, gc, json, runpy, sys
# Registered first, so it runs last at exit: after the command's own work, before the
# interpreter's collections.
atexit.register(lambda: print(json.dumps({"frozen": gc.get_freeze_count() > 0}),
                              file=sys.stderr))
if sys.argv[1] == "command":
    sys.argv = ["stepscope", "trace", "--json", sys.argv[2]]
    runpy.run_module("stepscope", run_name="__main__", alter_sys=True)
else:
    from stepscope.cli import main
    main(["trace", "--json", sys.argv[2]])
"""


@pytest.mark.parametrize("how", ["command", "in-process"])
def test_trace_command_skips_the_collections_at_exit_only_as_the_command(
        tmp_path: Path, how: str) -> None:
    """Run as ``python -m stepscope trace``, the process freezes its objects once the output is
    written, so the interpreter's collections at exit (~0.016 s of CPU) find nothing to walk;
    a caller of ``main`` in its own process keeps its collector as it was."""
    import subprocess
    import sys

    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 10, "dur": 5, "pid": 0, "tid": 7,
         "args": {"stream": 7, "correlation": 1}}]}))
    p = subprocess.run([sys.executable, "-c", _EXIT_PROBE, how, str(trace)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert '"busy_us"' in p.stdout
    got = json.loads(p.stderr.strip().splitlines()[-1])
    assert got == {"frozen": how == "command"}, p.stderr[-2000:]


def test_glibc_tuning_is_left_to_the_command_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller of the command's ``main`` in its own process (this test) keeps its allocator's
    settings: the mallopt tuning is asked for only when the process is the command."""
    import ctypes
    import types

    from stepscope.cli import trace_cmd as trace_cli

    calls: list[tuple[int, int]] = []
    libc = types.SimpleNamespace(mallopt=lambda what, value: calls.append((what, value)))
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: libc)
    trace_cli._keep_freed_memory()
    assert calls == []
    monkeypatch.setattr(trace_cli, "_started_as_command", lambda: True)
    trace_cli._keep_freed_memory()
    assert [what for what, _ in calls] == [-3, -1]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
