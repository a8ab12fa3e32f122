"""The JSON rendering of the report document (``stepscope report --json``)."""

from __future__ import annotations

from typing import Any, TextIO

from stepscope.common.escape import write_json


def public(doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON contract: ``doc`` without private (underscore) keys."""
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def write_report_json(doc: dict[str, Any], out: TextIO) -> None:
    """The public document as one JSON object; non-finite numbers (NaN/inf from bad
    records) become null, so it is always valid JSON."""
    write_json(public(doc), out)
