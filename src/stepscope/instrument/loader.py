"""Dataloader wait: the time ``next()`` on the wrapped loader blocks the training loop."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepscope.tracer import Tracer


class TimedLoader:
    """Iterates like the wrapped loader; each ``next()`` is timed as ``dataloader``.

    The wait happens before ``step()`` opens, so the tracer attaches it to the next step
    and starts that step at the wait's start. Attributes (``dataset``, ``sampler``, ...)
    and ``len()`` are forwarded.
    """

    def __init__(self, loader: Iterable[Any], tracer: Tracer) -> None:
        self._loader = loader
        self._tracer = tracer

    def __iter__(self) -> Iterator[Any]:
        tracer = self._tracer
        it = iter(self._loader)
        while True:
            token = tracer.open_phase("dataloader") if tracer.recording else None
            try:
                batch = next(it)
            except StopIteration:
                # The last wait belongs to no step; drop it rather than skew the next epoch.
                tracer.discard_phase(token)
                return
            tracer.close_phase(token)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
