"""Verdicts: what the numbers mean and what to do, each with its evidence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepscope.analysis import cost
from stepscope.analysis.host import is_host_busy
from stepscope.analysis.resource_use import resource_verdicts
from stepscope.analysis.stats import RESIDUAL
from stepscope.analysis.verdict import Consequence, Verdict
from stepscope.common.robust import median

#: Share of step time above which a phase is called a bottleneck (warning / critical).
INPUT_SHARE = (0.15, 0.30)
H2D_SHARE = (0.10, 0.25)
HOST_SHARE = (0.25, 0.40)  # untimed Python work of an eager loop on a busy host reaches ~20%
WAIT_SHARE = (0.08, 0.20)
COMPUTE_SHARE = 0.60
#: Share of the time held above which exposed communication, when the largest part, is named.
COMM_SHARE = 0.10
#: A goodput loss category at or above this share of the time held always has a finding.
LARGE_LOSS = 0.10

_STRAGGLER_FIX = {
    "dataloader": "check that rank's data shard, storage and CPU (noisy neighbour, fewer cores); "
    "give its DataLoader more workers (num_workers), persistent_workers=True, or wrap it "
    "in stepscope.PrefetchLoader",
    "h2d": "check that rank's host-to-device path (pin_memory=True, non_blocking=True, "
    "NUMA/PCIe placement); stepscope.PrefetchLoader overlaps the copy with compute",
    "forward": "check that rank's device (throttling, ECC, other processes) and its inputs "
    "(longer sequences or bigger batches on that rank)",
    "backward": "check that rank's device (throttling, other processes) and whether its inputs "
    "are larger; its backward compute, not the all-reduce, is slow",
    "optimizer": "check that rank's device and CPU: optimizer steps on CPU, foreach=False, or "
    "extra per-rank work (EMA, logging) after backward",
    "residual": "that rank does extra untimed work per step (logging, checkpoints, .item() "
    "syncs, Python overhead); time it with stepscope.phase(...) to see which",
}


def _pct(x: float | None) -> str:
    return f"{100.0 * (x or 0.0):.0f}%"


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 8:
        return ", ".join(str(r) for r in ranks[:8]) + f", … ({len(ranks)} ranks)"
    if len(ranks) > 1:
        return ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def ranks_subject(ranks: list[int], verb: str, verb_plural: str) -> str:
    """``rank 0 waits`` / ``ranks 0 and 2 wait``: the subject and its verb, in agreement."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} {verb}"
    return f"ranks {_ranks_text(ranks)} {verb_plural}"


def steady_share(phases: dict[str, Any], name: str, key: str = "share") -> float:
    """:func:`rank_share` with each rank's single slowest call of the phase left out (of
    both the phase and the step time): a one-off, such as the first batch (which builds the
    DataLoader's iterator and starts its workers), is not a steady cost. A clean 80-step
    demo run's 23 ms first batch made its dataloader 15% of the run against 8% without it."""
    ph = phases.get(name)
    if not ph or ph["share"] is None:
        return 0.0
    vals = []
    for p in ph["per_rank"]:
        s = (p.get(key) if p.get(key) is not None else p["share"]) or 0.0
        one = min(p.get("max_share") or 0.0, s)
        vals.append((s - one) / (1.0 - one) if one < 1.0 else 0.0)
    vals += [0.0] * (max(1, len(ph["per_rank"])) - len(vals))
    return median(vals)


def rank_share(phases: dict[str, Any], name: str, key: str = "share") -> float:
    """Median over ranks of the phase's share of that rank's step time (0 when absent).

    ``key="own_share"`` takes the phase's waits out first, ``"work_share"`` all collective
    time inside it (both fall back to ``share``).
    """
    ph = phases.get(name)
    if not ph or ph["share"] is None:
        return 0.0
    n_ranks = max(1, len(ph["per_rank"]))
    shares = [(p.get(key, p["share"]) if p.get(key) is not None else p["share"]) or 0.0
              for p in ph["per_rank"]]
    shares += [0.0] * (n_ranks - len(shares))
    return median(shares)


@dataclass(frozen=True)
class _Basis:
    """What every finding of one run is priced against."""

    run: dict[str, Any]
    #: ``run["cost"]``: summed step time, world size, median step (see :func:`cost.price`).
    job: dict[str, Any]
    world: int
    step_med: float
    #: The phase the ranks synchronise in (None when they never wait for each other).
    sync: str | None

    @property
    def mean_step(self) -> float:
        return _mean_step(self.job, self.run)

    def price_share(self, share: float, held: int | None = None) -> dict[str, Any]:
        """The cost of a share of every analysed step's time on ``held`` ranks (all)."""
        return cost.price(self.job, share * self.mean_step, self.run["steps"],
                          self.world if held is None else held)


def _basis(run: dict[str, Any]) -> _Basis:
    step_med = run["step_ms"]["median"] or 0.0
    job = run.get("cost") or {"total_ms": step_med * run["steps"], "world_size": run["ranks"],
                               "median_step_ms": step_med}
    return _Basis(run, job, int(job.get("world_size") or run["ranks"] or 1), step_med,
                  run["alignment"]["sync_phase"])


def diagnose(
    run: dict[str, Any],
    phases: dict[str, Any],
    ranks: list[dict[str, Any]],
    stragglers: list[dict[str, Any]],
    windows: list[dict[str, Any]],
    goodput: dict[str, Any] | None = None,
) -> list[Verdict]:
    """The run's verdicts, most severe first: stragglers (a rank, a host), the waits they
    cause, the bottleneck phases, slow step windows, "balanced" when nothing costs the job,
    and the resource findings.

    ``goodput``: the report's goodput section; the bottleneck advice follows its split of the
    time (:func:`measured_split`), so the advice and the goodput agree.
    """
    b = _basis(run)
    out = _straggler_verdicts(b, stragglers)
    out += _host_verdicts(run, stragglers, out)
    wait_share = median([r["wait_share"] or 0.0 for r in ranks])
    out += _wait_verdicts(b, ranks, stragglers, windows, wait_share, out)
    bottlenecks = _bottleneck_verdicts(b, phases, ranks, stragglers, goodput, out)
    out += bottlenecks
    out += _window_verdicts(b, windows, stragglers)
    out += _balanced_verdicts(b, ranks, wait_share, out, bool(bottlenecks))
    _price_waits(out)
    out += resource_verdicts(run, stragglers, out)
    cost.order(out)
    return out


def _straggler_verdicts(b: _Basis, stragglers: list[dict[str, Any]]) -> list[Verdict]:
    """One ``straggler`` per late rank (its biggest excess), the worst few, priced on every
    rank its collective holds."""
    out = []
    step_med = b.step_med
    for s in _top_stragglers(stragglers):
        impact = s["excess_ms"] / step_med if step_med else 0.0
        chronic = s["persistence"] == "chronic"
        when = (f"on {s['steps']} steps ({s['first_step']}–{s['last_step']}, chronic)" if chronic
                else f"on {s['steps']} steps in the window {s['first_step']}–{s['last_step']}")
        # Every rank of the collective waits for it: its excess holds the whole world.
        held = b.world if (s.get("victims") or b.sync) else 1
        c = cost.price(b.job, s["excess_ms"], s["steps"], held,
                       step_med if chronic else step_med + s["excess_ms"])
        ev = (f"rank {s['rank']}" + (f" (host {s['host']})" if s.get("host") else "")
              + f" spends {s['excess_ms']:.1f} ms more than the median rank in "
              f"{s['phase']} {when} ({_pct(impact)} of the run's median step, {step_med:.1f} ms)")
        if s.get("victims"):
            ev += (f"; {ranks_subject(s['victims'], 'waits', 'wait')} ≈ {s['victim_wait_ms']:.1f} ms "
                   f"per step for it in {s.get('wait_phase') or b.sync} (the collective)")
        ev += _cost_text(c)
        out.append(Verdict(
            kind="straggler", severity=cost.severity(cost.share(c)), evidence=ev,
            suggestion=f"Look at rank {s['rank']}'s {s['phase']}: "
            + _STRAGGLER_FIX.get(s["phase"], "time its sub-steps with stepscope.phase(...)"),
            cost=c, subject=f"rank {s['rank']} slow in {s['phase']}",
            rank=s["rank"], phase=s["phase"]))
    return out


def _wait_verdicts(b: _Basis, ranks: list[dict[str, Any]], stragglers: list[dict[str, Any]],
                  windows: list[dict[str, Any]], wait_share: float,
                  found: list[Verdict]) -> list[Verdict]:
    """``comm_wait``: the ranks that wait in the collective for a late one (priced as the
    first straggler in ``found`` when there is one: the same time, seen from the waiters)."""
    sync = b.sync
    # Without a culprit, waiting is arrival jitter (OS scheduling, noise): it is reported in
    # the balanced verdict, not raised as an alarm.
    if not (sync and wait_share >= WAIT_SHARE[0] and (stragglers or windows)):
        return []
    # The culprits arrive last: they are what the others wait for, never among the waiters.
    culprits = {s["rank"] for s in stragglers}
    waiting = [r for r in ranks
               if (r["wait_share"] or 0.0) >= WAIT_SHARE[0] and r["rank"] not in culprits]
    waiting = waiting or [r for r in ranks if r["rank"] not in culprits] or ranks
    shown_share = median([r["wait_share"] or 0.0 for r in waiting])
    cause = (f"rank {stragglers[0]['rank']} ({stragglers[0]['phase']}) arrives last"
             if stragglers else "arrival order varies from step to step (jitter, no single culprit)")
    who = ranks_subject([r["rank"] for r in waiting], "spends", "spend")
    of = "its" if len(waiting) == 1 else "their"
    med = "" if len(waiting) == 1 else " (median over these ranks)"
    c = b.price_share(shown_share, len(waiting))
    sev = cost.severity(cost.share(c))
    first = next((v for v in found if v.kind == "straggler"), None)
    if first is not None:
        # The wait is the straggler's price seen from the other ranks: counted once, there.
        c, sev = first.cost or c, first.severity
    return [Verdict(
        kind="comm_wait",
        severity=sev,
        evidence=f"{who} {_pct(shown_share)} of {of} step time{med} waiting in {sync} "
        f"for the last rank to arrive at the collective; {cause}"
        + (_cost_text(c) if first is None else " (its cost is the straggler's)"),
        suggestion="Fix the late rank first; then balance per-rank work (equal shard "
        "sizes, sequence-length bucketing) so ranks arrive together",
        cost=c, subject=f"waiting in {sync}",
    )]


def _bottleneck_verdicts(b: _Basis, phases: dict[str, Any], ranks: list[dict[str, Any]],
                        stragglers: list[dict[str, Any]], goodput: dict[str, Any] | None,
                        found: list[Verdict]) -> list[Verdict]:
    """Where the step time goes: input, host-to-device copies, untimed host work, exposed
    communication, else (when none of these) model compute. A bottleneck a straggler in
    ``found`` accounts for takes its cost (:func:`_unless_straggler`)."""
    split = measured_split(goodput)
    largest = max(split, key=lambda k: split[k]) if split else "compute"
    out = [v for v in (_input_verdict(b, phases, ranks, found), _h2d_verdict(b, phases, ranks, found),
                       _host_overhead_verdict(b, phases, found), _comm_bound_verdict(b, split, largest))
           if v is not None]
    # Own work less every collective inside (waits and transfers): the compute goodput counts.
    compute = sum(rank_share(phases, n, "work_share") for n in ("forward", "backward", "optimizer"))
    if out or compute < COMPUTE_SHARE or largest != "compute":
        return out
    ev = (f"forward+backward+optimizer take {_pct(compute)} of step time (own work, "
          "waiting and communication excluded)")
    if split:
        ev += f"; the time splits as {_split_text(split)}"
    al = b.run["alignment"]
    if b.sync == "backward" and al["arrival"] == "backward" and not stragglers:
        ev += ("; backward includes the all-reduce, so a rank slow inside backward "
               "compute cannot be told from communication without collective timing")
    return [Verdict(
        kind="compute_bound", severity="info", evidence=ev,
        cost=cost.no_cost(b.job),
        suggestion="The step is dominated by model compute: try mixed precision, "
        "torch.compile, fused optimizers, or a larger batch per step",
    )]


def _input_verdict(b: _Basis, phases: dict[str, Any], ranks: list[dict[str, Any]],
                   found: list[Verdict]) -> Verdict | None:
    # Waits inside the batch fetch (a gather across ranks) are not input time.
    dl = steady_share(phases, "dataloader", "work_share")
    if dl < INPUT_SHARE[0]:
        return None
    sev, c, because = _unless_straggler(found, "dataloader", dl, INPUT_SHARE[0], b.job,
                                        b.price_share(dl))
    return Verdict(
        kind="input_bound",
        severity=sev, cost=c, subject="the dataloader",
        evidence=_input_evidence(rank_share(phases, "dataloader", "work_share"), dl,
                                 phases["dataloader"], len(ranks), b.run["steps"], b.step_med)
        + (because or _cost_text(c)),
        suggestion="Raise DataLoader num_workers, set persistent_workers=True and "
        "pin_memory=True, increase prefetch_factor, or move decoding/augmentation off the "
        "training process; stepscope.PrefetchLoader overlaps the next batch's copy",
    )


def _h2d_verdict(b: _Basis, phases: dict[str, Any], ranks: list[dict[str, Any]],
                 found: list[Verdict]) -> Verdict | None:
    h2d = rank_share(phases, "h2d", "work_share")
    if h2d < H2D_SHARE[0]:
        if not phases.get("h2d_hidden"):
            return None
        hid = phases["h2d_hidden"]["median_ms"]
        return Verdict(
            kind="h2d_bound", severity="info", cost=cost.no_cost(b.job),
            evidence=f"PrefetchLoader hides {hid:.2f} ms of host-to-device copy per step; "
            f"exposed copy is {_pct(h2d)} of step time",
            suggestion="Nothing to do: the copy is overlapped (keep pin_memory=True, "
            "non_blocking=True)",
        )
    ev = (f"exposed host-to-device copy takes {_pct(h2d)} of step time (median "
          f"{phases['h2d']['median_ms']:.2f} ms per step on {len(ranks)} ranks)")
    hidden = phases.get("h2d_hidden")
    if hidden:
        ev += f"; a PrefetchLoader already hides {hidden['median_ms']:.2f} ms per step"
    sev, c, because = _unless_straggler(found, "h2d", h2d, H2D_SHARE[0], b.job, b.price_share(h2d))
    return Verdict(
        kind="h2d_bound",
        severity=sev, cost=c,
        subject="host-to-device copies",
        evidence=ev + (because or _cost_text(c)),
        suggestion="Wrap the loader in stepscope.PrefetchLoader to copy the next batch "
        "on a side stream while this one computes; use pin_memory=True in the DataLoader "
        "and .to(device, non_blocking=True)",
    )


def _host_overhead_verdict(b: _Basis, phases: dict[str, Any],
                           found: list[Verdict]) -> Verdict | None:
    # Collectives issued outside every phase (a pipeline's send/recv) are communication,
    # not host overhead: judged on the residual's work share.
    res = rank_share(phases, "residual", "work_share")
    if res < HOST_SHARE[0]:
        return None
    sev, c, because = _unless_straggler(found, RESIDUAL, res, HOST_SHARE[0], b.job,
                                        b.price_share(res))
    return Verdict(
        kind="host_overhead",
        severity=sev, cost=c,
        subject="untimed host work between phases",
        evidence=f"{_pct(res)} of step time is outside every timed phase and outside "
        f"every collective (median {phases['residual']['median_ms']:.2f} ms per step "
        "including collectives)" + (because or _cost_text(c)),
        suggestion="Find the untimed work with stepscope.phase(...): logging, "
        ".item()/.cpu() syncs, checkpointing, Python overhead; batch logging and use "
        "torch.compile or CUDA graphs to cut launch overhead",
    )


def _comm_bound_verdict(b: _Basis, split: dict[str, float] | None,
                        largest: str) -> Verdict | None:
    if not split or largest != "exposed_comm" or split["exposed_comm"] < COMM_SHARE:
        return None
    c = b.price_share(split["exposed_comm"])
    return Verdict(
        kind="comm_bound", severity="info", cost=c, subject="exposed communication",
        evidence=f"exposed communication (collective transfers on the step's path, waiting "
        f"for late ranks excluded) is the largest part of the time: {_split_text(split)}"
        + _cost_text(c),
        suggestion="Overlap or shrink the communication: accumulate gradients over "
        "micro-batches under DDP's no_sync() so the all-reduce runs once per several, use a "
        "larger batch per step, tune DDP's bucket_cap_mb so buckets go out during backward, "
        "compress gradients with a DDP comm hook (bf16/fp16, PowerSGD), or use a faster "
        "interconnect or backend (NCCL on GPUs)",
    )


def _window_verdicts(b: _Basis, windows: list[dict[str, Any]],
                    stragglers: list[dict[str, Any]]) -> list[Verdict]:
    """A finding for each slow step window no straggler explains, named after its phase."""
    out = []
    for w in windows:
        if any(s["first_step"] <= w["end_step"] and s["last_step"] >= w["start_step"]
               for s in stragglers):
            continue  # already explained by a straggler verdict
        n_w = int(w["end_step"]) - int(w["start_step"]) + 1
        n_w = int(w.get("steps") or n_w)
        c = cost.price(b.job, float(w.get("excess_ms") or 0.0), n_w, b.world,
                       b.step_med + float(w.get("excess_ms") or 0.0))
        sev = cost.severity(cost.share(c))
        # The one host rule (analysis/host.py; analyze_run has already split such windows
        # out): the CPU was shared with other processes. Priced, but a note: nothing to fix.
        host_busy = is_host_busy(w, b.run.get("clock"), stragglers)
        if host_busy:
            sev = "info"
        out.append(Verdict(
            kind=_window_kind(w["phase"]), severity=sev,
            cost=c, subject=f"steps {w['start_step']}–{w['end_step']} slow in {w['phase']}",
            evidence=f"steps {w['start_step']}–{w['end_step']}: {w['phase']} is "
            f"{w['slowdown']:.2f}× its median elsewhere on "
            f"{ranks_subject(w['ranks'], '', '').strip()} (+{float(w.get('excess_ms') or 0.0):.1f} "
            f"ms per step)" + _cost_text(c)
            + ("; every rank's host-timed compute slowed together, which is the host being busy "
               "(other processes), not one rank or the job" if host_busy else ""),
            suggestion="Something happened to every rank in that window, outside their own "
            "work (another process on the host, checkpoint, evaluation, shared storage or "
            "network contention); correlate with your logs",
        ))
    return out


def _balanced_verdicts(b: _Basis, ranks: list[dict[str, Any]], wait_share: float,
                      found: list[Verdict], bottlenecks: bool) -> list[Verdict]:
    """``balanced`` when no straggler or window in ``found`` is an alarm."""
    if any(v.severity != "info" and (v.kind == "straggler" or _is_window(v)) for v in found):
        return []
    # Stragglers and windows too cheap to matter are notes; the run is still balanced.
    run = b.run
    spread = [r["step_ms"]["median"] for r in ranks if r["step_ms"]["median"] is not None]
    diff = (max(spread) - min(spread)) if spread else 0.0
    return [Verdict(
        kind="balanced", severity="info", cost=cost.no_cost(b.job),
        evidence=f"{len(ranks)} rank(s) over {run['steps']} steps stay within noise: no "
        f"rank or step window costs the job >= {100 * cost.WARNING_SHARE:g}% of its time "
        f"(median step {b.step_med:.2f} ms, rank medians "
        f"differ by {diff:.2f} ms)" + _balanced_notes(run, wait_share),
        suggestion="No straggler to fix" + (
            "; see the bottleneck verdict for where step time goes" if bottlenecks else ""),
    )]


def _is_window(v: Verdict) -> bool:
    """A slow-step-window finding (its subject names the steps)."""
    return (v.subject or "").startswith("steps ")


def _unless_straggler(out: list[Verdict], phase: str, share: float, floor: float,
                      job: dict[str, Any], c: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """A phase's bottleneck that a straggler in that phase accounts for is that straggler's
    consequence: its share less the straggler's excess (its time lost over the job's) falls
    under the bar. Then the verdict takes the straggler's cost object and severity (folded into
    it by :func:`stepscope.analysis.cost.fold`) and says so; else its own price."""
    total = float(job.get("total_ms") or 0.0)
    for v in out:
        if v.kind != "straggler" or v.phase != phase or v.cost is None or total <= 0:
            continue
        if share - float(v.cost["lost_ms"]) / total < floor:
            return (v.severity, v.cost,
                    f"; without rank {v.rank}'s excess in {phase} it would be under "
                    f"{_pct(floor)} (its cost is the straggler's)")
    return cost.severity(cost.share(c)), c, ""


#: The parts of the time held that the advice is chosen from, as goodput names them.
_SPLIT = {"compute": "compute", "exposed_comm": "exposed communication",
          "stragglers": "waiting for late ranks", "input_stalls": "input", "host_overhead": "host"}


def measured_split(goodput: dict[str, Any] | None) -> dict[str, float] | None:
    """Shares of the time the job held (goodput's basis): ``compute`` (productive),
    ``exposed_comm``, ``stragglers`` (waiting for late ranks), ``input_stalls``,
    ``host_overhead``; None without a goodput section."""
    if not goodput or not goodput.get("gpu_hours"):
        return None
    total = float(goodput["gpu_hours"])
    lost = goodput.get("lost_gpu_hours") or {}
    out = {"compute": float(goodput.get("productive_gpu_hours") or 0.0) / total}
    out.update({k: float(lost.get(k) or 0.0) / total for k in _SPLIT if k != "compute"})
    return out


def _split_text(split: dict[str, float]) -> str:
    return ", ".join(f"{_SPLIT[k]} {_pct(v)}" for k, v in sorted(split.items(), key=lambda kv: -kv[1]))


#: Goodput's loss categories and the finding kinds that account for each.
_EXPLAINED_BY = {
    "stragglers": ("straggler", "comm_wait", "pipeline_bubble", "balanced"),
    "exposed_comm": ("comm_bound",),
    "input_stalls": ("input_bound", "h2d_bound"),
    "host_overhead": ("host_overhead",),
}
#: Phases whose straggler's excess goodput books in these categories.
_STRAGGLER_PHASES = {"input_stalls": ("dataloader", "h2d"), "host_overhead": (RESIDUAL,)}
_LOSS_TEXT = {
    "stragglers": ("waiting in collectives for the last rank to arrive",
                   "Find the late rank with `stepscope locate`; time its phases"),
    "exposed_comm": ("collective transfers on the step's path",
                     "Overlap or shrink the communication (no_sync() accumulation, larger batches, "
                     "bucket_cap_mb, a compressing comm hook)"),
    "input_stalls": ("exposed dataloader and host-to-device time",
                     "Raise DataLoader num_workers or wrap it in stepscope.PrefetchLoader"),
    "host_overhead": ("untimed work inside the steps",
                      "Time the untimed work with stepscope.phase(...)"),
    "warmup": ("the slow first steps (lazy initialisation, caches, the allocator)",
               "Nothing to fix in a long run; in a short one, warm up before timing"),
    "outside_steps": ("time between steps (evaluation, checkpoints, logging)",
                      "Time what runs between steps with stepscope.phase(...), or run it less often"),
    "restarts": ("relaunch gaps and steps re-done after a restart",
                 "Checkpoint more often, and find why the job restarted"),
}


def explain_goodput(run: dict[str, Any], verdicts: list[Verdict],
                    goodput: dict[str, Any] | None) -> list[Verdict]:
    """A note (``goodput_loss``, priced) for each goodput loss category of at least
    :data:`LARGE_LOSS` of the time held that no finding accounts for: a large loss in goodput
    always has a finding that explains it. Notes, not alarms: the time is lost, but no fault
    of the job's is known to cause it."""
    if not goodput or not goodput.get("gpu_hours"):
        return []
    total = float(goodput["gpu_hours"])
    kinds = {v.kind for v in verdicts} | {c.kind for v in verdicts for c in v.consequences}
    kinds |= {"straggler" for v in verdicts if _is_window(v)}
    job = run.get("cost") or {"total_ms": 0.0, "world_size": run.get("ranks") or 1}
    world = int(job.get("world_size") or run.get("ranks") or 1)
    total_ms = float(job.get("total_ms") or 0.0) * max(1, world)
    out: list[Verdict] = []
    for cat, hours in (goodput.get("lost_gpu_hours") or {}).items():
        share = float(hours or 0.0) / total
        if kinds & set(_EXPLAINED_BY.get(cat, ())):
            _book_on_straggler(verdicts, cat, share, goodput)
            continue
        # A straggler's slow work in an input or residual phase is in this category on its
        # rank: what is left without it is what needs a finding.
        for v in verdicts:
            if (v.kind == "straggler" and v.phase in _STRAGGLER_PHASES.get(cat, ()) and total_ms
                    and v.cost is not None):
                share -= float(v.cost["lost_ms"]) / total_ms
        if share < LARGE_LOSS:
            continue
        what, fix = _LOSS_TEXT.get(cat, (cat, "See the goodput section"))
        c = cost.price(job, share * _mean_step(job, run), run["steps"], world)
        out.append(Verdict(kind="goodput_loss", severity="info", cost=c,
                           subject=f"time lost to {cat}",
                           evidence=f"{_pct(share)} of the time the job held went to {what} "
                           + ("besides the straggler's " if share < float(hours or 0.0) / total
                              else "")
                           + f"(goodput {goodput.get('goodput', 0.0):.0%}); no fault of the "
                           "job's was found behind it" + _cost_text(c),
                           suggestion=fix))
    return out


def _book_on_straggler(verdicts: list[Verdict], cat: str, share: float,
                       goodput: dict[str, Any]) -> None:
    """The goodput a straggler cost (the time the other ranks waited for a late one) is its
    consequence: said once, inside the costliest straggler finding."""
    if cat != "stragglers" or share <= 0.0:
        return
    top = max((v for v in verdicts if v.kind == "straggler"), key=cost.lost_ms, default=None)
    if top is None:
        return
    top.consequences.append(Consequence(
        kind="goodput", subject="goodput",
        evidence=f"goodput {goodput.get('goodput', 0.0):.0%}: {_pct(share)} of the time the "
        "job held went to waiting in collectives for the last rank to arrive"))



def _price_waits(out: list[Verdict]) -> None:
    """comm_wait is the price of a straggler or window seen from the waiting ranks: it takes
    the costliest one's cost and severity (counted once), never more."""
    causes = [v for v in out if v.kind == "straggler" or _is_window(v)]
    for v in out:
        if v.kind != "comm_wait" or not (v.subject or "").startswith("waiting in") or not causes:
            continue
        top = max(causes, key=cost.lost_ms)
        if v.cost is not top.cost:
            v.cost, v.severity = top.cost, top.severity
            v.evidence = v.evidence.split(". Cost:")[0] + f" (its cost is {top.subject}'s)"


def _mean_step(job: dict[str, Any], run: dict[str, Any]) -> float:
    """Mean step time of the analysed steps (shares of the total convert to it)."""
    n = max(1, int(run["steps"] or 1))
    return float(job.get("total_ms") or 0.0) / n


def _cost_text(c: dict[str, Any]) -> str:
    if not c["lost_ms"]:
        return ""
    return (f". Cost: {c['ms_per_step']:.1f} ms on each of {c['steps']} steps = "
            f"{c['lost_ms'] / 1000.0:.2f} s, {100 * cost.share(c):.1f}% of the job's time "
            f"(step would be {c['what_if_step_ms']:.1f} ms without it)")


def _balanced_notes(run: dict[str, Any], wait_share: float) -> str:
    al = run["alignment"]
    out = ""
    if al["sync_phase"] and wait_share > 0.0:
        out += (f"; ranks wait {_pct(wait_share)} of their step time (median over ranks) in "
                f"{al['sync_phase']} for jittery arrivals, with no rank consistently late")
    if al["sync_phase"] == "backward" and al["arrival"] == "backward":
        out += ("; note: backward holds the all-reduce and no collective timing was recorded, "
                "so a rank slow inside backward compute delays every rank equally and cannot be "
                "singled out")
    return out


def _input_evidence(share: float, steady: float, ph: dict[str, Any], n_ranks: int, steps: int,
                    step_med: float) -> str:
    """The input_bound sentence: a share of total time and the per-step median, reconciled."""
    ev = (f"dataloader takes {_pct(share)} of total step time (median over {n_ranks} "
          f"rank{'s' if n_ranks != 1 else ''}); {_pct(steady)} without each rank's slowest batch; "
          f"per step it takes a median {ph['median_ms']:.2f} ms and a p90 {ph['p90_ms']:.2f} ms "
          f"over {steps} steps")
    if step_med and ph["median_ms"] is not None and ph["median_ms"] < 0.5 * share * step_med:
        ev += ": the time is concentrated in the slow steps, not spread over every step"
    return ev


def _window_kind(phase: str) -> str:
    return {"dataloader": "input_bound", "h2d": "h2d_bound", "residual": "host_overhead"}.get(
        phase, "comm_wait" if phase == "backward" else "compute_bound")


def _top_stragglers(stragglers: list[dict[str, Any]], n: int = 5) -> list[dict[str, Any]]:
    """One verdict per rank (its biggest excess), the worst few."""
    seen: set[int] = set()
    out = []
    for s in stragglers:
        if s["rank"] not in seen:
            seen.add(s["rank"])
            out.append(s)
    return out[:n]


def _host_verdicts(run: dict[str, Any], stragglers: list[dict[str, Any]],
                   found: list[Verdict]) -> list[Verdict]:
    """When every rank of a host straggles (and others do not), blame the host."""
    hosts = run["hosts"]
    if len(hosts) < 2:
        return []
    slow = {s["rank"] for s in stragglers}
    out = []
    for host, members in hosts.items():
        if len(members) > 1 and set(members) <= slow and len(slow) < run["ranks"]:
            phases = sorted({s["phase"] for s in stragglers if s["rank"] in members})
            # The host's price is its worst member's: they all hold the same collective.
            costs = [v.cost for v in found if v.kind == "straggler" and v.cost is not None
                     and any(f"rank {m} " in f"{v.subject} " for m in members)]
            c = max(costs, key=lambda x: x["lost_ms"]) if costs else None
            if c is None:
                continue
            out.append(Verdict(
                kind="straggler", severity=cost.severity(cost.share(c)), cost=c,
                subject=f"host {host}",
                evidence=f"all {len(members)} ranks of host {host} ({_ranks_text(members)}) "
                f"are slow in {', '.join(phases)} while other hosts are not",
                suggestion=f"Look at host {host} as a whole (thermal throttling, a shared "
                "disk or NIC, another job); consider excluding it",
            ))
    return out
