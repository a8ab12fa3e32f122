"""Real DDP and FSDP2 over gloo still train correctly with the CUDA simulator installed.

Without stepscope: this checks the simulator, not the recorder. One process per rank, each
simulating its own device (``cudasim.install(devices=world)``).
"""

from __future__ import annotations

import json
from pathlib import Path

import cudasim
import pytest
import torch
import torch.distributed as dist
from torch import nn

from stepscope.recording.dist import become_local_rank, spawn_local

pytestmark = pytest.mark.slow


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    become_local_rank(rank, world, port)
    sim = cudasim.install(devices=world, lag_steps=1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res: dict[str, object] = {}
    try:
        # DDP tutorial: .to(rank), device_ids=[rank], no set_device.
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)).to(rank)
        ddp = DDP(model, device_ids=[rank])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(64, 10, generator=g)
        y = 2.0 * x[:, :5]  # a learnable target
        losses = []
        sim.reset_counts()
        for _ in range(30):
            loss = nn.functional.mse_loss(ddp(x), y.to(rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            sim.host_tick()
        flat = _flat(model.parameters())
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        res["ddp"] = {
            "devices": sorted({str(p.device) for p in model.parameters()}),
            "current_device": torch.cuda.current_device(),
            "in_sync": all(torch.equal(gathered[0], t) for t in gathered),
            "learned": losses[-1] < 0.8 * losses[0],
            "threads": sorted(set(sim.backward_threads)),
            # DDP moving x to the device, and y.to(rank), both from pageable memory, each step:
            # the only host syncs.
            "syncs": sorted({k for k, _ in sim.sync_log}),
            "n_syncs": sim.syncs,
        }
        # FSDP2 on a CPU mesh (gloo), after set_device as FSDP2 scripts do.
        torch.cuda.set_device(rank)
        torch.manual_seed(0)
        fs = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
        mesh = init_device_mesh("cpu", (world,))
        for m in fs:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(fs, mesh=mesh)
        opt = torch.optim.SGD(fs.parameters(), lr=0.05)
        losses = []
        for _ in range(30):
            loss = nn.functional.mse_loss(fs(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        res["fsdp"] = {"learned": losses[-1] < 0.8 * losses[0],
                       "threads": sorted(set(sim.backward_threads))}
        (Path(out) / f"fw{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def test_ddp_and_fsdp2_train_over_gloo_with_the_simulator(tmp_path):
    spawn_local(_worker, 2, tmp_path)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"fw{rank}.json").read_text())
        assert res["ddp"] == {"devices": [f"cuda:{rank}"], "current_device": 0, "in_sync": True,
                              "learned": True, "threads": [f"cudasim-autograd-{rank}"],
                              "syncs": ["h2d.pageable"], "n_syncs": 60}
        assert res["fsdp"] == {"learned": True,
                               "threads": sorted({f"cudasim-autograd-{rank}"})}
