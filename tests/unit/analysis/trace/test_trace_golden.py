"""The trace analyser's output on every shared real trace equals the reference output.

``tests/fixtures/trace_golden.json`` was written by the previous implementation (the
per-event ijson parser, before the chunked native scan) with ``analyze_trace(dir).to_dict()``
passed through the strict JSON writer; the file paths are reduced to their names.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import paths  # tests/support: where the repository is
import pytest

from stepscope.analysis.trace import analyze_trace
from stepscope.common.escape import write_json

# The shared real traces: $STEPSCOPE_TRACES, else the nearest shared/traces (support/paths.py).
TRACES = paths.TRACES
GOLDEN = json.loads((paths.FIXTURES / "trace_golden.json").read_text())


def _doc(path: Path) -> dict[str, Any]:
    buf = io.StringIO()
    write_json(analyze_trace(path, workers=1).to_dict(), buf)
    doc: dict[str, Any] = json.loads(buf.getvalue())
    for r in doc["ranks"]:
        r["file"] = Path(r["file"]).name
    return doc


@pytest.mark.skipif(not TRACES.is_dir(), reason=paths.traces_missing())
@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_same_result_as_reference(name: str) -> None:
    assert _doc(TRACES / name) == GOLDEN[name]
