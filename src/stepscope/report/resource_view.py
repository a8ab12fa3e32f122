"""Throughput / MFU / memory / device-health parts of the terminal and markdown reports.

Additive helpers called from :mod:`stepscope.report.terminal` and
:mod:`stepscope.report.markdown`; they render ``run.throughput``, ``run.memory`` and
``run.device`` (see :mod:`stepscope.analysis.resource_use`) and print nothing for runs that
measured none of them.
"""

from __future__ import annotations

from typing import Any

from stepscope.common.escape import rich as esc

_DEVICE_COLS = (("sm_clock_mhz", "SM clock MHz"), ("power_w", "power W"), ("temp_c", "temp °C"),
                ("util_pct", "util %"))


def _num(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _mfu(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.2g}%"


def headline(doc: dict[str, Any]) -> str | None:
    """One line: job tokens/s, samples/s, TFLOP/s, MFU, peak memory; ``None`` if nothing measured."""
    run = doc["run"]
    thr = run.get("throughput") or {}
    mem = run.get("memory") or {}
    parts = []
    if thr.get("tokens_per_s") is not None:
        parts.append(f"{_num(thr['tokens_per_s'], 0)} tokens/s")
    if thr.get("samples_per_s") is not None:
        parts.append(f"{_num(thr['samples_per_s'], 1)} samples/s")
    if thr.get("tflops") is not None:
        parts.append(f"{thr['tflops']:.4g} TFLOP/s")
    if thr.get("mfu") is not None:
        parts.append(f"MFU {_mfu(thr['mfu'])}")
    if mem.get("peak_allocated_mb") is not None:
        parts.append(f"peak allocated {_num(mem['peak_allocated_mb'], 0)} MB")
    if mem.get("rss_mb") is not None:
        parts.append(f"host RSS {_num(mem['rss_mb'], 0)} MB")
    if not parts:
        return None
    return "Job (sum over ranks, median over steps): " + ", ".join(parts) + " (memory: max over ranks)"


def rank_table(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per-rank tokens/s, MFU, peak memory and device min–max; empty when nothing measured."""
    run = doc["run"]
    mem_rows = {r["rank"]: r for r in (run.get("memory") or {}).get("per_rank", [])}
    dev_rows = {r["rank"]: r for r in ((run.get("device") or {}).get("per_rank") or [])}
    cols: list[tuple[str, Any]] = []
    if any(r.get("tokens_per_s") is not None for r in mem_rows.values()):
        cols.append(("tokens/s", lambda m, d: _num(m.get("tokens_per_s"), 0)))
    if any(r.get("mfu") is not None for r in mem_rows.values()):
        cols.append(("MFU", lambda m, d: _mfu(m.get("mfu"))))
    if any(r.get("peak_allocated_mb") is not None for r in mem_rows.values()):
        cols.append(("peak alloc MB", lambda m, d: _num(m.get("peak_allocated_mb"), 0)))
    if any(r.get("rss_mb") is not None for r in mem_rows.values()):
        cols.append(("RSS MB", lambda m, d: _num(m.get("rss_mb"), 0)))
    for key, label in _DEVICE_COLS:
        if any(key in r for r in dev_rows.values()):
            cols.append((f"{label} min–max", lambda m, d, k=key: (
                f"{d[k]['min']:.0f}–{d[k]['max']:.0f}" if k in d else "-")))
    if not cols:
        return [], []
    ranks = sorted(set(mem_rows) | set(dev_rows))
    rows = [[str(r)] + [fn(mem_rows.get(r, {}), dev_rows.get(r, {})) for _, fn in cols] for r in ranks]
    return ["rank"] + [c for c, _ in cols], rows


def render_terminal(doc: dict[str, Any], con: Any) -> None:
    """Print the headline and the per-rank resource table with rich."""
    from rich.table import Table

    line = headline(doc)
    head, rows = rank_table(doc)
    if line:
        con.print(f"\n[bold]Throughput & memory[/] {esc(line)}")
    if rows:
        t = Table(title="Throughput, memory and device health per rank")
        for c in head:
            t.add_column(c, justify="right")
        for row in rows[:64]:
            t.add_row(*[esc(c) for c in row])
        con.print(t)


def markdown_lines(doc: dict[str, Any]) -> list[str]:
    """The markdown section (empty list when nothing was measured)."""
    line = headline(doc)
    head, rows = rank_table(doc)
    if not line and not rows:
        return []
    out = ["## Throughput, memory and device health", ""]
    if line:
        out += [line + ".", ""]
    if rows:
        out += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        out += ["| " + " | ".join(r) + " |" for r in rows[:64]]
        out.append("")
    return out
