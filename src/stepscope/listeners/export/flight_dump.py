"""Writing PyTorch's Flight Recorder buffer next to the heartbeat when a step is stuck.

PyTorch keeps a ring buffer of the collectives each process group issued (its "Flight
Recorder", on when ``TORCH_FR_BUFFER_SIZE`` or the older ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is
> 0). NCCL writes it to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` on a watchdog timeout; gloo
records into the same buffer but never writes it (a gloo job that times out leaves no file:
checked with torch 2.13 CPU, ``TORCH_FR_DUMP_TEMP_FILE`` set). So the heartbeat thread, when
it writes ``rank{R}.stacks.txt`` for a stuck step, also writes ``rank{R}.flight.json`` from
``torch._C._distributed_c10d._dump_fr_trace_json`` (every backend that records: NCCL, gloo).

One correction: gloo's dump has an empty ``pg_config`` (``{"": {"ranks": "[]"}}``), and
torch's analyser needs each group's ranks; they are filled in from this process's own
group table (``torch.distributed``), keyed by the group names the entries use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FLIGHT_SUFFIX = ".flight.json"


def flight_path(out_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}{FLIGHT_SUFFIX}"


def recorder_enabled(environ: Any = None) -> bool:
    """Whether this process's Flight Recorder records (buffer size > 0)."""
    env = os.environ if environ is None else environ
    raw = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    try:
        return int(raw) > 0
    except ValueError:
        return False


def _group_table() -> dict[str, dict[str, Any]]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    table: dict[str, dict[str, Any]] = {}
    for pg, name in list(c10d._world.pg_names.items()):
        try:
            ranks = dist.get_process_group_ranks(pg)
        except Exception:  # a group being torn down: leave it out, the dump still has the rest
            continue
        table[str(name)] = {"name": str(name), "desc": str(getattr(pg, "group_desc", "") or ""),
                            "ranks": str(sorted(int(r) for r in ranks))}
    return table


def dump_flight_recorder(out_dir: str | os.PathLike[str], rank: int) -> Path | None:
    """Write this rank's Flight Recorder buffer as JSON; ``None`` when there is nothing to write.

    Called from the heartbeat thread (never the training thread): the dump only copies the
    buffer under its lock; the collectives themselves are not touched.
    """
    if not recorder_enabled():
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch._C import _distributed_c10d as c10d_c

    dump_json = getattr(c10d_c, "_dump_fr_trace_json", None)  # torch >= 2.5 (earlier: none)
    if dump_json is None:
        return None
    doc = json.loads(dump_json(includeCollectives=True, onlyActive=False))
    if not doc.get("entries"):
        return None
    table = _group_table()
    cfg = {k: v for k, v in (doc.get("pg_config") or {}).items()
           if k and v.get("ranks") not in (None, "", "[]")}
    for name, row in table.items():
        cfg.setdefault(name, row)
    doc["pg_config"] = cfg
    doc["stepscope"] = {"rank": rank, "world_size": dist.get_world_size()}
    path = flight_path(out_dir, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)
    return path
