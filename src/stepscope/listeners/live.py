"""Live summaries: this rank's recent records, the cross-rank exchange and the one-line log."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from stepscope.common.errors import warn
from stepscope.common.escape import one_line
from stepscope.common.escape import rich as rich_escape
from stepscope.common.robust import median
from stepscope.common.waits import last_arriver, waits
from stepscope.instrument.resource_sampler import (  # [metrics]
    cross_rank_fields,
    line_suffix,
    payload_fields,
    summarize_records,
)
from stepscope.listeners.profiler import unobserved

if TYPE_CHECKING:
    from stepscope.recording.protocols import Run

#: Records kept per rank for ``summary()`` and the live exchange.
WINDOW = 100
#: Bytes of JSON each rank contributes to one exchange (phases are dropped to fit).
PAYLOAD_BYTES = 1024
#: Timeout of the side gloo group. Ranks issue their exchange at the same step count, so a
#: long wait means a rank stopped stepping; a short timeout keeps a pending exchange from
#: holding up process exit (gloo joins its worker threads on destroy).
EXCHANGE_TIMEOUT_S = 120.0
#: How long ``finish()`` waits for exchanges still in flight (seconds). Past it, a peer
#: is behind or stuck: the pending exchanges are left unfinished (see ``_park``), so this is
#: the longest the live view adds to a rank's exit, however long a peer stays stuck.
FINISH_WAIT_S = 2.0

# One side group per member set and process: creating a second group over the same ranks
# with local synchronisation would reuse its store keys.
_SIDE_GROUPS: dict[tuple[int, ...], Any] = {}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step and phase times (ms) and shares of step time over ``records``.

    ``h2d_share`` and ``dataloader_share`` are the exposed parts: time the step spent in
    those phases (a copy hidden by a prefetcher is not in them).
    """
    if not records:
        return {"steps": 0}
    step_med = median(r["step_ms"] for r in records)
    # Shares are one statistic over one set of steps: total phase time / total step time.
    step_total = sum(r["step_ms"] for r in records)
    by_phase: dict[str, list[float]] = {}
    starts: dict[str, list[float]] = {}
    for r in records:
        for p in r["phases"]:
            if p.get("parent") is None:
                by_phase.setdefault(p["name"], []).append(p["ms"])
                starts.setdefault(p["name"], []).append(p.get("start_ms", 0.0))
        by_phase.setdefault("residual", []).append(r.get("residual_ms", 0.0))
    n = len(records)
    phases: dict[str, dict[str, Any]] = {
        name: {
            "median_ms": median(v),
            "share": sum(v) / step_total if step_total else 0.0,
            # Mean offset from step start: orders phases on the cross-rank line.
            # None, not inf, when no record gave a start: summary() is strict JSON.
            "start_ms": sum(starts[name]) / len(starts[name]) if name in starts else None,
        }
        for name, v in by_phase.items()
    }
    top = max(phases, key=lambda k: phases[k]["median_ms"])
    out_colls = _collective_medians(records)
    out: dict[str, Any] = {
        "rank": records[-1]["rank"],
        "steps": n,
        "last_step": records[-1]["step"],
        "step_ms_median": step_med,
        "step_ms_max": max(r["step_ms"] for r in records),
        "top_phase": top,
        "h2d_share": phases["h2d"]["share"] if "h2d" in phases else 0.0,
        "dataloader_share": phases["dataloader"]["share"] if "dataloader" in phases else 0.0,
        "phases": phases,
        "collectives": out_colls,
    }
    out.update(summarize_records(records))
    return out


def _collective_medians(records: list[dict[str, Any]]) -> dict[str, float]:
    """Median per-step time in each collective, keyed ``"phase|op|pg"`` (the wait rule's match).

    DDP's gradient all-reduce is the ``grad_sync`` phase (op ``ddp_allreduce`` in its parent).
    A collective counts its ``exposed_ms`` where recorded (the time the step's stream waited
    for it), as the analysis does.
    """
    per_key: dict[str, list[float]] = {}
    for r in records:
        per: dict[str, float] = {}
        for p in r.get("phases") or ():
            if p.get("name") == "grad_sync":
                key = f"{p.get('parent') or ''}|ddp_allreduce|ddp"
                per[key] = per.get(key, 0.0) + float(p.get("ms") or 0.0)
        for c in r.get("collectives") or ():
            if isinstance(c, dict) and c.get("op") and isinstance(c.get("ms"), int | float):
                key = f"{c.get('phase') or ''}|{c['op']}|{c.get('pg')}"
                ms = c.get("exposed_ms")
                per[key] = per.get(key, 0.0) + float(ms if isinstance(ms, int | float) else c["ms"])
        for k, v in per.items():
            per_key.setdefault(k, []).append(v)
    n = len(records)
    return {k: median(v + [0.0] * (n - len(v))) for k, v in per_key.items()}


def local_summary(tracer: Run) -> dict[str, Any]:
    """This rank's summary, plus ``cross_rank`` once a cross-rank exchange has completed."""
    out = summarize(tracer.recent_records())
    view: LiveView | None = tracer.live
    if view is not None and view.latest is not None and view.distributed:
        out["cross_rank"] = dict(view.latest)
    return out


# ----------------------------------------------------------------- payload codec


def encode_payload(summary: dict[str, Any], extras: dict[str, Any] | None = None) -> bytes:
    """This rank's summary as compact JSON of at most ``PAYLOAD_BYTES`` bytes."""
    if not summary.get("steps"):
        return b""
    phases = {
        name: [round(p["median_ms"], 3), round(p["share"], 4),
               round(p["start_ms"], 3) if p["start_ms"] is not None else 1e9]
        for name, p in summary["phases"].items()
    }
    body: dict[str, Any] = {
        "r": summary["rank"],
        "s": summary["last_step"],
        "n": summary["steps"],
        "m": round(summary["step_ms_median"], 3),
        "x": round(summary["step_ms_max"], 3),
        "p": phases,
        "e": extras or {},
    }
    if payload_fields(summary):
        body["t"] = payload_fields(summary)
    colls = {k: round(v, 3) for k, v in (summary.get("collectives") or {}).items()}
    if colls:
        body["c"] = colls
    raw = json.dumps(body, separators=(",", ":")).encode()
    # Collectives first: the smallest matter least to who waited.
    while len(raw) > PAYLOAD_BYTES and colls:
        del colls[min(colls, key=lambda k: colls[k])]
        raw = json.dumps(body, separators=(",", ":")).encode()
    # Too many user phases: drop the smallest until it fits (the line needs the big ones).
    while len(raw) > PAYLOAD_BYTES and len(phases) > 1:
        del phases[min(phases, key=lambda k: phases[k][0])]
        raw = json.dumps(body, separators=(",", ":")).encode()
    return raw if len(raw) <= PAYLOAD_BYTES else b""


def decode_payload(raw: bytes) -> dict[str, Any] | None:
    raw = raw.rstrip(b"\0")
    if not raw:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def cross_rank_summary(payloads: list[dict[str, Any] | None], world_size: int) -> dict[str, Any] | None:
    """Median/max step time across ranks, the slowest rank and its phase, exposed shares.

    The slowest rank is the one whose phase exceeds the cross-rank median of that phase by
    the most: in synchronous training every rank's step takes as long as the slowest, and
    the ranks that wait show it in a later phase (the all-reduce in backward). With two
    ranks the two excesses tie, and the earlier phase in the step (the cause) wins.
    """
    got = [p for p in payloads if p]
    if not got:
        return None
    step_meds = {p["r"]: p["m"] for p in got}
    max_rank = max(step_meds, key=lambda r: step_meds[r])
    names = sorted({n for p in got for n in p["p"] if n != "residual"},
                   key=lambda n: median(p["p"][n][2] for p in got if n in p["p"]))
    cands: list[tuple[float, int, int, str, float]] = []
    for order, name in enumerate(names):
        vals = {p["r"]: p["p"][name][0] if name in p["p"] else 0.0 for p in got}
        mid = median(vals.values())
        for r, v in vals.items():
            cands.append((v - mid, order, r, name, v))
    step_mid = median(step_meds.values())
    threshold = max(0.5, 0.05 * step_mid)
    best = max((c[0] for c in cands), default=0.0)
    late = _late_by_waits(got, names, threshold)
    waited_in: dict[str, Any] = {}
    if late is not None:
        slow_rank, slow_phase, slow_ms, excess, key = late
        _, op, pg = key.split("|", 2)
        waited_in = {"waited_in_op": op, "waited_in_group": pg}
        if op == "p2p":  # a pipeline: the link (global ranks, sender first) the others waited on
            waited_in["waited_on_link"] = pg.rsplit(":", 1)[-1]
    elif len(got) > 1 and best >= threshold:
        # Near-ties go to the phase that comes first in the step.
        excess, _, slow_rank, slow_phase, slow_ms = min(
            (c for c in cands if c[0] >= 0.8 * best), key=lambda c: (c[1], -c[0])
        )
    else:
        slow_rank = max_rank
        mine = next(p for p in got if p["r"] == slow_rank)["p"]
        slow_phase = max(mine, key=lambda k: mine[k][0])
        slow_ms = mine[slow_phase][0]
        others = [p["p"].get(slow_phase, [0.0])[0] for p in got]
        excess = slow_ms - median(others)

    def share(p: dict[str, Any], name: str) -> float:
        return float(p["p"][name][1]) if name in p["p"] else 0.0

    h2d = [share(p, "h2d") for p in got]
    dl = [share(p, "dataloader") for p in got]
    return {
        "step": min(p["s"] for p in got),
        "ranks": len(got),
        "world_size": world_size,
        "step_ms_median": step_mid,
        "step_ms_max": step_meds[max_rank],
        "step_ms_max_rank": max_rank,
        "slowest_rank": slow_rank,
        "slowest_phase": slow_phase,
        "slowest_phase_ms": slow_ms,
        "slowest_phase_excess_ms": round(excess, 3),
        "h2d_share": sum(h2d) / len(h2d),
        "h2d_share_max": max(h2d),
        "dataloader_share": sum(dl) / len(dl),
        "dataloader_share_max": max(dl),
        "per_rank": {str(p["r"]): {"step_ms_median": p["m"], "step_ms_max": p["x"]} for p in got},
        **waited_in,
        **_resources_cross(got),  # [metrics] job tokens/s, MFU, peak memory
    }


def _resources_cross(got: list[dict[str, Any]]) -> dict[str, Any]:
    return cross_rank_fields(got)
#: Point-to-point ops: their key's group is the link (``"world:0>1"``), reported by its two ends.
_P2P = frozenset({"send", "recv", "isend", "irecv"})


def _matched(c: dict[str, float]) -> dict[str, tuple[float, str]]:
    """A rank's collective times keyed as they match across ranks, each with its top phase.

    A collective's key is ``phase|op|group``; a point-to-point link's is ``|p2p|<link>``,
    its two ends' sends and receives summed (a sender's ``isend`` meets the receiver's
    ``irecv``), as the report's pipeline rule matches them.
    """
    out: dict[str, tuple[float, str]] = {}
    for key, ms in c.items():
        phase, op, pg = [*key.split("|", 2), "", ""][:3]
        top = phase.split("/", 1)[0] or "residual"
        if op in _P2P:
            key = f"|p2p|{pg}"
            prev_ms, prev_top = out.get(key, (0.0, top))
            out[key] = (prev_ms + float(ms), prev_top if prev_ms >= float(ms) else top)
        else:
            out[key] = (float(ms), top)
    return out


def _late_by_waits(
    got: list[dict[str, Any]], names: list[str], threshold: float
) -> tuple[int, str, float, float, str] | None:
    """The late rank by the wait rule on the exchanged collective times, its phase, and the
    collective key (``phase|op|group``, ``|p2p|<link>`` for a pipeline link) the others
    waited in most.

    For each collective every rank reported (each point-to-point link its two ends
    reported), ``waits`` gives each member's wait; the rank the others waited for most (the
    last arriver of the collective with the largest total wait) is late, and its phase is
    the one where its own work (phase time minus its waits there) exceeds the other ranks'
    median the most. None without a clear wait.
    """
    if len(got) < 2 or not all(p.get("c") for p in got):
        return None
    colls = {p["r"]: _matched(p["c"]) for p in got}
    keys = set.union(*(set(c) for c in colls.values()))
    wait: dict[int, dict[str, float]] = {p["r"]: {} for p in got}
    best_key, best_total, best_times = None, 0.0, {}
    for key in sorted(keys):
        have = {r: c[key] for r, c in colls.items() if key in c}
        if len(have) != (2 if key.startswith("|p2p|") else len(got)):
            continue  # a rank without it (or a link seen from one end): no match
        times = {r: ms for r, (ms, _) in have.items()}
        w = waits(times)
        # A stage's whole time in a link is its bubble, not its own work (the report's
        # pipeline rule); which end waited for which is still the wait rule's.
        spent = times if key.startswith("|p2p|") else w
        for r, x in spent.items():
            top = have[r][1]
            wait[r][top] = wait[r].get(top, 0.0) + x
        if sum(w.values()) > best_total:
            best_key, best_total, best_times = key, sum(w.values()), times
    if best_key is None or best_total < threshold:
        return None
    late = last_arriver(best_times)
    if late is None:
        return None

    def own(p: dict[str, Any], name: str) -> float:
        ms = float(p["p"][name][0]) if name in p["p"] else 0.0
        return max(0.0, ms - wait[p["r"]].get(name, 0.0))

    mine = next(p for p in got if p["r"] == late)
    rows = [(own(mine, n) - median(own(p, n) for p in got if p["r"] != late), n)
            for n in [*names, "residual"]]
    excess, phase = max(rows)
    return late, phase, own(mine, phase), excess, best_key


def format_line(s: dict[str, Any]) -> str:
    """The one-line live log (rich markup; the phase name is escaped)."""
    return (
        f"[bold]stepscope[/] step {s['step']} | {s['ranks']}/{s['world_size']} ranks | "
        f"step {s['step_ms_median']:.1f} ms med, {s['step_ms_max']:.1f} max (r{s['step_ms_max_rank']}) | "
        f"slowest [bold red]r{s['slowest_rank']}[/]: {rich_escape(one_line(s['slowest_phase']))} "
        f"{s['slowest_phase_ms']:.1f} ms ({s['slowest_phase_excess_ms']:+.1f}) | "
        f"exposed h2d {s['h2d_share']:.0%} dl {s['dataloader_share']:.0%}"
        + (f" | pipeline: waited on r{s['slowest_rank']} over link "
           f"{rich_escape(one_line(str(s['waited_on_link'])))}" if s.get("waited_on_link") else "")
        + _resources_suffix(s)  # [metrics]
    )


def _resources_suffix(s: dict[str, Any]) -> str:
    return line_suffix(s)


# ----------------------------------------------------------------- the live view


class LiveView:
    """Exchanges per-rank summaries on a side gloo group and prints the cross-rank line.

    The training thread only enqueues an asynchronous ``all_gather`` of a prepared byte
    tensor every ``flush_every_n_steps`` steps; summarising, decoding and printing run on
    the tracer's writer thread, and a gather is read at a later cadence, never waited for.
    Every member rank issues the same number of gathers (one per cadence of step calls),
    so they pair up without a barrier.
    """

    def __init__(self, tracer: Run, log_every: int, group: Any = None, members: list[int] | None = None):
        self.tracer = tracer
        self.log_every = log_every
        self.exchange_every = tracer.config.flush_every_n_steps
        self.group = group
        self.members = members if members is not None else [tracer.rank.rank]
        self.distributed = group is not None
        self.printer = tracer.rank.rank == min(self.members)
        #: The latest cross-rank summary (``None`` until an exchange completed).
        self.latest: dict[str, Any] | None = None
        #: Decoded payloads of the latest completed exchange, by position in ``members``.
        self.latest_payloads: list[dict[str, Any] | None] = []
        #: ``fn() -> dict`` merged into this rank's payload (auto-profile trigger state).
        self.payload_extras: list[Callable[[], dict[str, Any]]] = []
        #: ``fn(payloads)`` after each completed exchange, on the writer thread.
        self.gather_callbacks: list[Callable[[list[dict[str, Any] | None]], None]] = []
        #: Lines printed so far (plain text), for tests and notebooks.
        self.lines: deque[str] = deque(maxlen=100)
        self.exchanges_done = 0
        self._printed_at = 0
        self._queued_lines = 0  # cadence lines handed to the writer thread, not yet printed
        self._calls = 0
        self._next: Any = None
        self._works: deque[tuple[Any, Any]] = deque()
        self._broken = False
        self._console: Any = None
        # The writer thread and finish() (training thread) may both read completed gathers.
        self._collect_lock = threading.Lock()

    # -- training thread

    def on_step_end(self, tracer: Run, step: int) -> None:
        try:
            self._calls += 1
            calls = self._calls
            exchange = calls % self.exchange_every == 0
            log = self.log_every > 0 and self.printer and calls % self.log_every == 0
            if exchange and self.distributed and not self._broken:
                self._issue()
            if exchange or log:
                if log:
                    self._queued_lines += 1
                tracer.submit_background(lambda: self._writer_job(log, step))
        except Exception as exc:  # protect the job: the live view is optional
            tracer.fail(exc)

    def _issue(self) -> None:
        import torch
        import torch.distributed as dist

        send = self._next
        if send is None:
            send = torch.zeros(PAYLOAD_BYTES, dtype=torch.uint8)
        out = torch.empty(len(self.members) * PAYLOAD_BYTES, dtype=torch.uint8)
        # Newer torch renamed it and warns on the old name; older torch lacks the new one.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # Asynchronous on the side gloo group: returns at once, read at a later cadence.
        # unobserved(): a profiler must not see it, or a gloo thread reaches the profiler's
        # state after the profiler stops (profiler.unobserved explains).
        with unobserved():
            work = gather(out, send, group=self.group, async_op=True)
        self._works.append((work, out))

    # -- writer thread

    def _writer_job(self, log: bool, at_step: int | None = None) -> list[dict[str, Any]]:
        # Runs as a writer item; the empty list means "no records to write".
        try:
            self._collect()
            payload = self._local_payload()
            if self.distributed:
                self._next = _to_tensor(payload)
            else:
                self._set_latest([decode_payload(payload)])
            if log:
                self._queued_lines -= 1
                self._print_cadence(at_step)
        except Exception as exc:  # protect the job: a broken view must not stop the writer
            self._break(exc)
        return []

    def _local_payload(self) -> bytes:
        extras: dict[str, Any] = {}
        for fn in self.payload_extras:
            extras.update(fn())
        # The line describes the last logging interval (Megatron-timer style), not the
        # whole window: a slow stretch of ten steps must not vanish in a 100-step median.
        interval = max(self.log_every, self.exchange_every)
        return encode_payload(summarize(self.tracer.recent_records()[-interval:]), extras)

    def _collect(self, wait_s: float = 0.0) -> None:
        with self._collect_lock:
            self._collect_locked(wait_s)

    def _collect_locked(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        works = self._works
        while works:
            work, out = works[0]
            if not work.is_completed():
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.005)  # only at finish(), bounded by FINISH_WAIT_S
                continue
            works.popleft()
            try:
                work.wait()  # already completed: returns or raises at once
            except Exception as exc:  # protect the job: a dead peer only ends the live view
                self._break(exc)
                works.clear()
                return
            data = out.numpy().tobytes()
            self._set_latest(
                [decode_payload(data[i * PAYLOAD_BYTES:(i + 1) * PAYLOAD_BYTES])
                 for i in range(len(self.members))]
            )

    def _set_latest(self, payloads: list[dict[str, Any] | None]) -> None:
        self.exchanges_done += 1
        self.latest_payloads = payloads
        summary = cross_rank_summary(payloads, len(self.members))
        if summary is not None:
            self.latest = summary
        for fn in self.gather_callbacks:
            fn(payloads)

    def _print_cadence(self, at_step: int | None) -> None:
        """The line due every ``log_every`` steps: always printed, saying why when stale."""
        label = at_step if at_step is not None else "?"
        if self.latest is None:
            self._emit(f"[bold]stepscope[/] step {label} | no cross-rank numbers yet "
                       "(the first exchange of summaries has not completed)")
            return
        fresh = self.exchanges_done > self._printed_at
        self._printed_at = self.exchanges_done
        line = format_line(dict(self.latest, step=label))
        if not fresh and self.distributed:
            line += f" | (same numbers as before: no new exchange since; data to step {self.latest['step']})"
        elif at_step is not None and self.latest["step"] < at_step - self.log_every:
            line += f" | (data to step {self.latest['step']}: records still resolving)"
        self._emit(line)

    def _print(self, summary: dict[str, Any]) -> None:
        self._printed_at = self.exchanges_done
        line = format_line(summary)
        from rich.text import Text

        plain = Text.from_markup(line).plain
        if self.lines and self.lines[-1].split(" | ", 1)[-1] == plain.split(" | ", 1)[-1]:
            return  # nothing new since the last line (finish() right after a cadence)
        self._emit(line)

    def _emit(self, line: str) -> None:
        """Print one line: through tqdm when a tqdm bar is active (so the bar is not broken)."""
        if self._console is None:
            self._console = _console()
        from rich.text import Text

        plain = Text.from_markup(line).plain
        self.lines.append(plain)
        bar = _active_tqdm()
        if bar is not None:
            bar.write(plain, file=self._console.file)
        else:
            self._console.print(line)

    def _break(self, exc: BaseException) -> None:
        if self._broken:
            return
        self._broken = True
        warn(f"live summary stopped: {exc!r}", stacklevel=2)

    # -- finish

    def on_finish(self, tracer: Run) -> None:
        try:
            # Bounded: a peer that stopped stepping must not hold up this rank's exit.
            self._collect(wait_s=FINISH_WAIT_S)
            if self._works:
                _park(self.group, list(self._works))
                self._works.clear()
            # Numbers that arrived after the last printed line (peers were behind): say them,
            # unless a cadence line is still queued on the writer thread (it will).
            if (self.log_every and self.printer and self.latest and not self._queued_lines
                    and self.exchanges_done > self._printed_at):
                self._print(dict(self.latest, step=f"{self._calls - 1} (final)"))
        except Exception as exc:  # protect the job
            self._break(exc)


def _active_tqdm() -> Any:
    """tqdm's class when tqdm is already imported and a bar is open, else None (never imports it)."""
    mod = sys.modules.get("tqdm.std") or sys.modules.get("tqdm")
    cls = getattr(mod, "tqdm", None)
    try:
        return cls if cls is not None and len(getattr(cls, "_instances", ())) > 0 else None
    except TypeError:
        return None
def _park(group: Any, works: list[Any]) -> None:
    """Keep a side group with exchanges a stuck peer never joined alive until process exit.

    Destroying a gloo group joins its worker threads, which sit in the pending exchange
    until the peer arrives or ``EXCHANGE_TIMEOUT_S`` passes: that held up exit by minutes.
    A daemon thread holding the last references is never joined and, at interpreter exit,
    never drops them, so the group's destructor (and its join) does not run. The group is
    also taken out of torch's registry, so a later ``destroy_process_group()`` skips it.
    """
    try:
        import torch.distributed.distributed_c10d as c10d

        world = c10d._world
        for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                      world.pg_to_tag, world.pg_coalesce_state):
            name = table.get(group) if table is world.pg_names else None
            table.pop(group, None)
            if name is not None:
                with contextlib.suppress(Exception):
                    getattr(c10d, "_unregister_process_group")(name)  # noqa: B009 - private
        for pgs in world.tags_to_pg.values():
            while group in pgs:
                pgs.remove(group)
    except Exception:  # torch internals differ across versions: parking still bounds exit
        pass
    for key, g in list(_SIDE_GROUPS.items()):
        if g is group:
            del _SIDE_GROUPS[key]
    threading.Thread(target=_hold, args=([group, works],), daemon=True,
                     name="stepscope-parked-exchange").start()


def _hold(refs: list[Any]) -> None:
    # This frame owns the references; a daemon thread's frame is never torn down at exit.
    threading.Event().wait()
    refs.clear()  # unreachable; keeps `refs` alive in the frame


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def _to_tensor(payload: bytes) -> Any:
    import torch

    buf = bytearray(PAYLOAD_BYTES)
    buf[: len(payload)] = payload
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def _side_group(members: list[int], world: int) -> Any:
    """The gloo group for summaries; collective over ``members`` (all ranks call init)."""
    import torch.distributed as dist

    key = tuple(members)
    group = _SIDE_GROUPS.get(key)
    if group is None:
        timeout = timedelta(seconds=EXCHANGE_TIMEOUT_S)
        if len(members) == world:
            group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            # Ranks filtered out by ``ranks=`` have no tracer and never get here.
            group = dist.new_group(members, backend="gloo", timeout=timeout, use_local_synchronization=True)
        _SIDE_GROUPS[key] = group
    return group


def attach_live(tracer: Run) -> LiveView:
    """Start the live view on ``tracer`` (idempotent): side group when distributed, log line.

    Called at init on every recording rank when any of them set ``log_every_n_steps`` or
    auto-profiling (the ranks agree first, ``dist.agree_at_init``), and by auto-profiling,
    which compares against a healthy rank through the same exchange.
    """
    view: LiveView | None = tracer.live
    log_every = tracer.config.log_every_n_steps
    if view is not None:
        if log_every and not view.log_every:
            view.log_every = log_every
            if view.printer and view._console is None:
                view._console = _console()
        return view
    group = None
    members: list[int] | None = None
    import torch.distributed as dist

    agreement = getattr(tracer, "agreement", None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        if agreement is not None:
            # Created only when every member agreed at init to create it (dist.agree_at_init):
            # a group one rank skips stalls the others and shifts the job's own group counter.
            members = list(agreement.members) if agreement.side_group else []
        else:
            ranks = tracer.config.ranks
            members = sorted(r for r in ranks if r < world) if ranks is not None else list(range(world))
        if len(members) > 1:
            group = _side_group(members, world)
        else:
            members = None
    view = LiveView(tracer, log_every, group, members)
    if log_every and view.printer:
        # Import rich now, at init: importing it later on the writer thread holds the GIL
        # long enough to stall a training step (and trip auto-profiling).
        view._console = _console()
    tracer.live = view
    tracer.add_listener(view)
    return view
