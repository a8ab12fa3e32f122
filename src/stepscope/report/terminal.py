"""The rich terminal rendering of the report document."""

from __future__ import annotations

from typing import Any

from stepscope.report.collectives import print_terminal as print_collectives

_SEV_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
MAX_RANK_ROWS = 16


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _rank_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """All ranks when few; otherwise stragglers plus the slowest and most-waiting ranks."""
    ranks: list[dict[str, Any]] = doc["ranks"]
    if len(ranks) <= MAX_RANK_ROWS:
        return ranks
    keep = {s["rank"] for s in doc["stragglers"]}
    by_own = sorted(ranks, key=lambda r: -(r["own_ms"]["median"] or 0.0))
    for r in by_own:
        if len(keep) >= MAX_RANK_ROWS:
            break
        keep.add(r["rank"])
    return [r for r in ranks if r["rank"] in keep]


def _trigger_cells(tr: dict[str, Any]) -> list[str]:
    summ = tr.get("trace_summary") or {}
    if "gpu_busy_pct" in summ:
        view = f"{summ['gpu_busy_pct']:.0f}% busy; " + ", ".join(str(k) for k in summ["top_kernels"])
    else:
        view = summ.get("error") or (f"{summ['platform']} trace" if summ else "-")
    return [str(tr["trigger_step"]), str(tr["rank"]), str(tr.get("role", "-")),
            str(tr.get("status", "-")), str(tr.get("trace") or "-"), view, str(tr.get("reason", ""))]


def render_terminal(doc: dict[str, Any], console: Any = None) -> None:
    """Print ``doc`` (from :func:`stepscope.analysis.run.analyze_run`) with rich."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    con = console or Console()
    run = doc["run"]
    al = run["alignment"]
    hosts = run["hosts"]
    head = (
        f"[bold]{run['dir']}[/]  run {run['run_id'] or '-'}\n"
        f"{run['ranks']} rank(s) on {len(hosts)} host(s), {run['steps']} sampled steps "
        f"({run['first_step']}–{run['last_step']}), {run['duration']:.1f} s, clock {run['clock']}\n"
        f"step time median {_f(run['step_ms']['median'])} ms, p90 {_f(run['step_ms']['p90'])} ms\n"
        f"timeline: {al['method']}"
        + (f"; ranks synchronise in [bold]{al['sync_phase']}[/]" if al["sync_phase"] else
           "; no synchronising phase found (ranks analysed independently)")
    )
    con.print(Panel(head, title="stepscope report", expand=False))
    if run["skipped"]:
        con.print("[yellow]Partial report — skipped:[/]")
        for s in run["skipped"]:
            con.print(f"  [yellow]•[/] {s}")

    con.print("\n[bold]Verdicts[/]")
    for v in doc["verdicts"]:
        style = _SEV_STYLE.get(v["severity"], "")
        con.print(f" [{style}]{v['severity'].upper():8}[/] [bold]{v['kind']}[/]: {v['evidence']}")
        con.print(f"          [dim]→ {v['suggestion']}[/]")

    if doc["stragglers"]:
        t = Table(title="Stragglers (culprits, not the ranks that wait for them)")
        for c in ("rank", "host", "phase", "excess ms", "steps", "first", "last", "kind",
                  "confidence", "waiting ranks"):
            t.add_column(c, justify="right" if c not in ("host", "phase", "kind") else "left")
        for s in doc["stragglers"][:20]:
            victims = s.get("victims") or []
            t.add_row(str(s["rank"]), str(s.get("host") or "-"), s["phase"], _f(s["excess_ms"]),
                      str(s["steps"]), str(s["first_step"]), str(s["last_step"]),
                      s["persistence"], _f(s["confidence"]),
                      f"{len(victims)} (≈{_f(s.get('victim_wait_ms'))} ms)" if victims else "-")
        con.print(t)
    if doc["windows"]:
        t = Table(title="Slow step windows")
        for c in ("steps", "ranks", "phase", "slowdown"):
            t.add_column(c)
        for w in doc["windows"]:
            ranks = ", ".join(str(r) for r in w["ranks"][:12]) + (" …" if len(w["ranks"]) > 12 else "")
            t.add_row(f"{w['start_step']}–{w['end_step']}", ranks, w["phase"], f"{w['slowdown']:.2f}×")
        con.print(t)
    if doc["run"].get("captures"):
        t = Table(title="Auto-profile captures (stepscope trace <run>/<trace> for the full analysis)")
        for c in ("step", "rank", "role", "status", "trace", "GPU busy / top kernels", "reason"):
            t.add_column(c)
        for tr in doc["run"]["captures"]:
            t.add_row(*_trigger_cells(tr))
        con.print(t)

    t = Table(title="Phases (all ranks)")
    for c in ("phase", "median ms", "p90 ms", "p99 ms", "max ms", "share of step"):
        t.add_column(c, justify="left" if c == "phase" else "right")
    for name, p in doc["phases"].items():
        label = name if p["parent"] is None else f"  └ {name} (in {p['parent']})"
        if name == "h2d_hidden":
            label = "h2d_hidden (overlapped by PrefetchLoader)"
        t.add_row(label, _f(p["median_ms"]), _f(p["p90_ms"]), _f(p["p99_ms"]), _f(p["max_ms"]),
                  _pct(p["share"]))
    con.print(t)
    print_collectives(doc, con)

    rows = _rank_rows(doc)
    t = Table(title="Ranks" + (f" ({len(rows)} of {len(doc['ranks'])} shown)"
                               if len(rows) < len(doc["ranks"]) else ""))
    top = [n for n, p in doc["phases"].items() if p["parent"] is None and n != "h2d_hidden"]
    for c in ("rank", "step ms", "p90", "own ms", "wait ms", *top):
        t.add_column(c, justify="right")
    per_rank = {n: {pr["rank"]: pr for pr in doc["phases"][n]["per_rank"]} for n in top}
    slow = {s["rank"] for s in doc["stragglers"]}
    for r in rows:
        cells = [f"[bold red]{r['rank']}*[/]" if r["rank"] in slow else str(r["rank"]),
                 _f(r["step_ms"]["median"]), _f(r["step_ms"]["p90"]), _f(r["own_ms"]["median"]),
                 _f(r["wait_ms"]["median"])]
        cells += [_f(per_rank[n].get(r["rank"], {}).get("median_ms")) for n in top]
        t.add_row(*cells)
    con.print(t)
    if slow:
        con.print("[dim]* straggler. Medians per step; own = step − wait at the collective.[/]")
