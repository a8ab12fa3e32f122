"""FLOPs per step and the accelerator's peak: what MFU (model FLOPs utilisation) is made of.

``MFU = achieved TFLOP/s / peak TFLOP/s``, where achieved = FLOPs of one step / step time.
The FLOPs of a step come from ``init(flops_per_step=...)`` or, with ``model_flops="auto"``,
from :class:`FlopCount`: ``torch.utils.flop_counter.FlopCounterMode`` active during one
sampled step (forward and backward). That step runs slower under the counter, so its record
says ``"untimed": true`` and the analysis leaves it out of timing statistics.

The peak comes from :data:`PEAK_TFLOPS` (dense, no 2:4 sparsity; vendor datasheets, listed
per device in :data:`SOURCES`) by device name and the dtype that carried most of the counted
FLOPs, or from ``init(peak_tflops=...)``. An unknown device gives no MFU and one warning; the
tool never guesses a peak.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from stepscope.common.errors import warn

#: Dense peak TFLOP/s by device key and math dtype. "fp32" is the non-tensor-core rate;
#: "tf32" is what float32 matmuls reach when TF32 is allowed
#: (``torch.backends.cuda.matmul.allow_tf32`` / ``set_float32_matmul_precision("high")``).
#: Datasheets quote tensor rates "with sparsity"; the dense figure is half of that.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h100-sxm": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "h100-pcie": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "h200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "a100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "l4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "l40s": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
    "a10g": {"fp32": 35.0, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0},
    "rtx4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
    "mi300x": {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4},
}

#: Where each row of :data:`PEAK_TFLOPS` comes from.
SOURCES: dict[str, str] = {
    "h100-sxm": "NVIDIA H100 Tensor Core GPU datasheet, SXM column (sparsity figures halved)",
    "h100-pcie": "NVIDIA H100 Tensor Core GPU datasheet, PCIe column (sparsity figures halved)",
    "h200": "NVIDIA H200 Tensor Core GPU datasheet, SXM column (same compute as H100 SXM)",
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe share these peaks)",
    "l4": "NVIDIA L4 Tensor Core GPU datasheet (sparsity figures halved)",
    "l40s": "NVIDIA L40S GPU datasheet (sparsity figures halved)",
    "a10g": "derived (AWS publishes no datasheet): 80 SMs x 1.71 GHz boost; GA102 tensor cores "
    "at the GeForce rate for FP32 accumulation (512 FLOP/SM/clock for bf16/fp16)",
    "rtx4090": "NVIDIA Ada Lovelace architecture whitepaper, Appendix A (FP32 accumulate rates)",
    "mi300x": "AMD Instinct MI300X data sheet (dense matrix rates; fp32 = vector rate)",
}

DTYPES = ("fp32", "tf32", "bf16", "fp16")


def device_key(name: str) -> str | None:
    """The :data:`PEAK_TFLOPS` key for a ``torch.cuda.get_device_name()`` string, or ``None``."""
    n = name.lower().replace(" ", "").replace("-", "").replace("_", "")
    if "nvl" in n:  # H100 NVL / H200 NVL have their own (lower, per-card) peaks: not listed
        return None
    if "h200" in n:
        return "h200"
    if "h100" in n:
        return "h100-pcie" if "pcie" in n else "h100-sxm"
    if "a100" in n:
        return "a100"
    if "l40s" in n:
        return "l40s"
    if "a10g" in n:
        return "a10g"
    if re.search(r"(^|[^a-z0-9])l4($|[^a-z0-9])", name.lower()):
        return "l4"
    if "4090" in n:
        return "rtx4090"
    if "mi300x" in n:
        return "mi300x"
    return None


def peak_tflops(name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of device ``name`` for math dtype ``dtype``; ``None`` when unknown."""
    key = device_key(name)
    if key is None:
        return None
    return PEAK_TFLOPS[key].get(dtype)


def math_dtype(dtype: Any) -> str | None:
    """The table's dtype name for a torch dtype (fp32 becomes tf32 when TF32 matmuls are on)."""
    import torch

    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float32:
        tf32 = bool(getattr(torch.backends.cuda.matmul, "allow_tf32", False)) or (
            torch.get_float32_matmul_precision() != "highest"
        )
        return "tf32" if tf32 else "fp32"
    return None


def _first_dtype(args: Any) -> Any:
    import torch

    for a in args:
        if isinstance(a, torch.Tensor):
            return a.dtype
        if isinstance(a, list | tuple):
            d = _first_dtype(a)
            if d is not None:
                return d
    return None


def _counter_class() -> Any:
    from torch.utils.flop_counter import FlopCounterMode

    class _Counter(FlopCounterMode):
        """Also notes which input dtype carried the FLOPs (the peak depends on it)."""

        def __init__(self) -> None:
            super().__init__(display=False)
            self.by_dtype: Counter[Any] = Counter()

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            glob = self.flop_counts["Global"]
            before = glob.get(func_packet, 0)
            res = super()._count_flops(func_packet, out, args, kwargs)
            delta = glob.get(func_packet, 0) - before
            if delta:
                self.by_dtype[_first_dtype(args)] += delta
            return res

    return _Counter


class FlopCount:
    """``FlopCounterMode`` around one step: ``start()`` at step entry, ``stop()`` at its exit.

    Both run on the training thread. The counter is a dispatch mode, so it sees every op of
    the step (forward and the backward the autograd engine runs), not only one module's.

    Example::

        fc = FlopCount(); fc.start(); loss = model(x).sum(); loss.backward(); fc.stop()
        fc.total, fc.dtype        # FLOPs of the step, "fp32"/"tf32"/"bf16"/"fp16" or None
    """

    def __init__(self) -> None:
        self.total: int | None = None
        self.dtype: str | None = None
        self._mode: Any = None

    def start(self) -> None:
        self._mode = _counter_class()()
        self._mode.__enter__()

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.__exit__(None, None, None)
        self.total = int(mode.get_total_flops())
        if mode.by_dtype:
            top = max(mode.by_dtype, key=lambda d: mode.by_dtype[d])
            self.dtype = math_dtype(top) if top is not None else None

    @property
    def active(self) -> bool:
        return self._mode is not None


def warn_unknown_peak(device_name: str, dtype: str | None) -> None:
    """The one warning for a device (or dtype) without a peak: MFU stays absent."""
    what = f"{device_name!r}" + (f" with {dtype}" if dtype else "")
    warn(f"no peak TFLOP/s known for {what}; MFU is not recorded. Pass init(peak_tflops=...) "
         "to set it (dense peak of one device, TFLOP/s)", stacklevel=3)
