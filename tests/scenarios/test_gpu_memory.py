"""Per-step memory on the simulated CUDA runtime: the job's own peak counters
(HF's and torchtitan's memory metrics read ``max_memory_allocated`` after resetting it
themselves) are never reset by stepscope."""

from __future__ import annotations

import torch

import stepscope
from stepscope.recording.schema import read_run

MiB = 1 << 20


def test_users_peak_counter_survives_and_records_carry_the_running_peak(tmp_path, cuda_sim):
    sim = cuda_sim(devices=1)
    stepscope.init(out_dir=str(tmp_path), auto=False, flush_every_n_steps=1, heartbeat_s=0)
    user_peaks = []
    try:
        torch.cuda.reset_peak_memory_stats()  # the job's own metric window starts here
        for i in range(4):
            with stepscope.step():
                big = torch.zeros((16 if i == 1 else 2) * MiB // 4, device="cuda")  # 16 MiB at step 1
                del big
            sim.host_tick()
            user_peaks.append(torch.cuda.max_memory_allocated())
    finally:
        stepscope.finish()
    # Before: stepscope reset the peak at every step, so the job's own reading after step 2
    # said 2 MiB although the job had used 16 MiB in its window.
    assert user_peaks == [2 * MiB, 16 * MiB, 16 * MiB, 16 * MiB], [p / MiB for p in user_peaks]
    recs = sorted(read_run(tmp_path), key=lambda r: r["step"])
    mem = [r["memory"] for r in recs]
    assert [m["peak_allocated_mb"] for m in mem] == [2.0, 16.0, 16.0, 16.0]
    assert all(m["allocated_mb"] == 0.0 for m in mem)
    assert sim.syncs == 0, sim.sync_log
