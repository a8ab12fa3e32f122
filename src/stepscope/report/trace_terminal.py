"""The rich terminal rendering of ``stepscope trace`` (every string from the trace escaped)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepscope.common.escape import one_line
from stepscope.common.escape import rich as esc
from stepscope.report.terminal import fit_table, make_console
from stepscope.report.trace_markdown import short_name


def render_trace_terminal(doc: dict[str, Any], console: Any = None) -> None:
    """Print the document of ``stepscope trace --json`` as tables, a diagnosis and warnings."""
    con = console or make_console()
    width = con.width
    for r in doc["ranks"]:
        if r.get("cpu") is not None:
            _render_cpu_rank(con, r, width)
            continue
        rows = r["steps"] or ([r["total"]] if r["total"] else [])
        cells = []
        for s in rows:
            w = s["wall_us"] or 1.0
            ov = s["comm_compute_overlap_pct"]
            cells.append([
                one_line(s["label"]), f"{s['wall_us'] / 1e3:,.2f}", f"{100 * s['compute_us'] / w:.1f}%",
                f"{100 * s['exposed_comm_us'] / w:.1f}%", f"{100 * s['exposed_memory_us'] / w:.1f}%",
                f"{100 * s['idle_us'] / w:.1f}%", f"{100 * s['idle_host_wait_us'] / w:.1f}%",
                "–" if ov is None else f"{ov:.1f}%", f"{s['kernel_sum_us'] / 1e3:,.2f}",
                str(s["launches"]),
            ])
        cols = [(c, "left" if c == "window" else "right")
                for c in ("window", "wall ms", "compute", "exp. comm", "exp. memcpy", "idle",
                          "host wait", "overlap", "kernel sum ms", "launches")]
        title = f"rank {r['rank']} · {one_line(r['platform'])} · {one_line(Path(str(r['file'])).name)}"
        if cells:
            con.print(fit_table(esc(title), cols, [[esc(c) for c in row] for row in cells], width,
                                optional=("launches", "kernel sum ms", "host wait", "overlap"),
                                plain_rows=cells))
        if r["top_kernels"]:
            krows = [[short_name(row["name"], 60), one_line(row["category"]), str(row["count"]),
                      f"{row['total_us'] / 1e3:,.2f}", f"{row['pct_of_kernel_sum']:.1f}"]
                     for row in r["top_kernels"][:8]]
            kcols = [(c, "left" if c in ("kernel", "category") else "right")
                     for c in ("kernel", "category", "count", "total ms", "% of sum")]
            con.print(fit_table("top kernels", kcols, [[esc(c) for c in row] for row in krows],
                                width, optional=("category", "count"), plain_rows=krows))
    cross = doc.get("cross_rank")
    if cross and cross.get("collectives_matched"):
        _render_cross_rank(con, cross, width)
    con.print("[bold]Diagnosis[/bold]")
    for d in doc["diagnosis"]:
        con.print(f" • {esc(one_line(d['message']))}")
    for w in list(doc["warnings"]) + [w for r in doc["ranks"] for w in r["warnings"]]:
        con.print(f"[yellow]warning:[/yellow] {esc(one_line(w))}")


def _render_cross_rank(con: Any, cross: dict[str, Any], width: int) -> None:
    """Collectives across ranks: one row per rank, its wait and how often it arrived last."""
    waits, last = cross["collective_wait_us"], cross.get("last_arrivals") or {}
    steps = {str(r["rank"]): r.get("mean_step_us") for r in cross.get("per_rank") or []}
    cells = [[str(k), f"{float(w) / 1e3:,.2f}", str(last.get(k, 0)),
              "–" if steps.get(k) is None else f"{float(steps[k]) / 1e3:,.2f}"]
             for k, w in sorted(waits.items(), key=lambda kv: int(kv[0]))]
    cols = [(c, "right") for c in ("rank", "collective wait ms", "arrived last", "mean step ms")]
    last_rank = cross.get("last_arriving_rank")
    title = (f"{cross['collectives_matched']} collectives matched across ranks"
             + ("" if last_rank is None else f" · last to arrive: rank {last_rank}"))
    con.print(fit_table(esc(title), cols, [[esc(c) for c in row] for row in cells], width,
                        optional=("mean step ms",), plain_rows=cells))


def _render_cpu_rank(con: Any, r: dict[str, Any], width: int) -> None:
    """A CPU-only trace: per-step wall, dataloader and collective time; top CPU ops."""
    cpu = r["cpu"]
    if r["steps"]:
        cells = [[one_line(s["label"]), f"{s['wall_us'] / 1e3:,.2f}", f"{s['dataloader_us'] / 1e3:,.2f}",
                  f"{s['collective_us'] / 1e3:,.2f}", str(s["cpu_ops"])] for s in r["steps"]]
        cols = [(c, "left" if c == "window" else "right")
                for c in ("window", "wall ms", "dataloader ms", "collective ms", "cpu ops")]
        title = f"rank {r['rank']} · cpu · {one_line(Path(str(r['file'])).name)}"
        con.print(fit_table(esc(title), cols, [[esc(c) for c in row] for row in cells], width,
                            optional=("cpu ops",), plain_rows=cells))
    for key, title in (("top_ops_by_self", "top CPU ops by self time"),
                       ("top_ops_by_total", "top CPU ops by total time")):
        if cpu[key]:
            rows = [[short_name(row["name"], 60), str(row["count"]), f"{row['self_us'] / 1e3:,.2f}",
                     f"{row['total_us'] / 1e3:,.2f}"] for row in cpu[key][:8]]
            cols = [(c, "left" if c == "op" else "right") for c in ("op", "count", "self ms", "total ms")]
            con.print(fit_table(title, cols, [[esc(c) for c in row] for row in rows], width,
                                optional=("count",), plain_rows=rows))
    if cpu["collectives"]:
        parts = [f"{one_line(c['name'])} ×{c['count']} {c['total_us'] / 1e3:,.1f} ms"
                 for c in cpu["collectives"][:6]]
        con.print("collectives: " + esc(", ".join(parts)))
