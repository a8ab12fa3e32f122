"""Where the tests find the repository (its root, the package source, fixtures) and the data
that lives outside it.

Everything outside the repository is named by an environment variable; unset, it is the
nearest such folder beside the checkout or beside one of the folders above it (a workspace
keeps ``shared/`` and ``.mirror/`` next to its checkouts, at whatever depth a clone lands).
Where none is found the tests that need it skip, naming the folder and the variable:

- ``STEPSCOPE_TRACES``: the real Kineto traces (``shared/traces``).
- ``STEPSCOPE_MIRRORS``: fetched third-party repositories, one bare git directory per
  repository at ``<owner>+<name>/repo`` (``.mirror``).
"""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SRC = ROOT / "src"
SUPPORT = TESTS / "support"
FIXTURES = TESTS / "fixtures"


def _outside(variable: str, *parts: str) -> Path:
    """``$variable``; else the first ``<folder>/<parts>`` that exists for the folders holding
    the checkout and each folder above them; else ``../<parts>`` (named in skip reasons)."""
    value = os.environ.get(variable)
    if value:
        return Path(value).expanduser().resolve()
    for folder in (ROOT.parent, *ROOT.parent.parents):
        candidate = folder.joinpath(*parts)
        if candidate.is_dir():
            return candidate
    return ROOT.parent.joinpath(*parts)


#: The shared real Kineto traces: ``$STEPSCOPE_TRACES``, else the nearest ``shared/traces``.
TRACES = _outside("STEPSCOPE_TRACES", "shared", "traces")
#: Fetched third-party repositories: ``$STEPSCOPE_MIRRORS``, else the nearest ``.mirror``.
MIRRORS = _outside("STEPSCOPE_MIRRORS", ".mirror")


def traces_missing() -> str:
    """The skip reason when the shared traces are absent ("" when they are here)."""
    if TRACES.is_dir():
        return ""
    return f"the shared real traces are not at {TRACES} (set STEPSCOPE_TRACES to their folder)"


def not_fetched(repo: str) -> str:
    """The skip reason for a third-party repository that is not fetched."""
    return (f"{repo} is not fetched under {MIRRORS} (set STEPSCOPE_MIRRORS to the folder "
            f"holding <owner>+<name>/repo git directories)")
