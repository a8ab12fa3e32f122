"""The exception tree of stepscope.

    StepscopeError
    ├── ConfigError (ValueError)        bad arguments to init()/Config
    ├── InstrumentationError (ValueError) the same phase timed twice (auto + manual), misuse
    └── AnalysisError                   a run directory or trace that cannot be analysed
"""

from __future__ import annotations


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
