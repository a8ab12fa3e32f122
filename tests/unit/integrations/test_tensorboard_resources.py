"""Throughput in the views: live line / summary(), TensorBoard and W&B scalars, HF and Lightning counts."""

from __future__ import annotations

import time

import pytest
import torch

import stepscope
from stepscope.instrument.resource_sampler import batch_counts, record_scalars
from stepscope.recording.schema import read_run


def test_batch_counts_without_touching_the_gpu():
    ids = torch.ones(4, 16, dtype=torch.long)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 10:] = 0
    assert batch_counts({"input_ids": ids, "attention_mask": mask}) == (40, 4)
    assert batch_counts({"input_ids": ids}) == (64, 4)
    assert batch_counts((torch.randn(8, 3), torch.randn(8))) == (None, 8)
    assert batch_counts(torch.randn(5, 2)) == (None, 5)
    assert batch_counts({"label": "x"}) == (None, None)


def test_live_line_and_summary_show_tokens_mfu_memory(tmp_path):
    tr = stepscope.init(out_dir=str(tmp_path), auto=False, log_every_n_steps=5, flush_every_n_steps=5,
                        flops_per_step=2e9, peak_tflops=1.0)
    for _ in range(10):
        with stepscope.step(tokens=1000, samples=2):
            time.sleep(0.005)
    s = stepscope.summary()
    lines = list(tr.live.lines)
    stepscope.finish()
    assert s["tokens_per_s"] == pytest.approx(1000 / (s["step_ms_median"] / 1e3), rel=0.2)
    assert s["mfu"] == pytest.approx(s["tflops"] / 1.0) and s["rss_mb"] > 0
    assert lines and "tok/s" in lines[-1] and "MFU" in lines[-1] and "RSS" in lines[-1]


def test_record_scalars_are_flat_and_skip_unmeasured():
    rec = {"throughput": {"tokens": 5, "tokens_per_s": 10.0}, "flops": {"per_step": 1, "mfu": 0.4},
           "memory": {"rss_mb": 100.0}, "device": "cuda:0"}
    assert record_scalars(rec) == {"throughput/tokens_per_s": 10.0, "flops/mfu": 0.4, "memory/rss_mb": 100.0}


def test_tensorboard_logs_throughput_and_memory(mem_tracer, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stepscope.integrations.tensorboard import attach_tensorboard

    tracer = mem_tracer(out_dir=str(tmp_path), flush_every_n_steps=2, flops_per_step=1e6, peak_tflops=1.0)
    sink = attach_tensorboard(tracer)
    for _ in range(4):
        with tracer.step(tokens=64):
            time.sleep(0.002)
    tracer.finish()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "rank0"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"stepscope/throughput/tokens_per_s", "stepscope/flops/mfu", "stepscope/memory/rss_mb"} <= tags
    assert all(e.value > 0 for e in acc.Scalars("stepscope/throughput/tokens_per_s"))
    sink.close()


def test_wandb_logs_throughput_and_memory(mem_tracer):
    pytest.importorskip("wandb", reason="wandb is not installed")
    from stepscope.integrations.wandb import WandbSink

    class FakeRun:
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def define_metric(self, *a, **k) -> None:
            pass

        def log(self, data, commit=False) -> None:
            self.rows.append(data)

    run = FakeRun()
    tracer = mem_tracer(flush_every_n_steps=1)
    tracer.add_listener(WandbSink(run))
    for _ in range(3):
        with tracer.step(samples=8):
            time.sleep(0.002)
    tracer.finish()
    assert len(run.rows) == 3
    assert all(r["stepscope/throughput/samples_per_s"] > 0 and r["stepscope/memory/rss_mb"] > 0
               for r in run.rows)


def test_hf_trainer_fills_samples_and_tokens(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    from stepscope.integrations.hf import StepscopeCallback

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(32, 8)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, input_ids, attention_mask=None, labels=None):
            out = self.head(self.emb(input_ids)).mean(dim=(1, 2))
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            mask = torch.ones(12, dtype=torch.long)
            mask[9:] = 0  # 9 real tokens of 12
            return {"input_ids": torch.full((12,), i % 32), "attention_mask": mask,
                    "labels": torch.tensor(float(i))}

    out = tmp_path / "run"
    cb = StepscopeCallback(out_dir=str(out), flush_every_n_steps=2)
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=4, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        gradient_accumulation_steps=2,
    )
    transformers.Trainer(model=TinyLM(), args=targs, train_dataset=Data(), callbacks=[cb]).train()
    recs = sorted(read_run(out), key=lambda r: r["step"])
    assert len(recs) == 4
    for r in recs:
        # two micro-batches of 4 samples × 9 unmasked tokens per optimizer step
        assert r["throughput"]["samples"] == 8 and r["throughput"]["tokens"] == 72
        assert r["throughput"]["tokens_per_s"] > 0


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning:lightning.*")
def test_lightning_callback_fills_samples(tmp_path):
    L = pytest.importorskip("lightning", reason="lightning is not installed")
    from stepscope.integrations.lightning import StepscopeCallback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    ds = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40))
    out = tmp_path / "run"
    trainer = L.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=str(tmp_path),
                        callbacks=[StepscopeCallback(out_dir=str(out), flush_every_n_steps=2)])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(ds, batch_size=5))
    recs = read_run(out)
    assert len(recs) == 4 and all(r["throughput"]["samples"] == 5 for r in recs)
    assert all("tokens" not in r["throughput"] for r in recs)
