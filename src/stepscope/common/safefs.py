"""Files under a run directory another user may have written: opened without following links.

A run directory is not necessarily trusted: a planted symlink (or a hardlink to a file
elsewhere) must not make a reader show an outside file or a writer change one. Every read
and write of the Parquet store, its lock and state, and of report outputs goes through
here:

* :func:`inside` - a path resolves inside a directory (no link leads out);
* :func:`run_file` / :func:`read_run_file` - a run file named by the run's own data
  (``meta.json``, heartbeats, stacks, dumps, traces): inside the run, regular, bounded;
* :func:`open_regular` - a regular file opened with ``O_NOFOLLOW``, refused when it is a
  link, not a regular file, or hardlinked (``st_nlink > 1``);
* :func:`write_atomic` - written to a new temporary file in the target's own directory,
  then renamed over it (a link at the target is replaced, never followed);
* :func:`safe_dir` - a directory made or accepted only when it is a real directory, not a
  link, inside the run.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafePath(OSError):
    """A path under a run directory that is a link, leaves the run, or is not a plain file."""


def inside(root: Path, path: Path) -> bool:
    """Whether ``path`` (resolved, links followed) is ``root`` or below it."""
    try:
        base = root.resolve(strict=True)
        target = path.resolve(strict=False)
    except (OSError, RuntimeError, ValueError):  # RuntimeError: a symlink loop
        return False
    return target == base or base in target.parents


def check_regular(st: os.stat_result, path: Path) -> None:
    """Raise :class:`UnsafePath` unless ``st`` is a regular file with one link."""
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path}: not a regular file; not used")
    if st.st_nlink > 1:
        raise UnsafePath(f"{path}: has other hard links (may be a file outside the run); not used")


def open_regular(path: Path, flags: int = os.O_RDONLY, root: Path | None = None) -> int:
    """A descriptor of the regular file ``path``: not a link, not hardlinked, inside ``root``."""
    if root is not None and not inside(root, path.parent):
        raise UnsafePath(f"{path}: outside the run directory; not used")
    fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK, 0o644)
    try:
        check_regular(os.fstat(fd), path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_regular(path: Path, root: Path | None = None) -> bool:
    """Whether ``path`` itself (links not followed) is a plain file with one link in ``root``."""
    try:
        st = os.lstat(path)
        check_regular(st, path)
    except OSError:
        return False
    return root is None or inside(root, path)


def safe_dir(path: Path, root: Path) -> Path:
    """``path`` as a real directory inside ``root`` (made if missing); :class:`UnsafePath`
    when it, or a directory between it and ``root``, is a link or leaves ``root``."""
    rel = path.relative_to(root)
    cur = root
    for part in rel.parts:
        cur = cur / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(cur)
        st = os.lstat(cur)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise UnsafePath(f"{cur}: a link or not a directory; not used")
    if not inside(root, path):
        raise UnsafePath(f"{path}: outside the run directory; not used")
    return path


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``: a new file in its directory renamed over it.

    A symlink or hardlink at ``path`` is replaced, never written through; the rename stays
    in the directory ``path`` names (its parent must not be a link: callers check it with
    :func:`safe_dir` or name a directory they chose).
    """
    parent = path.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        os.fchmod(fd, mode)  # mkstemp makes 0600; outputs are read by others as before
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_output(path: str | os.PathLike[str], content: str | bytes) -> None:
    """Write a report output the user named: never through a link planted at that path."""
    p = Path(path)
    if p.is_symlink():
        raise UnsafePath(f"{p}: is a symbolic link; not overwritten (remove it or name another file)")
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{p}: not a regular file; not overwritten")
        if st.st_nlink > 1:
            raise UnsafePath(f"{p}: has other hard links; not overwritten")
    write_atomic(p, content.encode("utf-8") if isinstance(content, str) else content)


def run_file(root: Path, rel: object, max_bytes: int) -> tuple[Path | None, str]:
    """``rel`` resolved inside ``root`` if it is a regular file of at most ``max_bytes``.

    Returns ``(path, "")`` or ``(None, reason)``. Never opens the file: ``os.stat`` tells a
    FIFO from a file without blocking.
    """
    if not isinstance(rel, str) or not rel or len(rel) > 4096 or "\0" in rel:
        return None, "is not a file name"
    try:
        base = root.resolve(strict=True)
        target = (base / rel).resolve(strict=False)
    except (OSError, RuntimeError, ValueError):  # RuntimeError: a symlink loop
        return None, "cannot be resolved"
    if target != base and base not in target.parents:
        return None, "is outside the run directory; not read"
    try:
        st = os.stat(target)
    except OSError:
        return None, "is missing"
    if not stat.S_ISREG(st.st_mode):
        return None, "is not a regular file; not read"
    if st.st_size > max_bytes:
        return None, f"is larger than {max_bytes:,} bytes; not read"
    return target, ""


def read_run_file(root: Path, rel: str, max_bytes: int) -> tuple[bytes | None, str]:
    """The bytes of ``rel`` inside the run directory ``root``, or ``(None, why not)``.

    The same rules as ``report``: the path must resolve inside the run (a symlink to
    ``/etc/passwd`` or an absolute ``stacks.path`` is refused), name a regular file (a FIFO
    would block, ``/dev/zero`` never ends) and hold at most ``max_bytes``. The type and size
    are checked with ``stat`` before opening and again on the open descriptor, which is
    opened non-blocking and without following a link swapped in between.
    """
    target, why = run_file(root, rel, max_bytes)
    if target is None:
        return None, why
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(target, flags)
    except OSError as exc:
        return None, f"is unreadable ({exc.strerror or exc})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "is not a regular file; not read"
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        return None, f"is unreadable ({exc.strerror or exc})"
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        return None, f"is larger than {max_bytes:,} bytes; not read"
    return data, ""
