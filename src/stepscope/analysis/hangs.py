"""Reading the heartbeat files of a run: who is alive, who is stuck, who everyone waits for.

Each rank's ``rank{R}.status.json`` (see :mod:`stepscope.listeners.heartbeat`) says where the rank was
at its last write. The states this module assigns:

``finished`` / ``crashed``
    as the rank wrote them (a crash carries its exception, step and phase stack);
``dead``
    the process is gone: its pid no longer exists on this host, or, for a rank on another
    host (no pid to check), its heartbeat is older than ``max(3 × interval, 10 s)``;
``stalled``
    the heartbeat is fresh but the step has not changed for ``stalled_after_s``; also a
    process that still exists on this host but whose heartbeat stopped (``frozen``: the
    interpreter is blocked, e.g. a C call holding the GIL, or the process is stopped);
``waiting``
    a stalled rank that is not the culprit while a culprit exists;
``running``
    everything else.

The culprit, the rank the others wait for, is looked for only while some rank is stalled:
a dead or crashed rank first; else the rank(s) at the oldest step; else, at one step, the
rank(s) outside a collective phase while others sit in one; else the rank whose phase
stack differs from the majority's. Among candidates, the one there longest.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

from stepscope.analysis.flight_records import apply_flight  # [export] PyTorch Flight Recorder dumps
from stepscope.common.errors import AnalysisError
from stepscope.common.safefs import read_run_file
from stepscope.recording.schema import HEARTBEAT_KIND, HEARTBEAT_MAX_MESSAGE

#: A heartbeat older than this many intervals (and at least ``DEAD_FLOOR_S``) is dead.
DEAD_INTERVALS = 3.0
DEAD_FLOOR_S = 10.0
#: Default stall threshold: the largest of these (seconds, × interval, × last step time).
STALL_FLOOR_S = 5.0
STALL_INTERVALS = 2.0
STALL_STEPS = 10.0
#: Frames shown from the culprit's stack dump.
TOP_FRAMES = 8
#: Bounds on what is read: a heartbeat is a few KB, a stack dump a few hundred KB.
MAX_HEARTBEAT_BYTES = 1 << 20
MAX_STACKS_BYTES = 16 << 20
#: Bounds on values from a heartbeat; outside them a field is unusable (hostile or corrupt).
MAX_RANKS = 1_000_000
MAX_PID = (1 << 31) - 1
MAX_STEP = 1 << 62
MAX_UNIX = 1e10  # seconds: year 2286
MAX_SECONDS = 1e9
MAX_TEXT = 1000
MAX_STACK_DEPTH = 64
#: A heartbeat's loss reasons read at most, and their names' length.
MAX_LOST_REASONS = 32
MAX_REASON = 64
#: Missing ranks listed by number (the count is always given).
MAX_LISTED_MISSING = 1000
_STATES = frozenset({"running", "finished", "crashed"})

_COLLECTIVE_WORDS = (
    "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast",
    "barrier", "all_to_all", "alltoall", "grad_sync", "nccl", "gloo", "collective",
)
_COLLECTIVE_TOKENS = frozenset({"sync", "wait", "comm", "reduce", "gather", "scatter", "send", "recv"})
_RANK_FILE = re.compile(r"^rank(\d+)\.status\.json$", re.ASCII)


def is_collective(phase: str | None) -> bool:
    """Whether a phase name looks like communication (a rank there is waiting on others)."""
    if not phase:
        return False
    leaf = phase.rsplit("/", 1)[-1].lower()
    if any(w in leaf for w in _COLLECTIVE_WORDS):
        return True
    return bool(set(re.split(r"[^a-z0-9]+", leaf)) & _COLLECTIVE_TOKENS)


def _pid_alive(pid: int) -> bool | None:
    """True/False for a pid on this host; None when it cannot be told."""
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    return True


def _plain_int(v: object, lo: int, hi: int) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi else None


def _number(v: object, lo: float, hi: float) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) and lo <= f <= hi else None


def _text(v: object, limit: int = MAX_TEXT) -> str | None:
    return v[:limit] if isinstance(v, str) else None


def _names(v: object) -> list[str] | None:
    """A phase stack: a list of strings, bounded; ``None`` when it is something else."""
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v[:MAX_STACK_DEPTH]):
        return None
    return [x[:MAX_TEXT] for x in v[:MAX_STACK_DEPTH]]


def _lost(v: object) -> dict[str, int] | None:
    """A heartbeat's ``lost`` section (reason -> steps), or None when it is not one."""
    if not isinstance(v, dict) or len(v) > MAX_LOST_REASONS:
        return None
    out: dict[str, int] = {}
    for k, n in v.items():
        count = _plain_int(n, 0, MAX_STEP)
        if not isinstance(k, str) or count is None:
            return None
        if count:
            out[k[:MAX_REASON]] = count
    return out


def _clean_beat(doc: dict[str, Any], name: str, file_rank: int, notes: list[str]) -> dict[str, Any] | None:
    """The heartbeat fields the reader uses, each checked for type and range.

    A required field that is missing or unusable skips the file; an optional one is dropped
    (with a note). Nothing from the file reaches the views unchecked, so no value (a pid of
    2^70, a step as a string, a world size of 10^12) can raise further on.
    """
    rank = _plain_int(doc.get("rank"), 0, MAX_RANKS - 1)
    if rank is None and "rank" in doc:
        notes.append(f"{name}: rank {str(doc['rank'])[:40]!r} is not a rank; read as rank {file_rank}")
        rank = file_rank
    run_id = doc.get("run_id")
    run_id = str(run_id) if isinstance(run_id, int) and not isinstance(run_id, bool) else run_id
    updated = _number(doc.get("updated_unix"), 0.0, MAX_UNIX)
    state = doc.get("state")
    if rank is None or not isinstance(run_id, str) or updated is None:
        missing = [k for k in ("rank", "run_id", "updated_unix", "step", "state", "pid") if k not in doc]
        what = f"missing {missing}" if missing else "rank, run_id or updated_unix of the wrong type or range"
        notes.append(f"{name}: incomplete heartbeat ({what}); skipped")
        return None
    if not isinstance(state, str) or state not in _STATES:
        notes.append(f"{name}: unknown state {str(state)[:40]!r}; skipped")
        return None
    bad: list[str] = []

    def opt(key: str, value: Any) -> Any:
        if value is None and doc.get(key) is not None:
            bad.append(key)
        return value

    beat: dict[str, Any] = {
        "kind": HEARTBEAT_KIND,
        "rank": rank,
        "run_id": run_id[:MAX_TEXT],
        "updated_unix": updated,
        "state": state,
        "step": opt("step", _plain_int(doc.get("step"), -MAX_STEP, MAX_STEP)),
        "pid": opt("pid", _plain_int(doc.get("pid"), 1, MAX_PID)),
        "host": opt("host", _text(doc.get("host"), 255)),
        "world_size": opt("world_size", _plain_int(doc.get("world_size"), 1, MAX_RANKS)),
        "interval_s": opt("interval_s", _number(doc.get("interval_s"), 1e-3, MAX_SECONDS)),
        "last_step": opt("last_step", _plain_int(doc.get("last_step"), -MAX_STEP, MAX_STEP)),
        "last_step_s": opt("last_step_s", _number(doc.get("last_step_s"), 0.0, MAX_SECONDS)),
        "in_phase_s": opt("in_phase_s", _number(doc.get("in_phase_s"), 0.0, MAX_SECONDS)),
        "step_since_unix": opt("step_since_unix", _number(doc.get("step_since_unix"), 0.0, MAX_UNIX)),
        "phase_stack": opt("phase_stack", _names(doc.get("phase_stack"))) or [],
    }
    coll = doc.get("collective")
    if isinstance(coll, dict) and isinstance(coll.get("op"), str):
        beat["collective"] = {"op": coll["op"][:MAX_TEXT]}
    elif coll is not None:
        bad.append("collective")
    err = doc.get("error")
    if isinstance(err, dict):
        beat["error"] = {
            "type": _text(err.get("type")),
            "message": _text(err.get("message"), HEARTBEAT_MAX_MESSAGE),
            "step": _plain_int(err.get("step"), -MAX_STEP, MAX_STEP),
            "phase_stack": _names(err.get("phase_stack")) or [],
            "where": _text(err.get("where")),
            "unix": _number(err.get("unix"), 0.0, MAX_UNIX),
        }
    elif err is not None:
        bad.append("error")
    lost = _lost(doc.get("lost"))
    if lost is not None:
        beat["lost"] = lost
    elif doc.get("lost") is not None:
        bad.append("lost")
    stacks = doc.get("stacks")
    if isinstance(stacks, dict) and isinstance(stacks.get("path"), str):
        beat["stacks"] = {"path": stacks["path"][:4096]}
    elif stacks is not None:
        bad.append("stacks")
    if bad:
        notes.append(f"{name}: field(s) {', '.join(bad)} of the wrong type or out of range; ignored")
    return beat


def _read_one(root: Path, name: str, file_rank: int, notes: list[str]) -> dict[str, Any] | None:
    raw, why = read_run_file(root, name, MAX_HEARTBEAT_BYTES)
    if raw is None:
        notes.append(f"{name} {why}")
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        notes.append(f"{name}: not UTF-8 text; skipped")
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # ValueError also covers integers of 4,300+ digits
        notes.append(f"{name}: torn or not JSON ({len(raw)} bytes); skipped")
        return None
    if not isinstance(doc, dict) or doc.get("kind") != HEARTBEAT_KIND:
        notes.append(f"{name}: not a stepscope heartbeat; skipped")
        return None
    return _clean_beat(doc, name, file_rank, notes)


def read_heartbeats(run_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[str], str | None]:
    """Parse every ``rank*.status.json``; returns (heartbeats, notes, run id from meta.json).

    Only files inside the run directory are read (see :func:`read_run_file`); each file is
    at most :data:`MAX_HEARTBEAT_BYTES` and its fields are checked (see :func:`_clean_beat`).
    What was skipped, and why, is in the notes.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise AnalysisError(f"{root}: no such run directory")
    notes: list[str] = []
    beats: list[dict[str, Any]] = []
    try:
        names = sorted(e.name for e in os.scandir(root) if _RANK_FILE.match(e.name))
    except OSError as exc:
        raise AnalysisError(f"{root}: cannot list the run directory ({exc.strerror or exc})") from None
    for name in names:
        m = _RANK_FILE.match(name)
        assert m is not None
        digits = m.group(1)
        if len(digits) > 7 or int(digits) >= MAX_RANKS:
            notes.append(f"{name[:60]}: rank out of range 0..{MAX_RANKS - 1}; skipped")
            continue
        doc = _read_one(root, name, int(digits), notes)
        if doc is None:
            continue
        if doc["rank"] != int(digits):
            notes.append(f"{name}: says rank {doc['rank']}; read as rank {int(digits)}")
            doc["rank"] = int(digits)
        beats.append(doc)
    meta_id: str | None = None
    if os.path.lexists(root / "meta.json"):
        raw, why = read_run_file(root, "meta.json", MAX_HEARTBEAT_BYTES)
        try:
            meta = json.loads(raw.decode("utf-8")) if raw is not None else None
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            meta, why = None, "is not JSON"
        if isinstance(meta, dict) and isinstance(meta.get("run_id"), str):
            meta_id = meta["run_id"][:MAX_TEXT]
        else:
            notes.append(f"meta.json {why or 'has no run id'}; run id taken from the heartbeats")
    return beats, notes, meta_id


def _stall_threshold(beat: dict[str, Any], override: float | None) -> float:
    if override is not None:
        return override
    interval = float(beat.get("interval_s") or 5.0)
    last = float(beat.get("last_step_s") or 0.0)
    return max(STALL_FLOOR_S, STALL_INTERVALS * interval, STALL_STEPS * last)


def _rank_view(beat: dict[str, Any], now: float, host: str, stalled_after_s: float | None) -> dict[str, Any]:
    interval = float(beat.get("interval_s") or 5.0)
    # A clock ahead of this host's (another host, or a bad file) would give negative ages.
    updated_ago = max(0.0, now - float(beat["updated_unix"]))
    stack = [str(p) for p in beat.get("phase_stack") or []]
    written_in_phase = float(beat.get("in_phase_s") or 0.0)
    state = str(beat["state"])
    reason = None
    frozen = False
    live = state == "running"
    same_host = beat.get("host") == host
    dead_after = max(DEAD_INTERVALS * interval, DEAD_FLOOR_S)
    if live:
        alive = _pid_alive(int(beat["pid"])) if same_host and beat.get("pid") else None
        if alive is False:
            state, live = "dead", False
            reason = (
                f"process {beat['pid']} on {host} is gone; last heartbeat {updated_ago:.1f} s ago"
            )
        elif updated_ago > dead_after:
            if alive:
                state, frozen = "stalled", True
                reason = (
                    f"process {beat['pid']} exists but its heartbeat stopped {updated_ago:.1f} s ago "
                    f"(frozen: interpreter blocked or process stopped)"
                )
            else:
                state, live = "dead", False
                reason = (
                    f"heartbeat stopped {updated_ago:.1f} s ago (> {dead_after:g} s = "
                    f"max({DEAD_INTERVALS:g} x its {interval:g} s interval, {DEAD_FLOOR_S:g} s))"
                )
    # A live rank has been in its phase since the write, plus the time since.
    in_phase = written_in_phase + (updated_ago if live or frozen else 0.0)
    step_since = beat.get("step_since_unix")
    step_age = max(0.0, now - float(step_since)) if isinstance(step_since, int | float) else in_phase
    threshold = _stall_threshold(beat, stalled_after_s)
    if state == "running" and step_age > threshold:
        state = "stalled"
        reason = f"step {beat['step']} unchanged for {step_age:.1f} s (threshold {threshold:g} s)"
    view: dict[str, Any] = {
        "rank": int(beat["rank"]),
        "host": beat.get("host"),
        "pid": beat.get("pid"),
        "state": state,
        "step": beat.get("step"),
        "phase_stack": stack,
        "in_phase_s": round(in_phase, 2),
        "updated_s_ago": round(updated_ago, 2),
        "last_step": beat.get("last_step"),
        "last_step_s": beat.get("last_step_s"),
        "step_age_s": round(step_age, 2),
    }
    coll = beat.get("collective")
    if isinstance(coll, dict) and isinstance(coll.get("op"), str):
        view["collective"] = coll["op"]  # the timed collective this rank is blocked in
    if reason:
        view["reason"] = reason
    if frozen:
        view["frozen"] = True
    err = beat.get("error")
    if state == "crashed" and isinstance(err, dict):
        where = "/".join(err.get("phase_stack") or []) or "no open phase"
        view["error"] = f"{err.get('type')}: {err.get('message')}"
        view["crash"] = {
            "type": err.get("type"),
            "message": err.get("message"),
            "step": err.get("step"),
            "phase_stack": err.get("phase_stack") or [],
            "where": err.get("where"),
            "unix": err.get("unix"),
        }
        view["reason"] = f"raised {err.get('type')} in {where} at step {err.get('step')}"
    elif state == "crashed":
        view["error"] = "crashed (no exception recorded)"
    if isinstance(beat.get("stacks"), dict):
        view["stacks_file"] = beat["stacks"].get("path")
    if beat.get("lost"):
        view["lost"] = dict(beat["lost"])
    return view


def _innermost(view: dict[str, Any]) -> str | None:
    """The innermost place the rank is in: the collective it is blocked in, else its phase."""
    if view.get("collective"):
        return str(view["collective"])
    stack = view["phase_stack"]
    return stack[-1] if stack else None


def _pick_culprit(views: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """The rank the others wait for, and why; ``(None, why not)`` when there is none."""
    active = [v for v in views if v["state"] != "finished"]
    stuck = [v for v in active if v["state"] == "stalled"]
    gone = [v for v in active if v["state"] in ("dead", "crashed")]
    if gone:
        # Peers of a dead rank often fail inside the collective it left: prefer a rank that
        # stopped outside a collective, then the first to stop.
        def order(v: dict[str, Any]) -> tuple[bool, float]:
            crash = v.get("crash") or {}
            stack = crash.get("phase_stack") or v["phase_stack"]
            stopped = crash.get("unix") or (-v["updated_s_ago"])
            return (is_collective(stack[-1] if stack else None), float(stopped))

        first = min(gone, key=order)
        others = len(active) - len(gone)
        if others or len(gone) > 1:
            return first, (
                f"rank {first['rank']} {first['state']} first; "
                f"{others or len(gone) - 1} other rank(s) {'wait' if others else 'stopped after it'}"
            )
    if not stuck:
        return None, "no rank is stalled"
    live = [v for v in active if v["state"] in ("running", "stalled")]
    steps = {v["step"] for v in live if v["step"] is not None}
    candidates: list[dict[str, Any]] = []
    why = ""
    if len(steps) > 1:
        oldest = min(steps)
        candidates = [v for v in live if v["step"] == oldest]
        why = f"behind: at step {oldest} while others are at step {max(steps)}"
    if not candidates or len(candidates) == len(live):
        in_coll = [v for v in live if is_collective(_innermost(v))]
        outside = [v for v in live if not is_collective(_innermost(v))]
        if in_coll and outside:
            candidates = outside
            why = "outside a collective while the others wait in one"
    if not candidates or len(candidates) == len(live):
        groups = Counter(tuple(v["phase_stack"]) for v in live)
        ranked = groups.most_common()
        if len(ranked) > 1 and ranked[0][1] > ranked[1][1]:
            major = ranked[0][0]
            candidates = [v for v in live if tuple(v["phase_stack"]) != major]
            why = f"in a different phase than the {ranked[0][1]} ranks in {'/'.join(major) or 'no phase'}"
    if not candidates or len(candidates) == len(live):
        return None, "all live ranks are in the same place; no single rank holds the others"
    best = max(candidates, key=lambda v: v["in_phase_s"])
    return best, why


def read_stack_top(root: Path, rel: str, n: int = TOP_FRAMES) -> tuple[list[str], str]:
    """The first ``n`` frames (most recent first) of the main thread in a stack dump.

    ``rel`` comes from a heartbeat: it is read only inside the run directory, as a regular
    file of at most :data:`MAX_STACKS_BYTES` (see :func:`read_run_file`); else ``([], why)``.
    """
    raw, why = read_run_file(root, rel, MAX_STACKS_BYTES)
    if raw is None:
        return [], why
    text = raw.decode("utf-8", errors="replace")
    main = None
    m = re.search(r"^# main thread: (0x[0-9a-f]+)", text, re.M)
    if m:
        main = m.group(1)
    blocks = [
        b.lstrip() for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
        if b.lstrip().startswith(("Thread", "Current thread"))
    ]
    chosen = None
    for block in blocks:
        head = block.split("\n", 1)[0]
        if main and main in head:
            chosen = block
            break
    if chosen is None:
        chosen = blocks[0] if blocks else ""
    frames = [ln.strip()[:MAX_TEXT] for ln in chosen.splitlines()[1:] if ln.strip().startswith("File ")]
    return frames[:n], ""


def analyze_status(
    run_dir: str | os.PathLike[str],
    *,
    now: float | None = None,
    stalled_after_s: float | None = None,
    trust_flight_dumps: bool = False,
) -> dict[str, Any]:
    """The ``stepscope status --json`` document; raises :class:`AnalysisError` when nothing is usable.

    ``trust_flight_dumps``: also read PyTorch's own Flight Recorder dumps (pickles).
    """
    root = Path(run_dir)
    beats, notes, meta_id = read_heartbeats(root)
    if not beats:
        detail = f" ({'; '.join(notes)})" if notes else ""
        raise AnalysisError(
            f"{root}: no readable heartbeat (rank*.status.json){detail}; heartbeats need "
            "heartbeat_s > 0 (the default)"
        )
    now = time.time() if now is None else now
    counts = Counter(str(b["run_id"]) for b in beats)
    if meta_id and meta_id in counts:
        run_id = meta_id
    else:
        newest = max(beats, key=lambda b: float(b["updated_unix"]))
        top = max(counts.values())
        newest_id = str(newest["run_id"])
        run_id = newest_id if counts[newest_id] == top else counts.most_common(1)[0][0]
        if meta_id:
            notes.append(f"meta.json names run {meta_id!r} but no heartbeat does; using {run_id!r}")
    kept = []
    for b in beats:
        if str(b["run_id"]) != run_id:
            notes.append(f"rank{b['rank']}.status.json: from run {b['run_id']!r}, not {run_id!r}; ignored")
        else:
            kept.append(b)
    world = max([int(b.get("world_size") or 0) for b in kept] + [max(b["rank"] for b in kept) + 1])
    # Bounded: world <= MAX_RANKS, and only the first MAX_LISTED_MISSING are listed.
    present = {b["rank"] for b in kept}
    n_missing = world - len(present)
    missing: list[int] = []
    for r in range(world):
        if len(missing) >= min(n_missing, MAX_LISTED_MISSING):
            break
        if r not in present:
            missing.append(r)
    if n_missing:
        listed = missing[:20]
        more = f" and {n_missing - len(listed)} more" if n_missing > len(listed) else ""
        notes.append(f"no usable heartbeat for rank(s) {', '.join(map(str, listed))}{more} of {world}")
    ahead = [b["rank"] for b in kept if float(b["updated_unix"]) > now + 60.0]
    if ahead:
        notes.append(f"rank(s) {', '.join(map(str, ahead[:20]))}: heartbeat time is ahead of this "
                     "host's clock; ages read as 0")
    host = socket.gethostname()
    views = sorted((_rank_view(b, now, host, stalled_after_s) for b in kept), key=lambda v: v["rank"])
    culprit_view, why = _pick_culprit(views)
    culprit: dict[str, Any] | None = None
    if culprit_view is not None:
        for v in views:
            if v is not culprit_view and v["state"] == "stalled":
                v["state"] = "waiting"
                v["reason"] = f"waiting for rank {culprit_view['rank']}"
        stack = culprit_view["phase_stack"]
        crash = culprit_view.get("crash")
        if culprit_view["state"] == "crashed" and crash:
            stack = crash["phase_stack"]
        since = culprit_view["in_phase_s"]
        if culprit_view["state"] == "dead":
            since = culprit_view["updated_s_ago"]
        culprit = {
            "rank": culprit_view["rank"],
            "phase": stack[-1] if stack else None,
            "phase_stack": list(stack),
            "step": culprit_view["step"] if not crash else crash.get("step"),
            "since_s": round(float(since), 2),
            "state": culprit_view["state"],
            "why": why,
        }
        if culprit_view.get("stacks_file"):
            frames, skipped = read_stack_top(root, culprit_view["stacks_file"])
            culprit["stack_file"] = culprit_view["stacks_file"]
            culprit["stack_top"] = frames
            if skipped:
                notes.append(f"rank {culprit_view['rank']}'s stack dump "
                             f"{culprit_view['stacks_file']!r} {skipped}")
    lost = losses(kept)
    if lost:
        notes.insert(0, lost_note(lost, "steps lost while recording, not on disk"))
    doc = {
        "run": {"id": run_id, "world_size": world, "dir": str(root)},
        "lost": lost,
        "ranks": views,
        "culprit": culprit,
        "missing_ranks": missing,
        "missing_count": n_missing,
        "notes": notes,
        "summary": _summary(views, culprit, why),
    }

    apply_flight(doc, root, trust_dumps=trust_flight_dumps)
    return doc


def _summary(views: list[dict[str, Any]], culprit: dict[str, Any] | None, why: str) -> str:
    states = Counter(v["state"] for v in views)
    parts = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
    if culprit is None:
        crashed = [v for v in views if v["state"] == "crashed"]
        if crashed:
            c = crashed[0]
            return f"{parts}; rank {c['rank']} {c.get('reason', 'crashed')}: {_message(c)}"
        return f"{parts}; no rank holds the others ({why})"
    where = "/".join(culprit["phase_stack"]) or "no phase"
    if culprit["state"] == "crashed":
        v = next(x for x in views if x["rank"] == culprit["rank"])
        return f"{parts}; rank {culprit['rank']} {v.get('reason')}: {_message(v)}"
    if culprit["state"] == "dead":
        return (
            f"{parts}; rank {culprit['rank']} died in {where} at step {culprit['step']} "
            f"(last heartbeat {culprit['since_s']:.0f} s ago); "
            + ("the others wait for it" if states.get("waiting") or states.get("running")
               or states.get("stalled") else "the others stopped after it")
        )
    return (
        f"{parts}; the others wait for rank {culprit['rank']}, in {where} at step "
        f"{culprit['step']} for {culprit['since_s']:.0f} s ({why})"
    )


def _message(view: dict[str, Any]) -> str:
    crash = view.get("crash") or {}
    return str(crash.get("message") or view.get("error") or "")


def losses(beats: list[dict[str, Any]]) -> dict[str, int]:
    """Steps lost by reason over the heartbeats (those no written record counts)."""
    total: dict[str, int] = {}
    for b in beats:
        for k, n in (b.get("lost") or {}).items():
            total[k] = total.get(k, 0) + int(n)
    return dict(sorted(total.items()))


def lost_note(lost: dict[str, int], what: str) -> str:
    """One line: ``what``, their total and each reason's count."""
    parts = ", ".join(f"{n} {k}" + (f" ({LOSS_REASONS[k]})" if k in LOSS_REASONS else "")
                      for k, n in lost.items())
    return f"{sum(lost.values())} {what} ({parts})"


#: What each loss reason means, as the notes say it.
LOSS_REASONS = {
    "write_failed": "their write failed: a full disk?",
    "timing_off": "run after an error turned timing off",
    "writer_queue_full": "the writer was behind",
    "unwritable": "could not be encoded",
    "pending_overflow": "too many steps pending",
}


def run_losses(run_dir: str | os.PathLike[str], run_id: str | None) -> dict[str, int]:
    """Steps lost by reason that the heartbeats of run ``run_id`` carry (for ``stepscope
    report``, which adds the records' own counts); never raises."""
    try:
        beats, _, _ = read_heartbeats(run_dir)
    except AnalysisError:
        return {}
    return losses([b for b in beats if run_id is None or str(b["run_id"]) == run_id])


def crash_evidence(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Crashes recorded in the heartbeat files (for ``stepscope report``); never raises.

    One entry per crashed rank: ``rank``, ``type``, ``message``, ``step``, ``phase_stack``,
    ``where`` (``step``, ``signal`` or ``exit``) and ``text`` ("rank 2 raised RuntimeError in
    backward at step 1412: CUDA out of memory").
    """
    try:
        beats, _, _ = read_heartbeats(run_dir)
    except AnalysisError:
        return []
    out = []
    for b in sorted(beats, key=lambda x: x["rank"]):
        err = b.get("error")
        if b.get("state") != "crashed" or not isinstance(err, dict):
            continue
        stack = [str(p) for p in err.get("phase_stack") or []]
        where = "/".join(stack) or "no open phase"
        out.append({
            "rank": b["rank"],
            "type": err.get("type"),
            "message": err.get("message"),
            "step": err.get("step"),
            "phase_stack": stack,
            "where": err.get("where"),
            "text": f"rank {b['rank']} raised {err.get('type')} in {where} at step {err.get('step')}: "
            f"{err.get('message')}",
        })
    return out
