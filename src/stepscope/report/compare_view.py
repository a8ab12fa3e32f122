"""Two runs side by side (``stepscope compare``): terminal and markdown renderings."""

from __future__ import annotations

from typing import Any

from stepscope.common.escape import md, md_code
from stepscope.common.escape import rich as escape
from stepscope.report.terminal import make_console


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _ci(row: dict[str, Any]) -> str:
    lo, hi = row.get("ci_low_pct"), row.get("ci_high_pct")
    return "-" if lo is None or hi is None else f"{lo:+.1f}…{hi:+.1f}%"


def _share(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def _rows(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("step", doc["step"]), *((p["name"], p) for p in doc["phases"])]


def render_compare(doc: dict[str, Any], console: Any = None) -> None:
    """Print the comparison document with rich."""
    from rich.table import Table


    con = console or make_console()
    a, b = doc["a"], doc["b"]
    for tag, run in (("A", a), ("B", b)):
        con.print(
            f"[bold]{tag}[/] {escape(run['dir'])}  run {escape(str(run['id']))}, "
            f"{run['world_size']} rank(s), "
            f"{run['steps']} steps ({run['first_step']}–{run['last_step']}), clock {escape(run['clock'])}"
        )
    table = Table(show_edge=False, pad_edge=False)
    # p90 columns where they fit; piped output is as wide as its content, so it keeps them.
    wide = con.width >= 110
    table.add_column("median ms", no_wrap=True)
    cols = ("A", "B", "change", "95% CI", "share A→B", *(("A p90", "B p90") if wide else ()), "")
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    for name, row in _rows(doc):
        style = ("bold green" if (row["change_pct"] or 0) < 0 else "bold red") if row["significant"] else ""
        change = _pct(row["change_pct"])
        share = ""
        if row.get("a_share") is not None:
            share = f"{_share(row.get('a_share'))}→{_share(row.get('b_share'))}"
        p90 = (_ms(row.get("a_p90_ms")), _ms(row.get("b_p90_ms"))) if wide else ()
        table.add_row(
            escape(name),
            _ms(row["a_ms"]), _ms(row["b_ms"]),
            f"[{style}]{change}[/]" if style else change,
            _ci(row), share, *p90,
            "*" if row["significant"] else "",
        )
    con.print(table)
    if doc.get("per_rank"):
        rt = Table(show_edge=False, pad_edge=False, title="step time per rank")
        for col in ("rank", "A median ms", "B median ms", "change", "95% CI"):
            rt.add_column(col, justify="right")
        for r in doc["per_rank"]:
            rt.add_row(str(r["rank"]), _ms(r["a_ms"]), _ms(r["b_ms"]), _pct(r["change_pct"]), _ci(r))
        con.print(rt)
    if doc.get("windows"):
        wt = Table(show_edge=False, pad_edge=False, title="windows where the runs differ")
        for col in ("steps", "B vs A", "ms per step", "phase", "phase A→B ms"):
            wt.add_column(col, justify="right")
        for w in doc["windows"]:
            wt.add_row(f"{w['start_step']}–{w['end_step']}", w["direction"], _ms(w["delta_ms"]),
                       escape(w["phase"] or "-"),
                       f"{_ms(w['phase_a_ms'])}→{_ms(w['phase_b_ms'])}" if w["phase"] else "-")
        con.print(wt)
    con.print(f"[bold]{escape(doc['verdict'])}[/]")
    for note in doc["notes"]:
        con.print(f"[dim]note: {escape(note)}[/]")
    method = doc["method"]
    con.print(f"[dim]* significant: {escape(method['significant'])}; {escape(method['interval'])}[/]")


def _md_escape(text: Any) -> str:
    return md(text)


def to_markdown(doc: dict[str, Any]) -> str:
    a, b = doc["a"], doc["b"]
    lines = [
        "# stepscope compare",
        "",
        f"- **A**: {md_code(a['dir'])} (run {md_code(a['id'])}, {a['world_size']} ranks, "
        f"{a['steps']} steps)",
        f"- **B**: {md_code(b['dir'])} (run {md_code(b['id'])}, {b['world_size']} ranks, "
        f"{b['steps']} steps)",
        "",
        f"**{_md_escape(doc['verdict'])}**",
        "",
        "| | A median ms | A p90 | B median ms | B p90 | change | 95% CI | significant |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, row in _rows(doc):
        lines.append(
            f"| {_md_escape(name)} | {_ms(row['a_ms'])} | {_ms(row.get('a_p90_ms'))} | {_ms(row['b_ms'])} "
            f"| {_ms(row.get('b_p90_ms'))} | {_pct(row['change_pct'])} | {_ci(row)} "
            f"| {'yes' if row['significant'] else ''} |"
        )
    if doc.get("windows"):
        lines += ["", "| steps where the runs differ | B vs A | ms per step | phase | phase A→B ms |",
                  "|---|---|---:|---|---:|"]
        lines += [
            f"| {w['start_step']}–{w['end_step']} | {w['direction']} | {_ms(w['delta_ms'])} | "
            f"{_md_escape(w['phase'] or '-')} | {_ms(w['phase_a_ms'])}→{_ms(w['phase_b_ms'])} |"
            for w in doc["windows"]
        ]
    if doc.get("per_rank"):
        lines += ["", "| rank | A median ms | B median ms | change |", "|---:|---:|---:|---:|"]
        lines += [
            f"| {r['rank']} | {_ms(r['a_ms'])} | {_ms(r['b_ms'])} | {_pct(r['change_pct'])} |"
            for r in doc["per_rank"]
        ]
    lines += ["", *(f"- {_md_escape(n)}" for n in doc["notes"])]
    lines += [
        f"- significant: {md(doc['method']['significant'])}; {md(doc['method']['interval'])}",
        f"- samples: {md(doc['method']['step_sample'])}; phases: {md(doc['method']['phase_sample'])}",
    ]
    return "\n".join(lines) + "\n"
