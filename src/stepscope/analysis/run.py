"""``analyze_run``: a run directory in, the JSON report document (plain dicts) out."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepscope.analysis import cost
from stepscope.analysis.align import BlockRows
from stepscope.analysis.coverage import add_coverage_sections
from stepscope.analysis.diagnose import diagnose, explain_goodput
from stepscope.analysis.goodput import compute_goodput
from stepscope.analysis.hangs import MAX_HEARTBEAT_BYTES, crash_evidence, lost_note, run_losses
from stepscope.analysis.host import split_host_busy
from stepscope.analysis.load import RunData, load_run
from stepscope.analysis.own import OwnBlockRunner, phase_waits
from stepscope.analysis.resource_use import analyze_resources
from stepscope.analysis.stats import create_phase_samples, phase_stats, rank_stats
from stepscope.analysis.stragglers import SeriesRunner, attribute
from stepscope.analysis.triggers import link_triggers
from stepscope.common import slow_step
from stepscope.common.safefs import read_run_file

#: Version of the JSON document; bump when a key changes meaning.
REPORT_VERSION = 1


def analyze_run(
    run_dir: str | os.PathLike[str],
    *,
    threads: int | None = None,
    memory_limit: str | None = None,
    keep: bool = False,
    store: bool = True,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Analyse every rank file of ``run_dir`` and return the report document.

    Top-level keys: ``run``, ``phases``, ``ranks``, ``stragglers``, ``windows``,
    ``verdicts``. Raises :class:`stepscope.common.errors.AnalysisError` when nothing is usable;
    anything skipped on the way is listed in ``run["skipped"]``. With ``keep=True`` the
    loaded :class:`RunData` is returned under the private key ``"_data"`` (its per-step
    tables); the caller must ``close()`` it. :func:`open_analyzed_run` hands both over typed.
    ``run_id``: which run to analyze where several launches wrote into ``run_dir`` (an id or
    a unique prefix; default the newest); ``run["runs"]`` lists them all.

    Example::

        doc = analyze_run("runs/demo")
        for s in doc["stragglers"]:
            print(s["rank"], s["phase"], s["excess_ms"])
    """
    run = open_analyzed_run(run_dir, threads=threads, memory_limit=memory_limit, store=store,
                            run_id=run_id)
    if keep:
        run.doc["_data"] = run.data
    else:
        run.close()
    return run.doc


@dataclass(frozen=True)
class AnalyzedRun:
    """A run's report document and the loaded run it was made from, still open for the
    per-step views (:func:`stepscope.analysis.heatmaps.plot_data`,
    :func:`stepscope.analysis.timeline.timeline`); ``close()`` it when done."""

    doc: dict[str, Any]
    data: RunData

    def close(self) -> None:
        self.data.close()


#: Where the per-rank phase rows (:func:`stepscope.analysis.stats.phase_rank_rows`) of a
#: loaded run are computed, when not on its connection: by an engine that splits the run into
#: tasks (:mod:`stepscope.analysis.dask_engine`).
PhaseRankRunner = Callable[[RunData], Iterable[tuple[Any, ...]]]
#: Where the per-step rows of whole steps (:data:`stepscope.analysis.align.BlockRows`) of a
#: loaded run are computed, when not on its connection: by an engine that splits the run into
#: step-block tasks (:mod:`stepscope.analysis.dask_engine`).
StepBlockRunner = Callable[[RunData], BlockRows]
#: Where the own-work matrices of a loaded run's blocks of whole steps
#: (:func:`stepscope.analysis.own.own_block`) are computed, when not on its connection: by an
#: engine that splits the run into step-block tasks (:mod:`stepscope.analysis.dask_engine`).
OwnBlocksRunner = Callable[[RunData], OwnBlockRunner]


def open_analyzed_run(
    run_dir: str | os.PathLike[str],
    *,
    threads: int | None = None,
    memory_limit: str | None = None,
    store: bool = True,
    run_id: str | None = None,
    phase_rank_rows: PhaseRankRunner | None = None,
    step_block_rows: StepBlockRunner | None = None,
    series_screen: SeriesRunner | None = None,
    own_blocks: OwnBlocksRunner | None = None,
) -> AnalyzedRun:
    """:func:`analyze_run`, with the loaded run kept open beside the document.

    ``phase_rank_rows``: computes the per-rank phase statistics' rows of the loaded run
    elsewhere (the same rows; default: on the run's own connection). ``step_block_rows``:
    computes the per-step rows of blocks of whole steps elsewhere (the same rows; default:
    on the run's own connection). ``series_screen``: computes each (rank, phase) gap series'
    noise and whether it may name a straggler elsewhere (the same values; default: here).
    ``own_blocks``: computes the own-work matrices of blocks of whole steps elsewhere (the
    same matrices; default: on the run's own connection)."""
    data = load_run(run_dir, threads=threads, memory_limit=memory_limit, store=store,
                    run_id=run_id)
    try:
        doc = _analyze(data, phase_rank_rows,
                       None if step_block_rows is None else step_block_rows(data),
                       series_screen, None if own_blocks is None else own_blocks(data))
    except BaseException:
        data.close()
        raise
    return AnalyzedRun(doc, data)


def recording_lost(con: Any) -> dict[str, int]:
    """Sum of the records' ``dropped`` counts by reason (steps never written); zeros left out."""
    rows = con.execute("SELECT key, n FROM lost_steps ORDER BY 1").fetchall()  # built by load_run
    return {str(k): int(n) for k, n in rows if n is not None and n > 0}


def _analyze(data: RunData, phase_rank_rows: PhaseRankRunner | None = None,
             block_rows: BlockRows | None = None,
             series_screen: SeriesRunner | None = None,
             own_blocks: OwnBlockRunner | None = None) -> dict[str, Any]:
    con = data.con
    create_phase_samples(con)
    n_rows = con.execute("SELECT count(*) FROM phase_samples").fetchone()[0]
    step_q = con.execute(
        "SELECT quantile_cont(step_ms, [0.5, 0.9]), min(t0), max(t0 + step_ms) FROM steps"
    ).fetchone()
    median_step = float(step_q[0][0])
    steps = [int(s) for (s,) in con.execute("SELECT DISTINCT step FROM steps ORDER BY 1").fetchall()]
    att = attribute(con, data.hosts, data.ranks, median_step, steps, block_rows,
                    series_screen, own_blocks)
    total_ms = con.execute(
        "SELECT median(t) FROM (SELECT rank, sum(step_ms) AS t FROM steps GROUP BY 1)").fetchone()[0]
    al, thr, stragglers, windows = att.alignment, att.thresholds, att.stragglers, att.windows
    windows, host_busy = split_host_busy(windows, data.clock, stragglers, con)

    phases = phase_stats(con, n_rows, None if phase_rank_rows is None
                         else lambda _con: phase_rank_rows(data))
    phase_waits(con, phases)
    ranks = rank_stats(con, data.hosts, n_rows)

    run: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "dir": str(data.run_dir),
        "run_id": data.run_id,
        "ranks": len(data.ranks),
        "rank_ids": data.ranks,
        "world_size": data.world_size,
        "hosts": data.hosts,
        "steps": len(steps),
        "first_step": steps[0],
        "last_step": steps[-1],
        "records": data.records,
        "phase_samples": int(n_rows),
        "clock": data.clock,
        "alignment": {
            "aligned": al.aligned,
            "method": al.method,
            "sync_phase": al.sync_phase,
            "arrival": al.arrival,
            "offsets_ms": {h: round(o, 3) for h, o in al.offsets_ms.items()},
            "end_spread_ms": None if al.end_spread_ms is None else round(al.end_spread_ms, 3),
            "wait_source": att.source,
        },
        # Wall time from the first step start to the last step end, aligned timeline.
        "duration": round((float(step_q[2]) - float(step_q[1])) / 1000.0, 3),
        "step_ms": {"median": round(median_step, 3), "p90": round(float(step_q[0][1]), 3)},
        "thresholds_ms": {k: round(v, 3) for k, v in thr.items()},
        # Slow first steps on every rank (warm-up): noted, not a window.
        "warmup": att.warmup,
        # Every rank's host-timed compute slowing at once on a CPU clock: the host was busy.
        "host_busy": host_busy,
        # A rank that would be a straggler but for its extra wait for a CPU (run-queue wait,
        # counters.runq_ms): the host was oversubscribed, not the job's code.
        "host_contention": att.contention,
        # A rank longer in one phase on every step, but no other rank waited for it: the
        # others spent as long elsewhere before the collective (stragglers.unwaited).
        "unwaited": att.unwaited,
        "skipped": list(data.skipped) + data.store_notes + att.notes,
        "partial": bool(data.skipped or att.notes),
    }
    # What the findings are priced against (analysis/cost.py).
    run["cost"] = {"total_ms": round(float(total_ms or 0.0), 3),
                   "world_size": int(data.world_size or len(data.ranks)),
                   "median_step_ms": round(median_step, 3), "thresholds": cost.thresholds()}
    run.update(analyze_resources(con))  # [metrics] run.throughput / run.memory / run.device
    run["recording_lost"] = recording_lost(con)  # [hostile] steps the recorder could not write
    # ... and those no written record could count (a full disk, timing off): the heartbeats'.
    for k, n in run_losses(data.run_dir, data.run_id).items():
        run["recording_lost"][k] = run["recording_lost"].get(k, 0) + n
    if run["recording_lost"]:
        run["recording_lost"] = dict(sorted(run["recording_lost"].items()))
        run["skipped"].append(lost_note(run["recording_lost"],
                                        "steps lost while recording (counted by the recorder)"))
        run["partial"] = True
    # Productive vs lost device time (analysis/goodput.py): the same split the advice follows.
    goodput = compute_goodput(con, data.run_dir, att.warmup, clock=data.clock)
    verdicts = diagnose(run, phases, ranks, stragglers, windows, goodput)
    # Auto-profile captures live under run: the six top-level keys are the contract.
    run["captures"], trigger_skips = link_triggers(data.run_dir, windows)
    run["skipped"].extend(trigger_skips)
    run["crashes"] = crash_evidence(data.run_dir)  # [ops] from the heartbeat files
    doc: dict[str, Any] = {
        "run": run,
        "phases": phases,
        "ranks": ranks,
        "stragglers": stragglers,
        "windows": windows,
        "verdicts": verdicts,
        # Additive: per op and process group (the six keys above are the contract).
        "collectives": att.collectives,
        # Additive: productive vs lost device time (analysis/goodput.py).
        "goodput": goodput,
    }
    add_coverage_sections(con, doc)  # [coverage] pipeline / experts / blind paths
    verdicts = cost.fold(doc["verdicts"])  # one fault, one finding
    verdicts += explain_goodput(run, verdicts, goodput)
    cost.order(verdicts)
    run["headline"] = cost.headline(run, verdicts, goodput)
    doc["verdicts"] = [v.to_dict() for v in verdicts]
    run["notes"] = run_notes(data, run)
    # Other launches into the same directory: named, never merged (analysis/launches.py).
    run["runs"] = [r.to_dict(r.run_id == (data.run_id or "")) for r in data.runs]
    if data.runs_note:
        run["notes"].insert(0, data.runs_note)
    job = run["cost"]
    for c in att.contention:
        why = (f"{c['extra_runq_ms']:.1f} ms more at the median step" if c.get("basis") == "extra"
               else f"as long, on a {c['steps']}-step stretch, but its own wait as long as the gap")
        run["notes"].append(
            f"rank {c['rank']} waited {c['runq_ms']:.1f} ms per step for a CPU on steps "
            f"{c['first_step']}–{c['last_step']} (the other ranks {c['others_runq_ms']:.1f} ms; "
            f"{why}), against its {c['phase']}'s {c['excess_ms']:.1f} ms over theirs and "
            f"{c['gap_ms']:.1f} ms over all its phases: the host is oversubscribed; not the "
            "job's code")
    for u in att.unwaited:
        run["notes"].append(
            f"rank {u['rank']}'s {u['phase']} ran {u['excess_ms']:.1f} ms over the other ranks' "
            f"on steps {u['first_step']}–{u['last_step']}, but no rank waited for it at the next "
            "collective (the others spent as long elsewhere in the step): a phase imbalance that "
            "costs nothing, not a straggler")
    for w in host_busy:
        if any(h["first_step"] <= w["end_step"] and h["last_step"] >= w["start_step"]
               for h in att.contention):
            continue  # one rank waiting for a CPU: its note above says so
        c = cost.price(job, float(w.get("excess_ms") or 0.0), int(w.get("steps") or 0), job["world_size"])
        run["notes"].append(
            f"steps {w['start_step']}–{w['end_step']}: every rank's {w['phase']} slowed together "
            f"(+{float(w.get('excess_ms') or 0.0):.1f} ms per step, {100 * cost.share(c):.1f}% of the "
            "job) with no rank singled out: on a CPU clock that is the host being busy (other "
            "processes), not a window of the job")
    return doc


def _meta_config(data: RunData) -> dict[str, Any]:

    # The run-file rules: inside the run, a regular file, size-bounded.
    raw, _ = read_run_file(Path(data.run_dir), "meta.json", MAX_HEARTBEAT_BYTES)
    try:
        meta = json.loads(raw.decode("utf-8")) if raw is not None else None
    except ValueError:
        meta = None  # unreadable meta.json: the notes that need it are left out
    cfg = meta.get("config") if isinstance(meta, dict) else None
    return cfg if isinstance(cfg, dict) else {}


def run_notes(data: RunData, run: dict[str, Any]) -> list[str]:
    """What the report should say about tools that stayed silent: an auto-profile that never
    fired (its threshold and the worst step), and why there is no MFU."""
    notes: list[str] = []
    cfg = _meta_config(data)
    ap = cfg.get("auto_profile")
    if ap not in (None, False, "False") and not run.get("captures"):
        text = str(ap)

        def field(name: str, default: float) -> float:
            m = re.search(rf"\b{name}=([0-9.eE+-]+)", text)
            try:
                return float(m.group(1)) if m else default
            except ValueError:
                return default

        k, slow = field("k", slow_step.DEFAULT_K), field("min_slowdown", slow_step.DEFAULT_MIN_SLOWDOWN)
        patience = field("patience", slow_step.DEFAULT_PATIENCE)
        row = data.con.execute(
            "SELECT step, max(step_ms) AS ms FROM steps GROUP BY 1 ORDER BY ms DESC LIMIT 1").fetchone()
        med = float(run["step_ms"]["median"] or 0.0)
        worst = (f"worst step {row[0]}: {float(row[1]):.1f} ms, {float(row[1]) / med:.2f}× the median"
                 if row and med > 0 else "no step to judge")
        notes.append(
            f"auto-profile armed, never fired (threshold: {1 + slow:g}× the running median step, "
            f"about {(1 + slow) * med:.1f} ms here, and {k:g} MADs above it, for {patience:g} "
            f"step(s) in a row; {worst})")
    thr = run.get("throughput") or {}
    if thr.get("mfu") is None:
        if thr.get("tflops") is None and not cfg.get("flops_per_step") and not cfg.get("model_flops"):
            notes.append("no MFU: FLOPs per step unknown (pass init(flops_per_step=...) or "
                         "init(model_flops=...) to get TFLOP/s and MFU)")
        elif str(run.get("clock") or "").startswith("cpu") and not cfg.get("peak_tflops"):
            notes.append("no MFU: a CPU run has no known peak TFLOP/s (pass init(peak_tflops=...))")
        else:
            notes.append("no MFU: the device's peak TFLOP/s for this dtype is unknown (pass "
                         "init(peak_tflops=...))")
    return notes

