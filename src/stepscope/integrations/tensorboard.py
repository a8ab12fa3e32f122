"""TensorBoard sink: each rank's step and phase times as ``SummaryWriter`` scalars."""

from __future__ import annotations

import os
from typing import Any

from stepscope.common.errors import warn
from stepscope.instrument.resource_sampler import record_scalars
from stepscope.integrations import require
from stepscope.lifecycle import NullTracer
from stepscope.tracer import Tracer

require("tensorboard", "tensorboard", "stepscope.integrations.tensorboard")


class TensorBoardSink:
    """A record listener writing ``stepscope/step_ms`` and ``stepscope/phase/<name>_ms``.

    Each rank writes its own run directory (``<log_dir>/rank<R>``), so TensorBoard overlays
    the ranks on one chart per phase. Runs on the tracer's writer thread, at flush cadence.
    """

    def __init__(self, log_dir: str | os.PathLike[str], rank: int, writer: Any = None) -> None:
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(os.path.join(os.fspath(log_dir), f"rank{rank}"))
        self.writer = writer
        self._failed = False

    def __call__(self, record: dict[str, Any]) -> None:
        if self._failed:
            return
        try:
            step = record["step"]
            add = self.writer.add_scalar
            add("stepscope/step_ms", record["step_ms"], step)
            for p in record["phases"]:
                if p.get("parent") is None:
                    add(f"stepscope/phase/{p['name']}_ms", p["ms"], step)
            add("stepscope/phase/residual_ms", record.get("residual_ms", 0.0), step)
            for key, value in record_scalars(record).items():  # [metrics] tokens/s, MFU, memory
                add(f"stepscope/{key}", value, step)
            # Flushed per record (a file flush, on the writer thread): nothing tells a
            # listener that the run ended, and unflushed events would be lost at exit.
            self.writer.flush()
        except Exception as exc:  # protect the job: a broken sink must not stop recording
            self._failed = True
            warn(f"TensorBoard sink stopped: {exc!r}", stacklevel=2)

    def close(self) -> None:
        self.writer.close()


def attach_tensorboard(
    tracer: Tracer | NullTracer, log_dir: str | os.PathLike[str] | None = None
) -> TensorBoardSink | None:
    """Send ``tracer``'s records to TensorBoard; ``None`` for a disabled tracer.

    ``log_dir`` defaults to ``<out_dir>/tensorboard``.

    Example::

        tracer = stepscope.init(out_dir="runs/a", model=model, optimizer=opt)
        attach_tensorboard(tracer)          # tensorboard --logdir runs/a/tensorboard
    """
    if not isinstance(tracer, Tracer):
        return None
    sink = TensorBoardSink(log_dir or os.path.join(tracer.config.out_dir, "tensorboard"), tracer.rank.rank)
    tracer.add_listener(sink)
    return sink
