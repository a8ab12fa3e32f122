"""Lightning DDP runs for the wait-attribution tests (``DDPStrategy`` over gloo on CPU)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from stepscope.integrations.lightning import StepscopeCallback


class SlowModule(L.LightningModule):  # type: ignore[misc]
    """A small classifier; ``slow_rank`` sleeps ``ms`` in ``phase`` (forward or optimizer)."""

    def __init__(self, slow_rank: int = -1, phase: str = "", ms: float = 0.0) -> None:
        super().__init__()
        self.slow_rank, self.phase, self.ms = slow_rank, phase, ms
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def _sleep(self, where: str) -> None:
        if where == self.phase and self.global_rank == self.slow_rank:
            time.sleep(self.ms / 1000.0)

    def on_fit_start(self) -> None:
        torch.set_num_threads(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._sleep("forward")
        x, y = batch
        # self(x), not self.net(x): stepscope's model hooks (auto={"backward"}) fire on it.
        loss: torch.Tensor = nn.functional.cross_entropy(self(x), y)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._sleep("optimizer")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def launch_lightning(out_dir: str | os.PathLike[str], ranks: int = 2, steps: int = 60,
                     slow_rank: int = -1, phase: str = "", ms: float = 0.0,
                     start_method: str = "spawn", **init_kwargs: Any) -> Path:
    """Lightning DDP with ``StepscopeCallback``; returns the run directory.

    ``start_method`` is Lightning's ``DDPStrategy(start_method=...)``: ``"spawn"`` (what
    ``strategy="ddp_spawn"`` means: a fresh interpreter per rank) or ``"forkserver"`` (ranks
    forked from multiprocessing's fork server, which may have imported torch and Lightning).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    n = steps * 16 * ranks
    data = torch.utils.data.TensorDataset(torch.randn(n, 64, generator=g),
                                          torch.randint(0, 10, (n,), generator=g))
    strategy = DDPStrategy(start_method=start_method)  # type: ignore[arg-type]
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=ranks, strategy=strategy,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(out),
                        callbacks=[StepscopeCallback(out_dir=str(out), run_id="pl", **init_kwargs)])
    trainer.fit(SlowModule(slow_rank, phase, ms), torch.utils.data.DataLoader(data, batch_size=16))
    return out
