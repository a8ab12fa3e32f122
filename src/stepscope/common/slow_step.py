"""When the auto-profile calls a step slow: its default thresholds, shared by the trigger
(:mod:`stepscope.listeners.autoprofile`) and the report's note on a trigger that was armed
but never fired (which reads the recorded config and falls back to these defaults).

A step is slow when its time exceeds both ``median + k * 1.4826 * MAD`` of the recent steps
and ``(1 + min_slowdown) * median``; the trigger fires after ``patience`` slow steps in a row.
"""

from __future__ import annotations

#: Robust z-score: how many scaled MADs above the median a slow step must be.
DEFAULT_K = 5.0
#: Minimum relative slowdown over the median (0.5 = 50 % slower); guards against a tiny MAD.
DEFAULT_MIN_SLOWDOWN = 0.5
#: Consecutive slow steps before the trigger fires (1 = the first one).
DEFAULT_PATIENCE = 2
