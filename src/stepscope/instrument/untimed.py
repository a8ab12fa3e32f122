"""Process groups that carried collectives stepscope did not time (issued from C++).

A collective issued from C++ (a ``ProcessGroup`` method called directly, a framework's native
code, a backend's own scheduling) never passes through the Python functions
:mod:`.collectives` patches. The process group still counts it: its sequence number
(``_get_sequence_number_for_group``, kept by gloo and NCCL) moves on by one per collective.

At the end of each sampled step this listener reads every group's sequence number. A group
whose number moved while stepscope timed no call on it since the previous step's end carried
only untimed work: the difference is counted as ``unseen_untimed`` (on the next sampled step,
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

    def look(self) -> int:
        """Collectives issued on groups that carried no timed call since the last look."""
        n = seen = 0
        last = self._last
        pg_map = getattr(getattr(torch.distributed.distributed_c10d, "_world", None), "pg_map", None)
        groups = list(pg_map) if pg_map else []
        timed_calls = col.TIMED_CALLS.get
        for pg in groups:
            try:
                seq = pg._get_sequence_number_for_group()  # an int (pybind)
            except Exception:  # a backend without sequence numbers: cannot tell, not counted
                continue
            prev = last.get(pg)
            if prev is None:
                info = col.group_info(pg)
                if info is None:
                    continue
                pid = info[0]
            else:
                pid = prev[2]
            timed = timed_calls(pid, 0)
            seen += 1
            last[pg] = (seq, timed, pid)
            if prev is not None and seq > prev[0] and timed == prev[1]:
                n += seq - prev[0]
        if len(last) > seen:  # destroyed groups
            for pg in [g for g in last if g not in groups]:
                del last[pg]
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
        try:
            samples = session.config.samples
            if not samples(index):
                # An unsampled step times nothing: the window of the sampled step after it
                # starts at its end (no look at the end of the others: one per group each).
                if samples(index + 1):
                    self.look()
                    self._looked_at = index
                return
            n = self.look()
            fresh = self._looked_at == index - 1  # else the window spans steps (index moved)
            self._looked_at = index
            if n and fresh:
                session.add_counter("unseen_untimed", n)
        except Exception:  # protect the job: this check is off for the rest of the run
            self._off = True
