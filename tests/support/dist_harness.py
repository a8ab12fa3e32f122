"""Real gloo DDP runs for the wait-attribution tests: accumulation and static_graph variants.

Reuses the demo job's model, slow-injection points and loader (:mod:`stepscope.demo`), with
``micro`` micro-batches per step (``no_sync`` on all but the last) and DDP options. One
process per rank, one intra-op thread each.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stepscope
from stepscope import demo
from stepscope.recording.dist import become_local_rank, spawn_local


@contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """This process as rank ``rank`` of a local gloo group, torn down on the way out."""
    become_local_rank(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def loader(rank: int, n: int, batch: int) -> torch.utils.data.DataLoader[Any]:
    """The harness's data: ``n`` random 64-feature samples of 10 classes, seeded by rank."""
    g = torch.Generator().manual_seed(rank)
    data = torch.utils.data.TensorDataset(torch.randn(n, 64, generator=g),
                                          torch.randint(0, 10, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, generator=g)


def train(out_dir: str, run_id: str, model: nn.Module, injector: demo._Injector,
          data: torch.utils.data.DataLoader[Any], steps: int, micro: int = 1,
          before_step: Callable[[int], None] | None = None) -> None:
    """The harness's training loop, recorded with every automatic phase.

    ``micro`` micro-batches per step, ``no_sync`` on all but the last (DDP); ``before_step(i)``
    runs before step ``i`` opens, outside it. The demo's slow-injection points fire as set.
    """
    opt = demo._SlowSGD(model.parameters(), lr=0.01)
    opt.injector = injector
    stepscope.init(out_dir=out_dir, model=model, optimizer=opt, run_id=run_id,
                   auto={"dataloader", "forward", "backward", "optimizer"})
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    while step < steps:
        for batch in stepscope.wrap_loader(demo._batches(data, injector)):
            if step >= steps:
                break
            if before_step is not None:
                before_step(step)
            with stepscope.step():
                x, y = batch.to("cpu")
                for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
                    # DDP's no_sync: the all-reduce waits for the last micro-batch.
                    with model.no_sync() if m < micro - 1 else nullcontext():  # type: ignore[operator]
                        loss_fn(model(xm), ym).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            step += 1
            injector.step = step
    stepscope.finish()


def _worker(rank: int, world: int, port: int, out_dir: str, steps: int,
            slow: tuple[demo.SlowSpec, ...], micro: int, ddp_kw: dict[str, Any]) -> None:
    with gloo_group(rank, world, port):
        torch.manual_seed(0)
        injector = demo._Injector(rank, slow)
        model = DDP(demo.DemoModel(injector), **ddp_kw)
        train(out_dir, "harness", model, injector, loader(rank, 32 * 16 * micro, 16 * micro),
              steps, micro)


def launch(out_dir: str | os.PathLike[str], ranks: int = 2, steps: int = 60,
           slow: tuple[demo.SlowSpec, ...] = (), micro: int = 1, **ddp_kw: Any) -> Path:
    """Run the job with one process per rank; returns the run directory."""
    return spawn_local(_worker, ranks, out_dir, steps, tuple(slow), micro, ddp_kw)


class _Sleep(nn.Module):
    """Sleeps in forward (and, through demo's SleepInBackward, in backward) when injected."""

    def __init__(self, injector: Any) -> None:
        super().__init__()
        self.injector = injector

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.injector.sleep("forward")
        out: torch.Tensor = demo.SleepInBackward.apply(x, self.injector.delay("backward"))
        return out


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str, steps: int,
                 slow: tuple[demo.SlowSpec, ...], layers: int) -> None:
    from torch.distributed.fsdp import fully_shard

    with gloo_group(rank, world, port):
        torch.manual_seed(0)
        injector = demo._Injector(rank, slow)
        mods: list[nn.Module] = [nn.Linear(64, 128), nn.ReLU()]
        for i in range(layers):
            if i == layers // 2:
                # Mid-model: the fast ranks wait in the next layer's all-gather (forward) and
                # in a backward all-gather / reduce-scatter (backward).
                mods.append(_Sleep(injector))
            mods += [nn.Linear(128, 128), nn.ReLU()]
        mods.append(nn.Linear(128, 10))
        model = nn.Sequential(*mods)
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(model)
        train(out_dir, "fsdp", model, injector, loader(rank, 32 * 16, 32), steps)


def launch_fsdp(out_dir: str | os.PathLike[str], ranks: int = 2, steps: int = 60,
                slow: tuple[demo.SlowSpec, ...] = (), layers: int = 4) -> Path:
    """FSDP2 (``fully_shard`` per Linear and the root) over gloo; returns the run directory."""
    return spawn_local(_fsdp_worker, ranks, out_dir, steps, tuple(slow), layers)


def _hf_worker(rank: int, world: int, port: int, out_dir: str, steps: int, slow_rank: int,
               phase: str, ms: float) -> None:
    import time

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from stepscope.integrations.hf import StepscopeCallback

    become_local_rank(rank, world, port)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                       n_positions=32, bos_token_id=0, eos_token_id=0))
    delay = ms / 1000.0 if rank == slow_rank else 0.0

    class SlowOptimizer(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
            if phase == "optimizer" and delay:
                time.sleep(delay)

    if phase == "forward" and delay:
        model.transformer.h[1].register_forward_pre_hook(lambda *_: time.sleep(delay))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 128, (steps * 8 * world + 64, 32), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "hf"), per_device_train_batch_size=8, max_steps=steps,
        use_cpu=True, ddp_backend="gloo", report_to=[], logging_steps=10_000, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-4)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[StepscopeCallback(out_dir=out_dir, run_id="hf"), SlowOptimizer()])
    trainer.train()
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_hf(out_dir: str | os.PathLike[str], ranks: int = 2, steps: int = 60, slow_rank: int = -1,
              phase: str = "", ms: float = 0.0) -> Path:
    """The HF Trainer under DDP (gloo, CPU) on a tiny GPT-2 built from a config."""
    return spawn_local(_hf_worker, ranks, out_dir, steps, slow_rank, phase, ms)

