"""Who this process is in the job: rank, local rank, world size, host."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepscope.common import escape
from stepscope.common.errors import warn


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    hostname: str

    def __post_init__(self) -> None:
        # Names every encoder accepts (an undecodable host name's lone surrogates written out).
        object.__setattr__(self, "hostname", escape.name(str(self.hostname)))


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


#: Where :func:`free_port` looks first: below the ephemeral range, whose ports the kernel
#: hands to any socket that connects or binds port 0.
_LISTEN_PORTS = (20000, 32768)


def _ephemeral_low() -> int:
    """The lowest port the kernel assigns implicitly (Linux: ``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _LISTEN_PORTS[1]


def _bindable(port: int) -> bool:
    if port > 65535:  # past the last port: socket.bind raises OverflowError, not OSError
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A TCP port on 127.0.0.1 that is free now, with the ``span - 1`` ports after it (for a
    local rendezvous and exporters: demo, tests).

    Taken below the kernel's ephemeral range where it can: a port from ``bind(port 0)`` is
    ephemeral, and between this call and the listener's ``bind`` any outgoing connection on
    the host (gloo's own rank-to-rank sockets, an HTTP client) may be given that very port,
    so the rendezvous fails with "address already in use". Ports outside the range are only
    ever taken on purpose. Falls back to an ephemeral port when none is free there."""
    import random

    pick = random.SystemRandom().randrange  # not the module's state: forked callers differ
    low, high = _LISTEN_PORTS[0], min(_LISTEN_PORTS[1], _ephemeral_low())
    for _ in range(64 if high - low > span else 0):
        base = pick(low, high - span)
        if all(_bindable(base + i) for i in range(span)):
            return base
    while True:  # the ephemeral fallback: the kernel's pick, checked for its neighbours
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if all(_bindable(base + i) for i in range(1, span)):
            return base


def become_local_rank(rank: int, world: int, port: int) -> None:
    """Give this process the environment ``torchrun`` gives a rank of a one-host job
    (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``) and one intra-op thread, since the ranks share the host's cores."""
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)


#: What every :func:`spawn_local` rank imports: the fork server imports it once.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "stepscope.demo")


def spawn_local(fn: Callable[..., Any], ranks: int, out_dir: str | os.PathLike[str],
                *args: Any) -> Path:
    """Run ``fn(rank, ranks, port, out_dir, *args)`` in one process per rank on this host
    (``torch.multiprocessing.start_processes`` through :func:`run_then_exit`, a free rendezvous
    port); ``out_dir`` is created first and returned. For the demo and tests.

    Where the platform has one, the ranks are forked by multiprocessing's fork server, which
    has imported :data:`FORKSERVER_PRELOAD` once, instead of each starting a fresh interpreter
    that imports torch again (seconds of CPU a rank); elsewhere they are spawned. Either way a
    rank starts with this process's current environment, ``sys.path`` and working directory.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # once it runs: no-op
    mp.start_processes(  # type: ignore[attr-defined]
        _with_environ, args=(dict(os.environ), fn, ranks, free_port(), str(out), *args),
        nprocs=ranks, join=True, start_method=method)
    return out


def _with_environ(index: int, environ: dict[str, str], fn: Callable[..., Any], *args: Any) -> None:
    """:func:`run_then_exit` with the launching process's environment as it is now (a fork
    server's children would otherwise get the server's, from when it started)."""
    os.environ.clear()
    os.environ.update(environ)
    run_then_exit(index, fn, *args)


def run_then_exit(index: int, fn: Callable[..., Any], *args: Any) -> None:
    """A ``torch.multiprocessing.spawn`` target: run ``fn(index, *args)``, then leave at once.

    Tearing a gloo process group down through Python's garbage collection can deadlock
    (PyTorch's ``~ProcessGroupGloo`` waits for a worker thread that waits for the GIL while
    it frees a finished work's tensors). Two things guard against it:

    - While ``fn`` runs, ``destroy_process_group()`` still shuts the groups down and takes
      them out of torch's registry, but this process keeps a reference to each group, so
      the C++ destructor never runs: not inside ``destroy_process_group`` and not when
      ``fn``'s frame (holding a DDP model, whose reducer holds the group) is freed on return.
    - A worker whose ``fn`` returned has nothing left to do, so it flushes its output and
      exits with status 0 without running destructors.

    Exceptions propagate unchanged, so ``spawn`` reports them as usual.
    """
    import sys

    keep_groups_until_exit()
    fn(index, *args)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


#: Process groups that ``destroy_process_group`` let go of in a ``run_then_exit`` worker,
#: kept so their destructor (which can deadlock, see ``run_then_exit``) never runs.
_kept_groups: list[Any] = []


def keep_groups_until_exit() -> None:
    """Make ``torch.distributed.destroy_process_group`` keep every group it destroys alive.

    For processes that end with ``os._exit`` (``run_then_exit``): the group is shut down and
    unregistered as usual; only the final C++ destructor is left to process exit.
    """
    try:
        import torch.distributed as tdist
        import torch.distributed.distributed_c10d as c10d
    except ImportError:  # no torch.distributed: nothing to keep
        return
    real = c10d.destroy_process_group
    if getattr(real, "_stepscope_keeps_groups", False):
        return

    def destroy_process_group(group: Any = None) -> None:
        if group is not None:
            _kept_groups.append(group)
        else:
            try:  # every registered group: torch keeps them in its (private) world registry
                _kept_groups.extend(list(c10d._world.pg_map))
            except Exception:  # registry renamed: keep at least the default group
                with contextlib.suppress(Exception):
                    _kept_groups.append(tdist.group.WORLD)
        real(group)

    destroy_process_group._stepscope_keeps_groups = True  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = real.__doc__
    c10d.destroy_process_group = destroy_process_group
    tdist.destroy_process_group = destroy_process_group


# ----------------------------------------------------------------- init agreement (device)
# What every recording rank must decide alike at init: the run id (one per job, however the
# job was launched) and whether the live view's side gloo group exists. Creating a group is
# collective; a rank that skips it stalls the others and shifts their group counter, so the
# job's own next ``new_group()`` pairs with the wrong group. The ranks agree over the default
# process group's store (backend-agnostic: no tensor, no device, works before any NCCL call).

#: Launcher variables naming the job, in order; the value is the same on every rank.
JOB_ID_VARS: tuple[tuple[str, ...], ...] = (
    ("STEPSCOPE_RUN_ID",),
    ("TORCHELASTIC_RUN_ID",),
    ("SLURM_JOB_ID", "SLURM_STEP_ID"),
    ("PBS_JOBID",),
    ("LSB_JOBID",),
    ("FLUX_JOB_ID",),
    ("JOB_ID",),  # Grid Engine
)
#: Longest a rank waits at init for the others (seconds). Past it the rank decides alone:
#: no side group (a group that not every member creates would hang) and its own run id.
AGREE_TIMEOUT_S = 30.0

_agree_seq = 0  # agreements made by this process; every member makes them in the same order


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed at init (or what this rank decided alone, ``agreed=False``)."""

    run_id: str
    #: Every member creates the live view's side group (some member asked for the live view).
    side_group: bool
    #: The ranks that record (``ranks=`` filter applied), sorted.
    members: tuple[int, ...]
    agreed: bool


#: What a launcher sets when it has no id for the job: plain ``torchrun`` (no ``--standalone``,
#: no ``--rdzv-id``) sets ``TORCHELASTIC_RUN_ID=none`` on every launch.
NO_ID = frozenset({"none"})


def launcher_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The job id from the launcher's environment (torchrun, Slurm, PBS, LSF, Flux, SGE), or None.

    None also where the first launcher variable set says it has no id (``none``): the
    launcher is that one, and an id of the next kind (a Slurm job holding several launches)
    would not tell its launches apart; the ranks then agree a fresh id.
    """
    env = os.environ if environ is None else environ
    for names in JOB_ID_VARS:
        parts = [env.get(n, "").strip() for n in names]
        if parts[0].lower() in NO_ID:
            return None
        if parts[0]:
            return "-".join(p for p in parts if p)
    return None


def new_run_id() -> str:
    """A fresh id: local time and 8 random hex digits."""
    import time
    import uuid

    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def agree_at_init(
    *,
    run_id: str | None,
    wants_side_group: bool,
    ranks: Iterable[int] | None,
    timeout_s: float = AGREE_TIMEOUT_S,
) -> Agreement:
    """Agree the run id and the side group with the other recording ranks.

    ``run_id`` is this rank's explicit id (config), kept when given. Otherwise every rank takes
    the lowest member's candidate: the launcher's job id, else a fresh one, so an
    ``mp.spawn``/``srun``/plain-env job gets one id. ``wants_side_group`` is this rank's
    config (live view or auto-profiling on); the side group exists when any member wants it and
    all members took part. Without an initialised process group of more than one rank there is
    nothing to agree: the rank's own choices come back with ``agreed=False``.

    The lowest member collects every member's wishes and publishes one decision; the others
    follow it, so a rank that arrives after the timeout still decides like the rest.
    """
    global _agree_seq
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds; got {timeout_s!r}")
    candidate = launcher_run_id() or new_run_id()
    alone = Agreement(run_id or candidate, False, (), False)
    try:
        import torch.distributed as tdist

        if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() < 2:
            return alone
        world, me = tdist.get_world_size(), tdist.get_rank()
        store = tdist.distributed_c10d._get_default_store()
    except Exception:  # protect the job: no usable store means "decide alone"
        return alone
    wanted = range(world) if ranks is None else ranks
    members = tuple(sorted({r for r in wanted if 0 <= r < world}))
    if me not in members or len(members) < 2:
        return Agreement(alone.run_id, False, members, False)
    _agree_seq += 1
    prefix = f"stepscope/agree/{_agree_seq}"
    leader = members[0]
    import json
    from datetime import timedelta

    try:
        store.set(f"{prefix}/wish/{me}", json.dumps({"side": bool(wants_side_group)}))
        if me == leader:
            decision = {"run_id": candidate, "side": False, "all": False}
            keys = [f"{prefix}/wish/{r}" for r in members]
            try:
                store.wait(keys, timedelta(seconds=timeout_s))
                wishes = [json.loads(store.get(k)) for k in keys]
                decision.update(all=True, side=any(bool(w.get("side")) for w in wishes))
            except Exception:  # a member never came: decide without it, and say so below
                pass
            store.set(f"{prefix}/decision", json.dumps(decision))
        else:
            # The leader waits up to timeout_s for everyone, then publishes: allow for that.
            store.wait([f"{prefix}/decision"], timedelta(seconds=2 * timeout_s + 5))
            decision = json.loads(store.get(f"{prefix}/decision"))
    except Exception as exc:  # protect the job: a broken store only loses the agreement
        _warn(f"ranks could not agree at init ({exc!r}): this rank's own run id, no live exchange")
        return Agreement(alone.run_id, False, members, False)
    if not decision.get("all"):
        _warn(f"not every recording rank started stepscope within {timeout_s:g} s: "
              "no cross-rank live exchange")
    agreed_id = decision.get("run_id")
    return Agreement(
        run_id or (agreed_id if isinstance(agreed_id, str) and agreed_id else candidate),
        bool(decision.get("side")) and bool(decision.get("all")),
        members,
        bool(decision.get("all")),
    )


def _warn(msg: str) -> None:
    warn(msg, stacklevel=3)
