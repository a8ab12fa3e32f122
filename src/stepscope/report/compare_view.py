"""``stepscope compare``: two runs side by side (terminal, JSON, markdown)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from stepscope.common.errors import AnalysisError
from stepscope.common.escape import md, md_code, term, write_json
from stepscope.common.safefs import write_output


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

    from stepscope.common.escape import rich as escape
    from stepscope.report.terminal import make_console

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


def _reading(run_a: str, run_b: str) -> Any:
    """Progress on stderr (a terminal only) while both runs' rank files are read."""
    try:
        from stepscope.report.progress import input_bytes, progress
    except ImportError:  # no stepscope.report.progress: read without a progress line
        return contextlib.nullcontext()
    total = (input_bytes(run_a, "rank*") + input_bytes(run_b, "rank*")) or None
    return progress(total, "reading rank files of both runs", unit="bytes", track_reads=True,
                    done_desc="comparing")


#: Fewest compared steps per run for ``--fail-if-slower`` to decide (no bootstrap interval
#: on fewer says anything).
MIN_GATE_STEPS = 5


def compare_command(
    run_a: str, run_b: str, as_json: bool, markdown: str | None = None, steps: str | None = None,
    fail_if_slower: float | None = None,
) -> int:
    """Run ``stepscope compare``; 0 when the runs compared, 2 when either is unusable, 1 when
    ``fail_if_slower`` is given and B (the new run) is more than that many % slower than A
    (the saved baseline): a CI gate."""
    if fail_if_slower is not None and (not isinstance(fail_if_slower, (int, float))
                                       or not fail_if_slower >= 0 or fail_if_slower == float("inf")):
        print(f"stepscope compare: --fail-if-slower must be a finite percentage >= 0; got "
              f"{fail_if_slower!r}", file=sys.stderr)
        return 2
    import duckdb

    from stepscope.analysis.comparison import compare_runs

    try:
        with _reading(run_a, run_b):
            doc = compare_runs(run_a, run_b, steps=steps)
    except ValueError as exc:  # a bad --steps
        print(f"stepscope compare: {term(exc)}", file=sys.stderr)
        return 2
    except AnalysisError as exc:
        print(f"stepscope compare: {term(exc)}", file=sys.stderr)
        return 2
    except (duckdb.Error, OSError, UnicodeError) as exc:
        print(f"stepscope compare: cannot read runs ({type(exc).__name__}: {term(exc)})", file=sys.stderr)
        return 2
    note = sys.stderr if as_json else sys.stdout
    if as_json:
        write_json(doc, sys.stdout)
        for n in doc["notes"]:
            print(f"stepscope compare: {term(n)}", file=sys.stderr)
    else:
        render_compare(doc)
    if markdown:
        try:
            write_output(markdown, to_markdown(doc))  # never through a planted link
        except OSError as exc:
            print(f"stepscope compare: cannot write {term(markdown)} ({term(exc)})", file=sys.stderr)
            return 2
        print(f"wrote {term(markdown)}", file=note)
    if fail_if_slower is not None:
        n_a, n_b = int(doc["step"].get("a_samples") or 0), int(doc["step"].get("b_samples") or 0)
        if min(n_a, n_b) < MIN_GATE_STEPS:
            # A gate that passes on two steps would pass anything: say there is too little.
            print(f"stepscope compare: too few steps to gate on (A: {n_a}, B: {n_b}; "
                  f"--fail-if-slower needs at least {MIN_GATE_STEPS} on each side)",
                  file=sys.stderr)
            return 2
        slower = float(doc.get("slower_pct") or 0.0)
        if slower > fail_if_slower:
            print(f"stepscope compare: B is {slower:.1f}% slower than A (limit "
                  f"{fail_if_slower:g}%): {doc['verdict']}", file=sys.stderr)
            return 1
        print(f"stepscope compare: B is within {fail_if_slower:g}% of A "
              f"(slower by {slower:.1f}%)", file=sys.stderr)
    return 0
