"""Cross-rank alignment, wait estimation and straggler/slow-window detection.

Under DDP the gradient all-reduce runs inside ``backward``, so the collective's end is
(nearly) simultaneous on every rank while its *arrival* is not: the rank that arrives last
made the others wait, and their wait shows up as a long backward. Per step we place every
rank's phases on one aligned timeline, take the last arrival at the synchronising phase,
and estimate each rank's wait as its arrival gap (capped by the time it spent there). A
rank's *own* work in a phase is its time there minus that wait. The straggler is the rank
whose own work in some phase exceeds the cross-rank median by more than the noise (MAD),
over a run of steps; the phase with the excess is where to look.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from stepscope.analysis.stats import RESIDUAL

#: A phase nested in the sync phase with one of these names times the collective itself;
#: its start is then the rank's arrival (it separates own backward compute from waiting).
_COMM_NAME = re.compile(r"all_?reduce|allgather|reduce_scatter|collective|comm|grad_sync|sync|wait",
                        re.IGNORECASE)

#: Thresholds are in robust sigmas (1.4826 * MAD) of cross-rank excess, floored so that
#: near-noiseless runs do not flag microseconds.
SIGMAS = 5.0
FLOOR_MS = 0.25
FLOOR_FRAC = 0.02
MIN_SEGMENT = 5  # flagged steps needed before a rank is called a straggler
MAX_GAP = 2  # unflagged samples tolerated inside one segment
CHRONIC_COVER = 0.8  # a segment spanning this fraction of analysed steps is chronic
CHRONIC_DENSITY = 0.5  # flagged share of a segment's span (or of the run) for it to count


@dataclass
class Alignment:
    """How ranks were put on one timeline and where they synchronise."""

    sync_phase: str | None
    arrival: str | None  # phase whose start is the arrival at the collective
    aligned: bool
    method: str
    offsets_ms: dict[str, float] = field(default_factory=dict)
    end_spread_ms: float | None = None


def _candidates(con: Any, n_ranks: int) -> list[str]:
    rows = con.execute(
        f"""SELECT name FROM phases WHERE parent IS NULL GROUP BY name
            HAVING count(DISTINCT rank) = {n_ranks}"""
    ).fetchall()
    return [r[0] for r in rows]


def align(con: Any, hosts: dict[str, list[int]], n_ranks: int, median_step: float) -> Alignment:
    """Pick the synchronising phase, estimate per-host clock offsets, build table ``st``.

    ``st`` (rank, step, host, t, step_ms) has ``t`` = step start on the aligned timeline.
    """
    cands = _candidates(con, n_ranks) if n_ranks > 1 else []
    multi_host = len(hosts) > 1
    shared = any(len(rs) > 1 for rs in hosts.values())
    spreads: dict[str, float] = {}
    if cands and shared:
        # Clocks on one host are directly comparable: measure end alignment there only.
        names = ", ".join("'" + c.replace("'", "''") + "'" for c in cands)
        for name, spread in con.execute(
            f"""SELECT name, median(spread) FROM (
                    SELECT p.name, p.step, s.host, max(s.t0 + p.e) - min(s.t0 + p.e) AS spread
                    FROM phases p JOIN steps s USING (rank, step)
                    WHERE p.parent IS NULL AND p.name IN ({names})
                    GROUP BY 1, 2, 3 HAVING count(*) > 1) GROUP BY 1"""
        ).fetchall():
            spreads[name] = float(spread)
    sync: str | None = None
    if spreads:
        best = min(spreads, key=lambda n: spreads[n])
        sync = best
        if "backward" in spreads and spreads["backward"] <= 1.5 * spreads[best] + 0.2:
            sync = "backward"
        # Scheduling jitter spreads even a real collective's end by a few ms (a rank wakes
        # late from the wait), so the bar is loose; ranks that never synchronise drift apart
        # by far more than half a step.
        tol = max(1.0, 0.5 * median_step)
        if spreads[sync] > tol:
            sync = None
    elif "backward" in cands:
        # One rank per host: alignment cannot be measured before offsets are known, so
        # trust the DDP convention that the collective ends backward.
        sync = "backward"

    offsets: dict[str, float] = {h: 0.0 for h in hosts}
    method = "single host: start_unix_ns compared directly" if not multi_host else ""
    if multi_host and sync is not None:
        rows = con.execute(
            f"""WITH ends AS (
                    SELECT s.host, p.step, s.t0 + p.e AS end_t FROM phases p
                    JOIN steps s USING (rank, step)
                    WHERE p.name = '{sync}' AND p.parent IS NULL),
                med AS (SELECT step, median(end_t) AS m FROM ends GROUP BY 1)
                SELECT host, median(end_t - m) FROM ends JOIN med USING (step) GROUP BY 1"""
        ).fetchall()
        offsets = {str(h): float(o) for h, o in rows}
        method = (f"{len(hosts)} hosts: per-host clock offsets estimated from the common end "
                  f"of '{sync}' (median over steps)")
    elif multi_host:
        method = (f"{len(hosts)} hosts and no synchronising phase: clocks compared as "
                  "recorded (offsets unknown)")
    con.execute("CREATE OR REPLACE TABLE hoff (host VARCHAR, off DOUBLE)")
    if offsets:
        con.executemany("INSERT INTO hoff VALUES (?, ?)", list(offsets.items()))
    con.execute(
        """CREATE OR REPLACE TABLE st AS
           SELECT s.rank, s.step, s.host, s.t0 - coalesce(h.off, 0.0) AS t, s.step_ms
           FROM steps s LEFT JOIN hoff h USING (host)"""
    )
    arrival = sync
    if sync is not None:
        child = con.execute(
            f"""SELECT name FROM phases WHERE parent = '{sync}' GROUP BY name
                HAVING count(DISTINCT rank) = {n_ranks} ORDER BY count(*) DESC"""
        ).fetchall()
        for (name,) in child:
            if _COMM_NAME.search(name):
                arrival = name
                break
    spread = spreads.get(sync) if sync else None
    return Alignment(sync, arrival, sync is not None, method, offsets, spread)


def build_wait(con: Any, al: Alignment) -> None:
    """Table ``wait`` (rank, step, wait_ms): time a rank spent waiting for the last arrival."""
    if al.sync_phase is None:
        con.execute(
            "CREATE OR REPLACE TABLE wait AS SELECT rank, step, CAST(0 AS DOUBLE) AS wait_ms FROM st"
        )
        return
    parent = "p.parent IS NULL" if al.arrival == al.sync_phase else f"p.parent = '{al.sync_phase}'"
    con.execute(
        f"""CREATE OR REPLACE TABLE arr AS
            SELECT st.rank, st.step, st.t + p.s AS a, p.e - p.s AS dur
            FROM st JOIN phases p USING (rank, step)
            WHERE p.name = '{al.arrival}' AND {parent}"""
    )
    con.execute(
        """CREATE OR REPLACE TABLE wait AS
           WITH last AS (SELECT step, max(a) AS l FROM arr GROUP BY 1)
           SELECT st.rank, st.step,
                  CAST(coalesce(least(greatest(last.l - arr.a, 0.0), greatest(arr.dur, 0.0)), 0.0) AS DOUBLE)
                      AS wait_ms
           FROM st LEFT JOIN arr USING (rank, step) LEFT JOIN last USING (step)"""
    )
    con.execute("DROP TABLE arr")


def build_excess(con: Any, al: Alignment) -> dict[str, float]:
    """Table ``ex`` (rank, step, name, own, excess); returns the flag threshold per phase.

    Own work is the phase time minus the wait when the phase is the synchronising one;
    excess is own work minus the cross-rank median at that step.
    """
    sync = al.sync_phase or ""
    con.execute(
        f"""CREATE OR REPLACE TABLE own AS
            SELECT p.rank, p.step, p.name,
                   CASE WHEN p.name = '{sync}' THEN greatest(p.ms - w.wait_ms, 0.0)
                        ELSE p.ms END AS own
            FROM phases p JOIN wait w USING (rank, step) WHERE p.parent IS NULL
            UNION ALL SELECT rank, step, '{RESIDUAL}', residual_ms FROM steps"""
    )
    con.execute(
        """CREATE OR REPLACE TABLE ex AS
           WITH med AS (SELECT step, name, median(own) AS m FROM own GROUP BY 1, 2)
           SELECT o.rank, o.step, o.name, o.own, o.own - med.m AS excess
           FROM own o JOIN med USING (step, name)"""
    )
    con.execute("DROP TABLE own")
    med_step = con.execute("SELECT median(step_ms) FROM steps").fetchone()[0] or 0.0
    floor = max(FLOOR_MS, FLOOR_FRAC * med_step)
    thr = {
        name: max(SIGMAS * 1.4826 * float(mad or 0.0), floor)
        for name, mad in con.execute("SELECT name, median(abs(excess)) FROM ex GROUP BY 1").fetchall()
    }
    con.execute("CREATE OR REPLACE TABLE thr (name VARCHAR, thr DOUBLE)")
    con.executemany("INSERT INTO thr VALUES (?, ?)", list(thr.items()))
    return thr


def _segments(idx: list[int], max_gap: int = MAX_GAP) -> list[list[int]]:
    """Group sorted sample indices into runs whose gaps are at most ``max_gap`` samples."""
    out: list[list[int]] = []
    for i in idx:
        if out and i - out[-1][-1] <= max_gap + 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _confidence(n: int, density: float, ratio: float) -> float:
    # More flagged steps, denser runs and excess further above the threshold all raise it.
    c = float((1.0 - 0.5 ** (n / 3.0)) * min(1.0, density) * min(1.0, ratio / 3.0))
    return round(min(0.99, max(0.0, c)), 2)


def find_stragglers(
    con: Any, steps: list[int], host_of: dict[int, str], thr: dict[str, float]
) -> list[dict[str, Any]]:
    """Ranks whose own work in a phase exceeds the median over a run of steps."""
    pos = {s: i for i, s in enumerate(steps)}
    flagged: dict[tuple[int, str], list[tuple[int, float]]] = {}
    for rank, name, step, excess in con.execute(
        """SELECT ex.rank, ex.name, ex.step, ex.excess FROM ex JOIN thr USING (name)
           WHERE ex.excess > thr.thr ORDER BY 1, 2, 3"""
    ).fetchall():
        flagged.setdefault((int(rank), str(name)), []).append((pos[int(step)], float(excess)))
    n_steps = len(steps)
    min_n = max(MIN_SEGMENT, math.ceil(0.04 * n_steps))
    out: list[dict[str, Any]] = []
    for (rank, name), hits in flagged.items():
        excess_at = dict(hits)
        idx = [i for i, _ in hits]
        segments = _segments(idx)
        if len(idx) >= CHRONIC_DENSITY * n_steps and idx[-1] - idx[0] + 1 >= CHRONIC_COVER * n_steps:
            # Flagged on most steps across the run but with noise-sized holes: one chronic
            # straggler, not a string of windows.
            segments = [idx]
        for seg in segments:
            span = seg[-1] - seg[0] + 1
            density = len(seg) / span
            if len(seg) < min_n or density < CHRONIC_DENSITY:
                continue
            ex = sorted(excess_at[i] for i in seg)
            med = ex[len(ex) // 2] if len(ex) % 2 else 0.5 * (ex[len(ex) // 2 - 1] + ex[len(ex) // 2])
            chronic = span >= CHRONIC_COVER * n_steps
            out.append(
                {
                    "rank": rank,
                    "host": host_of.get(rank),
                    "phase": name,
                    "excess_ms": round(med, 3),
                    "steps": len(seg),
                    "first_step": steps[seg[0]],
                    "last_step": steps[seg[-1]],
                    "persistence": "chronic" if chronic else "window",
                    "confidence": _confidence(len(seg), density, med / thr[name]),
                }
            )
    out.sort(key=lambda s: -s["excess_ms"] * s["steps"])
    return out


def find_windows(
    con: Any, steps: list[int], stragglers: list[dict[str, Any]], all_ranks: list[int]
) -> list[dict[str, Any]]:
    """Runs of steps whose step time stands out from the run's median (robustly)."""
    rows = con.execute("SELECT step, max(step_ms) FROM steps GROUP BY 1 ORDER BY 1").fetchall()
    if len(rows) < 2 * MIN_SEGMENT:
        return []
    wall = [float(v) for _, v in rows]
    srt = sorted(wall)
    med = srt[len(srt) // 2]
    mad = sorted(abs(v - med) for v in wall)[len(wall) // 2]
    thr = max(SIGMAS * 1.4826 * mad, max(FLOOR_MS, 0.03 * med))
    pos = {s: i for i, s in enumerate(steps)}
    idx = [pos[int(s)] for (s, _), v in zip(rows, wall, strict=True) if v > med + thr]
    out: list[dict[str, Any]] = []
    covered: set[tuple[int, int]] = set()
    for seg in _segments(idx):
        span = seg[-1] - seg[0] + 1
        if len(seg) < MIN_SEGMENT or len(seg) / span < 0.5 or span >= CHRONIC_COVER * len(steps):
            continue
        first, last = steps[seg[0]], steps[seg[-1]]
        inside = [wall[i] for i in range(seg[0], seg[-1] + 1)]
        slowdown = sorted(inside)[len(inside) // 2] / med if med else 1.0
        hits = [s for s in stragglers if s["first_step"] <= last and s["last_step"] >= first]
        if hits:
            ranks = sorted({s["rank"] for s in hits})
            phase = max(hits, key=lambda s: s["excess_ms"] * s["steps"])["phase"]
            covered.update((s["rank"], s["first_step"]) for s in hits)
        else:
            ranks, phase = list(all_ranks), _window_phase(con, first, last)
        out.append({"start_step": first, "end_step": last, "ranks": ranks, "phase": phase,
                    "slowdown": round(slowdown, 3)})
    # A windowed straggler that did not slow the whole step (no collective) is a window too.
    for s in stragglers:
        if s["persistence"] != "window" or (s["rank"], s["first_step"]) in covered:
            continue
        r = con.execute(
            f"""SELECT median(step_ms) FILTER (WHERE step BETWEEN {s['first_step']}
                       AND {s['last_step']}), median(step_ms) FROM steps WHERE rank = {s['rank']}"""
        ).fetchone()
        slowdown = (r[0] / r[1]) if r[0] and r[1] else 1.0
        if slowdown <= 1.0:
            continue
        out.append({"start_step": s["first_step"], "end_step": s["last_step"],
                    "ranks": [s["rank"]], "phase": s["phase"], "slowdown": round(slowdown, 3)})
    out.sort(key=lambda w: w["start_step"])
    return out


def _window_phase(con: Any, first: int, last: int) -> str:
    """The phase whose median own time grew most inside the window."""
    row = con.execute(
        f"""SELECT name, median(own) FILTER (WHERE step BETWEEN {first} AND {last})
                       - median(own) AS grow
            FROM ex GROUP BY 1 ORDER BY grow DESC NULLS LAST LIMIT 1"""
    ).fetchone()
    return str(row[0]) if row else "step"
