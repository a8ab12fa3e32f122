"""Which automatic instruments a config installs on a recorder, and how they come off again.

:func:`install_instruments` hooks the model (forward, backward), the optimizer, patches
host-to-device copies and collectives, as ``config.auto`` and ``config.collectives`` ask, and
returns the functions that remove them plus the phases now timed automatically. Each
instrument talks to the recorder through the recorder protocol only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def install_instruments(
    recorder: Any, config: Any, model: Any, optimizer: Any, warn: Callable[[str], None],
) -> tuple[list[Callable[[], None]], set[str]]:
    """Install what ``config`` asks for on ``recorder``; ``(uninstallers, auto phases)``.

    An optimizer that cannot be hooked costs only its phase (``warn`` says so); every
    other failure is the caller's to handle.
    """
    removers: list[Callable[[], None]] = []
    active: set[str] = set()
    auto = config.auto
    if model is not None and auto & {"forward", "backward"}:
        from stepscope.instrument.hooks import attach_model

        removers.append(attach_model(recorder, model, forward="forward" in auto, backward="backward" in auto))
        active |= auto & {"forward", "backward"}
    if optimizer is not None and "optimizer" in auto:
        from stepscope.instrument.hooks import attach_optimizer

        try:
            removers.append(attach_optimizer(recorder, optimizer))
            active.add("optimizer")
        except Exception as exc:  # protect the job: drop only this phase, keep all other timing
            warn(f"the optimizer phase is not timed: cannot hook {type(optimizer).__name__} "
                 f"({exc!r}); pass the underlying torch.optim.Optimizer")
    if "h2d" in auto:
        from stepscope.instrument.h2d import install_patch

        removers.append(install_patch())
        active.add("h2d")
    if config.collectives:
        from stepscope.instrument import collectives

        removers.append(collectives.install_patch())
        if hasattr(recorder, "add_listener"):  # groups that carried only C++-issued work
            from stepscope.instrument.untimed import UntimedGroups

            recorder.add_listener(UntimedGroups())
    return removers, active
