"""A self-contained HTML page: the report plus interactive plots drawn by inline JS (no CDN).

Security: the page's data (the report document and the plot data) travels as JSON in a
``<script type="application/json">`` element written by :func:`escape.json_for_script`, and
the script builds every element from it with ``textContent`` and DOM calls, never
``innerHTML``: a phase name such as ``<img src=x onerror=...>`` is shown, not run.
"""

# ruff: noqa: E501  (the inline JavaScript reads better unwrapped)

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from stepscope.common.escape import html_text, json_for_script
from stepscope.common.figures import PlotData
from stepscope.common.safefs import write_output
from stepscope.report.plots import scale_note

_JS = r"""
'use strict';
const ALL = JSON.parse(document.getElementById('stepscope-data').textContent);
const DOC = ALL.doc, D = ALL.plot;
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
  for (const c of kids) e.appendChild(typeof c === 'string' ? document.createTextNode(c) : c);
  return e;
}
function svg(tag, attrs) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]); return e;
}
const f2 = x => (x === null || x === undefined) ? '-' : Number(x).toFixed(2);
const pct = x => (x === null || x === undefined) ? '-' : (100 * x).toFixed(1) + '%';
// A table whose columns sort on click (numbers numerically, '-' last).
function table(id, heads, rows) {
  const t = el('table', {id: id, class: 'sortable'}), thead = el('thead'), tb = el('tbody');
  const hr = el('tr');
  heads.forEach((h, k) => {
    const th = el('th', {title: 'click to sort'}, h);
    th.addEventListener('click', () => sortBy(t, k, th));
    hr.appendChild(th);
  });
  thead.appendChild(hr);
  rows.forEach(r => {
    const tr = el('tr');
    r.forEach(c => {
      const v = (c !== null && typeof c === 'object') ? c : {text: String(c)};
      const td = el('td', v.cls ? {class: v.cls} : {}, v.text);
      tr.appendChild(td);
    });
    tb.appendChild(tr);
  });
  t.appendChild(thead); t.appendChild(tb);
  return t;
}
function sortKey(s) {
  const m = /^-?[0-9][0-9,]*\.?[0-9]*/.exec(s.replace(/^[^0-9-]*/, ''));
  return m ? parseFloat(m[0].replace(/,/g, '')) : null;
}
function sortBy(t, k, th) {
  const tb = t.tBodies[0], rows = Array.from(tb.rows);
  const dir = th.dataset.dir === 'asc' ? 'desc' : 'asc';
  t.querySelectorAll('th').forEach(h => { delete h.dataset.dir; h.classList.remove('asc', 'desc'); });
  th.dataset.dir = dir; th.classList.add(dir);
  const sign = dir === 'asc' ? 1 : -1;
  rows.sort((a, b) => {
    const x = a.cells[k].textContent, y = b.cells[k].textContent;
    const nx = sortKey(x), ny = sortKey(y);
    if (nx !== null && ny !== null) return sign * (nx - ny);
    if (nx !== null) return -1;
    if (ny !== null) return 1;
    return sign * x.localeCompare(y);
  });
  rows.forEach(r => tb.appendChild(r));
}
function section(parent, title, ...kids) {
  const s = el('section', {}, el('h2', {}, title), ...kids);
  parent.appendChild(s); return s;
}
// ---- heat-map (canvas), scale from Python: warm-up excluded, clipped at a percentile
function color(v, lo, hi) {
  if (v === null) return '#ddd';
  if (v > hi) return '#ffff66';
  const t = hi > lo ? Math.min(1, Math.max(0, (v - lo) / (hi - lo))) : 0;
  return `hsl(${250 - 200 * t}, 75%, ${22 + 40 * t}%)`;
}
function heat(box, grid, sc, label, width) {
  const R = D.ranks.length, S = D.steps.length, lab = 56;
  const cw = Math.max(1, (width - lab) / S), ch = Math.max(6, Math.min(22, Math.floor(200 / Math.max(R, 1))));
  const c = el('canvas', {width: Math.ceil(lab + cw * S), height: ch * R + 20});
  const ctx = c.getContext('2d');
  const slow = new Set(D.stragglers);
  ctx.font = '11px system-ui, sans-serif'; ctx.textBaseline = 'middle';
  for (let i = 0; i < R; i++) {
    ctx.fillStyle = slow.has(D.ranks[i]) ? '#c00' : '#333';
    ctx.fillText((slow.has(D.ranks[i]) ? '▶ r' : 'r') + D.ranks[i], 2, i * ch + ch / 2);
    for (let j = 0; j < S; j++) { ctx.fillStyle = color(grid[i][j], sc.lo, sc.hi); ctx.fillRect(lab + j * cw, i * ch, Math.ceil(cw), ch); }
  }
  const first = D.steps[0], span = Math.max(D.steps[S - 1] + D.bucket_width - first, 1);
  const xs = st => lab + (st - first) / span * cw * S;
  ctx.strokeStyle = '#f00'; ctx.lineWidth = 2;
  D.windows.forEach(w => w.ranks.forEach(r => {
    const i = D.ranks.indexOf(r);
    if (i >= 0) ctx.strokeRect(xs(w.start_step), i * ch + 1, Math.max(2, xs(w.end_step + 1) - xs(w.start_step)), ch - 2);
  }));
  ctx.fillStyle = '#555'; ctx.textBaseline = 'top';
  const mag = Math.pow(10, Math.floor(Math.log10(Math.max(span / 4, 1)))), tick = Math.ceil(span / 4 / mag) * mag;
  for (let st = Math.ceil(first / tick) * tick; st < first + span; st += tick) ctx.fillText(String(st), Math.min(xs(st), c.width - 30), ch * R + 4);
  const tip = document.getElementById('tip');
  c.addEventListener('mousemove', e => {
    const j = Math.floor((e.offsetX - lab) / cw), i = Math.floor(e.offsetY / ch);
    if (i >= 0 && i < R && j >= 0 && j < S) {
      const v = grid[i][j];
      tip.style.display = 'block'; tip.style.left = (e.pageX + 12) + 'px'; tip.style.top = (e.pageY + 12) + 'px';
      tip.textContent = `rank ${D.ranks[i]}, step ${D.steps[j]}: ${label} ${v === null ? '-' : v.toFixed(2) + ' ms'}`;
    } else tip.style.display = 'none';
  });
  c.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
  box.appendChild(c);
  box.appendChild(el('div', {class: 'note'}, `${label}: dark = ${sc.lo.toFixed(1)} ms, bright = ${sc.hi.toFixed(1)} ms; ${sc.note}. Red boxes: slow windows; ▶: culprit rank.`));
}
const PAL = ['#4e79a7', '#f28e2b', '#e15759', '#76b7b2', '#59a14f', '#edc948', '#b07aa1', '#ff9da7', '#9c755f'];
function bars(box, width) {
  const names = Object.keys(D.bars), R = D.ranks.length, H = 200;
  const s = svg('svg', {width: width, height: H, role: 'img'}), bw = width / Math.max(R, 1);
  let max = 0;
  for (let i = 0; i < R; i++) max = Math.max(max, names.reduce((a, n) => a + (D.bars[n][i] || 0), 0));
  for (let i = 0; i < R; i++) {
    let y = H - 14;
    names.forEach((n, k) => {
      const h = (D.bars[n][i] || 0) / (max || 1) * (H - 24);
      y -= h;
      const r = svg('rect', {x: i * bw + 1, y: y, width: Math.max(1, bw - 2), height: h, fill: PAL[k % PAL.length]});
      const t = svg('title', {}); t.textContent = `rank ${D.ranks[i]} ${n}: ${(D.bars[n][i] || 0).toFixed(2)} ms`;
      r.appendChild(t); s.appendChild(r);
    });
    if (R <= 32) { const t = svg('text', {x: i * bw + bw / 2, y: H - 2, 'text-anchor': 'middle', 'font-size': 10}); t.textContent = String(D.ranks[i]); s.appendChild(t); }
  }
  box.appendChild(s);
  const leg = el('div', {class: 'legend'});
  names.forEach((n, k) => { const sw = el('span', {class: 'sw'}, '■'); sw.style.color = PAL[k % PAL.length]; leg.appendChild(sw); leg.appendChild(document.createTextNode(' ' + n + '  ')); });
  box.appendChild(leg);
}
function series(box, width) {
  const W = width, H = 180, S = D.steps.length, sc = D.scale.step_ms;
  const s = svg('svg', {width: W, height: H, role: 'img'});
  const warm = Math.min(D.warmup_steps, S - 1);
  const max = Math.max(sc.hi * 1.15, ...D.series.median.slice(warm), 1e-9);
  const first = D.steps[0], last = D.steps[S - 1] + D.bucket_width, xs = st => (st - first) / Math.max(last - first, 1) * W;
  const y = v => H - Math.min(v, max) / max * (H - 10);
  D.windows.forEach(w => {
    const r = svg('rect', {x: xs(w.start_step), y: 0, width: Math.max(2, xs(w.end_step + 1) - xs(w.start_step)), height: H, fill: 'rgba(255,0,0,0.15)'});
    const t = svg('title', {}); t.textContent = `steps ${w.start_step}-${w.end_step}: ${w.phase}, ${w.slowdown}x, ranks ${w.ranks.join(', ')}`;
    r.appendChild(t); s.appendChild(r);
  });
  [['median', '#4e79a7'], ['max', '#e15759']].forEach(([k, c]) => {
    s.appendChild(svg('polyline', {points: D.series[k].map((v, j) => `${xs(D.steps[j])},${y(v)}`).join(' '), fill: 'none', stroke: c}));
  });
  box.appendChild(s);
  box.appendChild(el('div', {class: 'note'}, `blue: median rank, red: slowest rank; y axis 0–${max.toFixed(0)} ms (higher points drawn at the top); shaded: slow windows.`));
}
function build() {
  const root = document.getElementById('report'), run = DOC.run;
  document.title = 'stepscope report — ' + run.dir;
  root.appendChild(el('h1', {}, 'stepscope report — ' + run.dir));
  if (run.headline) root.appendChild(el('p', {class: 'sum'}, el('b', {}, run.headline)));
  root.appendChild(el('p', {class: 'sum'}, `${run.ranks} rank(s) on ${Object.keys(run.hosts).length} host(s), ${run.steps} sampled steps (${run.first_step}–${run.last_step}), ${Number(run.duration).toFixed(1)} s, clock ${run.clock}; median step ${f2(run.step_ms.median)} ms (p90 ${f2(run.step_ms.p90)} ms). Timeline: ${run.alignment.method}` + (run.alignment.sync_phase ? `; ranks synchronise in ${run.alignment.sync_phase}.` : '.')));
  if (run.skipped.length) root.appendChild(el('p', {class: 'warn'}, 'Partial report — skipped: ' + run.skipped.join('; ')));
  const ul = el('ul', {class: 'verdicts'});
  DOC.verdicts.forEach(v => ul.appendChild(el('li', {class: v.severity}, el('b', {}, `${v.severity} · ${v.kind}: `), v.evidence, ...(v.consequences || []).map(c => el('div', {class: 'why'}, `↳ ${c.kind}: ${c.evidence}`)), el('div', {class: 'fix'}, '→ ' + v.suggestion))));
  root.appendChild(ul);
  const top = el('div', {class: 'top'}), left = el('div', {class: 'heat'}), right = el('div', {class: 'side'});
  top.appendChild(left); top.appendChild(right); root.appendChild(top);
  const caps = run.captures || [];
  const capText = w => (w.captures || []).filter(i => i >= 0 && i < caps.length).map(i => `step ${caps[i].trigger_step} r${caps[i].rank} (${caps[i].status || '-'})`).join(', ') || '-';
  if (D) {
    const width = Math.max(300, left.clientWidth - 4);
    left.appendChild(el('h2', {}, 'Step time per rank and step'));
    heat(left, D.step_ms, D.scale.step_ms, 'step', width);
    if (D.phase !== 'step') { left.appendChild(el('h2', {}, `${D.phase} (own time) per rank and step`)); heat(left, D.phase_ms, D.scale.phase_ms, D.phase + ' (own)', width); }
  }
  right.appendChild(el('h2', {}, 'Slow step windows'));
  right.appendChild(DOC.windows.length ? table('windows', ['steps', 'ranks', 'phase', 'slowdown', 'captures'], DOC.windows.map(w => [`${w.start_step}–${w.end_step}`, w.ranks.slice(0, 12).join(', ') + (w.ranks.length > 12 ? ' …' : ''), w.phase, w.slowdown.toFixed(2) + '×', capText(w)])) : el('p', {}, 'No slow step window.'));
  const multiHost = Object.keys(run.hosts).length > 1;
  if (DOC.stragglers.length) {
    right.appendChild(el('h2', {}, 'Stragglers'));
    right.appendChild(table('stragglers', [...(multiHost ? ['rank', 'host'] : ['rank']), 'phase', 'excess ms', 'steps', 'from–to', 'waiting ranks'], DOC.stragglers.map(s => [...(multiHost ? [s.rank, s.host || '-'] : [s.rank]), s.phase, f2(s.excess_ms), `${s.steps} (${s.persistence})`, `${s.first_step}–${s.last_step}`, (s.victims || []).join(', ') || '-'])));
  }
  const rest = el('div', {class: 'rest'}); root.appendChild(rest);
  if (D) {
    const w = Math.max(300, rest.clientWidth - 4);
    section(rest, 'Step time over steps (slow windows shaded)').id = 'series-box';
    series(rest.lastChild, w);
    section(rest, 'Phases per rank (median ms per step)').id = 'bars-box';
    bars(rest.lastChild, w);
  }
  const slow = new Set(DOC.stragglers.map(s => s.rank));
  const tops = Object.keys(DOC.phases).filter(n => DOC.phases[n].parent === null && n !== 'h2d_hidden');
  const per = {}; tops.forEach(n => { per[n] = {}; DOC.phases[n].per_rank.forEach(p => { per[n][p.rank] = p.median_ms; }); });
  section(rest, 'Ranks (click a column to sort)', table('ranks', ['rank', 'host', 'step ms', 'p90', 'own ms', 'wait ms', ...tops], DOC.ranks.map(r => [slow.has(r.rank) ? {text: r.rank + ' *', cls: 'bad'} : r.rank, r.host, f2(r.step_ms.median), f2(r.step_ms.p90), f2(r.own_ms.median), f2(r.wait_ms.median), ...tops.map(n => f2(per[n][r.rank]))])));
  section(rest, 'Phases', table('phases', ['phase', 'median ms', 'p90 ms', 'p99 ms', 'max ms', 'share of step'], Object.entries(DOC.phases).map(([n, p]) => [p.parent === null ? n : `${n} (in ${p.parent})`, f2(p.median_ms), f2(p.p90_ms), f2(p.p99_ms), f2(p.max_ms), pct(p.share)])));
  if (caps.length) section(rest, 'Auto-profile captures', table('captures', ['step', 'rank', 'role', 'status', 'trace', 'reason'], caps.map(t => [t.trigger_step, t.rank, t.role || '-', t.status || '-', t.trace || '-', t.reason || ''])));
}
build();
"""

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 auto; padding: 8px 16px; max-width: 1800px; color: #222; }
h1 { font-size: 18px; margin: 4px 0; } h2 { font-size: 14px; margin: 8px 0 4px; }
p.sum { margin: 2px 0 6px; color: #444; } .warn { color: #a60; }
ul.verdicts { margin: 4px 0 8px; padding-left: 18px; } ul.verdicts li { margin: 2px 0; }
li.critical b { color: #c00; } li.warning b { color: #a60; } li.info b { color: #07a; }
.fix { color: #555; font-size: 13px; } .why { font-size: 13px; }
.top { display: flex; gap: 16px; align-items: flex-start; flex-wrap: wrap; }
.heat { flex: 3 1 640px; min-width: 0; } .side { flex: 2 1 360px; min-width: 0; overflow-x: auto; } .side table { font-size: 12px; }
canvas, svg { display: block; max-width: 100%; }
.note { font-size: 12px; color: #555; margin: 2px 0 6px; }
table { border-collapse: collapse; font-size: 13px; margin: 4px 0 10px; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: right; white-space: nowrap; }
td:first-child, th:first-child { text-align: left; }
th { background: #f3f3f3; cursor: pointer; user-select: none; }
th.asc::after { content: ' ▲'; } th.desc::after { content: ' ▼'; }
td.bad { color: #c00; font-weight: bold; }
.rest { overflow-x: auto; } .legend { font-size: 12px; } .sw { font-size: 14px; }
#tip { position: absolute; display: none; background: #222; color: #fff; padding: 4px 8px;
       font-size: 12px; border-radius: 3px; pointer-events: none; }
"""


def render_html(doc: dict[str, Any], pd: PlotData | None) -> str:
    """The page as one string: data as escaped JSON, built into the page by inline JS."""
    public = {k: v for k, v in doc.items() if not k.startswith("_")}
    plot: dict[str, Any] | None = None
    if pd is not None:
        plot = asdict(pd)
        plot["scale"] = {k: dict(asdict(v), note=scale_note(v)) for k, v in pd.scale.items()}
    data = json_for_script({"doc": public, "plot": plot})
    title = html_text(f"stepscope report — {doc['run']['dir']}")
    return (f"<!doctype html><html><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{title}</title>"
            f"<style>{_CSS}</style></head><body><div id='report'></div><div id='tip'></div>"
            f"<noscript>This report is drawn by JavaScript; the same numbers are in "
            f"<code>stepscope report --json</code>.</noscript>"
            f'<script type="application/json" id="stepscope-data">{data}</script>'
            f"<script>{_JS}</script></body></html>")


def write_html(doc: dict[str, Any], path: str, plots: PlotData | None = None) -> str:
    """Write the self-contained page (with its plots given ``plots``); returns its path."""

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_output(out, render_html(doc, plots))  # never through a link planted at that path
    return str(out)
