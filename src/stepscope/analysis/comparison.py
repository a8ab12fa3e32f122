"""Comparing two runs: step time and every shared phase, with a bootstrap confidence interval.

Samples are per step, one number per step index of a run:

* the step: the **max over ranks** of ``step_ms`` (the job moves at its slowest rank);
* a phase: the **max over ranks** of the phase's time on that step (a phase slowed on one
  rank shows up; a median over ranks would hide it). A step on which a phase did not happen
  gives no sample (not a zero).

``change_pct = (median_b - median_a) / median_a × 100``. Its 95 % interval is a percentile
bootstrap of the ratio of medians: both runs' per-step samples are resampled with
replacement ``N_BOOT`` times (numpy, seed ``SEED``), each time taking ``median(b*) /
median(a*) - 1``. A difference is *significant* when that interval excludes 0 and the
change is at least ``MIN_EFFECT_PCT`` (smaller shifts are machine noise between two
launches, even when a long run makes them statistically detectable).

Warm-up: unless a step range is given, the first ``WARMUP_FRACTION`` of each run's sampled
steps (at least one step when there are ten or more) is left out.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from stepscope.analysis import changepoint
from stepscope.analysis.hangs import is_collective
from stepscope.analysis.load import RunData, load_run
from stepscope.analysis.stats import phase_order
from stepscope.common.errors import AnalysisError

N_BOOT = 2000
SEED = 0
CONFIDENCE = 0.95
MIN_EFFECT_PCT = 3.0
#: Practical significance: a change must also move at least this many ms per step and this
#: share of the step (0.010 -> 0.013 ms is 30% of nothing).
MIN_DELTA_MS = 0.1
MIN_STEP_SHARE = 0.01
#: The tail statistic compared beside the median.
TAIL_Q = 90.0
WARMUP_FRACTION = 0.10
#: Resamples drawn per numpy batch (bounds memory for long runs).
_BATCH_ELEMS = 4_000_000


def parse_steps(spec: str | None) -> tuple[int | None, int | None]:
    """``"100:"``, ``":500"``, ``"100:500"`` (end exclusive) or ``"100"`` (just that step)."""
    if spec is None or spec.strip() in ("", ":"):
        return None, None
    text = spec.strip()
    try:
        if ":" not in text:
            n = int(text)
            return n, n + 1
        lo, hi = text.split(":", 1)
        start = int(lo) if lo.strip() else None
        end = int(hi) if hi.strip() else None
    except ValueError:
        raise ValueError(f"--steps must look like 100:, :500 or 100:500; got {spec!r}") from None
    if start is not None and end is not None and end <= start:
        raise ValueError(f"--steps end must be greater than start (end exclusive); got {spec!r}")
    return start, end


def _columns(con: Any, table: str) -> set[str]:
    return {str(r[0]) for r in con.execute(f"DESCRIBE {table}").fetchall()}


def _series(data: RunData, start: int | None, end: int | None) -> dict[str, Any]:
    """Per-step samples of a run: step, residual and every phase (keyed by path)."""
    con = data.con
    where = []
    if start is not None:
        where.append(f"step >= {int(start)}")
    if end is not None:
        where.append(f"step < {int(end)}")
    cond = ("WHERE " + " AND ".join(where)) if where else ""
    step_rows = con.execute(
        f"SELECT step, max(step_ms), max(residual_ms) FROM steps {cond} GROUP BY step ORDER BY step"
    ).fetchall()
    cols = _columns(con, "phases")
    # Schema 2 records carry a path; schema 1 ones a parent name (one level of nesting).
    path = "path" if "path" in cols else "CASE WHEN parent IS NULL THEN name ELSE parent || '/' || name END"
    phase_rows = con.execute(
        f"""SELECT p, step, max(ms) FROM (
                SELECT {path} AS p, rank, step, sum(ms) AS ms FROM phases {cond} GROUP BY ALL)
            GROUP BY p, step ORDER BY p, step"""
    ).fetchall()
    per_rank = con.execute(
        f"SELECT rank, step, step_ms FROM steps {cond} ORDER BY rank, step"
    ).fetchall()
    return {
        "steps": [int(r[0]) for r in step_rows],
        "step_ms": [float(r[1]) for r in step_rows],
        "residual_ms": {int(r[0]): float(r[2]) for r in step_rows if r[2] is not None},
        "phases": _group(phase_rows),
        "per_rank": _group(per_rank),
    }


def _group(rows: list[tuple[Any, Any, Any]]) -> dict[Any, dict[int, float]]:
    out: dict[Any, dict[int, float]] = {}
    for key, step, ms in rows:
        if ms is not None:
            out.setdefault(key, {})[int(step)] = float(ms)
    return out


def _warmup_cut(steps: list[int]) -> int:
    """The first step index kept after leaving out the warm-up."""
    n = len(steps)
    if n < 10:
        return steps[0] if steps else 0
    skip = max(1, math.ceil(WARMUP_FRACTION * n))
    return steps[skip]


def bootstrap_change(
    a: np.ndarray, b: np.ndarray, n_boot: int = N_BOOT, seed: int = SEED, confidence: float = CONFIDENCE,
    q: float = 50.0,
) -> tuple[float, float] | None:
    """Percentile interval (in %) of ``P_q(b)/P_q(a) - 1`` (median by default); None when undefined."""
    if len(a) < 3 or len(b) < 3:
        return None
    rng = np.random.default_rng(seed)
    ratios: list[np.ndarray] = []
    per_batch = max(1, _BATCH_ELEMS // max(len(a), len(b)))
    done = 0
    while done < n_boot:
        k = min(per_batch, n_boot - done)
        ma = np.percentile(a[rng.integers(0, len(a), (k, len(a)))], q, axis=1)
        mb = np.percentile(b[rng.integers(0, len(b), (k, len(b)))], q, axis=1)
        ok = ma > 0
        ratios.append(mb[ok] / ma[ok] - 1.0)
        done += k
    r = np.concatenate(ratios)
    if len(r) < n_boot // 2:
        return None  # the baseline is zero in most resamples: a percentage means nothing
    tail = (1.0 - confidence) / 2 * 100
    lo, hi = np.percentile(r, [tail, 100 - tail])
    return float(lo) * 100, float(hi) * 100


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), nd)


def _practical(delta: float | None, step_ms: float | None) -> bool:
    """Is a change of ``delta`` ms per step big enough to matter, whatever its CI?"""
    if delta is None:
        return False
    floor = max(MIN_DELTA_MS, MIN_STEP_SHARE * float(step_ms or 0.0))
    return abs(delta) >= floor


def compare_samples(a: list[float], b: list[float], step_ms: float | None = None) -> dict[str, Any]:
    """Medians, p90s, change and its interval for two sample lists (the contract's fields).

    ``significant``: the median moved (its interval excludes 0, by at least
    ``MIN_EFFECT_PCT``) *and* by a practical amount (``MIN_DELTA_MS`` and ``MIN_STEP_SHARE``
    of ``step_ms``, the step's median; the sample's own median when omitted).
    ``tail_significant`` is the same test on the p90.
    """
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ma = float(np.median(xa)) if len(xa) else None
    mb = float(np.median(xb)) if len(xb) else None
    pa = float(np.percentile(xa, TAIL_Q)) if len(xa) else None
    pb = float(np.percentile(xb, TAIL_Q)) if len(xb) else None
    ref = step_ms if step_ms is not None else ma
    change = tail = None
    if ma is not None and mb is not None and ma > 0:
        change = (mb - ma) / ma * 100
    if pa is not None and pb is not None and pa > 0:
        tail = (pb - pa) / pa * 100
    ci = bootstrap_change(xa, xb) if change is not None else None
    tci = bootstrap_change(xa, xb, q=TAIL_Q) if tail is not None else None
    delta = None if ma is None or mb is None else mb - ma
    tdelta = None if pa is None or pb is None else pb - pa
    significant = bool(
        ci is not None and change is not None and (ci[0] > 0 or ci[1] < 0)
        and abs(change) >= MIN_EFFECT_PCT and _practical(delta, ref)
    )
    tail_significant = bool(
        tci is not None and tail is not None and (tci[0] > 0 or tci[1] < 0)
        and abs(tail) >= MIN_EFFECT_PCT and _practical(tdelta, ref)
    )
    return {
        "a_ms": _r(ma),
        "b_ms": _r(mb),
        "change_pct": _r(change, 2),
        "ci_low_pct": _r(ci[0], 2) if ci else None,
        "ci_high_pct": _r(ci[1], 2) if ci else None,
        "significant": significant,
        "a_p90_ms": _r(pa),
        "b_p90_ms": _r(pb),
        "a_samples": len(xa),
        "b_samples": len(xb),
        "delta_ms": _r(delta),
        "p90_change_pct": _r(tail, 2),
        "p90_delta_ms": _r(tdelta),
        "tail_significant": tail_significant,
        "a_mean_ms": _r(float(np.mean(xa))) if len(xa) else None,
        "b_mean_ms": _r(float(np.mean(xb))) if len(xb) else None,
    }


def _run_info(data: RunData, series: dict[str, Any]) -> dict[str, Any]:
    steps = series["steps"]
    return {
        "id": data.run_id,
        "dir": str(data.run_dir),
        "world_size": data.world_size,
        "clock": data.clock,
        "steps": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "skipped": list(data.skipped),
    }


def compare_runs(
    run_a: str | os.PathLike[str],
    run_b: str | os.PathLike[str],
    *,
    steps: str | None = None,
) -> dict[str, Any]:
    """The ``stepscope compare --json`` document; :class:`AnalysisError` when nothing compares."""
    start, end = parse_steps(steps)
    da = load_run(run_a)
    try:
        db = load_run(run_b)
    except BaseException:
        da.close()
        raise
    try:
        return _compare(da, db, start, end, steps is not None)
    finally:
        da.close()
        db.close()


def _compare(da: RunData, db: RunData, start: int | None, end: int | None, ranged: bool) -> dict[str, Any]:
    sa, sb = _series(da, start, end), _series(db, start, end)
    notes: list[str] = []
    for name, s, d in (("A", sa, da), ("B", sb, db)):
        if not s["steps"]:
            raise AnalysisError(f"{d.run_dir}: no steps in the range {start}:{end} (run {name})")
    cut_a = cut_b = None
    if not ranged:
        cut_a, cut_b = _warmup_cut(sa["steps"]), _warmup_cut(sb["steps"])
        notes.append(
            f"warm-up left out: the first {WARMUP_FRACTION:.0%} of sampled steps (A from step "
            f"{cut_a}, B from step {cut_b}); pass --steps to choose"
        )
    keep_a = [i for i, s in enumerate(sa["steps"]) if cut_a is None or s >= cut_a]
    keep_b = [i for i, s in enumerate(sb["steps"]) if cut_b is None or s >= cut_b]
    step_set_a = {sa["steps"][i] for i in keep_a}
    step_set_b = {sb["steps"][i] for i in keep_b}
    step = compare_samples([sa["step_ms"][i] for i in keep_a], [sb["step_ms"][i] for i in keep_b])
    step_ref = max(float(step["a_ms"] or 0.0), float(step["b_ms"] or 0.0))

    if da.clock != db.clock:
        notes.append(
            f"clocks differ (A: {da.clock}, B: {db.clock}): CUDA-event and host times are not "
            "strictly comparable"
        )
    phases_a = {p: v for p, v in sa["phases"].items() if step_set_a & v.keys()}
    phases_b = {p: v for p, v in sb["phases"].items() if step_set_b & v.keys()}
    shared = sorted(phases_a.keys() & phases_b.keys(), key=_phase_key(phases_a))
    only_a = sorted(phases_a.keys() - phases_b.keys())
    only_b = sorted(phases_b.keys() - phases_a.keys())
    if only_a or only_b:
        notes.append(
            "phases not in both runs are listed, not compared: "
            + "; ".join(x for x in (
                f"only in A: {', '.join(only_a)}" if only_a else "",
                f"only in B: {', '.join(only_b)}" if only_b else "",
            ) if x)
        )
    if not shared:
        notes.append("the runs share no phase; only the step time is compared")
    total_a = sum(sa["step_ms"][i] for i in keep_a) or 1.0
    total_b = sum(sb["step_ms"][i] for i in keep_b) or 1.0
    phases = []
    for path in shared:
        va = [ms for s, ms in phases_a[path].items() if s in step_set_a]
        vb = [ms for s, ms in phases_b[path].items() if s in step_set_b]
        entry = {"name": path, **compare_samples(va, vb, step_ref)}
        if "/" not in path:
            entry["a_share"] = _r(sum(va) / total_a, 4)
            entry["b_share"] = _r(sum(vb) / total_b, 4)
        phases.append(entry)
    ra = [v for s, v in sa["residual_ms"].items() if s in step_set_a]
    rb = [v for s, v in sb["residual_ms"].items() if s in step_set_b]
    if ra and rb and shared:
        phases.append({"name": "residual", **compare_samples(ra, rb, step_ref)})

    per_rank = None
    if da.world_size == db.world_size:
        per_rank = []
        for rank in sorted(sa["per_rank"].keys() & sb["per_rank"].keys()):
            va = [ms for s, ms in sa["per_rank"][rank].items() if s in step_set_a]
            vb = [ms for s, ms in sb["per_rank"][rank].items() if s in step_set_b]
            if va and vb:
                c = compare_samples(va, vb)
                per_rank.append({"rank": int(rank), **c})
    else:
        notes.append(
            f"world sizes differ (A: {da.world_size}, B: {db.world_size}): the job's step (max "
            "over ranks) and phases are compared, not ranks"
        )
    windows = diff_windows(sa, sb, step_set_a & step_set_b, shared, step_ref)
    return {
        "a": _run_info(da, sa),
        "b": _run_info(db, sb),
        "step": step,
        "phases": phases,
        "per_rank": per_rank,
        "only_in_a": only_a,
        "only_in_b": only_b,
        "method": {
            "statistic": "median of per-step samples",
            "step_sample": "max over ranks of step_ms per step",
            "phase_sample": "max over ranks of the phase's ms per step (steps without it: no sample)",
            "interval": f"percentile bootstrap of median(B)/median(A) - 1, {N_BOOT} resamples, "
            f"numpy seed {SEED}, {CONFIDENCE:.0%}",
            "significant": f"interval excludes 0, |change| >= {MIN_EFFECT_PCT:g}% and the median "
            f"moved >= max({MIN_DELTA_MS:g} ms, {100 * MIN_STEP_SHARE:g}% of the step)",
            "tail": f"p{TAIL_Q:g} of the same samples, same test (tail_significant)",
            "windows": "change points in B's step time minus A's at the same step index",
            "warmup": None if ranged else f"first {WARMUP_FRACTION:.0%} of sampled steps",
            "steps": None if not ranged else [start, end],
        },
        "notes": notes,
        "windows": windows,
        "verdict": verdict(step, phases, windows),
        "slower_pct": slower_pct(step, windows),
    }


def diff_windows(sa: dict[str, Any], sb: dict[str, Any], steps: set[int], shared: list[str],
                 step_ref: float) -> list[dict[str, Any]]:
    """Stretches of step indices where B differs from A, and the phase that did.

    Both runs are lined up by step index; change-point detection
    (:func:`stepscope.analysis.changepoint.elevated`) finds where ``B - A`` (slower) or
    ``A - B`` (faster) holds a level beyond its noise, in the step time and in each
    top-level phase that is not a collective (a phase's own difference stands out even when
    two launches on a busy host differ everywhere in step time). A step window names the
    phase whose difference there is largest; a phase window not inside a step window of the
    same phase is listed too.
    """
    idx = sorted(steps)
    if len(idx) < 10:
        return []
    a = dict(zip(sa["steps"], sa["step_ms"], strict=True))
    b = dict(zip(sb["steps"], sb["step_ms"], strict=True))
    tops = [p for p in shared if "/" not in p and not is_collective(p)]
    min_len = max(5, len(idx) // 50)
    out: list[dict[str, Any]] = []
    for sign, how in ((1.0, "slower"), (-1.0, "faster")):
        found: list[tuple[str | None, tuple[list[int], float]]] = []
        for top in tops:
            found += [(top, w) for w in _diff_level(idx, _own(sa, top, shared), _own(sb, top, shared),
                                                    sign, step_ref, min_len)]
        # Step-time windows last: one that a phase's own window already explains is dropped.
        found += [(None, w) for w in _diff_level(idx, a, b, sign, step_ref, min_len)]
        for path, (ws, level) in found:
            best: str | None = path if path is not None else _biggest(sa, sb, tops, ws, sign)
            if path is None and any(o["phase"] == best and o["direction"] == how
                                    and o["start_step"] <= ws[-1] and o["end_step"] >= ws[0]
                                    for o in out):
                continue
            pa = pb = None
            if best is not None:
                pa = float(np.median([sa["phases"][best][s] for s in ws if s in sa["phases"][best]]))
                pb = float(np.median([sb["phases"][best][s] for s in ws if s in sb["phases"][best]]))
            out.append({
                "start_step": ws[0], "end_step": ws[-1], "steps": len(ws), "direction": how,
                "series": "step" if path is None else path,
                "delta_ms": _r(sign * level), "phase": best,
                "phase_a_ms": _r(pa), "phase_b_ms": _r(pb),
                "lost_ms": _r(sign * level * len(ws)),
            })
    # A phase's own window first: measured against that phase's noise, it is the specific
    # answer; a step-time window between two launches on a busy host may be the host.
    out.sort(key=lambda w: (w["series"] == "step", -abs(float(w["lost_ms"] or 0.0))))
    return out


def _own(series: dict[str, Any], top: str, shared: list[str]) -> dict[int, float]:
    """A top-level phase per step without the collectives inside it (waiting is not its work)."""
    kids = [series["phases"][q] for q in shared if q.startswith(top + "/") and is_collective(q)]
    if not kids:
        return dict(series["phases"][top])
    return {s: ms - sum(k.get(s, 0.0) for k in kids) for s, ms in series["phases"][top].items()}


def _diff_level(idx: list[int], a: dict[int, float], b: dict[int, float], sign: float,
                step_ref: float, min_len: int) -> list[tuple[list[int], float]]:
    """Windows (their step indices and level) where ``sign * (b - a)`` sits above zero."""

    both = [s for s in idx if s in a and s in b]
    if len(both) < 2 * min_len:
        return []
    d = [sign * (b[s] - a[s]) for s in both]
    bar = max(MIN_DELTA_MS, 5 * MIN_STEP_SHARE * step_ref, 2.5 * changepoint.noise(d))
    return [(both[w.start:w.end + 1], w.excess)
            for w in changepoint.elevated(d, bar, baseline=0.0, min_len=min_len)]


def _biggest(sa: dict[str, Any], sb: dict[str, Any], tops: list[str], ws: list[int],
             sign: float) -> str | None:
    best, best_d = None, 0.0
    for path in tops:
        pa, pb = sa["phases"][path], sb["phases"][path]
        dd = [pb[s] - pa[s] for s in ws if s in pa and s in pb]
        if len(dd) >= 3 and sign * float(np.median(dd)) > best_d:
            best, best_d = path, sign * float(np.median(dd))
    return best


def slower_pct(step: dict[str, Any], windows: list[dict[str, Any]]) -> float:
    """How much slower B is than A, in % of A's time, for ``--fail-if-slower``.

    The larger of the significant median change and the mean change when a slower window
    explains it (a slowdown confined to a window moves the mean, not the median). 0 when
    B is not slower.
    """
    out = 0.0
    if step["significant"] and (step["change_pct"] or 0.0) > 0:
        out = float(step["change_pct"])
    ma, mb = step.get("a_mean_ms"), step.get("b_mean_ms")
    if any(w["direction"] == "slower" for w in windows) and ma and mb and ma > 0:
        out = max(out, (float(mb) - float(ma)) / float(ma) * 100.0)
    return round(out, 2)


def _phase_key(phases: dict[str, dict[int, float]]) -> Any:

    tops = phase_order([p.split("/", 1)[0] for p in phases])

    def key(path: str) -> tuple[int, str]:
        top = path.split("/", 1)[0]
        return (tops.index(top) if top in tops else len(tops), path)

    return key


def _driver(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Significant phase changes that are the phase's own: not a wait, not explained by a child."""
    sig = [p for p in phases if p["significant"] and p["name"] != "residual"]
    own = []
    for p in sig:
        if is_collective(p["name"]):
            continue  # waiting on other ranks moves with whoever is slow
        comm = [c for c in phases if c["name"].startswith(p["name"] + "/") and is_collective(c["name"])]
        if comm and abs(_delta(p) - sum(_delta(c) for c in comm)) < 0.5 * abs(_delta(p)):
            continue  # most of its change is a collective inside it: waiting, not its own work
        kids = [c for c in sig if c["name"].startswith(p["name"] + "/")]
        explained = sum(_delta(c) for c in kids if _delta(c) * _delta(p) > 0)
        if kids and abs(explained) >= 0.5 * abs(_delta(p)):
            continue
        own.append(p)
    if not own:
        own = [p for p in sig if not is_collective(p["name"])] or sig
    return sorted(own, key=lambda p: -abs(_delta(p)))


def _delta(row: dict[str, Any]) -> float:
    """B's median less A's, ms (a phase or the step; a missing side counts as 0)."""
    return float(row["b_ms"] or 0.0) - float(row["a_ms"] or 0.0)


def _moved(p: dict[str, Any]) -> str:
    verb = "fell" if _delta(p) < 0 else "rose"
    return f"{p['name']} {verb} from {p['a_ms']:.1f} to {p['b_ms']:.1f} ms"


def _window_text(w: dict[str, Any]) -> str:
    out = (f"B is {abs(w['delta_ms']):.1f} ms per step {w['direction']} in steps "
           f"{w['start_step']}–{w['end_step']} ({w['steps']} steps)")
    if w["phase"] is not None:
        verb = "fell" if w["phase_b_ms"] < w["phase_a_ms"] else "rose"
        out += f": {w['phase']} {verb} from {w['phase_a_ms']:.1f} to {w['phase_b_ms']:.1f} ms there"
    return out


def verdict(step: dict[str, Any], phases: list[dict[str, Any]],
            windows: list[dict[str, Any]] | None = None) -> str:
    """One sentence: how the step changed, and the phase that moved it (or the window)."""
    drivers = _driver(phases)
    if step["change_pct"] is None:
        return "no significant difference can be stated: too few steps to compare"
    if windows and not step["significant"]:
        # A change confined to a window leaves the median alone: name the window.
        out = _window_text(windows[0])
        if len(windows) > 1:
            out += f"; {len(windows) - 1} more window(s) differ"
        return out + f"; the median step is unchanged (B {step['change_pct']:+.1f}%)"
    if not step["significant"]:
        lo, hi = step["ci_low_pct"], step["ci_high_pct"]
        ci = f", CI {lo:+.1f} to {hi:+.1f}%" if lo is not None and hi is not None else ""
        out = f"no significant difference in step time (B {step['change_pct']:+.1f}%{ci})"
        if drivers:
            out += f"; {_moved(drivers[0])}, which the step does not show"
        return out
    faster = step["change_pct"] < 0
    size = abs(step["change_pct"])
    lo, hi = sorted((abs(step["ci_low_pct"]), abs(step["ci_high_pct"])))
    out = f"B is {size:.0f}% {'faster' if faster else 'slower'} per step (CI {lo:.0f}–{hi:.0f}%)"
    tail = ""
    if windows:
        # A change confined to a window: named beside the whole-run one, never dropped, also
        # when the whole-run driver is the window's phase (a slow-data window of 30 ms moved
        # the run's dataloader median by 0.2 ms: naming only that hid where the time went).
        tail = "; and " + _window_text(windows[0])
    if not drivers:
        return out + (tail or "; no single phase changed beyond noise")
    out += f": {_moved(drivers[0])}"
    if tail:
        return out + tail
    # Others are named only when they matter next to the step's change (ms, not percent).
    floor = max(0.1, 0.1 * abs(_delta(step)))
    more = [p for p in drivers[1:] if abs(_delta(p)) >= floor]
    # Collectives are never drivers (their time is waiting on whoever is slow), but one that
    # moved beyond noise is said so, not left out: the DDP demo's grad_sync fell by 12 ms
    # with its data fix, and "the rest is within noise" read as if nothing else had moved.
    waits = _waits_moved(phases, drivers)
    if more:
        out += "; also " + ", ".join(_moved(p) for p in more[:2])
    elif len(drivers) > 1:
        own = "phase's own time" if waits else "phase"
        out += f"; every other {own} moved less than {floor:.1f} ms"
    elif not waits:
        out += "; the rest is within noise"
    if waits:
        out += "; waits on other ranks changed too: " + ", ".join(_moved(p) for p in waits[:2])
    return out


def _waits_moved(phases: list[dict[str, Any]], drivers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Significant changes of collectives (waits on other ranks) that are not drivers, largest first."""
    got = [p for p in phases if p["significant"] and is_collective(p["name"])
           and not any(p is d for d in drivers)]
    return sorted(got, key=lambda p: -abs(_delta(p)))

