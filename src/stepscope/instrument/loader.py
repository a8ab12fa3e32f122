"""Dataloader wait: the time ``next()`` on the wrapped loader blocks the training loop."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepscope.recording.protocols import Recorder


class TimedLoader:
    """Iterates like the wrapped loader; each ``next()`` is timed as ``dataloader``.

    The wait happens before ``step()`` opens, so the tracer attaches it to the next step
    and starts that step at the wait's start. Attributes (``dataset``, ``sampler``, ...)
    and ``len()`` are forwarded.
    """

    def __init__(self, loader: Iterable[Any], tracer: Recorder) -> None:
        self._loader = loader
        self._tracer = tracer

    def __iter__(self) -> Iterator[Any]:
        tracer = self._tracer
        it = iter(self._loader)
        token = None
        try:
            while True:
                # A wait no step adopted (the loop skipped a batch) would stretch the next
                # step back to it: only the wait right before a step is that step's.
                tracer.drop_unconsumed(token)
                # host=True: on GPU the wait is host time; CUDA events would time GPU idle.
                token = tracer.open_phase("dataloader", host=True) if tracer.recording else None
                try:
                    batch = next(it)
                except StopIteration:
                    # The last wait belongs to no step; drop it rather than skew the next epoch.
                    tracer.discard_phase(token)
                    token = None
                    return
                tracer.close_phase(token)
                yield batch
        finally:
            # `break` out of the loop (or an exception) abandons the last wait: evaluation or
            # anything else done before the next step must not be charged to that step.
            tracer.drop_unconsumed(token)

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
