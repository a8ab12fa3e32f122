"""HF Trainer callback with the real transformers Trainer on CPU (tiny model, a few steps)."""

from __future__ import annotations

import time

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate")

from stepscope.integrations.hf import StepscopeCallback  # noqa: E402
from stepscope.recording.schema import read_run  # noqa: E402


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.net(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class SlowData(torch.utils.data.Dataset):
    """Each item takes 3 ms to load, so the dataloader wait is visible."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        time.sleep(0.003)
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.randn((), generator=g)}


def _trainer(tmp_path, cb, **args):
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=6,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        logging_steps=2, dataloader_num_workers=0, **args,
    )
    return transformers.Trainer(model=TinyModel(), args=targs, train_dataset=SlowData(), callbacks=[cb])


def test_trainer_steps_are_recorded_with_phases(tmp_path):
    out = tmp_path / "run"
    cb = StepscopeCallback(out_dir=str(out), flush_every_n_steps=2)
    _trainer(tmp_path, cb, gradient_accumulation_steps=2).train()
    recs = sorted(read_run(out), key=lambda r: r["step"])
    # One record per optimizer step, not per micro-batch.
    assert [r["step"] for r in recs] == list(range(6))
    for r in recs[1:]:
        ph = {p["name"]: p for p in r["phases"]}
        assert {"dataloader", "forward", "backward", "optimizer"} <= set(ph), ph
        assert ph["forward"]["calls"] == 2 and ph["backward"]["calls"] == 2
        # Two micro-batches of 4 items at 3 ms each are fetched before the step starts.
        assert ph["dataloader"]["ms"] >= 20.0
        assert ph["dataloader"]["start_ms"] == 0.0
        assert ph["optimizer"]["start_ms"] > ph["backward"]["start_ms"]
    assert (out / "meta.json").exists()


def test_callback_passes_init_options_and_summary(tmp_path):
    import stepscope

    out = tmp_path / "run"
    cb = StepscopeCallback(out_dir=str(out), flush_every_n_steps=1, log_every_n_steps=2)
    _trainer(tmp_path, cb).train()
    assert cb.tracer.config.log_every_n_steps == 2
    s = cb.tracer.summary()
    assert s["steps"] == 6 and s["top_phase"] == "dataloader"
    assert cb.tracer.live.lines, "the live line was printed"
    assert stepscope.current() is not cb.tracer  # finished and reset at train end


def test_callback_rejects_a_model_argument():
    with pytest.raises(TypeError, match="from the Trainer"):
        StepscopeCallback(model=torch.nn.Linear(1, 1))
