"""Throughput, MFU, memory and device health across a run, and the verdicts they support.

The loader (:mod:`stepscope.analysis.load`) reads the records' optional ``throughput``,
``flops``, ``memory`` and ``device`` sections as JSON columns (:data:`RESOURCE_COLUMNS`) and
calls :func:`create_resource_table` to flatten them into one table::

    res (rank, step, tokens, samples, tokens_per_s, samples_per_s, tflops, mfu,
         peak_allocated_mb, peak_reserved_mb, allocated_mb, rss_mb, workers_rss_mb,
         alloc_retries, ooms, util_pct, sm_clock_mhz, power_w, temp_c, runq_ms)

``runq_ms`` is the training thread's run-queue wait in the step (``counters.runq_ms``,
:mod:`stepscope.instrument.sched`; CPU clock only), read by the straggler analysis.

Records marked ``"untimed": true`` (the step FLOPs were counted on) are left out of every
table by the loader (:data:`TIMED_FILTER`).

:func:`analyze_resources` fills ``run.throughput``, ``run.memory`` and ``run.device``;
:func:`resource_verdicts` turns them into ``memory_pressure``, ``memory_creep`` and
``throttled_device``. A value never measured is ``None`` (never 0).
"""

from __future__ import annotations

from typing import Any

from stepscope.analysis import cost
from stepscope.analysis.blocks import WHOLE, in_block, rank_blocks
from stepscope.analysis.relations import exists
from stepscope.analysis.verdict import Verdict
from stepscope.common.robust import median, robust_sigma

#: Extra columns for the loader's ``read_json`` (JSON: a bad value nulls one field, not the row;
#: ``device`` is a plain string in records without device-health samples).
RESOURCE_COLUMNS: dict[str, str] = {
    "throughput": "JSON",
    "flops": "JSON",
    "memory": "JSON",
    "device": "JSON",
    "untimed": "BOOLEAN",
}
#: Loader filter keeping timed records only.
TIMED_FILTER = "coalesce(untimed, false) = false"

_FIELDS: tuple[tuple[str, str], ...] = (
    ("throughput", "tokens"), ("throughput", "samples"), ("throughput", "tokens_per_s"),
    ("throughput", "samples_per_s"), ("flops", "tflops"), ("flops", "mfu"),
    ("memory", "peak_allocated_mb"), ("memory", "peak_reserved_mb"), ("memory", "allocated_mb"),
    ("memory", "rss_mb"), ("memory", "workers_rss_mb"), ("memory", "alloc_retries"),
    ("memory", "ooms"), ("device", "util_pct"), ("device", "sm_clock_mhz"),
    ("device", "power_w"), ("device", "temp_c"),
)
DEVICE_METRICS = ("sm_clock_mhz", "power_w", "temp_c", "util_pct")

#: A rank's median SM clock below this fraction of its peers' median is throttled.
CLOCK_RATIO = 0.92
#: A rank's median power below this fraction of its peers' median (with a clock at most
#: ``CLOCK_SOFT`` of theirs) is throttled. Power alone is weak evidence: a rank that waits
#: for others also draws less.
POWER_RATIO = 0.75
CLOCK_SOFT = 0.97
#: memory_creep: share of step pairs whose memory rose (of pairs that changed), and the rise
#: over the run, in robust sigmas of the residual noise and at least a floor: material growth
#: only (>= 64 MB and >= 5% of the level), so allocator and page-cache drift of a healthy run
#: (+1% RSS) is never called a leak.
CREEP_CONSISTENCY = 0.6
CREEP_SIGMAS = 8.0
CREEP_FLOOR_MB = 64.0
CREEP_FLOOR_SHARE = 0.05
#: What memory_creep judges, in the order a finding names them.
CREEP_METRICS = {"allocated_mb": "allocated GPU memory", "peak_reserved_mb": "reserved GPU memory",
                 "rss_mb": "process RSS (host memory)"}
#: Each third of the run must sit at least this share of the total rise above the one before
#: (a leak grows throughout; a one-off jump or a warm-up step does not).
CREEP_THIRDS_SHARE = 0.2
#: Points kept per rank for the O(n²) Theil–Sen fit (evenly thinned beyond this).
CREEP_MAX_POINTS = 300


def create_resource_table(con: Any, keep: str = "TRUE") -> None:
    """Flatten the JSON sections of table ``kept_records`` into ``step_resources`` (called by the
    loader, after
    it built ``steps`` from the same records: ``kept_records`` where ``keep``)."""
    sections = sorted({sec for sec, _ in _FIELDS} | {"counters"})
    if not con.execute(
            f"""SELECT count(*) FROM (SELECT 1 FROM kept_records WHERE {keep}
                AND ({' OR '.join(f'{s} IS NOT NULL' for s in sections)}) LIMIT 1)""").fetchone()[0]:
        # No record has a section (the common case): every value is NULL, and a view over
        # ``steps`` (the same records, rank and step) has the rows. The table was 10^7 rows
        # of NULLs at 10^8 phase samples, written for ~4 s CPU.
        nulls = ", ".join(f"CAST(NULL AS DOUBLE) AS {name}"
                          for name in [n for _, n in _FIELDS] + ["runq_ms"])
        con.execute(f"CREATE VIEW step_resources AS SELECT rank, step, {nulls} FROM steps")
        return
    cols = ",\n".join(
        f"TRY_CAST(json_extract_string({sec}, '$.{name}') AS DOUBLE) AS {name}" for sec, name in _FIELDS
    )
    cols += ",\nTRY_CAST(json_extract_string(counters, '$.runq_ms') AS DOUBLE) AS runq_ms"
    con.execute(
        f"""CREATE TABLE step_resources AS SELECT CAST(rank AS INTEGER) AS rank, step, {cols}
            FROM kept_records WHERE {keep}"""
    )


def _r(x: Any, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def _sig(x: Any, digits: int = 4) -> float | None:
    """Significant digits: TFLOP/s and MFU span 1e-7 (a CPU toy) to 1e3."""
    return None if x is None else float(f"{float(x):.{digits}g}")


def analyze_resources(con: Any) -> dict[str, Any]:
    """``{"throughput": ..., "memory": ..., "device": ...}`` for the report's ``run`` section."""
    if not exists(con, "step_resources"):
        return {"throughput": _empty_throughput(), "memory": _empty_memory(), "device": None}
    # One scan for which columns hold any value: a run without a section (the common case,
    # and 10^7 records at 10^8 samples) reads none of its columns again.
    names = [name for _, name in _FIELDS]
    counts = con.execute(
        f"SELECT {', '.join(f'count({n})' for n in names)} FROM step_resources").fetchone()
    present = {n for n, k in zip(names, counts, strict=True) if k}
    return {"throughput": _throughput(con, present), "memory": _memory(con, present),
            "device": _device_table(con, present)}


def _throughput(con: Any, present: set[str]) -> dict[str, Any]:
    """Job totals per step: sum over ranks; MFU of the job = achieved over summed peaks."""
    if not present & {"tokens_per_s", "samples_per_s", "tflops", "mfu"}:
        return _empty_throughput()
    t = con.execute(
        """WITH per_step AS (
               SELECT step, sum(tokens_per_s) AS tps, sum(samples_per_s) AS sps,
                      sum(tflops) AS tf, sum(tflops / mfu) FILTER (WHERE mfu > 0) AS peak,
                      count(mfu) AS n_mfu, count(tflops) AS n_tf, count(*) AS n
               FROM step_resources GROUP BY step)
           SELECT median(tps), median(sps), median(tf) FILTER (WHERE n_tf = n),
                  median(tf / peak) FILTER (WHERE n_mfu = n AND peak > 0)
           FROM per_step"""
    ).fetchone()
    return {
        "tokens_per_s": _r(t[0], 1),
        "samples_per_s": _r(t[1], 3),
        "tflops": _sig(t[2]),
        "mfu": _sig(t[3]),
    }


def _memory(con: Any, present: set[str]) -> dict[str, Any]:
    memory = _empty_memory()
    if present & {"peak_allocated_mb", "peak_reserved_mb", "allocated_mb", "rss_mb",
                  "workers_rss_mb", "alloc_retries", "ooms"}:
        m = con.execute(
            """SELECT max(peak_allocated_mb), max(peak_reserved_mb), max(allocated_mb), max(rss_mb),
                      max(workers_rss_mb), max(alloc_retries), max(ooms) FROM step_resources"""
        ).fetchone()
        memory.update({
            "peak_allocated_mb": _r(m[0], 1),
            "peak_reserved_mb": _r(m[1], 1),
            "allocated_mb": _r(m[2], 1),
            "rss_mb": _r(m[3], 1),
            "workers_rss_mb": _r(m[4], 1),
            "alloc_retries": None if m[5] is None else int(m[5]),
            "ooms": None if m[6] is None else int(m[6]),
        })
    memory["per_rank"] = _memory_per_rank(con, present)
    memory["creep"] = _creep(con, [n for n in CREEP_METRICS if n in present])
    return memory


def _empty_throughput() -> dict[str, Any]:
    return {"tokens_per_s": None, "samples_per_s": None, "tflops": None, "mfu": None}


def _empty_memory() -> dict[str, Any]:
    return {"peak_allocated_mb": None, "peak_reserved_mb": None, "allocated_mb": None,
            "rss_mb": None, "workers_rss_mb": None, "alloc_retries": None, "ooms": None,
            "per_rank": [], "creep": []}


def _memory_per_rank(con: Any, present: set[str]) -> list[dict[str, Any]]:
    """Every rank of ``step_resources``, its values ``None`` where no record measured them."""
    if not present & {"peak_allocated_mb", "rss_mb", "alloc_retries", "ooms", "tokens_per_s", "mfu"}:
        return [{"rank": int(r), "peak_allocated_mb": None, "rss_mb": None, "alloc_retries": None,
                 "ooms": None, "tokens_per_s": None, "mfu": None}
                for (r,) in con.execute("SELECT DISTINCT rank FROM step_resources ORDER BY rank").fetchall()]
    rows = con.execute(
        """SELECT rank, max(peak_allocated_mb), max(rss_mb), max(alloc_retries), max(ooms),
                  median(tokens_per_s), median(mfu)
           FROM step_resources GROUP BY rank ORDER BY rank"""
    ).fetchall()
    return [
        {"rank": int(r[0]), "peak_allocated_mb": _r(r[1], 1), "rss_mb": _r(r[2], 1),
         "alloc_retries": None if r[3] is None else int(r[3]),
         "ooms": None if r[4] is None else int(r[4]),
         "tokens_per_s": _r(r[5], 1), "mfu": _sig(r[6])}
        for r in rows
    ]


def _device_table(con: Any, present: set[str]) -> dict[str, Any] | None:
    """Per-rank min/median/max of SM clock, power, temperature, utilisation; ``None`` if unsampled."""
    if not present & set(DEVICE_METRICS):
        return None
    aggs = ", ".join(f"min({m}), median({m}), max({m}), count({m})" for m in DEVICE_METRICS)
    rows = con.execute(f"SELECT rank, {aggs} FROM step_resources GROUP BY rank ORDER BY rank").fetchall()
    per_rank = []
    for row in rows:
        entry: dict[str, Any] = {"rank": int(row[0])}
        for i, m in enumerate(DEVICE_METRICS):
            lo, mid, hi, n = row[1 + 4 * i: 5 + 4 * i]
            if n:
                entry[m] = {"min": _r(lo, 1), "median": _r(mid, 1), "max": _r(hi, 1)}
        if len(entry) > 1:
            per_rank.append(entry)
    return {"per_rank": per_rank} if per_rank else None


def theil_sen(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Theil–Sen slope (median of pairwise slopes) and the share of changing pairs that rise."""
    slopes: list[float] = []
    up = down = 0
    n = len(xs)
    for i in range(n):
        for j in range(i + 1, n):
            dx = xs[j] - xs[i]
            if dx == 0:
                continue
            dy = ys[j] - ys[i]
            slopes.append(dy / dx)
            up += dy > 0
            down += dy < 0
    if not slopes:
        return 0.0, 0.0
    return median(slopes), (up / (up + down) if up + down else 0.0)


def creep_test(steps: list[int], values: list[float], metric: str) -> dict[str, Any] | None:
    """A steady rise of ``values`` over ``steps`` (warm-up tenth left out), or ``None``.

    Robust to plateaus (values read at flush cadence repeat) and to a one-off jump: the
    Theil–Sen slope of a series that is flat but for one step stays 0.
    """
    pts = sorted(zip(steps, values, strict=True))
    skip = max(1, len(pts) // 10)
    pts = pts[skip:]
    if len(pts) < 8:
        return None
    if len(pts) > CREEP_MAX_POINTS:
        stride = len(pts) / CREEP_MAX_POINTS
        pts = [pts[int(i * stride)] for i in range(CREEP_MAX_POINTS)]
    xs = [float(s) for s, _ in pts]
    ys = [float(v) for _, v in pts]
    slope, rising = theil_sen(xs, ys)
    if slope <= 0:
        return None
    span = xs[-1] - xs[0]
    rise = slope * span
    noise = robust_sigma([y - slope * x for x, y in zip(xs, ys, strict=True)])
    level = median(ys)
    floor = max(CREEP_FLOOR_MB, CREEP_FLOOR_SHARE * level)
    if rising < CREEP_CONSISTENCY or rise < max(CREEP_SIGMAS * noise, floor):
        return None
    k = len(ys) // 3
    thirds = [median(ys[:k]), median(ys[k:2 * k]), median(ys[2 * k:])]
    if not (thirds[1] - thirds[0] >= CREEP_THIRDS_SHARE * rise
            and thirds[2] - thirds[1] >= CREEP_THIRDS_SHARE * rise):
        return None
    return {
        "metric": metric,
        "first_step": int(xs[0]),
        "last_step": int(xs[-1]),
        "start_mb": round(ys[0], 1),
        "end_mb": round(ys[-1], 1),
        "rise_mb": round(rise, 1),
        "slope_mb_per_step": round(slope, 4),
        "rising_share": round(rising, 3),
        "noise_mb": round(noise, 2),
    }


def _creep(con: Any, names: list[str]) -> list[dict[str, Any]]:
    """memory_creep findings, one per rank: every metric that grew (allocated, reserved, RSS).

    ``names``: the metrics of :data:`CREEP_METRICS` that some record measured (none: no
    series read). ``metric`` is the first that grew in their order; ``grew`` lists them all.
    """
    out: list[dict[str, Any]] = []
    if not names:
        return out
    # A block of ranks at a time: every record's row as Python tuples at once was ~0.85 GB
    # at 10^7 records (4,096 ranks x 2,500 steps), the report's peak.
    # The blocks cover every rank, also one with resource rows but no analysed step.
    ends = [b[1] for b in rank_blocks(con)]
    ends[-1] = WHOLE[1]
    for lo, hi in zip([WHOLE[0]] + [e + 1 for e in ends[:-1]], ends, strict=True):
        out += _creep_block(con, names, (lo, hi))
    return out


def _creep_block(con: Any, names: list[str], block: tuple[int, int]) -> list[dict[str, Any]]:
    out = []
    rows = con.execute(
        f"SELECT rank, step, {', '.join(names)} FROM step_resources WHERE {in_block('rank', block)} "
        "ORDER BY rank, step"
    ).fetchall()
    by_rank: dict[int, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_rank.setdefault(int(row[0]), []).append(row[1:])
    for rank, series in by_rank.items():
        grew = []
        for k, metric in enumerate(names, start=1):
            pts = [(int(row[0]), float(row[k])) for row in series if row[k] is not None]
            if len(pts) >= 8:
                found = creep_test([p[0] for p in pts], [p[1] for p in pts], metric)
                if found:
                    grew.append(found)
        if grew:
            out.append({"rank": rank, **grew[0],
                        "grew": [{k: g[k] for k in ("metric", "start_mb", "end_mb", "rise_mb")}
                                 for g in grew]})
    return out


# --------------------------------------------------------------------- verdicts


def resource_verdicts(run: dict[str, Any], stragglers: list[dict[str, Any]],
                      found: list[Verdict] | None = None) -> list[Verdict]:
    """``memory_pressure``, ``memory_creep`` and ``throttled_device`` verdicts (possibly none).

    Memory findings cost no step time (their price is a crash risk) and keep their own
    severity; a throttled device is priced as the straggler it causes, if any.
    """
    out: list[Verdict] = []
    job = run.get("cost") or {}
    mem = run.get("memory") or {}
    pressed = [r for r in mem.get("per_rank", [])
               if (r.get("alloc_retries") or 0) > 0 or (r.get("ooms") or 0) > 0]
    if pressed:
        ooms = sum(r.get("ooms") or 0 for r in pressed)
        ev = "; ".join(
            f"rank {r['rank']}: {r.get('alloc_retries') or 0} allocator retries, {r.get('ooms') or 0} "
            f"OOMs, peak allocated {r.get('peak_allocated_mb')} MB" for r in pressed[:8]
        )
        out.append(Verdict(
            kind="memory_pressure",
            severity="critical" if ooms else "warning", cost=cost.no_cost(job),
            subject="allocator retries",
            evidence=f"the CUDA caching allocator had to free its cache and retry (cudaMalloc "
            f"failed) — {ev}. Each retry synchronises the device and fragments memory",
            suggestion="Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to cut "
            "fragmentation; lower the micro-batch size (with gradient accumulation), use "
            "activation checkpointing, or free references to large tensors earlier",
        ))
    for c in mem.get("creep", []):
        what = CREEP_METRICS.get(c["metric"], c["metric"])
        also = [f"{CREEP_METRICS.get(g['metric'], g['metric'])} +{g['rise_mb']} MB"
                for g in c.get("grew", [])[1:]]
        out.append(Verdict(
            kind="memory_creep",
            # No step time lost (yet): the price is an OOM later, so a warning by its own rule.
            severity="warning", cost=cost.no_cost(job),
            subject=f"rank {c['rank']}'s {what}",
            evidence=f"rank {c['rank']}: {what} rose steadily from {c['start_mb']} MB to "
            f"{c['end_mb']} MB over steps {c['first_step']}–{c['last_step']} (Theil–Sen slope "
            f"{c['slope_mb_per_step']} MB/step, +{c['rise_mb']} MB; memory rose in "
            f"{100 * c['rising_share']:.0f}% of step pairs that changed, and in every third of "
            f"the run)" + (f"; also grew: {', '.join(also)}" if also else ""),
            suggestion="Something keeps a reference every step — a leak: e.g. losses or "
            "outputs kept for logging without .detach()/.item(), growing lists or caches, "
            "hooks storing activations. Store .item() or .detach().cpu() values and clear them",
        ))
    out += _throttle_verdicts(run, stragglers, found or [])
    return out


def _throttle_verdicts(run: dict[str, Any], stragglers: list[dict[str, Any]],
                       found: list[Verdict]) -> list[Verdict]:
    dev = run.get("device") or {}
    per_rank = dev.get("per_rank") or []
    if len(per_rank) < 2:
        return []
    slow = {s["rank"]: s for s in stragglers}
    med = {m: {r["rank"]: r[m]["median"] for r in per_rank if m in r} for m in DEVICE_METRICS}
    out: list[Verdict] = []
    for entry in per_rank:
        rank = entry["rank"]
        reasons = []
        ratio: dict[str, float] = {}
        for m in ("sm_clock_mhz", "power_w"):
            peers = [v for r, v in med[m].items() if r != rank and v is not None]
            mine = med[m].get(rank)
            if mine is None or not peers or median(peers) <= 0:
                continue
            ratio[m] = mine / median(peers)
        job = run.get("cost") or {}
        clock = ratio.get("sm_clock_mhz")
        power = ratio.get("power_w")
        if clock is not None and clock < CLOCK_RATIO:
            reasons.append(f"SM clock median {med['sm_clock_mhz'][rank]:.0f} MHz vs "
                           f"{median([v for r, v in med['sm_clock_mhz'].items() if r != rank]):.0f} MHz on "
                           f"its peers ({100 * clock:.0f}%)")
        if power is not None and power < POWER_RATIO and (clock is None or clock < CLOCK_SOFT):
            reasons.append(f"power median {med['power_w'][rank]:.0f} W vs "
                           f"{median([v for r, v in med['power_w'].items() if r != rank]):.0f} W on its "
                           f"peers ({100 * power:.0f}%)")
        if not reasons:
            continue
        temp = entry.get("temp_c")
        ev = f"rank {rank}: " + "; ".join(reasons)
        if temp:
            ev += f"; temperature {temp['min']}–{temp['max']} °C"
        s = slow.get(rank)
        if s:
            ev += (f"; it is also the straggler in {s['phase']} (+{s['excess_ms']:.1f} ms per step), "
                   "so the slow clock explains it")
        priced = [v.cost for v in found if v.kind == "straggler" and v.cost is not None
                  and (v.subject or "").startswith(f"rank {rank} ")]
        c = priced[0] if priced else cost.no_cost(job)
        out.append(Verdict(
            kind="throttled_device",
            # Slow with nobody waiting for it costs no step time: a note, not an alarm.
            severity=cost.severity(cost.share(c)), cost=c,
            subject=f"rank {rank}'s device",
            evidence=ev,
            suggestion=f"Check rank {rank}'s GPU: nvidia-smi -q -d PERFORMANCE shows the "
            "throttle reason (thermal, power cap, HW slowdown); check cooling and airflow, the "
            "power limit (nvidia-smi -q -d POWER) and application clocks; move the job off it",
        ))
    return out
