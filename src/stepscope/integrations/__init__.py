"""Integrations with the frameworks users already run: HF Trainer, Lightning, TensorBoard, W&B.

Each submodule imports its framework when imported and says which extra to install when it
is missing; importing ``stepscope.integrations`` itself imports none of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from stepscope.instrument.resource_sampler import batch_counts
from stepscope.lifecycle import NullTracer
from stepscope.tracer import Tracer


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise ImportError naming the pip extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs the '{module}' package, which is not installed; "
            f"install it with: pip install 'stepscope[{extra}]'"
        ) from exc


class StepDriver:
    """Drives a tracer from framework events: step begin/end and named phases.

    The span between one step's end and the next step's start is timed as ``dataloader``
    (the tracer attaches it to the next step); ``restart_wait()`` drops what came before
    (logging, evaluation, checkpointing) so only the wait for the batch remains.
    """

    def __init__(self, tracer: Tracer | NullTracer, wait_phase: str | None = "dataloader") -> None:
        self.tracer = tracer
        self.wait_phase = wait_phase
        self._wait: Any = None
        self._open: dict[str, Any] = {}
        self._in_step = False

    def begin_step(self) -> None:
        if self._in_step:
            return
        self.close("__wait__")
        self.tracer.step().__enter__()
        self._in_step = True

    def end_step(self) -> None:
        if not self._in_step:
            return
        for name in list(self._open):
            self.close(name)
        self.tracer.step().__exit__(None, None, None)
        self._in_step = False
        self.restart_wait()

    def count_batch(self, batch: Any) -> None:
        """Add the batch's samples (and tokens, for ``input_ids``/``attention_mask``) to the step."""
        if not self._in_step:
            return
        try:
            tokens, samples = batch_counts(batch)
            if tokens is not None:
                self.tracer.count("tokens", tokens)
            if samples is not None:
                self.tracer.count("samples", samples)
        except Exception:  # protect the job: an odd batch only loses its counts
            return

    def restart_wait(self) -> None:
        token = self._open.pop("__wait__", None)
        if token is not None:
            self.tracer.discard_phase(token)
        if self.wait_phase is not None and not self._in_step:
            self._open["__wait__"] = self.tracer.open_phase(self.wait_phase)

    def open(self, name: str) -> None:
        """Start ``name``; outside a step it is kept for the next step (a pre-step phase)."""
        if name not in self._open:
            self._open[name] = self.tracer.open_phase(name)

    def close(self, name: str) -> None:
        token = self._open.pop(name, None)
        if token is not None:
            self.tracer.close_phase(token)

    def stop(self) -> None:
        """Drop the open wait span and close the step, if any (end of training)."""
        token = self._open.pop("__wait__", None)
        if token is not None:
            self.tracer.discard_phase(token)
        if self._in_step:
            self.end_step()
            token = self._open.pop("__wait__", None)
            if token is not None:
                self.tracer.discard_phase(token)
