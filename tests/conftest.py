"""Shared fixtures: tracers writing to memory or to tmp dirs, a simulated CUDA runtime, a one-rank world."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stepscope.recording.clock import CpuClock
from stepscope.recording.config import Config
from stepscope.recording.sinks import MemorySink
from stepscope.tracer import Tracer

# Harnesses, simulators and synthetic runs live in tests/support/, imported by plain name.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# Reports size their tables to COLUMNS when it is set (report.terminal.make_console). The tests
# read reports written to a pipe, so the caller's terminal size must not reach them: a shell
# that exports COLUMNS, or a pytest-xdist worker (its environment has COLUMNS=80, LINES=24).
# Tests of the terminal width set it themselves.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

# A pytest-xdist worker shares the cores with the other workers, one of which may be running a
# world of ranks (each on one intra-op thread, recording.dist.become_local_rank): one thread
# here too, so an in-process matmul does not take every core from those ranks.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def mem_tracer():
    """Factory: ``mem_tracer(**config_kwargs, model=..., optimizer=..., clock=...)``."""
    made: list[Tracer] = []

    def make(model=None, optimizer=None, clock=None, **cfg):
        cfg.setdefault("out_dir", "unused")
        sink = MemorySink()
        tracer = Tracer(
            Config(**cfg), model=model, optimizer=optimizer, clock=clock or CpuClock(), sink=sink
        )
        tracer.sink = sink  # type: ignore[attr-defined]
        made.append(tracer)
        return tracer

    yield make
    for t in made:
        t.finish()


@pytest.fixture
def cuda_sim():
    """Factory: ``cuda_sim(devices=1, lag_steps=0, ...)`` installs the simulated CUDA runtime
    (:mod:`tests.cudasim`) for this test and fully restores torch afterwards."""
    import cudasim

    made: list[cudasim.CudaSim] = []

    def make(**kwargs):
        sim = cudasim.CudaSim(**kwargs)
        sim.install()
        made.append(sim)
        return sim

    try:
        yield make
    finally:
        for sim in reversed(made):
            sim.uninstall()
    for sim in made:  # raised where found, but the code under test may have swallowed it
        assert not sim.reuse_errors, sim.reuse_errors


@pytest.fixture
def world1() -> Iterator[Any]:
    """A one-rank gloo world in this process (HashStore: no port), torn down afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


RANKS_GROUP = "ranks"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start a world of processes (everything under ``tests/dist/`` and every test
    marked ``slow``) run one at a time under pytest-xdist (``--dist loadgroup``): on two cores,
    two such worlds at once would time each other's ranks. The short in-process tests run on the
    other workers beside them. Those tests start the fork server their ranks fork from first."""
    dist_dir = Path(__file__).resolve().parent / "dist"
    grouped = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if item.path.is_relative_to(dist_dir) or item.get_closest_marker("slow"):
            if "fork_server" not in item.fixturenames:  # parametrized items share the list
                item.fixturenames.insert(0, "fork_server")
            if grouped:
                item.add_marker(pytest.mark.xdist_group(RANKS_GROUP))


@pytest.fixture(scope="session")
def fork_server(request: pytest.FixtureRequest) -> None:
    """Start the fork server that ``spawn_local`` forks ranks from, importing once what the
    selected tests' ranks import besides torch: a test module lists it in ``RANK_IMPORTS``
    (e.g. ``transformers.trainer``, seconds of CPU that every rank would pay again).

    Only when some selected module asks, and only modules that are installed; otherwise the
    server starts on the first launch with ``FORKSERVER_PRELOAD`` alone. Started by the first
    test that launches ranks, so an xdist worker that runs none pays nothing.
    """
    import importlib.util
    import multiprocessing
    import multiprocessing.forkserver

    from stepscope.recording.dist import FORKSERVER_PRELOAD

    modules = {getattr(item, "module", None) for item in request.session.items}
    wanted = sorted({name for mod in modules for name in getattr(mod, "RANK_IMPORTS", ())})
    wanted = [name for name in wanted if importlib.util.find_spec(name.partition(".")[0])]
    if wanted and "forkserver" in multiprocessing.get_all_start_methods():
        multiprocessing.set_forkserver_preload([*FORKSERVER_PRELOAD, *wanted])
        # The server and the ranks forked from it write to its stdout and stderr: not the
        # terminal or this test's captured output (a rank's exception still reaches its test
        # through torch's error file).
        saved = [os.dup(1), os.dup(2)]
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            multiprocessing.forkserver.ensure_running()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (*saved, devnull):
                os.close(fd)
