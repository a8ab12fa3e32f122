"""The heat maps' data: per-rank step and phase times bucketed by step (ranks subsampled),
the step series, the phase bars and colour scales robust to warm-up and outliers."""

from __future__ import annotations

from typing import Any

from stepscope.analysis.load import RunData
from stepscope.common.figures import ColorScale, Grid, PlotData

#: Most ranks (rows) and step buckets (columns) a heat map shows.
MAX_RANKS = 128
MAX_STEPS = 300
#: Colour scales clip at this percentile of the cells (warm-up excluded) so one outlier
#: step cannot wash out a slow window.
CLIP_PCT = 99.0


def focus_phase(doc: dict[str, Any]) -> str:
    """The phase worth a heat-map: the top straggler's, else the biggest top-level share."""
    if doc["stragglers"]:
        return str(doc["stragglers"][0]["phase"])
    shares = {n: p["share"] or 0.0 for n, p in doc["phases"].items() if p["parent"] is None}
    return max(shares, key=lambda n: shares[n]) if shares else "step"


def _shown_ranks(doc: dict[str, Any], limit: int) -> list[int]:
    ranks = [r["rank"] for r in doc["ranks"]]
    if len(ranks) <= limit:
        return ranks
    keep = {s["rank"] for s in doc["stragglers"]}
    stride = max(1, len(ranks) // (limit - len(keep) or 1))
    keep.update(ranks[::stride])
    return sorted(keep)[:limit]


def plot_data(doc: dict[str, Any], data: RunData) -> PlotData:
    """The figures' data for the report document ``doc`` of the loaded run ``data``."""
    con = data.con
    ranks = _shown_ranks(doc, MAX_RANKS)
    n_steps = doc["run"]["steps"]
    width = max(1, -(-n_steps // MAX_STEPS))
    # Consecutive sampled steps, ``width`` to a bucket, numbered from 0.
    bucket = f"""WITH bucket AS (SELECT step,
                     CAST((row_number() OVER (ORDER BY step) - 1) // {width} AS INTEGER) AS b
                 FROM (SELECT DISTINCT step FROM steps))"""
    shown = ", ".join(str(int(r)) for r in ranks) or "NULL"
    buckets = [int(s) for (s,) in con.execute(
        f"{bucket} SELECT min(step) FROM bucket GROUP BY b ORDER BY b").fetchall()]
    pos = {r: i for i, r in enumerate(ranks)}

    def grid(sql: str) -> Grid:
        out: Grid = [[None] * len(buckets) for _ in ranks]
        for rank, b, v in con.execute(sql).fetchall():
            out[pos[int(rank)]][int(b)] = round(float(v), 3)
        return out

    step_grid = grid(
        f"""{bucket} SELECT s.rank, k.b, median(s.step_ms) FROM steps s JOIN bucket k USING (step)
            WHERE s.rank IN ({shown}) GROUP BY 1, 2"""
    )
    phase = focus_phase(doc)
    phase_grid = grid(
        f"""{bucket} SELECT x.rank, k.b, median(x.own) FROM own_excess x JOIN bucket k USING (step)
            WHERE x.rank IN ({shown}) AND x.name = '{phase.replace("'", "''")}'
            GROUP BY 1, 2"""
    ) if phase != "step" else step_grid
    series = con.execute(
        f"""{bucket} SELECT k.b, median(s.step_ms), max(s.step_ms)
            FROM steps s JOIN bucket k USING (step) GROUP BY 1 ORDER BY 1"""
    ).fetchall()
    warm = warmup_steps(doc)
    top = [n for n, p in doc["phases"].items() if p["share"] is not None]
    bars = {n: {pr["rank"]: pr["median_ms"] for pr in doc["phases"][n]["per_rank"]} for n in top}
    return PlotData(
        ranks=ranks,
        steps=buckets,
        bucket_width=width,
        step_ms=step_grid,
        phase=phase,
        phase_ms=phase_grid,
        series={"median": [round(float(m), 3) for _, m, _ in series],
                "max": [round(float(x), 3) for _, _, x in series]},
        bars={n: [bars[n].get(r) or 0.0 for r in ranks] for n in top},
        windows=doc["windows"],
        stragglers=[s["rank"] for s in doc["stragglers"]],
        warmup_steps=warm,
        scale={"step_ms": color_scale(step_grid, buckets, warm),
               "phase_ms": color_scale(phase_grid, buckets, warm)},
    )


def warmup_steps(doc: dict[str, Any]) -> int:
    """Leading sampled steps left out of colour scales: compilation, allocator and cache
    warm-up make them slow on every run (5% of the run, at least 1, at most 10)."""
    n = int(doc["run"]["steps"] or 0)
    return 0 if n < 10 else min(10, max(1, n // 20))


def color_scale(grid: Grid, steps: list[int], warm: int) -> ColorScale:
    """The colour scale of a heat map whose columns start at ``steps``, the first ``warm``
    sampled steps left out."""
    first = sorted(steps)[min(warm, len(steps) - 1)] if steps and warm else None
    vals = sorted(v for row in grid for st, v in zip(steps, row, strict=False)
                  if v is not None and (first is None or st >= first))
    if not vals:
        vals = sorted(v for row in grid for v in row if v is not None)
    if not vals:
        return ColorScale(lo=0.0, hi=1.0, clipped=0, pct=CLIP_PCT, warmup=warm)
    hi = vals[min(len(vals) - 1, int(len(vals) * CLIP_PCT / 100.0))]
    lo = vals[0]
    clipped = sum(1 for row in grid for v in row if v is not None and v > hi)
    return ColorScale(lo=round(lo, 3), hi=round(max(hi, lo + 1e-6), 3), clipped=clipped,
                      pct=CLIP_PCT, warmup=warm)
