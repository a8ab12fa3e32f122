"""Where the tests find the repository (its root, the package source, fixtures) and the data
that lives outside it.

Everything outside the repository is named by an environment variable, with a default at a
fixed place beside the checkout; nothing is found by walking up the file system, so a clone
passes or skips the same way wherever it lives:

- ``STEPSCOPE_TRACES``: the real Kineto traces (default ``../shared/traces`` beside the
  repository root). Tests that need them skip, naming the folder and the variable.
- ``STEPSCOPE_MIRRORS``: fetched third-party repositories, one bare git directory per
  repository at ``<owner>+<name>/repo`` (default ``../.mirror`` beside the repository root).
  Tests that run a fetched script skip without it, naming the folder and the variable.
"""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SRC = ROOT / "src"
SUPPORT = TESTS / "support"
FIXTURES = TESTS / "fixtures"


def _from_env(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).expanduser().resolve() if value else default


#: The shared real Kineto traces: ``$STEPSCOPE_TRACES``, else ``../shared/traces``.
TRACES = _from_env("STEPSCOPE_TRACES", ROOT.parent / "shared" / "traces")
#: Fetched third-party repositories: ``$STEPSCOPE_MIRRORS``, else ``../.mirror``.
MIRRORS = _from_env("STEPSCOPE_MIRRORS", ROOT.parent / ".mirror")


def traces_missing() -> str:
    """The skip reason when the shared traces are absent ("" when they are here)."""
    if TRACES.is_dir():
        return ""
    return f"the shared real traces are not at {TRACES} (set STEPSCOPE_TRACES to their folder)"


def not_fetched(repo: str) -> str:
    """The skip reason for a third-party repository that is not fetched."""
    return (f"{repo} is not fetched under {MIRRORS} (set STEPSCOPE_MIRRORS to the folder "
            f"holding <owner>+<name>/repo git directories)")
