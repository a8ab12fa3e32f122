"""``errors.warn``: a warning names user-given things (phases, counters, paths) and reaches the
terminal on stderr, so control and format characters in it are written out as text."""

from __future__ import annotations

import warnings

from stepscope.common.errors import StepscopeWarning, warn


def test_a_warning_writes_out_control_and_format_characters() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("phase 'fwd\u202edrawkcab\x1b[2J' timed twice")
    (w,) = caught
    assert issubclass(w.category, StepscopeWarning)
    text = str(w.message)
    assert "\u202e" not in text and "\x1b" not in text
    assert text == "stepscope: phase 'fwd\\u202edrawkcab\\x1b[2J' timed twice"
