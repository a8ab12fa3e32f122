"""The status screen: which rank is stuck, where, and for how long (``stepscope status``)."""

from __future__ import annotations

from typing import Any

from stepscope.common.escape import rich as escape
from stepscope.report.flight_view import render_flight  # [export] PyTorch Flight Recorder section

_STATE_STYLE = {
    "running": "green",
    "waiting": "yellow",
    "stalled": "bold red",
    "dead": "bold red",
    "crashed": "bold red",
    "finished": "cyan",
}


def render_status(doc: dict[str, Any], console: Any = None) -> None:
    """Print the status document with rich."""
    from rich.console import Console
    from rich.table import Table


    con = console or Console()
    run = doc["run"]
    con.print(f"[bold]{escape(run['dir'])}[/]  run {escape(str(run['id']))}, world size {run['world_size']}")
    table = Table(show_edge=False, pad_edge=False)
    for col in ("rank", "host", "pid", "state", "step", "phase", "in phase", "heartbeat"):
        table.add_column(col, justify="right" if col in ("rank", "pid", "step") else "left")
    for v in doc["ranks"]:
        style = _STATE_STYLE.get(v["state"], "")
        table.add_row(
            str(v["rank"]),
            escape(str(v.get("host") or "-")),
            str(v.get("pid") or "-"),
            f"[{style}]{escape(v['state'])}[/]" if style else escape(v["state"]),
            escape(v.get("step")),
            escape("/".join(v["phase_stack"]) or "-"),
            f"{v['in_phase_s']:.1f} s",
            f"{v['updated_s_ago']:.1f} s ago",
        )
    con.print(table)
    for v in doc["ranks"]:
        crash = v.get("crash") or {}
        if crash:
            msg = str(crash.get("message") or "")
            note = f"{v.get('reason')}: {msg if len(msg) <= 200 else msg[:200] + '…'}"
        else:
            note = str(v.get("reason") or v.get("error") or "")
        if note:
            con.print(f"  rank {v['rank']}: {escape(note)}", soft_wrap=True)
    cul = doc["culprit"]
    if cul is not None:
        where = "/".join(cul["phase_stack"]) or "no phase"
        con.print(
            f"[bold red]culprit: rank {cul['rank']}[/] ({escape(cul['state'])}) in [bold]{escape(where)}[/] "
            f"at step {cul['step']} for {cul['since_s']:.1f} s — {escape(cul['why'])}"
        )
        if cul.get("stack_top"):
            con.print(f"top frames of rank {cul['rank']}'s main thread ({escape(cul['stack_file'])}):")
            for frame in cul["stack_top"]:
                con.print(f"  {escape(frame)}", soft_wrap=True)
    con.print(escape(doc["summary"]))

    render_flight(doc.get("flight_recorder"), con)
    for note in doc["notes"]:
        con.print(f"[dim]note: {escape(note)}[/]", soft_wrap=True)
