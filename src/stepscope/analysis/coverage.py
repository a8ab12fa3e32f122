"""Coverage sections: what the report adds for pipeline, expert parallel and unseen paths.

Called once by :mod:`stepscope.analysis.run` after the wait attribution (tables ``cw`` and
``steps`` exist). Each section is added only when the run uses that mechanism, and its
verdicts join the others, most severe first.
"""

from __future__ import annotations

from typing import Any

from stepscope.analysis.diagnose import _SEVERITY_ORDER
from stepscope.analysis.experts import expert_verdicts, experts_section
from stepscope.analysis.pipeline import pipeline_section


def add_coverage_sections(con: Any, doc: dict[str, Any]) -> None:
    """Add ``pipeline`` and ``experts`` (when used) to ``doc`` and their verdicts."""
    added: list[dict[str, Any]] = []
    pipe = pipeline_section(con)
    if pipe is not None:
        doc["pipeline"] = pipe
    experts = experts_section(con, doc["run"]["step_ms"]["median"] or 0.0)
    if experts is not None:
        doc["experts"] = experts
        added += expert_verdicts(experts)
    if added:
        doc["verdicts"] = sorted(doc["verdicts"] + added,
                                 key=lambda v: _SEVERITY_ORDER[v["severity"]])
