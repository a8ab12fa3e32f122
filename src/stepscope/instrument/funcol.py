"""Functional collectives: timing of ``torch.distributed._functional_collectives`` and DTensor.

Functional collectives (``funcol``) issue the communication and return at once; the result
is an ``AsyncCollectiveTensor`` whose first use (or an explicit ``wait_tensor``) blocks until
the collective is done. DTensor's redistributions (tensor parallel's Colwise/Rowwise
all-reduces and all-gathers, in forward and in backward) call the same module-level
functions (``funcol.all_reduce``, ``funcol.all_gather_single``, ``funcol.reduce_scatter_single``,
``funcol.all_to_all_single``) at call time, so replacing those names covers them.

Timed like an ``async_op=True`` call in :mod:`.collectives`: from the issue (this rank's
arrival) to the issue's return, plus the ``wait_tensor`` that waits for it; the work the job
does in between is the entry's ``gap``, not time in the collective. Issue and wait are
matched through the result's storage (views of the result share it). A result never waited
through ``wait_tensor`` (its memory freed first) is never recorded.

Functions a module bound by name before the patch (``from ..._functional_collectives import
all_to_all_single``) are found and rebound (:mod:`.bound`).

Not seen: functional collectives traced into a graph (``torch.compile``: they become graph
ops; :mod:`stepscope.instrument.collective_timing` counts such calls as *blind*), and callers that
reach ``torch.ops._c10d_functional`` directly instead of through this module.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from stepscope.instrument import bound

#: funcol function name → the op name recorded (the c10d name for the same collective, so
#: bus-bandwidth factors and tables apply unchanged).
OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_gather_tensor": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_tensor_autograd": "all_gather_into_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "all_to_all_single_autograd": "all_to_all_single",
    "broadcast": "broadcast",
}
#: Ops whose byte count is the output (all-gather: nccl-tests' convention); others the input.
_OUTPUT_BYTES = frozenset({"all_gather_into_tensor"})
_MAX_PENDING = 512

_lock = threading.Lock()
# storage data_ptr → pending entry, oldest first (bounded: results never waited are dropped).
_pending: OrderedDict[int, tuple[Any, ...]] = OrderedDict()
_originals: dict[str, Callable[..., Any]] = {}
#: The collectives module that installed the patch (:func:`apply`), which records what is
#: timed here; handed in, not imported: it imports this module.
_col: Any = None


def _module() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


def _key(t: Any) -> int | None:
    elem = getattr(t, "elem", t)  # an AsyncCollectiveTensor wraps the real result
    if not isinstance(elem, torch.Tensor):
        return None
    try:
        return int(elem.untyped_storage().data_ptr())
    except Exception:  # a tensor without storage (meta/fake): nothing to match
        return None


def _group(funcol: Any, group: Any, tag: str) -> tuple[str, int] | None:
    c10d = torch.distributed.distributed_c10d
    name = funcol._resolve_group_name(group, tag)
    info: tuple[str, int] | None = _col.group_info(getattr(c10d, "_resolve_process_group")(name))  # noqa: B009 (private)
    return info


def _split_bytes(t: torch.Tensor, splits: Any, size: int) -> int:
    if splits is None:
        return t.numel() * t.element_size()
    # One row's size from the shape: a rank that sends no rows may still receive some.
    row = int(t.shape[1:].numel()) * t.element_size() if t.dim() > 0 else 0
    return int(sum(int(s) for s in splits)) * row


def _make(name: str, orig: Callable[..., Any], col: Any) -> Callable[..., Any]:
    op = OPS[name]
    funcol = _module()
    tracing = funcol._are_we_tracing
    gate = col.gate

    def patched(*args: Any, **kwargs: Any) -> Any:
        if col.is_compiling():
            col.traced_into_graph()
            return orig(*args, **kwargs)
        if col.disabled or col.tls.inside:
            return orig(*args, **kwargs)
        rec = gate.current()
        if rec is None:
            return orig(*args, **kwargs)
        if col.compiled_pending:
            col.flush_compiled(rec)
        if tracing():
            col.unseen(rec, "traced")  # captured into a graph: runs there, untimed
            return orig(*args, **kwargs)
        try:
            path = rec.current_path()
            start = rec.clock.mark()  # this rank's arrival
        except Exception as exc:  # protect the job: our error, the call goes through
            col.disable(exc)
            return orig(*args, **kwargs)
        col.tls.inside = True
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            col.tls.inside = False
            col.release(rec, start)
            raise  # the collective's own error, unchanged
        col.tls.inside = False
        try:
            _issued(name, op, rec, path, start, args, kwargs, out, funcol)
        except Exception as exc:  # protect the job: the call already happened; return its result
            col.disable(exc)
        return out

    patched.__name__ = name
    patched.__qualname__ = name
    patched.__doc__ = orig.__doc__
    patched.__wrapped__ = orig  # type: ignore[attr-defined]
    return patched


def _issued(name: str, op: str, rec: Any, path: str | None, start: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any], out: Any, funcol: Any) -> None:
    col = _col
    inp = args[0] if args else kwargs.get("self")
    group = kwargs.get("group")
    if group is None:
        # (self, reduceOp|gather_dim|src, group) or (self, reduceOp, scatter_dim, group) or
        # (self, output_split_sizes, input_split_sizes, group)
        gi = 3 if name.startswith(("reduce_scatter", "all_to_all")) else 2
        group = args[gi] if len(args) > gi else None
    tag = kwargs.get("tag", "")
    info = _group(funcol, group, tag if isinstance(tag, str) else "")
    if info is None:
        rec.clock.release(start)
        return
    pid, size = info
    seq = col.next_seq(pid)
    recv = 0
    if op == "all_to_all_single" and isinstance(inp, torch.Tensor):
        ins = kwargs.get("input_split_sizes", args[2] if len(args) > 2 else None)
        outs = kwargs.get("output_split_sizes", args[1] if len(args) > 1 else None)
        nbytes = _split_bytes(inp, ins, size)
        recv = _split_bytes(inp, outs, size) if outs is not None else nbytes
    elif op in _OUTPUT_BYTES and isinstance(out, torch.Tensor):
        nbytes = out.numel() * out.element_size()
    else:
        nbytes = col.payload_bytes(inp)
    key = _key(out)
    if key is None or not (hasattr(out, "elem") or hasattr(out, "trigger_wait")):
        # Already waited inside the call (tracing, or a gather that needed the data): done.
        col.add(rec, op, pid, size, nbytes, start, rec.clock.mark(), path, seq, None, recv)
        return
    pending = (rec, op, pid, size, nbytes, start, path, seq, rec.clock.mark(), recv)
    with _lock:
        old = _pending.pop(key, None)
        _pending[key] = pending
        while len(_pending) > _MAX_PENDING:
            _, stale = _pending.popitem(last=False)
            _forget(stale)
    if old is not None:
        _forget(old)


def _forget(pending: tuple[Any, ...]) -> None:
    col = _col
    col.release(pending[0], pending[5])
    col.release(pending[0], pending[8])


def _make_wait(orig: Callable[..., Any], col: Any) -> Callable[..., Any]:
    def wait_tensor(tensor: Any) -> Any:
        # is_compiling first: while dynamo traces, it folds to True and nothing else is touched.
        if col.is_compiling() or not _pending or col.disabled:
            return orig(tensor)
        key = _key(tensor)
        with _lock:
            pending = _pending.pop(key, None) if key is not None else None
        if pending is None:
            return orig(tensor)
        rec = pending[0]
        try:
            wait_path = rec.current_path()
            wait_start = rec.clock.mark()
        except Exception as exc:  # protect the job
            col.disable(exc)
            return orig(tensor)
        try:
            out = orig(tensor)
        except BaseException:
            _forget(pending)
            col.release(rec, wait_start)
            raise
        try:
            _, op, pid, size, nbytes, start, _, seq, issued, recv = pending
            # Recorded in the phase that waited (where this rank's time went): the first use
            # of a tensor-parallel output is often outside the forward that issued it.
            col.add(rec, op, pid, size, nbytes, start, rec.clock.mark(), wait_path, seq,
                    (issued, wait_start), recv)
        except Exception as exc:  # protect the job: the wait already happened
            col.disable(exc)
        return out

    wait_tensor.__doc__ = orig.__doc__
    wait_tensor.__wrapped__ = orig  # type: ignore[attr-defined]
    return wait_tensor


def apply(col: Any) -> None:
    """Replace the funcol functions (called by :mod:`.collective_timing` when it installs,
    with itself as ``col``)."""
    global _col
    try:
        funcol = _module()
    except ImportError:  # a torch without functional collectives: nothing to time
        return
    _col = col
    _pending.clear()
    for name in OPS:
        orig = getattr(funcol, name, None)
        if orig is None:
            continue
        _originals[name] = orig
        setattr(funcol, name, _make(name, orig, col))
    orig_wait = funcol.wait_tensor
    _originals["wait_tensor"] = orig_wait
    funcol.wait_tensor = _make_wait(orig_wait, col)
    bound.rebind((orig, getattr(funcol, name)) for name, orig in _originals.items())


def restore() -> None:
    if not _originals:
        return
    funcol = _module()
    bound.restore(_originals.values())
    for name, orig in _originals.items():
        cur = getattr(funcol, name, None)
        if getattr(cur, "__wrapped__", None) is orig:
            setattr(funcol, name, orig)
    _originals.clear()
    with _lock:
        while _pending:
            _forget(_pending.popitem()[1])
