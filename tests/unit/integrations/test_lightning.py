"""Lightning Callback and Profiler with the real Lightning Trainer on CPU (tiny model)."""

from __future__ import annotations

import time

import pytest
import torch

L = pytest.importorskip("lightning", reason="lightning is not installed")

from stepscope.integrations.lightning import StepscopeCallback, StepscopeProfiler  # noqa: E402
from stepscope.recording.schema import read_run  # noqa: E402

# Lightning's pytree helper trips a torch deprecation on every fit; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")



class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SlowData(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        time.sleep(0.002)  # 4 items a batch: ~8 ms of visible dataloader wait
        return torch.randn(8), torch.randn(())


def _fit(tmp_path, **kw) -> None:
    trainer = L.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=str(tmp_path), **kw)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(SlowData(), batch_size=4))


def _check(recs, names) -> None:
    recs = sorted(recs, key=lambda r: r["step"])
    assert [r["step"] for r in recs] == list(range(6))
    for r in recs[1:]:
        ph = {p["name"]: p for p in r["phases"]}
        assert names <= set(ph), ph
        assert all(ph[n]["parent"] is None for n in names)  # closure phases are not nested
        assert ph["dataloader"]["ms"] >= 6.0
        order = sorted(names, key=lambda n: ph[n]["start_ms"])
        assert order.index("forward") < order.index("backward") < order.index("optimizer")


def test_profiler_records_steps_from_lightning_actions(tmp_path):
    out = tmp_path / "run"
    prof = StepscopeProfiler(out_dir=str(out), flush_every_n_steps=2)
    _fit(tmp_path, profiler=prof)
    _check(read_run(out), {"dataloader", "h2d", "forward", "backward", "optimizer"})
    text = prof.summary()
    assert "stepscope: 6 recent steps" in text and "dataloader" in text


def test_callback_records_steps_from_lightning_hooks(tmp_path):
    out = tmp_path / "run"
    cb = StepscopeCallback(out_dir=str(out), flush_every_n_steps=2)
    _fit(tmp_path, callbacks=[cb])
    _check(read_run(out), {"dataloader", "forward", "backward", "optimizer"})
    assert cb.tracer.summary()["steps"] == 6


def test_callback_stands_aside_for_the_profiler(tmp_path):
    out = tmp_path / "run"
    cb = StepscopeCallback(out_dir=str(tmp_path / "cb"))
    _fit(tmp_path, callbacks=[cb], profiler=StepscopeProfiler(out_dir=str(out)))
    assert cb.tracer is None
    assert len(read_run(out)) == 6


class Called(Tiny):
    """A module whose training_step calls the module itself (so model hooks fire)."""

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)


def test_callback_leaves_auto_phases_to_the_hooks(tmp_path):
    """auto={"backward"}: the gradient hooks time backward; the callback must not add its own."""
    out = tmp_path / "run"
    trainer = L.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=str(tmp_path),
                        callbacks=[StepscopeCallback(out_dir=str(out), auto={"backward"})])
    trainer.fit(Called(), torch.utils.data.DataLoader(SlowData(), batch_size=4))
    recs = sorted(read_run(out), key=lambda r: r["step"])
    assert len(recs) == 6
    for r in recs:
        bwd = [p for p in r["phases"] if p["name"] == "backward"]
        assert len(bwd) == 1 and bwd[0]["calls"] == 1, bwd
