"""The main job: a small DDP model trained on CPU over gloo ranks, one of them slow on purpose.

``launch()`` is also the harness the distributed tests use: it injects slowness into one
phase of one rank for a window of steps, so the analysis can be checked against a known
culprit.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stepscope
from stepscope.recording.dist import become_local_rank, spawn_local

INJECTABLE_PHASES = ("dataloader", "h2d", "forward", "backward", "optimizer")


@dataclass(frozen=True)
class SlowSpec:
    """Make ``rank`` slower by ``ms`` in ``phase`` for steps in ``[start_step, end_step)``."""

    rank: int
    phase: str
    start_step: int = 0
    end_step: int | None = None
    ms: float = 20.0

    def __post_init__(self) -> None:
        if self.phase not in INJECTABLE_PHASES:
            raise ValueError(f"phase must be one of {INJECTABLE_PHASES}; got {self.phase!r}")
        if self.ms < 0:
            raise ValueError(f"ms must be >= 0; got {self.ms}")

    def delay_s(self, rank: int, phase: str, step: int) -> float:
        if rank != self.rank or phase != self.phase or step < self.start_step:
            return 0.0
        if self.end_step is not None and step >= self.end_step:
            return 0.0
        return self.ms / 1000.0


@dataclass
class _Injector:
    """Tells each injection point how long to sleep at the current step."""

    rank: int
    slow: tuple[SlowSpec, ...]
    step: int = 0

    def delay(self, phase: str) -> float:
        """Seconds to sleep in ``phase`` at the current step."""
        return sum(s.delay_s(self.rank, phase, self.step) for s in self.slow)

    def sleep(self, phase: str) -> None:
        delay = self.delay(phase)
        if delay > 0:
            time.sleep(delay)


class SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds``: slowness in backward *compute* (before
    the gradient all-reduce; on the autograd engine's thread for a device tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.seconds > 0:
            time.sleep(ctx.seconds)
        return grad, None


class DemoModel(nn.Module):
    def __init__(self, injector: _Injector, d_in: int = 64, hidden: int = 256, classes: int = 10):
        super().__init__()
        self.injector = injector
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.injector.sleep("forward")
        out: torch.Tensor = SleepInBackward.apply(self.net(x), self.injector.delay("backward"))
        return out


class _SlowSGD(torch.optim.SGD):
    injector: _Injector

    def step(self, closure: Any = None) -> Any:
        self.injector.sleep("optimizer")
        return super().step(closure)


class _Batch:
    """A batch whose ``.to()`` can be slowed (stands in for a host-to-device copy on CPU)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, injector: _Injector) -> None:
        self.x, self.y, self.injector = x, y, injector

    def to(self, device: Any, non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        self.injector.sleep("h2d")
        return self.x.to(device, non_blocking=non_blocking), self.y.to(device, non_blocking=non_blocking)


def _batches(loader: Any, injector: _Injector) -> Any:
    for x, y in loader:
        injector.sleep("dataloader")
        yield _Batch(x, y, injector)


def _worker(
    rank: int,
    world: int,
    port: int,
    out_dir: str,
    steps: int,
    slow: tuple[SlowSpec, ...],
    sink: str,
    seed: int,
    run_id: str,
    progress: bool,
    log_every: int,
) -> None:
    become_local_rank(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(seed)
        injector = _Injector(rank, slow)
        model = DDP(DemoModel(injector))
        opt = _SlowSGD(model.parameters(), lr=0.01)
        opt.injector = injector
        g = torch.Generator().manual_seed(seed + rank)
        n = 64 * 32
        data = torch.utils.data.TensorDataset(
            torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
        )
        loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=g)
        # H2D is timed manually: on CPU there is no host-to-device copy to catch automatically.
        stepscope.init(
            out_dir=out_dir, model=model, optimizer=opt, sink=sink, run_id=run_id,
            auto={"dataloader", "forward", "backward", "optimizer"},
            log_every_n_steps=log_every,
        )
        loss_fn = nn.CrossEntropyLoss()
        step = 0
        t0 = time.monotonic()
        while step < steps:
            for batch in stepscope.wrap_loader(_batches(loader, injector)):
                if step >= steps:
                    break
                # [metrics] throughput: each sample's 64 features stand in for 64 tokens
                with stepscope.step(tokens=batch.x.numel(), samples=len(batch.x)):
                    x, y = stepscope.wrap_h2d(batch).to("cpu")
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    with stepscope.phase("metrics"):
                        value = loss.item()
                step += 1
                injector.step = step
                if progress and rank == 0 and step % 50 == 0 and not log_every:
                    print(
                        f"  step {step}/{steps}  loss {value:.3f}  {time.monotonic() - t0:.1f}s",
                        flush=True,
                    )
        stepscope.finish()
    finally:
        dist.destroy_process_group()



def launch(
    out_dir: str | os.PathLike[str],
    ranks: int = 4,
    steps: int = 200,
    slow: tuple[SlowSpec, ...] | list[SlowSpec] = (),
    sink: str = "jsonl",
    seed: int = 0,
    progress: bool = False,
    log_every_n_steps: int = 0,
) -> Path:
    """Run the demo job with one process per rank and return the run directory.

    Earlier rank files in ``out_dir`` are removed first, so the directory holds one run.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1; got {ranks}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    for s in slow:
        if not 0 <= s.rank < ranks:
            raise ValueError(f"slow rank {s.rank} is not in 0..{ranks - 1}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [
        *out.glob("rank*.jsonl"), *out.glob("rank*.sqlite"), out / "meta.json",
        *out.glob("rank*.status.json"), *out.glob("rank*.stacks.txt"),  # [ops] heartbeats
    ]:
        old.unlink(missing_ok=True)
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    spawn_local(_worker, ranks, out, steps, tuple(slow), sink, seed, run_id, progress,
                log_every_n_steps)
    return out


def run_demo(
    out_dir: str, ranks: int = 4, steps: int = 200, slow_rank: int = 1, fixed: bool = True
) -> int:
    """``stepscope demo``: train, record, print the report. Returns a process exit code.

    With ``fixed`` it then trains the same job without the slow rank into ``<out_dir>-fixed``
    and compares the two runs over the slow window (``stepscope compare``).
    """
    if ranks < 2:
        print("stepscope demo: --ranks must be at least 2 (one slow rank, one to wait)", file=sys.stderr)
        return 2
    if not 0 <= slow_rank < ranks:
        print(f"stepscope demo: --slow-rank must be in 0..{ranks - 1}", file=sys.stderr)
        return 2
    if steps < 20:
        print("stepscope demo: --steps must be at least 20", file=sys.stderr)
        return 2
    window = (int(steps * 0.4), int(steps * 0.7))
    spec = SlowSpec(rank=slow_rank, phase="dataloader", start_step=window[0], end_step=window[1], ms=15.0)
    print(
        f"stepscope demo: {ranks} gloo ranks on CPU, {steps} steps; rank {slow_rank} waits "
        f"{spec.ms:g} ms longer for data in steps {window[0]}-{window[1] - 1}"
    )
    t0 = time.monotonic()
    out = launch(out_dir, ranks=ranks, steps=steps, slow=(spec,), progress=True, log_every_n_steps=25)
    print(f"recorded {out}/ in {time.monotonic() - t0:.1f}s\n")
    rc = _print_report(out)
    if rc != 0 or not fixed:
        return rc
    return _fixed_and_compare(out, ranks, steps, window)


def _fixed_and_compare(out: Path, ranks: int, steps: int, window: tuple[int, int]) -> int:
    """The same job with the slow rank fixed, then ``stepscope compare`` over the slow window."""
    from stepscope.cli.compare_cmd import compare_command

    fixed_dir = out.with_name(out.name + "-fixed")
    print(f"\nstepscope demo: the same job with the slow rank fixed, into {fixed_dir}/")
    t0 = time.monotonic()
    launch(fixed_dir, ranks=ranks, steps=steps, slow=(), progress=True)
    print(f"recorded {fixed_dir}/ in {time.monotonic() - t0:.1f}s\n")
    span = f"{window[0]}:{window[1]}"
    print(f"$ stepscope compare {out} {fixed_dir} --steps {span}")
    return compare_command(str(out), str(fixed_dir), as_json=False, steps=span)


def _print_report(run_dir: Path) -> int:
    from stepscope.cli.report_cmd import report_command

    return report_command(str(run_dir), as_json=False, markdown=None, html=None)
