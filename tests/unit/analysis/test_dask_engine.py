"""``stepscope report --engine dask``: the per-rank-block tasks on a Dask cluster give the
same report as the single-machine path, and its errors are one line."""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import synth_collectives as sc
from synth_runs import Slow, SynthRun, write_run

from stepscope.analysis import align, dask_engine, own, series, stragglers
from stepscope.analysis import store as st
from stepscope.analysis.blocks import WHOLE
from stepscope.analysis.load import load_run
from stepscope.analysis.run import open_analyzed_run
from stepscope.analysis.stats import create_phase_samples, local_phase_rank_rows
from stepscope.cli import main

distributed = pytest.importorskip("distributed")

#: Runs shaped like the equivalence corpus's (benchmarks/equivalence_corpus.py): several
#: hosts with clock offsets, hidden H2D time, recorded collectives, hostile lines (no flat
#: copy: the client sends the rows), and more ranks than one store partition holds.
RUNS = {
    "multihost": lambda d: write_run(d, SynthRun(ranks=16, steps=60, hosts=4, host_offset_ms=37.0,
                                                 slow=(Slow(9, "forward", 8.0),))),
    "hidden": lambda d: write_run(d, SynthRun(ranks=4, steps=50, h2d_hidden_ms=1.5,
                                              slow=(Slow(0, "h2d", 5.0),))),
    "ddp_accum": lambda d: sc.write(d, sc.make_records(
        sc.CollRun(sc.ddp_program(micro=4), ranks=4, slow=(Slow(2, "forward", 5.0),)))),
    "two_blocks": lambda d: write_run(d, SynthRun(ranks=st.RANK_BLOCK + 4, steps=6, every=1,
                                                  slow=(Slow(258, "dataloader", 12.0),))),
}


def _hostile(d: Path) -> Path:
    write_run(d, SynthRun(ranks=4, steps=60, slow=(Slow(3, "forward", 9.0),)))
    lines = (d / "rank1.jsonl").read_text().splitlines(True)
    # A duplicate record, a corrupt line, step 30 missing, a torn last line.
    (d / "rank1.jsonl").write_text("".join([*lines[:10], lines[9], "{not json\n", *lines[10:30],
                                            *lines[31:]]) + '{"schema": 1, "ra')
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus")
    runs = {name: root / name for name in RUNS}
    for name, make in RUNS.items():
        make(runs[name])
    runs["hostile"] = _hostile(root / "hostile")
    return runs


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """A local cluster in this process (threads, not processes: cheap to start)."""
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  **dask_engine.LOCAL_OPTIONS) as cluster:
        yield str(cluster.scheduler_address)


def _report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["report", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name", [*RUNS, "hostile"])
def test_dask_report_is_the_default_report(name: str, corpus: dict[str, Path], address: str,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # Step blocks of ~7 steps of 16 ranks: several step-block tasks a statement; series
    # tasks of 3 ranks.
    monkeypatch.setattr(dask_engine, "STEP_BLOCK_RECORDS", 100)
    monkeypatch.setattr(dask_engine, "SERIES_BLOCK_RANKS", 3)
    run = str(corpus[name])
    code, default, _ = _report(capsys, run, "--json")
    assert code == 0
    code, dask, err = _report(capsys, run, "--json", "--engine", "dask", "--dask-address", address)
    assert code == 0, err
    assert json.loads(dask) == json.loads(default)
    assert json.loads(dask)["phases"]  # a document, with the per-rank statistics the tasks made


def test_tasks_read_the_store_partitions(corpus: dict[str, Path]) -> None:
    """A run compacted with its flat copy: one task per rank block, reading that block's
    files; the hostile run has no flat copy the report reads: its rows are sent."""
    data = load_run(corpus["two_blocks"])
    try:
        tasks = dask_engine.plan(data)
        assert [t.ranks for t in tasks] == [(0, st.RANK_BLOCK - 1),
                                            (st.RANK_BLOCK, 2 * st.RANK_BLOCK - 1)]
        assert all(t.files and t.phases is None for t in tasks)
        assert all(f"rank_block={k}" in f for k, t in enumerate(tasks) for f in t.files)
        create_phase_samples(data.con)
        local = local_phase_rank_rows(data.con)
        by_tasks = [r for t in tasks for r in dask_engine.run_rank_block(t)]
        assert sorted(by_tasks) == sorted(local) and len(local) == 6 * (st.RANK_BLOCK + 4)
    finally:
        data.close()
    data = load_run(corpus["hostile"])
    try:
        tasks = dask_engine.plan(data)
        assert tasks and all(not t.files and t.phases is not None for t in tasks)
    finally:
        data.close()


@pytest.mark.parametrize("name", ["multihost", "hostile"])
def test_step_block_tasks_give_the_whole_run_rows(name: str, corpus: dict[str, Path]) -> None:
    """Blocks of whole steps, disjoint and covering every step; each task reads its steps of
    the store's flat copy (or is sent them: the hostile run) and the union of their rows of
    each alignment statement is the rows the default path inserts."""
    data = load_run(corpus[name])
    try:
        tasks = dask_engine.plan_steps(data, 100)
        steps = [s for (s,) in data.con.execute("SELECT DISTINCT step FROM steps ORDER BY 1").fetchall()]
        assert len(tasks) > 2
        assert [s for t in tasks for s in steps if t.steps[0] <= s <= t.steps[1]] == steps
        assert all(bool(t.files) == (name != "hostile") for t in tasks)
        whole_run = align.block_params(WHOLE, WHOLE)
        hosts = sorted(data.hosts)
        for table, select, params in (
                ("spreads", align.SYNC_SPREADS,
                 {"names": ["forward", "backward", "optimizer"], "hosts": hosts}),
                ("ends", align.SYNC_ENDS, {"sync": "backward", "hosts": hosts})):
            whole = data.con.execute(select, {**params, **whole_run}).fetchall()
            parts = [dask_engine.run_step_block(t, select, params) for t in tasks]
            by_tasks = [tuple(row) for p in parts for row in zip(*p.values(), strict=True)]
            assert len(whole) > len(tasks) and sorted(by_tasks) == sorted(whole), table
    finally:
        data.close()


def test_alignment_from_step_block_tasks(corpus: dict[str, Path], address: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The alignment computed from the tasks' rows is the default path's, to the last bit
    (the spread of the phase ends and each host's clock offset, before rounding)."""
    monkeypatch.setattr(dask_engine, "STEP_BLOCK_RECORDS", 100)
    ran: list[str] = []
    with distributed.Client(address) as client:
        bind = dask_engine.step_runner(client)
        got = []
        for engine in (None, bind):
            data = load_run(corpus["multihost"])
            try:
                rows = None if engine is None else engine(data)

                def counted(table: str, select: str, params: dict[str, Any],
                            rows: Any = rows) -> None:
                    ran.append(table)
                    rows(table, select, params)

                got.append(align.align(data.con, data.hosts, len(data.ranks), 10.0,
                                       None if rows is None else counted))
            finally:
                data.close()
    assert ran == ["sync_spreads", "sync_ends"]
    assert got[1] == got[0] and got[0].end_spread_ms is not None and len(got[0].offsets_ms) == 4


@pytest.mark.parametrize("name", ["multihost", "two_blocks"])
def test_series_screen_from_rank_block_tasks(name: str, corpus: dict[str, Path], address: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Each (rank, phase) gap series' screen (its noise, and whether the straggler search may
    name a straggler on it) comes from one task per block of ranks on the cluster (counted
    in its task stream), never from the client's thread; the screen, and the report, are
    the default path's."""
    monkeypatch.setattr(dask_engine, "SERIES_BLOCK_RANKS", 5)
    on_client: list[int] = []
    candidates = stragglers.candidates_of

    def where(data: series.Series, *args: Any) -> frozenset[tuple[int, str]]:
        if threading.current_thread() is threading.main_thread():
            on_client.append(len(data))
        return candidates(data, *args)

    monkeypatch.setattr(stragglers, "candidates_of", where)
    got: list[tuple[stragglers.SeriesScreen, tuple[Any, ...]]] = []
    with distributed.Client(address) as client:
        engine = dask_engine.series_runner(client)

        def spy(*args: Any) -> stragglers.SeriesScreen:
            got.append((engine(*args), args))
            return got[-1][0]

        with distributed.get_task_stream(client) as stream:
            run = open_analyzed_run(corpus[name], series_screen=spy)
        run.close()
    tasks = {t["key"] for t in stream.data if "run_series_block" in str(t["key"])}
    ranks = len(run.doc["run"]["rank_ids"])
    assert len(tasks) == -(-ranks // 5) and got and len(got[0][1][0]) >= ranks
    assert on_client == []  # the candidates were found in the tasks only
    screen, args = got[0]
    whole = stragglers.screen_series(*args)
    assert list(screen.thresholds.items()) == list(whole.thresholds.items())
    assert screen.candidates == whole.candidates
    assert on_client == [len(args[0])]  # screen_series itself runs here, on the client
    default = open_analyzed_run(corpus[name])
    default.close()
    assert run.doc == default.doc


@pytest.mark.parametrize("name", ["multihost", "ddp_accum", "hostile"])
def test_own_work_from_step_block_tasks(name: str, corpus: dict[str, Path], address: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The own-work and gap matrices (and each step's middle values, timed steps, waits)
    come from one task per step block on the cluster (counted in its task stream: none if
    the client built them), equal to the whole run's on the client, cell by cell; the
    report is the default path's."""
    monkeypatch.setattr(dask_engine, "STEP_BLOCK_RECORDS", 100)
    checked: list[int] = []
    with distributed.Client(address) as client:
        bind = dask_engine.own_runner(client)

        def spy(data: Any) -> own.OwnBlockRunner:
            blocks = bind(data)

            def run(spec: own.OwnSpec) -> list[own.OwnBlock | None]:
                got = blocks(spec)
                whole = own.own_block(data.con, spec)
                assert whole is not None and all(b is not None for b in got)
                parts = [b for b in got if b is not None]
                for k in range(len(spec.names)):
                    for field in ("owns", "gaps"):
                        joined = np.concatenate([getattr(b, field)[k] for b in parts], axis=1)
                        assert np.array_equal(joined, getattr(whole, field)[k], equal_nan=True)
                    mids = [np.concatenate(c) for c in zip(*[m for b in parts for m in b.mids[k]],
                                                            strict=True)]
                    ref = [np.concatenate(c) for c in zip(*whole.mids[k], strict=True)]
                    assert all(np.array_equal(a, b, equal_nan=True)
                               for a, b in zip(mids, ref, strict=True))
                checked.append(len(parts))
                return got

            return run

        with distributed.get_task_stream(client) as stream:
            run = open_analyzed_run(corpus[name], own_blocks=spy)
        run.close()
    tasks = {t["key"] for t in stream.data if "run_own_block" in str(t["key"])}
    assert checked and checked[0] > 2 and len(tasks) == checked[0]
    default = open_analyzed_run(corpus[name])
    default.close()
    assert run.doc == default.doc


def test_a_phase_named_like_sql_gives_the_same_report(tmp_path: Path, address: str,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The synchronising phase named with braces and both quotes: the alignment's statements
    take it as a bound value, never as text, on both engines (the same report, the name kept)."""
    monkeypatch.setattr(dask_engine, "STEP_BLOCK_RECORDS", 100)
    write_run(tmp_path, SynthRun(ranks=8, steps=30, hosts=2, host_offset_ms=21.0, comm_child=True,
                                 slow=(Slow(5, "forward", 8.0),)))
    odd = "x{block}'\"{names}"
    for f in tmp_path.glob("rank*.jsonl"):
        f.write_text(f.read_text().replace('"backward"', json.dumps(odd)))
    code, default, err = _report(capsys, str(tmp_path), "--json")
    assert code == 0, err
    code, dask, err = _report(capsys, str(tmp_path), "--json", "--engine", "dask",
                              "--dask-address", address)
    assert code == 0, err
    doc = json.loads(dask)
    assert doc == json.loads(default)
    assert odd in doc["phases"]
    al = doc["run"]["alignment"]
    assert (al["sync_phase"], al["arrival"]) == (odd, "allreduce") and al["end_spread_ms"] is not None


def test_store_by_file_url(corpus: dict[str, Path], address: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """The store read by URL (object storage; here ``file://``), the same on both engines."""
    code, from_dir, _ = _report(capsys, str(corpus["multihost"]), "--json")  # compacts the store
    url = (corpus["multihost"] / st.STORE_DIR).resolve().as_uri()
    code, default, err = _report(capsys, url, "--json")
    assert code == 0, err
    code, dask, err = _report(capsys, url, "--json", "--engine", "dask", "--dask-address", address)
    assert code == 0, err
    assert json.loads(dask) == json.loads(default)
    # The same statistics as from the run directory (goodput there reads the rank files too).
    assert json.loads(dask)["phases"] == json.loads(from_dir)["phases"]


def test_a_local_cluster_when_no_address(corpus: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Worker processes of their own (one: a cheaper start), closed afterwards."""
    monkeypatch.setattr(dask_engine, "LOCAL_WORKERS", 1)
    run = str(corpus["hidden"])
    _, default, _ = _report(capsys, run, "--json")
    code, dask, err = _report(capsys, run, "--json", "--engine", "dask")
    assert code == 0, err
    assert json.loads(dask) == json.loads(default)


def test_without_dask_one_line_naming_the_extra(corpus: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)  # import fails as if not installed
    code, out, err = _report(capsys, str(corpus["hidden"]), "--json", "--engine", "dask")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "pip install 'stepscope[dask]'" in err


def test_unreachable_scheduler_one_line(corpus: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(dask_engine, "CONNECT_TIMEOUT_S", 1.0)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"tcp://127.0.0.1:{port}"
    code, out, err = _report(capsys, str(corpus["hidden"]), "--json", "--engine", "dask",
                             "--dask-address", addr)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and addr in err and "cannot reach the Dask scheduler" in err


def test_address_needs_the_dask_engine(corpus: dict[str, Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _report(capsys, str(corpus["hidden"]), "--dask-address", "tcp://x:1")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--engine dask" in err


def test_a_scheduler_without_workers_one_line(corpus: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Not a report that waits forever for a worker."""
    monkeypatch.setattr(dask_engine, "CONNECT_TIMEOUT_S", 1.0)
    with distributed.LocalCluster(n_workers=0, processes=False,
                                  **dask_engine.LOCAL_OPTIONS) as empty:
        addr = str(empty.scheduler_address)
        code, out, err = _report(capsys, str(corpus["hidden"]), "--json", "--engine", "dask",
                                 "--dask-address", addr)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "has no workers" in err
