"""Process groups that carried collectives stepscope did not time (issued from C++).

A collective issued from C++ (a ``ProcessGroup`` method called directly, a framework's native
code, a backend's own scheduling) never passes through the Python functions
:mod:`.collectives` patches. The process group still counts it: its sequence number
(``_get_sequence_number_for_group``, kept by gloo and NCCL) moves on by one per collective.

At the end of each sampled step, and of the step before one, this listener reads every
group's sequence number (one pybind call per group). A group whose number moved while
stepscope timed no call on it during the one step since the previous look carried only
untimed work: the difference is counted as ``unseen_untimed`` (on the next sampled step,
where counters reported between steps go), so the report's ``blind`` section names it instead
of a silent "balanced". Conservative by design: a group that also carried timed calls in that
window is not counted (a funcol's backward issued from C++ beside its timed forward, DDP's
buffer broadcast beside its C++ bucket all-reduce), nor is a backend without sequence numbers.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from stepscope.instrument import collective_timing as col

#: While there is no default process group, how often a step end asks torch whether there
#: is one now (seconds). Asking is three Python calls (``is_initialized`` and two properties),
#: made at every step end of every single-process run with the caches cold after the step's
#: torch work; a group made later is seen within this long, and its first look only sets the
#: baseline. Once there is one, the step ends look at the groups directly (none after
#: ``destroy_process_group``).
DIST_CHECK_S = 1.0

_monotonic = time.monotonic


class UntimedGroups:
    """Listener: ``on_step_end`` compares each group's sequence number with the calls timed on it."""

    #: Called at the end of sampled steps and of the steps before them only (see
    #: ``Session.add_listener``): the other steps time nothing, so nothing is looked at there.
    sampled_only = True

    def __init__(self) -> None:
        # ProcessGroup → (its sequence number, stepscope's timed-call count) at the last look,
        # and its id (looked up once per group).
        self._last: dict[Any, tuple[int, int, str]] = {}
        self._off = False
        self._dist = False  # a default process group was seen
        self._next_ask = 0.0  # monotonic time of the next is_initialized() while not _dist
        self._looked_at = -2  # the step whose end the last look was taken at
        #: torch's table of live process groups, read once a default group is seen: torch
        #: mutates that one dict in place (``new_group``, ``destroy_process_group``).
        self._pg_map: dict[Any, Any] = {}
        self._kept = 0  # len(self._last), kept without a call

    def look(self) -> int:
        """Collectives issued on groups that carried no timed call since the last look.

        Run at the end of a DDP step with the caches cold: operators, not method calls
        (``in``, ``[]``, a kept length), so that it costs one call per group beside its own."""
        n = seen = 0
        last = self._last
        groups = list(self._pg_map)
        timed_calls = col.TIMED_CALLS
        for pg in groups:
            try:
                seq = pg._get_sequence_number_for_group()  # an int (pybind)
            except Exception:  # a backend without sequence numbers: cannot tell, not counted
                continue
            if pg in last:
                prev = last[pg]
                pid = prev[2]
            else:
                prev = None
                info = col.group_info(pg)
                if info is None:
                    continue
                pid = info[0]
                self._kept += 1
            timed = timed_calls[pid] if pid in timed_calls else 0  # noqa: SIM401 (no call)
            seen += 1
            last[pg] = (seq, timed, pid)
            if prev is not None and seq > prev[0] and timed == prev[1]:
                n += seq - prev[0]
        if self._kept > seen:  # destroyed groups (rare)
            for pg in [g for g in last if g not in groups]:
                del last[pg]
            self._kept = len(last)
        return n

    def on_step_end(self, session: Any, index: int) -> None:
        if self._off:
            return
        if not self._dist:
            now = _monotonic()
            if now < self._next_ask:
                return
            self._next_ask = now + DIST_CHECK_S
            if not torch.distributed.is_initialized():
                return
            self._dist = True
            pg_map = getattr(getattr(torch.distributed.distributed_c10d, "_world", None), "pg_map", None)
            self._pg_map = pg_map if isinstance(pg_map, dict) else {}
        try:
            # Called at the end of a sampled step and of the step before one (sampled_only).
            # A window is counted only when it is one step long: at the end of the step
            # before a sampled one it is the baseline of that step's window (the look before
            # it was steps earlier), unless that step follows a sampled one (one step in 2).
            n = self.look()
            fresh = self._looked_at == index - 1  # else the window spans steps
            self._looked_at = index
            if n and fresh:
                session.add_counter("unseen_untimed", n)
        except Exception:  # protect the job: this check is off for the rest of the run
            self._off = True
