"""Unwrap: the real optimizer and module inside what frameworks wrap around them.

Frameworks hand users wrappers: accelerate's ``AcceleratedOptimizer`` (an ``Optimizer``
subclass that never ran ``Optimizer.__init__``, so it has no hook registries), Lightning's
``LightningOptimizer``, DeepSpeed's ZeRO optimizers (``.optimizer``), ``torch.compile``'s
``OptimizedModule`` (``._orig_mod``), DDP and accelerate's prepared model (``.module``).
Hooks go on the object that really runs: the innermost optimizer whose ``step()`` the wrapper
calls; for models the outermost ``nn.Module`` is kept (its hooks run eagerly around the
whole wrapped call), and :func:`model_wrappers` names the wrappers for mechanism checks.
"""

from __future__ import annotations

from typing import Any

#: Attributes a wrapper keeps its inner optimizer under (accelerate, DeepSpeed, Lightning).
_OPT_ATTRS = ("optimizer", "_optimizer", "optim")
#: Attributes a wrapper keeps its inner module under (DDP/FSDP1/accelerate, torch.compile).
_MOD_ATTRS = ("module", "_orig_mod", "_fsdp_wrapped_module")
_MAX_DEPTH = 8


def hookable_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.optim.Optimizer`` that has its step hook registries."""
    import torch

    return isinstance(obj, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(obj)


def optimizer(obj: Any) -> Any:
    """The real optimizer inside ``obj`` (``obj`` itself when it is one), or ``obj`` unchanged.

    Follows ``.optimizer`` / ``._optimizer`` / ``.optim`` while the object is not a hookable
    ``torch.optim.Optimizer``. Returns ``obj`` when nothing hookable is found, so the caller's
    type check reports the user's object.
    """
    cur = obj
    for _ in range(_MAX_DEPTH):
        if cur is None or hookable_optimizer(cur):
            return cur
        nxt = None
        for attr in _OPT_ATTRS:
            try:
                cand = vars(cur).get(attr) if hasattr(cur, "__dict__") else None
            except TypeError:
                cand = None
            if cand is not None and cand is not cur:
                nxt = cand
                break
        if nxt is None:
            return obj
        cur = nxt
    return obj


def model_wrappers(model: Any) -> list[str]:
    """Class names from the outermost wrapper inwards (``["DistributedDataParallel", "Net"]``)."""
    import torch

    names: list[str] = []
    cur = model
    for _ in range(_MAX_DEPTH):
        if cur is None:
            break
        names.append(type(cur).__name__)
        nxt = None
        for attr in _MOD_ATTRS:
            cand = getattr(cur, "_modules", {}).get(attr) if isinstance(cur, torch.nn.Module) else None
            if cand is None and attr == "_orig_mod":
                cand = getattr(cur, "_orig_mod", None)
            if isinstance(cand, torch.nn.Module):
                nxt = cand
                break
        cur = nxt
    return names


def module(obj: Any) -> Any:
    """The ``nn.Module`` to hook for ``obj``: ``obj`` itself if it is one, else its wrapped module.

    DeepSpeed's engine and accelerate's prepared model are modules already (their hooks run
    around the whole call); an object that only holds a module (``.module``) yields that.
    """
    import torch

    if obj is None or isinstance(obj, torch.nn.Module):
        return obj
    for attr in _MOD_ATTRS:
        cand = getattr(obj, attr, None)
        if isinstance(cand, torch.nn.Module):
            return cand
    return obj


def uses_ddp(model: Any) -> bool:
    """Whether ``model`` is (or wraps) a ``DistributedDataParallel`` or FSDP module."""
    import torch

    names = set(model_wrappers(model))
    if names & {"DistributedDataParallel", "FullyShardedDataParallel"}:
        return True
    try:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(model, torch.nn.Module) and any(
            isinstance(m, FSDPModule) for m in model.modules())
    except ImportError:  # an old torch without FSDP2
        return False


def ddp_forward_active() -> bool:
    """Whether a ``DistributedDataParallel`` forward is running now (the model passed was
    the module inside DDP, as the HF Trainer's and Lightning's callbacks see it)."""
    import torch

    return torch.nn.parallel.DistributedDataParallel._get_active_ddp_module() is not None
