"""The exception tree of stepscope.

    StepscopeError
    ├── ConfigError (ValueError)        bad arguments to init()/Config
    ├── InstrumentationError (ValueError) the same phase timed twice (auto + manual), misuse
    └── AnalysisError                   a run directory or trace that cannot be analysed
"""

from __future__ import annotations

import contextlib
import warnings

from stepscope.common.escape import term


class StepscopeError(Exception):
    """Base class of every error stepscope raises on purpose."""


class ConfigError(StepscopeError, ValueError):
    """An argument to ``init()`` or ``Config`` is out of its allowed range."""


class InstrumentationError(StepscopeError, ValueError):
    """Instrumentation misuse, e.g. a phase timed both automatically and manually."""


class AnalysisError(StepscopeError):
    """Input that cannot be analysed at all (nothing usable was found)."""


class StepscopeWarning(RuntimeWarning):
    """Something went wrong inside stepscope; the training job goes on."""


def warn(msg: str, stacklevel: int = 1) -> None:
    """Issue ``StepscopeWarning("stepscope: " + msg)``, never raising into the job.

    ``stacklevel`` counts from the caller, as for :func:`warnings.warn`. A filter that turns
    warnings into errors (``-W error``, pytest's ``filterwarnings = error``) would otherwise
    raise out of a hook or thread in the middle of training; the warning is then lost instead.
    """
    with contextlib.suppress(Exception):  # protect the job (see above)
        # Names in the message are the user's: shown as text on the terminal, never obeyed.
        warnings.warn(f"stepscope: {term(msg)}", StepscopeWarning, stacklevel=stacklevel + 1)
