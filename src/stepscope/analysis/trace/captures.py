"""Where the traces of one capture are: a trace file, a folder of per-rank traces, or the
capture folders below a folder (``RUN/traces``, ``RUN/traces/auto/step000120``, ...)."""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

from stepscope.common.errors import AnalysisError

#: How much of a file's (inflated) head is searched for ``"traceEvents"``; Kineto writes a
#: few KB of device properties before it.
SNIFF_BYTES = 1 << 16
_LISTED = 5  # other capture folders named in the note


def _candidates(folder: Path) -> list[Path]:
    """The regular ``*.json`` / ``*.json.gz`` files directly in ``folder``, by name."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    return [f for f in entries if (f.name.endswith(".json") or f.name.endswith(".json.gz"))
            and not f.is_symlink() and f.is_file()]


def is_trace(path: Path) -> bool:
    """Whether ``path`` looks like a Chrome/Kineto trace: named ``*.pt.trace.json[.gz]``, or
    ``"traceEvents"`` in its first bytes."""
    if path.name.endswith((".pt.trace.json", ".pt.trace.json.gz")):
        return True
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                head = f.read(SNIFF_BYTES)
        else:
            with path.open("rb") as f:
                head = f.read(SNIFF_BYTES)
    except (OSError, EOFError, zlib.error):
        return False
    return b'"traceEvents"' in head


def _capture_folders(top: Path) -> list[tuple[Path, list[Path]]]:
    """Every folder below ``top`` (not ``top`` itself) holding traces, with its traces.
    Links to folders are not followed."""
    out = []
    for root, dirs, _files in os.walk(top):
        dirs.sort()
        if Path(root) == top:
            continue
        traces = [f for f in _candidates(Path(root)) if is_trace(f)]
        if traces:
            out.append((Path(root), traces))
    return out


def _newest(files: list[Path]) -> float:
    try:
        return max(f.stat().st_mtime for f in files)
    except OSError:
        return 0.0


def find_traces(path: str | os.PathLike[str]) -> tuple[list[Path], list[str]]:
    """The trace files of one capture at ``path``, and notes on what else was found.

    A file is itself. A folder holding ``.json``/``.json.gz`` traces gives those (every
    ``.json``/``.json.gz`` file in it, as before). A folder without any (a run directory,
    ``RUN/traces`` holding only ``auto/``) gives the capture folder below it with the newest
    trace; the notes name the other capture folders, which can be passed to analyze them.
    Traces of different folders are never mixed: they are different windows.
    """
    p = Path(path)
    if p.is_file():
        return [p], []
    if not p.is_dir():
        raise AnalysisError(f"no such trace file or directory: {p}")
    here = _candidates(p)
    below = _capture_folders(p)
    if here and (any(is_trace(f) for f in here) or not below):
        notes = []
        if below:
            notes.append(f"{len(below)} more capture folder(s) below {p}: "
                         + ", ".join(str(d.relative_to(p)) for d, _ in below[:_LISTED])
                         + (", ..." if len(below) > _LISTED else "")
                         + "; pass one to analyze it")
        return here, notes
    if not below:
        raise AnalysisError(f"no .json or .json.gz trace files in directory {p} "
                            "or its sub-folders")
    chosen, files = max(below, key=lambda b: (_newest(b[1]), str(b[0])))
    notes = [f"traces from {chosen.relative_to(p)}"]
    others = [d for d, _ in below if d != chosen]
    if others:
        notes[0] += (f", the newest of {len(below)} capture folders under {p}; the others: "
                     + ", ".join(str(d.relative_to(p)) for d in others[:_LISTED])
                     + (", ..." if len(others) > _LISTED else "")
                     + " (pass one to analyze it)")
    return files, notes
