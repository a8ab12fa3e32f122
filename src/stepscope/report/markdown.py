"""The markdown rendering (``summary.md``) with PNG plots beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepscope.common.escape import md, md_code
from stepscope.common.figures import PlotData
from stepscope.common.safefs import write_output
from stepscope.report.collective_view import markdown_lines as collectives_markdown
from stepscope.report.coverage_view import markdown_lines as coverage_markdown
from stepscope.report.goodput_view import markdown_lines as goodput_lines  # [export]
from stepscope.report.plots import have_matplotlib, write_pngs
from stepscope.report.resource_view import markdown_lines  # [metrics]
from stepscope.report.terminal import capture_label, window_captures


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_markdown(doc: dict[str, Any], images: list[str] | None = None) -> str:
    """Markdown text of ``doc``; ``images`` are relative PNG paths to embed."""
    run = doc["run"]
    al = run["alignment"]
    lines = [
        f"# stepscope report — {md_code(run['dir'])}",
        "",
        *([f"**{md(run['headline'])}**", ""] if run.get("headline") else []),
        f"{run['ranks']} rank(s) on {len(run['hosts'])} host(s), {run['steps']} sampled steps "
        f"({run['first_step']}–{run['last_step']}), {run['duration']:.1f} s, clock {md_code(run['clock'])}. "
        f"Median step {_f(run['step_ms']['median'])} ms (p90 {_f(run['step_ms']['p90'])} ms).",
        "",
        f"Timeline: {md(al['method'])}"
        + (f"; ranks synchronise in {md_code(al['sync_phase'])}." if al["sync_phase"] else "."),
        "",
    ]
    if run["skipped"]:
        lines += ["**Partial report.** Skipped:", ""]
        lines += [f"- {md(s)}" for s in run["skipped"]] + [""]
    lines += ["## Verdicts", ""]
    for v in doc["verdicts"]:
        lines += [f"- **{md(v['severity'])} · {md(v['kind'])}** — {md(v['evidence'])}"]
        lines += [f"  - *Consequence ({md(c['kind'])}):* {md(c['evidence'])}"
                  for c in v.get("consequences") or ()]
        lines += [f"  - *What to do:* {md(v['suggestion'])}"]
    lines += [f"- *Note:* {md(n)}" for n in run.get("notes") or []]
    lines.append("")
    if doc["stragglers"]:
        lines += ["## Stragglers", "",
                  "| rank | host | phase | excess ms | steps | first | last | kind | confidence |",
                  "|---:|---|---|---:|---:|---:|---:|---|---:|"]
        for s in doc["stragglers"]:
            lines.append(f"| {s['rank']} | {md(s.get('host') or '-')} | {md(s['phase'])} | "
                         f"{_f(s['excess_ms'])} | {s['steps']} | {s['first_step']} | "
                         f"{s['last_step']} | {md(s['persistence'])} | {_f(s['confidence'])} |")
        lines.append("")
    if doc["windows"]:
        lines += ["## Slow step windows", "", "| steps | ranks | phase | slowdown | captures |",
                  "|---|---|---|---:|---|"]
        for w in doc["windows"]:
            ranks = ", ".join(str(r) for r in w["ranks"][:16])
            caps = ", ".join(capture_label(c) for c in window_captures(doc, w)) or "-"
            lines.append(f"| {w['start_step']}–{w['end_step']} | {ranks} | {md(w['phase'])} | "
                         f"{w['slowdown']:.2f}× | {md(caps)} |")
        lines.append("")
    if doc["run"].get("captures"):
        lines += ["## Auto-profile captures", "",
                  "| trigger step | rank | role | status | trace | GPU busy | top kernels | reason |",
                  "|---:|---:|---|---|---|---:|---|---|"]
        for t in doc["run"]["captures"]:
            summ = t.get("trace_summary") or {}
            busy = f"{summ['gpu_busy_pct']:.0f}%" if "gpu_busy_pct" in summ else summ.get("platform", "-")
            tops = ", ".join(str(k) for k in summ.get("top_kernels", [])) or "-"
            lines.append(f"| {md(t['trigger_step'])} | {md(t['rank'])} | {md(t.get('role', '-'))} | "
                         f"{md(t.get('status', '-'))} | {md_code(t.get('trace') or '-')} | {md(busy)} | "
                         f"{md(tops)} | {md(t.get('reason', ''))} |")
        lines.append("")
    lines += ["## Phases", "", "| phase | median ms | p90 ms | p99 ms | max ms | share |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, p in doc["phases"].items():
        label = md(name) if p["parent"] is None else f"{md(name)} (in {md(p['parent'])})"
        share = "-" if p["share"] is None else f"{100 * p['share']:.1f}%"
        lines.append(f"| {label} | {_f(p['median_ms'])} | {_f(p['p90_ms'])} | "
                     f"{_f(p['p99_ms'])} | {_f(p['max_ms'])} | {share} |")
    lines += ["", *collectives_markdown(doc)]
    lines += coverage_markdown(doc)  # [coverage] pipeline stages, expert parallel
    lines += ["## Ranks", "", "| rank | host | step ms | p90 | own ms | wait ms |",
              "|---:|---|---:|---:|---:|---:|"]
    for r in doc["ranks"][:64]:
        lines.append(f"| {r['rank']} | {md(r['host'])} | {_f(r['step_ms']['median'])} | "
                     f"{_f(r['step_ms']['p90'])} | {_f(r['own_ms']['median'])} | "
                     f"{_f(r['wait_ms']['median'])} |")
    if len(doc["ranks"]) > 64:
        lines.append(f"\n({len(doc['ranks']) - 64} more ranks in the JSON report)")
    lines.append("")

    lines += markdown_lines(doc)

    lines += goodput_lines(doc)
    if images:
        lines += ["## Plots", ""] + [f"![{md(Path(i).stem)}]({i})" for i in images] + [""]
    elif images is not None:
        lines += ["*Plots skipped: install matplotlib (`pip install stepscope[plots]`).*", ""]
    return "\n".join(lines)


def write_markdown(doc: dict[str, Any], path: str, plots: PlotData | None = None) -> list[str]:
    """Write the markdown file (and, given ``plots``, PNGs beside it when matplotlib is
    there); paths written. A link at any of those paths is refused
    (:class:`~stepscope.common.safefs.UnsafePath`)."""

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs: list[Path] = []
    if plots is not None and have_matplotlib():
        pngs = write_pngs(plots, out.parent, out.stem)
    write_output(out, render_markdown(doc, [p.name for p in pngs]))
    return [str(out), *(str(p) for p in pngs)]
