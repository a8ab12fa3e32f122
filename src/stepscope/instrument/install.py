"""Which automatic instruments a config installs on a recorder, and how they come off again.

:func:`install_instruments` hooks the model (forward, backward), the optimizer, patches
host-to-device copies and collectives, as ``config.auto`` and ``config.collectives`` ask, and
returns the functions that remove them, the phases now timed automatically, and the
instruments that are on for sampled steps only (:class:`PerStep`: the model's hooks, the
backward wrapper and the optimizer's hooks). Each instrument talks to the recorder through
the recorder protocol only.

The host-to-device and collective patches stay on for the run: they replace methods of
``torch.Tensor`` and functions of ``torch.distributed`` for the whole process, and cost one
thread-local read per call while no sampled step is open (``instrument/h2d.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class PerStep(Protocol):
    """An instrument the session puts on before a sampled step and takes off after it (on the
    training thread, between steps); ``off()`` may keep it on (a compiled model's hooks)."""

    def on(self) -> None: ...

    def off(self) -> None: ...

    def remove(self) -> None: ...


def install_instruments(
    recorder: Any, config: Any, model: Any, optimizer: Any, warn: Callable[[str], None],
) -> tuple[list[Callable[[], None]], set[str], list[PerStep]]:
    """Install what ``config`` asks for on ``recorder``; ``(uninstallers, auto phases,
    per-step instruments)``, the per-step ones on (their ``remove`` among the uninstallers).

    An optimizer that cannot be hooked costs only its phase (``warn`` says so); every
    other failure is the caller's to handle.
    """
    removers: list[Callable[[], None]] = []
    active: set[str] = set()
    per_step: list[PerStep] = []
    auto = config.auto
    if model is not None and auto & {"forward", "backward"}:
        from stepscope.instrument.hooks import attach_model

        hooks = attach_model(recorder, model, forward="forward" in auto, backward="backward" in auto)
        per_step.append(hooks)
        removers.append(hooks.remove)
        active |= auto & {"forward", "backward"}
    if optimizer is not None and "optimizer" in auto:
        from stepscope.instrument.hooks import attach_optimizer

        try:
            opt_hooks = attach_optimizer(recorder, optimizer)
            per_step.append(opt_hooks)
            removers.append(opt_hooks.remove)
            active.add("optimizer")
        except Exception as exc:  # protect the job: drop only this phase, keep all other timing
            warn(f"the optimizer phase is not timed: cannot hook {type(optimizer).__name__} "
                 f"({exc!r}); pass the underlying torch.optim.Optimizer")
    if "h2d" in auto:
        from stepscope.instrument.h2d import install_patch

        removers.append(install_patch())
        active.add("h2d")
    if config.collectives:
        from stepscope.instrument import collective_timing as collectives

        removers.append(collectives.install_patch())
        if hasattr(recorder, "add_listener"):  # groups that carried only C++-issued work
            from stepscope.instrument.untimed import UntimedGroups

            recorder.add_listener(UntimedGroups())
    return removers, active, per_step
