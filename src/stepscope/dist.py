"""Who this process is in the job: rank, local rank, world size, host."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    hostname: str


#: The analysis rejects records of larger jobs (``analysis.load.MAX_RANKS``); so does init.
MAX_WORLD_SIZE = 1_000_000


def _env_rank(name: str, default: int) -> int:
    """An integer env var; ``ValueError`` naming it when set to something else."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw[:40]!r}: expected an integer") from None


def check_rank(rank: int, local_rank: int, world_size: int, source: str) -> None:
    """``ValueError`` naming ``source``'s variables unless ``0 <= rank < world_size <= 10^6``."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"{source}: world size {world_size} (WORLD_SIZE) must be 1..{MAX_WORLD_SIZE}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{source}: rank {rank} (RANK) must be in 0..{world_size - 1} "
                         f"(WORLD_SIZE={world_size})")
    if not 0 <= local_rank < MAX_WORLD_SIZE:
        raise ValueError(f"{source}: local rank {local_rank} (LOCAL_RANK) must be 0..{MAX_WORLD_SIZE - 1}")


def rank_info() -> RankInfo:
    """From ``torch.distributed`` when initialised, else torchrun's env vars, else 0 of 1.

    Raises ``ValueError`` naming the variables when they are out of range (``RANK=-3``,
    ``WORLD_SIZE=0``, a rank not below the world size) or not integers: every record
    written with them would later be rejected by ``stepscope report``.
    """
    host = socket.gethostname()
    local = _env_rank("LOCAL_RANK", -1)
    try:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            rank, world = tdist.get_rank(), tdist.get_world_size()
            info = RankInfo(rank, local if local >= 0 else rank, world, host)
            check_rank(info.rank, info.local_rank, info.world_size, "torch.distributed")
            return info
    except ValueError:
        raise
    except Exception:  # protect the job: a broken dist module just means "not distributed"
        pass
    rank = _env_rank("RANK", 0)
    world = _env_rank("WORLD_SIZE", 1)
    if local < -1 or (local == -1 and os.environ.get("LOCAL_RANK", "").strip()):
        raise ValueError(f"LOCAL_RANK={local}: expected a non-negative integer")
    info = RankInfo(rank, local if local >= 0 else rank, world, host)
    check_rank(info.rank, info.local_rank, info.world_size,
               f"RANK={os.environ.get('RANK', '')!r} WORLD_SIZE={os.environ.get('WORLD_SIZE', '')!r}")
    return info


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a local rendezvous: demo, tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_then_exit(index: int, fn: Callable[..., Any], *args: Any) -> None:
    """A ``torch.multiprocessing.spawn`` target: run ``fn(index, *args)``, then leave at once.

    Tearing a gloo process group down through Python's garbage collection can deadlock
    (PyTorch's ``~ProcessGroupGloo`` waits for a worker thread that waits for the GIL while
    it frees a finished work's tensors). A worker whose ``fn`` returned has nothing left to
    do, so it flushes its output and exits with status 0 without running destructors.
    Exceptions propagate unchanged, so ``spawn`` reports them as usual.
    """
    import sys

    fn(index, *args)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
