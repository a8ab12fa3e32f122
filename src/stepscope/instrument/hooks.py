"""Forward, backward and optimizer timing: public PyTorch hooks, and one call-site wrapper.

- forward: forward pre/post hooks on the given (root) module.
- backward: timed at its call. While a tracer that times backward is running, the module
  attribute ``torch.autograd.backward`` (which ``Tensor.backward`` calls, and so every
  ``loss.backward()``, ``scaler.scale(loss).backward()``, Lightning's, Accelerate's and
  ``torch.distributed.pipelining``'s full backward) is a wrapper: on the thread that owns an
  open sampled step it opens ``backward`` before the call and closes it when the call returns
  or raises. The engine has run every end-of-backward callback by then, DDP's gradient
  all-reduce wait included: a rank that waits in the all-reduce shows a long backward. The
  original is put back when the last such tracer finishes (unless someone wrapped it after
  us: then ours stays, passing calls straight through). Not timed: ``torch.autograd.grad``
  (a gradient penalty is not a training backward; zero-bubble pipeline schedules, which split
  backward into ``autograd.grad`` calls, show no ``backward``), a backward a library calls
  through a reference it took before the tracer started (``from torch.autograd import
  backward``), a backward called inside another (reentrant checkpointing), and a backward
  called from a thread that does not own the step. This replaced a gradient hook on each
  forward's output plus a queued final callback, which cost ~17 µs more per step
  (measured with ``benchmarks/hot_path.py --mode callsite``).
- grad_sync (DDP-style data parallel only): nested in backward, from the moment this rank's last
  parameter gradient is accumulated (its arrival at the gradient all-reduce) to the end of
  backward. A rank slow in backward *compute* arrives late and has a short grad_sync; the
  ranks that wait for it have a long one. Which parameter finishes last is learnt on the
  first distributed backward (a hook on every parameter, once), then one hook remains.
  Not under FSDP (FSDP2's ``fully_shard`` or FSDP1): FSDP calls post-accumulate hooks itself,
  on its reduce-scatter stream after the reduce-scatter, so the marker would be ~0 on every
  rank; its reduce-scatters are timed as collectives instead.
- Autograd threads: on CUDA, backward runs on a device thread while the owner blocks. While
  the owner is inside the timed call, the gate names its recorder (``gate.backward_owner``):
  the first instrumented call (a collective, the grad_sync marker) made on a thread running an
  autograd graph task adopts that thread (``enter_autograd``: the in-step gate raised there for
  this graph task, the owner's phase stack shared), so collectives issued during backward
  (FSDP2 reduce-scatters and all-gathers, tensor-parallel all-reduces) are timed.
- optimizer: ``Optimizer.register_step_pre_hook``/``register_step_post_hook``.

All of these are on for sampled steps only (:class:`ModelHooks`, :class:`OptimizerHooks`): the
session puts them on at the end of the step before a sampled one and takes them off at its end,
so an unsampled step runs ``Module.__call__``'s fast path, torch's own backward and a hook-free
``optimizer.step()``. A compiled model keeps its module hooks on every step (dynamo keeps the
hooks it compiled with), which costs each step the module-hook slow path and two hook calls.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from stepscope.instrument import unwrap
from stepscope.recording import gate

if TYPE_CHECKING:
    from stepscope.recording.protocols import Recorder

#: Dynamo folds this to a constant True while it traces (as it does ``is_compiling``), and in
#: eager code it is one Python call where ``is_compiling`` is two (it asks
#: ``torch.jit.is_scripting`` first): five calls a step here, each made with the caches cold
#: after a long torch op. Dynamo is what traces module and optimizer hooks; a non-strict
#: ``torch.export`` runs them eagerly, where the gate (closed outside a step) decides.
_is_compiling = torch.compiler.is_dynamo_compiling
_get_ident = threading.get_ident


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
    def __init__(self, tracer: Recorder, model: torch.nn.Module, forward: bool, backward: bool) -> None:
        self.tracer = tracer
        self.model = model
        self.forward = forward
        self.backward = backward
        self._fwd: list[Any] = []
        self._bwd: Any = None  # the open backward's token
        self._sync: Any = None
        # grad_sync state: None = not decided yet, False = off (not distributed).
        self._sync_param: torch.Tensor | bool | None = None
        self._calibration: list[Any] = []
        self._last_seen: torch.Tensor | None = None
        self._sync_handle: Any = None
        # grad_sync times DDP's (or FSDP's) gradient sync: without one, no such phase.
        self._ddp = unwrap.uses_ddp(model)

    # When dynamo traces a compiled module's hooks, _is_compiling() is a constant True, so the
    # hooks trace to nothing: no graph break, and the compiled wrapper's own hooks (called
    # eagerly) do the timing. Cheaper than torch.compiler.disable wrappers on every call.
    # Timed only on the thread that owns the open sampled step (``open_phase`` with ``others``
    # False: ``sampled_owner``, one attribute read; the gate, a thread-local, answers for a
    # pre-step phase or an adopted thread), so forwards run by other threads (evaluation, EMA)
    # are not counted.
    def pre(self, module: Any, args: Any) -> None:
        if _is_compiling():
            return
        # Whether DDP runs this forward matters only until the first backward decides on
        # grad_sync (``_sync_param``): no lookup on every later step.
        if not self._ddp and self._sync_param is None:
            self._ddp = unwrap.ddp_forward_active()
        if self.forward:
            token = self.tracer.open_phase("forward", False, False)
            if token is not None:  # another thread's forward leaves no token for the owner's post
                self._fwd.append(token)

    def post(self, module: Any, args: Any, output: Any) -> None:
        # Appended: runs after other forward hooks (FSDP2's reshard belongs to forward).
        if self.forward and self._fwd and not _is_compiling():
            tracer = self.tracer
            if tracer.sampled_owner == _get_ident() or gate.current() is tracer:
                tracer.close_phase(self._fwd.pop())

    def run_backward(self, real: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``torch.autograd.backward(*args, **kwargs)`` timed as this step's ``backward``
        (the wrapper calls it on the owner's thread, the gate raised, none open)."""
        tracer = self.tracer
        token = self._bwd = tracer.open_phase("backward")
        if token is None:
            return real(*args, **kwargs)
        self._sync = None
        if self._sync_param is None:
            try:
                self._start_calibration()
            except Exception as exc:  # protect the job: calibration must not break the backward
                tracer.fail(exc)
        prev, gate.backward_owner = gate.backward_owner, tracer  # device threads: adopted
        try:
            return real(*args, **kwargs)
        except BaseException as exc:
            tracer.note_raise(exc)  # crash evidence names backward (and grad_sync) open
            raise
        finally:
            gate.backward_owner = prev
            if self._sync is not None:
                tracer.close_phase(self._sync)
                self._sync = None
            self._bwd = None
            tracer.close_phase(token)
            if gate.adopted:
                gate.adopted = False
                tracer.leave_autograd_threads()
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
        # On a device thread (CUDA), gate.current() adopts it: grad_sync nests in backward.
        tracer = self.tracer
        if self._bwd is not None and self._sync is None and (
                tracer.sampled_owner == _get_ident() or gate.current() is tracer):
            self._sync = tracer.open_phase("grad_sync")

    def sync_marker(self, on: bool) -> None:
        """Put the grad_sync marker (learnt already) on its parameter, or take it off."""
        if on and self._sync_handle is None and isinstance(self._sync_param, torch.Tensor):
            self._sync_handle = self._sync_param.register_post_accumulate_grad_hook(self._on_last_grad)
        elif not on and self._sync_handle is not None:
            self._sync_handle.remove()
            self._sync_handle = None

    def remove(self) -> None:
        if self.backward:
            _unwrap_backward(self)
        for h in self._calibration:
            h.remove()
        self._calibration = []
        if self._sync_handle is not None:
            self._sync_handle.remove()
            self._sync_handle = None


# ------------------------------------------------------- the torch.autograd.backward wrapper

_autograd = torch.autograd
_active: list[_ModelHooks] = []  # hooks of running tracers that time backward, oldest first
_real_backward: Callable[..., Any] | None = None  # what the wrapper calls


def _timed_backward(*args: Any, **kwargs: Any) -> Any:
    real = _real_backward
    assert real is not None
    if not _is_compiling():
        tid = _get_ident()
        for hooks in _active:
            if hooks.tracer.sampled_owner == tid and hooks._bwd is None:
                return hooks.run_backward(real, args, kwargs)
        here = gate.current()
        if here is not None:
            for hooks in _active:
                # The gate is raised here for this tracer: this thread owns its step (a device
                # thread adopted during the owner's backward calls in only for a reentrant
                # backward, while that backward is open: passed through).
                if hooks.tracer is here and hooks._bwd is None:
                    return hooks.run_backward(real, args, kwargs)
    return real(*args, **kwargs)


_in_chain = False  # ours is installed (on top, or under a wrapper someone put over it)


def _wrap_backward(hooks: _ModelHooks) -> None:
    global _real_backward, _in_chain
    if not _in_chain:
        _real_backward = _autograd.backward
        _autograd.backward = _timed_backward
        _in_chain = True
    _active.append(hooks)


def _unwrap_backward(hooks: _ModelHooks) -> None:
    global _in_chain
    if hooks in _active:
        _active.remove(hooks)
    # Put the original back unless someone wrapped ours since: then ours stays in their chain,
    # passing calls through, and a later tracer uses it instead of wrapping theirs again.
    if not _active and _autograd.backward is _timed_backward and _real_backward is not None:
        _autograd.backward = _real_backward
        _in_chain = False


def compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a module it wraps) runs under ``torch.compile``: an
    ``OptimizedModule`` or a module compiled in place (``model.compile()``). Dynamo keeps the
    hooks a module was compiled with (it does not guard on them by default,
    ``torch._dynamo.config.skip_nnmodule_hook_guards``), so such a model keeps its hooks."""
    if "torch._dynamo" not in sys.modules:  # nothing can be compiled yet: no dynamo import
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    cur: Any = model
    for _ in range(8):
        if isinstance(cur, OptimizedModule) or getattr(cur, "_compiled_call_impl", None) is not None:
            return True
        cur = next((m for a in ("module", "_orig_mod", "_fsdp_wrapped_module")
                    if isinstance(m := getattr(cur, a, None), torch.nn.Module)), None)
        if cur is None:
            return False
    return False


class ModelHooks:
    """The model's hooks and the backward wrapper, put on for sampled steps only.

    ``on()`` and ``off()`` are called at step boundaries on the training thread (the session
    puts them on at the boundary before a sampled step and takes them off after it): an
    unsampled forward then takes ``Module.__call__``'s fast path and ``loss.backward()`` calls
    torch directly. A compiled model (:func:`compiled`, asked at each ``off()`` as well, for a
    model compiled in place after ``init()``) keeps its module hooks on; only the backward
    wrapper comes off.
    """

    def __init__(self, tracer: Recorder, model: torch.nn.Module, forward: bool, backward: bool) -> None:
        self._hooks = _ModelHooks(tracer, model, forward, backward)
        self.model = model
        self.always = compiled(model)
        self._handles: list[Any] = []
        self._backward_on = False
        self.on()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def on(self) -> None:
        hooks = self._hooks
        if hooks.backward and not self._backward_on:
            _wrap_backward(hooks)
            self._backward_on = True
        if self._handles:
            return
        model = self.model
        # Pre-hook first and close-hook last, so collectives other forward hooks issue (FSDP2's
        # unshard and reshard of the root) are inside ``forward``.
        # Only the hooks this config needs: each is a Python call on every forward.
        self._handles.append(model.register_forward_pre_hook(hooks.pre, prepend=True))
        if hooks.forward:
            self._handles.append(model.register_forward_hook(hooks.post))
        hooks.sync_marker(True)

    def off(self) -> None:
        # The backward wrapper comes off in any case: torch.autograd.backward is called
        # eagerly, outside a compiled forward.
        if self._backward_on:
            _unwrap_backward(self._hooks)
            self._backward_on = False
        if not self._handles or self.always:
            return
        if getattr(self.model, "_compiled_call_impl", None) is not None:  # compiled since init()
            self.always = True
            return
        self._take_off()

    def _take_off(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        hooks = self._hooks
        hooks._fwd.clear()  # a forward that raised left its token: that step is closed
        hooks.sync_marker(False)

    def remove(self) -> None:
        self.off()
        self._take_off()
        self._hooks.remove()


def attach_model(tracer: Recorder, model: torch.nn.Module, *, forward: bool, backward: bool) -> ModelHooks:
    """Hook ``model`` (attached now); ``remove()`` takes the hooks off for good."""
    return ModelHooks(tracer, model, forward, backward)


class OptimizerHooks:
    """``optimizer.step()`` timed inside sampled steps; ``on()``/``off()`` as :class:`ModelHooks`
    (an optimizer has no compiled path to keep: its hooks run eagerly around ``step()``)."""

    always = False

    def __init__(self, tracer: Recorder, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        tokens: list[Any] = []
        self._tokens = tokens

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            if not _is_compiling():
                token = tracer.open_phase("optimizer", False, False)
                if token is not None:
                    tokens.append(token)

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            if tokens and not _is_compiling():
                tracer.close_phase(tokens.pop())

        self._pre, self._post = pre, post
        self._handles: list[Any] = []
        self.on()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def on(self) -> None:
        if not self._handles:
            opt = self.optimizer
            self._handles = [opt.register_step_pre_hook(self._pre),
                             opt.register_step_post_hook(self._post)]

    def off(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._tokens.clear()

    def remove(self) -> None:
        self.off()


def attach_optimizer(tracer: Recorder, optimizer: torch.optim.Optimizer) -> OptimizerHooks:
    """Time ``optimizer.step()`` inside steps (attached now); ``remove()`` takes the hooks off."""
    return OptimizerHooks(tracer, optimizer)
