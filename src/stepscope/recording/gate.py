"""The in-step gate: which recorder, if any, owns a sampled step open on *this* thread.

Instruments that patch library functions (``Tensor.to`` for H2D, ``torch.distributed``
collectives) run for every call in the process, on every thread. They read this
thread-local first and do nothing more unless a sampled step (or a sampled pre-step phase
such as the dataloader wait) is open on the calling thread. The recorder raises the gate when
such a span opens and lowers it when it closes; nothing else writes it. (The per-step hooks
of one tracer first compare the calling thread with the recorder's ``sampled_owner``, and
ask here only when it is not the owner.)

On CUDA, backward runs on a device thread while the owner blocks. The recorder raises the
gate there too, for the owner's autograd graph task only: the gate remembers the task id and
reads closed on that thread once another task (or none) runs, so a gate left raised by a
backward whose end ran elsewhere never times unrelated work.

The owner's backward is timed at its call (``torch.autograd.backward``, see
:mod:`stepscope.instrument.hooks`), on the owner's thread, before the engine starts and
while it runs, so no hook on the device thread announces it. Instead, while that call runs,
``backward_owner`` names the recorder; a thread whose gate is down that asks
:func:`current` from inside an autograd graph task (``_current_graph_task_id() >= 0``) is
then adopted (:meth:`~stepscope.recording.recorder.Recorder.enter_autograd`): its gate is raised for
that graph task and it shares the owner's phase stack. Threads outside a graph task (a
loader worker, a logger) are never adopted.

A thread-local read costs ~0.1 µs, far less than swapping patched methods in and out at
every step (which invalidates CPython's method caches).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_task_id = torch._C._current_graph_task_id


class _Gate(threading.local):
    #: ``(recorder, graph task or None)`` while raised, else ``None``: one thread-local read
    #: or write per look or change (each costs ~1–3 µs right after a long torch op, when the
    #: caches are cold). The task is set on adopted autograd threads only.
    raised: tuple[Any, int | None] | None = None


_gate = _Gate()
#: This thread's gate, for the step boundary of the recorder, which raises it there
#: (``here.raised = raised_by(recorder)``, a value it keeps) and lowers it (``here.raised =
#: None``) without a call: the same writes :func:`set_current` makes.
here = _gate

#: The recorder whose owner is inside a timed ``torch.autograd.backward`` call now: any thread
#: may read it; only that call (:mod:`stepscope.instrument.hooks`) writes it, restoring what
#: was there before when it returns (nested tracers).
backward_owner: Any = None
#: Set when :func:`current` adopted a thread for ``backward_owner``; the backward call clears
#: it on return and then has the recorder forget its adopted threads.
adopted = False


def current() -> Any:
    """The recorder that owns the sampled span open on this thread, or ``None``."""
    raised = _gate.raised
    if raised is not None:
        rec, task = raised
        if task is None or _task_id() == task:
            return rec
    bw = backward_owner
    if bw is None or _task_id() < 0:
        return None
    # A thread running an autograd graph task while the owner is blocked in its backward:
    # the owner's backward, run here (CUDA's device threads). Adopted for this graph task.
    if not bw.enter_autograd():
        return None
    global adopted
    adopted = True
    return bw


def raised_by(recorder: Any) -> tuple[Any, None]:
    """What ``here.raised`` holds while ``recorder``'s sampled step is open on this thread."""
    return (recorder, None)


def set_current(recorder: Any, *, autograd: bool = False) -> None:
    """Raise (a recorder) or lower (``None``) this thread's gate. Recorder only.

    ``autograd=True``: raised for the autograd graph task running on this thread now.
    """
    if recorder is None:
        _gate.raised = None
    else:
        _gate.raised = (recorder, _task_id() if autograd else None)
