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

The parts live in their own modules: :mod:`~stepscope.analysis.align` (timeline),
:mod:`~stepscope.analysis.collwaits` (wait tables, collectives view),
:mod:`~stepscope.analysis.own` (own work, median of the others, per-phase waits) and
:mod:`~stepscope.analysis.series` (gap series and their noise); this module searches them
for stragglers and windows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from stepscope.analysis import changepoint
from stepscope.analysis.align import Alignment, BlockRows, align
from stepscope.analysis.collwaits import (
    DDP_OP,
    GRAD_SYNC,
    build_waits,
    collectives_section,
    sql_literal,
)
from stepscope.analysis.own import OwnBlockRunner, build_own
from stepscope.analysis.series import (
    EXPLAINS,
    FLOOR_MS,
    SIGMAS,
    Series,
    merge_thresholds,
    net_of_runq,
    read_gap_series,
    runq_by_step,
    runq_extra,
    thresholds_of,
)
from stepscope.analysis.stats import RESIDUAL
from stepscope.common import robust

MIN_SEGMENT = 5  # flagged steps needed before a rank is called a straggler
CHRONIC_COVER = 0.8  # a segment spanning this fraction of analysed steps is chronic
CHRONIC_DENSITY = 0.5  # flagged share of a segment's span (or of the run) for it to count
#: Share of the steps whose gap reaches the naming floor for a gap over the run to be chronic
#: whatever its noise.
CHRONIC_PERSISTS = 0.8
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
#: A straggler explains a window of step time it overlaps only with an excess of at least
#: this share of the window's: a rank 1.6 ms slow over the whole run does not explain every
#: rank's step running 23 ms slow for six steps (the host, busy for a while, did).
EXPLAINS_SHARE = 0.5

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
    #: Would-be chronic stragglers no other rank waited for (:func:`unwaited`).
    unwaited: list[dict[str, Any]] = field(default_factory=list)


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


@dataclass(frozen=True)
class SeriesScreen:
    """What the straggler search needs of each gap series that the series alone decides:
    its flag threshold (:func:`~stepscope.analysis.series.thresholds_of`) and whether it may
    name a straggler at all (:func:`candidates_of`). A per-rank aggregate: blocks of whole
    ranks give, by union, the whole run's (:func:`merge_screens`)."""

    thresholds: dict[tuple[int, str], float]
    candidates: frozenset[tuple[int, str]]


#: Computes :func:`screen_series` of a run's gap series elsewhere, the same values
#: (arguments: the series, the median step, the analysed steps' count): an engine that
#: runs it on blocks of ranks as tasks (:mod:`stepscope.analysis.dask_engine`).
SeriesRunner = Callable[[Series, float, int], SeriesScreen]


def screen_series(data: Series, median_step: float, n_steps: int) -> SeriesScreen:
    """Every series' threshold and the candidates among them (:class:`SeriesScreen`)."""
    thr = thresholds_of(data, median_step)
    return SeriesScreen(thr, candidates_of(data, thr, median_step, n_steps))


def merge_screens(data: Series, parts: Iterable[SeriesScreen]) -> SeriesScreen:
    """The screens of blocks of ranks as the whole run's (thresholds in ``data``'s order;
    a lost block is an error, :func:`~stepscope.analysis.series.merge_thresholds`)."""
    parts = list(parts)
    thr = merge_thresholds(data, (p.thresholds for p in parts))
    return SeriesScreen(thr, frozenset().union(*(p.candidates for p in parts)))


#: Gap values per stacked chunk of :func:`candidates_of`.
_SCREEN_CHUNK = 1 << 22


def candidates_of(data: Series, thr: dict[tuple[int, str], float], median_step: float,
                  n_steps: int) -> frozenset[tuple[int, str]]:
    """The series on which :func:`find_stragglers`' search may name a straggler: a superset,
    decided per series by the search's own first tests (a bound, never a guess).

    A series with a threshold is left out only where the search is sure to find nothing:
    not chronic by its run-wide level or its persistence, not flagged on most steps across
    the run, and no window (too short, or :func:`~stepscope.analysis.changepoint.may_hold_window`
    says none from the series' median). A series whose window baseline would not be its
    median (flagged on most steps, with a level above the bar) is kept. Series of one
    length and dtype are stacked and tested at once (numpy on a 2-D array; each row's
    values and comparisons in the series' own dtype, as the search makes them)."""
    groups: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for key, (_, gap, _) in data.items():
        if key in thr:
            groups.setdefault((len(gap), np.asarray(gap).dtype.str), []).append(key)
    out: set[tuple[int, str]] = set()
    for (n, _), keys in groups.items():
        rows = max(1, _SCREEN_CHUNK // max(n, 1))
        for i in range(0, len(keys), rows):
            part = keys[i:i + rows]
            keep = _candidate_rows(data, thr, part, n, median_step, n_steps)
            out.update(k for k, k_in in zip(part, keep.tolist(), strict=True) if k_in)
    return frozenset(out)


class _Tests(NamedTuple):
    """The search's first tests of equal-length gap series, a value per row (one row per
    series; :func:`_series_tests`). ``high`` is the per-step flag matrix."""

    bar: Any  # a window's minimum excess (float64)
    whole: Any  # the series' median, as float64 (``whole_x``: in the series' dtype)
    whole_x: Any
    high: Any
    n_high: Any
    chronic: Any  # chronic at the run-wide level (before the flagged-steps test)
    dense: Any  # flagged on most steps


def _series_tests(x: Any, t: Any, median_step: float, n_steps: int) -> _Tests:
    """:class:`_Tests` of the rows of ``x`` (2-D, one series per row, its own dtype) with
    thresholds ``t``. Each comparison runs in ``x``'s dtype, as it does against one series
    (a Python float against a NumPy array takes the array's dtype)."""
    n = x.shape[1]
    high = x > t.astype(x.dtype)[:, None]
    n_high = np.count_nonzero(high, axis=1)
    # A stretch's level is a median over >= min_n steps: its noise is well under one
    # step's, so its bar is a few of the rank's noise sigmas, not the per-step SIGMAS.
    bar = np.maximum(np.maximum(WINDOW_SIGMAS * t / SIGMAS, MIN_EXCESS_MS),
                     WINDOW_IMPACT * median_step)
    whole_x = np.median(x, axis=1)  # each row's np.median, in its dtype (robust.median's)
    whole = whole_x.astype(np.float64)
    floor = _naming_floor(median_step)
    # Above the naming floor on nearly every step, however noisy each step (a loaded
    # host's preemption swings single steps by the gap itself): persistent, so chronic.
    # Clean busy-host runs reached 0.56 at most (36 soak runs, 8 recorded ones).
    persistent = (np.count_nonzero(x >= x.dtype.type(floor), axis=1) / max(n, 1)
                  >= CHRONIC_PERSISTS) & (n > 0)
    dense = n_high >= CHRONIC_DENSITY * n_steps
    # The gap's level over the whole run sits well above its noise even where single
    # steps are too noisy to flag (a busy host): chronic, priced at that level.
    chronic = ((n >= CHRONIC_COVER * n_steps) & ((whole > bar) | persistent)
               & (whole >= floor) & ~dense)
    return _Tests(bar, whole, whole_x, high, n_high, chronic, dense)


def _naming_floor(median_step: float) -> float:
    """The least gap level named as a straggler: an absolute floor or a share of the step."""
    return max(MIN_EXCESS_MS, CHRONIC_IMPACT * median_step)


def _spans_run(at: Any, n_steps: int) -> bool:
    """Do step positions ``at`` (ascending, not empty) stretch over most of the run?"""
    return int(at[-1]) - int(at[0]) + 1 >= CHRONIC_COVER * n_steps


def _candidate_rows(data: Series, thr: dict[tuple[int, str], float],
                    keys: list[tuple[int, str]], n: int, median_step: float,
                    n_steps: int) -> Any:
    """:func:`candidates_of` for series ``keys`` of ``n`` values each: a bool per key."""
    if n == 0:
        return np.zeros(len(keys), dtype=bool)
    x = np.stack([np.asarray(data[k][1]) for k in keys])
    tt = _series_tests(x, np.array([thr[k] for k in keys], dtype=np.float64), median_step,
                       n_steps)
    flagged = np.zeros(len(keys), dtype=bool)
    for i in np.flatnonzero(tt.dense & (tt.n_high > 0)).tolist():  # few: flagged on most steps
        flagged[i] = _spans_run(np.asarray(data[keys[i]][0])[tt.high[i]], n_steps)
    baseline_moves = (tt.whole > tt.bar) & tt.dense & (tt.n_high < n)
    if n < max(MIN_SEGMENT, math.ceil(0.04 * n_steps)):
        return tt.chronic | flagged | baseline_moves
    window = changepoint.may_hold_windows(x, tt.bar, tt.whole_x)
    return tt.chronic | flagged | baseline_moves | window


def find_stragglers(
    con: Any, steps: list[int], host_of: dict[int, str], thr: dict[tuple[int, str], float],
    median_step: float = 0.0, contention: list[dict[str, Any]] | None = None,
    series: Series | None = None, screen: SeriesScreen | None = None,
    runner: SeriesRunner | None = None,
) -> list[dict[str, Any]]:
    """Ranks whose own work in a phase exceeds the other ranks' median over a run of steps.

    Chronic: flagged (gap above the rank's threshold) on most steps across the run. Window:
    a stretch found by change-point detection on the rank's gap series
    (:func:`stepscope.analysis.changepoint.elevated`), with its whole bounds and its excess
    from :func:`window_excess`. A window must exceed the run's noise floor
    (:func:`noise_floor`: what the other ranks' own work rises by, by itself, over as many
    steps) and be sustained. A chronic gap is present on every step, so a transient swing
    of the others is no measure of it: it keeps the per-step and impact bars.

    ``screen``: ``thr`` with the series that may name a straggler (:func:`screen_series`;
    default: found here); ``runner``: where the net-of-run-queue series' screen is computed
    (default: here).
    """
    data = read_gap_series(con, steps) if series is None else series
    n_steps = len(steps)
    if screen is None:
        screen = SeriesScreen(thr, candidates_of(data, thr, median_step, n_steps))
    extra = runq_extra(con) if runq_by_step(con) else {}
    if not extra:
        return _find(con, steps, host_of, thr, median_step, data, candidates=screen.candidates)
    # CPU clock with the run-queue wait recorded: where a rank's extra wait for a CPU at a
    # step explains its gap there, the gap is taken net of it (series.net_of_runq); every
    # other step keeps its gross gap. Only what remains can name a straggler.
    net = net_of_runq(data, extra, steps)
    ns = (screen_series if runner is None else runner)(net, median_step, n_steps)
    netted = _find(con, steps, host_of, ns.thresholds, median_step, net, raw=data,
                   candidates=ns.candidates)
    gross = _find(con, steps, host_of, thr, median_step, data, candidates=screen.candidates)

    def same(f: dict[str, Any], s: dict[str, Any]) -> bool:
        return bool(f["rank"] == s["rank"] and f["phase"] == s["phase"]
                    and f["first_step"] <= s["last_step"] and f["last_step"] >= s["first_step"])

    # Each finding judged on its steps' figures: the gross one first (its bounds are the
    # fault's where the wait for a CPU does not account for it); what the net series finds
    # beside it (a gap left once the wait is out) on its own.
    kept: list[dict[str, Any]] = []
    noted: list[dict[str, Any]] = []
    for s in gross + [f for f in netted if not any(same(f, g) for g in gross)]:
        if any(same(k, s) for k in kept):
            continue
        c = _contention(con, s, extra, data, steps)
        if (s["persistence"] == "window" and c["step_rise_ms"] is not None
                and c["step_rise_ms"] < 0.5 * float(s["excess_ms"])):
            # The rank was not slower in its step, only in this phase: the time moved between
            # its phases (where a busy host's preemption landed), and no one waited longer.
            continue
        if not _host_explains(c, len(steps)):
            kept.append(s)
            continue
        if not any(same(n, s) for n in noted):
            noted.append(c)
        # The wait accounts for the gross gap; a gap the net series still finds there stands.
        kept += [f for f in netted if same(f, s) and f is not s
                 and not _host_explains(_contention(con, f, extra, data, steps), len(steps))]
    if contention is not None:
        contention += noted
    kept.sort(key=lambda s: -s["excess_ms"] * s["steps"])
    return kept


#: A window's gross gap persisting on this share of its steps, while the other ranks' waits
#: for a CPU rose as much as its own, is the rank's, whatever the host: never a contention note.
PERSISTS = 0.9


def _host_explains(c: dict[str, Any], n_steps: int) -> bool:
    """Whether a would-be straggler is the host's, from the figures of its steps (``c``, from
    :func:`_contention`); sets ``c["basis"]`` to the figure that proves it.

    ``extra``: the rank's extra wait for a CPU over the other ranks' (median per step)
    reaches :data:`~stepscope.analysis.series.EXPLAINS` of its excess and of its gaps summed
    over its phases (a wait spent in another phase explains nothing here). ``own``: the
    other ranks waited as long, but the rank's own wait reaches as much, on a window too
    short to be the job's (under 10 steps or a tenth of the run: a busy host's preemption can
    land in one phase of one rank for a few steps, the others' in their collective's wait,
    where it costs nothing). Never a gap that persists on >= :data:`PERSISTS` of a window's steps (of at
    least a tenth of the run) while the other ranks' waits rose as much as its own: a
    sleeping rank on a loaded host."""
    need = EXPLAINS * max(c["excess_ms"], c["gap_ms"])
    long = c["persistence"] == "chronic" or c["steps"] >= max(2 * MIN_SEGMENT,
                                                               ALL_RANK_MIN_SHARE * n_steps)
    sustained = c["persists"] >= PERSISTS and long
    rose_alike = (c["runq_rise_ms"] is not None and c["others_runq_rise_ms"] is not None
                  and c["others_runq_rise_ms"] >= c["runq_rise_ms"] - 0.5 * c["excess_ms"])
    if c["extra_runq_ms"] > 0.0 and c["extra_runq_ms"] >= need:
        c["basis"] = "extra"
        return not (sustained and rose_alike)
    if c["runq_ms"] >= need and not long:
        c["basis"] = "own"
        return True
    return False


def _contention(con: Any, s: dict[str, Any], extra: dict[int, dict[int, float]],
                data: Series, steps: list[int]) -> dict[str, Any]:
    """The figures that decide whether a straggler found on gross own work is the host's:
    the rank's and the other ranks' run-queue wait per step inside its steps and outside
    them, its extra wait over theirs, its gaps over all its phases there (``gap_ms``), and
    the share of its steps whose gross gap reaches half its excess."""
    first, last, rank = int(s["first_step"]), int(s["last_step"]), int(s["rank"])
    row = con.execute(
        f"""SELECT median(runq_ms) FILTER (WHERE rank = {rank} AND step BETWEEN {first} AND {last}),
                   median(runq_ms) FILTER (WHERE rank <> {rank} AND step BETWEEN {first} AND {last}),
                   median(runq_ms) FILTER (WHERE rank = {rank} AND step NOT BETWEEN {first} AND {last}),
                   median(runq_ms) FILTER (WHERE rank <> {rank} AND step NOT BETWEEN {first} AND {last})
            FROM step_resources WHERE runq_ms IS NOT NULL AND isfinite(runq_ms)"""
    ).fetchone()
    mine_in, others_in, mine_out, others_out = (float(v) if v is not None else None for v in row)
    mine = [v for st, v in extra.get(rank, {}).items() if first <= st <= last]
    persists = 0.0
    cols = data.get((rank, str(s["phase"])))
    if cols is not None:
        at = np.asarray(steps, dtype=np.int64)[cols[0]]
        inside = cols[1][(at >= first) & (at <= last)]
        if len(inside):
            persists = float(np.mean(inside >= 0.5 * float(s["excess_ms"])))
    # The rank's gaps over its steps, each phase's median, summed over the phases where it
    # is positive (per-step noise cancels in a median; it would add up in a per-step sum).
    gap_ms = 0.0
    # And its gap over every phase summed per step: how much it rose inside the window over
    # outside it (a rank that sleeps adds its sleep; one whose time moved between phases, 0).
    total: dict[int, float] = {}
    for (r, _), (p, g, _) in data.items():
        if r != rank:
            continue
        at = np.asarray(steps, dtype=np.int64)[p]
        sel = (at >= first) & (at <= last)
        if sel.any():
            gap_ms += max(0.0, float(np.median(g[sel])))
        for st, v in zip(at.tolist(), g.tolist(), strict=True):
            total[st] = total.get(st, 0.0) + v
    t_in = [v for st, v in total.items() if first <= st <= last]
    t_out = [v for st, v in total.items() if not first <= st <= last]
    step_rise = (round(robust.median(t_in) - robust.median(t_out), 3)
                 if t_in and t_out else None)  # None: no steps outside (chronic)

    def rise(a: float | None, b: float | None) -> float | None:
        return round(a - b, 3) if a is not None and b is not None else None

    return {"rank": rank, "phase": s["phase"], "first_step": first, "last_step": last,
            "persistence": s["persistence"], "excess_ms": s["excess_ms"], "steps": s["steps"],
            "runq_ms": round(mine_in or 0.0, 3), "others_runq_ms": round(others_in or 0.0, 3),
            "extra_runq_ms": round(robust.median(mine), 3) if mine else 0.0,
            "gap_ms": round(gap_ms, 3), "step_rise_ms": step_rise,
            "runq_rise_ms": rise(mine_in, mine_out), "others_runq_rise_ms": rise(others_in, others_out),
            "persists": round(persists, 3)}


def _find(
    con: Any, steps: list[int], host_of: dict[int, str], thr: dict[tuple[int, str], float],
    median_step: float, data: Series, raw: Series | None = None,
    candidates: frozenset[tuple[int, str]] | None = None,
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
        if t is None or (candidates is not None and (rank, name) not in candidates):
            continue  # no straggler to find here (candidates_of: a bound)
        tt = _series_tests(xa[None, :], np.array([t], dtype=np.float64), median_step, n_steps)
        high = tt.high[0]
        idx = at[high]
        bar = float(tt.bar[0])
        whole = float(tt.whole[0])
        if tt.chronic[0]:
            seg = at.tolist()
            if raw is not None:
                whole = _raw_chronic(raw, (rank, name), at, whole)
            out.append(_straggler(con, rank, name, host_of, steps, seg, whole, "chronic",
                                  _confidence(len(seg), 1.0, whole / t)))
            # A window on top of the chronic level is still looked for below.
        elif tt.dense[0] and len(idx) and _spans_run(idx, n_steps):
            # Flagged on most steps across the run: one chronic straggler, whatever its holes.
            med = float(np.median(xa[high]))
            if (min(med, whole) >= _naming_floor(median_step)
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
        # Windows are measured from the series' median; a window over more than half the
        # steps (yet too short to be chronic) lifts that median into itself, and nothing
        # stands out from it (a rank slow on steps 50-150 of 200 was missed). A gap's level
        # at par is what it is on the steps not flagged: windows are measured from there.
        base = None
        if whole > bar and tt.dense[0] and len(idx) < len(xa):
            base = float(np.median(xa[~high]))
        if len(xa) < min_n or not changepoint.may_hold_window(
                xa, bar, whole if base is None else base):
            continue  # a bound, not a guess: elevated() would find no window here
        xs = xa.tolist()
        own = own_a.tolist()
        pts = list(zip(at.tolist(), xs, strict=True))
        chronic_done = any(o["rank"] == rank and o["phase"] == name for o in out)
        for w in changepoint.elevated(xs, bar, baseline=base, min_len=min_n):
            seg = [i for i, _ in pts[w.start:w.end + 1]]
            chronic = _spans_run(seg, n_steps)
            if chronic and chronic_done:
                continue
            # Chronic: the gap itself (to the other ranks' median), not over a short outside.
            if chronic:
                level = robust.median(xs[w.start:w.end + 1])
                if level < _naming_floor(median_step):
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
                if raw is not None and (rank, name) in raw:
                    # Run-queue wait explains a gap away, never makes one: a window the net
                    # series alone shows (another rank's wait for a CPU taken out of it) cost
                    # no one a wait. The raw gap over these steps must clear the same bar.
                    rp, rg, _ = raw[(rank, name)]
                    sel = np.isin(rp, seg)
                    r_in = float(np.median(rg[sel])) if sel.any() else 0.0
                    r_out = float(np.median(rg[~sel])) if (~sel).any() else 0.0
                    if min(r_in, r_in - r_out) < bar:
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
    the same steps: what the others waited. The net series takes a rank's extra wait for a
    CPU out of its gaps on the steps where it covers them, so its level can sit under what the
    other ranks really waited for it."""
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
    con.execute("CREATE OR REPLACE TEMP TABLE flagged_steps (step BIGINT)")
    con.execute("INSERT INTO flagged_steps SELECT unnest(?::BIGINT[])", [flagged])
    rows = con.execute(
        f"""SELECT q.rank, median(q.wait_ms - r.wait_ms), median(q.wait_ms)
            FROM step_waits q JOIN step_waits r ON q.step = r.step AND r.rank = {int(s['rank'])}
            WHERE q.rank <> {int(s['rank'])} AND q.step IN (SELECT step FROM flagged_steps)
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
            f"""SELECT coalesce(phase, '{RESIDUAL}'), sum(wait) FROM collective_waits
                WHERE rank IN ({ids}) AND step IN (SELECT step FROM flagged_steps)
                GROUP BY 1 ORDER BY 2 DESC LIMIT 1"""
        ).fetchone()
        s["wait_phase"] = str(row[0]) if row and row[1] else None
    con.execute("DROP TABLE flagged_steps")


#: Wait sources that measure every rank's time in its collectives (no clocks compared).
MEASURED = ("collectives", "grad_sync", "collectives+timeline")
MEASURED_SHARE = 0.8


def unwaited(con: Any, stragglers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chronic stragglers no other rank waited for, where waits are measured.

    A rank is a straggler because the others wait for it at their next collective. When a
    rank's gap in one phase is made up by the others elsewhere before that collective (rank 0
    longer in forward, rank 1 as much longer in backward's own compute), they all arrive
    together: no rank's wait rose by the :func:`_add_victims` bar, and the gap cost the job
    nothing. Only where the other ranks' waits were measured (matched collectives) on at least
    :data:`MEASURED_SHARE` of the straggler's steps.
    """
    out = []
    for s in stragglers:
        if s["persistence"] != "chronic" or s["victims"]:
            continue
        first, last, rank = int(s["first_step"]), int(s["last_step"]), int(s["rank"])
        row = con.execute(
            f"""SELECT (SELECT count(*) FROM (SELECT DISTINCT rank, step FROM collective_waits
                                              WHERE matched AND rank <> {rank}
                                                AND step BETWEEN {first} AND {last})),
                       (SELECT count(*) FROM steps WHERE rank <> {rank}
                                                     AND step BETWEEN {first} AND {last})"""
        ).fetchone()
        # Measured on most of the other ranks' steps (a partition that could not be matched
        # leaves a rank's wait unknown, not absent).
        if row and row[1] and row[0] >= MEASURED_SHARE * row[1]:
            out.append(s)
    return out


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
            FROM own_excess WHERE name = {sql_literal(name)} {who}"""
    ).fetchone()
    inside, outside, others = r if r else (None, None, None)
    base = outside if outside is not None and outside > 1e-9 else others
    if inside is None or base is None or base <= 1e-9:
        return 1.0
    return float(inside) / float(base)


def explaining(stragglers: list[dict[str, Any]], first: int, last: int,
               excess: float) -> list[dict[str, Any]]:
    """The stragglers that overlap steps ``first``..``last`` with an excess of at least
    :data:`EXPLAINS_SHARE` of a window's ``excess`` (ms per step): those that explain it."""
    return [s for s in stragglers if s["first_step"] <= last and s["last_step"] >= first
            and float(s["excess_ms"]) >= EXPLAINS_SHARE * excess]


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
    for w in changepoint.elevated_any_length(wall, bar, min_len=min_len):
        seg = at[w.start:w.end + 1]
        span = seg[-1] - seg[0] + 1
        if span >= CHRONIC_COVER * len(steps):
            continue
        first, last = steps[seg[0]], steps[seg[-1]]
        hits = explaining(stragglers, first, last, max(0.0, w.excess))
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
            ranks = list(all_ranks)
            phase, slowdown = _shared_phase(con, first, last)
            if seg[0] == 0:
                # Every rank slow from the first analysed step: warm-up (lazy init, caches,
                # allocator), not something that happened to the run. Noted, not flagged.
                warmup.update(start_step=first, end_step=last, phase=phase,
                              slowdown=round(slowdown, 3))
                continue
            if phase != "step" and slowdown <= 1.0:
                # The step time rose but no phase's own time did (on a busy host: collectives
                # every rank waited in, each rank slow on other steps): no phase to name. The
                # rule windowed stragglers follow below.
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
        phase, slowdown = _shared_phase(con, first, last)
        warmup.update(start_step=first, end_step=last, phase=phase, slowdown=round(slowdown, 3))
        break


def _shared_phase(con: Any, first: int, last: int) -> tuple[str, float]:
    """The phase that grew most on every rank in steps [first, last], and its own slowdown
    there (``("step", 1.0)`` for a run with no phases)."""
    phase = _window_phase(con, first, last)
    return phase, own_slowdown(con, phase, first, last) if phase != "step" else 1.0


def _window_phase(con: Any, first: int, last: int) -> str:
    """The phase whose median own time grew most inside the window."""
    row = con.execute(
        f"""SELECT name, median(own) FILTER (WHERE step BETWEEN {first} AND {last})
                       - median(own) AS grow
            FROM own_excess GROUP BY 1 ORDER BY grow DESC NULLS LAST LIMIT 1"""
    ).fetchone()
    return str(row[0]) if row else "step"


def attribute(con: Any, hosts: dict[str, list[int]], ranks: list[int], median_step: float,
              steps: list[int], block_rows: BlockRows | None = None,
              series_screen: SeriesRunner | None = None,
              own_blocks: OwnBlockRunner | None = None) -> Attribution:
    """Waits, own work, stragglers, windows and the collectives view for a loaded run
    (``block_rows``: where the alignment's per-step rows are computed, :func:`align`;
    ``series_screen``: where each gap series' noise and candidacy are, :func:`screen_series`;
    ``own_blocks``: where the own-work matrices are, :func:`~stepscope.analysis.own.build_own`)."""
    n_ranks = len(ranks)
    al = align(con, hosts, n_ranks, median_step, block_rows)
    info: list[str] = []
    source, notes = build_waits(con, n_ranks, al, info)
    if source in ("collectives", "grad_sync", "collectives+timeline"):
        row = con.execute(
            """SELECT coalesce(phase, 'residual'), arg_max(op, ms) FROM (
                   SELECT phase, op, sum(wait) + 1e-9 * sum(ms) AS ms FROM collective_waits GROUP BY 1, 2)
               GROUP BY 1 ORDER BY max(ms) DESC LIMIT 1"""
        ).fetchone()
        if row:
            al.sync_phase = str(row[0]).split("/")[0]
            al.arrival = GRAD_SYNC if row[1] == DDP_OP else str(row[1])
            al.aligned = True
    series = read_gap_series(con, steps, build_own(con, own_blocks))
    screen = (screen_series if series_screen is None else series_screen)(
        series, median_step, len(steps))
    thr = screen.thresholds
    host_of = {r: h for h, rs in hosts.items() for r in rs}
    contention: list[dict[str, Any]] = []
    stragglers = find_stragglers(con, steps, host_of, thr, median_step, contention, series,
                                 screen, series_screen)
    del series
    gone = unwaited(con, stragglers) if source in MEASURED else []
    stragglers = [s for s in stragglers if s not in gone]
    warmup: dict[str, Any] = {}
    windows = find_windows(con, steps, stragglers, ranks, warmup)
    by_phase: dict[str, list[float]] = {}
    for (_, name), t in thr.items():
        by_phase.setdefault(name, []).append(t)
    thresholds = {n: robust.median(v) for n, v in by_phase.items()}
    return Attribution(al, source, thresholds, stragglers, windows,
                       collectives_section(con, source, notes + info), notes, warmup or None,
                       contention, gone)
