"""Who this process is in the job: rank, local rank, world size, host."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


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
