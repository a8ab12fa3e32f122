"""GPU tests for PrefetchLoader: bit-identical batches, safe memory reuse, flat reserved memory."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from stepscope.prefetch import PrefetchLoader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

Pair = namedtuple("Pair", ["image", "label"])


class Images(Dataset[dict[str, Any]]):
    """Deterministic pseudo-random samples (seeded by index) so every path sees the same data."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 64, 64)) -> None:
        self.n, self.shape = n, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        return {
            "x": torch.rand(self.shape, generator=g),
            "pair": Pair(torch.randint(0, 255, (16,), generator=g, dtype=torch.uint8), i),
            "ids": [torch.randint(0, 50_000, (32,), generator=g), f"s{i}"],
        }


def _naive(batch: Any, device: torch.device) -> Any:
    from stepscope.instrument.batch import map_tensors

    return map_tensors(lambda t: t.to(device), batch)


def _assert_bit_identical(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
        # bitwise, NaN-safe: compare the raw bytes
        assert a.cpu().numpy().tobytes() == b.cpu().numpy().tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_bit_identical(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bit_identical(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dl_pin", [False, True])
def test_bit_identical_to_naive_path(workers: int, dl_pin: bool) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    ds = Images(9)
    naive = [_naive(b, dev) for b in DataLoader(ds, batch_size=4)]
    loader = PrefetchLoader(DataLoader(ds, batch_size=4, num_workers=workers, pin_memory=dl_pin))
    got = list(loader)
    torch.cuda.synchronize()
    assert len(got) == len(naive) == 3
    for a, b in zip(got, naive, strict=True):
        _assert_bit_identical(a, b)
        assert a["x"].device == dev


def test_slow_consumer_and_early_free_do_not_corrupt() -> None:
    """The consumer is slowed on the GPU and drops each batch right away: the allocator
    then offers that memory to the next copy, which must wait for the consumer."""
    dev = torch.device("cuda", torch.cuda.current_device())
    n, numel = 12, 1 << 20
    src = [torch.full((numel,), float(i)) for i in range(n)]
    sums = []
    for batch in PrefetchLoader(src, device=dev):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the batch is read
        sums.append(batch.sum())
        del batch  # freed long before the GPU has read it
    torch.cuda.synchronize()
    assert [s.item() for s in sums] == [float(i) * numel for i in range(n)]


def test_prefetched_copy_overlaps_compute() -> None:
    """The copy of batch N+1 is queued before batch N is returned, and runs on its own stream."""
    dev = torch.device("cuda", torch.cuda.current_device())
    src = [torch.ones(1 << 22).pin_memory() for _ in range(3)]
    it = iter(PrefetchLoader(src, device=dev))
    first = next(it)
    pending = it._pending  # batch 1, already queued on the copy stream
    assert pending is not None and pending.batch.device == dev
    assert first.device == dev
    # the keep-alive holds the user's own pinned tensor (no extra pin)
    assert pending.keepalive[0] is src[1]
    rest = list(it)
    assert len(rest) == 2 and all(bool((b == 1).all()) for b in rest)


@pytest.mark.slow
def test_no_race_under_the_cuda_sanitizer() -> None:
    """TORCH_CUDA_SANITIZER checks every stream access: the early free must be ordered."""
    script = textwrap.dedent("""
        import torch
        from stepscope.prefetch import PrefetchLoader
        out = []
        for batch in PrefetchLoader([torch.full((1 << 16,), float(i)) for i in range(6)]):
            torch.cuda._sleep(5_000_000)
            out.append(batch.sum())
            del batch
        torch.cuda.synchronize()
        assert [o.item() for o in out] == [float(i) * (1 << 16) for i in range(6)]
    """)
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "data race" not in proc.stderr, proc.stderr[-4000:]


def test_memory_reserved_flat_across_epochs() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    src = [torch.rand(1 << 20) for _ in range(6)]
    loader = PrefetchLoader(src, device=dev)
    reserved = []
    for _ in range(3):
        for batch in loader:
            (batch * 2).sum()
        del batch
        torch.cuda.synchronize()
        gc.collect()
        reserved.append(torch.cuda.memory_reserved(dev))
    assert reserved[0] == reserved[1] == reserved[2], reserved
    assert len(loader._streams) == 1  # one copy stream for the loader's whole life


def test_break_releases_device_memory() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    loader = PrefetchLoader([torch.rand(1 << 20) for _ in range(5)], device=dev)
    for i, _batch in enumerate(loader):
        if i == 1:
            break
    del _batch
    gc.collect()
    assert torch.cuda.memory_allocated(dev) == before


def test_tensors_already_on_device_are_left_alone() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    on_dev = torch.ones(4, device=dev)
    (out,) = list(PrefetchLoader([{"a": on_dev, "b": torch.ones(4)}], device=dev))
    assert out["a"] is on_dev and out["b"].device == dev


def test_reports_exposed_and_hidden_copy_through_a_tracer() -> None:
    class Recorder:
        recording = True

        def __init__(self) -> None:
            self.phases: list[Any] = []
            self.side: list[Any] = []
            self.counters: dict[str, float] = {}

        def open_phase(self, name: str) -> Any:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return name, start

        def close_phase(self, token: Any) -> None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.phases.append((token[0], token[1], end))

        def add_side_span(self, name: str, start: Any, end: Any) -> None:
            self.side.append((name, start, end))

        def add_counter(self, name: str, value: float) -> None:
            self.counters[name] = self.counters.get(name, 0) + value

    dev = torch.device("cuda", torch.cuda.current_device())
    rec = Recorder()
    src = [torch.rand(1 << 24).pin_memory() for _ in range(4)]  # 64 MiB each
    for batch in PrefetchLoader(src, device=dev, tracer=rec):
        torch.cuda._sleep(100_000_000)  # compute much longer than the copy
        del batch
    torch.cuda.synchronize()
    assert rec.counters["h2d_bytes"] == 4 * (1 << 24) * 4
    copy_ms = [s.elapsed_time(e) for _, s, e in rec.side]
    exposed_ms = [s.elapsed_time(e) for _, s, e in rec.phases]
    assert len(copy_ms) == len(exposed_ms) == 4 and all(c > 0 for c in copy_ms)
    # after the first batch every copy ran under the previous batch's compute
    assert sum(exposed_ms[1:]) <= 0.05 * sum(copy_ms[1:])
