"""Heartbeat: each rank's ``rank{R}.status.json``, rewritten off the training thread.

A daemon thread wakes every ``heartbeat_s`` seconds, reads the tracer's :meth:`state`
snapshot (plain values: no clock, no CUDA call) and atomically replaces the status file, so
``stepscope status`` can tell, while a job hangs or after it died, where every rank was.

Crash evidence goes to the same file, synchronously and bounded:

* an exception leaving ``step()``: state ``crashed`` with the step, the open phase stack and
  the exception's type and message (the exception itself propagates untouched; a later step
  on the same tracer means the user caught it, and the state returns to ``running``);
* SIGTERM: only when the handler is still the default one and ``init()`` ran on the main
  thread, a handler writes the state, finishes the tracer within ``TERM_FLUSH_S`` (on a
  helper thread, abandoned past the deadline), then restores the default action and
  re-sends the signal, so the process still dies of SIGTERM. Python runs signal handlers
  only when the main thread returns to the interpreter, which a rank blocked in a
  collective does not do until the collective times out (minutes); so a watcher thread,
  woken through ``signal.set_wakeup_fd``, does the same at once;
* interpreter exit (``finish()`` through ``atexit``): ``finished``, or ``crashed`` when an
  uncaught exception is ending the interpreter.

SIGKILL leaves the last heartbeat (state ``running``); the reader calls that rank dead.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from stepscope.listeners.export.flight_dump import dump_flight_recorder
from stepscope.recording.schema import HEARTBEAT_KIND as KIND
from stepscope.recording.schema import HEARTBEAT_MAX_MESSAGE as MAX_MESSAGE
from stepscope.recording.schema import HEARTBEAT_SCHEMA as SCHEMA
from stepscope.recording.sinks import write_json_atomic, yield_on_wake

if TYPE_CHECKING:
    from stepscope.recording.protocols import Run

#: How long a crash write waits for the heartbeat thread's lock before writing anyway.
LOCK_TIMEOUT_S = 2.0
#: How long SIGTERM waits for the tracer to flush before the process dies anyway (seconds).
TERM_FLUSH_S = 2.0


def status_path(out_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.status.json"


def stacks_path(out_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.stacks.txt"


def thread_label(ident: int | None) -> str:
    """A thread id spelled as ``faulthandler`` prints it (``0x`` + 16 hex digits)."""
    return f"0x{(ident or 0):016x}"


def describe_error(exc_type: type | None, exc: BaseException | None) -> tuple[str, str]:
    """``(type name, message)`` of an exception, never raising (``str(exc)`` may)."""
    name = getattr(exc_type, "__name__", None) or type(exc).__name__
    try:
        message = str(exc) if exc is not None else ""
    except Exception:  # protect the job: a broken __str__ must not hide the crash
        message = "<unprintable>"
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "…"
    return name, message


class Heartbeat:
    """Writes ``rank{R}.status.json`` every ``interval_s`` and the final state on a crash.

    Example::

        hb = Heartbeat(tracer, interval_s=5.0)   # usually via Config(heartbeat_s=5)
        hb.start()
        ...
        hb.on_finish(tracer)
    """

    def __init__(
        self,
        tracer: Run,
        interval_s: float,
        dump_stacks_after_s: float | None = None,
    ) -> None:
        self.tracer = tracer
        self.interval_s = float(interval_s)
        self.dump_after_s = dump_stacks_after_s
        out_dir = tracer.config.out_dir
        self.path = status_path(out_dir, tracer.rank.rank)
        self.stacks = stacks_path(out_dir, tracer.rank.rank)
        self.pid = os.getpid()
        self.started = time.time()
        self.failures = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._final: dict[str, Any] | None = None
        self._last_error: dict[str, Any] | None = None
        self._dumped: tuple[int, bool] | None = None
        self._dump_info: dict[str, Any] | None = None
        self._prev_sigterm: Any = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._terminating = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="stepscope-heartbeat", daemon=True)

    # ------------------------------------------------------------ writer thread

    def start(self) -> None:
        self._tick()
        self._thread.start()

    def _run(self) -> None:
        yield_on_wake()  # its timer wakes must not take the CPU from the training thread
        while not self._stop.wait(self.interval_s):
            self._tick()

    def _tick(self) -> None:
        try:
            st = self.tracer.state()
            self._caught(st)
            self._maybe_dump(st)
            self._write(self._payload(st))
        except Exception:  # protect the job: a vanished out_dir must not kill the thread
            self.failures += 1

    def _payload(self, st: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        final = self._final
        if final is not None:
            return {**final, "updated_unix": now}
        since = st["phase_started"] or st["step_started"] or st["last_step_end"] or self.started
        # The step index changes at step exit: "on this step since" is the last exit.
        step_since = st["step_started"] if st["in_step"] else (st["last_step_end"] or self.started)
        info = self.tracer.rank
        return {
            "kind": KIND,
            "schema": SCHEMA,
            "run_id": self.tracer.run_id,
            "rank": info.rank,
            "world_size": info.world_size,
            "host": info.hostname,
            "pid": self.pid,
            "interval_s": self.interval_s,
            "started_unix": self.started,
            "updated_unix": now,
            "state": "running",
            "step": st["step"],
            "in_step": st["in_step"],
            "phase_stack": list(st["phase_stack"]),
            "phase_since_unix": since,
            "step_since_unix": step_since,
            "in_phase_s": round(max(0.0, now - since), 3),
            "last_step": st["last_step"],
            "last_step_unix": st["last_step_end"],
            "last_step_s": None if st["last_step_s"] is None else round(st["last_step_s"], 6),
            "timing_enabled": st["enabled"],
            # Steps lost that no written record counts (a full disk, timing off): the report
            # and `stepscope status` add them to the records' own counts.
            "lost": dict(st.get("lost") or {}),
            "collective": st.get("collective"),
            "error": None,
            "last_error": self._last_error,
            "stacks": self._dump_info,
        }

    def _write(self, payload: dict[str, Any]) -> None:
        if os.getpid() != self.pid:
            return  # a forked child (a DataLoader worker) must not speak for the rank
        locked = self._lock.acquire(timeout=LOCK_TIMEOUT_S)
        try:
            write_json_atomic(self.path, payload)
        finally:
            if locked:
                self._lock.release()

    def _maybe_dump(self, st: dict[str, Any]) -> None:
        if self.dump_after_s is None or self._final is not None:
            return
        since = st["step_started"] if st["in_step"] else st["phase_started"]
        if since is None or time.time() - since < self.dump_after_s:
            return
        key = (int(st["step"]), bool(st["in_step"]))
        if self._dumped == key:
            return  # once per stuck episode
        self._dumped = key
        tmp = self.stacks.with_name(f".{self.stacks.name}.{self.pid}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(
                f"# stepscope stacks: rank {self.tracer.rank.rank} pid {self.pid}, step {st['step']}"
                f" open {time.time() - since:.1f} s, phases {'/'.join(st['phase_stack']) or '-'}\n"
                f"# main thread: {thread_label(threading.main_thread().ident)}\n"
                f"# written at unix {time.time():.3f}\n"
            )
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)
        os.replace(tmp, self.stacks)
        self._dump_info = {"path": self.stacks.name, "step": st["step"], "written_unix": time.time()}
        try:  # [export] PyTorch's Flight Recorder buffer beside the stacks, when the job records one
            dump_flight_recorder(self.stacks.parent, self.tracer.rank.rank)
        except Exception:  # protect the job: the stacks are written; the heartbeat goes on
            self.failures += 1

    # ------------------------------------------------------------ training thread

    def _caught(self, st: dict[str, Any]) -> None:
        """A step ended after the one that raised: the training loop caught the exception
        and went on, so it was not a crash. Decided here, on the heartbeat thread (each tick)
        and at finish, not at every step end: the file says ``running`` again at the tick
        after that step, as before, and no step boundary pays for the check."""
        final = self._final
        if final is None:
            return
        err = final.get("error") or {}
        last = st.get("last_step")
        if err.get("where") == "step" and last is not None and last > err.get("step", last):
            self._last_error = err
            if self._final is final:  # not replaced meanwhile by a later crash
                self._final = None

    def on_exception(
        self, tracer: Run, exc_type: type, exc: BaseException, phase_stack: list[str]
    ) -> None:
        st = tracer.state()
        self._crash(st, exc_type, exc, phase_stack, where="step")

    def on_finish(self, tracer: Run) -> None:
        """At ``finish()`` (explicit or at exit): stop the thread, write the final state."""
        self._stop.set()
        self._restore_sigterm()
        st = tracer.state()
        self._caught(st)
        if self._final is None:
            # An uncaught exception ending the interpreter is visible here (atexit runs after
            # the traceback is printed); an explicit finish() has none.
            last = getattr(sys, "last_value", None)
            if last is not None and not isinstance(last, SystemExit):
                self._crash(st, type(last), last, list(st["phase_stack"]), where="exit")
            else:
                payload = self._payload(st)
                payload["state"] = "finished"
                self._final = payload
                self._write(payload)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.interval_s))

    def on_closed(self, run: Run) -> None:
        """After the last record was written (or not): the final file with the final losses."""
        final = self._final
        if final is None:
            return
        lost = run.unrecorded_losses()
        if lost != final.get("lost"):
            self._final = {**final, "lost": lost}
            try:
                self._write(self._final)
            except Exception:  # protect the job: a full disk may refuse this write too
                self.failures += 1

    def _crash(
        self,
        st: dict[str, Any],
        exc_type: type | None,
        exc: BaseException | None,
        phase_stack: list[str],
        where: str,
        type_name: str | None = None,
        message: str | None = None,
    ) -> None:
        name, msg = describe_error(exc_type, exc) if type_name is None else (type_name, message or "")
        step = int(st["step"])
        self._final = None  # the latest cause wins (a SIGTERM after a caught exception)
        payload = self._payload({**st, "phase_stack": phase_stack})
        payload["state"] = "crashed"
        payload["phase_stack"] = list(phase_stack)
        payload["error"] = {
            "type": name,
            "message": msg,
            "step": step,
            "phase_stack": list(phase_stack),
            "where": where,
            "unix": time.time(),
        }
        self._final = payload
        self._write(payload)

    # ------------------------------------------------------------ SIGTERM

    def install_sigterm(self) -> bool:
        """Install the SIGTERM handler if SIGTERM still has its default action (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return False  # the job (or its launcher) handles SIGTERM: leave it alone
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        except (ValueError, OSError):  # not the main interpreter, or no SIGTERM here
            return False
        self._start_watcher()
        return True

    def _start_watcher(self) -> None:
        """Wake a thread on SIGTERM even while the main thread is blocked in C (a collective)."""
        try:
            recv, send = socket.socketpair()
            send.setblocking(False)
            old = signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError, AttributeError):  # no wakeup fd here: the handler alone
            return
        if old != -1:  # someone else (asyncio) reads the wakeup fd: leave it theirs
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(old)
            recv.close()
            send.close()
            return
        self._wakeup = (recv, send)
        threading.Thread(target=self._watch, args=(recv, send), name="stepscope-sigterm",
                         daemon=True).start()

    def _watch(self, recv: socket.socket, send: socket.socket) -> None:
        try:
            while True:
                data = recv.recv(64)
                if not data or 0 in data:  # closed, or the stop byte from _restore_sigterm
                    return
                if signal.SIGTERM in data and os.getpid() == self.pid:
                    self._terminate(signal.SIGTERM)
        except OSError:  # closed under us at finish: nothing left to watch
            return
        finally:
            recv.close()
            send.close()

    def _restore_sigterm(self) -> None:
        if self._prev_sigterm is None or threading.current_thread() is not threading.main_thread():
            return
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._prev_sigterm = None
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            with contextlib.suppress(ValueError, OSError):
                old = signal.set_wakeup_fd(-1)
                if old not in (-1, wakeup[1].fileno()):
                    signal.set_wakeup_fd(old)  # someone else's since: leave it theirs
            with contextlib.suppress(OSError):
                wakeup[1].send(b"\0")  # stops the watcher, which closes both ends

    def _after_fork_in_child(self) -> None:
        # A forked child (a DataLoader worker) must not write its signals into the parent's
        # watcher socket: a worker's SIGTERM would kill the rank.
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is None:
            return
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        for sock in wakeup:
            with contextlib.suppress(OSError):
                sock.close()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:
            # Inherited by a forked child (a DataLoader worker being shut down): just die.
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._terminate(signum)

    def _terminate(self, signum: int) -> None:
        """Record the signal, flush within ``TERM_FLUSH_S``, then die of SIGTERM (any thread)."""
        if not self._terminating.acquire(blocking=False):
            # The watcher thread or the main thread is already on it; it ends the process.
            time.sleep(TERM_FLUSH_S + LOCK_TIMEOUT_S + 1.0)
            _die()
            return
        try:
            st = self.tracer.state()
            self._crash(
                st, None, None, list(st["phase_stack"]), where="signal",
                type_name="SIGTERM", message=f"terminated by signal {signum} (SIGTERM)",
            )
            # Finishing can wait on a peer (the live exchange) or the disk: never past the
            # deadline. The main thread is stopped here or blocked in C, so nothing races it.
            done = threading.Thread(target=self.tracer.finish, name="stepscope-term-flush", daemon=True)
            done.start()
            done.join(TERM_FLUSH_S)
        except Exception:  # protect the job: the process must still die of SIGTERM
            pass
        _die()


def _die() -> None:
    """The default action of SIGTERM, now: the process ends as if stepscope were not there."""
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    elif not _default_action_from_any_thread():
        os._exit(128 + signal.SIGTERM)  # the shell's spelling of "killed by SIGTERM"
    os.kill(os.getpid(), signal.SIGTERM)
    # Delivery is asynchronous when another thread takes it; do not run on meanwhile.
    time.sleep(5.0)
    os._exit(128 + signal.SIGTERM)


def _default_action_from_any_thread() -> bool:
    """Reset SIGTERM to its default action through libc (``signal.signal`` is main-thread only)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        return bool(libc.signal(int(signal.SIGTERM), None) != ctypes.c_void_p(-1).value)
    except Exception:  # no libc through ctypes here: the caller exits with status 143 instead
        return False


# Heartbeats whose SIGTERM watcher a forked child must disconnect (one fork hook per process).
_FORK_WATCH: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for hb in list(_FORK_WATCH):
        hb._after_fork_in_child()


with contextlib.suppress(AttributeError):  # no fork on this platform
    os.register_at_fork(after_in_child=_after_fork_in_child)


def attach_heartbeat(tracer: Run) -> Heartbeat:
    """Start the heartbeat for ``tracer`` (wired by :func:`stepscope.tracer.wire` when
    ``heartbeat_s`` > 0)."""
    cfg = tracer.config
    hb = Heartbeat(tracer, cfg.heartbeat_s, cfg.dump_stacks_after_s)
    tracer.add_listener(hb)
    if hb.install_sigterm():
        _FORK_WATCH.add(hb)
    hb.start()
    return hb
