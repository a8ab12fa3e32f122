"""TensorBoard and W&B sinks with the real packages (W&B offline), plus the missing-package message."""

from __future__ import annotations

import importlib
import sys
import time

import pytest
import torch

from stepscope.integrations import require


def _steps(tracer, n: int) -> None:
    model = torch.nn.Linear(4, 4)
    for _ in range(n):
        with tracer.step():
            with tracer.phase("dataloader"):
                time.sleep(0.001)
            model(torch.randn(2, 4)).sum().backward()


def test_tensorboard_scalars_per_phase_per_rank(mem_tracer, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stepscope.integrations.tensorboard import attach_tensorboard

    tracer = mem_tracer(out_dir=str(tmp_path), flush_every_n_steps=2)
    sink = attach_tensorboard(tracer)
    assert sink is not None
    _steps(tracer, 6)
    tracer.finish()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "rank0"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"stepscope/step_ms", "stepscope/phase/dataloader_ms", "stepscope/phase/residual_ms"} <= tags
    assert [e.step for e in acc.Scalars("stepscope/step_ms")] == list(range(6))
    assert min(e.value for e in acc.Scalars("stepscope/phase/dataloader_ms")) >= 1.0
    sink.close()


def test_tensorboard_on_a_disabled_tracer_is_none():
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from stepscope.integrations.tensorboard import attach_tensorboard
    from stepscope.lifecycle import NULL_TRACER

    assert attach_tensorboard(NULL_TRACER) is None


@pytest.fixture
def wandb_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="stepscope-test", dir=str(tmp_path), mode="offline")
    logged: list[tuple[dict, bool]] = []
    real_log = run.log

    def spy(data, *args, commit=None, **kw):
        logged.append((dict(data), commit))
        return real_log(data, *args, commit=commit, **kw)

    monkeypatch.setattr(run, "log", spy)
    yield run, logged
    run.finish()


def test_wandb_logs_monotonic_steps_on_its_own_axis(mem_tracer, tmp_path, wandb_run):
    from stepscope.integrations.wandb import attach_wandb

    run, logged = wandb_run
    tracer = mem_tracer(out_dir=str(tmp_path), flush_every_n_steps=100)
    sink = attach_wandb(tracer, run, commit=True)
    assert sink is not None
    _steps(tracer, 4)
    tracer.flush()  # what the tracer does at the next flush cadence
    with tracer.step(index=1):  # the loop restarts its step count: not logged again
        pass
    _steps(tracer, 4)  # steps 2..5: only 4 and 5 move the axis forward
    tracer.finish()
    assert [d["stepscope/step"] for d, _ in logged] == [0, 1, 2, 3, 4, 5]
    assert all(commit is True for _, commit in logged)
    assert {"stepscope/step_ms", "stepscope/phase/dataloader_ms"} <= set(logged[0][0])
    assert run.summary["stepscope/step"] == 5
    assert run.summary["_step"] == 5  # one W&B row per record with commit=True


def test_wandb_default_does_not_advance_the_users_step(mem_tracer, tmp_path, wandb_run):
    from stepscope.integrations.wandb import attach_wandb

    run, logged = wandb_run
    tracer = mem_tracer(out_dir=str(tmp_path), flush_every_n_steps=1)
    attach_wandb(tracer, run)
    for i in range(3):
        _steps(tracer, 1)
        run.log({"loss": 1.0 / (i + 1)}, step=10 * i)  # the user's own, explicit steps
    tracer.finish()
    run.log({"loss": 0.25}, step=30)
    ours = [(d, commit) for d, commit in logged if "stepscope/step" in d]
    assert [d["stepscope/step"] for d, _ in ours] == [0, 1, 2]
    assert all(commit is False for _, commit in ours)
    # The user's explicit steps were all accepted (step 30's row is still open), and
    # stepscope's numbers joined their rows.
    assert run.summary["_step"] == 20
    assert run.summary["loss"] == pytest.approx(1 / 3)
    assert run.summary["stepscope/step"] == 2


def test_wandb_only_on_rank_zero(mem_tracer, tmp_path, wandb_run):
    from stepscope.integrations.wandb import attach_wandb
    from stepscope.recording.dist import RankInfo

    run, _ = wandb_run
    tracer = mem_tracer(out_dir=str(tmp_path))
    tracer.rank = RankInfo(rank=1, local_rank=1, world_size=2, hostname="h")
    assert attach_wandb(tracer, run) is None


@pytest.mark.parametrize(("module", "extra"), [("stepscope.integrations.wandb", "wandb"),
                                               ("stepscope.integrations.tensorboard", "tensorboard"),
                                               ("stepscope.integrations.hf", "hf"),
                                               ("stepscope.integrations.lightning", "lightning")])
def test_missing_package_names_the_extra(monkeypatch, module, extra):
    package = {"wandb": "wandb", "tensorboard": "tensorboard", "hf": "transformers",
               "lightning": "lightning.pytorch"}[extra]
    # A None entry makes `import package` raise ImportError, as if it were not installed.
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'stepscope\[{extra}\]'"):
        importlib.import_module(module)
    monkeypatch.delitem(sys.modules, module, raising=False)


def test_require_returns_the_module():
    assert require("json", "x", "test").__name__ == "json"
