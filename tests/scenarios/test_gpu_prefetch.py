"""PrefetchLoader on the simulated CUDA runtime, through a real tracer.

``PrefetchLoader(wrap_loader(...))`` as the README recommends, with unpinned leaves (plain
tensors and an object with its own ``.to()``): no host sync, each step charged its own batch's
dataloader wait (batch 0's included), at most two batches on the device.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import stepscope
from stepscope.common.errors import StepscopeWarning
from stepscope.prefetch import PrefetchLoader
from stepscope.recording.schema import read_run

MiB = 1 << 20
N = 8
#: How long fetching batch i takes (s): batch 0 (workers starting) and batch 5 are slow.
FETCH_S = {0: 0.3, 5: 0.3}
FAST_S = 0.01


class Tokens:
    """A batch type with its own ``.to()`` and ``pin_memory()`` (like a tokenizer's encoding)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def to(self, device: Any, non_blocking: bool = False) -> Tokens:
        return Tokens(self.ids.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Tokens:
        return Tokens(self.ids.pin_memory())


class SlowSource:
    """An iterable of unpinned batches whose fetch takes ``FETCH_S`` seconds."""

    def __init__(self, n: int = N, tokens: bool = True) -> None:
        self.n, self.tokens = n, tokens

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            time.sleep(FETCH_S.get(i, FAST_S))
            batch: dict[str, Any] = {"x": torch.full((MiB // 4,), float(i)), "i": i}  # 1 MiB
            if self.tokens:
                batch["tok"] = Tokens(torch.zeros(4, dtype=torch.int64))
            yield batch


def _run(tmp_path: Any, sim: Any, source: Any, **kw: Any) -> tuple[list[dict[str, Any]], list[int]]:
    stepscope.init(out_dir=str(tmp_path), auto={"dataloader"}, flush_every_n_steps=1, heartbeat_s=0)
    peaks: list[int] = []
    try:
        seen = []
        for batch in PrefetchLoader(stepscope.wrap_loader(source), **kw):
            with stepscope.step():
                assert batch["x"].device.type == "cuda"
                seen.append(batch["i"])
                time.sleep(0.02)  # compute
            peaks.append(torch.cuda.memory_stats(0)["allocated_bytes.all.current"])
            sim.host_tick()
    finally:
        stepscope.finish()
    assert seen == list(range(N))
    recs = sorted(read_run(tmp_path), key=lambda r: r["step"])
    return recs, peaks


def _dl_ms(rec: dict[str, Any]) -> float:
    return sum(p["ms"] for p in rec["phases"] if p["name"] == "dataloader")


def test_wrap_loader_composition_charges_each_step_its_own_batch_and_never_syncs(tmp_path, cuda_sim):
    sim = cuda_sim(devices=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepscopeWarning)  # nothing to warn about: all pinned
        recs, peaks = _run(tmp_path, sim, SlowSource())
    # Unpinned leaves were pinned (the tensor by PrefetchLoader, Tokens by its pin_memory()):
    # every copy asynchronous, no host sync at all.
    assert sim.syncs == 0, sim.sync_log
    assert all(not blocking for kind, _, blocking in sim.copies if kind == "h2d"), sim.copies
    assert [r["step"] for r in recs] == list(range(N))
    dl = [_dl_ms(r) for r in recs]
    # Before: step k got batch k+1's wait (step 4 showed batch 5's 300 ms) and batch 0's wait
    # was dropped. Now each step has its own batch's (fast fetches sleep 10 ms; the margin is
    # for a loaded 2-core machine).
    assert dl[0] >= 290.0, dl
    assert dl[5] >= 290.0, dl
    assert all(dl[i] < 200.0 for i in range(N) if i not in FETCH_S), dl
    # At most two 1 MiB batches (plus the small Tokens) on the device at any step's end.
    assert max(peaks) <= 2 * MiB + 4096, [p / MiB for p in peaks]
    assert torch.cuda.memory_stats(0)["allocated_bytes.all.peak"] <= 2 * MiB + 4096


def test_pin_memory_false_warns_once_and_falls_back_to_blocking_copies(tmp_path, cuda_sim):
    sim = cuda_sim(devices=1)
    with pytest.warns(StepscopeWarning, match="pin_memory=False") as caught:
        recs, _ = _run(tmp_path, sim, SlowSource(tokens=False), pin_memory=False)
    assert len([w for w in caught if "pinned memory" in str(w.message)]) == 1
    assert len(recs) == N
    assert sim.syncs >= N  # the fallback: pageable copies block, and are counted as such
    assert {kind for kind, _ in sim.sync_log} == {"h2d.pageable"}


def test_object_without_pin_memory_warns_once(tmp_path, cuda_sim):
    class Bare:
        def __init__(self) -> None:
            self.ids = torch.zeros(4)

        def to(self, device: Any, non_blocking: bool = False) -> Bare:
            out = Bare()
            out.ids = self.ids.to(device, non_blocking=non_blocking)
            return out

    sim = cuda_sim(devices=1)
    batches = [{"x": torch.zeros(4), "b": Bare()} for _ in range(3)]
    stepscope.init(out_dir=str(tmp_path), auto=False, heartbeat_s=0)
    try:
        with pytest.warns(StepscopeWarning, match="Bare has .to\\(\\) but no pin_memory") as caught:
            for _batch in PrefetchLoader(batches):
                with stepscope.step():
                    pass
                sim.host_tick()
    finally:
        stepscope.finish()
    assert len([w for w in caught if "Bare" in str(w.message)]) == 1
    assert [k for k, _ in sim.sync_log] == ["h2d.pageable"] * 3  # only Bare's copies blocked


def test_loop_without_steps_still_prefetches(cuda_sim):
    """No tracer steps around batches: batch N+1 is queued at hand-over, as before."""
    sim = cuda_sim(devices=1)
    out = [b["i"] for b in PrefetchLoader(SlowSource(n=4, tokens=False))]
    assert out == [0, 1, 2, 3] and sim.syncs == 0
