"""Reference-counted patches: installed by the first tracer that needs them, removed by the last.

Several tracers (a default one and explicit ones, tests) may want the same library function
patched. :class:`SharedPatch` applies the patch when the first user acquires it and restores
the original when the last one releases it; each release function works once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class SharedPatch:
    """``apply()`` on the first :meth:`acquire`, ``restore()`` when the last remover runs."""

    def __init__(self, apply: Callable[[], None], restore: Callable[[], None]) -> None:
        self._apply = apply
        self._restore = restore
        self._lock = threading.Lock()
        self._users = 0

    @property
    def installed(self) -> bool:
        return self._users > 0

    def acquire(self) -> Callable[[], None]:
        """Count one more user (applying the patch if first); returns that user's remover."""
        with self._lock:
            if self._users == 0:
                self._apply()
            self._users += 1
        removed = False

        def remove() -> None:
            nonlocal removed
            with self._lock:
                if removed:
                    return
                removed = True
                self._users -= 1
                if self._users == 0:
                    self._restore()

        return remove
