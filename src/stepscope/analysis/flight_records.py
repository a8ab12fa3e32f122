"""Reading PyTorch Flight Recorder dumps of a run: which collective each rank is in, who never came.

Dumps are looked for in the run directory:

* ``rank{R}.flight.json``: written by stepscope's heartbeat beside ``rank{R}.stacks.txt``
  once a step is stuck (``dump_stacks_after_s``), from the Flight Recorder's JSON dump
  (every backend that records into it: NCCL and gloo), see :mod:`stepscope.listeners.export.flight_dump`;
* ``flight_recorder/<prefix><rank>``: PyTorch's own dump files (NCCL writes them on a
  watchdog timeout when ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``; point
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` / ``TORCH_FR_DUMP_TEMP_FILE`` at
  ``<run_dir>/flight_recorder/nccl_trace_rank_``). They are pickles, read by torch's own
  loader (``torch.distributed.flight_recorder.components.loader.read_dump``): only read them
  from a run directory the job itself wrote.

The cross-rank matching is torch's analyser (``build_db`` of
``torch.distributed.flight_recorder``): it pairs each rank's entries per process group and
sequence number and reports the first collective some ranks never entered (``missing_ranks``)
or entered with a different op or size. On top of it this module reads, per rank, the last
collective per group and the one still in flight, and the sequence numbers per group (a rank
behind the others in a group is the one they wait for).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

from stepscope.common.safefs import read_run_file, run_file

#: The stepscope dump's file name pattern (see stepscope.listeners.export.flight_dump).
_OURS = re.compile(r"^rank(\d+)\.flight\.json$")
TORCH_DIR = "flight_recorder"
#: Largest dump read (bytes); a Flight Recorder buffer of 20 000 entries is a few MB.
MAX_DUMP_BYTES = 256 << 20
#: No job has a million ranks (the rank files' bound too).
MAX_RANKS = 1_000_000


def _read_ours(root: Path, notes: list[str]) -> dict[str, dict[str, Any]]:
    details: dict[str, dict[str, Any]] = {}
    for p in sorted(root.glob("rank*.flight.json")):
        m = _OURS.match(p.name)
        if not m:
            continue
        # The same rules as every run file: inside the run, a regular file, size-bounded.
        data, why = read_run_file(root, p.name, MAX_DUMP_BYTES)
        if data is None:
            notes.append(f"{p.name} {why}; skipped")
            continue
        rank = int(m.group(1))
        if rank >= MAX_RANKS:
            notes.append(f"{p.name}: rank {rank} is not a plausible rank (at most "
                         f"{MAX_RANKS - 1:,}); skipped")
            continue
        try:
            doc = json.loads(data.decode("utf-8"))
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            entries = doc.get("entries")
            if not isinstance(entries, list) or not isinstance(doc.get("pg_config"), dict):
                raise ValueError("entries or pg_config of the wrong type")
            for i, e in enumerate(entries):
                why = _bad_entry(e)
                if why:
                    raise ValueError(f"entry {i} {why}")
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
            what = str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
            notes.append(f"{p.name}: not a readable Flight Recorder dump ({what[:200]}); skipped")
            continue
        for e in entries:  # JSON has lists where the pickled dump has tuples
            if isinstance(e.get("process_group"), list):
                e["process_group"] = tuple(e["process_group"])
        details[p.name] = {"host_name": f"host_rank{rank}", "rank": rank, "entries": entries,
                           "version": str(doc.get("version", ""))[:64],
                           "pg_config": doc["pg_config"], "path": p.name}
    return details


#: The fields this module and torch's analyser read from an entry, with the types they take.
_ENTRY_TYPES: dict[str, tuple[type, ...]] = {
    "collective_seq_id": (int,), "p2p_seq_id": (int,), "record_id": (int,), "pg_id": (int,),
    "op_id": (int,), "profiling_name": (str,), "state": (str,), "retired": (bool,),
    "is_p2p": (bool,), "time_created_ns": (int,), "input_sizes": (list,),
    "output_sizes": (list,), "input_dtypes": (list,), "output_dtypes": (list,),
}


def _bad_entry(e: object) -> str:
    """Why a dump's entry is not one the analysis can use ("" when it is)."""
    if not isinstance(e, dict):
        return "is not an object"
    pg = e.get("process_group")
    if pg is not None and (not isinstance(pg, list | tuple) or len(pg) > 2
                           or not all(isinstance(x, str) for x in pg)):
        return "has a process_group that is not [name, description]"
    for key, types in _ENTRY_TYPES.items():
        v = e.get(key)
        if v is None:
            continue
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            return f"has a {key} of the wrong type ({type(v).__name__})"
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 1 << 62:
            return f"has a {key} out of range"
    return ""


def _ranks(value: object) -> list[int] | None:
    """A group's member ranks as data: a list of ints, or the text of one (``"[0, 1]"``)."""
    if isinstance(value, str):
        if len(value) > 16 * MAX_RANKS:
            return None
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, list) or len(value) > MAX_RANKS:
        return None
    if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_RANKS
               for r in value):
        return None
    return list(value)


def _plain_pg_config(details: dict[str, dict[str, Any]], notes: list[str]) -> None:
    """Rewrite every dump's ``pg_config`` as plain data torch's analyser reads safely.

    Torch's analyser evaluates a group's ``ranks`` text (``eval``) when it parses to a
    string: ``ranks`` here is parsed as JSON and written back as the text of a list of
    ints, or the group is dropped (and filled from the other dumps or the entries).
    """
    for d in details.values():
        clean: dict[str, dict[str, Any]] = {}
        bad = 0
        cfg = d.get("pg_config")
        for name, row in (cfg.items() if isinstance(cfg, dict) else ()):
            ranks = _ranks(row.get("ranks")) if isinstance(row, dict) else None
            if not isinstance(name, str) or ranks is None or not isinstance(row, dict) \
                    or not isinstance(row.get("desc", ""), str):
                bad += 1
                continue
            clean[name] = {"name": str(row.get("name", name)), "desc": str(row.get("desc", "")),
                           "ranks": str(ranks)}
        if bad:
            notes.append(f"{d.get('path')}: {bad} process group(s) in pg_config without a "
                         "list of ranks; ignored")
        d["pg_config"] = clean


def _read_torch(root: Path, notes: list[str], trusted: bool) -> dict[str, dict[str, Any]]:
    folder = root / TORCH_DIR
    if folder.is_symlink() or not folder.is_dir():
        return {}
    files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    if not files:
        return {}
    if not trusted:
        # torch's dumps are pickles: loading one runs whatever code it names, and a run
        # directory is not necessarily written by someone the reader trusts.
        notes.append(f"{len(files)} file(s) in {TORCH_DIR}/ not read: PyTorch's Flight Recorder "
                     "dumps are pickles (loading one can run code); pass --trust-flight-dumps "
                     "to read them")
        return {}
    from torch.distributed.flight_recorder.components.loader import read_dump

    # Group by prefix (file name minus the trailing rank digits); the largest group wins.
    groups: dict[str, list[Path]] = {}
    for p in files:
        m = re.match(r"^(.*?)(\d+)$", p.name)
        if m:
            groups.setdefault(m.group(1), []).append(p)
    if not groups:
        return {}
    prefix = max(groups, key=lambda k: (len(groups[k]), k))
    details: dict[str, dict[str, Any]] = {}
    for p in groups[prefix]:
        target, why = run_file(root, f"{TORCH_DIR}/{p.name}", MAX_DUMP_BYTES)
        if target is None:
            notes.append(f"{TORCH_DIR}/{p.name} {why}; skipped")
            continue
        try:
            d = read_dump(prefix, str(target))
        except Exception as exc:  # a torn or foreign file: note it, read the others
            notes.append(f"{TORCH_DIR}/{p.name}: not a readable Flight Recorder dump ({exc!r}); skipped")
            continue
        d["path"] = f"{TORCH_DIR}/{p.name}"
        details[p.name] = d
    return details


def _fix_pg_config(details: dict[str, dict[str, Any]]) -> None:
    """Fill groups the dump left without ranks (gloo) from the other ranks' dumps or the entries."""
    known: dict[str, dict[str, Any]] = {}
    for d in details.values():
        for name, row in (d.get("pg_config") or {}).items():
            if name and isinstance(row, dict) and row.get("ranks") not in (None, "", "[]"):
                known.setdefault(str(name), row)
    world = sorted({int(d["rank"]) for d in details.values()})
    # Last resort for a group no dump describes: the ranks whose entries use it.
    users: dict[str, set[int]] = {}
    for d in details.values():
        for e in d["entries"]:
            users.setdefault(str((e.get("process_group") or ("",))[0]), set()).add(int(d["rank"]))
    for d in details.values():
        cfg = {k: v for k, v in (d.get("pg_config") or {}).items()
               if k and isinstance(v, dict) and v.get("ranks") not in (None, "", "[]")}
        for e in d["entries"]:
            name, desc = [*(e.get("process_group") or ()), "", ""][:2]
            if name in cfg:
                continue
            row = known.get(name)
            if row is None and desc == "default_pg":
                row = {"name": name, "desc": desc, "ranks": str(world)}
            elif row is None:
                row = {"name": name, "desc": desc, "ranks": str(sorted(users.get(name, ())))}
            if row is not None:
                cfg[name] = row
        d["pg_config"] = cfg


def _torch_analysis(details: dict[str, dict[str, Any]], notes: list[str]) -> dict[str, Any] | None:
    """Torch's matcher over the dumps: the first collective some rank never entered or mismatched."""
    import logging

    fr_log = logging.getLogger("Flight Recorder")  # torch's analyser logs every finding at INFO
    was = fr_log.disabled
    fr_log.disabled = True
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(out):
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.config_manager import JobConfig

            args = JobConfig().parse_args(["unused", "--allow-incomplete-ranks"])
            version = next(iter(details.values()))["version"]
            db = build_db({k: {kk: v for kk, v in d.items() if kk != "path"}
                           for k, d in details.items()}, args, version)
    except Exception as exc:  # torch's analyser rejects the dumps: the per-rank view still stands
        notes.append(f"torch's Flight Recorder analyser failed on these dumps: {exc!r}")
        return None
    finally:
        fr_log.disabled = was
    for c in db.collectives:
        missing = sorted(int(r) for r in (c.missing_ranks or ()))
        if missing or not c.pass_check:
            return {
                "op": c.collective_name,
                "pg": str(c.group_id),
                "pg_desc": c.pg_desc,
                "seq": int(c.collective_seq_id),
                "expected_ranks": sorted(int(r) for r in (c.expected_ranks or ())),
                "missing_ranks": missing,
                "mismatch": c.type_of_mismatch and str(c.type_of_mismatch),
                "pass_check": bool(c.pass_check),
                "state": c.collective_state,
                "ops_by_rank": _ops_at(details, str(c.group_id), int(c.collective_seq_id)),
            }
    return None


def _ops_at(details: dict[str, dict[str, Any]], pg: str, seq: int) -> dict[str, str | None]:
    """What each dumped rank issued at sequence ``seq`` of group ``pg`` (``None``: nothing)."""
    out: dict[str, str | None] = {}
    for d in sorted(details.values(), key=lambda d: int(d["rank"])):
        hit = [e for e in d["entries"] if not e.get("is_p2p")
               and str((e.get("process_group") or ("",))[0]) == pg
               and int(e.get("collective_seq_id") or 0) == seq]
        out[str(d["rank"])] = str(hit[-1].get("profiling_name")) if hit else None
    return out


def _rank_view(d: dict[str, Any]) -> dict[str, Any]:
    entries = [e for e in d["entries"] if not e.get("is_p2p")]
    seq: dict[str, int] = {}
    for e in entries:
        pg = str((e.get("process_group") or ("",))[0])
        seq[pg] = max(seq.get(pg, -1), int(e.get("collective_seq_id") or 0))
    # In flight: not yet retired (gloo marks only that) and not completed (NCCL tracks state).
    flying = [e for e in d["entries"] if not e.get("retired", False) and e.get("state") != "completed"]
    cur = flying[-1] if flying else None
    last = d["entries"][-1] if d["entries"] else None

    def brief(e: dict[str, Any] | None) -> dict[str, Any] | None:
        if e is None:
            return None
        pg = tuple(e.get("process_group") or ("", ""))
        return {"op": e.get("profiling_name"), "pg": str(pg[0]), "pg_desc": str(pg[1]) if len(pg) > 1 else "",
                "seq": int(e.get("collective_seq_id") or 0), "state": e.get("state"),
                "p2p_seq": int(e.get("p2p_seq_id") or 0), "is_p2p": bool(e.get("is_p2p"))}

    return {"rank": int(d["rank"]), "file": d.get("path"), "entries": len(d["entries"]),
            "in_collective": brief(cur), "last_collective": brief(last), "seq_by_pg": seq}


def analyze_flight(run_dir: str | os.PathLike[str], world_size: int | None = None, *,
                   trust_dumps: bool = False) -> dict[str, Any] | None:
    """The ``flight_recorder`` section of ``stepscope status``; ``None`` when the run has no dump.

    Keys: ``ranks`` (per rank: the collective in flight, the last one, sequence numbers per
    group), ``missing_dumps``, ``first_unmatched`` (torch's analyser), ``behind`` (per
    group, ranks at a lower sequence number than the others), ``culprit_ranks`` and ``why``,
    ``notes``.
    """
    root = Path(run_dir)
    notes: list[str] = []
    details = _read_ours(root, notes)
    source = "stepscope heartbeat (rank*.flight.json)"
    if not details:
        details = _read_torch(root, notes, trust_dumps)
        source = f"PyTorch dump files ({TORCH_DIR}/)"
    if not details:
        if notes:  # dumps there but none read (untrusted pickles, torn files): say so
            return {"source": source, "files": [], "ranks": [], "missing_dumps": [],
                    "first_unmatched": None, "behind": [], "culprit_ranks": [], "why": "",
                    "analyser": "torch.distributed.flight_recorder", "notes": notes}
        return None
    ranks = sorted({int(d["rank"]) for d in details.values()})
    _plain_pg_config(details, notes)
    _fix_pg_config(details)
    views = sorted((_rank_view(d) for d in details.values()), key=lambda v: v["rank"])
    world = min(max([world_size or 0, ranks[-1] + 1]), MAX_RANKS)
    missing_dumps = sorted(set(range(world)) - set(ranks))
    unmatched = _torch_analysis(details, notes)

    behind: list[dict[str, Any]] = []
    for pg in sorted({pg for v in views for pg in v["seq_by_pg"]}):
        by_rank = {v["rank"]: v["seq_by_pg"][pg] for v in views if pg in v["seq_by_pg"]}
        if len(by_rank) > 1 and len(set(by_rank.values())) > 1:
            top = max(by_rank.values())
            behind.append({"pg": pg, "seq_by_rank": {str(r): s for r, s in sorted(by_rank.items())},
                           "behind": sorted(r for r, s in by_rank.items() if s < top), "max_seq": top})
    culprits: list[int] = []
    why = ""
    if unmatched and unmatched["missing_ranks"]:
        culprits = unmatched["missing_ranks"]
        waiting = sorted(set(unmatched["expected_ranks"]) - set(culprits))
        why = (f"rank(s) {', '.join(map(str, culprits))} never entered {unmatched['op']} "
               f"(group {unmatched['pg_desc'] or unmatched['pg']}, sequence {unmatched['seq']}) "
               f"that rank(s) {', '.join(map(str, waiting))} are in")
    elif unmatched and (unmatched["mismatch"] or len(set(unmatched["ops_by_rank"].values())) > 1):
        ops = ", ".join(f"rank {r}: {op or 'nothing'}" for r, op in unmatched["ops_by_rank"].items())
        why = (f"sequence {unmatched['seq']} of group {unmatched['pg_desc'] or unmatched['pg']} "
               f"does not match across ranks ({unmatched['mismatch'] or ops})")
    elif behind:
        b = behind[0]
        culprits = b["behind"]
        why = (f"rank(s) {', '.join(map(str, culprits))} are behind in group {b['pg']}: "
               f"sequence numbers {b['seq_by_rank']}")
    return {
        "source": source,
        "files": sorted(str(d.get("path")) for d in details.values()),
        "ranks": views,
        "missing_dumps": missing_dumps,
        "first_unmatched": unmatched,
        "behind": behind,
        "culprit_ranks": culprits,
        "why": why,
        "analyser": "torch.distributed.flight_recorder",
        "notes": notes,
    }


def apply_flight(doc: dict[str, Any], run_dir: str | os.PathLike[str], *, trust_dumps: bool = False) -> None:
    """Add ``flight_recorder`` to a ``stepscope status`` document; name the culprit from it
    when the heartbeats could not (``culprit`` is ``None``), or note that it agrees."""
    world = doc.get("run", {}).get("world_size")
    fr = analyze_flight(run_dir, world if isinstance(world, int) else None, trust_dumps=trust_dumps)
    doc["flight_recorder"] = fr
    if fr is None or not fr["culprit_ranks"]:
        return
    cul = doc.get("culprit")
    if cul is not None:
        if cul.get("rank") in fr["culprit_ranks"]:
            cul["flight_recorder"] = fr["why"]
        else:
            doc.setdefault("notes", []).append(f"the Flight Recorder disagrees: {fr['why']}")
        return
    rank = fr["culprit_ranks"][0]
    if not any(v.get("state") in ("stalled", "waiting", "dead", "crashed") for v in doc.get("ranks", [])):
        # A dump is written once a step is stuck; if every rank has moved on, it is history.
        doc.setdefault("notes", []).append(
            f"the Flight Recorder dump names rank {rank}, but no rank is stalled now: {fr['why']}")
        return
    view = next((v for v in doc.get("ranks", []) if v.get("rank") == rank), None)
    stack = list(view["phase_stack"]) if view else []
    doc["culprit"] = {
        "rank": rank,
        "phase": stack[-1] if stack else None,
        "phase_stack": stack,
        "step": view["step"] if view else None,
        "since_s": round(float(view["in_phase_s"]), 2) if view else 0.0,
        "state": view["state"] if view else "unknown",
        "why": f"Flight Recorder: {fr['why']}",
        "source": "flight_recorder",
    }
    for v in doc.get("ranks", []):
        if v.get("rank") != rank and v.get("state") == "stalled":
            v["state"] = "waiting"
            v["reason"] = f"waiting for rank {rank}"
    states = [str(v.get("state")) for v in doc.get("ranks", [])]
    counts = ", ".join(f"{states.count(s)} {s}" for s in ("stalled", "waiting", "dead", "crashed")
                       if s in states)
    doc["summary"] = (f"{counts + '; ' if counts else ''}the others wait for rank {rank} "
                      f"(heartbeats alone could not tell); Flight Recorder: {fr['why']}")
