"""The collectives view: per op and process group, calls, bytes, time (and the part hidden beside
compute), wait share, bus bandwidth.

Additive sections for the terminal and markdown reports (the JSON is ``doc["collectives"]``,
built by :func:`stepscope.analysis.collwaits.collectives_section`).
"""

from __future__ import annotations

from typing import Any

from stepscope.common.escape import md, one_line
from stepscope.common.escape import rich as esc

COLUMNS = ("op", "group", "ranks", "in phases", "calls/step", "MB/step", "ms/step",
           "hidden ms/step", "wait ms/step", "wait share", "bus GB/s")


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def rows(doc: dict[str, Any], limit: int = 20) -> list[list[str]]:
    """One row of plain-text cells per op and group, the most time first (at most ``limit``).

    Op, group and phase names come from the run: one line each, control characters shown as
    text; each renderer escapes the cells for its format.
    """
    out = []
    for o in ((doc.get("collectives") or {}).get("ops") or [])[:limit]:
        mb = None if o.get("bytes_per_step") is None else o["bytes_per_step"] / 1e6
        out.append([one_line(o["op"]), one_line(f"{o['pg']} (n={o['pg_size']})"), one_line(o["ranks"]),
                    one_line(", ".join(map(str, o.get("phases") or []))), _f(o["calls_per_step"], 1), _f(mb),
                    _f(o["ms_per_step"]), _f(o.get("hidden_ms_per_step")), _f(o["wait_ms_per_step"]),
                    f"{100.0 * (o['wait_share'] or 0.0):.0f}%", _f(o.get("bus_gbps"))])
    return out


def _footer(doc: dict[str, Any]) -> str:
    col = doc.get("collectives") or {}
    src = {"collectives": "recorded collectives and DDP's grad_sync",
           "grad_sync": "DDP's grad_sync phase (no other collectives recorded)",
           "timeline": "no collective timing: arrival gaps on the aligned timeline",
           "collectives+timeline": "recorded collectives; DDP's all-reduce in backward from "
           "arrival gaps on the aligned timeline (no grad_sync phase)",
           "none": "no collectives"}.get(col.get("source", ""), col.get("source", ""))
    return f"Waits from {src}. {col.get('wait_rule', '')}."


def print_terminal(doc: dict[str, Any], console: Any) -> None:
    """Print the collectives table with rich (nothing when the run has none)."""
    body = rows(doc)
    if not body:
        return
    from rich.table import Table

    t = Table(title="Collectives (per rank and step)")
    for c in COLUMNS:
        t.add_column(c, justify="left" if c in ("op", "group", "in phases") else "right")
    for r in body:
        t.add_row(*[esc(c) for c in r])
    console.print(t)
    console.print(f"[dim]{esc(_footer(doc))}[/]")


def markdown_lines(doc: dict[str, Any]) -> list[str]:
    """The markdown section (empty when the run has no collectives)."""
    body = rows(doc)
    if not body:
        return []
    out = ["## Collectives", "", "| " + " | ".join(COLUMNS) + " |",
           "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(md(c) for c in r) + " |" for r in body]
    return [*out, "", f"*{md(_footer(doc))}*", ""]
