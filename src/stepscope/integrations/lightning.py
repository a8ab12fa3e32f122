"""Lightning: a ``Callback`` and a ``Profiler`` that time training steps with stepscope."""

from __future__ import annotations

from typing import Any

import stepscope
from stepscope.integrations import StepDriver, require
from stepscope.recording.dist import launcher_run_id, new_run_id

_pl = require("lightning.pytorch", "lightning", "stepscope.integrations.lightning")
_profilers = require("lightning.pytorch.profilers", "lightning", "stepscope.integrations.lightning")


def _init(out_dir: str, init_kwargs: dict[str, Any], model: Any = None) -> Any:
    kwargs = dict(init_kwargs)
    if kwargs.get("run_id") is None:
        rid = _shared_run_id()
        if rid is not None:
            kwargs["run_id"] = rid
    auto = kwargs.pop("auto", None)
    # Phases come from Lightning's own events; only hooks Lightning has no event for stay.
    auto = set() if auto is None or auto is True else set(auto or ())
    return stepscope.init(out_dir, model=model, auto=auto, **kwargs)


def _shared_run_id() -> str | None:
    """One run id for every rank: rank 0's, broadcast over the job's process group.

    Lightning starts the ranks itself (``ddp_spawn``, ``ddp``), so each would otherwise draw
    its own id and the report would see several runs. Every rank reaches this hook, so the
    broadcast is collective. ``None`` outside a distributed job or when the id comes from
    the environment (the launcher already agrees).
    """
    import torch.distributed as dist

    if launcher_run_id() is not None:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    box = [new_run_id() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _finish(tracer: Any) -> None:
    if tracer is None:
        return
    if stepscope.current() is tracer:
        stepscope.finish()
    else:
        tracer.finish()


class StepscopeProfiler(_profilers.Profiler):  # type: ignore[misc,name-defined]
    """``Trainer(profiler=StepscopeProfiler(...))``: stepscope timing from Lightning's actions.

    Unlike Lightning's ``SimpleProfiler`` (host clock), phases are timed with CUDA events on
    a GPU, and each step becomes a stepscope record: ``dataloader`` (next batch), ``h2d``
    (``batch_to_device``), ``forward`` (``training_step``), ``backward`` and ``optimizer``
    (from ``on_before_optimizer_step`` to the end of ``optimizer_step``, so the closure's
    forward/backward are not counted twice). ``init_kwargs`` go to :func:`stepscope.init`.

    Example::

        trainer = L.Trainer(profiler=StepscopeProfiler(out_dir="runs/pl"), max_steps=100)
        trainer.fit(model, loader)
    """

    def __init__(self, out_dir: str = "runs/stepscope", **init_kwargs: Any) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.init_kwargs = init_kwargs
        self.tracer: Any = None
        self._driver: StepDriver | None = None
        self._names: dict[str, str | None] = {}

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        super().setup(stage, local_rank, log_dir)
        # Only training steps are timed; validate/test/predict runs record nothing.
        if stage == "fit" and self.tracer is None:
            self.tracer = _init(self.out_dir, self.init_kwargs)
            self._driver = StepDriver(self.tracer, wait_phase=None)

    def _phase(self, action: str) -> str | None:
        name = self._names.get(action, "")
        if name == "":
            name = None
            if action == "[_TrainingEpochLoop].train_dataloader_next":
                name = "dataloader"
            elif action.startswith("[Strategy]"):
                name = {"batch_to_device": "h2d", "training_step": "forward",
                        "backward": "backward"}.get(action.rsplit(".", 1)[-1])
            self._names[action] = name
        return name

    def start(self, action_name: str) -> None:
        d = self._driver
        if d is None:
            return
        if action_name == "run_training_batch":
            d.begin_step()
        elif action_name.startswith("[LightningModule]") and action_name.endswith(
            ".on_before_optimizer_step"
        ):
            d.open("optimizer")
        else:
            phase = self._phase(action_name)
            if phase is not None:
                d.open(phase)

    def stop(self, action_name: str) -> None:
        d = self._driver
        if d is None:
            return
        if action_name.startswith("[LightningModule]"):
            if action_name.endswith(".optimizer_step"):
                d.close("optimizer")
            elif action_name.endswith(".on_train_batch_end"):
                d.end_step()
            return
        phase = self._phase(action_name)
        if phase is not None:
            d.close(phase)

    def summary(self) -> str:
        if self.tracer is None:
            return ""
        self._stop()
        s = self.tracer.summary()
        if not s.get("steps"):
            return ""
        rows = [f"stepscope: {s['steps']} recent steps, median {s['step_ms_median']:.2f} ms "
                f"(max {s['step_ms_max']:.2f} ms); records in {self.out_dir}"]
        for name, p in sorted(s["phases"].items(), key=lambda kv: -kv[1]["median_ms"]):
            rows.append(f"  {name:<12} {p['median_ms']:9.3f} ms  {p['share']:6.1%}")
        return "\n".join(rows)

    def teardown(self, stage: str | None) -> None:
        self._stop()
        super().teardown(stage)

    def _stop(self) -> None:
        if self._driver is not None:
            self._driver.stop()
            self._driver = None
            _finish(self.tracer)


class StepscopeCallback(_pl.Callback):  # type: ignore[misc,name-defined]
    """``Trainer(callbacks=[StepscopeCallback(...)])``: stepscope timing from Lightning hooks.

    A step runs from ``on_train_batch_start`` to ``on_train_batch_end``; ``forward`` is the
    training step up to ``zero_grad``/``backward``, ``backward`` spans
    ``on_before_backward``..``on_after_backward`` (DDP's all-reduce wait included),
    ``optimizer`` starts at ``on_before_optimizer_step``; the wait for the batch (including
    its copy to the device) is ``dataloader``. Use this or :class:`StepscopeProfiler`, not
    both (with both, this callback stands aside).

    Example::

        trainer = L.Trainer(callbacks=[StepscopeCallback(out_dir="runs/pl")], max_steps=100)
    """

    def __init__(self, out_dir: str = "runs/stepscope", **init_kwargs: Any) -> None:
        self.out_dir = out_dir
        self.init_kwargs = init_kwargs
        self.tracer: Any = None
        self._driver: StepDriver | None = None
        # Phases the user asked stepscope to time itself (auto={"backward"} gives DDP's
        # grad_sync): the callback leaves those to the hooks, so none is counted twice. The
        # hooks sit on the LightningModule: its training_step must call the module (self(x)).
        auto = init_kwargs.get("auto")
        self._hooked = set() if auto is None or isinstance(auto, bool) else set(auto)

    def _open(self, name: str) -> None:
        if self._driver is not None and name not in self._hooked:
            self._driver.open(name)

    def _close(self, name: str) -> None:
        if self._driver is not None and name not in self._hooked:
            self._driver.close(name)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if isinstance(trainer.profiler, StepscopeProfiler):
            return
        self.tracer = _init(self.out_dir, self.init_kwargs, model=pl_module)
        self._driver = StepDriver(self.tracer)
        self._driver.restart_wait()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._driver is not None:
            self._driver.begin_step()
            self._driver.count_batch(batch)  # [metrics] samples / tokens
            self._open("forward")

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._close("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._close("forward")
        self._open("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._close("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._open("optimizer")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._driver is not None:
            self._driver.end_step()

    # Validation and checkpointing run between steps; the batch wait starts after them.
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._driver is not None:
            self._driver.restart_wait()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        if self._driver is not None:
            self._driver.restart_wait()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._driver is not None:
            self._driver.stop()
            self._driver = None
            _finish(self.tracer)
