"""``run_then_exit`` workers never run a gloo group's destructor (it can deadlock).

CI once hung 300 s in a worker after ``fn`` returned: ``~Reducer`` (the DDP model, freed
with ``fn``'s frame) dropped the last reference to a group that ``destroy_process_group()``
had unregistered, and ``~ProcessGroupGloo`` blocked on a mutex held by a worker thread
waiting for the GIL. The worker below has exactly that shape: DDP model as a local,
``destroy_process_group()`` in ``finally``, return.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from stepscope.recording.dist import free_port, run_then_exit, spawn_local

JOB_DEADLINE_S = 120.0


def _ddp_then_destroy(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import stepscope.recording.dist as sdist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    side = dist.new_group([0, 1])
    try:
        model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        dist.all_reduce(torch.ones(1), group=side)
        world = dist.group.WORLD
    finally:
        dist.destroy_process_group(side)
        dist.destroy_process_group()
    kept = sdist._kept_groups
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "kept": len(kept),
        "world_kept": any(g is world for g in kept),
        "side_kept": any(g is side for g in kept),
        "unregistered": not dist.is_initialized(),
    }))


def test_destroyed_groups_outlive_the_worker_frame(tmp_path: Path) -> None:
    t0 = time.monotonic()
    ctx = mp.spawn(run_then_exit, args=(_ddp_then_destroy, free_port(), str(tmp_path)),  # type: ignore[attr-defined]
                   nprocs=2, join=False)
    while not ctx.join(timeout=1.0):
        if time.monotonic() - t0 > JOB_DEADLINE_S:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"2-rank job still running after {JOB_DEADLINE_S:.0f} s (teardown hang)")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # destroy_process_group still did its job (the registry is empty) ...
        assert got["unregistered"], got
        # ... but the groups it let go of stay referenced until os._exit.
        assert got["world_kept"] and got["side_kept"], got
        assert got["kept"] >= 2, got


def test_keep_groups_is_idempotent() -> None:
    import torch.distributed as dist

    import stepscope.recording.dist as sdist

    before = dist.destroy_process_group
    try:
        sdist.keep_groups_until_exit()
        once = dist.destroy_process_group
        sdist.keep_groups_until_exit()
        assert dist.destroy_process_group is once  # not wrapped twice
        assert once is not before or getattr(before, "_stepscope_keeps_groups", False)
    finally:
        import torch.distributed.distributed_c10d as c10d

        dist.destroy_process_group = before  # type: ignore[attr-defined]
        c10d.destroy_process_group = before  # type: ignore[assignment]


def test_free_port_is_outside_the_ephemeral_range_and_free_for_its_span() -> None:
    """A rendezvous port from ``bind(0)`` is ephemeral: gloo's own rank-to-rank sockets (or any
    client) may be given it before the listener binds it. free_port() picks below the range."""
    import socket

    from stepscope.recording import dist

    low = dist._ephemeral_low()
    for span in (1, 2, 3):
        base = free_port(span=span)
        if low > dist._LISTEN_PORTS[0] + span:  # a range below the ephemeral one exists here
            assert dist._LISTEN_PORTS[0] <= base and base + span <= low
        for p in range(base, base + span):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))  # raises if any port of the span is taken


def test_free_port_skips_a_taken_neighbour(monkeypatch: pytest.MonkeyPatch) -> None:
    from stepscope.recording import dist

    taken = {20001}
    monkeypatch.setattr(dist, "_bindable", lambda port: port not in taken)
    monkeypatch.setattr(dist, "_ephemeral_low", lambda: 32768)
    picks = iter([20000, 20002])  # the first one's neighbour is taken; the second pair is free

    class _Pick:
        def randrange(self, a: int, b: int) -> int:
            return next(picks)

    monkeypatch.setattr("random.SystemRandom", _Pick)
    assert free_port(span=2) == 20002


def test_free_port_neighbours_past_the_last_port_are_not_bindable() -> None:
    """The ephemeral fallback checks the ports after the kernel's pick; one past 65535 makes
    socket.bind raise OverflowError (not OSError), which must read as "not free"."""
    from stepscope.recording import dist

    assert dist._bindable(65536) is False


def _report_environ(rank: int, world: int, port: int, out: str, name: str) -> None:
    Path(out, f"rank{rank}.txt").write_text(os.environ.get(name, "<unset>"))


def test_spawn_local_ranks_see_the_launchers_environment_as_it_is_now(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first launch may start the fork server; a variable set after that must still reach
    # the next launch's ranks, and one removed must be gone, as with a fresh interpreter.
    name = "STEPSCOPE_TEST_LAUNCH_ENV"
    monkeypatch.delenv(name, raising=False)
    first = spawn_local(_report_environ, 2, tmp_path / "first", name)
    monkeypatch.setenv(name, "second")
    second = spawn_local(_report_environ, 2, tmp_path / "second", name)
    monkeypatch.delenv(name)
    third = spawn_local(_report_environ, 2, tmp_path / "third", name)
    for run, want in ((first, "<unset>"), (second, "second"), (third, "<unset>")):
        assert [(run / f"rank{r}.txt").read_text() for r in (0, 1)] == [want, want]
