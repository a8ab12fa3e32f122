"""stepscope on a busy simulated GPU: kernels cost GPU time, the host runs ahead.

Each test runs the public API on the GPU-bound simulator (``CudaSim(tflops=...)``: every op on
a simulated-device tensor is a kernel costed by its FLOPs) and checks a claim that only holds
when the GPU, not the host, is the bottleneck.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import stepscope
from stepscope.prefetch import PrefetchLoader
from stepscope.records import read_run

KiB = 1 << 10
#: 2 FLOP/ns: one forward + weight-gradient backward of Linear(1024, 1024) on 64 rows is
#: 2 x 134 MFLOP, ~134 ms of GPU time.
TFLOPS = 2e-6
#: 2.5 MB/s: a 256 KiB batch (64 x 1024 float32) is ~105 ms of copy.
COPY_BYTES_PER_NS = 0.0025
BATCHES = 6


def _records(path: Any) -> list[dict[str, Any]]:
    return sorted(read_run(path), key=lambda r: r["step"])


def _train(sim: Any, loader: Any, model: nn.Module) -> None:
    for batch in loader:
        with stepscope.step():
            model(batch).sum().backward()
    sim.drain()  # the GPU finishes its queue (a test helper, not a host sync)


def test_prefetch_hides_the_copy_under_compute_in_the_readme_loop(tmp_path, cuda_sim):
    sim = cuda_sim(tflops=TFLOPS, copy_bytes_per_ns=COPY_BYTES_PER_NS)
    model = nn.Linear(1024, 1024, bias=False).to("cuda")
    data = [torch.randn(64, 1024).pin_memory() for _ in range(BATCHES)]
    stepscope.init(out_dir=str(tmp_path), flush_every_n_steps=1, heartbeat_s=0)
    try:
        _train(sim, PrefetchLoader(data, "cuda"), model)
    finally:
        stepscope.finish()
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == list(range(BATCHES))
    copy_ms = 64 * 1024 * 4 / COPY_BYTES_PER_NS / 1e6
    compute_ms = 2 * 2 * 64 * 1024 * 1024 / TFLOPS / 1e9
    for r in recs[1:]:  # batch 0's copy has nothing to hide under
        assert r["side_ms"]["h2d_copy"] == pytest.approx(copy_ms, rel=0.02)
        assert r["h2d_hidden_ms"] >= 0.95 * r["side_ms"]["h2d_copy"], r
        # The GPU does the compute, not compute + copy, per step.
        assert r["step_ms"] < compute_ms + 0.1 * copy_ms, r
    # No batch memory was reused while a kernel still read it (the fixture checks too).
    assert sim.reuse_errors == []
