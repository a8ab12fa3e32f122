"""Collectives: step-scoped timing of the ``torch.distributed`` calls a job issues.

While a tracer with collective timing lives, the collective functions of
``torch.distributed.distributed_c10d`` (and the same names re-exported on ``torch.distributed``,
which is how FSDP2, accelerate, Lightning and user code reach them) are replaced, once and
reference counted, by versions that first read the in-step gate (:mod:`.gate`). Outside a
sampled span on the calling thread, and while ``torch.compile`` traces, they call the original
untouched. Inside, each call becomes one entry handed to ``tracer.add_collective``.

What "time in the collective" means (the quantity the wait rule in ``analysis/waits.py``
subtracts across ranks):

- On gloo/CPU it is **host-blocking time**: for a synchronous call, from entering the call
  (this rank's arrival) to its return; for ``async_op=True`` (and ``isend``/``irecv``), the
  issuing call's duration plus the duration of ``wait()`` on the returned Work. The compute
  the job overlaps between issue and wait is excluded (the entry carries that gap as a pair of
  marks and :func:`summarize` subtracts it): on gloo the blocking happens inside ``wait()``,
  so a rank that arrives late makes the other ranks' ``wait()`` longer. The arrival is the
  issue.
- On GPU the marks are the tracer's clock marks, i.e. CUDA events recorded on the *current*
  stream: the start completes when the current stream reaches the collective, the end
  (recorded after the call, or after ``wait()`` for async work, which makes the current stream
  wait on the communication stream) completes when the current stream may proceed past the
  collective. So the figure is the time the current stream was held by the collective.
  Nothing here synchronises the host; the tracer reads the events later, after ``query()``.

Exposed and hidden: each entry's ``ms`` is split into ``exposed_ms`` (the step's stream waited
for it) and ``hidden_ms`` (it ran beside compute); only the exposed part is taken from the
phase by the analysis. A call on the step's own stream (the stream of its start mark) or on
the host is all exposed. A call made while another stream is current (FSDP2's all-gathers
under ``torch.cuda.stream(all_gather_stream)``, its reduce-scatters) is a *side* call: its
marks measure it on that stream, while compute goes on. The compute stream joins it through
``Stream.wait_event`` / ``wait_stream`` (both call ``torch.cuda.Event.wait``, patched with the
collectives) on an event ``Stream.record_event`` recorded on the side stream after the call
(patched too, to tag such events with their stream). While a side call is pending in the
sampled step, a wait of the step's stream on such an event is bracketed by two marks on the
step's stream, the time it was held; a side call's exposed time is the overlap of its span
with the holds on its stream's later events, plus its own ``wait()`` when made from the step's
stream (at most its ``ms``). Two marks per such wait, no host sync; outside sampled steps with
a side call the patches cost one test of an empty dict. Not seen: a join through an event
recorded with ``Event.record`` (untagged), through ``torch.accelerator.current_stream()``
(a ``torch.Stream``), through a third stream (HSDP's all-reduce stream waiting on the
reduce-scatter one), or after the step: a side call with no join seen in its step is all
exposed, as before the split (never wrongly called hidden).

Every entry carries the op (the function's name), a process-group id identical on all ranks
of that group (``"world"`` for the default group, else the member ranks and the group's name,
e.g. ``"g0-1#1"``), the group size, the bytes moved (the full buffer in nccl-tests' convention:
all-gather counts the output, reduce-scatter the input, the rest the tensors passed), a
per-group sequence number (counted over the calls this process timed, so the same on every
rank that samples the same steps), and the phase path open at arrival.

Functional collectives (``torch.distributed._functional_collectives``, hence DTensor and
tensor parallel) are timed by :mod:`.funcol`, installed and removed with this patch; entries
from both share the per-group sequence numbers. Point-to-point calls get their link as the
group id (:func:`p2p_id`), so the analysis pairs a send with its receive.

Not seen: DDP's bucketed all-reduce (issued from C++; timed by the ``grad_sync`` phase),
calls inside a ``_coalescing_manager`` block (the real work happens at its exit, in C++;
``batch_isend_irecv`` on NCCL uses one), counted per step as the ``unseen_coalesced`` counter
so the report says so. Functions a module bound by name (``from torch.distributed import
all_reduce``) before the patch went in are rebound to the patched ones (:mod:`.bound`).
An async Work waited after its step ends is attached to the next sampled step; one never
waited (e.g. only ``get_future()``, as DDP comm hooks do) is never recorded. Nested calls
(``all_gather_into_tensor`` → ``all_gather_single``, ``all_gather_object`` → ``all_gather``)
are timed once, as the outermost.

Protecting the job: an exception raised by the real collective propagates unchanged and that
call's timing is dropped; an error in this module turns collective timing off with one
``StepscopeWarning`` and the call goes through untouched.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from stepscope.common.errors import warn
from stepscope.instrument import bound, funcol
from stepscope.instrument.patch import SharedPatch
from stepscope.recording import gate
from stepscope.recording.step import STREAM_WAIT

#: function name → the parameter whose tensor(s) give the byte count (None: no payload).
OPS: dict[str, str | None] = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "all_gather": "tensor_list",
    "all_gather_single": "output_tensor",
    "all_gather_into_tensor": "output_tensor",
    "_all_gather_base": "output_tensor",
    "all_gather_coalesced": "output_tensor_lists",
    "reduce_scatter": "input_list",
    "reduce_scatter_single": "input",
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": None,
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "all_gather_object": None,
    "broadcast_object_list": None,
}

#: Ops that return a Work without an ``async_op`` argument.
_ALWAYS_ASYNC = frozenset({"isend", "irecv"})


class _ThreadState(threading.local):
    inside = False


#: This thread is inside a timed call (its nested calls are not timed again); ``disabled``:
#: timing off after an internal error. Both are read by :mod:`.funcol` too.
tls = _ThreadState()
is_compiling = torch.compiler.is_compiling
disabled = False
_originals: dict[str, Callable[..., Any]] = {}
# Per process-group object: (id string, size); weak so destroyed groups are forgotten.
_groups: weakref.WeakKeyDictionary[Any, tuple[str, int]] = weakref.WeakKeyDictionary()
# Per group id string (a point-to-point link's id too): the number of calls timed so far.
_seq: dict[str, int] = {}
# Per group id string: calls timed on the group, its point-to-point links' included.
_timed: dict[str, int] = {}


def available() -> bool:
    """Whether this torch build has ``torch.distributed`` (so there is something to time)."""
    return bool(torch.distributed.is_available())


# ------------------------------------------------------------------ group / bytes helpers


def _compact(ranks: Iterable[int]) -> str:
    rs = list(ranks)
    if len(rs) > 2 and rs == list(range(rs[0], rs[0] + len(rs))):
        return f"{rs[0]}..{rs[-1]}"
    return "-".join(str(r) for r in rs)


def group_info(group: Any) -> tuple[str, int] | None:
    """``(stable id, size)`` of ``group`` (``None`` = the default group), or None if unknown."""
    c10d = torch.distributed.distributed_c10d
    default = c10d._world.default_pg
    if group is None:
        if default is None:
            return None
        group = default
    hit = _groups.get(group) if isinstance(group, c10d.ProcessGroup) else None
    if hit is not None:
        return hit
    if not isinstance(group, c10d.ProcessGroup):
        return None  # e.g. GroupMember.NON_GROUP_MEMBER: this rank is not in the group
    try:
        ranks = c10d.get_process_group_ranks(group)
    except Exception:  # a destroyed (or foreign) group: this call goes untimed, quietly
        return None
    name = getattr(group, "group_name", "")
    pid = "world" if group is default else f"g{_compact(ranks)}#{name}"
    info = (pid, len(ranks))
    _groups[group] = info
    return info


#: Point-to-point ops: (peer parameter, group-relative peer parameter, this rank sends).
P2P: dict[str, tuple[str, str, bool]] = {
    "send": ("dst", "group_dst", True), "isend": ("dst", "group_dst", True),
    "recv": ("src", "group_src", False), "irecv": ("src", "group_src", False),
}


def p2p_id(pid: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
           group: Any) -> str:
    """The id of a point-to-point link, ``"<group>:<src>><dst>"`` in global ranks.

    The same on both ends (the sender's send and the receiver's recv), so the analysis
    pairs them; ``?`` for a receive from any source.
    """
    c10d = torch.distributed.distributed_c10d
    key, gkey, sends = P2P[name]
    peer = args[1] if len(args) > 1 else kwargs.get(key)
    if peer is None and kwargs.get(gkey) is not None:
        g: Any = group if group is not None else c10d._world.default_pg
        peer = c10d.get_global_rank(g, kwargs[gkey])
    me = c10d.get_rank()
    other = "?" if peer is None else str(int(peer))
    return f"{pid}:{me}>{other}" if sends else f"{pid}:{other}>{me}"


def payload_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(payload_bytes(o) for o in obj)
    return 0


class _Spec:
    """Where a function's group / async_op / payload arguments sit, found once at install."""

    __slots__ = ("async_i", "group_i", "name", "orig", "payload", "payload_i", "recv", "recv_i")

    def __init__(self, name: str, orig: Callable[..., Any]) -> None:
        self.name = name
        self.orig = orig
        params = list(inspect.signature(orig).parameters)
        self.payload = OPS[name]
        self.payload_i = params.index(self.payload) if self.payload in params else -1
        self.group_i = params.index("group") if "group" in params else -1
        self.async_i = params.index("async_op") if "async_op" in params else -1
        self.recv = _RECV.get(name)
        self.recv_i = params.index(self.recv) if self.recv in params else -1

    def arg(self, args: tuple[Any, ...], kwargs: dict[str, Any], i: int, key: str | None) -> Any:
        if 0 <= i < len(args):
            return args[i]
        return kwargs.get(key) if key is not None else None


# ------------------------------------------------------------------ the patched calls

#: all-to-all ops: the parameter holding what this rank receives (uneven splits: MoE routing).
_RECV: dict[str, str] = {"all_to_all_single": "output", "all_to_all": "output_tensor_list"}


#: Calls timed per group id (:func:`timed_calls`), for readers that look at every group at
#: once (``untimed.UntimedGroups``); written here only.
TIMED_CALLS = _timed


def timed_calls(pid: str) -> int:
    """How many calls on group ``pid`` this process has timed, its point-to-point links'
    (``"<pid>:<src>><dst>"``, numbered apart) included."""
    return _timed.get(pid, 0)


def next_seq(pid: str, group: str | None = None) -> int:
    """The next sequence number of ``pid`` (shared by every patched collective path); a
    point-to-point link's call passes the id of the ``group`` it runs on."""
    seq = _seq.get(pid, 0) + 1
    _seq[pid] = seq
    g = pid if group is None else group
    _timed[g] = _timed.get(g, 0) + 1
    return seq


def release(rec: Any, mark: Any) -> None:
    """Give a clock mark back, never raising (the job's own error is what propagates)."""
    with contextlib.suppress(Exception):
        rec.clock.release(mark)


#: Collectives traced into a compiled graph while no sampled step was open on the tracing
#: thread; added to the next sampled step that issues a collective.
compiled_pending = 0


def traced_into_graph() -> None:
    """Called by a collective wrapper while dynamo traces it (``torch.compile``).

    ``comptime`` runs its callback once, while dynamo traces this call, and leaves nothing in
    the compiled graph: no cost when the graph runs. Only reached when compiling (then
    ``torch._dynamo`` is imported; stepscope never imports it itself).
    """
    try:
        torch._dynamo.comptime.comptime(lambda ctx: _count_compiled())
    except Exception:  # protect the job (a torch without comptime): only the count is lost
        return


def _count_compiled() -> None:
    global compiled_pending
    rec = gate.current()
    if rec is None:
        compiled_pending += 1
        return
    n, compiled_pending = compiled_pending + 1, 0
    try:
        rec.add_counter("unseen_compiled", n)
    except Exception as exc:  # protect the job: this runs inside dynamo's tracing
        disable(exc)


def flush_compiled(rec: Any) -> None:
    """Count the compiled-graph collectives traced outside sampled steps into ``rec``'s step."""
    global compiled_pending
    n, compiled_pending = compiled_pending, 0
    if n:
        unseen_n(rec, "compiled", n)


def unseen(rec: Any, path: str) -> None:
    """Count one collective this rank issued where it cannot be timed (the paths:
    :data:`stepscope.common.unseen.UNSEEN`)."""
    unseen_n(rec, path, 1)


def unseen_n(rec: Any, path: str, n: int) -> None:
    """Count ``n`` collectives this rank issued where they cannot be timed."""
    try:
        rec.add_counter(f"unseen_{path}", n)
    except Exception as exc:  # protect the job: the call itself goes through untouched
        disable(exc)


def add(rec: Any, op: str, pid: str, size: int, nbytes: int, start: Any, end: Any,
        path: str | None, seq: int, gap: tuple[Any, Any] | None, recv: int | None,
        side: tuple[Any, ...] | None = None) -> None:
    """Hand one timed call to the recorder (``recv`` only where it differs from ``nbytes``,
    ``side`` only for a side-stream collective)."""
    kw: dict[str, Any] = {"seq": seq, "gap": gap}
    if recv:
        kw["recv_bytes"] = recv
    if side is not None:
        kw["side"] = side
    rec.add_collective(op, pid, size, nbytes, start, end, path, **kw)


# ------------------------------------------------------------------ side-stream collectives

#: Side streams with a collective issued in the current sampled step: stream → the ticket
#: of its latest such collective. Empty outside such steps (then the stream patches below
#: cost one test of it). ``_side_step``: the (recorder, step index) the entries belong to.
_side: dict[Any, int] = {}
_side_step: tuple[int, int] = (0, -1)
#: Orders side collectives and the events recorded on their streams (which can join them).
_tickets = itertools.count(1)
#: The attributes a joining event carries: its stream and ticket (set by ``record_event``).
_EV_STREAM = "_stepscope_stream"
_EV_TICKET = "_stepscope_ticket"


def side_of(rec: Any, start: Any) -> tuple[Any, int] | None:
    """``(stream, ticket)`` when the call whose arrival mark is ``start`` runs on another
    stream than the step's own (a communication stream, FSDP2's all-gather under
    ``torch.cuda.stream``), else None (on the step's stream, on the host clock)."""
    global _side_step
    stream = getattr(start, "stream", None)
    if stream is None:
        return None
    main = rec.step_stream()
    if main is None or stream == main:
        return None
    key = (id(rec), rec.open_step_index())
    if key != _side_step:
        _side.clear()
        _side_step = key
    ticket = _side[stream] = next(_tickets)
    return stream, ticket


def _patched_record_event(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.cuda.Stream.record_event``: an event recorded on a stream with a side
    collective pending is tagged with that stream (FSDP2's all-gather / reduce-scatter
    events, and ``wait_stream``'s, go through it)."""

    def record_event(self: Any, event: Any = None) -> Any:
        ev = orig(self, event)
        if not _side or disabled or self not in _side:
            return ev
        try:
            setattr(ev, _EV_STREAM, self)
            setattr(ev, _EV_TICKET, next(_tickets))
        except Exception as exc:  # protect the job: the event is recorded; only the split is lost
            disable(exc)
        return ev

    record_event.__wrapped__ = orig  # type: ignore[attr-defined]
    return record_event


def _patched_event_wait(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.cuda.Event.wait`` (``Stream.wait_event`` / ``wait_stream`` call it): a wait
    of the step's stream on a tagged event is bracketed by two marks on the step's stream;
    the time between them is the time it was held (see :func:`summarize`)."""

    def wait(self: Any, stream: Any = None) -> Any:
        if not _side or disabled:
            return orig(self, stream)
        joined = getattr(self, _EV_STREAM, None)
        if joined is None or is_compiling():
            return orig(self, stream)
        rec = gate.current()
        if rec is None:
            return orig(self, stream)
        try:
            before = _hold_start(rec, joined, stream)
        except Exception as exc:  # protect the job: our error, the wait goes through untimed
            disable(exc)
            return orig(self, stream)
        if before is None:
            return orig(self, stream)
        try:
            out = orig(self, stream)
        except BaseException:
            release(rec, before)
            raise  # the wait's own error, unchanged
        try:
            rec.add_stream_wait(before, rec.clock.mark(), (joined, getattr(self, _EV_TICKET, 0)))
        except Exception as exc:  # protect the job: the wait happened; only the split is lost
            disable(exc)
        return out

    wait.__wrapped__ = orig  # type: ignore[attr-defined]
    return wait


def _hold_start(rec: Any, joined: Any, stream: Any) -> Any:
    """The mark before a wait, when it is the step's stream waiting on a side stream with a
    collective pending in this step; else None (nothing to split)."""
    if (id(rec), rec.open_step_index()) != _side_step:
        _side.clear()  # pending calls of an earlier step: the patches go quiet again
        return None
    if joined not in _side:
        return None
    main = rec.step_stream()
    if main is None or (stream is not None and stream != main) or joined == main:
        return None
    before = rec.clock.mark()
    if getattr(before, "stream", None) != main:
        rec.clock.release(before)  # the current stream is not the step's: not a compute wait
        return None
    return before


def disable(exc: BaseException) -> None:
    global disabled
    if disabled:
        return
    disabled = True
    warn(f"collective timing disabled after an internal error: {exc!r}", stacklevel=3)


#: The timed collective a thread is blocked in, by thread id: ``(op, wall time it entered)``.
#: Read by observers on other threads (the heartbeat: "which collective is rank 3 stuck in").
BLOCKED_IN: dict[int, tuple[str, float]] = {}


def blocked_in(thread_id: int) -> tuple[str, float] | None:
    """The collective ``thread_id`` is blocked in (op, since when, wall clock), or None."""
    return BLOCKED_IN.get(thread_id)


def _make_patched(spec: _Spec) -> Callable[..., Any]:
    orig = spec.orig
    name = spec.name
    always_async = name in _ALWAYS_ASYNC
    world = torch.distributed.distributed_c10d._world

    def patched(*args: Any, **kwargs: Any) -> Any:
        # is_compiling first: while dynamo traces, it folds to True and nothing else is touched.
        if is_compiling():
            # Traced by dynamo: rewritten to the functional form (counted as compiled there)
            # or a graph break (then it runs eagerly, timed).
            return orig(*args, **kwargs)
        rec = gate.current()
        if rec is None or tls.inside or disabled:
            return orig(*args, **kwargs)
        if compiled_pending:
            flush_compiled(rec)
        if world.pg_coalesce_state:
            # Issued inside a coalescing block: the real work runs at its exit, in C++.
            unseen(rec, "coalesced")
            return orig(*args, **kwargs)
        try:
            path = rec.current_path()
            start = rec.clock.mark()  # this rank's arrival
            side = side_of(rec, start)
        except Exception as exc:  # protect the job: our error, the call goes through
            disable(exc)
            return orig(*args, **kwargs)
        tls.inside = True
        tid = threading.get_ident()
        BLOCKED_IN[tid] = (name, time.time())
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            tls.inside = False
            BLOCKED_IN.pop(tid, None)
            with contextlib.suppress(Exception):
                rec.clock.release(start)
            raise  # the collective's own error, unchanged
        tls.inside = False
        BLOCKED_IN.pop(tid, None)
        try:
            is_async = always_async or bool(spec.arg(args, kwargs, spec.async_i, "async_op"))
            if is_async and not isinstance(out, torch.distributed.distributed_c10d.Work):
                rec.clock.release(start)  # not in the group, or an illegal (coalesced) work
                return out
            info = group_info(spec.arg(args, kwargs, spec.group_i, "group"))
            if info is None:
                rec.clock.release(start)
                return out
            pid, size = info
            group_pid = pid
            if name in P2P:
                pid, size = p2p_id(pid, name, args, kwargs,
                                   spec.arg(args, kwargs, spec.group_i, "group")), 2
            seq = next_seq(pid, group_pid)
            payload = spec.arg(args, kwargs, spec.payload_i, spec.payload)
            nbytes = payload_bytes(payload) if spec.payload is not None else 0
            recv = (payload_bytes(spec.arg(args, kwargs, spec.recv_i, spec.recv))
                    if spec.recv is not None else None)
            if is_async:
                issued = rec.clock.mark()
                return _timed_work(out, (rec, name, pid, size, nbytes, start, path, seq, issued,
                                         recv, side))
            add(rec, name, pid, size, nbytes, start, rec.clock.mark(), path, seq, None, recv,
                side)
        except Exception as exc:  # protect the job: the call already happened; return its result
            disable(exc)
        return out

    patched.__name__ = name
    patched.__qualname__ = name
    patched.__doc__ = orig.__doc__
    patched.__wrapped__ = orig  # type: ignore[attr-defined]
    return patched


_WORK_FORWARDED = (
    "is_completed", "is_success", "exception", "get_future", "get_future_result", "result",
    "source_rank", "_source_rank", "boxed", "_get_duration", "_get_op_type",
)


def _build_work_class() -> type:
    base = torch.distributed.distributed_c10d.Work

    class TimedWork(base):  # type: ignore[misc,valid-type]
        """A ``Work`` that takes the end mark when ``wait()`` (or ``synchronize()``) returns.

        It is an instance of ``torch.distributed.Work`` (FSDP2 checks ``isinstance``); every
        method forwards to the real work.
        """

        __slots__ = ("_ss_inner", "_ss_pending")

        def __init__(self, inner: Any, pending: tuple[Any, ...]) -> None:
            super().__init__()
            self._ss_inner = inner
            self._ss_pending: tuple[Any, ...] | None = pending

        def _ss_begin(self) -> Any:
            pending = self._ss_pending
            if pending is None or disabled:
                return None
            try:
                return pending[0].clock.mark()
            except Exception as exc:  # protect the job
                disable(exc)
                return None

        def _ss_done(self, wait_start: Any) -> None:
            pending, self._ss_pending = self._ss_pending, None
            if pending is None or wait_start is None:
                return
            try:
                rec, name, pid, size, nbytes, start, path, seq, issued, recv, side = pending
                if side is not None:
                    # Waited from the step's stream: the wait itself held it (WorkNCCL::wait
                    # makes the current stream wait for the collective's end).
                    here = getattr(wait_start, "stream", None) == rec.step_stream()
                    side = (*side, here)
                add(rec, name, pid, size, nbytes, start, rec.clock.mark(), path, seq,
                    (issued, wait_start), recv, side)
            except Exception as exc:  # protect the job
                disable(exc)

        def _ss_drop(self) -> None:
            # The real wait raised: its error propagates, this timing is forgotten.
            pending, self._ss_pending = self._ss_pending, None
            if pending is not None:
                with contextlib.suppress(Exception):
                    pending[0].clock.release(pending[5])
                    pending[0].clock.release(pending[8])

        def _ss_call(self, attr: str, args: Any, kwargs: Any) -> Any:
            wait_start = self._ss_begin()
            pending = self._ss_pending
            tid = threading.get_ident()
            if pending is not None:
                BLOCKED_IN[tid] = (f"{pending[1]}.{attr}", time.time())
            try:
                out = getattr(self._ss_inner, attr)(*args, **kwargs)
            except BaseException:
                BLOCKED_IN.pop(tid, None)
                self._ss_drop()
                raise
            BLOCKED_IN.pop(tid, None)
            self._ss_done(wait_start)
            return out

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            return self._ss_call("wait", args, kwargs)

        def synchronize(self, *args: Any, **kwargs: Any) -> Any:
            return self._ss_call("synchronize", args, kwargs)

        def block_current_stream(self, *args: Any, **kwargs: Any) -> Any:
            return self._ss_call("block_current_stream", args, kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._ss_inner, name)

        def __repr__(self) -> str:
            return f"TimedWork({self._ss_inner!r})"

    def forward(attr: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self._ss_inner, attr)(*args, **kwargs)

        method.__name__ = attr
        return method

    for attr in _WORK_FORWARDED:
        if hasattr(base, attr):
            setattr(TimedWork, attr, forward(attr))
    return TimedWork


_work_cls: type | None = None


def _timed_work(inner: Any, pending: tuple[Any, ...]) -> Any:
    global _work_cls
    if _work_cls is None:
        _work_cls = _build_work_class()
    return _work_cls(inner, pending)


# ------------------------------------------------------------------ install / remove


def _targets() -> list[Any]:
    import torch.distributed as dist

    return [dist.distributed_c10d, dist]


def _apply() -> None:
    global disabled
    disabled = False
    _seq.clear()
    _timed.clear()
    c10d = torch.distributed.distributed_c10d
    for name in OPS:
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        _originals[name] = orig
        patched = _make_patched(_Spec(name, orig))
        for mod in _targets():
            if getattr(mod, name, None) is orig:
                setattr(mod, name, patched)
    bound.rebind((orig, getattr(c10d, name)) for name, orig in _originals.items())
    orig_bc = getattr(torch.distributed, "_broadcast_coalesced", None)
    if orig_bc is not None:
        _originals["_broadcast_coalesced"] = orig_bc
        setattr(torch.distributed, "_broadcast_coalesced", _make_broadcast_coalesced(orig_bc))  # noqa: B010 (private)
    funcol.apply(sys.modules[__name__])
    _apply_stream_patches()


#: (class, attribute, original) of the stream patches in place.
_stream_originals: list[tuple[Any, str, Any]] = []


def _apply_stream_patches() -> None:
    """Patch ``torch.cuda.Stream.record_event`` and ``torch.cuda.Event.wait`` (as they are
    now: the simulator's stand-ins in tests) where this torch has them."""
    _side.clear()
    cuda = torch.cuda
    for cls, attr, make in ((getattr(cuda, "Stream", None), "record_event", _patched_record_event),
                            (getattr(cuda, "Event", None), "wait", _patched_event_wait)):
        orig = getattr(cls, attr, None) if cls is not None else None
        if orig is None:
            continue
        _stream_originals.append((cls, attr, orig))
        setattr(cls, attr, make(orig))


def _restore() -> None:
    bound.restore(_originals.values())
    for name, orig in _originals.items():
        for mod in _targets():
            cur = getattr(mod, name, None)
            if getattr(cur, "__wrapped__", None) is orig:
                setattr(mod, name, orig)
    _originals.clear()
    funcol.restore()
    for cls, attr, orig in _stream_originals:
        if getattr(getattr(cls, attr, None), "__wrapped__", None) is orig:
            setattr(cls, attr, orig)
    _stream_originals.clear()
    _side.clear()


def _make_broadcast_coalesced(orig: Callable[..., Any]) -> Callable[..., Any]:
    """DDP's buffer broadcast (``broadcast_buffers=True``, the default, with any buffer: batch
    norm statistics, position ids) at the start of every forward: a collective issued from
    Python through this private binding, recorded as a ``broadcast`` on DDP's group. A rank
    that arrives late to forward makes the others wait here, inside their forward."""

    def patched(process_group: Any, tensors: Any, buffer_size: int, src: int = 0) -> Any:
        if is_compiling():
            return orig(process_group, tensors, buffer_size, src)
        rec = gate.current()
        if rec is None or tls.inside or disabled:
            return orig(process_group, tensors, buffer_size, src)
        try:
            path = rec.current_path()
            start = rec.clock.mark()  # this rank's arrival
        except Exception as exc:  # protect the job: our error, the call goes through
            disable(exc)
            return orig(process_group, tensors, buffer_size, src)
        tls.inside = True
        try:
            out = orig(process_group, tensors, buffer_size, src)
        except BaseException:
            tls.inside = False
            release(rec, start)
            raise  # the collective's own error, unchanged
        tls.inside = False
        try:
            info = group_info(process_group)
            if info is None:
                release(rec, start)
                return out
            pid, size = info
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            add(rec, "broadcast", pid, size, nbytes, start, rec.clock.mark(), path, next_seq(pid),
                None, None)
        except Exception as exc:  # protect the job: the call already happened
            disable(exc)
        return out

    patched.__wrapped__ = orig  # type: ignore[attr-defined]
    return patched


_patch = SharedPatch(_apply, _restore)


def install_patch() -> Callable[[], None]:
    """Install the patched collectives (reference counted); returns their remover."""
    return _patch.acquire()


# ------------------------------------------------------------------ the record section


def summarize(
    entries: Iterable[tuple[Any, ...]], elapsed_ms: Callable[[Any, Any], float]
) -> list[dict[str, Any]]:
    """The record's ``collectives`` section: one dict per (phase, op, pg), first-seen order.

    ``entries`` are the tuples the tracer kept: ``(op, pg, pg_size, nbytes, start, end,
    phase_path, seq, gap[, recv_bytes[, side]])`` (``recv_bytes`` only from all-to-all: kept as
    the entry's ``recv_bytes`` beside ``bytes``, the bytes sent, and ``recv_max_bytes``, the
    most one call received: uneven MoE routing shows there), ``gap`` being ``None`` or the
    ``(issue_end, wait_start)`` marks of an async call, whose span (overlapped work) is not
    time in the collective; ``elapsed_ms`` is the clock's reader (all marks are ready by now).

    ``ms`` is the time in the collective, split into ``exposed_ms`` (the step's stream waited
    for it) and ``hidden_ms`` (it ran beside compute). A call on the step's own stream or on
    the host is all exposed. A side-stream call (``side`` set) is exposed where its span
    overlaps the step's stream being held by a wait on its stream's work issued after it
    (the :data:`~stepscope.recording.step.STREAM_WAIT` entries, or its own ``wait()`` from
    the step's stream), at most its ``ms``; with no such join seen, all of it.
    """
    entries = list(entries)
    holds = [e for e in entries if e[0] == STREAM_WAIT]
    out: dict[tuple[Any, str, str], dict[str, Any]] = {}
    for entry in entries:
        op, pg, size, nbytes, start, end, path, seq, gap = entry[:9]
        if op == STREAM_WAIT:
            continue
        recv = entry[9] if len(entry) > 9 else None
        side = entry[10] if len(entry) > 10 else None
        ms = elapsed_ms(start, end)
        if gap is not None:
            ms -= elapsed_ms(gap[0], gap[1])
        exposed = ms if side is None else _exposed(entry, side, holds, elapsed_ms, ms)
        key = (path, op, pg)
        e = out.get(key)
        if e is None:
            out[key] = {
                "phase": path, "op": op, "pg": pg, "pg_size": size, "count": 1, "bytes": nbytes,
                "ms": ms, "max_ms": ms, "exposed_ms": exposed, "hidden_ms": ms - exposed,
                "seq_first": seq, "seq_last": seq,
            }
            if recv is not None:
                out[key]["recv_bytes"] = recv
                out[key]["recv_max_bytes"] = recv
        else:
            if recv is not None:
                e["recv_bytes"] = e.get("recv_bytes", 0) + recv
                e["recv_max_bytes"] = max(e.get("recv_max_bytes", 0), recv)
            e["count"] += 1
            e["bytes"] += nbytes
            e["ms"] += ms
            e["max_ms"] = max(e["max_ms"], ms)
            e["exposed_ms"] += exposed
            e["hidden_ms"] += ms - exposed
            e["seq_first"] = min(e["seq_first"], seq)
            e["seq_last"] = max(e["seq_last"], seq)
    for e in out.values():
        for k in ("ms", "max_ms", "exposed_ms", "hidden_ms"):
            e[k] = round(e[k], 4)
    return list(out.values())


def _exposed(entry: tuple[Any, ...], side: tuple[Any, ...], holds: list[tuple[Any, ...]],
             elapsed_ms: Callable[[Any, Any], float], ms: float) -> float:
    """The part of a side-stream call's ``ms`` during which the step's stream was held
    waiting for its stream: the overlap of its span with each hold on a later event of that
    stream, plus its own ``wait()`` where the step's stream made it. A call whose join was
    not seen in its step (no such hold, no such wait) is all exposed, as if on the step's
    stream: what cannot be told apart is never called hidden."""
    start, end, gap = entry[4], entry[5], entry[8]
    stream, ticket = side[0], side[1]
    span = elapsed_ms(start, end)
    held = 0.0
    seen = len(side) > 2 and bool(side[2]) and gap is not None
    if seen:
        held += elapsed_ms(gap[1], end)
    for h in holds:
        joined, t = h[10]
        if t <= ticket or joined != stream:
            continue  # a wait on another stream's work, or on an event recorded before it
        seen = True
        a = elapsed_ms(start, h[4])
        b = elapsed_ms(start, h[5])
        held += max(0.0, min(b, span) - max(a, 0.0))
    if not seen:
        return ms
    return min(max(held, 0.0), max(ms, 0.0))
