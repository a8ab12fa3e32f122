"""The rich terminal rendering of the report document.

Every string taken from the run (phase names, hostnames, reasons, file names) goes through
:func:`stepscope.common.escape.rich`; every table through :func:`fit_table`, which sizes
columns to their content and drops optional columns rather than cutting a number.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from stepscope.common.escape import one_line
from stepscope.common.escape import rich as esc
from stepscope.report import goodput_view as _gp  # [export] productive vs lost GPU-hours
from stepscope.report import resource_view as _res  # [metrics] tokens/s, MFU, memory, device
from stepscope.report.collective_view import print_terminal as print_collectives
from stepscope.report.coverage_view import print_terminal as print_coverage

_SEV_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
MAX_RANK_ROWS = 16
#: Width used when stdout is not a terminal and COLUMNS is unset: wide enough for any table
#: (tables and panels take only the width their content needs).
PIPE_WIDTH = 4096


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def make_console(file: Any = None) -> Any:
    """A rich Console for reports on ``file`` (stdout): the terminal's width on a terminal,
    ``COLUMNS`` when the user set it, otherwise wide enough that nothing is cut."""
    from rich.console import Console

    out = file if file is not None else sys.stdout
    columns = os.environ.get("COLUMNS", "")
    isatty = bool(getattr(out, "isatty", lambda: False)())
    if columns.isdigit() and int(columns) > 0:
        return Console(file=out, width=int(columns), highlight=False)
    if isatty:
        return Console(file=out, highlight=False)
    return Console(file=out, width=PIPE_WIDTH, highlight=False, soft_wrap=True)


def fit_table(title: str, columns: list[tuple[str, str]], rows: list[list[str]], width: int,
              optional: tuple[str, ...] = (), plain_rows: list[list[str]] | None = None) -> Any:
    """A rich Table that fits ``width`` without cutting a cell.

    ``columns`` are (plain header, justify); ``rows`` hold (escaped) markup, ``plain_rows`` their
    visible text when it differs. Columns named in ``optional`` are dropped from the right
    until the table fits; what still does not fit wraps (``fold``) instead of ending in "…".
    """
    from rich.table import Table

    plain = plain_rows if plain_rows is not None else rows
    widths = [max([len(h)] + [len(r[i]) for r in plain]) for i, (h, _) in enumerate(columns)]
    keep = list(range(len(columns)))

    def total() -> int:
        return sum(widths[i] + 3 for i in keep) + 1

    for name in reversed(optional):
        if total() <= width:
            break
        idx = next((i for i, (h, _) in enumerate(columns) if h == name), None)
        if idx is not None and idx in keep:
            keep.remove(idx)
    dropped = len(columns) - len(keep)
    if dropped:
        title += f" ({dropped} column(s) not shown at this width; widen the terminal or see --json)"
    t = Table(title=title)
    for i in keep:
        h, justify = columns[i]
        t.add_column(esc(h), justify=justify, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        t.add_row(*[r[i] for i in keep])
    return t


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


def capture_label(tr: dict[str, Any]) -> str:
    """One capture in a windows table: trigger step, rank and status (plain text)."""
    return f"step {tr.get('trigger_step')} r{tr.get('rank')} ({one_line(tr.get('status', '-'))})"


def window_captures(doc: dict[str, Any], w: dict[str, Any]) -> list[dict[str, Any]]:
    """The capture entries (from ``run.captures``) listed by window ``w``."""
    caps = doc["run"].get("captures") or []
    return [caps[i] for i in w.get("captures") or [] if isinstance(i, int) and 0 <= i < len(caps)]


def _trigger_cells(tr: dict[str, Any]) -> list[str]:
    summ = tr.get("trace_summary") or {}
    if "gpu_busy_pct" in summ:
        view = f"{summ['gpu_busy_pct']:.0f}% busy; " + ", ".join(one_line(k) for k in summ["top_kernels"])
    else:
        view = one_line(summ.get("error") or (f"{summ['platform']} trace" if summ else "-"))
    cells = [str(tr["trigger_step"]), str(tr["rank"]), str(tr.get("role", "-")),
             str(tr.get("status", "-")), str(tr.get("trace") or "-"), view, str(tr.get("reason", ""))]
    return [one_line(c) for c in cells]


def render_terminal(doc: dict[str, Any], console: Any = None) -> None:
    """Print ``doc`` (from :func:`stepscope.analysis.run.analyze_run`) with rich."""
    from rich.panel import Panel

    con = console or make_console()
    width = con.width
    run = doc["run"]
    al = run["alignment"]
    hosts = run["hosts"]
    head = (
        f"[bold]{esc(run['dir'])}[/]  run {esc(run['run_id'] or '-')}\n"
        f"{run['ranks']} rank(s) on {len(hosts)} host(s), {run['steps']} sampled steps "
        f"({run['first_step']}–{run['last_step']}), {run['duration']:.1f} s, clock {esc(run['clock'])}\n"
        f"step time median {_f(run['step_ms']['median'])} ms, p90 {_f(run['step_ms']['p90'])} ms\n"
        f"timeline: {esc(al['method'])}"
        + (f"; ranks synchronise in [bold]{esc(al['sync_phase'])}[/]" if al["sync_phase"] else
           "; no synchronising phase found (ranks analysed independently)")
    )
    if run.get("headline"):
        # The first line: what the run lost and to what (analysis/cost.py).
        con.print(f"[bold]{esc(one_line(run['headline']))}[/]")
    con.print(Panel(head, title="stepscope report", expand=False))
    for crash in run.get("crashes") or []:  # [ops] crash evidence from the heartbeats
        con.print(f"[bold red]crash:[/] {esc(crash['text'])}")
    if run["skipped"]:
        con.print("[yellow]Partial report — skipped:[/]")
        for s in run["skipped"]:
            con.print(f"  [yellow]•[/] {esc(one_line(s))}")

    con.print("\n[bold]Verdicts[/]")
    for v in doc["verdicts"]:
        style = _SEV_STYLE.get(v["severity"], "")
        con.print(f" [{style}]{esc(v['severity'].upper()):8}[/] [bold]{esc(v['kind'])}[/]: "
                  f"{esc(one_line(v['evidence']))}")
        for c in v.get("consequences") or ():  # the same fault seen from elsewhere: its evidence
            con.print(f"          ↳ {esc(c['kind'])}: {esc(one_line(c['evidence']))}")
        con.print(f"          [dim]→ {esc(one_line(v['suggestion']))}[/]")

    for note in run.get("notes") or []:
        con.print(f" [dim]note:[/] {esc(one_line(note))}")

    if doc["stragglers"]:
        cols = [("rank", "right"), ("host", "left"), ("phase", "left"), ("excess ms", "right"),
                ("steps", "right"), ("first", "right"), ("last", "right"), ("kind", "left"),
                ("confidence", "right"), ("waiting ranks", "right")]
        rows = []
        for s in doc["stragglers"][:20]:
            victims = s.get("victims") or []
            rows.append([str(s["rank"]), one_line(s.get("host") or "-"), one_line(s["phase"]),
                         _f(s["excess_ms"]), str(s["steps"]), str(s["first_step"]),
                         str(s["last_step"]), one_line(s["persistence"]), _f(s["confidence"]),
                         f"{len(victims)} (≈{_f(s.get('victim_wait_ms'))} ms)" if victims else "-"])
        con.print(fit_table("Stragglers (culprits, not the ranks that wait for them)", cols,
                            [[esc(c) for c in r] for r in rows], width,
                            optional=("host", "first", "last", "confidence", "waiting ranks"),
                            plain_rows=rows))
    if doc["windows"]:
        rows = []
        for w in doc["windows"]:
            ranks = ", ".join(str(r) for r in w["ranks"][:12]) + (" …" if len(w["ranks"]) > 12 else "")
            caps = ", ".join(capture_label(c) for c in window_captures(doc, w)) or "-"
            rows.append([f"{w['start_step']}–{w['end_step']}", ranks, one_line(w["phase"]),
                         f"{w['slowdown']:.2f}×", caps])
        con.print(fit_table("Slow step windows", [("steps", "left"), ("ranks", "left"),
                                                  ("phase", "left"), ("slowdown", "right"),
                                                  ("captures", "left")],
                            [[esc(c) for c in r] for r in rows], width, plain_rows=rows))
    if doc["run"].get("captures"):
        rows = [_trigger_cells(tr) for tr in doc["run"]["captures"]]
        cols = [(c, "left") for c in ("step", "rank", "role", "status", "trace",
                                       "GPU busy / top kernels", "reason")]
        con.print(fit_table("Auto-profile captures (stepscope trace <run>/<trace> for the full analysis)",
                            cols, [[esc(c) for c in r] for r in rows], width,
                            optional=("role", "reason"), plain_rows=rows))

    rows = []
    for name, p in doc["phases"].items():
        label = (one_line(name) if p["parent"] is None
                 else f"  └ {one_line(name)} (in {one_line(p['parent'])})")
        if name == "h2d_hidden":
            label = "h2d_hidden (overlapped by PrefetchLoader)"
        rows.append([label, _f(p["median_ms"]), _f(p["p90_ms"]), _f(p["p99_ms"]), _f(p["max_ms"]),
                     _pct(p["share"])])
    cols = [(c, "left" if c == "phase" else "right")
            for c in ("phase", "median ms", "p90 ms", "p99 ms", "max ms", "share of step")]
    con.print(fit_table("Phases (all ranks)", cols, [[esc(c) for c in r] for r in rows], width,
                        optional=("p99 ms", "max ms"), plain_rows=rows))
    print_collectives(doc, con)
    print_coverage(doc, con)  # [coverage] pipeline stages, expert parallel

    shown = _rank_rows(doc)
    title = "Ranks" + (f" ({len(shown)} of {len(doc['ranks'])} shown)"
                       if len(shown) < len(doc["ranks"]) else "")
    top = [n for n, p in doc["phases"].items() if p["parent"] is None and n != "h2d_hidden"]
    per_rank = {n: {pr["rank"]: pr for pr in doc["phases"][n]["per_rank"]} for n in top}
    slow = {s["rank"] for s in doc["stragglers"]}
    plain, marked = [], []
    for r in shown:
        cells = [f"{r['rank']}*" if r["rank"] in slow else str(r["rank"]),
                 _f(r["step_ms"]["median"]), _f(r["step_ms"]["p90"]), _f(r["own_ms"]["median"]),
                 _f(r["wait_ms"]["median"])]
        cells += [_f(per_rank[n].get(r["rank"], {}).get("median_ms")) for n in top]
        plain.append(cells)
        first = f"[bold red]{cells[0]}[/]" if r["rank"] in slow else cells[0]
        marked.append([first, *cells[1:]])
    heads = ["rank", "step ms", "p90", "own ms", "wait ms", *[one_line(n) for n in top]]
    # Per-phase columns go first (least important, and the Phases table has them), then p90.
    con.print(fit_table(title, [(h, "right") for h in heads],
                        [[c if i == 0 else esc(c) for i, c in enumerate(row)] for row in marked],
                        width, optional=("p90", *heads[5:]), plain_rows=plain))
    if slow:
        con.print("[dim]* straggler. Medians per step; own = step − wait at the collective.[/]")

    _res.render_terminal(doc, con)

    _gp.render_terminal(doc, con)
