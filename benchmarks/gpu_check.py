"""GPU check: what only a real CUDA device can confirm, in one run of at most 8 minutes.

    make gpu-check-prepare        # where a package index is reachable: wheels into .gpu-wheels/
    make gpu-check                # on the GPU machine: offline install, then this script
    make gpu-check DRY=1          # anywhere: every check's code path on CPU tensors, tiny sizes
    python benchmarks/gpu_check.py [--dry-run] [--record [PATH]] [--only NAME ...]

Prints one JSON line per check, ``{"check": name, "ok": bool, "device": ..., figures...}``:

- ``sync_debug``: a 200-step training run (an MLP, SGD) with every step recorded under
  ``torch.cuda.set_sync_debug_mode("error")``: any host sync inside the loop raises; the run
  must finish with no exception, no ``StepscopeWarning`` and 200 records on disk (dry: 20
  steps, without the sync debug mode, which needs CUDA).
- ``run_ahead``: steps that each run a GPU sleep kernel (``torch.cuda._sleep``, ~20 ms)
  inside a phase, recorded: the host must enqueue them in well under the GPU's time, and the
  recorded phase must be the kernel's GPU time.
- ``overhead_3ms`` / ``overhead_30ms``: wall time per step of a GPU-bound MLP step sized to
  ~3 and ~30 ms, bare / every step recorded / one step in 10 recorded, in interleaved blocks
  (medians over blocks).
- ``records``: every step of the runs above is on disk, once, and for every record the
  top-level phases plus ``residual_ms`` equal ``step_ms``.
- ``prefetch``: PrefetchLoader over pinned batches against a plain loop that copies with
  ``.to(device, non_blocking=True)`` inside the step: the share of the copy hidden
  (``h2d_hidden_ms`` / ``side_ms.h2d_copy``) and the step time of both.
- ``profiler_trace``: a ``profile_steps`` window captured through stepscope, analysed by
  ``python -m stepscope trace DIR --json``.

A ``summary`` line ends the run. Each check has its own time limit and the whole run a
budget (``--budget-s``, 450 s): a check that runs out prints what it has with
``"timed_out": true``; past the budget a watchdog prints the partial results and exits 3.
Without CUDA (and without ``--dry-run``) it prints one line to stderr and exits 2. In dry
mode every line says ``"device": "dry-run"`` and ``"measured": false``: ``ok`` then means
only that the check's code ran end to end; its GPU criterion is evaluated on CPU figures
(``criterion_met``) and means nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECORD = ROOT / "benchmarks" / "results" / "gpu_check.json"

# stepscope's runtime dependencies other than torch: import name -> the distributions to
# install when it is missing (rich's own dependencies with it). tests/unit/test_gpu_check_dry.py
# checks this against pyproject.toml.
RUNTIME_DEPS: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy",),
    "rich": ("rich", "markdown-it-py", "mdurl", "pygments"),
    "duckdb": ("duckdb",),
    "ijson": ("ijson",),
    "msgspec": ("msgspec",),
    "orjson": ("orjson",),
    "psutil": ("psutil",),
}

# Per-check time limits (s); their sum is the default budget.
LIMITS_S = {
    "sync_debug": 60.0,
    "run_ahead": 30.0,
    "overhead_3ms": 60.0,
    "overhead_30ms": 90.0,
    "records": 30.0,
    "prefetch": 90.0,
    "profiler_trace": 90.0,
}
CHECKS = tuple(LIMITS_S)
DRY_NOTE = "dry run: CPU tensors, tiny sizes; nothing was measured on a GPU"


def missing_dists() -> list[str]:
    """Distributions to install for the runtime dependencies this Python cannot import."""
    out: list[str] = []
    for module, dists in RUNTIME_DEPS.items():
        if importlib.util.find_spec(module) is None:
            out.extend(dists)
    return out


class Deadline:
    """A time limit: ``left()`` seconds remain; ``expired()`` once they are gone."""

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return self._end - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0


class CheckTimeout(Exception):
    """A check ran past its own time limit; the figures gathered so far are kept."""


class Env:
    """What every check needs: the device, the sizes for this mode, a scratch directory."""

    def __init__(self, dry: bool, scratch: Path) -> None:
        import torch

        self.torch = torch
        self.dry = dry
        self.scratch = scratch
        self.device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
        self.device_name = "dry-run" if dry else torch.cuda.get_device_name(self.device)
        # Run directories whose records the ``records`` check verifies: (label, dir, steps).
        self.runs: list[tuple[str, Path, list[int]]] = []

    def sync(self) -> None:
        if not self.dry:
            self.torch.cuda.synchronize(self.device)

    def run_dir(self, label: str) -> Path:
        d = self.scratch / label
        if d.exists():
            shutil.rmtree(d)
        return d


# ---------------------------------------------------------------- workloads


def make_mlp(env: Env, width: int, depth: int) -> tuple[Any, Any]:
    torch = env.torch
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(env.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    return model, opt


def train_step(model: Any, opt: Any, x: Any) -> None:
    """Forward, backward, optimizer: no host sync of its own (no ``.item()``)."""
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed_block(env: Env, n: int, body: Callable[[int], None]) -> float:
    """Wall ms per step of ``n`` calls of ``body``, the device idle at both ends."""
    env.sync()
    t0 = time.perf_counter()
    for i in range(n):
        body(i)
    env.sync()
    return (time.perf_counter() - t0) * 1e3 / n


@contextlib.contextmanager
def recording(out_dir: Path, **kwargs: Any) -> Iterator[Any]:
    """stepscope recording into ``out_dir`` for the block; finished (records flushed) after."""
    import stepscope

    tracer = stepscope.init(out_dir=str(out_dir), flush_every_n_steps=10, **kwargs)
    try:
        yield tracer
    finally:
        stepscope.finish()


def read_records(out_dir: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for f in sorted(out_dir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


# ---------------------------------------------------------------- checks


def check_sync_debug(env: Env, dl: Deadline, fig: dict[str, Any]) -> bool:
    import stepscope

    torch = env.torch
    steps = 20 if env.dry else 200
    width, batch = (64, 16) if env.dry else (1024, 256)
    model, opt = make_mlp(env, width, 4)
    xs = [torch.randn(batch, width, device=env.device) for _ in range(4)]
    out = env.run_dir("sync_debug")
    done: list[int] = []
    fig.update(steps=steps, sync_debug_mode="unavailable on CPU" if env.dry else "error")
    with warnings.catch_warnings(record=True) as caught, recording(out, model=model, optimizer=opt):
        warnings.simplefilter("always")
        if not env.dry:
            torch.cuda.set_sync_debug_mode("error")
        t0 = time.perf_counter()
        try:
            for i in range(steps):
                if dl.expired():
                    raise CheckTimeout
                with stepscope.step():
                    train_step(model, opt, xs[i % len(xs)])
                done.append(i)
        except CheckTimeout:
            raise
        except Exception as e:  # a sync under "error" mode: report where it came from
            frames = traceback.extract_tb(e.__traceback__)
            fig["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            fig["error_in_stepscope"] = any("stepscope" in fr.filename for fr in frames)
            fig["error_at"] = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else None
        finally:
            if not env.dry:
                torch.cuda.set_sync_debug_mode(0)
            fig["host_ms_per_step"] = round((time.perf_counter() - t0) * 1e3 / max(1, len(done)), 4)
            fig["steps_done"] = len(done)
            env.runs.append(("sync_debug", out, list(done)))
    ours = [str(w.message) for w in caught if w.category.__name__ == "StepscopeWarning"]
    fig["stepscope_warnings"] = ours[:3]
    fig["records_on_disk"] = len(read_records(out))
    return "error" not in fig and not ours and fig["records_on_disk"] == steps


def check_run_ahead(env: Env, dl: Deadline, fig: dict[str, Any]) -> bool:
    import stepscope

    torch = env.torch
    steps, sleep_ms = 10, 20.0
    if env.dry:
        # No sleep kernel on CPU: a small matmul stands in so the code path runs.
        w = torch.randn(64, 64)

        def kernel() -> None:
            w @ w

        fig["kernel"] = "cpu matmul (stand-in)"
    else:
        probe = 20_000_000
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        cycles = int(probe * sleep_ms / max(start.elapsed_time(end), 1e-3))

        def kernel() -> None:
            torch.cuda._sleep(cycles)

        fig.update(kernel="torch.cuda._sleep", cycles=cycles)
    out = env.run_dir("run_ahead")
    done: list[int] = []
    with recording(out):
        for i in range(2):  # the first steps set up events and streams
            with stepscope.step(), stepscope.phase("sleep"):
                kernel()
            done.append(i)
        env.sync()
        t0 = time.perf_counter()
        for i in range(2, 2 + steps):
            if dl.expired():
                raise CheckTimeout
            with stepscope.step(), stepscope.phase("sleep"):
                kernel()
            done.append(i)
        host_ms = (time.perf_counter() - t0) * 1e3
        env.sync()
        total_ms = (time.perf_counter() - t0) * 1e3
    env.runs.append(("run_ahead", out, done))
    phase_ms = [
        p["ms"] for r in read_records(out) if r["step"] >= 2 for p in r["phases"] if p["path"] == "sleep"
    ]
    fig.update(
        steps=steps,
        sleep_ms_target=None if env.dry else sleep_ms,
        host_ms_to_enqueue=round(host_ms, 3),
        total_ms=round(total_ms, 3),
        host_share=round(host_ms / total_ms, 4) if total_ms else None,
        sleep_phase_ms_median=median(phase_ms),
        criterion="host_ms_to_enqueue < 0.5 x total_ms and the recorded sleep phase within 20% of the kernel",
    )
    m = fig["sleep_phase_ms_median"]
    return host_ms < 0.5 * total_ms and m is not None and abs(m - sleep_ms) <= 0.2 * sleep_ms


def check_overhead(env: Env, dl: Deadline, fig: dict[str, Any], target_ms: float) -> bool:
    import stepscope

    torch = env.torch
    name = f"overhead_{int(target_ms)}ms"
    width, depth = (64, 2) if env.dry else (2048, 4)
    model, opt = make_mlp(env, width, depth)
    # Size the batch so one bare step takes about target_ms (dry: a fixed tiny batch).
    batch = 8
    if not env.dry:
        probe = 512
        x = torch.randn(probe, width, device=env.device)
        timed_block(env, 3, lambda _i: train_step(model, opt, x))
        ms = timed_block(env, 5, lambda _i: train_step(model, opt, x))
        batch = int(min(65536, max(8, probe * target_ms / max(ms, 1e-3))))
    x = torch.randn(batch, width, device=env.device)
    n = (6 if env.dry else max(10, int(300 / target_ms)))
    reps = 2 if env.dry else 7
    variants = ("bare", "every_step", "one_in_10")
    times: dict[str, list[float]] = {v: [] for v in variants}

    def bare(_i: int) -> None:
        train_step(model, opt, x)

    def stepped(_i: int) -> None:
        with stepscope.step():
            train_step(model, opt, x)

    fig.update(target_ms=target_ms, batch=batch, steps_per_block=n)
    blocks = 0
    try:
        for rep in range(reps + 1):  # block set 0 warms up and is not counted
            for k in range(len(variants)):
                if dl.expired():
                    raise CheckTimeout
                v = variants[(k + rep) % len(variants)]  # rotate the order: interleaved
                if v == "bare":
                    ms = timed_block(env, n, bare)
                else:
                    every = 1 if v == "every_step" else 10
                    out = env.run_dir(f"{name}_{v}_{rep}")
                    with recording(out, model=model, optimizer=opt, every_n_steps=every):
                        ms = timed_block(env, n, stepped)
                    env.runs.append((f"{name}_{v}", out, list(range(0, n, every))))
                if rep:
                    times[v].append(ms)
                    blocks += 1
    finally:
        med = {v: median(t) for v, t in times.items()}
        fig.update(blocks=blocks, **{f"{v}_ms": med[v] for v in variants})
        b = med["bare"]
        for v in variants[1:]:
            m = med[v]
            fig[f"{v}_overhead_pct"] = round(100 * (m - b) / b, 3) if b and m is not None else None
    limit = 5.0 if target_ms < 10 else 1.0
    fig.update(limit_pct=limit, criterion=f"every_step_overhead_pct <= {limit}")
    o = fig.get("every_step_overhead_pct")
    return o is not None and o <= limit


def check_records(env: Env, dl: Deadline, fig: dict[str, Any]) -> bool:
    expected = found = missing = duplicates = bad_identity = 0
    max_diff = 0.0
    clocks: set[str] = set()
    negative_residual = 0
    for _label, out, steps in env.runs:
        if dl.expired():
            raise CheckTimeout
        recs = read_records(out)
        seen = [r["step"] for r in recs]
        expected += len(steps)
        found += len(recs)
        missing += len(set(steps) - set(seen))
        duplicates += len(seen) - len(set(seen))
        for r in recs:
            clocks.add(r.get("clock", "?"))
            top = [p for p in r["phases"] if p.get("parent") is None]
            total = sum(p["ms"] for p in top) + r["residual_ms"]
            diff = abs(total - r["step_ms"])
            max_diff = max(max_diff, diff)
            # Each field is rounded to 0.1 us when written; allow that per term, and 0.01%.
            if diff > 1e-4 * (len(top) + 2) + 1e-4 * r["step_ms"]:
                bad_identity += 1
            negative_residual += r["residual_ms"] < 0
    fig.update(
        runs=len(env.runs),
        records_expected=expected,
        records_found=found,
        missing=missing,
        duplicates=duplicates,
        identity_violations=bad_identity,
        max_abs_diff_ms=round(max_diff, 6),
        negative_residuals=negative_residual,
        clocks=sorted(clocks),
        criterion="every expected step on disk once; top-level phases + residual_ms = step_ms",
    )
    clock_ok = env.dry or clocks == {"cuda"}
    complete = found == expected and not missing and not duplicates
    return bool(env.runs) and complete and not bad_identity and clock_ok


def check_prefetch(env: Env, dl: Deadline, fig: dict[str, Any]) -> bool:
    import stepscope

    torch = env.torch
    batch_mib = 0.0625 if env.dry else 64
    distinct, n, reps = (2, 4, 1) if env.dry else (6, 16, 3)
    numel = int(batch_mib * (1 << 20))
    pin = not env.dry
    host = [torch.randint(0, 256, (numel,), dtype=torch.uint8) for _ in range(distinct)]
    if pin:
        host = [t.pin_memory() for t in host]
    loader = [host[i % distinct] for i in range(n)]
    side = 256 if env.dry else 2048
    w = torch.randn(side, side, device=env.device)

    def compute(x: Any, k: int) -> None:
        z = w * x[:1].float().add(1)  # reads the batch: the compute depends on its copy
        z = z + x.float().mean()
        for _ in range(k):
            z = z @ w

    # Reference times: one copy alone, one matmul alone; compute ~1.5x the copy.
    copy_ms = timed_block(env, 3, lambda i: host[i % distinct].to(env.device, non_blocking=True))
    mm_ms = timed_block(env, 5, lambda _i: w @ w)
    k = 1 if env.dry else max(1, int(1.5 * copy_ms / max(mm_ms, 1e-3)))
    xd = host[0].to(env.device)
    compute_ms = timed_block(env, 5, lambda _i: compute(xd, k))
    fig.update(batch_mib=batch_mib, pinned=pin, batches=n, matmuls=k, copy_ms=round(copy_ms, 4),
               compute_ms=round(compute_ms, 4))
    step_ms: dict[str, list[float]] = {"plain": [], "prefetch": []}
    hidden: list[float] = []
    copied: list[float] = []
    for rep in range(reps):
        for v in (("plain", "prefetch") if rep % 2 == 0 else ("prefetch", "plain")):
            if dl.expired():
                raise CheckTimeout
            out = env.run_dir(f"prefetch_{v}_{rep}")
            with recording(out):
                env.sync()
                t0 = time.perf_counter()
                if v == "plain":
                    for b in loader:
                        with stepscope.step():
                            compute(b.to(env.device, non_blocking=True), k)
                else:
                    for b in stepscope.PrefetchLoader(loader):
                        with stepscope.step():
                            compute(b, k)
                env.sync()
                step_ms[v].append((time.perf_counter() - t0) * 1e3 / n)
            env.runs.append((f"prefetch_{v}", out, list(range(n))))
            if v == "prefetch":
                for r in read_records(out):
                    c = (r.get("side_ms") or {}).get("h2d_copy")
                    if r["step"] >= 1 and c:  # batch 0's copy has nothing to hide behind
                        copied.append(c)
                        hidden.append(r.get("h2d_hidden_ms") or 0.0)
    frac = sum(hidden) / sum(copied) if copied else None
    fig.update(
        plain_step_ms=median(step_ms["plain"]),
        prefetch_step_ms=median(step_ms["prefetch"]),
        h2d_copy_ms_median=median(copied),
        h2d_hidden_ms_median=median(hidden),
        hidden_fraction=round(frac, 4) if frac is not None else None,
        criterion="hidden_fraction >= 0.95 (steps 1..) and prefetch_step_ms < plain_step_ms",
    )
    p, q = fig["prefetch_step_ms"], fig["plain_step_ms"]
    return frac is not None and frac >= 0.95 and p is not None and q is not None and p < q


def check_profiler_trace(env: Env, dl: Deadline, fig: dict[str, Any]) -> bool:
    import stepscope

    torch = env.torch
    width, batch = (64, 16) if env.dry else (1024, 512)
    model, opt = make_mlp(env, width, 4)
    x = torch.randn(batch, width, device=env.device)
    out = env.run_dir("profiler_trace")
    window = (3, 6)
    with recording(out, model=model, optimizer=opt, profile_steps=window):
        for _ in range(8):
            if dl.expired():
                raise CheckTimeout
            with stepscope.step():
                train_step(model, opt, x)
    env.runs.append(("profiler_trace", out, list(range(8))))
    traces = out / "traces"
    files = sorted(traces.glob("*.json*")) if traces.is_dir() else []
    fig.update(profile_steps=list(window), trace_files=len(files),
               trace_bytes=sum(f.stat().st_size for f in files))
    if not files:
        fig["error"] = "no trace file written"
        return False
    cmd = [sys.executable, "-m", "stepscope", "trace", str(traces), "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, dl.left()))
    except subprocess.TimeoutExpired as e:
        raise CheckTimeout from e
    fig["trace_rc"] = proc.returncode
    if proc.returncode != 0:
        fig["error"] = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1][:300]
        return False
    doc = json.loads(proc.stdout)
    rank = doc["ranks"][0]
    top = rank.get("top_kernels") or []
    fig.update(
        platform=rank.get("platform"),
        steps_in_trace=len(rank.get("steps") or []),
        top_kernel=(top[0].get("name") if top and isinstance(top[0], dict) else None),
        warnings=[str(w) for w in doc.get("warnings", [])][:3],
        criterion="stepscope trace exits 0 and finds the window's 3 steps with GPU activity",
    )
    gpu_ok = env.dry or rank.get("platform") != "cpu"
    return fig["steps_in_trace"] == window[1] - window[0] and gpu_ok


RUNNERS: dict[str, Callable[[Env, Deadline, dict[str, Any]], bool]] = {
    "sync_debug": check_sync_debug,
    "run_ahead": check_run_ahead,
    "overhead_3ms": lambda env, dl, fig: check_overhead(env, dl, fig, 3.0),
    "overhead_30ms": lambda env, dl, fig: check_overhead(env, dl, fig, 30.0),
    "records": check_records,
    "prefetch": check_prefetch,
    "profiler_trace": check_profiler_trace,
}


# ---------------------------------------------------------------- driver


class Results:
    """The lines printed so far; printed once each, recorded at the end or on the watchdog."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        self.args = args
        self.device = device
        self.lines: list[dict[str, Any]] = []
        self.current: str | None = None
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def emit(self, line: dict[str, Any]) -> None:
        with self.lock:
            self.lines.append(line)
            print(json.dumps(line), flush=True)

    def summary(self, budget_exceeded: bool = False) -> None:
        checks = [ln for ln in self.lines if ln["check"] != "summary"]
        self.emit({
            "check": "summary",
            "ok": bool(checks) and all(ln["ok"] for ln in checks) and not budget_exceeded,
            "device": self.device,
            "measured": not self.args.dry_run,
            "checks": len(checks),
            "failed": [ln["check"] for ln in checks if not ln["ok"]],
            "budget_exceeded": budget_exceeded,
            "elapsed_s": round(time.monotonic() - self.t0, 2),
            **({"note": DRY_NOTE} if self.args.dry_run else {}),
        })
        if self.args.record:
            write_record(self.args, self.device, self.lines)


def write_record(args: argparse.Namespace, device: str, lines: list[dict[str, Any]]) -> None:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    record = {
        "benchmark": "gpu_check",
        "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "machine": f"{device}; {platform.node()}; {os.cpu_count()} CPUs; {platform.python_version()}",
        "load": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "measured": not args.dry_run,
        "figures": {ln["check"]: {k: v for k, v in ln.items() if k != "check"} for ln in lines},
    }
    path = Path(args.record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def start_watchdog(results: Results, budget_s: float) -> threading.Timer:
    """Past the budget: print the running check as timed out, the summary, and exit 3."""

    def fire() -> None:
        if results.current is not None:
            results.emit({"check": results.current, "ok": False, "device": results.device,
                          "measured": not results.args.dry_run, "timed_out": True,
                          "error": f"the run's budget of {budget_s:.0f} s ran out during this check"})
        results.summary(budget_exceeded=True)
        sys.stdout.flush()
        os._exit(3)

    timer = threading.Timer(budget_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--dry-run", action="store_true",
                    help="run every check's code path on CPU tensors at tiny sizes; measures nothing")
    ap.add_argument("--record", nargs="?", const=str(DEFAULT_RECORD), default=None, metavar="PATH",
                    help=f"write the lines as a results record (default {DEFAULT_RECORD.relative_to(ROOT)})")
    ap.add_argument("--only", nargs="+", choices=CHECKS, default=None, help="run only these checks")
    ap.add_argument("--budget-s", type=float, default=sum(LIMITS_S.values()),
                    help="the whole run's time limit (s); past it partial results are printed")
    ap.add_argument("--keep", metavar="DIR", default=None,
                    help="write the runs' records and traces under DIR and keep them")
    ap.add_argument("--list-deps", action="store_true",
                    help="print stepscope's runtime dependencies but torch (distribution names) and exit")
    ap.add_argument("--missing-deps", action="store_true",
                    help="print the runtime dependencies this Python lacks (distribution names) and exit")
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be > 0, got {args.budget_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_deps:
        print(" ".join(d for dists in RUNTIME_DEPS.values() for d in dists))
        return 0
    if args.missing_deps:
        print(" ".join(missing_dists()))
        return 0
    missing = missing_dists()
    if missing:
        print(f"gpu_check: missing dependencies {' '.join(missing)}: run `make gpu-check-prepare` where a "
              "package index is reachable, then `make gpu-check` (it installs them offline)", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError as e:
        print(f"gpu_check: cannot import torch ({e}); run it with the Python that has the machine's "
              "CUDA torch (make gpu-check GPU_PYTHON=...)", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
              "nothing to measure. `make gpu-check DRY=1` runs the checks' code on CPU", file=sys.stderr)
        return 2
    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    scratch.mkdir(parents=True, exist_ok=True)
    env = Env(args.dry_run, scratch)
    results = Results(args, env.device_name)
    watchdog = start_watchdog(results, args.budget_s)
    run = Deadline(args.budget_s)
    try:
        for name in args.only or CHECKS:
            fig: dict[str, Any] = {}
            results.current = name
            t0 = time.monotonic()
            ok, extra = False, {}
            try:
                ok = RUNNERS[name](env, Deadline(min(LIMITS_S[name], run.left())), fig)
            except CheckTimeout:
                extra = {"timed_out": True}
            except Exception as e:  # a failing check must not stop the others
                extra = {"error": f"{type(e).__name__}: {e}"[:300]}
            finally:
                with contextlib.suppress(Exception):
                    import stepscope

                    stepscope.finish()
                    if not env.dry:
                        torch.cuda.set_sync_debug_mode(0)
            line: dict[str, Any] = {"check": name, "ok": bool(ok) and not extra, "device": env.device_name,
                                    "measured": not env.dry, **fig, **extra,
                                    "elapsed_s": round(time.monotonic() - t0, 2)}
            if env.dry:
                line["criterion_met"] = line["ok"]
                line["ok"] = not extra
                line["note"] = DRY_NOTE
            results.current = None
            results.emit(line)
        watchdog.cancel()
        results.summary()
    finally:
        watchdog.cancel()
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0 if results.lines[-1]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
