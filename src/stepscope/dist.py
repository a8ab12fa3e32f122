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


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw)
    except ValueError:
        return default


def rank_info() -> RankInfo:
    """From ``torch.distributed`` when initialised, else torchrun's env vars, else 0 of 1."""
    host = socket.gethostname()
    local = _env_int("LOCAL_RANK", -1)
    try:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            rank, world = tdist.get_rank(), tdist.get_world_size()
            return RankInfo(rank, local if local >= 0 else rank, world, host)
    except Exception:  # protect the job: a broken dist module just means "not distributed"
        pass
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    return RankInfo(rank, local if local >= 0 else rank, world, host)


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
