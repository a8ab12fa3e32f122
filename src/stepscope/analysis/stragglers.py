"""Who waited, who made them wait, and where the culprit spent its extra time.

Waits come from the one rule in :mod:`stepscope.common.waits`: a synchronising collective
ends together on every rank of its group, so a rank's time in it beyond the shortest is time
spent waiting for the last arrival. Collectives are the records' ``collectives`` sections
(schema 2) plus every ``grad_sync`` phase (DDP's bucketed all-reduce, issued from C++: op
``ddp_allreduce``, group ``ddp``, in the grad_sync's parent phase). No clocks are compared
across ranks. Matching is per (step, phase path, op, group): the summed time of the matched
calls on each rank. A partition counts only when every rank of the group recorded it with the
same number of calls; partial or mismatched partitions contribute no wait (stated in the
report's ``skipped`` list), so a missing rank or a skipped call can under-state waits, never
invent them.

A rank's *own* work in phase P is P's time minus the waits of collectives inside P at any
depth (so a ``dataloader`` that gathers across ranks is split into data time and wait);
untimed ``residual`` time gets the waits of collectives outside any phase. A rank is a
straggler in P when its own work exceeds the median of the *other* ranks' own work at the
same step by more than its noise (robust sigmas of the successive differences of that gap,
so a level shift or a slow window does not inflate it), floored: *chronic* when flagged
(``SIGMAS`` sigmas) on most steps across the run, *window* when change-point detection on
the gap series finds a stretch whose level sits ``WINDOW_SIGMAS`` sigmas above the level
outside it (:mod:`stepscope.analysis.changepoint`). ``excess_ms`` is the median gap over
the chronic straggler's flagged steps, or the window's level over the level outside it.

Only when a run carries no collective timing at all does the old timeline estimate (arrival
gaps at the synchronising phase, clocks compared) stand in, and the report says so.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepscope.analysis import changepoint, grouped
from stepscope.analysis.own import OwnColumns, build_own
from stepscope.analysis.pipeline import IS_P2P, build_p2p_waits
from stepscope.analysis.stats import RESIDUAL, phase_order
from stepscope.common import robust
from stepscope.common.waits import sql_wait

#: A phase nested in the sync phase with one of these names times the collective itself;
#: its start is then the rank's arrival (timeline fallback only).
_COMM_NAME = re.compile(r"all_?reduce|allgather|reduce_scatter|collective|comm|grad_sync|sync|wait",
                        re.IGNORECASE)

GRAD_SYNC = "grad_sync"
DDP_OP = "ddp_allreduce"
DDP_PG = "ddp"

#: Flag threshold: SIGMAS robust sigmas of the rank's own step-to-step variation, floored so
#: near-noiseless data does not flag microseconds.
SIGMAS = robust.SIGMAS
FLOOR_MS = 0.25
FLOOR_FRAC = 0.02  # of the median step
MIN_SEGMENT = 5  # flagged steps needed before a rank is called a straggler
CHRONIC_COVER = 0.8  # a segment spanning this fraction of analysed steps is chronic
CHRONIC_DENSITY = 0.5  # flagged share of a segment's span (or of the run) for it to count
#: Smallest excess worth naming, as a share of the median step: a rank a few percent slower
#: for a while is what a shared host does; a chronic gap needs less evidence than a window.
CHRONIC_IMPACT = 0.05
WINDOW_IMPACT = 0.10
#: And in absolute terms: below this no straggler is named, whatever the step length
#: (sub-millisecond gaps on short steps are scheduler noise on a shared host).
MIN_EXCESS_MS = 1.0
#: Shortest all-rank step-time window, as a share of the analysed steps.
ALL_RANK_MIN_SHARE = 0.10
#: Share of a window's steps whose gap must reach half its level (a sustained slowdown).
SUSTAINED = 0.75
#: Bar for a change-point window's level, in the rank's noise sigmas.
WINDOW_SIGMAS = 2.5
VICTIM_FRACTION = 0.5  # a victim's wait exceeds the culprit's by this share of the excess

#: Bus-bandwidth factors (NCCL-tests convention), by op, for a group of n ranks.
_BUS_FACTOR: dict[str, Any] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "allreduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}

WAIT_RULE = ("wait = time in a matched collective minus the shortest time any rank of its group "
             "spent in it (per step, phase, op, group); own work = phase time minus the waits "
             "inside it")


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
        # One statement: executemany runs one INSERT per host (seconds at 10^3 hosts).
        con.execute("INSERT INTO hoff SELECT unnest(?::VARCHAR[]), unnest(?::DOUBLE[])",
                    [list(offsets), list(offsets.values())])
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


def _timeline_wait(con: Any, al: Alignment) -> None:
    """Table ``tw`` (rank, step, wait_ms): arrival gaps on the aligned timeline.

    Only a fallback for records without any collective timing (no ``collectives`` section,
    no ``grad_sync`` phase): it compares clocks across ranks, which the wait rule never does.
    """
    if al.sync_phase is None:
        con.execute(
            "CREATE OR REPLACE TABLE tw AS SELECT rank, step, CAST(0 AS DOUBLE) AS wait_ms FROM st"
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
        """CREATE OR REPLACE TABLE tw AS
           WITH last AS (SELECT step, max(a) AS l FROM arr GROUP BY 1)
           SELECT st.rank, st.step,
                  CAST(coalesce(least(greatest(last.l - arr.a, 0.0), greatest(arr.dur, 0.0)), 0.0) AS DOUBLE)
                      AS wait_ms
           FROM st LEFT JOIN arr USING (rank, step) LEFT JOIN last USING (step)"""
    )
    con.execute("DROP TABLE arr")




@dataclass
class Attribution:
    """Everything the wait/straggler analysis adds to the report."""

    alignment: Alignment
    source: str  # "collectives", "grad_sync", "timeline" or "none"
    thresholds: dict[str, float]
    stragglers: list[dict[str, Any]]
    windows: list[dict[str, Any]]
    collectives: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    warmup: dict[str, Any] | None = None
    #: Would-be stragglers explained by the rank's extra run-queue wait (host contention).
    contention: list[dict[str, Any]] = field(default_factory=list)


def _q(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def build_waits(con: Any, n_ranks: int, al: Alignment,
                info: list[str] | None = None) -> tuple[str, list[str]]:
    """Tables ``cw`` (one row per rank, step, phase, op, pg with its ``wait``) and ``wait``.

    ``wait`` (rank, step, wait_ms) is each rank's total wait per step. Returns the wait
    source and notes on partitions that could not be matched.
    """
    con.execute(
        f"""CREATE OR REPLACE TABLE call AS
            SELECT rank, step, phase, op, pg, max(pg_size) AS pg_size, sum(count) AS count,
                   sum(bytes) AS bytes, sum(ms) AS ms, min(seq_first) AS seq_first,
                   max(seq_last) AS seq_last
            FROM (SELECT rank, step, phase, op, pg, coalesce(pg_size, {n_ranks}) AS pg_size,
                         count, bytes, ms, seq_first, seq_last FROM colls
                  UNION ALL
                  SELECT rank, step, parent, '{DDP_OP}', '{DDP_PG}', {n_ranks}, calls, NULL, ms,
                         NULL, NULL FROM phases WHERE name = '{GRAD_SYNC}')
            GROUP BY 1, 2, 3, 4, 5"""
    )
    notes: list[str] = []
    n_calls, n_coll = con.execute(
        f"SELECT count(*), count(*) FILTER (WHERE op <> '{DDP_OP}') FROM call").fetchone()
    # A group is expected on as many ranks as its size, capped by the ranks that ever
    # recorded it (a rank file or a rank's collective timing may be missing).
    con.execute(
        """CREATE OR REPLACE TABLE cexp AS
           SELECT pg, least(max(pg_size), count(DISTINCT rank)) AS n, max(pg_size) AS size,
                  count(DISTINCT rank) AS seen FROM call GROUP BY 1"""
    )
    for pg, size, seen in con.execute(
        "SELECT pg, size, seen FROM cexp WHERE seen < size ORDER BY 1").fetchall():
        if pg == DDP_PG and seen == n_ranks:
            continue
        notes.append(
            f"collectives of group {pg!r} (size {size}) recorded on {seen} rank(s) only: waits "
            "are computed among those (under-stated if a missing rank was the late one)")
    part = "step, coalesce(phase, ''), op, pg"
    con.execute(
        f"""CREATE OR REPLACE TABLE cm AS
            SELECT c.*, count(*) OVER w = e.n AND min(c.count) OVER w = max(c.count) OVER w
                        AS matched,
                   min(c.seq_first) OVER w IS DISTINCT FROM max(c.seq_first) OVER w AS seq_shift
            FROM call c JOIN cexp e USING (pg) WHERE NOT c.{IS_P2P}
            WINDOW w AS (PARTITION BY {part})"""
    )
    build_p2p_waits(con)  # point-to-point links: their two ends, not the group
    con.execute(
        f"""CREATE OR REPLACE TABLE cw AS
            SELECT *, {sql_wait('ms', part)} AS wait FROM cm WHERE matched
            UNION ALL SELECT *, CAST(0.0 AS DOUBLE) AS wait FROM cm WHERE NOT matched
            UNION ALL BY NAME SELECT * FROM p2pw"""
    )
    con.execute("DROP TABLE p2pw")
    con.execute("DROP TABLE cm")
    bad = con.execute(
        """SELECT count(*), count(DISTINCT step), string_agg(DISTINCT op || '@' || pg, ', ')
            FROM (SELECT DISTINCT step, phase, op, pg FROM cw WHERE NOT matched)"""
    ).fetchone()
    if bad[0]:
        notes.append(
            f"{bad[0]} collective group(s) on {bad[1]} step(s) ({bad[2]}) were not recorded on "
            "every rank of their group or with different call counts (a rank skipped or added "
            "a call): their time is not counted as waiting")
    shifted = con.execute("SELECT count(DISTINCT step) FROM cw WHERE matched AND seq_shift").fetchone()[0]
    if shifted:
        notes.append(
            f"collective sequence numbers differ across ranks on {shifted} step(s) (a rank "
            "issued extra or fewer calls earlier); calls were matched by step and phase")
    source = "collectives" if n_coll else "grad_sync" if n_calls else "none"
    if info is None:
        info = []
    n_gs, n_bw = con.execute(
        f"""SELECT count(*) FILTER (WHERE op = '{DDP_OP}'),
                   count(*) FILTER (WHERE phase = 'backward' OR starts_with(phase, 'backward/'))
            FROM call"""
    ).fetchone()
    if n_calls and not n_gs and not n_bw and n_ranks > 1 and al.sync_phase == "backward":
        # Collectives recorded elsewhere, but none in backward and no grad_sync phase
        # (e.g. Lightning's callback): DDP's all-reduce still ends backward, unseen. Its
        # wait comes from arrival gaps on the aligned timeline, as for records without
        # collective timing.
        _timeline_wait(con, al)
        con.execute(
            f"""INSERT INTO cw (rank, step, phase, op, pg, pg_size, count, ms, matched,
                                seq_shift, wait)
                SELECT rank, step, 'backward', 'arrival_gap', 'timeline', {n_ranks}, 1,
                       wait_ms, TRUE, FALSE, wait_ms FROM tw"""
        )
        con.execute("DROP TABLE tw")
        source = "collectives+timeline"
        info.append("no grad_sync phase: DDP's all-reduce wait in backward is estimated from "
                    "arrival gaps on the aligned timeline (clocks compared across ranks)")
    if not n_calls and n_ranks > 1 and al.sync_phase is not None:
        # No collective timing at all: fall back to arrival gaps on the aligned timeline.
        _timeline_wait(con, al)
        con.execute(
            f"""INSERT INTO cw (rank, step, phase, op, pg, pg_size, count, ms, matched,
                                seq_shift, wait)
                SELECT rank, step, {_q(al.sync_phase)}, 'arrival_gap', 'timeline', {n_ranks}, 1,
                       wait_ms, TRUE, FALSE, wait_ms FROM tw"""
        )
        con.execute("DROP TABLE tw")
        source = "timeline"
    con.execute(
        """CREATE OR REPLACE TABLE wait AS
           SELECT s.rank, s.step, CAST(coalesce(sum(c.wait), 0.0) AS DOUBLE) AS wait_ms
           FROM steps s LEFT JOIN cw c USING (rank, step) GROUP BY 1, 2"""
    )
    return source, notes


def build_thresholds(con: Any, median_step: float,
                     series: Series | None = None) -> dict[tuple[int, str], float]:
    """Flag threshold per (rank, phase): the rank's own noise in its gap to the others.

    Noise is the robust sigma of successive differences of the gap (divided by sqrt 2), so
    a level shift or a window of slow steps does not inflate it; floored. ``series``: the
    gap series of table ``ex`` (:func:`_series`) when already read.
    """
    if series is None:
        steps = [int(s) for (s,) in con.execute("SELECT DISTINCT step FROM ex ORDER BY 1").fetchall()]
        series = _series(con, steps)
    return _thresholds(series, median_step)


def _confidence(n: int, density: float, ratio: float) -> float:
    # More flagged steps, denser runs and excess further above the threshold all raise it.
    c = float((1.0 - 0.5 ** (n / 3.0)) * min(1.0, density) * min(1.0, ratio / 3.0))
    return round(min(0.99, max(0.0, c)), 2)


def noise_floor(own: dict[int, list[float]], rank: int, width: int) -> float:
    """How far the *other* ranks' own work rises by itself over a stretch of ``width`` steps.

    The highest median of ``width`` consecutive own-work values of each other rank, minus
    that rank's median; the largest over the other ranks. On a busy host every rank gets
    descheduled now and then, a few steps at a time, and warm-up slows them all: an excess
    no larger than what another rank shows on its own, over as many steps, is that noise.
    """
    rises = []
    for r, xs in own.items():
        if r == rank or len(xs) < width:
            continue
        rises.append(changepoint.rolling_max_median(xs, width) - robust.median(xs))
    return max(rises, default=0.0)


def window_excess(gap: list[float], own: list[float], start: int, end: int, level: float) -> float:
    """A window's excess from two estimates that bracket it.

    The gap estimate (the smaller of ``level``, the gap's level inside over its level
    outside, and the median gap inside) is the excess itself when the host slows every
    rank alike, but over-states it when the other ranks run faster while the straggler holds
    them (on a busy host its idle time gives them the cores: seen at +3..6 ms on a 30 ms
    window). The rank's own rise (its own work inside over its own work outside) over-states
    it when the host slows every rank, and under-states it when the straggler's own work,
    too, speeds up. When the own rise is the lower one, the other ranks sped up and the truth
    lies between the two: their midpoint. Otherwise the gap.
    """
    gap_level = min(level, robust.median(gap[start:end + 1]))
    own_out = own[:start] + own[end + 1:]
    if len(own_out) < MIN_SEGMENT:
        return gap_level
    rise = robust.median(own[start:end + 1]) - robust.median(own_out)
    return gap_level if rise >= gap_level else 0.5 * (gap_level + max(rise, 0.0))


def find_stragglers(
    con: Any, steps: list[int], host_of: dict[int, str], thr: dict[tuple[int, str], float],
    median_step: float = 0.0, contention: list[dict[str, Any]] | None = None,
    series: Series | None = None,
) -> list[dict[str, Any]]:
    """Ranks whose own work in a phase exceeds the other ranks' median over a run of steps.

    Chronic: flagged (gap above the rank's threshold) on most steps across the run. Window:
    a stretch found by change-point detection on the rank's gap series
    (:func:`stepscope.analysis.changepoint.elevated`), with its whole bounds and its excess
    from :func:`window_excess`. A window must exceed the run's noise floor
    (:func:`noise_floor`: what the other ranks' own work rises by, by itself, over as many
    steps) and be sustained. A chronic gap is present on every step, so a transient swing
    of the others is no measure of it: it keeps the per-step and impact bars.
    """
    data = _series(con, steps) if series is None else series
    runq = runq_by_step(con)
    if not runq:
        return _find(con, steps, host_of, thr, median_step, data)
    # CPU clock with the run-queue wait recorded: what a rank did is its own work less the
    # time it was runnable but held off the CPU (split over its phases in proportion to their
    # own work: it was preempted wherever it ran); the gaps to the other ranks and their
    # noise are taken again on that. Only what remains can name a straggler.
    net = _net_of_runq(data, runq, steps)
    found = _find(con, steps, host_of, _thresholds(net, median_step), median_step, net, raw=data)
    if contention is not None:
        extra = runq_extra(con)
        for s in _find(con, steps, host_of, thr, median_step, data):
            if any(f["rank"] == s["rank"] and f["phase"] == s["phase"]
                   and f["first_step"] <= s["last_step"] and f["last_step"] >= s["first_step"]
                   for f in found):
                continue
            contention.append(_contention(con, s, extra))
    return found


#: One (rank, phase) series: step positions, gap to the other ranks, own work (numpy arrays).
Series = dict[tuple[int, str], tuple[Any, Any, Any]]


def _series(con: Any, steps: list[int], cols: OwnColumns | None = None) -> Series:
    """Every (rank, phase) gap series of table ``ex``, in (rank, phase, step) order.

    Fixed-dtype columns, not Python rows: each series is a slice (a view) of arrays sorted
    once in numpy. ``cols``: ex's columns as :func:`build_own` returned them (else read).
    """
    if cols is None:
        names = [str(n) for (n,) in con.execute(
            "SELECT DISTINCT name FROM ex WHERE excess IS NOT NULL ORDER BY 1").fetchall()]
        got = con.execute(
            "SELECT rank, list_position($names, name) - 1 AS nid, step, excess, own FROM ex "
            "WHERE excess IS NOT NULL", {"names": names}).fetchnumpy()
        cols = OwnColumns(names, *(np.asarray(got[c]) for c in ("rank", "nid", "step", "own",
                                                                 "excess")))
        del got
    names = cols.names
    rank_a = np.asarray(cols.rank, dtype=np.int64)
    nid_a = np.asarray(cols.nid, dtype=np.int64)
    pos_a = np.searchsorted(np.asarray(steps, dtype=np.int64), np.asarray(cols.step, dtype=np.int64))
    # One integer key (rank, phase, step position): a single argsort, not a three-key lexsort.
    key_a = rank_a * (len(names) + 1) + nid_a
    order = np.argsort(key_a * (len(steps) + 1) + pos_a)
    rank_a, nid_a, pos_a, key_a = rank_a[order], nid_a[order], pos_a[order], key_a[order]
    ex_a = np.asarray(cols.excess, dtype=np.float64)[order]
    own_a = np.asarray(cols.own, dtype=np.float64)[order]
    del order
    starts = np.flatnonzero(np.r_[True, key_a[1:] != key_a[:-1]]) if len(key_a) else key_a
    bounds = [*starts.tolist(), len(key_a)]
    return {(int(rank_a[i]), names[int(nid_a[i])]): (pos_a[i:j], ex_a[i:j], own_a[i:j])
            for i, j in itertools.pairwise(bounds)}


def runq_by_step(con: Any) -> dict[int, dict[int, float]]:
    """``{rank: {step: run-queue wait ms}}`` from ``res.runq_ms``; empty when not recorded."""
    has = con.execute(
        """SELECT count(*) FROM information_schema.columns
           WHERE table_name = 'res' AND column_name = 'runq_ms'""").fetchone()[0]
    out: dict[int, dict[int, float]] = {}
    if not has:
        return out
    for rank, step, ms in con.execute(
        "SELECT rank, step, runq_ms FROM res WHERE runq_ms IS NOT NULL AND isfinite(runq_ms) AND runq_ms >= 0"
    ).fetchall():
        out.setdefault(int(rank), {})[int(step)] = float(ms)
    return out if len(out) > 1 else {}


def _net_of_runq(data: Series, runq: dict[int, dict[int, float]], steps: list[int]) -> Series:
    """Gap series and own-work series with each rank's run-queue wait taken out.

    A step's wait is split over the rank's phases by weight own × max(1, own / the rank's
    median own in that phase): preemption falls on the time the thread ran, and most on
    a phase that ran long (one long preemption lands in one phase). Each phase keeps at
    least nothing (never negative).
    """
    rows = [(r, name, steps[int(i)], o) for (r, name), (pos, _, own) in data.items()
            for i, o in zip(pos.tolist(), own.tolist(), strict=True)]
    base: dict[tuple[int, str], float] = {}
    per_key: dict[tuple[int, str], list[float]] = {}
    for rank, name, _, own in rows:
        per_key.setdefault((rank, name), []).append(max(own, 0.0))
    for key, xs in per_key.items():
        base[key] = robust.median(xs)
    weight: dict[tuple[int, int], float] = {}

    def w_of(r: int, name: str, o: float) -> float:
        b = base[(r, name)]
        return o * max(1.0, o / b) if b > 1e-9 else o

    for rank, name, step, own in rows:
        weight[(rank, step)] = weight.get((rank, step), 0.0) + w_of(rank, name, max(own, 0.0))
    net: dict[tuple[int, str], dict[int, float]] = {}
    by_cell: dict[tuple[int, str], list[tuple[float, int]]] = {}
    for rank, name, step, own in rows:
        o = max(own, 0.0)
        tw = weight[(rank, step)]
        q = runq.get(rank, {}).get(step, 0.0)
        v = max(0.0, o - q * w_of(rank, name, o) / tw) if tw > 0 else o
        net.setdefault((rank, name), {})[step] = v
        by_cell.setdefault((step, name), []).append((v, rank))
    others: dict[tuple[int, int, str], float] = {}
    for (st, name), vals in by_cell.items():
        if len(vals) < 2:
            continue
        vals.sort()
        xs = [v for v, _ in vals]
        for k, (_, r) in enumerate(vals):
            others[(r, st, name)] = _median_without(xs, k)
    pos_of = {s: i for i, s in enumerate(steps)}
    out: Series = {}
    for (r, name), per in net.items():
        pts = [(pos_of[st], per[st] - others[(r, st, name)], per[st])
               for st in sorted(per, key=lambda x: pos_of[x]) if (r, st, name) in others]
        if pts:
            out[(r, name)] = (np.array([p for p, _, _ in pts], dtype=np.int64),
                              np.array([g for _, g, _ in pts], dtype=np.float64),
                              np.array([o for _, _, o in pts], dtype=np.float64))
    return out


def _thresholds(data: Series, median_step: float) -> dict[tuple[int, str], float]:
    """:func:`build_thresholds`' rule, over every series at once (numpy, no per-series loop)."""
    floor = max(FLOOR_MS, FLOOR_FRAC * median_step)
    keys = list(data)
    if not keys:
        return {}
    lens = np.array([len(data[k][1]) for k in keys], dtype=np.int64)
    gap = np.concatenate([np.asarray(data[k][1], dtype=np.float64) for k in keys])
    # Successive differences within each series: every difference but those across series.
    n_d = np.maximum(lens - 1, 0)
    keep = np.ones(max(len(gap) - 1, 0), dtype=bool)
    ends = np.cumsum(lens)[:-1] - 1  # last value of each series but the final one
    keep[ends[(ends >= 0) & (ends < len(keep))]] = False
    d = (gap[1:] - gap[:-1])[keep]
    mad = grouped.mads_contiguous(d, grouped.starts_of(n_d), n_d)
    sig = np.where(n_d >= 2, SIGMAS * (robust.MAD_SCALE * np.nan_to_num(mad) / math.sqrt(2.0)), 0.0)
    return {k: max(float(v), floor) for k, v in zip(keys, sig.tolist(), strict=True)}


def runq_extra(con: Any) -> dict[int, dict[int, float]]:
    """Each rank's run-queue wait per step (``res.runq_ms``) minus the other ranks' median at
    that step: ``{rank: {step: ms}}``; empty when the runs carry none (a GPU run, records
    from before :mod:`stepscope.instrument.sched`)."""
    has = con.execute(
        """SELECT count(*) FROM information_schema.columns
           WHERE table_name = 'res' AND column_name = 'runq_ms'""").fetchone()[0]
    if not has:
        return {}
    by_step: dict[int, list[tuple[float, int]]] = {}
    for step, rank, ms in con.execute(
        "SELECT step, rank, runq_ms FROM res WHERE runq_ms IS NOT NULL AND isfinite(runq_ms)"
    ).fetchall():
        by_step.setdefault(int(step), []).append((float(ms), int(rank)))
    out: dict[int, dict[int, float]] = {}
    for step, vals in by_step.items():
        n = len(vals)
        if n < 2:
            continue
        vals.sort()
        xs = [v for v, _ in vals]
        for k, (ms, rank) in enumerate(vals):
            out.setdefault(rank, {})[step] = ms - _median_without(xs, k)
    return out


def _median_without(xs: list[float], k: int) -> float:
    """Median of sorted ``xs`` with position ``k`` left out (the other ranks'), in O(1)."""
    m = len(xs) - 1

    def at(j: int) -> float:
        return xs[j if j < k else j + 1]

    return at(m // 2) if m % 2 else 0.5 * (at(m // 2 - 1) + at(m // 2))


def _contention(con: Any, s: dict[str, Any], extra: dict[int, dict[int, float]]) -> dict[str, Any]:
    """What a straggler found on raw own work, but not once run-queue wait is taken out, was."""
    first, last, rank = int(s["first_step"]), int(s["last_step"]), int(s["rank"])
    row = con.execute(
        f"""SELECT median(runq_ms) FILTER (WHERE rank = {rank}),
                   median(runq_ms) FILTER (WHERE rank <> {rank})
            FROM res WHERE step BETWEEN {first} AND {last} AND runq_ms IS NOT NULL"""
    ).fetchone()
    mine = [v for st, v in extra.get(rank, {}).items() if first <= st <= last]
    return {"rank": rank, "phase": s["phase"], "first_step": first, "last_step": last,
            "persistence": s["persistence"], "excess_ms": s["excess_ms"],
            "runq_ms": round(float(row[0] or 0.0), 3), "others_runq_ms": round(float(row[1] or 0.0), 3),
            "extra_runq_ms": round(robust.median(mine), 3) if mine else 0.0}


def _find(
    con: Any, steps: list[int], host_of: dict[int, str], thr: dict[tuple[int, str], float],
    median_step: float, data: Series, raw: Series | None = None,
) -> list[dict[str, Any]]:
    # raw given: ``data`` is net of run-queue wait and decides whether and where a window is
    # (the others' speed-up while a straggler sleeps, window_excess' reason to meet the own
    # rise halfway, was their shorter wait for a CPU: the net gap is the level). Its price is
    # what the others waited, so the raw series over those bounds counts too: waking from a
    # sleep on a busy host waits for a CPU, and that wait held them as well.
    net = raw is not None
    # Each phase's own-work series per rank, as lists, built when a window needs them.
    owns: dict[str, dict[int, list[float]]] = {}

    def owns_of(name: str) -> dict[int, list[float]]:
        if name not in owns:
            owns[name] = {r: own.tolist() for (r, n), (_, _, own) in data.items() if n == name}
        return owns[name]

    n_steps = len(steps)
    min_n = max(MIN_SEGMENT, math.ceil(0.04 * n_steps))
    out: list[dict[str, Any]] = []
    for (rank, name), (at, xa, own_a) in data.items():
        t = thr.get((rank, name))
        if t is None:
            continue
        high = xa > t
        idx = at[high]
        # A stretch's level is a median over >= min_n steps: its noise is well under one
        # step's, so its bar is a few of the rank's noise sigmas, not the per-step SIGMAS.
        bar = max(WINDOW_SIGMAS * t / SIGMAS, MIN_EXCESS_MS, WINDOW_IMPACT * median_step)
        whole = float(np.median(xa))  # robust.median: the same middle value(s), same mean
        if (len(xa) >= CHRONIC_COVER * n_steps and whole > bar
                and whole >= max(MIN_EXCESS_MS, CHRONIC_IMPACT * median_step)
                and not (len(idx) >= CHRONIC_DENSITY * n_steps)):
            # The gap's level over the whole run sits well above its noise even where single
            # steps are too noisy to flag (a busy host): chronic, priced at that level.
            seg = at.tolist()
            if raw is not None:
                whole = _raw_chronic(raw, (rank, name), at, whole)
            out.append(_straggler(con, rank, name, host_of, steps, seg, whole, "chronic",
                                  _confidence(len(seg), 1.0, whole / t)))
            # A window on top of the chronic level is still looked for below.
        elif (len(idx) >= CHRONIC_DENSITY * n_steps and len(idx)
              and int(idx[-1]) - int(idx[0]) + 1 >= CHRONIC_COVER * n_steps):
            # Flagged on most steps across the run: one chronic straggler, whatever its holes.
            med = float(np.median(xa[high]))
            if (min(med, whole) >= max(MIN_EXCESS_MS, CHRONIC_IMPACT * median_step)
                    and whole >= 0.5 * med):
                ids = idx.tolist()
                if raw is not None:
                    med = _raw_chronic(raw, (rank, name), idx, med)
                out.append(_straggler(con, rank, name, host_of, steps, ids, med, "chronic",
                                      _confidence(len(ids), len(ids) / (ids[-1] - ids[0] + 1),
                                                  med / t)))
                continue
            # Flagged on most steps, but the run's median gap is too small to name or far
            # under the flagged steps' (a busy host favouring the other rank by half a
            # millisecond, with a real window on top): not chronic; windows are looked for.
        if len(xa) < min_n or not changepoint.may_hold_window(xa, bar, whole):
            continue  # a bound, not a guess: elevated() would find no window here
        xs = xa.tolist()
        own = own_a.tolist()
        pts = list(zip(at.tolist(), xs, strict=True))
        chronic_done = any(o["rank"] == rank and o["phase"] == name for o in out)
        for w in changepoint.elevated(xs, bar, min_len=min_n):
            seg = [i for i, _ in pts[w.start:w.end + 1]]
            chronic = seg[-1] - seg[0] + 1 >= CHRONIC_COVER * n_steps
            if chronic and chronic_done:
                continue
            # Chronic: the gap itself (to the other ranks' median), not over a short outside.
            if chronic:
                level = robust.median(xs[w.start:w.end + 1])
                if level < max(MIN_EXCESS_MS, CHRONIC_IMPACT * median_step):
                    continue
            else:
                level = (min(w.excess, robust.median(xs[w.start:w.end + 1])) if net
                         else window_excess(xs, own, w.start, w.end, w.excess))
                if level < bar or level <= noise_floor(owns_of(name), rank, w.length):
                    continue
                inside = xs[w.start:w.end + 1]
                if sum(1 for x in inside if x >= 0.5 * level) < SUSTAINED * len(inside):
                    # Not sustained: a rank the host descheduled now and then (gaps from 0 to
                    # twice the level), not one running slow for a while.
                    continue
                if seg[0] == 0 and len(seg) < ALL_RANK_MIN_SHARE * n_steps:
                    # A short slow start on one rank: its warm-up (lazy init, the first
                    # rank's logging set-up), as for every rank in find_windows.
                    continue
            if raw is not None:
                level = (_raw_chronic(raw, (rank, name), np.asarray(seg), level) if chronic
                         else _raw_level(raw, (rank, name), w.start, w.end, level))
            out.append(_straggler(con, rank, name, host_of, steps, seg, level,
                                  "chronic" if chronic else "window",
                                  _confidence(len(seg), 1.0, w.excess / t)))
    out.sort(key=lambda s: -s["excess_ms"] * s["steps"])
    return out


def _raw_chronic(raw: Series, key: tuple[int, str], positions: Any, net_level: float) -> float:
    """A chronic straggler found on the net series is priced at no less than its raw gap over
    the same steps: what the others waited. Spreading a step's run-queue wait over phases
    puts most of it on the phase that ran long, so the net level under-states a rank that
    sleeps there (a 30 ms optimizer sleep read 23.9 ms net beside a CPU hog)."""
    cols = raw.get(key)
    if cols is None:
        return net_level
    pos, gap, _ = cols
    sel = gap[np.isin(pos, positions)]
    return max(net_level, float(np.median(sel))) if len(sel) else net_level


def _raw_level(raw: Series, key: tuple[int, str], start: int, end: int,
               net_level: float) -> float:
    """:func:`window_excess` on the raw series over a window found on the net one."""
    cols = raw.get(key)
    if cols is None or not len(cols[1]):
        return net_level
    xs, own = cols[1].tolist(), cols[2].tolist()
    out = xs[:start] + xs[end + 1:]
    if len(out) < MIN_SEGMENT:
        return net_level
    level = robust.median(xs[start:end + 1]) - robust.median(out)
    # Two estimates, each low in its own way: the net level leaves out the straggler's wait
    # for a CPU after each sleep, the raw estimate meets a low own rise halfway.
    return max(net_level, window_excess(xs, own, start, end, level))


def _straggler(con: Any, rank: int, name: str, host_of: dict[int, str], steps: list[int],
               seg: list[int], excess: float, persistence: str, confidence: float) -> dict[str, Any]:
    s: dict[str, Any] = {
        "rank": rank,
        "host": host_of.get(rank),
        "phase": name,
        "excess_ms": round(excess, 3),
        "steps": len(seg) if persistence == "chronic" else seg[-1] - seg[0] + 1,
        "first_step": steps[seg[0]],
        "last_step": steps[seg[-1]],
        "persistence": persistence,
        "confidence": confidence,
    }
    _add_victims(con, s, [steps[i] for i in seg])
    return s


def _add_victims(con: Any, s: dict[str, Any], flagged: list[int]) -> None:
    """Ranks whose wait rose while straggler ``s`` was slow: they waited more than it did."""
    con.execute("CREATE OR REPLACE TEMP TABLE fl (step BIGINT)")
    con.execute("INSERT INTO fl SELECT unnest(?::BIGINT[])", [flagged])
    rows = con.execute(
        f"""SELECT q.rank, median(q.wait_ms - r.wait_ms), median(q.wait_ms)
            FROM wait q JOIN wait r ON q.step = r.step AND r.rank = {int(s['rank'])}
            WHERE q.rank <> {int(s['rank'])} AND q.step IN (SELECT step FROM fl)
            GROUP BY 1 ORDER BY 1"""
    ).fetchall()
    bar = max(FLOOR_MS, VICTIM_FRACTION * s["excess_ms"])
    victims = [(int(r), float(w)) for r, rise, w in rows if rise is not None and rise >= bar]
    s["victims"] = [r for r, _ in victims]
    s["victim_wait_ms"] = round(robust.median(w for _, w in victims), 3)
    s["wait_phase"] = None
    if victims:
        ids = ", ".join(str(r) for r, _ in victims)
        row = con.execute(
            f"""SELECT coalesce(phase, '{RESIDUAL}'), sum(wait) FROM cw
                WHERE rank IN ({ids}) AND step IN (SELECT step FROM fl)
                GROUP BY 1 ORDER BY 2 DESC LIMIT 1"""
        ).fetchone()
        s["wait_phase"] = str(row[0]) if row and row[1] else None
    con.execute("DROP TABLE fl")


def own_slowdown(con: Any, name: str, first: int, last: int, rank: int | None = None) -> float:
    """Median own time of ``name`` inside steps [first, last] over its median outside.

    For one rank when given (its own baseline; the other ranks' median when the window
    covers the whole run), else over all ranks.
    """
    who = f"AND rank = {int(rank)}" if rank is not None else ""
    r = con.execute(
        f"""SELECT median(own) FILTER (WHERE step BETWEEN {first} AND {last}),
                   median(own) FILTER (WHERE step NOT BETWEEN {first} AND {last}),
                   median(others) FILTER (WHERE step BETWEEN {first} AND {last})
            FROM ex WHERE name = {_q(name)} {who}"""
    ).fetchone()
    inside, outside, others = r if r else (None, None, None)
    base = outside if outside is not None and outside > 1e-9 else others
    if inside is None or base is None or base <= 1e-9:
        return 1.0
    return float(inside) / float(base)


def find_windows(
    con: Any, steps: list[int], stragglers: list[dict[str, Any]], all_ranks: list[int],
    warmup: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Runs of steps whose step time stands out from the run's median (robustly).

    A slow start on every rank with no straggler is warm-up: it goes into ``warmup``
    (start_step, end_step, phase, slowdown), not the windows. A window's ``slowdown`` is
    the named phase's own slowdown there (own time inside the window over its median
    outside), not the whole step's.
    """
    rows = con.execute("SELECT step, max(step_ms) FROM steps GROUP BY 1 ORDER BY 1").fetchall()
    if warmup is None:
        warmup = {}
    if len(rows) < 2 * MIN_SEGMENT:
        return []
    wall = [float(v) for _, v in rows]
    med = robust.median(wall)
    bar = max(WINDOW_SIGMAS * changepoint.noise(wall), FLOOR_MS, 0.03 * med)
    pos = {s: i for i, s in enumerate(steps)}
    at = [pos[int(s)] for s, _ in rows]
    out: list[dict[str, Any]] = []
    covered: set[tuple[int, int]] = set()
    # Every rank slow together for a few steps is the host (another process, a GC pause, a
    # page-cache flush), not the job: an all-rank window must last a tenth of the run.
    min_len = max(MIN_SEGMENT, math.ceil(ALL_RANK_MIN_SHARE * len(steps)))
    for w in changepoint.elevated(wall, bar, min_len=min_len):
        seg = at[w.start:w.end + 1]
        span = seg[-1] - seg[0] + 1
        if span >= CHRONIC_COVER * len(steps):
            continue
        first, last = steps[seg[0]], steps[seg[-1]]
        hits = [s for s in stragglers if s["first_step"] <= last and s["last_step"] >= first]
        if hits:
            top = max(hits, key=lambda s: s["excess_ms"] * s["steps"])
            ranks = sorted({s["rank"] for s in hits})
            phase = top["phase"]
            slowdown = own_slowdown(con, phase, top["first_step"], top["last_step"], top["rank"])
            covered.update((s["rank"], s["first_step"]) for s in hits)
            if top["persistence"] == "window":
                # Explained by a windowed straggler: its bounds, found on that rank's own work,
                # are the window's; the step-time series is noisier (every rank's jitter).
                first, last = top["first_step"], top["last_step"]
                span = top["steps"]
        else:
            ranks, phase = list(all_ranks), _window_phase(con, first, last)
            slowdown = own_slowdown(con, phase, first, last) if phase != "step" else 1.0
            if seg[0] == 0:
                # Every rank slow from the first analysed step: warm-up (lazy init, caches,
                # allocator), not something that happened to the run. Noted, not flagged.
                warmup.update(start_step=first, end_step=last, phase=phase,
                              slowdown=round(slowdown, 3))
                continue
        excess = max(0.0, w.excess)
        out.append({"start_step": first, "end_step": last, "ranks": ranks, "phase": phase,
                    "slowdown": round(slowdown, 3), "excess_ms": round(excess, 3),
                    "steps": span})
    # A windowed straggler that did not slow the whole step (no collective) is a window too.
    for s in stragglers:
        if s["persistence"] != "window" or (s["rank"], s["first_step"]) in covered:
            continue
        slowdown = own_slowdown(con, s["phase"], s["first_step"], s["last_step"], s["rank"])
        if slowdown <= 1.0:
            continue
        out.append({"start_step": s["first_step"], "end_step": s["last_step"],
                    "ranks": [s["rank"]], "phase": s["phase"], "slowdown": round(slowdown, 3),
                    "excess_ms": s["excess_ms"], "steps": s["steps"]})
    if not warmup:
        _find_warmup(con, wall, bar, at, steps, stragglers, warmup)
    out.sort(key=lambda w: w["start_step"])
    return out


def _find_warmup(con: Any, wall: list[float], bar: float, at: list[int], steps: list[int],
                 stragglers: list[dict[str, Any]], warmup: dict[str, Any]) -> None:
    """A slow start shorter than an all-rank window must last (a tenth of the run) is still
    warm-up: noted in ``warmup``, never a window."""
    for w in changepoint.elevated(wall, bar, min_len=MIN_SEGMENT):
        seg = at[w.start:w.end + 1]
        if seg[0] != 0:
            break
        first, last = steps[seg[0]], steps[seg[-1]]
        if any(s["first_step"] <= last and s["last_step"] >= first for s in stragglers):
            break
        phase = _window_phase(con, first, last)
        slowdown = own_slowdown(con, phase, first, last) if phase != "step" else 1.0
        warmup.update(start_step=first, end_step=last, phase=phase, slowdown=round(slowdown, 3))
        break


def _window_phase(con: Any, first: int, last: int) -> str:
    """The phase whose median own time grew most inside the window."""
    row = con.execute(
        f"""SELECT name, median(own) FILTER (WHERE step BETWEEN {first} AND {last})
                       - median(own) AS grow
            FROM ex GROUP BY 1 ORDER BY grow DESC NULLS LAST LIMIT 1"""
    ).fetchone()
    return str(row[0]) if row else "step"


def _bus_factor(op: str, n: int) -> float | None:
    if n < 1:
        return None
    for key, f in _BUS_FACTOR.items():
        if op == key or op.startswith(key + "_"):
            return float(f(n))
    return 2.0 * (n - 1) / n if op == DDP_OP else None


def collectives_section(con: Any, source: str, notes: list[str]) -> dict[str, Any]:
    """The report's ``collectives`` view: per op and process group, per step and rank.

    ``bus_gbps`` follows NCCL-tests (algorithm bandwidth = bytes / transfer time, times
    2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all), with
    ``bytes`` the full buffer of a call as recorded and the transfer time the part not spent
    waiting (time in the collective minus wait). None where bytes are unknown (DDP's
    all-reduce) or nothing was matched.
    """
    n_steps = con.execute("SELECT count(DISTINCT step) FROM steps").fetchone()[0] or 1
    ops: list[dict[str, Any]] = []
    for (op, pg, size, ranks, calls, nbytes, ms, wait, phases, m_bytes, m_xfer,
         matched) in con.execute(
        """SELECT op, pg, max(pg_size), count(DISTINCT rank), sum(count), sum(bytes), sum(ms),
                  sum(wait), list(DISTINCT coalesce(phase, 'residual')),
                  sum(bytes) FILTER (WHERE matched), sum(ms - wait) FILTER (WHERE matched),
                  sum(count) FILTER (WHERE matched)
           FROM cw WHERE pg <> 'timeline' GROUP BY 1, 2 ORDER BY sum(ms) DESC"""
    ).fetchall():
        per = float(ranks * n_steps)
        bus = None
        factor = _bus_factor(str(op), int(size or 0))
        if factor is not None and m_bytes and m_xfer and m_xfer > 0:
            bus = round(factor * float(m_bytes) / float(m_xfer) / 1e6, 3)
        ops.append({
            "op": op, "pg": pg, "pg_size": int(size or 0), "ranks": int(ranks),
            "phases": phase_order(list(phases)),
            "calls_per_step": round(float(calls) / per, 3),
            "bytes_per_step": None if nbytes is None else round(float(nbytes) / per, 1),
            "ms_per_step": round(float(ms) / per, 3),
            "wait_ms_per_step": round(float(wait) / per, 3),
            "wait_share": round(float(wait) / float(ms), 4) if ms else 0.0,
            "matched_share": round(float(matched or 0) / float(calls), 4) if calls else 0.0,
            "bus_gbps": bus,
        })
    return {"source": source, "wait_rule": WAIT_RULE, "ops": ops, "notes": list(notes)}


def phase_waits(con: Any, phases: dict[str, Any]) -> None:
    """Add ``wait_ms`` (median wait inside, per step), ``own_share`` and ``work_share``.

    ``own_share`` is the phase's share of step time once its waits are taken out;
    ``work_share`` takes out all collective time inside it (waits and transfers), so a
    ``dataloader`` that gathers across ranks is judged on its own data time.
    """
    total = con.execute("SELECT sum(step_ms) FROM steps").fetchone()[0] or 0.0
    # Residual work: untimed time minus every collective issued outside a phase (waits and
    # transfers: a pipeline's send/recv is communication, not host overhead).
    con.execute(
        """CREATE OR REPLACE TEMP TABLE rx AS
           SELECT ex.rank, ex.step, ex.wait, ex.own,
                  greatest(ex.own + ex.wait - coalesce(c.ms, 0.0), 0.0) AS work
           FROM ex LEFT JOIN (SELECT rank, step, sum(ms) AS ms FROM cw WHERE phase IS NULL
                              GROUP BY 1, 2) c USING (rank, step)
           WHERE ex.name = 'residual'"""
    )
    rank_step = dict(con.execute("SELECT rank, sum(step_ms) FROM steps GROUP BY 1").fetchall())
    rows = con.execute(
        f"""SELECT path, NULL AS rank, median(wait), sum(ms - wait), bool_and(parent IS NULL),
                   sum(greatest(ms - coll_ms, 0.0))
            FROM pw GROUP BY 1
            UNION ALL SELECT '{RESIDUAL}', NULL, median(wait), sum(own), TRUE, sum(work) FROM rx
            UNION ALL SELECT path, rank, median(wait), sum(ms - wait), bool_and(parent IS NULL),
                             sum(greatest(ms - coll_ms, 0.0))
            FROM pw GROUP BY 1, 2
            UNION ALL SELECT '{RESIDUAL}', rank, median(wait), sum(own), TRUE, sum(work) FROM rx
                      GROUP BY 2"""
    ).fetchall()
    # Index the per-rank entries once: searching per_rank for each row is ranks^2.
    per_rank: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for pname, ph in phases.items():
        for p in ph["per_rank"]:
            per_rank.setdefault((pname, int(p["rank"])), []).append(p)
    for path, rank, wmed, own_sum, top, work_sum in rows:
        ph = phases.get(str(path))
        if ph is None:
            continue
        targets = [ph] if rank is None else per_rank.get((str(path), int(rank)), [])
        denom = total if rank is None else (rank_step.get(rank) or 0.0)
        for t in targets:
            t["wait_ms"] = round(float(wmed or 0.0), 3)
            t["own_share"] = round(float(own_sum) / denom, 4) if top and denom else None
            t["work_share"] = round(float(work_sum) / denom, 4) if top and denom else None


def attribute(con: Any, hosts: dict[str, list[int]], ranks: list[int], median_step: float,
              steps: list[int]) -> Attribution:
    """Waits, own work, stragglers, windows and the collectives view for a loaded run."""
    n_ranks = len(ranks)
    al = align(con, hosts, n_ranks, median_step)
    info: list[str] = []
    source, notes = build_waits(con, n_ranks, al, info)
    if source in ("collectives", "grad_sync", "collectives+timeline"):
        row = con.execute(
            """SELECT coalesce(phase, 'residual'), arg_max(op, ms) FROM (
                   SELECT phase, op, sum(wait) + 1e-9 * sum(ms) AS ms FROM cw GROUP BY 1, 2)
               GROUP BY 1 ORDER BY max(ms) DESC LIMIT 1"""
        ).fetchone()
        if row:
            al.sync_phase = str(row[0]).split("/")[0]
            al.arrival = GRAD_SYNC if row[1] == DDP_OP else str(row[1])
            al.aligned = True
    series = _series(con, steps, build_own(con))
    thr = build_thresholds(con, median_step, series)
    host_of = {r: h for h, rs in hosts.items() for r in rs}
    contention: list[dict[str, Any]] = []
    stragglers = find_stragglers(con, steps, host_of, thr, median_step, contention, series)
    del series
    warmup: dict[str, Any] = {}
    windows = find_windows(con, steps, stragglers, ranks, warmup)
    by_phase: dict[str, list[float]] = {}
    for (_, name), t in thr.items():
        by_phase.setdefault(name, []).append(t)
    thresholds = {n: robust.median(v) for n, v in by_phase.items()}
    return Attribution(al, source, thresholds, stragglers, windows,
                       collectives_section(con, source, notes + info), notes, warmup or None,
                       contention)
