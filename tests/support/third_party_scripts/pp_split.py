"""Re-creation (own code) of the usage pattern of pytorch/PiPPy's examples/basic/example_train.py,
written against the upstream ``torch.distributed.pipelining`` API: a module-level script that
builds the whole model on every rank, splits it with the tracing frontend (``pipeline`` and
``SplitPoint.END`` after blocks), builds this rank's stage, and runs one GPipe step over
micro-batches: the first stage feeds the input, the last computes the loss.

As in a language model's pipeline, the first stage holds an input projection (the embedding's
place) and the last the output head, so neither end carries more operators than the other: the
balanced run really is balanced, not just left with the loss on its last stage.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
width, n_out, batch, n_micro = 256, 4, 32, 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Stack(torch.nn.Module):
    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = torch.nn.Linear(width, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


torch.manual_seed(0)
net = Stack(world)
# One stage per rank: cut after every block but the last.
spec = {f"blocks.{i}": SplitPoint.END for i in range(world - 1)}
pipe = pipeline(net, (torch.randn(batch // n_micro, width),), split_spec=spec)

dist.init_process_group(rank=rank, world_size=world)
stage = pipe.build_stage(rank, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_micro, loss_fn=torch.nn.MSELoss())

x = torch.randn(batch, width)
y = torch.randn(batch, n_out)
if rank == 0:
    schedule.step(x)
elif rank == world - 1:
    losses: list[torch.Tensor] = []
    schedule.step(target=y, losses=losses)
else:
    schedule.step()

if rank == world - 1:
    print("pipeline step done")
