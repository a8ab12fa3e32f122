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
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import stepscope
from stepscope import demo
from stepscope.recording.dist import become_local_rank, spawn_local

# ------------------------------------------------------------------ accelerate


def _accelerate_worker(rank: int, world: int, port: int, out_dir: str, steps: int,
                       slow: tuple[demo.SlowSpec, ...]) -> None:
    from accelerate import Accelerator

    become_local_rank(rank, world, port)
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
    return spawn_local(_accelerate_worker, ranks, out_dir, steps, tuple(slow))


# ------------------------------------------------------------------ tensor parallel


class _FeedForward(nn.Module):
    """A transformer MLP block: column-parallel up projection, row-parallel down projection."""

    def __init__(self, injector: demo._Injector, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.injector = injector
        self.in_proj = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.in_proj(x))
        # Slowness between the two projections: before the forward all-reduce of the
        # row-parallel output, and (backward) before the column-parallel input's all-reduce.
        self.injector.sleep("forward")
        h = demo.SleepInBackward.apply(h, self.injector.delay("backward"))
        out: torch.Tensor = self.out_proj(h)
        return out


def _tp_worker(rank: int, world: int, port: int, out_dir: str, steps: int,
               slow: tuple[demo.SlowSpec, ...]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    become_local_rank(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        injector = demo._Injector(rank, slow)
        # An embedding-like first layer: the block's input needs a gradient, so backward
        # all-reduces it (the column-parallel input's Partial gradient).
        model = nn.Sequential(nn.Linear(64, 64), _FeedForward(injector), nn.Linear(64, 10))
        parallelize_module(model[1], mesh, {"in_proj": ColwiseParallel(),
                                            "out_proj": RowwiseParallel()})
        opt = demo._SlowSGD(model.parameters(), lr=0.01, foreach=False)
        opt.injector = injector
        stepscope.init(out_dir=out_dir, model=model, optimizer=opt, run_id="tp",
                       auto={"forward", "backward", "optimizer"})
        loss_fn = nn.CrossEntropyLoss()
        g = torch.Generator().manual_seed(0)  # every TP rank sees the same batch
        for step in range(steps):
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            injector.step = step
            with stepscope.step():
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        stepscope.finish()
    finally:
        dist.destroy_process_group()


def launch_tp(out_dir: str | os.PathLike[str], ranks: int = 2, steps: int = 40,
              slow: tuple[demo.SlowSpec, ...] = ()) -> Path:
    """Tensor parallel (Colwise/RowwiseParallel on a 1-D CPU mesh) over gloo; the run directory."""
    return spawn_local(_tp_worker, ranks, out_dir, steps, tuple(slow))


# ------------------------------------------------------------------ pipeline parallel


class _StageBlock(nn.Module):
    """One pipeline stage's layers; sleeps in forward when this stage is injected."""

    def __init__(self, injector: demo._Injector, n_micro: int, dim: int = 64) -> None:
        super().__init__()
        self.injector = injector
        self.n_micro = n_micro
        self.layers = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The step's injected delay, spread over its micro-batches.
        delay = sum(s.delay_s(self.injector.rank, "forward", self.injector.step)
                    for s in self.injector.slow) / self.n_micro
        if delay > 0:
            import time

            time.sleep(delay)
        out: torch.Tensor = self.layers(x)
        return out


class _SlowLoss(nn.MSELoss):
    """The schedule's loss (called by ``schedule.step()`` outside the stage), ``ms`` slower."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.ms > 0:
            time.sleep(self.ms / 1000.0)
        return super().forward(input, target)


def _pp_worker(rank: int, world: int, port: int, out_dir: str, steps: int,
               slow: tuple[demo.SlowSpec, ...], schedule_name: str, n_micro: int, dim: int,
               loss_ms: float) -> None:
    from torch.distributed import pipelining

    become_local_rank(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        injector = demo._Injector(rank, slow)
        block = _StageBlock(injector, n_micro, dim)
        stage = pipelining.PipelineStage(block, stage_index=rank, num_stages=world,
                                         device=torch.device("cpu"))
        schedule_cls = getattr(pipelining, schedule_name)
        schedule = schedule_cls(stage, n_microbatches=n_micro, loss_fn=_SlowLoss(loss_ms))
        opt = torch.optim.SGD(block.parameters(), lr=0.01)
        stepscope.init(out_dir=out_dir, model=block, optimizer=opt, run_id="pp",
                       auto={"forward", "backward", "optimizer"})
        g = torch.Generator().manual_seed(0)
        for step in range(steps):
            x, y = torch.randn(8 * n_micro, dim, generator=g), torch.randn(8 * n_micro, dim, generator=g)
            injector.step = step
            with stepscope.step():
                if rank == 0:
                    schedule.step(x)
                elif rank == world - 1:
                    schedule.step(target=y, losses=[])
                else:
                    schedule.step()
                opt.step()
                opt.zero_grad(set_to_none=True)
        stepscope.finish()
    finally:
        dist.destroy_process_group()


def launch_pipeline(out_dir: str | os.PathLike[str], ranks: int = 2, steps: int = 30,
                    slow: tuple[demo.SlowSpec, ...] = (), schedule: str = "ScheduleGPipe",
                    n_micro: int = 2, dim: int = 64, loss_ms: float = 0.0) -> Path:
    """``torch.distributed.pipelining``, one stage per rank, over gloo; the run directory.

    ``dim``: the stage's width. At 64 a stage computes ~0.15 ms per micro-batch, and the
    schedule's own work around it (chunking, the loss, scaling gradients, its bookkeeping) is
    a quarter of the step: real host overhead, which ``host_overhead`` rightly reports.
    ``loss_ms``: the schedule's loss function sleeps this long per micro-batch.
    """
    return spawn_local(_pp_worker, ranks, out_dir, steps, tuple(slow), schedule, n_micro, dim,
                       loss_ms)


# ------------------------------------------------------------------ expert parallel


class _MoE(nn.Module):
    """One expert per rank; tokens routed with ``all_to_all_single`` and uneven splits.

    ``skew`` is the share of every rank's tokens its router sends to expert (rank) ``hot``;
    the rest is spread evenly. ``per_token_ms`` makes expert compute cost grow with the tokens
    an expert receives (as it does on a device), so the busy expert's rank arrives last at
    the all-to-all that returns the tokens.
    """

    def __init__(self, world: int, hot: int, skew: float, per_token_ms: float,
                 dim: int = 32) -> None:
        super().__init__()
        self.world, self.hot, self.skew, self.per_token_ms = world, hot, skew, per_token_ms
        self.gate = nn.Linear(dim, world)
        self.expert = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, dim))

    def _splits(self, n: int) -> list[int]:
        if self.skew <= 0:
            base = [n // self.world] * self.world
        else:
            hot = round(self.skew * n)
            rest = (n - hot) // (self.world - 1)
            base = [hot if e == self.hot else rest for e in range(self.world)]
        base[-1] += n - sum(base)
        return base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        from torch.distributed import _functional_collectives as funcol

        scores = self.gate(x)
        order = scores.argmax(dim=-1).argsort()  # a deterministic stand-in for routing
        send_splits = self._splits(x.shape[0])
        counts = torch.tensor(send_splits)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)  # how many tokens each expert gets
        recv_splits = recv_counts.tolist()
        routed = x[order]
        # torchtitan's MoE dispatch/combine: autograd-aware functional all-to-all.
        tokens = funcol.all_to_all_single_autograd(routed, recv_splits, send_splits, dist.group.WORLD)
        time.sleep(self.per_token_ms * tokens.shape[0] / 1000.0)
        out = self.expert(tokens)
        back = funcol.all_to_all_single_autograd(out, send_splits, recv_splits, dist.group.WORLD)
        combined = torch.empty_like(back)
        combined[order] = back
        result: torch.Tensor = x + combined * scores.softmax(-1).max(-1, keepdim=True).values
        return result


def _moe_worker(rank: int, world: int, port: int, out_dir: str, steps: int, hot: int,
                skew: float, per_token_ms: float) -> None:
    become_local_rank(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(32, 32), _MoE(world, hot, skew, per_token_ms),
                              nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        stepscope.init(out_dir=out_dir, model=model, optimizer=opt, run_id="moe",
                       auto={"forward", "backward", "optimizer"})
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x, y = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
            with stepscope.step():
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        stepscope.finish()
    finally:
        dist.destroy_process_group()


def launch_moe(out_dir: str | os.PathLike[str], ranks: int = 2, steps: int = 30, hot: int = 1,
               skew: float = 0.0, per_token_ms: float = 0.5) -> Path:
    """A mixture-of-experts layer over gloo, one expert per rank; the run directory.

    ``skew=0`` routes evenly; ``skew=0.8`` sends 80% of every rank's tokens to rank ``hot``.
    """
    return spawn_local(_moe_worker, ranks, out_dir, steps, hot, skew, per_token_ms)
