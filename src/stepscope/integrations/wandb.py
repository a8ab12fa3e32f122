"""Weights & Biases sink: rank 0's step and phase times (and cross-rank numbers) on their own axis."""

from __future__ import annotations

from typing import Any

from stepscope.common.errors import warn
from stepscope.instrument.resource_sampler import record_scalars
from stepscope.integrations import require
from stepscope.lifecycle import NullTracer
from stepscope.tracer import Tracer

_wandb = require("wandb", "wandb", "stepscope.integrations.wandb")

#: Cross-rank numbers of the live view logged with each record (when distributed).
CROSS_KEYS = ("step_ms_median", "step_ms_max", "slowest_rank", "h2d_share", "dataloader_share")


class WandbSink:
    """A record listener calling ``run.log`` with ``stepscope/*`` metrics.

    The metrics use their own x-axis, ``stepscope/step`` (``define_metric``), which only
    moves forward: records are logged in step order and a step not after the last one is
    skipped. With ``commit=False`` (default) each record joins the row of the user's next
    ``wandb.log`` and never advances W&B's own step, so a training loop that logs with
    ``step=`` is unaffected; pass ``commit=True`` when nothing else logs to the run.
    """

    def __init__(self, run: Any = None, *, commit: bool = False, prefix: str = "stepscope") -> None:
        run = run if run is not None else _wandb.run
        if run is None:
            raise RuntimeError("WandbSink needs a W&B run: call wandb.init() first or pass run=")
        self.run = run
        self.commit = commit
        self.prefix = prefix
        self.cross: dict[str, Any] | None = None
        self.last_step = -1
        self._failed = False
        run.define_metric(f"{prefix}/step")
        run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")

    def __call__(self, record: dict[str, Any]) -> None:
        if self._failed or record["step"] <= self.last_step:
            return
        try:
            pre = self.prefix
            data: dict[str, Any] = {f"{pre}/step": record["step"], f"{pre}/step_ms": record["step_ms"]}
            for p in record["phases"]:
                if p.get("parent") is None:
                    data[f"{pre}/phase/{p['name']}_ms"] = p["ms"]
            data[f"{pre}/phase/residual_ms"] = record.get("residual_ms", 0.0)
            for key, value in record_scalars(record).items():  # [metrics] tokens/s, MFU, memory
                data[f"{pre}/{key}"] = value
            if self.cross:
                for k in CROSS_KEYS:
                    if k in self.cross:
                        data[f"{pre}/cross_rank/{k}"] = self.cross[k]
            self.run.log(data, commit=self.commit)
            self.last_step = record["step"]
        except Exception as exc:  # protect the job: a broken sink must not stop recording
            self._failed = True
            warn(f"W&B sink stopped: {exc!r}", stacklevel=2)


def attach_wandb(tracer: Tracer | NullTracer, run: Any = None, *, commit: bool = False) -> WandbSink | None:
    """Log ``tracer``'s records to W&B from rank 0; ``None`` on other ranks or when disabled.

    Example::

        wandb.init(project="my-run")
        tracer = stepscope.init(out_dir="runs/a", model=model, optimizer=opt, log_every_n_steps=50)
        attach_wandb(tracer)
    """
    if not isinstance(tracer, Tracer) or tracer.rank.rank != 0:
        return None
    sink = WandbSink(run, commit=commit)
    view = getattr(tracer, "_live", None)
    if view is not None and view.distributed:
        # The live view's latest cross-rank summary rides along with each record.
        view.gather_callbacks.append(lambda _payloads: setattr(sink, "cross", view.latest))
    tracer.add_listener(sink)
    return sink
