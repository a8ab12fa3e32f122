"""Anomaly-triggered deep profiling: a slow step arms ``stepscope.Profiler`` for the next steps."""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepscope.common.robust import MAD_SCALE, mad, median
from stepscope.listeners.live import attach_live
from stepscope.listeners.profiler import DeviceSpec, Profiler, on_device
from stepscope.recording.config import AutoProfileConfig, resolve_auto_profile
from stepscope.recording.schema import TRIGGERS_FILE, TRIGGERS_SCHEMA

if TYPE_CHECKING:
    from stepscope.listeners.live import LiveView
    from stepscope.listeners.profiler import Profiler
    from stepscope.recording.protocols import Run



class SlowStepDetector:
    """Median + k·MAD over a running window, with a minimum slowdown and patience.

    The baseline is recomputed every few steps, not every step, to keep the per-step cost
    to an append and a comparison.
    """

    REFRESH = 5

    def __init__(self, cfg: AutoProfileConfig) -> None:
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.median_ms = 0.0
        self.mad_ms = 0.0
        self.threshold_ms = float("inf")
        self._since_refresh = self.REFRESH
        self._run = 0

    def update(self, step_ms: float) -> dict[str, Any] | None:
        """Add one step time; returns the trigger's numbers when it completes a slow run."""
        cfg = self.cfg
        hit: dict[str, Any] | None = None
        if len(self.history) >= cfg.min_history:
            if self._since_refresh >= self.REFRESH:
                self._refresh()
            if step_ms > self.threshold_ms:
                self._run += 1
                if self._run >= cfg.patience:
                    self._run = 0
                    hit = {
                        "step_ms": round(step_ms, 3),
                        "baseline_ms": round(self.median_ms, 3),
                        "mad_ms": round(self.mad_ms, 3),
                        "threshold_ms": round(self.threshold_ms, 3),
                        "reason": (
                            f"{cfg.patience} step(s) over {self.threshold_ms:.1f} ms "
                            f"(median {self.median_ms:.1f} ms + {cfg.k:g}*MAD, at least "
                            f"{cfg.min_slowdown:.0%} slower); last {step_ms:.1f} ms"
                        ),
                    }
            else:
                self._run = 0
        self.history.append(step_ms)
        self._since_refresh += 1
        return hit

    def reset_run(self) -> None:
        self._run = 0

    def _refresh(self) -> None:
        self._since_refresh = 0
        h = list(self.history)
        med = median(h)
        spread = mad(h, med)
        self.median_ms, self.mad_ms = med, spread
        self.threshold_ms = max(med + self.cfg.k * MAD_SCALE * spread, med * (1.0 + self.cfg.min_slowdown))


class _Capture:
    __slots__ = ("info", "prof", "remaining", "window")

    def __init__(self, prof: Profiler, info: dict[str, Any], window: tuple[int, int], remaining: int):
        self.prof = prof
        self.info = info
        self.window = window
        self.remaining = remaining


class AutoProfiler:
    """Watches step times on the training thread and drives one capture at a time."""

    def __init__(self, tracer: Run, cfg: AutoProfileConfig, view: LiveView | None = None) -> None:
        self.tracer = tracer
        self.cfg = cfg
        self.detector = SlowStepDetector(cfg)
        self.view = view
        self.out_dir = Path(tracer.config.out_dir)
        #: Trigger lines written so far (also in ``triggers.jsonl``).
        self.triggers: list[dict[str, Any]] = []
        self.captures = 0
        self.last_trigger_step = -1
        self._capture: _Capture | None = None
        self._cooldown_until = -1
        self._last_ns: int | None = None
        self._skip_next = False
        # Set on the writer thread from the live exchange, taken on the training thread.
        self._healthy_request: dict[str, Any] | None = None
        self._seen: dict[int, int] = {}
        if view is not None:
            view.payload_extras.append(self._payload)
            view.gather_callbacks.append(self._on_gather)

    # -- training thread

    def on_step_end(self, tracer: Run, step: int) -> None:
        try:
            now = time.perf_counter_ns()
            last, self._last_ns = self._last_ns, now
            if self._capture is not None:
                self._advance(step)
                return
            if self._skip_next or last is None:
                # The step after a capture carries the trace export: not a baseline step.
                self._skip_next = False
                return
            request, self._healthy_request = self._healthy_request, None
            if request is not None and self._may_capture(step):
                self._arm(step, "healthy", request)
                return
            hit = self.detector.update((now - last) / 1e6)
            if hit is None:
                return
            if not self._may_capture(step):
                return
            hit["trigger_ranks"] = [tracer.rank.rank]
            self.last_trigger_step = step
            self._arm(step, "affected", hit)
        except Exception as exc:  # protect the job: profiling is optional, training is not
            tracer.fail(exc)

    def on_finish(self, tracer: Run) -> None:
        cap, self._capture = self._capture, None
        if cap is not None:
            cap.prof.stop()  # writes what the window recorded so far
            self._record(cap, "incomplete")

    def _may_capture(self, step: int) -> bool:
        return self.captures < self.cfg.max_captures and step >= self._cooldown_until

    def _arm(self, step: int, role: str, info: dict[str, Any]) -> None:
        cfg = self.cfg
        self._cooldown_until = step + 1 + cfg.warmup + cfg.steps + cfg.cooldown
        window = (step + 1 + cfg.warmup, step + 1 + cfg.warmup + cfg.steps)
        user = self.tracer.profiler
        if user is not None and user.enabled and user.step_num < user.end_step:
            # torch.profiler allows one session per process; the user's window wins.
            self._write({**self._base(step, role, info, window), "trace": None, "status": "skipped",
                         "note": "a profile_steps window is active on this rank"})
            return
        self.captures += 1
        prof = Profiler(
            self.out_dir / "traces" / "auto" / f"step{step:06d}",
            start_step=cfg.warmup,
            end_step=cfg.warmup + cfg.steps,
            warmup=cfg.warmup,
            device=self.tracer.cuda_device,
        )
        # Starting torch.profiler costs this one step some milliseconds; it is rare and bounded.
        prof.start()
        self._capture = _Capture(prof, self._base(step, role, info, window), window,
                                 cfg.warmup + cfg.steps)

    def _advance(self, step: int) -> None:
        cap = self._capture
        assert cap is not None
        # The tracer's own profiler (if any) was stepped before the callbacks; this is ours.
        cap.prof.step()
        cap.remaining -= 1
        if cap.remaining > 0:
            return
        self._capture = None
        self._skip_next = True
        self.detector.reset_run()
        cap.prof.stop()
        self._record(cap, "captured" if cap.prof.trace_path.exists() else "failed")

    def _base(self, step: int, role: str, info: dict[str, Any], window: tuple[int, int]) -> dict[str, Any]:
        rank = self.tracer.rank.rank
        note = info.get("note")
        if note is None and role == "affected":
            note = ("a healthy rank captures the same number of steps after the next live exchange, "
                    "if one did not trigger" if self.view is not None and self.cfg.compare_healthy
                    else "single process: no healthy rank to compare with")
        return {
            "schema": TRIGGERS_SCHEMA,
            "run_id": self.tracer.run_id,
            "role": role,
            "step": step,
            "trigger_step": info.get("trigger_step", step),
            "rank": rank,
            "trigger_ranks": info.get("trigger_ranks", [rank]),
            "reason": info["reason"],
            "baseline_ms": info.get("baseline_ms"),
            "mad_ms": info.get("mad_ms"),
            "threshold_ms": info.get("threshold_ms"),
            "step_ms": info.get("step_ms"),
            "window": list(window),
            "note": note,
            "unix_ns": time.time_ns(),
        }

    def _record(self, cap: _Capture, status: str) -> None:
        trace = cap.prof.trace_path
        rel = os.path.relpath(trace, self.out_dir) if trace.exists() else None
        self._write({**cap.info, "trace": rel, "status": status})

    def _write(self, line: dict[str, Any]) -> None:
        self.triggers.append(line)
        path = self.out_dir / TRIGGERS_FILE
        data = (json.dumps(line) + "\n").encode()

        def job() -> list[dict[str, Any]]:
            # One append per line: ranks share the file; O_APPEND keeps lines whole locally.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            return []

        # File I/O belongs on the writer thread, not the training loop.
        self.tracer.submit_background(job)

    # -- writer thread (live exchange)

    def _payload(self) -> dict[str, Any]:
        return {"ap": [self.last_trigger_step, int(self._capture is not None)]}

    def _on_gather(self, payloads: list[dict[str, Any] | None]) -> None:
        """Pick one healthy rank for each new trigger; every rank decides alike from the
        same gathered data, and only the chosen one arms itself."""
        got = [p for p in payloads if p]
        new: list[tuple[int, int]] = []
        for p in got:
            ap = p.get("e", {}).get("ap")
            if ap and ap[0] >= 0 and self._seen.get(p["r"], -1) < ap[0]:
                self._seen[p["r"]] = ap[0]
                new.append((ap[0], p["r"]))
        if not new or not self.cfg.compare_healthy:
            return
        step = max(t for t, _ in new)
        recent = {r for r, t in self._seen.items() if t >= step - self.cfg.cooldown}
        healthy = [p for p in got if p["r"] not in recent and not p.get("e", {}).get("ap", [0, 0])[1]]
        if not healthy:
            return
        chosen = min(healthy, key=lambda p: (p["m"], p["r"]))["r"]
        if chosen != self.tracer.rank.rank:
            return
        ranks = sorted(r for _, r in new)
        self._healthy_request = {
            "trigger_ranks": ranks,
            "trigger_step": step,
            "reason": f"healthy-rank comparison for rank(s) {ranks} that triggered at step {step}",
            "note": f"trigger step {step}; this rank had not triggered",
        }


_warmed = False  # torch.profiler's first start in a process loads and initialises CUPTI


def warm_profiler(device: DeviceSpec = None) -> bool:
    """Start and stop one empty ``torch.profiler`` session now, once per process.

    The first profiler start in a process loads libcupti and initialises Kineto (seconds on a
    GPU); later starts reuse them. Paid mid-run by the one rank that triggered, it stalled
    every other rank at its next collective, and again when the healthy rank started its own
    capture. Paid at init, every rank pays it at once while the ranks are starting up anyway,
    so no rank waits on another. False when skipped (done already, or a profiler is running).
    """
    global _warmed
    if _warmed:
        return False
    import torch
    from torch.profiler import ProfilerActivity, profile

    if torch.autograd.profiler._is_profiler_enabled:  # the user's session: never disturb it
        return False
    _warmed = True
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with warnings.catch_warnings(), on_device(device):
        warnings.simplefilter("ignore")  # an empty session warns about its empty trace
        prof = profile(activities=activities)
        prof.start()
        prof.stop()  # synchronises the current device: ``device``, not GPU 0
    return True


def attach_autoprofile(tracer: Run) -> AutoProfiler:
    """Start anomaly-triggered profiling on ``tracer`` (called when the tracer is built)."""
    cfg = resolve_auto_profile(tracer.config.auto_profile)
    assert cfg is not None, "attach_autoprofile is only called when auto_profile is set"
    try:
        warm_profiler(tracer.cuda_device)
    except Exception as exc:  # protect the job: a cold first capture is slower, nothing worse
        tracer.warn(f"could not warm up torch.profiler at init: {exc!r}", key="warm-profiler")
    view = None
    if cfg.compare_healthy:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The side group exists only if the ranks agreed on it at init (dist.agree_at_init).
            view = attach_live(tracer)
            if not view.distributed:
                view = None
    ap = AutoProfiler(tracer, cfg, view)
    tracer.autoprofile = ap
    tracer.add_listener(ap)
    return ap
