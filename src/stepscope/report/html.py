"""A self-contained HTML page: the report plus interactive plots drawn by inline JS (no CDN)."""

# ruff: noqa: E501  (the inline JavaScript reads better unwrapped)

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from stepscope.report.markdown import render_markdown
from stepscope.report.plots import plot_data

_JS = r"""
const D = JSON.parse(document.getElementById('plotdata').textContent);
const tip = document.getElementById('tip');
function color(v, lo, hi) {
  if (v === null) return '#eee';
  const t = hi > lo ? Math.min(1, Math.max(0, (v - lo) / (hi - lo))) : 0;
  return `hsl(${240 - 240 * t}, 80%, ${35 + 25 * t}%)`;
}
function heat(id, grid, label) {
  const c = document.getElementById(id), ctx = c.getContext('2d');
  const R = D.ranks.length, S = D.steps.length;
  const cw = Math.max(2, Math.floor(900 / S)), ch = Math.max(4, Math.min(18, Math.floor(400 / R)));
  c.width = cw * S; c.height = ch * R;
  const vals = grid.flat().filter(v => v !== null).sort((a, b) => a - b);
  const lo = vals[Math.floor(vals.length * 0.02)] || 0, hi = vals[Math.floor(vals.length * 0.98)] || 1;
  for (let i = 0; i < R; i++) for (let j = 0; j < S; j++) {
    ctx.fillStyle = color(grid[i][j], lo, hi); ctx.fillRect(j * cw, i * ch, cw, ch);
  }
  c.onmousemove = e => {
    const j = Math.floor(e.offsetX / cw), i = Math.floor(e.offsetY / ch);
    if (i < R && j < S) {
      tip.style.display = 'block'; tip.style.left = (e.pageX + 12) + 'px'; tip.style.top = (e.pageY + 12) + 'px';
      const v = grid[i][j];
      tip.textContent = `rank ${D.ranks[i]}, step ${D.steps[j]}: ${label} ${v === null ? '-' : v.toFixed(2) + ' ms'}`;
    }
  };
  c.onmouseleave = () => { tip.style.display = 'none'; };
}
function svg(tag, attrs) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]); return e;
}
const PAL = ['#4e79a7', '#f28e2b', '#e15759', '#76b7b2', '#59a14f', '#edc948', '#b07aa1', '#ff9da7', '#9c755f'];
function bars() {
  const s = document.getElementById('bars'), names = Object.keys(D.bars), R = D.ranks.length;
  const W = 900, H = 260, bw = W / Math.max(R, 1);
  let max = 0;
  for (let i = 0; i < R; i++) max = Math.max(max, names.reduce((a, n) => a + (D.bars[n][i] || 0), 0));
  for (let i = 0; i < R; i++) {
    let y = H;
    names.forEach((n, k) => {
      const h = (D.bars[n][i] || 0) / (max || 1) * (H - 20);
      y -= h;
      const r = svg('rect', {x: i * bw + 1, y: y, width: Math.max(1, bw - 2), height: h, fill: PAL[k % PAL.length]});
      const t = svg('title', {}); t.textContent = `rank ${D.ranks[i]} ${n}: ${(D.bars[n][i] || 0).toFixed(2)} ms`;
      r.appendChild(t); s.appendChild(r);
    });
  }
  const leg = document.getElementById('legend');
  names.forEach((n, k) => { leg.innerHTML += `<span style="color:${PAL[k % PAL.length]}">■</span> ${n} &nbsp;`; });
}
function series() {
  const s = document.getElementById('series'), W = 900, H = 220, S = D.steps.length;
  const max = Math.max(...D.series.max, 1e-9), x = j => j / Math.max(S - 1, 1) * W, y = v => H - v / max * (H - 10);
  const first = D.steps[0], last = D.steps[S - 1], xs = st => (st - first) / Math.max(last - first, 1) * W;
  D.windows.forEach(w => {
    const r = svg('rect', {x: xs(w.start_step), y: 0, width: Math.max(2, xs(w.end_step) - xs(w.start_step)), height: H, fill: 'rgba(255,0,0,0.15)'});
    const t = svg('title', {}); t.textContent = `steps ${w.start_step}-${w.end_step}: ${w.phase}, ${w.slowdown}x, ranks ${w.ranks.join(', ')}`;
    r.appendChild(t); s.appendChild(r);
  });
  [['median', '#4e79a7'], ['max', '#e15759']].forEach(([k, c]) => {
    s.appendChild(svg('polyline', {points: D.series[k].map((v, j) => `${x(j)},${y(v)}`).join(' '), fill: 'none', stroke: c}));
  });
}
heat('heat_step', D.step_ms, 'step');
heat('heat_phase', D.phase_ms, D.phase + ' (own)');
bars(); series();
"""

_CSS = """
body { font-family: system-ui, sans-serif; max-width: 960px; margin: 2em auto; color: #222; }
pre { white-space: pre-wrap; background: #f6f6f6; padding: 1em; font-size: 13px; }
canvas, svg { border: 1px solid #ddd; display: block; margin: .5em 0 1.5em; }
#tip { position: absolute; display: none; background: #222; color: #fff; padding: 4px 8px;
       font-size: 12px; border-radius: 3px; pointer-events: none; }
"""


def render_html(doc: dict[str, Any], pd: dict[str, Any] | None) -> str:
    """The page as one string: report text, embedded JSON data, inline JS plots."""
    body = f"<pre>{html.escape(render_markdown(doc))}</pre>"
    if pd is not None:
        # '</' cannot appear inside the script element that carries the data.
        data = json.dumps(pd).replace("</", "<\\/")
        body += f"""
<h2>Step time per rank and step</h2><canvas id="heat_step"></canvas>
<h2>{html.escape(pd['phase'])} (own time) per rank and step</h2><canvas id="heat_phase"></canvas>
<h2>Phases per rank (median ms)</h2><div id="legend"></div><svg id="bars" width="900" height="260"></svg>
<h2>Step time over steps (slow windows shaded)</h2><svg id="series" width="900" height="220"></svg>
<div id="tip"></div>
<script type="application/json" id="plotdata">{data}</script>
<script>{_JS}</script>"""
    title = html.escape(f"stepscope report — {doc['run']['dir']}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
            f"<style>{_CSS}</style></head><body><h1>{title}</h1>{body}</body></html>")


def write_html(doc: dict[str, Any], path: str) -> str:
    """Write the self-contained page; returns its path."""
    data = doc.get("_data")
    pd = plot_data(doc, data) if data is not None else None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(doc, pd))
    return str(out)
