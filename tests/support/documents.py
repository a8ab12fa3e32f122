"""The analysed document of a run as its JSON form, read with given load options."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from stepscope.analysis.load import load_run
from stepscope.common.escape import write_json


def analysed_doc(run: str | Path, **kw: Any) -> dict[str, Any]:
    """The report document of ``run`` as ``--json`` writes it, less the run's folder."""
    data = load_run(run, **kw)
    try:
        from stepscope.analysis.run import _analyze

        d = _analyze(data)
    finally:
        data.close()
    d["run"].pop("dir", None)
    buf = io.StringIO()
    write_json(d, buf)
    out: dict[str, Any] = json.loads(buf.getvalue())
    return out
