"""Forward, backward and optimizer timing through public PyTorch hooks (no global patching).

- forward: forward pre/post hooks on the given (root) module.
- backward: a gradient hook on the forward outputs opens the phase when backward reaches
  them; it closes from an autograd *final callback* queued one level deep, so it runs after
  every other end-of-backward callback, DDP's gradient all-reduce wait included. That is
  what makes a rank that waits in the all-reduce show a long backward.
- grad_sync (DDP-style data parallel only): nested in backward, from the moment this rank's last
  parameter gradient is accumulated (its arrival at the gradient all-reduce) to the end of
  backward. A rank slow in backward *compute* arrives late and has a short grad_sync; the
  ranks that wait for it have a long one. Which parameter finishes last is learnt on the
  first distributed backward (a hook on every parameter, once), then one hook remains.
  Not under FSDP (FSDP2's ``fully_shard`` or FSDP1): FSDP calls post-accumulate hooks itself,
  on its reduce-scatter stream after the reduce-scatter, so the marker would be ~0 on every
  rank; its reduce-scatters are timed as collectives instead.
- Autograd threads: on CUDA, backward runs on a device thread while the owner blocks. The
  backward-start hook tells the recorder (``enter_autograd``), which raises the in-step gate
  there for this graph task and shares the owner's phase stack, so collectives issued during
  backward (FSDP2 reduce-scatters and all-gathers, tensor-parallel all-reduces) are timed.
- optimizer: ``Optimizer.register_step_pre_hook``/``register_step_post_hook``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from stepscope.instrument import gate, unwrap

if TYPE_CHECKING:
    from stepscope.tracer import Tracer

_is_compiling = torch.compiler.is_compiling


def _first_grad_tensors(output: Any, limit: int = 4) -> list[torch.Tensor]:
    """Up to ``limit`` output tensors that will receive a gradient, in a nested output."""
    found: list[torch.Tensor] = []
    todo = [output]
    while todo and len(found) < limit:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad and obj.grad_fn is not None:
                found.append(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple):
            todo.extend(obj)
        elif hasattr(obj, "__dataclass_fields__"):
            todo.extend(getattr(obj, f) for f in obj.__dataclass_fields__)
    return found


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _fsdp(model: torch.nn.Module) -> bool:
    """True when ``model`` or a submodule is sharded by FSDP (``fully_shard`` or FSDP1)."""
    kinds: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        kinds = [FSDPModule, FullyShardedDataParallel]
    except ImportError:  # a build without torch.distributed: no FSDP either
        return False
    marks = tuple(kinds)
    return any(isinstance(m, marks) for m in model.modules())


class _ModelHooks:
    def __init__(self, tracer: Tracer, model: torch.nn.Module, forward: bool, backward: bool) -> None:
        self.tracer = tracer
        self.model = model
        self.forward = forward
        self.backward = backward
        self._fwd: list[Any] = []
        self._bwd: Any = None
        self._bwd_step = -1  # step index the open backward belongs to (stale after a raise)
        self._bwd_adopted = False  # enter_autograd adopted the open backward's thread
        self._sync: Any = None
        # grad_sync state: None = not decided yet, False = off (not distributed).
        self._sync_param: torch.Tensor | bool | None = None
        self._calibration: list[Any] = []
        self._last_seen: torch.Tensor | None = None
        self._sync_handle: Any = None
        # grad_sync times DDP's (or FSDP's) gradient sync: without one, no such phase.
        self._ddp = unwrap.uses_ddp(model)
        # Built once, not per step: the gradient hook registered on each forward's output,
        # and the end-of-backward callback that queues the closing one behind the others.
        self._on_grad = self.on_grad
        engine = torch.autograd.Variable._execution_engine
        self._engine = engine
        close = self._close_backward
        self._queue_close: Callable[[], None] = functools.partial(engine.queue_callback, close)

    # When dynamo traces a compiled module's hooks, is_compiling() is a constant True, so the
    # hooks trace to nothing: no graph break, and the compiled wrapper's own hooks (called
    # eagerly) do the timing. Cheaper than torch.compiler.disable wrappers on every call.
    # The gate (a thread-local) is raised only on the thread that owns the open sampled
    # step, so forwards run by other threads (evaluation, EMA) are not counted.
    def pre(self, module: Any, args: Any) -> None:
        if _is_compiling():
            return
        # Whether DDP runs this forward matters only until the first backward decides on
        # grad_sync (``_sync_param``): no lookup on every later step.
        if not self._ddp and self._sync_param is None:
            self._ddp = unwrap.ddp_forward_active()
        if self.forward and gate.current() is self.tracer:
            self._fwd.append(self.tracer.open_phase("forward"))

    def post(self, module: Any, args: Any, output: Any) -> None:
        # Appended: runs after other forward hooks (FSDP2's reshard belongs to forward).
        if self.forward and self._fwd and not _is_compiling() and gate.current() is self.tracer:
            self.tracer.close_phase(self._fwd.pop())

    def post_grad(self, module: Any, args: Any, output: Any) -> None:
        # Prepended: our gradient hook is registered on the outputs before FSDP2's
        # pre-backward hook, so backward is open when its all-gathers start.
        tracer = self.tracer
        if _is_compiling() or gate.current() is not tracer or not torch.is_grad_enabled():
            return
        try:
            if isinstance(output, torch.Tensor):  # the usual output: no search
                if output.requires_grad and output.grad_fn is not None:
                    output.register_hook(self._on_grad)
                return
            for t in _first_grad_tensors(output):
                t.register_hook(self._on_grad)
        except Exception as exc:  # protect the job: an odd output type must not break it
            tracer.fail(exc)

    # Gradient hooks and engine callbacks run on autograd's threads (one per device on GPU),
    # so they cannot use the gate; they were registered only from the owning thread's forward.
    def on_grad(self, grad: Any) -> None:
        tracer = self.tracer
        index = tracer.open_step_index()  # one call, not in_step and step_index
        if index is None:
            return
        if self._bwd is not None and self._bwd_step == index:
            return
        # A backward of an earlier step that raised never closed: forget it.
        self._sync = None
        # On a device thread (CUDA), this backward is the owner's work: its gate and stack.
        self._bwd_adopted = tracer.enter_autograd()
        self._bwd = tracer.open_phase("backward")
        self._bwd_step = index
        if self._bwd is None:
            return
        try:
            # Public-in-practice engine API (DDP and FSDP use it): runs at the end of this
            # backward pass. Queue the closing callback from inside the first one so it lands
            # behind callbacks queued during backward (DDP's all-reduce finalisation).
            self._engine.queue_callback(self._queue_close)
            if self._sync_param is None:
                self._start_calibration()
        except Exception as exc:  # protect the job
            tracer.fail(exc)

    def _close_backward(self) -> None:
        if self._sync is not None:
            self.tracer.close_phase(self._sync)
            self._sync = None
        token, self._bwd = self._bwd, None
        self.tracer.close_phase(token)
        if self._bwd_adopted:  # the recorder adopted this thread at the backward's start
            self._bwd_adopted = False
            self.tracer.leave_autograd()
        if self._calibration:
            self._finish_calibration()

    # ----------------------------------------------------------- grad_sync marker

    def _start_calibration(self) -> None:
        if not _distributed() or not self._ddp or _fsdp(self.model):  # grad_sync: DDP only
            self._sync_param = False
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            self._sync_param = False
            return

        def seen(p: torch.Tensor) -> None:
            self._last_seen = p

        self._calibration = [p.register_post_accumulate_grad_hook(seen) for p in params]

    def _finish_calibration(self) -> None:
        for h in self._calibration:
            h.remove()
        self._calibration = []
        last = self._last_seen
        self._last_seen = None
        if last is None:
            # No parameter accumulated (e.g. torch.autograd.grad for a gradient penalty):
            # learn on a later backward instead of switching grad_sync off for the run.
            self._sync_param = None
            return
        self._sync_param = last
        self._sync_handle = last.register_post_accumulate_grad_hook(self._on_last_grad)

    def _on_last_grad(self, p: torch.Tensor) -> None:
        if self._bwd is not None and self._sync is None and self.tracer.in_step:
            self._sync = self.tracer.open_phase("grad_sync")

    def remove(self) -> None:
        for h in self._calibration:
            h.remove()
        self._calibration = []
        if self._sync_handle is not None:
            self._sync_handle.remove()
            self._sync_handle = None


def attach_model(
    tracer: Tracer, model: torch.nn.Module, *, forward: bool, backward: bool
) -> Callable[[], None]:
    """Hook ``model``; returns a function that removes the hooks."""
    hooks = _ModelHooks(tracer, model, forward, backward)
    # Pre-hook first and close-hook last, so collectives other forward hooks issue (FSDP2's
    # unshard and reshard of the root) are inside ``forward``.
    # Only the hooks this config needs: each is a Python call on every forward.
    handles = [model.register_forward_pre_hook(hooks.pre, prepend=True)]
    if forward:
        handles.append(model.register_forward_hook(hooks.post))
    if backward:
        handles.append(model.register_forward_hook(hooks.post_grad, prepend=True))

    def remove() -> None:
        for h in handles:
            h.remove()
        hooks.remove()

    return remove


def attach_optimizer(tracer: Tracer, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Time ``optimizer.step()`` inside steps; returns a function that removes the hooks."""
    tokens: list[Any] = []

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        if not _is_compiling() and gate.current() is tracer:
            tokens.append(tracer.open_phase("optimizer"))

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        if tokens and not _is_compiling():
            tracer.close_phase(tokens.pop())

    handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove
