"""Schema-2 synthetic runs with collectives: an event simulation of DDP, FSDP2 and HF shapes.

Every rank runs the same program per step: compute segments (own work, in a phase path) and
synchronising collectives. A collective ends for all ranks of its group when the last one
arrives (plus a transfer time), so each rank's time in it is ``end - its arrival``, exactly
what the recorder measures. Clocks carry across steps, so slowness after the last collective
of a step (optimizer) delays the next step's arrivals. DDP's all-reduce is recorded as a
``grad_sync`` phase (C++ reducer, not in ``collectives``); the others as ``collectives``
entries aggregated per (phase, op, pg) with per-group sequence numbers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from synth_runs import Slow

T0_NS = 1_763_000_000_000_000_000

# Program items: ("open", path) / ("close", path) / ("work", path, base_ms) /
# ("coll", path, op, pg, nbytes, transfer_ms) / ("ddp", path) (grad_sync phase + reducer sync)
# / ("nosync", path) (grad_sync phase of a no_sync micro-batch: nothing to wait for).
Item = tuple[Any, ...]


def ddp_program(micro: int = 1, data_ms: float = 2.0, fwd_ms: float = 6.0, bwd_ms: float = 9.0,
                opt_ms: float = 3.0) -> list[Item]:
    """DDP with ``micro`` micro-batches per step (``no_sync`` on all but the last)."""
    prog: list[Item] = [("open", "dataloader"), ("work", "dataloader", data_ms), ("close", "dataloader")]
    for m in range(micro):
        prog += [("open", "forward"), ("work", "forward", fwd_ms / micro), ("close", "forward"),
                 ("open", "backward"), ("work", "backward", bwd_ms / micro),
                 ("ddp" if m == micro - 1 else "nosync", "backward"), ("close", "backward")]
    prog += [("open", "optimizer"), ("work", "optimizer", opt_ms), ("close", "optimizer")]
    return prog


def fsdp_program(layers: int = 4, fwd_ms: float = 8.0, bwd_ms: float = 12.0,
                 nbytes: int = 4 << 20) -> list[Item]:
    """FSDP2-like: an all-gather before each layer's forward and backward, a reduce-scatter
    after each layer's backward."""
    prog: list[Item] = [("open", "dataloader"), ("work", "dataloader", 1.5), ("close", "dataloader"),
                        ("open", "forward")]
    for _ in range(layers):
        prog += [("coll", "forward", "all_gather", "0", nbytes, 0.4),
                 ("work", "forward", fwd_ms / layers)]
    prog += [("close", "forward"), ("open", "backward")]
    for _ in range(layers):
        prog += [("coll", "backward", "all_gather", "0", nbytes, 0.4),
                 ("work", "backward", bwd_ms / layers),
                 ("coll", "backward", "reduce_scatter", "0", nbytes, 0.4)]
    prog += [("close", "backward"), ("open", "optimizer"), ("work", "optimizer", 2.0),
             ("close", "optimizer")]
    return prog


def hf_program() -> list[Item]:
    """HF Trainer under DDP: the batch fetch gathers ``num_items_in_batch`` across ranks."""
    return [("open", "dataloader"), ("work", "dataloader", 2.0),
            ("coll", "dataloader", "all_reduce", "0", 8, 0.2), ("close", "dataloader"),
            *ddp_program(data_ms=0.0)[3:]]


@dataclass
class CollRun:
    program: list[Item]
    ranks: int = 2
    steps: int = 60
    slow: tuple[Slow, ...] = ()
    noise_ms: float = 0.15
    residual_ms: float = 0.4
    seed: int = 0


def make_records(spec: CollRun) -> dict[int, list[dict[str, Any]]]:
    rng = random.Random(spec.seed)
    n = spec.ranks
    clock = [0.0] * n
    seq: dict[str, list[int]] = {}
    out: dict[int, list[dict[str, Any]]] = {r: [] for r in range(n)}
    # Slowness is spread evenly over the compute segments of its phase in one step.
    segs: dict[str, int] = {}
    for it in spec.program:
        if it[0] == "work":
            top = it[1].split("/")[0]
            segs[top] = segs.get(top, 0) + 1
    for step in range(spec.steps):
        start = list(clock)
        t = [c + spec.residual_ms / 2 for c in clock]
        ph: list[dict[str, dict[str, Any]]] = [{} for _ in range(n)]
        opened: list[dict[str, float]] = [{} for _ in range(n)]
        coll: list[dict[tuple[str, str, str], dict[str, Any]]] = [{} for _ in range(n)]

        for it in spec.program:
            kind = it[0]
            if kind in ("open", "close"):
                for r in range(n):
                    _mark(kind, it[1], t[r], start[r], opened[r], ph[r])
            elif kind == "work":
                top = it[1].split("/")[0]
                for r in range(n):
                    extra = sum(s.ms for s in spec.slow if s.phase == top and s.hits(r, step))
                    t[r] += max(0.01, it[2] + extra / segs[top] + rng.gauss(0.0, spec.noise_ms))
            elif kind in ("ddp", "nosync"):
                path = it[1] + "/grad_sync"
                for r in range(n):
                    _mark("open", path, t[r], start[r], opened[r], ph[r])
                end = max(t) + 1.0
                t = [end] * n if kind == "ddp" else [x + 0.05 for x in t]
                for r in range(n):
                    _mark("close", path, t[r], start[r], opened[r], ph[r])
            else:
                _, path, op, pg, nbytes, xfer = it
                end = max(t) + xfer
                k = seq.setdefault(pg, [0] * n)
                for r in range(n):
                    e = coll[r].setdefault((path, op, pg), {
                        "phase": path, "op": op, "pg": pg, "pg_size": n, "count": 0, "bytes": 0,
                        "ms": 0.0, "max_ms": 0.0, "seq_first": k[r]})
                    d = end - t[r]
                    e["count"] += 1
                    e["bytes"] += nbytes
                    e["ms"] += d
                    e["max_ms"] = max(e["max_ms"], d)
                    e["seq_last"] = k[r]
                    k[r] += 1
                t = [end] * n
        for r in range(n):
            t[r] += spec.residual_ms / 2
            step_ms = t[r] - start[r]
            clock[r] = t[r]
            phases = []
            for path, e in ph[r].items():
                parent = path.rsplit("/", 1)[0] if "/" in path else None
                phases.append({"name": path.rsplit("/", 1)[-1], "path": path, "parent": parent,
                               "ms": e["ms"], "calls": e["calls"], "start_ms": e["start"],
                               "end_ms": e["end"]})
            top = sum(p["ms"] for p in phases if p["parent"] is None)
            rec: dict[str, Any] = {
                "schema": 2, "run_id": "synth2", "rank": r, "local_rank": r, "world_size": n,
                "hostname": "node-0", "device": "cpu", "step": step,
                "start_unix_ns": T0_NS + int(start[r] * 1e6), "clock": "cpu", "step_ms": step_ms,
                "phases": phases, "residual_ms": max(0.0, step_ms - top), "side_ms": {},
                "counters": {}, "dropped": {"pending_overflow": 0},
            }
            if coll[r]:
                rec["collectives"] = list(coll[r].values())
            out[r].append(rec)
    return out


def _mark(kind: str, path: str, now: float, start: float, opened: dict[str, float],
          ph: dict[str, dict[str, Any]]) -> None:
    """Open or close phase ``path`` at ``now`` on one rank (repeats add calls and time)."""
    if kind == "open":
        opened[path] = now
        return
    s0 = opened.pop(path)
    e = ph.setdefault(path, {"ms": 0.0, "calls": 0, "start": s0 - start})
    e["ms"] += now - s0
    e["calls"] += 1
    e["end"] = now - start


def write(out_dir: str | Path, recs: dict[int, list[dict[str, Any]]]) -> Path:
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    for rank, rows in recs.items():
        with open(root / f"rank{rank}.jsonl", "w") as fh:
            for rec in rows:
                fh.write(json.dumps(rec) + "\n")
    return root
