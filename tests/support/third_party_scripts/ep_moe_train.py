"""Training script (own code) for an expert-parallel mixture-of-experts layer, set up the way
pytorch/torchtitan does it: a ``MoE`` (router -> reorderer -> grouped experts) whose routed
experts are sharded over the expert-parallel mesh with
``parallelize_module(moe.experts, ep_mesh, ExpertParallel())``; ``ExpertParallel`` exchanges the
per-expert token counts, then dispatches and combines the tokens with ``all_to_all_single``
(uneven splits). The classes come from ``moe_impl``: torchtitan's own modules (when its
repository is fetched) or this repository's re-creation (``ep_moe.py``).

Command line: ``--skew B`` adds B to the router's ``expert_bias`` (the per-expert routing bias
torchtitan's auxiliary-loss-free load balancing adjusts) for the experts of rank ``--hot``;
``--per-token-ms MS`` gives each routed token MS ms of expert compute (a sleep, so an expert's
time follows its token count on a CPU shared by every rank).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from moe_impl import ExpertParallel, MoE, MoEArgs
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

parser = argparse.ArgumentParser()
parser.add_argument("--skew", type=float, default=0.0)
parser.add_argument("--hot", type=int, default=1)
parser.add_argument("--per-token-ms", type=float, default=0.25)
parser.add_argument("--experts-per-rank", type=int, default=2)
args = parser.parse_args()

world = int(os.environ["WORLD_SIZE"])
ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
rank = ep_mesh.get_rank()
dim, hidden, tokens = 32, 64, 64


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.moe = MoE(MoEArgs(num_experts=world * args.experts_per_rank, num_shared_experts=0,
                               top_k=1, use_grouped_mm=False), dim=dim, hidden_dim=hidden)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(x)))


torch.manual_seed(0)  # the same initial weights on every rank
model = Net()
model.moe.init_weights(0.02, torch.device("cpu"))
with torch.no_grad():
    first = args.hot * args.experts_per_rank
    model.moe.expert_bias[first:first + args.experts_per_rank] += args.skew
parallelize_module(model.moe.experts, ep_mesh, ExpertParallel())
model.moe.experts.register_forward_pre_hook(
    lambda mod, inputs: time.sleep(args.per_token_ms * inputs[0].shape[0] / 1000.0))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

gen = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
for step in range(10):
    x = torch.randn(2, tokens // 2, 16, generator=gen)
    y = torch.randint(0, 4, (2, tokens // 2), generator=gen)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0 and step % 5 == 0:
        print(f"step {step} loss {loss.item():.3f}")

dist.destroy_process_group()
