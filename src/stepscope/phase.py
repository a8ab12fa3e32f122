"""User-named phases: the ``phase()`` context manager/decorator and the name rule.

Kept apart from :mod:`stepscope.tracer` (which needs torch) so that ``import stepscope``
and the analysis side stay light: ``stepscope.phase("x")`` works before ``init()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any, TypeVar

from stepscope.common import escape

if TYPE_CHECKING:
    from stepscope.recording.protocols import Recorder

__all__ = ["PhaseContext", "check_phase_name"]

F = TypeVar("F", bound=Callable[..., Any])

_get_ident = threading.get_ident


class PhaseContext:
    """``with tracer.phase("x"):`` and ``@tracer.phase("x")``.

    One context may be entered by several threads at once (a decorated function called from
    a worker pool): each thread closes its own token.
    """

    __slots__ = ("_default", "_host", "_name", "_tokens", "_tracer")

    def __init__(
        self, tracer: Recorder | None, name: str, host: bool,
        default: Callable[[], Any] | None = None,
    ) -> None:
        if tracer is None and default is None:
            raise TypeError("PhaseContext needs a tracer, or default: what returns the default one")
        self._tracer = tracer  # None: ask default() for the default tracer at each use
        self._default = default
        self._name = name
        self._host = host
        self._tokens: list[tuple[int, Any, Any]] = []  # (thread, tracer, token)

    def __enter__(self) -> PhaseContext:
        tracer: Any = self._tracer
        if tracer is None:
            tracer = self._default()  # type: ignore[misc]
        self._tokens.append((_get_ident(), tracer, tracer.open_phase(self._name, host=self._host)))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        tokens = self._tokens
        tid = _get_ident()
        if tokens and tokens[-1][0] == tid:  # the usual case: this thread entered last
            _, tracer, token = tokens.pop()
        else:
            for i in range(len(tokens) - 1, -1, -1):
                if tokens[i][0] == tid:
                    _, tracer, token = tokens.pop(i)
                    break
            else:
                return  # entered on no thread we know of: nothing to close
        if exc is not None:
            tracer.note_raise(exc)  # the innermost phase an exception left, before it closes
        tracer.close_phase(token)

    def __call__(self, fn: F) -> F:
        ctx = self

        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with ctx:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def check_phase_name(name: Any) -> str:
    """``name`` as it is recorded (lone surrogates written out: :func:`escape.name`), or
    ``ValueError``."""
    if not isinstance(name, str) or not name or name == "residual" or "/" in name:
        raise ValueError(
            f"phase name must be a non-empty string other than 'residual', without '/'; got {name!r}"
        )
    return escape.name(name)
