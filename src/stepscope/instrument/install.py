"""Which automatic instruments a config installs on a recorder, and how they come off again:
the instrument side as the session sees it (:data:`AUTOMATIC`, a
:class:`~stepscope.recording.protocols.Instruments` the face hands to the session).

:func:`install_instruments` hooks the model (forward, backward), the optimizer, patches
host-to-device copies and collectives, as ``config.auto`` and ``config.collectives`` ask, and
returns the functions that remove them, the phases now timed automatically, and the
instruments that are on for sampled steps only (:class:`PerStep`: the model's hooks, the
backward wrapper, the optimizer's hooks and the ``Tensor.to``/``.cuda`` patch). Each
instrument talks to the recorder through the recorder protocol only.

The collective patches stay on for the run: they replace functions of ``torch.distributed``
for the whole process, and cost one thread-local read per call while no sampled step is open.
The host-to-device patch is on around sampled steps only, as the hooks are
(``instrument/h2d.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stepscope.instrument import collective_timing as collectives
from stepscope.instrument import graphs, h2d, hooks, resource_sampler, sched
from stepscope.instrument.untimed import UntimedGroups
from stepscope.recording.config import Config
from stepscope.recording.protocols import PerStep, Recorder
from stepscope.recording.resolver import Summarizer

__all__ = ["AUTOMATIC", "AutomaticInstruments", "PerStep", "install_instruments"]


def install_instruments(
    recorder: Recorder, config: Config, model: Any, optimizer: Any, warn: Callable[[str], None],
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
        model_hooks = hooks.attach_model(recorder, model, forward="forward" in auto,
                                         backward="backward" in auto)
        per_step.append(model_hooks)
        removers.append(model_hooks.remove)
        active |= auto & {"forward", "backward"}
    if optimizer is not None and "optimizer" in auto:
        try:
            opt_hooks = hooks.attach_optimizer(recorder, optimizer)
            per_step.append(opt_hooks)
            removers.append(opt_hooks.remove)
            active.add("optimizer")
        except Exception as exc:  # protect the job: drop only this phase, keep all other timing
            warn(f"the optimizer phase is not timed: cannot hook {type(optimizer).__name__} "
                 f"({exc!r}); pass the underlying torch.optim.Optimizer")
    if "h2d" in auto:
        h2d_patch = h2d.StepPatch()
        per_step.append(h2d_patch)
        removers.append(h2d_patch.remove)
        active.add("h2d")
    if config.collectives:
        removers.append(collectives.install_patch())
        add_listener = getattr(recorder, "add_listener", None)
        if add_listener is not None:  # groups that carried only C++-issued work
            add_listener(UntimedGroups())
    return removers, active, per_step


class AutomaticInstruments:
    """The instruments a config turns on, as the session reaches them
    (:class:`~stepscope.recording.protocols.Instruments`)."""

    def install(
        self, recorder: Any, config: Config, model: Any, optimizer: Any, warn: Callable[[str], None],
    ) -> tuple[list[Callable[[], None]], set[str], list[PerStep]]:
        return install_instruments(recorder, config, model, optimizer, warn)

    def watch_captures(self) -> tuple[Callable[[], None], Callable[[], bool]]:
        return graphs.install_patch(), graphs.probe()

    def resources(
        self, config: Config, device: str, warn: Callable[..., None]
    ) -> resource_sampler.ResourceMonitor:
        return resource_sampler.monitor_for(config, device, warn)

    def run_queue(self, clock_kind: str) -> sched.RunQueueReader | None:
        return sched.reader_for(clock_kind)

    @property
    def summarize_collectives(self) -> Summarizer:
        return collectives.summarize

    def blocked_in(self, thread_id: int) -> tuple[str, float] | None:
        return collectives.blocked_in(thread_id)


#: What the face hands to every session.
AUTOMATIC = AutomaticInstruments()
