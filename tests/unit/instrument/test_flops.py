"""FLOP counting against a hand count, the peak table, MFU, and the unknown-device warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import stepscope
from stepscope.common.errors import ConfigError, StepscopeWarning
from stepscope.instrument.flops import PEAK_TFLOPS, SOURCES, FlopCount, device_key, peak_tflops
from stepscope.instrument.resource_sampler import ResourceMonitor

B, D_IN, H, D_OUT = 16, 32, 64, 8


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, D_OUT))


def _hand_count(batch: int = B) -> int:
    """2·in·out·batch per linear forward; backward twice that (grad input + grad weight)."""
    fwd = 2 * D_IN * H * batch + 2 * H * D_OUT * batch
    return fwd + 2 * fwd


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(B, D_IN, requires_grad=True)  # so the first layer's grad-input is computed too
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def test_flop_count_matches_hand_count_for_an_mlp():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fc = FlopCount()
    fc.start()
    _train_step(model, opt)
    fc.stop()
    assert fc.total == _hand_count()
    assert fc.dtype in ("fp32", "tf32")


def test_auto_counts_one_step_marks_it_untimed_and_gives_mfu(mem_tracer):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tr = mem_tracer(model=model, optimizer=opt, model_flops="auto", peak_tflops=2.0)
    for _ in range(4):
        with tr.step(samples=B):
            _train_step(model, opt)
    tr.finish()
    recs = tr.sink.records
    first, rest = recs[0], recs[1:]
    assert first["untimed"] is True and first["flops"]["counted_step"] is True
    assert first["flops"]["per_step"] == _hand_count()
    assert "tflops" not in first["flops"] and "samples_per_s" not in first["throughput"]
    for r in rest:
        assert "untimed" not in r
        f = r["flops"]
        assert f["per_step"] == _hand_count()
        want = _hand_count() / (r["step_ms"] / 1e3) / 1e12
        assert f["tflops"] == pytest.approx(want, rel=1e-3)
        assert f["mfu"] == pytest.approx(f["tflops"] / 2.0, rel=1e-3)


def test_flops_per_step_given_cpu_without_peak_warns_once_and_has_no_mfu(mem_tracer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = mem_tracer(flops_per_step=1e9)
        for _ in range(3):
            with tr.step():
                pass
        tr.finish()
    ours = [w for w in caught if issubclass(w.category, StepscopeWarning)]
    assert len(ours) == 1 and "peak" in str(ours[0].message)
    for r in tr.sink.records:
        assert "untimed" not in r  # nothing to count: the user gave the FLOPs
        assert r["flops"]["per_step"] == 10**9 and r["flops"]["tflops"] > 0
        assert "mfu" not in r["flops"]


def test_known_device_peak_from_table_by_counted_dtype():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        mon = ResourceMonitor(device="cpu", flops_per_step=1e12, device_name="NVIDIA H100 80GB HBM3",
                              host=False)
        mon.on_step_start(0)
        _train_step(model, opt)
        snap = mon.on_step_end(0)
        assert mon.step_fields(0, 0, 10.0, {}, snap)["untimed"] is True
        fields = mon.step_fields(1, 0, 10.0, {}, mon.on_step_end(1))
    finally:
        torch.set_float32_matmul_precision(prec)
    # 1e12 FLOPs in 10 ms = 100 TFLOP/s; fp32 (TF32 off) peak of an H100 SXM is 67.
    assert fields["flops"]["tflops"] == pytest.approx(100.0)
    assert fields["flops"]["mfu"] == pytest.approx(100.0 / 67.0, rel=1e-4)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("AMD Instinct MI300X", "mi300x"),
        ("NVIDIA L40", None),
        ("Tesla T4", None),
        ("NVIDIA H100 NVL", None),
        ("cpu", None),
    ],
)
def test_device_names_map_to_table_rows(name, key):
    assert device_key(name) == key


def test_table_is_complete_documented_and_dense():
    assert set(SOURCES) == set(PEAK_TFLOPS)
    for key, row in PEAK_TFLOPS.items():
        assert set(row) == {"fp32", "tf32", "bf16", "fp16"}, key
        assert row["bf16"] >= row["tf32"] >= row["fp32"] * 0.99 > 0, key
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp64") is None
    assert peak_tflops("Tesla T4", "bf16") is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"flops_per_step": -1},
        {"flops_per_step": "many"},
        {"flops_per_step": True},
        {"model_flops": "yes"},
        {"peak_tflops": 0},
        {"peak_tflops": float("inf")},
        {"flops_per_step": 1e9, "model_flops": "auto"},
    ],
)
def test_bad_flop_arguments_raise_value_error(kwargs, tmp_path):
    with pytest.raises(ConfigError) as info:
        stepscope.init(out_dir=str(tmp_path), **kwargs)
    assert isinstance(info.value, ValueError)
