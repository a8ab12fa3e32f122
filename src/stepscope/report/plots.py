"""Plot data (downsampled in DuckDB) and matplotlib PNGs: heat-maps, stacked bars, series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepscope.common.escape import plot

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


def plot_data(doc: dict[str, Any], data: Any) -> dict[str, Any]:
    """Everything the plots draw, as plain lists (steps bucketed, ranks subsampled)."""
    con = data.con
    ranks = _shown_ranks(doc, MAX_RANKS)
    n_steps = doc["run"]["steps"]
    width = max(1, -(-n_steps // MAX_STEPS))
    con.execute("CREATE OR REPLACE TABLE shown (rank INTEGER)")
    con.executemany("INSERT INTO shown VALUES (?)", [(r,) for r in ranks])
    con.execute(
        f"""CREATE OR REPLACE TABLE bucket AS SELECT step,
               CAST((row_number() OVER (ORDER BY step) - 1) // {width} AS INTEGER) AS b
            FROM (SELECT DISTINCT step FROM steps)"""
    )
    buckets = [int(s) for (s,) in con.execute(
        "SELECT min(step) FROM bucket GROUP BY b ORDER BY b").fetchall()]
    pos = {r: i for i, r in enumerate(ranks)}

    def grid(sql: str) -> list[list[float | None]]:
        out: list[list[float | None]] = [[None] * len(buckets) for _ in ranks]
        for rank, b, v in con.execute(sql).fetchall():
            out[pos[int(rank)]][int(b)] = round(float(v), 3)
        return out

    step_grid = grid(
        """SELECT s.rank, k.b, median(s.step_ms) FROM steps s JOIN bucket k USING (step)
           WHERE s.rank IN (SELECT rank FROM shown) GROUP BY 1, 2"""
    )
    phase = focus_phase(doc)
    phase_grid = grid(
        f"""SELECT x.rank, k.b, median(x.own) FROM own_excess x JOIN bucket k USING (step)
            WHERE x.rank IN (SELECT rank FROM shown) AND x.name = '{phase.replace("'", "''")}'
            GROUP BY 1, 2"""
    ) if phase != "step" else step_grid
    series = con.execute(
        """SELECT k.b, median(s.step_ms), max(s.step_ms) FROM steps s JOIN bucket k USING (step)
           GROUP BY 1 ORDER BY 1"""
    ).fetchall()
    warm = warmup_steps(doc)
    top = [n for n, p in doc["phases"].items() if p["share"] is not None]
    bars = {n: {pr["rank"]: pr["median_ms"] for pr in doc["phases"][n]["per_rank"]} for n in top}
    return {
        "ranks": ranks,
        "steps": buckets,
        "bucket_width": width,
        "step_ms": step_grid,
        "phase": phase,
        "phase_ms": phase_grid,
        "series": {"median": [round(float(m), 3) for _, m, _ in series],
                   "max": [round(float(x), 3) for _, _, x in series]},
        "bars": {n: [bars[n].get(r) or 0.0 for r in ranks] for n in top},
        "windows": doc["windows"],
        "stragglers": [s["rank"] for s in doc["stragglers"]],
        "warmup_steps": warm,
        "scale": {"step_ms": color_scale(step_grid, buckets, warm),
                  "phase_ms": color_scale(phase_grid, buckets, warm)},
    }


def warmup_steps(doc: dict[str, Any]) -> int:
    """Leading sampled steps left out of colour scales: compilation, allocator and cache
    warm-up make them slow on every run (5% of the run, at least 1, at most 10)."""
    n = int(doc["run"]["steps"] or 0)
    return 0 if n < 10 else min(10, max(1, n // 20))


def color_scale(grid: list[list[float | None]], steps: list[int], warm: int) -> dict[str, Any]:
    """{lo, hi, clipped, pct, warmup}: the scale of a heat-map, robust to warm-up and outliers.

    Cells of the first ``warm`` sampled steps are ignored; ``hi`` is the ``CLIP_PCT``
    percentile of the rest; ``clipped`` counts cells above it (drawn in the top colour).
    """
    first = sorted(steps)[min(warm, len(steps) - 1)] if steps and warm else None
    vals = sorted(v for row in grid for st, v in zip(steps, row, strict=False)
                  if v is not None and (first is None or st >= first))
    if not vals:
        vals = sorted(v for row in grid for v in row if v is not None)
    if not vals:
        return {"lo": 0.0, "hi": 1.0, "clipped": 0, "pct": CLIP_PCT, "warmup": warm}
    hi = vals[min(len(vals) - 1, int(len(vals) * CLIP_PCT / 100.0))]
    lo = vals[0]
    clipped = sum(1 for row in grid for v in row if v is not None and v > hi)
    return {"lo": round(lo, 3), "hi": round(max(hi, lo + 1e-6), 3), "clipped": clipped,
            "pct": CLIP_PCT, "warmup": warm}


def scale_note(sc: dict[str, Any]) -> str:
    """The legend's words for a colour scale."""
    note = f"clipped at p{sc['pct']:g} = {sc['hi']:.1f} ms"
    if sc["clipped"]:
        note += f" ({sc['clipped']} cells above)"
    if sc["warmup"]:
        note += f"; first {sc['warmup']} warm-up steps not in the scale"
    return note


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_pngs(pd: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Heat-maps (windows and culprits marked, phase bars beside), stacked bars and the step
    series as PNGs; [] without matplotlib."""
    if not have_matplotlib():
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    out: list[Path] = []
    ranks = pd["ranks"]
    n_r = len(ranks)
    bw = pd["bucket_width"]
    ext = (float(pd["steps"][0]), float(pd["steps"][-1] + bw), n_r - 0.5, -0.5)
    culprits = set(pd["stragglers"])
    row_of = {r: i for i, r in enumerate(ranks)}
    names = list(pd["bars"])
    colors = [f"C{k % 10}" for k in range(len(names))]

    def save(fig: Any, name: str) -> None:
        import io

        from stepscope.common.safefs import write_output

        path = out_dir / f"{stem}_{name}.png"
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        write_output(path, buf.getvalue())  # never through a link planted at that name
        plt.close(fig)
        out.append(path)

    def rank_labels(ax: Any) -> None:
        if n_r <= 32:
            ax.set_yticks(range(n_r), [f"{r} ◀ culprit" if r in culprits else str(r) for r in ranks])
            for lab, r in zip(ax.get_yticklabels(), ranks, strict=True):
                if r in culprits:
                    lab.set_color("red")
                    lab.set_fontweight("bold")

    def heat(grid: list[list[float | None]], sc: dict[str, Any], title: str, name: str) -> None:
        arr = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
        fig = plt.figure(figsize=(12, 2.2 + 0.3 * min(n_r, 40)))
        gs = fig.add_gridspec(1, 3, width_ratios=[5, 0.12, 1.7], wspace=0.25,
                              left=0.12, right=0.98, top=0.8, bottom=0.3 if n_r < 8 else 0.18)
        ax, cax = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
        axb = fig.add_subplot(gs[2], sharey=ax)
        cmap = matplotlib.colormaps["viridis"].with_extremes(over="#ffff66", bad="#dddddd")
        im = ax.imshow(arr, aspect="auto", interpolation="nearest", cmap=cmap, extent=ext,
                       vmin=sc["lo"], vmax=sc["hi"])
        for k, w in enumerate(pd["windows"]):
            rows = [row_of[r] for r in w["ranks"] if r in row_of]
            x0, x1 = w["start_step"], w["end_step"] + 1
            if not rows:
                continue
            for i in rows:
                ax.add_patch(Rectangle((x0, i - 0.5), x1 - x0, 1.0, fill=False, edgecolor="red",
                                       linewidth=2))
            ax.annotate(f"{w['start_step']}–{w['end_step']} {plot(w['phase'])} {w['slowdown']:.2f}×",
                        (x0, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2 + 9 * (k % 2)),
                        textcoords="offset points", fontsize=7, color="red", va="bottom",
                        annotation_clip=False)
        ax.set_xlabel("step")
        ax.set_ylabel("rank")
        rank_labels(ax)
        ax.set_title(title, pad=22)
        fig.colorbar(im, cax=cax, extend="max").set_label("ms")
        fig.text(0.12, 0.02, f"Colour scale {scale_note(sc)}. Red boxes: slow windows; red rank: culprit.",
                 fontsize=8, color="#444")
        left = np.zeros(n_r)
        for name_, col in zip(names, colors, strict=True):
            vals = np.array(pd["bars"][name_], dtype=float)
            axb.barh(range(n_r), vals, left=left, color=col, label=plot(name_), height=0.8)
            left += vals
        axb.tick_params(labelleft=False)
        axb.set_xlabel("median ms per step")
        axb.set_title("phases per rank (run medians)", fontsize=9)
        axb.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.3 if n_r < 8 else -0.12),
                   ncols=min(3, max(1, len(names))), frameon=False)
        save(fig, name)

    heat(pd["step_ms"], pd["scale"]["step_ms"], "step time per rank and step (ms); red boxes: "
         "slow windows", "heatmap_step")
    if pd["phase"] != "step":
        heat(pd["phase_ms"], pd["scale"]["phase_ms"],
             f"{plot(pd['phase'])} own time per rank and step (ms); red boxes: slow windows",
             "heatmap_phase")

    fig, ax = plt.subplots(figsize=(9, 3.5))
    x = np.arange(n_r)
    bottom = np.zeros(n_r)
    for name_, col in zip(names, colors, strict=True):
        vals = np.array(pd["bars"][name_], dtype=float)
        ax.bar(x, vals, bottom=bottom, label=plot(name_), color=col)
        bottom += vals
    ax.set_xticks(x, [f"{r}*" if r in culprits else str(r) for r in ranks] if n_r <= 32 else [""] * n_r)
    ax.set_xlabel("rank (* culprit)")
    ax.set_ylabel("median ms per step")
    ax.set_title("phases per rank, whole-run medians (a waiting rank shows long backward)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    save(fig, "phases")

    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.plot(pd["steps"], pd["series"]["median"], label="median rank")
    ax.plot(pd["steps"], pd["series"]["max"], label="slowest rank", alpha=0.7)
    sc = pd["scale"]["step_ms"]
    warm = min(pd["warmup_steps"], len(pd["steps"]) - 1)
    top = max(sc["hi"] * 1.15, max(pd["series"]["median"][warm:] or [1.0]) * 1.1)
    clipped = [v for v in pd["series"]["max"] if v > top]
    ax.set_ylim(0, top)
    for w in pd["windows"]:
        ax.axvspan(w["start_step"], w["end_step"] + 1, color="red", alpha=0.15)
        ax.text(w["start_step"], top * 0.97, f"rank {', '.join(str(r) for r in w['ranks'][:4])}: "
                f"{plot(w['phase'])}", fontsize=8, color="darkred", va="top")
    if pd["warmup_steps"]:
        ax.axvspan(pd["steps"][0], pd["steps"][min(pd["warmup_steps"], len(pd["steps"]) - 1)],
                   color="grey", alpha=0.15, label="warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("step ms")
    ax.set_title("step time (slow windows shaded red)"
                 + (f"; {len(clipped)} points above {top:.0f} ms off the scale" if clipped else ""))
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    save(fig, "series")
    return out
