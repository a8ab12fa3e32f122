"""Progress for long commands: on stderr when it is a terminal, nothing otherwise, never stdout.

Usage (any command)::

    from stepscope.report.progress import progress

    with progress(total=len(files), desc="reading status files", unit="files") as p:
        for f in files:
            ...
            p.advance()          # or p.advance(n), p.update(completed), p.stage("merging")

``total=None`` shows a spinner with elapsed time. ``unit="bytes"`` shows sizes, rate and
ETA. ``track_reads=True`` (with ``unit="bytes"``) fills the bar from the bytes this process
and its children have read from files (``/proc``), for work that reads inside a library
(DuckDB, ijson) where no loop can call ``advance``. Code deep in a library can report
without a handle: :func:`stage` and :func:`advance` act on the innermost active bar, and do
nothing when there is none. Set ``STEPSCOPE_PROGRESS=0`` to turn bars off on a terminal too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from stepscope.common.escape import rich as escape

_ACTIVE: list[Bar] = []


class Bar:
    """A handle on one progress display; every method is a no-op when it is not shown."""

    def __init__(self, prog: Any = None, task: Any = None) -> None:
        self._prog = prog
        self._task = task
        self.shown = prog is not None

    def advance(self, n: float = 1) -> None:
        if self._prog is not None:
            self._prog.advance(self._task, n)

    def update(self, completed: float | None = None, total: float | None = None) -> None:
        if self._prog is not None:
            kw: dict[str, Any] = {}
            if completed is not None:
                kw["completed"] = completed
            if total is not None:
                kw["total"] = total
            self._prog.update(self._task, **kw)

    def stage(self, desc: str) -> None:
        """Change the text in front of the bar (e.g. "reading" → "analysing")."""
        if self._prog is not None:
            self._prog.update(self._task, description=desc)


def enabled(stream: TextIO | None = None) -> bool:
    """True when a bar would be shown on ``stream`` (default: stderr)."""
    s = stream if stream is not None else sys.stderr
    if os.environ.get("STEPSCOPE_PROGRESS", "") == "0":
        return False
    try:
        return bool(s.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def input_bytes(path: str | os.PathLike[str], pattern: str = "*") -> int:
    """Total size of ``path`` (a file) or of the files matching ``pattern`` in it (a directory)."""
    p = Path(path)
    try:
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.glob(pattern) if f.is_file())
    except OSError:
        pass
    return 0


def bytes_read() -> int | None:
    """Bytes read so far by this process and its children (Linux ``rchar``); None if unknown."""
    total = 0
    try:
        with open("/proc/self/io") as fh:
            total = next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    with contextlib.suppress(Exception):  # children (ProcessPool workers): optional psutil
        import psutil

        for c in psutil.Process().children(recursive=True):
            with contextlib.suppress(Exception):
                total += int(c.io_counters().read_chars)
    return total


@contextlib.contextmanager
def progress(total: float | None, desc: str, unit: str = "files", *, stream: TextIO | None = None,
             track_reads: bool = False, done_desc: str | None = None) -> Iterator[Bar]:
    """A progress bar on ``stream`` (stderr) while the block runs; a no-op handle when off.

    ``done_desc``: the text shown once ``track_reads`` has seen ``total`` bytes (the reading
    is over, the rest of the work goes on).
    """
    out = stream if stream is not None else sys.stderr
    if not enabled(out):
        bar = Bar()
        _ACTIVE.append(bar)
        try:
            yield bar
        finally:
            _ACTIVE.remove(bar)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    cols: list[Any] = [SpinnerColumn(), TextColumn("[progress.description]{task.description}"),
                       BarColumn()]
    if unit == "bytes":
        cols += [DownloadColumn(), TransferSpeedColumn()]
    else:
        cols += [MofNCompleteColumn(), TextColumn(unit)]
    cols += [TaskProgressColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    console = Console(file=out, stderr=out is sys.stderr, highlight=False)
    prog = Progress(*cols, console=console, transient=True, refresh_per_second=8)

    task = prog.add_task(escape(desc), total=total if total else None)
    bar = Bar(prog, task)
    stop = threading.Event()
    watcher: threading.Thread | None = None
    start = bytes_read() if track_reads and total else None
    if start is not None and total:
        def watch() -> None:
            switched = False
            while not stop.wait(0.25):
                now = bytes_read()
                if now is None:
                    return
                done = min(float(total), float(now - start))
                prog.update(task, completed=done)
                if done >= total and done_desc and not switched:
                    prog.update(task, description=escape(done_desc))
                    switched = True

        watcher = threading.Thread(target=watch, name="stepscope-progress", daemon=True)
    prog.start()
    _ACTIVE.append(bar)
    if watcher is not None:
        watcher.start()
    try:
        yield bar
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(timeout=1.0)
        _ACTIVE.remove(bar)
        prog.stop()


def stage(desc: str) -> None:
    """Set the text of the innermost active bar (no-op without one)."""
    if _ACTIVE:
        _ACTIVE[-1].stage(desc)


def advance(n: float = 1) -> None:
    """Advance the innermost active bar (no-op without one)."""
    if _ACTIVE:
        _ACTIVE[-1].advance(n)
