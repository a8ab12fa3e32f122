"""The Flight Recorder part of ``stepscope status`` (``doc["flight_recorder"]``), with rich."""

from __future__ import annotations

from typing import Any

from stepscope.common.escape import one_line
from stepscope.common.escape import rich as esc


def _where(c: dict[str, Any] | None) -> str:
    if not c:
        return "no collective in flight"
    group = c.get("pg_desc") or c.get("pg")
    return f"{c['op']} (group {group}, seq {c['seq']}, {c.get('state') or '?'})"


def render_flight(fr: dict[str, Any] | None, con: Any) -> None:
    """Per rank: the collective in flight and the last one; then torch's first unmatched collective."""
    if not fr:
        return
    con.print(f"[bold]Flight Recorder[/] ({esc(fr['source'])}; matched by {esc(fr['analyser'])})")
    for v in fr["ranks"]:
        last = v.get("last_collective")
        cur = v.get("in_collective")
        now = f"in {_where(cur)}" if cur else "no collective in flight"
        con.print(f"  rank {v['rank']}: {esc(one_line(now))}; "
                  f"last issued {esc(one_line(_where(last)))}", soft_wrap=True)
    if fr["missing_dumps"]:
        con.print(f"  no dump from rank(s) {', '.join(map(str, fr['missing_dumps']))}")
    if fr["why"]:
        con.print(f"  [bold red]{esc(one_line(fr['why']))}[/]", soft_wrap=True)
    for note in fr["notes"]:
        con.print(f"  [dim]note: {esc(one_line(note))}[/]", soft_wrap=True)
