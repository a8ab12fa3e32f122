"""One run id per run under Lightning: ranks agree on rank 0's id (no 'Partial report')."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepscope.analysis.run import analyze_run

pytestmark = pytest.mark.slow


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_ddp_ranks_share_one_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    L = pytest.importorskip("lightning")
    pl = pytest.importorskip("dist_lightning")
    import torch

    from stepscope.integrations.lightning import StepscopeCallback

    monkeypatch.delenv("STEPSCOPE_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    out = tmp_path / "run"
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(30 * 16 * 2, 64, generator=g),
                                          torch.randint(0, 10, (30 * 16 * 2,), generator=g))
    trainer = L.Trainer(max_steps=30, accelerator="cpu", devices=2, strategy="ddp_spawn",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(out),
                        callbacks=[StepscopeCallback(out_dir=str(out))])  # no run_id given
    trainer.fit(pl.SlowModule(), torch.utils.data.DataLoader(data, batch_size=16))
    doc = analyze_run(out)
    assert doc["run"]["ranks"] == 2
    assert not any("run_id" in s for s in doc["run"]["skipped"]), doc["run"]["skipped"]
    assert doc["run"]["run_id"] and not doc["run"]["partial"], doc["run"]
