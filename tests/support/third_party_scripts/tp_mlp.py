"""Re-creation (own code) of the usage pattern of pytorch/examples'
distributed/tensor_parallelism/tensor_parallel_example.py: a module-level script, launched by
torchrun, that builds a 1-D device mesh over all ranks, shards a two-layer MLP Megatron-style
(first projection column-wise, second row-wise) with ``parallelize_module``, and trains with
AdamW(foreach=True). Every rank draws the same input (seeded per iteration); the loss is the
output's sum, used outside the model (where the row-parallel all-reduce is first waited on).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class TwoLayerMLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 64, d_out: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(d_in, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


world = int(os.environ["WORLD_SIZE"])
accel = torch.accelerator.current_accelerator()
device_type = accel.type if accel is not None else "cpu"
mesh = init_device_mesh(device_type, (world,))
rank = mesh.get_rank()

model = TwoLayerMLP().to(device_type)
model = parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)

iterations = 8
for it in range(iterations):
    torch.manual_seed(it)  # the same batch on every tensor-parallel rank
    batch = torch.rand(24, 16, device=device_type)
    out = model(batch)
    out.sum().backward()
    optimizer.step()
    if rank == 0 and it % 4 == 0:
        print(f"iteration {it} done")

if dist.is_initialized():
    dist.destroy_process_group()
