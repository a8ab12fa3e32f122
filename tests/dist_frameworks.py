"""Real gloo runs of other parallelism styles, written the way their users write them.

- accelerate: ``Accelerator.prepare(model, optimizer, loader, scheduler)`` and the *prepared*
  optimizer handed to ``stepscope.init`` (the style of accelerate's ``nlp_example``).
- tensor parallel: ``parallelize_module`` with Colwise/RowwiseParallel on a feed-forward block
  over a 1-D device mesh (the style of pytorch/examples ``tensor_parallelism``).
- pipeline: ``torch.distributed.pipelining`` stages fed by a ``ScheduleGPipe`` / ``Schedule1F1B``.
- expert parallel: a mixture-of-experts layer that routes tokens with ``all_to_all_single``
  and uneven splits, one expert per rank.

Each injects sleeps through :class:`stepscope.demo._Injector` (25+ ms, above a busy 2-core
machine's jitter). One process per rank, one intra-op thread each.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import stepscope
from stepscope import demo
from stepscope.dist import free_port, run_then_exit


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)


def _spawn(worker: Callable[..., None], out_dir: str | os.PathLike[str], ranks: int,
           *args: Any) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(run_then_exit, args=(worker, ranks, free_port(), str(out), *args),  # type: ignore[attr-defined]
             nprocs=ranks, join=True)
    return out


# ------------------------------------------------------------------ accelerate


def _accelerate_worker(rank: int, world: int, port: int, out_dir: str, steps: int,
                       slow: tuple[demo.SlowSpec, ...]) -> None:
    from accelerate import Accelerator

    _env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        injector = demo._Injector(rank, slow)
        model = demo.DemoModel(injector)
        optimizer = demo._SlowSGD(model.parameters(), lr=0.01)
        optimizer.injector = injector
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
        g = torch.Generator().manual_seed(0)
        n = 32 * 16 * world
        data = torch.utils.data.TensorDataset(torch.randn(n, 64, generator=g),
                                              torch.randint(0, 10, (n,), generator=g))
        loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        # The prepared (wrapped) optimizer and model, as an accelerate user has them at hand.
        stepscope.init(out_dir=out_dir, model=model, optimizer=optimizer, run_id="accelerate",
                       auto={"dataloader", "forward", "backward", "optimizer"})
        loss_fn = nn.CrossEntropyLoss()
        step = 0
        while step < steps:
            for x, y in stepscope.wrap_loader(loader):
                if step >= steps:
                    break
                with stepscope.step():
                    loss = loss_fn(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                step += 1
                injector.step = step
        stepscope.finish()
    finally:
        dist.destroy_process_group()


def launch_accelerate(out_dir: str | os.PathLike[str], ranks: int = 2, steps: int = 40,
                      slow: tuple[demo.SlowSpec, ...] = ()) -> Path:
    """accelerate over gloo (CPU) with the prepared model/optimizer/loader; the run directory."""
    return _spawn(_accelerate_worker, out_dir, ranks, steps, tuple(slow))
