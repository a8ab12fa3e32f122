"""Synthetic DDP-shaped run directories for analysis tests (no processes, exact control).

The model follows what DDP does to phase timings: every rank arrives at the collective
inside ``backward`` when its forward (and its own backward compute) is done; the collective
ends together on all ranks, so the ranks that arrived early show a long ``backward`` (they
wait) and the late rank a short one. Slowness injected before the collective delays that
rank's arrival; slowness after it (optimizer) delays its next step's arrival.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASE_MS: dict[str, float] = {
    "dataloader": 2.0,
    "h2d": 1.0,
    "forward": 6.0,
    "backward": 9.0,  # own backward compute, before the collective completes
    "optimizer": 3.0,
}
COMM_MS = 2.0


@dataclass
class Slow:
    """Extra milliseconds in one rank's phase over a step range (end inclusive)."""

    rank: int
    phase: str
    ms: float = 15.0
    start_step: int = 0
    end_step: int | None = None

    def hits(self, rank: int, step: int) -> bool:
        end = self.end_step if self.end_step is not None else 1 << 30
        return rank == self.rank and self.start_step <= step <= end


@dataclass
class SynthRun:
    """Parameters of one synthetic run; :func:`write_run` turns it into files."""

    ranks: int = 4
    steps: int = 60
    slow: tuple[Slow, ...] = ()
    noise_ms: float = 0.15
    hosts: int = 1
    host_offset_ms: float = 0.0  # clock offset added per host index (multi-host skew)
    base_ms: dict[str, float] = field(default_factory=lambda: dict(BASE_MS))
    comm_child: bool = False  # emit an "allreduce" phase nested in backward
    residual_ms: float = 0.3
    h2d_hidden_ms: float | None = None
    seed: int = 0
    every: int = 1  # sample every n-th step
    # Extra milliseconds in the collective on every rank over (first, last, ms) step ranges:
    # a fabric slower for a while (the collective ends later everywhere).
    comm_slow: tuple[tuple[int, int, float], ...] = ()
    clock: str = "cpu"  # "cuda": records carry the CUDA clock and device cuda:<local rank>


def make_records(spec: SynthRun) -> dict[int, list[dict[str, Any]]]:
    """Per-rank lists of schema-1 records for ``spec``."""
    rng = random.Random(spec.seed)
    t0_ns = 1_763_000_000_000_000_000
    clock_ms = [0.0] * spec.ranks  # each rank's local "now", ms since t0
    out: dict[int, list[dict[str, Any]]] = {r: [] for r in range(spec.ranks)}
    for step in range(spec.steps):
        work: list[dict[str, float]] = []
        for r in range(spec.ranks):
            w = {}
            for name, base in spec.base_ms.items():
                extra = sum(s.ms for s in spec.slow if s.phase == name and s.hits(r, step))
                w[name] = max(0.01, base + extra + rng.gauss(0.0, spec.noise_ms))
            work.append(w)
        starts = list(clock_ms)
        arrive = [
            starts[r] + spec.residual_ms / 2 + work[r]["dataloader"] + work[r]["h2d"]
            + work[r]["forward"]
            for r in range(spec.ranks)
        ]
        ready = [arrive[r] + work[r]["backward"] for r in range(spec.ranks)]
        done = max(ready) + COMM_MS + sum(ms for a, b, ms in spec.comm_slow if a <= step <= b)
        for r in range(spec.ranks):
            w = work[r]
            phases: list[dict[str, Any]] = []
            t = spec.residual_ms / 2
            for name in ("dataloader", "h2d", "forward"):
                phases.append(_phase(name, t, w[name]))
                t += w[name]
            bw_start = t
            bw_end = done - starts[r]
            phases.append(_phase("backward", bw_start, bw_end - bw_start))
            if spec.comm_child:
                c0 = ready[r] - starts[r]
                phases.append(_phase("allreduce", c0, bw_end - c0, parent="backward"))
            phases.append(_phase("optimizer", bw_end, w["optimizer"]))
            step_ms = bw_end + w["optimizer"] + spec.residual_ms / 2
            clock_ms[r] = starts[r] + step_ms
            if step % spec.every:
                continue
            host = r * spec.hosts // spec.ranks
            local = r % max(1, spec.ranks // spec.hosts)
            rec: dict[str, Any] = {
                "schema": 1,
                "run_id": "synth",
                "rank": r,
                "local_rank": local,
                "world_size": spec.ranks,
                "hostname": f"node-{host}",
                "device": "cpu" if spec.clock == "cpu" else f"cuda:{local}",
                "step": step,
                "start_unix_ns": t0_ns + int((starts[r] + host * spec.host_offset_ms) * 1e6),
                "clock": spec.clock,
                "step_ms": step_ms,
                "phases": phases,
                "residual_ms": spec.residual_ms,
                "side_ms": {},
                "counters": {},
                "dropped": {"pending_overflow": 0},
            }
            if spec.h2d_hidden_ms is not None:
                rec["h2d_hidden_ms"] = spec.h2d_hidden_ms
            out[r].append(rec)
    return out


def _phase(name: str, start: float, ms: float, parent: str | None = None) -> dict[str, Any]:
    return {"name": name, "parent": parent, "ms": ms, "calls": 1, "start_ms": start,
            "end_ms": start + ms}


def write_run(out_dir: str | Path, spec: SynthRun,
              runq: dict[tuple[int, int], float] | None = None,
              runq_floor_ms: tuple[float, float] = (0.5, 3.0)) -> Path:
    """Write ``rank{R}.jsonl`` files for ``spec`` into ``out_dir`` and return it.

    With ``runq``, every record carries a run-queue wait (``counters.runq_ms``): uniform in
    ``runq_floor_ms`` (seeded by ``spec.seed``) plus ``runq[(rank, step)]``.
    """
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(spec.seed)
    for rank, recs in make_records(spec).items():
        with open(root / f"rank{rank}.jsonl", "w") as fh:
            for rec in recs:
                if runq is not None:
                    rec["counters"] = {"runq_ms": rng.uniform(*runq_floor_ms)
                                       + runq.get((rank, rec["step"]), 0.0)}
                fh.write(json.dumps(rec) + "\n")
    return root
