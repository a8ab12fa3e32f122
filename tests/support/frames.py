"""What one call runs, seen through ``sys.setprofile``: the tests that budget a step's or a
hook's work name the functions it calls, in order."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import stepscope

#: Prefix of stepscope's own source files (not the tests: a checkout named ``stepscope``
#: holds them too, outside ``src/stepscope``).
PACKAGE = str(Path(stepscope.__file__).parent) + os.sep


def calls_of(fn: Callable[[], Any], *, c: bool = False, package: bool = False) -> list[str]:
    """Names of the functions ``fn()`` calls, in order: Python functions, or with ``c`` the C
    functions called from Python code. With ``package``, only those called from (for C) or
    defined in (for Python) stepscope's own files. The profile is removed however ``fn`` ends;
    its exception propagates."""
    event = "c_call" if c else "call"
    own = getattr(fn, "__code__", None)  # fn's own frame is not one of its calls
    got: list[str] = []

    def prof(frame: Any, ev: str, arg: Any) -> None:
        if ev != event or (not c and frame.f_code is own):
            return
        if not package or frame.f_code.co_filename.startswith(PACKAGE):
            got.append(arg.__name__ if c else frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return got
