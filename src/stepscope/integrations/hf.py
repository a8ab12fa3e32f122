"""Hugging Face ``transformers.Trainer`` callback: steps, phases and dataloader wait."""

from __future__ import annotations

from typing import Any

import stepscope
from stepscope.integrations import StepDriver, require

_transformers = require("transformers", "hf", "stepscope.integrations.hf")
TrainerCallback = _transformers.TrainerCallback


class StepscopeCallback(TrainerCallback):  # type: ignore[misc,valid-type]
    """Time every optimizer step of a ``Trainer`` with stepscope.

    One step is one optimizer step (all gradient-accumulation micro-batches). Forward and
    backward are timed by hooks on the Trainer's model, the optimizer between the Trainer's
    ``on_pre_optimizer_step`` and ``on_optimizer_step`` events (so accelerate/DeepSpeed
    wrappers need no hooks), and the wait for the next batch between steps as ``dataloader``
    (logging, evaluation and checkpointing are left out of it).

    ``init_kwargs`` go to :func:`stepscope.init` (``log_every_n_steps``, ``auto_profile``...).

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[StepscopeCallback(out_dir="runs/hf")])
        trainer.train()
        # stepscope report runs/hf
    """

    def __init__(self, out_dir: str = "runs/stepscope", **init_kwargs: Any) -> None:
        if "model" in init_kwargs or "optimizer" in init_kwargs:
            raise TypeError("StepscopeCallback takes the model and optimizer from the Trainer")
        self.out_dir = out_dir
        self.init_kwargs = init_kwargs
        self.tracer: Any = None
        self._driver: StepDriver | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        kwargs = dict(self.init_kwargs)
        auto = kwargs.pop("auto", {"forward", "backward", "h2d"})
        auto = {"forward", "backward", "h2d"} if auto is True else set(auto or ())
        # The optimizer and the batch wait are timed by Trainer events, not hooks.
        auto -= {"optimizer", "dataloader"}
        self.tracer = stepscope.init(self.out_dir, model=model, auto=auto, **kwargs)
        self._driver = StepDriver(self.tracer)
        self._driver.restart_wait()
        # Trainer callbacks never see the batch: a forward pre-hook counts each micro-batch
        # (gradient accumulation sums them into the optimizer step); evaluation is outside steps.
        self._count_hook: Any = None
        if model is not None and hasattr(model, "register_forward_pre_hook"):
            driver = self._driver

            def _count(_mod: Any, args: Any, kwargs: Any) -> None:
                driver.count_batch(kwargs if kwargs else (args[0] if args else None))

            self._count_hook = model.register_forward_pre_hook(_count, with_kwargs=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._driver is not None:
            self._driver.begin_step()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._driver is not None:
            self._driver.open("optimizer")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._driver is not None:
            self._driver.close("optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._driver is not None:
            self._driver.end_step()

    # Logging, evaluation and saving run between steps; the batch wait starts after them.
    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._driver is not None:
            self._driver.restart_wait()

    on_evaluate = on_log
    on_save = on_log

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._driver is not None:
            self._driver.stop()
            self._driver = None
        hook = getattr(self, "_count_hook", None)
        if hook is not None:
            hook.remove()
            self._count_hook = None
        if self.tracer is not None:
            if stepscope.current() is self.tracer:
                stepscope.finish()
            else:
                self.tracer.finish()
