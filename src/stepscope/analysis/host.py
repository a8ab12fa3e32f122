"""The one rule for "the host was busy, not the job": which slow windows are host contention.

On a CPU clock every phase is host work, so another process taking the cores slows the
job's phases as surely as its own code would. Two kinds of evidence say "host":

* every rank's host work (forward, backward, optimizer, residual) slowing at once with no
  rank singled out, or a compute phase running ``HOST_BUSY_SLOWDOWN`` times slower on one of
  the window's ranks meanwhile (a real input-bound window slows the loader, not the model's
  compute; a busy host deschedules a rank's compute, and the others wait for it in
  whatever they do next: seen as a 10-step all-rank dataloader window in a clean Lightning
  run next to a CPU hog, one rank's backward 5x slower meanwhile);
* the kernel's own account (:mod:`stepscope.instrument.sched`): a rank whose extra
  run-queue wait over the other ranks, in the window, is at least ``RUNQ_SHARE`` of the
  window's excess was runnable but waiting for a CPU.

:func:`split_host_busy` applies it to the analysis' windows (the run report's ``host_busy``
notes); :func:`stepscope.analysis.diagnose.diagnose` asks :func:`is_host_busy` of any window
it is handed directly.
"""

from __future__ import annotations

from typing import Any

from stepscope.analysis.series import runq_extra
from stepscope.analysis.stragglers import explaining, own_slowdown
from stepscope.common import robust

_COMPUTE = ("forward", "backward", "optimizer")
#: On a CPU clock these are all host work: the residual (Python between phases) slows with
#: the model's compute when another process takes the cores (seen: a balanced pipeline next
#: to other jobs, residual 1.2x on both ranks for 11 steps, nothing else changed).
HOST_WORK = (*_COMPUTE, "residual")
#: A compute phase this many times slower on a rank of an all-rank window: the host.
HOST_BUSY_SLOWDOWN = 1.5
#: A rank's extra run-queue wait at this share of a window's excess explains it.
RUNQ_SHARE = 0.5


def is_host_busy(w: dict[str, Any], clock: str | None, stragglers: list[dict[str, Any]],
                 con: Any = None, extra: dict[int, dict[int, float]] | None = None) -> bool:
    """Whether window ``w`` (all-rank) is the host being busy rather than the job.

    ``con`` (the loaded run) adds the compute-slowdown evidence, ``extra``
    (:func:`stepscope.analysis.series.runq_extra`) the run-queue evidence.
    """
    if not str(clock or "").startswith("cpu") or len(w["ranks"]) < 2:
        return False
    first, last = int(w["start_step"]), int(w["end_step"])
    excess = float(w.get("excess_ms") or 0.0)
    if explaining(stragglers, first, last, excess):
        return False
    if w["phase"] in HOST_WORK:
        return True
    if con is not None and any(own_slowdown(con, p, first, last, r) >= HOST_BUSY_SLOWDOWN
                               for p in _COMPUTE for r in w["ranks"]):
        return True
    for per_step in (extra or {}).values():
        inside = [v for st, v in per_step.items() if first <= st <= last]
        if inside and excess > 0 and robust.median(inside) >= RUNQ_SHARE * excess:
            return True
    return False


def split_host_busy(windows: list[dict[str, Any]], clock: str | None,
                    stragglers: list[dict[str, Any]],
                    con: Any = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(windows of the job, windows that are the host being busy)``, by :func:`is_host_busy`."""
    if not str(clock or "").startswith("cpu"):
        return windows, []
    extra = runq_extra(con) if con is not None else {}
    busy = [w for w in windows if is_host_busy(w, clock, stragglers, con, extra)]
    return [w for w in windows if w not in busy], busy
