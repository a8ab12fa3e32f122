"""Markdown rendering (summary.md) of a trace analysis report."""

from __future__ import annotations

from typing import Any

from stepscope.common.escape import md, md_code, one_line
from stepscope.common.safefs import write_output


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _ms(us: float | None) -> str:
    return "–" if us is None else f"{us / 1000.0:,.2f}"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "–"


def short_name(name: str, width: int = 70) -> str:
    """A kernel name without its argument list, cut to `width` characters."""
    n = one_line(name).replace("(anonymous namespace)::", "").split("(", 1)[0].removeprefix("void ")
    return n if len(n) <= width else n[: width - 1] + "…"


def render_markdown(doc: dict[str, Any]) -> str:
    """summary.md from the JSON document of ``stepscope trace --json``."""
    out = ["# stepscope trace summary", ""]
    out.append("## Diagnosis")
    out.append("")
    for d in doc["diagnosis"] or [{"message": "Nothing to diagnose (no GPU activity)."}]:
        out.append(f"- {md(d['message'])}")
    out.append("")
    for r in doc["ranks"]:
        fname = md_code(str(r["file"]).rsplit("/", 1)[-1])
        out.append(f"## Rank {md(r['rank'])} ({md(r['platform'])}, {fname})")
        out.append("")
        rows = r["steps"] or ([r["total"]] if r["total"] else [])
        if not rows:
            out.append("No GPU events in this trace.")
            out.append("")
        else:
            out.append("| window | wall ms | compute | exposed comm | exposed memcpy | idle "
                       "(host / kernel wait) | comm overlap | kernel sum ms | launches |")
            out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for s in rows:
                w = s["wall_us"]
                ov = s["comm_compute_overlap_pct"]
                out.append(
                    f"| {md(s['label'])} | {_ms(w)} | {_pct(s['compute_us'], w)} | "
                    f"{_pct(s['exposed_comm_us'], w)} | {_pct(s['exposed_memory_us'], w)} | "
                    f"{_pct(s['idle_us'], w)} ({_pct(s['idle_host_wait_us'], w)} / "
                    f"{_pct(s['idle_kernel_wait_us'], w)}) | "
                    f"{'–' if ov is None else f'{ov:.1f}%'} | "
                    f"{_ms(s['kernel_sum_us'])} | {s['launches']} |"
                )
            out.append("")
        if r["top_kernels"]:
            out.append("| top kernels | category | count | total ms | mean µs | % of kernel sum |")
            out.append("|---|---|---:|---:|---:|---:|")
            for k in r["top_kernels"][:10]:
                out.append(f"| {md_code(short_name(k['name']))} | {md(k['category'])} | {k['count']} | "
                           f"{_ms(k['total_us'])} | {_f(k['mean_us'])} | {_f(k['pct_of_kernel_sum'])} |")
            out.append("")
        if r["copies"]:
            out.append("| copies | count | MB | time ms | GB/s |")
            out.append("|---|---:|---:|---:|---:|")
            for kind, c in sorted(r["copies"].items()):
                out.append(f"| {md(kind)} | {int(c['count'])} | {c['bytes'] / 1e6:,.2f} | "
                           f"{_ms(c['time_us'])} | {_f(c['gbps'], 2)} |")
            out.append("")
        if r["unclassified_pct"] is not None:
            out.append(f"Unclassified kernel time: {r['unclassified_pct']:.1f}% "
                       f"(taxonomy v{doc['taxonomy_version']}).")
            out.append("")
    cross = doc.get("cross_rank")
    if cross:
        out.append("## Across ranks")
        out.append("")
        out.append("| rank | mean step ms | busy ms | compute ms | exposed comm ms | idle ms | "
                   "collective wait ms |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|")
        for row in cross["per_rank"]:
            wait = cross["collective_wait_us"].get(str(row["rank"]))
            out.append(f"| {row['rank']} | {_ms(row['mean_step_us'])} | {_ms(row['busy_us'])} | "
                       f"{_ms(row['compute_us'])} | {_ms(row['exposed_comm_us'])} | "
                       f"{_ms(row['idle_us'])} | {_ms(wait)} |")
        out.append("")
        out.append(f"Collectives matched: {cross['collectives_matched']}; transfer "
                   f"{_ms(cross['collective_transfer_us'])} ms; last to arrive: rank "
                   f"{_f(cross['last_arriving_rank'])}.")
        out.append("")
    warnings = list(doc["warnings"]) + [w for r in doc["ranks"] for w in r["warnings"]]
    if warnings:
        out.append("## Warnings")
        out.append("")
        out.extend(f"- {md(w)}" for w in warnings)
        out.append("")
    return "\n".join(out)


def write_markdown(doc: dict[str, Any], path: str) -> None:
    """Write ``summary.md`` of the trace document to ``path``, never through a planted link.

    The summary shows GPU step breakdowns; CPU-only ranks' steps (no GPU fields) are in
    their ``cpu`` section.
    """

    md_doc = {**doc, "ranks": [r if r.get("total") is not None else {**r, "steps": []}
                               for r in doc["ranks"]]}
    write_output(path, render_markdown(md_doc))
