"""matplotlib PNGs of the analysis' plot data: heat-maps, stacked bars, the step series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepscope.common.escape import plot
from stepscope.common.figures import ColorScale, Grid, PlotData
from stepscope.common.safefs import write_output


def scale_note(sc: ColorScale) -> str:
    """The legend's words for a colour scale."""
    note = f"clipped at p{sc.pct:g} = {sc.hi:.1f} ms"
    if sc.clipped:
        note += f" ({sc.clipped} cells above)"
    if sc.warmup:
        note += f"; first {sc.warmup} warm-up steps not in the scale"
    return note


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_pngs(pd: PlotData, out_dir: Path, stem: str) -> list[Path]:
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
    ranks = pd.ranks
    n_r = len(ranks)
    bw = pd.bucket_width
    ext = (float(pd.steps[0]), float(pd.steps[-1] + bw), n_r - 0.5, -0.5)
    culprits = set(pd.stragglers)
    row_of = {r: i for i, r in enumerate(ranks)}
    names = list(pd.bars)
    colors = [f"C{k % 10}" for k in range(len(names))]

    def save(fig: Any, name: str) -> None:
        import io


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

    def heat(grid: Grid, sc: ColorScale, title: str, name: str) -> None:
        arr = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
        fig = plt.figure(figsize=(12, 2.2 + 0.3 * min(n_r, 40)))
        gs = fig.add_gridspec(1, 3, width_ratios=[5, 0.12, 1.7], wspace=0.25,
                              left=0.12, right=0.98, top=0.8, bottom=0.3 if n_r < 8 else 0.18)
        ax, cax = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
        axb = fig.add_subplot(gs[2], sharey=ax)
        cmap = matplotlib.colormaps["viridis"].with_extremes(over="#ffff66", bad="#dddddd")
        im = ax.imshow(arr, aspect="auto", interpolation="nearest", cmap=cmap, extent=ext,
                       vmin=sc.lo, vmax=sc.hi)
        for k, w in enumerate(pd.windows):
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
            vals = np.array(pd.bars[name_], dtype=float)
            axb.barh(range(n_r), vals, left=left, color=col, label=plot(name_), height=0.8)
            left += vals
        axb.tick_params(labelleft=False)
        axb.set_xlabel("median ms per step")
        axb.set_title("phases per rank (run medians)", fontsize=9)
        axb.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.3 if n_r < 8 else -0.12),
                   ncols=min(3, max(1, len(names))), frameon=False)
        save(fig, name)

    heat(pd.step_ms, pd.scale["step_ms"], "step time per rank and step (ms); red boxes: "
         "slow windows", "heatmap_step")
    if pd.phase != "step":
        heat(pd.phase_ms, pd.scale["phase_ms"],
             f"{plot(pd.phase)} own time per rank and step (ms); red boxes: slow windows",
             "heatmap_phase")

    fig, ax = plt.subplots(figsize=(9, 3.5))
    x = np.arange(n_r)
    bottom = np.zeros(n_r)
    for name_, col in zip(names, colors, strict=True):
        vals = np.array(pd.bars[name_], dtype=float)
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
    ax.plot(pd.steps, pd.series["median"], label="median rank")
    ax.plot(pd.steps, pd.series["max"], label="slowest rank", alpha=0.7)
    sc = pd.scale["step_ms"]
    warm = min(pd.warmup_steps, len(pd.steps) - 1)
    top = max(sc.hi * 1.15, max(pd.series["median"][warm:] or [1.0]) * 1.1)
    clipped = [v for v in pd.series["max"] if v > top]
    ax.set_ylim(0, top)
    for w in pd.windows:
        ax.axvspan(w["start_step"], w["end_step"] + 1, color="red", alpha=0.15)
        ax.text(w["start_step"], top * 0.97, f"rank {', '.join(str(r) for r in w['ranks'][:4])}: "
                f"{plot(w['phase'])}", fontsize=8, color="darkred", va="top")
    if pd.warmup_steps:
        ax.axvspan(pd.steps[0], pd.steps[min(pd.warmup_steps, len(pd.steps) - 1)],
                   color="grey", alpha=0.15, label="warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("step ms")
    ax.set_title("step time (slow windows shaded red)"
                 + (f"; {len(clipped)} points above {top:.0f} ms off the scale" if clipped else ""))
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    save(fig, "series")
    return out
