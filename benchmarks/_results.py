"""Benchmark results as data: write one JSON record per benchmark under benchmarks/results/.

A benchmark run with ``--record DIR`` runs itself again without that flag, passes its output
through, and writes the JSON lines it printed as the record's figures, with the command, the
commit, the machine and its load (format: benchmarks/results/README.md). Also usable on any
command's output::

    python benchmarks/trace_speed.py --no-hta | python benchmarks/_results.py --name trace_speed \
        --command "python benchmarks/trace_speed.py --no-hta"
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIELDS = ("benchmark", "title", "command", "commit", "machine", "load", "recorded", "figures")


def commit() -> str | None:
    """The checkout's short commit, with ``+dirty`` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def machine() -> str:
    """A one-line description of where the figures were measured."""
    gpu = "no GPU"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            gpu = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.system()}, {gpu}"


def load() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def figures_from_lines(lines: list[str]) -> dict[str, Any]:
    """The JSON objects among ``lines``: one object as is, several keyed by position."""
    objs = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                objs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if len(objs) == 1:
        return objs[0]
    return {f"line {i + 1}": o for i, o in enumerate(objs)}


def make_record(name: str, command: str, figures: dict[str, Any], *, title: str | None = None,
                load_before: list[float] | None = None) -> dict[str, Any]:
    """A record in the format of benchmarks/results/README.md."""
    if not isinstance(figures, dict) or not figures:
        raise ValueError(f"figures must be a non-empty dict, got {figures!r}")
    return {
        "benchmark": name,
        "title": title or name,
        "command": command,
        "commit": commit(),
        "machine": machine(),
        "load": {"before": load_before, "after": load()},
        "recorded": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "figures": figures,
    }


def write_record(record: dict[str, Any], out_dir: str | os.PathLike[str] = RESULTS) -> Path:
    """Write ``record`` as ``out_dir/<benchmark>.json``, replacing an older one."""
    missing = [k for k in FIELDS if k not in record]
    if missing:
        raise ValueError(f"record lacks {missing}; expected the fields {list(FIELDS)}")
    path = Path(out_dir) / f"{record['benchmark']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def _strip_record(argv: list[str]) -> tuple[list[str], str | None]:
    out, where, it = [], None, iter(argv)
    for a in it:
        if a == "--record":
            where = next(it, None)
            if where is None:
                raise SystemExit("--record needs a directory, e.g. --record benchmarks/results")
        elif a.startswith("--record="):
            where = a.split("=", 1)[1]
        else:
            out.append(a)
    return out, where


def record_run(script: str, argv: list[str], name: str | None = None) -> int:
    """Run ``script`` with ``argv`` less ``--record DIR``, echo its output, write the record.

    The record is named after the first printed line's ``benchmark`` key (else the script's
    name), so each mode of a benchmark keeps its own file.
    """
    args, where = _strip_record(argv)
    rel = os.path.relpath(Path(script).resolve(), ROOT)
    command = shlex.join(["python", rel, *args])
    before = load()
    lines = []
    with subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
        rc = proc.wait()
    if rc != 0:
        print(f"benchmark exited {rc}: no record written", file=sys.stderr)
        return rc
    figures = figures_from_lines(lines)
    first = next(iter(figures.values()), {}) if "line 1" in figures else figures
    bench = name or (first.get("benchmark") if isinstance(first, dict) else None) or Path(script).stem
    path = write_record(make_record(str(bench), command, figures, load_before=before), where or RESULTS)
    print(f"record written: {os.path.relpath(path)}", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description="write a benchmark record from JSON lines on stdin")
    ap.add_argument("--name", required=True, help="the record's benchmark name (its file name)")
    ap.add_argument("--command", required=True, help="the command that printed the lines")
    ap.add_argument("--title", help="what was measured, in a few words")
    ap.add_argument("--out", default=str(RESULTS), help="results directory")
    args = ap.parse_args()
    figures = figures_from_lines(sys.stdin.read().splitlines())
    if not figures:
        print("no JSON lines on stdin", file=sys.stderr)
        return 2
    path = write_record(make_record(args.name, args.command, figures, title=args.title), args.out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
