"""The ``stepscope trace`` command: analyse Kineto traces and print, dump or write the result."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from stepscope.errors import AnalysisError


def trace_command(path: str, as_json: bool = False, markdown: str | None = None,
                  max_inflated_mb: float | None = None) -> int:
    """Analyse `path` (a trace file or a directory of per-rank traces).

    Returns 0 on success, 2 when the input cannot be analysed at all (message on stderr).
    """
    from stepscope.analysis.trace import MAX_INFLATED_BYTES, analyse

    cap = MAX_INFLATED_BYTES if max_inflated_mb is None else int(max_inflated_mb * (1 << 20))
    if cap <= 0:
        print(f"stepscope trace: --max-inflated-mb must be positive, got {max_inflated_mb}",
              file=sys.stderr)
        return 2
    try:
        doc = analyse(path, max_bytes=cap).to_dict()
    except AnalysisError as e:
        print(f"stepscope trace: {e}", file=sys.stderr)
        return 2
    if all(r["events_seen"] == 0 for r in doc["ranks"]):
        reasons = "; ".join(w for r in doc["ranks"] for w in r["warnings"])
        print(f"stepscope trace: no trace events could be read from {path}: {reasons}",
              file=sys.stderr)
        return 2
    if markdown:
        from stepscope.report.trace_markdown import render_markdown

        # The markdown renderer shows GPU step breakdowns; CPU-only ranks' steps (no GPU
        # fields) are in their `cpu` section.
        md_doc = {**doc, "ranks": [r if r.get("total") is not None else {**r, "steps": []}
                                   for r in doc["ranks"]]}
        try:
            Path(markdown).write_text(render_markdown(md_doc), encoding="utf-8")
        except OSError as e:
            print(f"stepscope trace: cannot write {markdown}: {e}", file=sys.stderr)
            return 2
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        _print_rich(doc)
    return 0


def _print_rich(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from stepscope.report.trace_markdown import short_name

    con = Console()
    for r in doc["ranks"]:
        if r.get("cpu") is not None:
            _print_cpu(con, r)
            continue
        rows = r["steps"] or ([r["total"]] if r["total"] else [])
        t = Table(title=f"rank {r['rank']} · {r['platform']} · {Path(r['file']).name}")
        for col in ("window", "wall ms", "compute", "exp. comm", "exp. memcpy", "idle",
                    "host wait", "overlap", "kernel sum ms", "launches"):
            if col == "window":
                t.add_column(col, no_wrap=True, min_width=16)
            else:
                t.add_column(col, justify="right")
        for s in rows:
            w = s["wall_us"] or 1.0
            ov = s["comm_compute_overlap_pct"]
            t.add_row(
                s["label"], f"{s['wall_us'] / 1e3:,.2f}", f"{100 * s['compute_us'] / w:.1f}%",
                f"{100 * s['exposed_comm_us'] / w:.1f}%", f"{100 * s['exposed_memory_us'] / w:.1f}%",
                f"{100 * s['idle_us'] / w:.1f}%", f"{100 * s['idle_host_wait_us'] / w:.1f}%",
                "–" if ov is None else f"{ov:.1f}%", f"{s['kernel_sum_us'] / 1e3:,.2f}",
                str(s["launches"]),
            )
        if rows:
            con.print(t)
        if r["top_kernels"]:
            k = Table(title="top kernels")
            for col in ("kernel", "category", "count", "total ms", "% of sum"):
                k.add_column(col, justify="left" if col in ("kernel", "category") else "right")
            for row in r["top_kernels"][:8]:
                k.add_row(short_name(row["name"], 60), row["category"], str(row["count"]),
                          f"{row['total_us'] / 1e3:,.2f}", f"{row['pct_of_kernel_sum']:.1f}")
            con.print(k)
    cross = doc.get("cross_rank")
    if cross and cross.get("collectives_matched"):
        con.print(f"collectives matched across ranks: {cross['collectives_matched']}, "
                  f"last to arrive: rank {cross['last_arriving_rank']}, waits (µs): "
                  f"{cross['collective_wait_us']}")
    con.print("[bold]Diagnosis[/bold]")
    for d in doc["diagnosis"]:
        con.print(f" • {d['message']}")
    for w in list(doc["warnings"]) + [w for r in doc["ranks"] for w in r["warnings"]]:
        con.print(f"[yellow]warning:[/yellow] {w}")


def _print_cpu(con: Any, r: dict[str, Any]) -> None:
    """A CPU-only trace: per-step wall, dataloader and collective time; top CPU ops."""
    from rich.markup import escape
    from rich.table import Table

    cpu = r["cpu"]
    if r["steps"]:
        t = Table(title=escape(f"rank {r['rank']} · cpu · {Path(r['file']).name}"))
        for col in ("window", "wall ms", "dataloader ms", "collective ms", "cpu ops"):
            t.add_column(col, justify="left" if col == "window" else "right")
        for s in r["steps"]:
            t.add_row(escape(s["label"]), f"{s['wall_us'] / 1e3:,.2f}", f"{s['dataloader_us'] / 1e3:,.2f}",
                      f"{s['collective_us'] / 1e3:,.2f}", str(s["cpu_ops"]))
        con.print(t)
    for key, title in (("top_ops_by_self", "top CPU ops by self time"),
                       ("top_ops_by_total", "top CPU ops by total time")):
        if cpu[key]:
            k = Table(title=title)
            for col in ("op", "count", "self ms", "total ms"):
                k.add_column(col, justify="left" if col == "op" else "right")
            for row in cpu[key][:8]:
                k.add_row(escape(row["name"][:60]), str(row["count"]), f"{row['self_us'] / 1e3:,.2f}",
                          f"{row['total_us'] / 1e3:,.2f}")
            con.print(k)
    if cpu["collectives"]:
        con.print("collectives: " + escape(", ".join(
            f"{c['name']} ×{c['count']} {c['total_us'] / 1e3:,.1f} ms" for c in cpu["collectives"][:6])))
