"""Pipeline and expert-parallel views: per stage bubble, per rank all-to-all traffic.

Additive sections for the terminal and markdown reports; the JSON is ``doc["pipeline"]`` and
``doc["experts"]`` (built by :mod:`stepscope.analysis.pipeline` and
:mod:`stepscope.analysis.experts`). Nothing is printed for a run without them.
"""

from __future__ import annotations

from typing import Any

from stepscope.common.escape import rich as escape

PIPE_COLUMNS = ("stage", "rank", "bubble ms/step", "bubble share", "p2p ms/step",
                "others waited on it ms/step")
EXPERT_COLUMNS = ("group", "rank", "calls/step", "sent MB/step", "recv MB/step",
                  "max recv per call MB", "wait ms/step")


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.0f}%"


def pipeline_rows(doc: dict[str, Any]) -> list[list[str]]:
    pipe = doc.get("pipeline") or {}
    out = []
    for s in pipe.get("stages") or []:
        mark = "*" if s["stage"] == pipe.get("bottleneck_stage") else ""
        out.append([f"{s['stage']}{mark}", str(s["rank"]), _f(s["bubble_ms"]),
                    _pct(s["bubble_share"]), _f(s["p2p_ms"]), _f(s["waited_on_ms"])])
    return out


def expert_rows(doc: dict[str, Any]) -> list[list[str]]:
    out = []
    for g in (doc.get("experts") or {}).get("groups") or []:
        for r in g["ranks"]:
            mark = "*" if r["rank"] == g["max_recv_rank"] and (g["imbalance"] or 0) >= 1.5 else ""
            out.append([str(g["pg"]), f"{r['rank']}{mark}", _f(r["calls_per_step"], 1),
                        _f(r["sent_bytes_per_step"] / 1e6, 3), _f(r["recv_bytes_per_step"] / 1e6, 3),
                        _f(r["max_call_recv_bytes"] / 1e6, 3), _f(r["wait_ms_per_step"])])
    return out


def _pipe_footer(doc: dict[str, Any]) -> str:
    pipe = doc["pipeline"]
    b = pipe.get("bottleneck_stage")
    head = ("no stage made the others wait" if b is None
            else f"* bottleneck: stage {b} (rank {pipe['bottleneck_rank']})")
    return f"{head}. {pipe['rule']}."


def print_terminal(doc: dict[str, Any], console: Any) -> None:
    """Print the pipeline and experts tables with rich (only the ones the run has)."""
    from rich.table import Table


    for title, cols, body, footer in (
        ("Pipeline stages (bubble = waiting on neighbours)", PIPE_COLUMNS, pipeline_rows(doc),
         _pipe_footer(doc) if doc.get("pipeline") else ""),
        ("Expert parallel: all-to-all per rank", EXPERT_COLUMNS, expert_rows(doc),
         (doc.get("experts") or {}).get("rule", "")),
    ):
        if not body:
            continue
        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="left" if c == "group" else "right")
        for r in body:
            t.add_row(*(escape(c) for c in r))
        console.print(t)
        console.print(f"[dim]{escape(footer)}[/]")


def markdown_lines(doc: dict[str, Any]) -> list[str]:
    """The markdown sections (empty when the run has neither)."""
    out: list[str] = []
    for title, cols, body, footer in (
        ("Pipeline stages", PIPE_COLUMNS, pipeline_rows(doc),
         _pipe_footer(doc) if doc.get("pipeline") else ""),
        ("Expert parallel", EXPERT_COLUMNS, expert_rows(doc),
         (doc.get("experts") or {}).get("rule", "")),
    ):
        if not body:
            continue
        out += [f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
        out += ["", f"*{footer}*", ""]
    return out
