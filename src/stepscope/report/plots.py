"""Plot data (downsampled in DuckDB) and matplotlib PNGs: heat-maps, stacked bars, series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_RANKS = 128
MAX_STEPS = 300


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
        f"""SELECT x.rank, k.b, median(x.own) FROM ex x JOIN bucket k USING (step)
            WHERE x.rank IN (SELECT rank FROM shown) AND x.name = '{phase.replace("'", "''")}'
            GROUP BY 1, 2"""
    ) if phase != "step" else step_grid
    series = con.execute(
        """SELECT k.b, median(s.step_ms), max(s.step_ms) FROM steps s JOIN bucket k USING (step)
           GROUP BY 1 ORDER BY 1"""
    ).fetchall()
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
    }


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_pngs(pd: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Heat-maps, stacked bars and the step series as PNGs; [] without matplotlib."""
    if not have_matplotlib():
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt
    import numpy as np

    out: list[Path] = []
    ext = (float(pd["steps"][0]), float(pd["steps"][-1] + pd["bucket_width"]), len(pd["ranks"]) - 0.5, -0.5)

    def heat(grid: list[list[float | None]], title: str, name: str) -> None:
        arr = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
        fig, ax = plt.subplots(figsize=(9, 1.2 + 0.25 * min(len(pd["ranks"]), 40)))
        im = ax.imshow(arr, aspect="auto", interpolation="nearest", cmap="magma", extent=ext)
        ax.set_xlabel("step")
        ax.set_ylabel("rank")
        if len(pd["ranks"]) <= 32:
            ax.set_yticks(range(len(pd["ranks"])), [str(r) for r in pd["ranks"]])
        ax.set_title(title)
        fig.colorbar(im, ax=ax, label="ms")
        fig.tight_layout()
        path = out_dir / f"{stem}_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)

    heat(pd["step_ms"], "step time per rank and step (ms)", "heatmap_step")
    if pd["phase"] != "step":
        heat(pd["phase_ms"], f"{pd['phase']} own time per rank and step (ms)", "heatmap_phase")

    fig, ax = plt.subplots(figsize=(9, 3.5))
    x = np.arange(len(pd["ranks"]))
    bottom = np.zeros(len(x))
    for name, vals in pd["bars"].items():
        ax.bar(x, vals, bottom=bottom, label=name)
        bottom += np.array(vals, dtype=float)
    ax.set_xticks(x, [str(r) for r in pd["ranks"]] if len(x) <= 32 else [""] * len(x))
    ax.set_xlabel("rank")
    ax.set_ylabel("median ms per step")
    ax.set_title("phases per rank (a waiting rank shows long backward)")
    ax.legend(fontsize="small", ncols=4)
    fig.tight_layout()
    path = out_dir / f"{stem}_phases.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    out.append(path)

    fig, ax = plt.subplots(figsize=(9, 3))
    ax.plot(pd["steps"], pd["series"]["median"], label="median rank")
    ax.plot(pd["steps"], pd["series"]["max"], label="slowest rank", alpha=0.7)
    for w in pd["windows"]:
        ax.axvspan(w["start_step"], w["end_step"], color="red", alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("step ms")
    ax.set_title("step time (slow windows shaded)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / f"{stem}_series.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    out.append(path)
    return out
