"""Where the tests find the repository: its root, the package source, fixtures and traces."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SRC = ROOT / "src"
SUPPORT = TESTS / "support"
FIXTURES = TESTS / "fixtures"
#: Shared Kineto traces: a ``shared/traces`` folder beside the repository (or above it).
TRACES = next((p / "shared" / "traces" for p in ROOT.parents
               if (p / "shared" / "traces").is_dir()), ROOT.parent / "shared" / "traces")
