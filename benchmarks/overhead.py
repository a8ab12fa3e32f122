"""Overhead of stepscope on a CPU training loop: bare vs instrumented, interleaved.

Prints one JSON line: median step-time ratio (instrumented / bare) over interleaved
repetitions, and the host cost of the tracer's primitives in µs (a phase open+close, a
step enter+exit, a forward/backward/optimizer hook set) measured in isolation.

    python benchmarks/overhead.py [--reps 15] [--steps 60] [--hidden 768]
    python benchmarks/overhead.py --per-instrument   # µs/step each automatic instrument adds
    python benchmarks/overhead.py --collectives      # collective timing, 2 gloo ranks on CPU

``--collectives`` prints three JSON lines: the host µs a timed collective costs over an
untimed one (2 gloo ranks, tiny ``all_reduce``, sync and async, blocks of calls interleaved;
also on a one-rank group where the network does not add noise), and the step-time ratio with
collective timing on vs off for a DDP and an FSDP2 (``fully_shard``) job on CPU.
    python benchmarks/overhead.py --resources        # throughput and memory read costs
    python benchmarks/overhead.py --resources --record benchmarks/results   # also write a record

``--baseline-src DIR`` (with the default mode or ``--per-instrument``) compares this build with
another one (e.g. ``BASE/src``, a ``git archive`` of another commit) in the same run: two worker
processes, one per build, each importing its own ``stepscope``, run one repetition each in
turn (the order alternating),
so machine drift hits both alike. Each build's ratio is its instrumented over its own bare
loop; the training thread's CPU time (``thread_time``) is reported beside wall time, being less
disturbed by other jobs on a shared machine. ``--noise-floor`` adds a third worker whose
"instrumented" loop is the bare loop again: its ratios are what two identical untraced loops
show when measured the same way (the spread any other ratio must be read against). Each line
carries ``uptime`` at the start and end (other jobs share the machine).

    python benchmarks/overhead.py --reps 31 --steps 60 --hidden 640 \
        --baseline-src BASE/src --noise-floor
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from stepscope.recording.clock import CpuClock
from stepscope.recording.config import Config
from stepscope.tracer import Tracer


def make_job(hidden: int, batch: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = [torch.randn(batch, hidden) for _ in range(8)]
    return model, opt, data


def bare(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor], steps: int) -> float:
    return bare_cpu(model, opt, data, steps)[0]


def bare_cpu(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor], steps: int
) -> tuple[float, float, float]:
    """(wall, training-thread CPU, process CPU) seconds per step of the loop without stepscope."""
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for i in range(steps):
        x = data[i % len(data)].to(torch.float32)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return ((time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps,
            (time.process_time() - p0) / steps)


def instrumented(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor], steps: int, out: str
) -> float:
    return instrumented_cpu(model, opt, data, steps, out)[0]


def instrumented_cpu(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor], steps: int, out: str
) -> tuple[float, float, float]:
    """(wall, training-thread CPU, process CPU) seconds per step with a new tracer (as
    ``init()`` builds it; its writer thread's CPU is in the process CPU)."""
    tracer = Tracer(Config(out_dir=out), model=model, optimizer=opt)
    source = (data[i % len(data)] for i in range(steps))
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for x in tracer.wrap_loader(source):
        with tracer.step():
            x = x.to(torch.float32)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with tracer.phase("metrics"):
                loss.item()
    dt, dc = (time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps
    dp = (time.process_time() - p0) / steps
    tracer.finish()
    return dt, dc, dp


def primitive_costs(n: int = 20000) -> dict[str, float]:
    """µs per call of the tracer's hot-path primitives, CPU clock, memory-free sink."""
    from stepscope.recording.sinks import MemorySink

    tracer = Tracer(Config(out_dir="unused", flush_every_n_steps=100), clock=CpuClock(), sink=MemorySink())
    with tracer.step():
        t0 = time.perf_counter_ns()
        for _ in range(n):
            tracer.close_phase(tracer.open_phase("x"))
        phase_ns = (time.perf_counter_ns() - t0) / n
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with tracer.step():
            pass
    step_ns = (time.perf_counter_ns() - t0) / n
    tracer.finish()
    return {"phase_open_close_us": phase_ns / 1e3, "step_enter_exit_us": step_ns / 1e3}


#: Untimed bare steps before each repetition's timed pair (see ``_serve``); ten times as many
#: for the tiny model of ``--per-instrument``.
WARM_STEPS = 5


def per_instrument(reps: int = 7, steps: int = 1500) -> dict[str, float]:
    """µs per step each automatic instrument adds on a tiny model (minimum over reps).

    The tiny model makes the step ~0.25 ms so that tracer costs stand out of the noise;
    the minimum over repetitions is the least noisy estimate of a fixed added cost.
    """
    one_rep = per_instrument_rep(steps)
    return per_instrument_summary([one_rep() for _ in range(reps)])


def per_instrument_rep(steps: int) -> Any:
    """A function running one repetition: µs per step, bare and with each variant."""
    from stepscope.recording.sinks import MemorySink

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 8)

    def loop(tracer: Tracer | None, n: int = steps) -> tuple[float, float, float]:
        t0, c0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
        for _ in range(n):
            if tracer is None:
                y = x.to(torch.float32)
                model(y).sum().backward()
                opt.step()
                opt.zero_grad()
            else:
                with tracer.step():
                    y = x.to(torch.float32)
                    model(y).sum().backward()
                    opt.step()
                    opt.zero_grad()
        t1, c1, p1 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
        return (t1 - t0) / n / 1e3, (c1 - c0) / n / 1e3, (p1 - p0) / n / 1e3

    def one_rep() -> dict[str, tuple[float, float, float]]:
        loop(None, WARM_STEPS * 10)  # untimed warm-up: see _serve
        got = {"bare": loop(None)}
        for name, auto in PER_INSTRUMENT_VARIANTS.items():
            tracer = Tracer(Config(out_dir="unused", auto=auto), model=model, optimizer=opt,
                            clock=CpuClock(), sink=MemorySink())
            got[name] = loop(tracer)
            tracer.finish()
        return got

    return one_rep


PER_INSTRUMENT_VARIANTS: dict[str, set[str]] = {
    "step_only": set(), "forward": {"forward"}, "forward_backward": {"forward", "backward"},
    "optimizer": {"optimizer"}, "h2d": {"h2d"}, "all": {"forward", "backward", "optimizer", "h2d"},
}


def per_instrument_summary(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """µs/step added over the bare loop, minimum over repetitions: wall, training-thread CPU
    and process CPU (every thread: the writer's record building included)."""
    out: dict[str, Any] = {}
    for i, kind in enumerate(("wall", "thread_cpu", "process_cpu")):
        best = {k: min(r[k][i] for r in reps) for k in reps[0]}
        out[kind] = {f"{k}_added_us": round(v - best["bare"], 1) for k, v in best.items() if k != "bare"}
        out[kind]["bare_step_us"] = round(best["bare"], 1)
    return out


# ------------------------------------------------------------------ --baseline-src


def _serve(args: argparse.Namespace) -> None:
    """Worker side of ``--baseline-src``: one repetition per line read from stdin."""
    if args.per_instrument:
        one = per_instrument_rep(args.steps)
        run: Any = lambda rep: one()  # noqa: E731
    else:
        model, opt, data = make_job(args.hidden, args.batch)
        bare_cpu(model, opt, data, 20)  # warm-up
        out = tempfile.mkdtemp(prefix="stepscope-overhead-")

        # The noise floor: the same loop in place of the instrumented one (no tracer at all).
        second = bare_cpu if args.floor else lambda m, o, d, n: instrumented_cpu(m, o, d, n, out)

        def run(rep: int) -> dict[str, float]:
            # Woken from its read of stdin after another worker ran, this process finds its
            # working set evicted: whichever loop ran first in a repetition paid for the refill
            # (~2% of a 2.6 ms step here, enough to bias a build's ratio by the order it runs
            # in). A few untimed steps first, so both timed loops start warm.
            bare_cpu(model, opt, data, WARM_STEPS)
            if rep % 2:
                b = bare_cpu(model, opt, data, args.steps)
                i = second(model, opt, data, args.steps)
            else:
                i = second(model, opt, data, args.steps)
                b = bare_cpu(model, opt, data, args.steps)
            return {"bare_wall": b[0], "bare_cpu": b[1], "bare_proc": b[2],
                    "inst_wall": i[0], "inst_cpu": i[1], "inst_proc": i[2]}

    import stepscope

    print(json.dumps({"ready": os.path.dirname(stepscope.__file__)}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(int(line))), flush=True)
    if not args.per_instrument:
        import shutil

        shutil.rmtree(out, ignore_errors=True)


def compare_builds(args: argparse.Namespace) -> None:
    """``--baseline-src``: this build and the baseline, one repetition each in turn."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    builds = {"this": os.path.abspath(here), "baseline": os.path.abspath(args.baseline_src)}
    argv = [sys.executable, os.path.abspath(__file__), "--serve", "--steps", str(args.steps),
            "--hidden", str(args.hidden), "--batch", str(args.batch)]
    if args.per_instrument:
        argv.append("--per-instrument")
    elif args.noise_floor:
        builds["noise_floor"] = builds["this"]
    uptime_start = _uptime()
    procs = {}
    for name, src in builds.items():
        env = dict(os.environ, PYTHONPATH=src)
        procs[name] = subprocess.Popen(argv + (["--floor"] if name == "noise_floor" else []),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    where = {name: json.loads(p.stdout.readline())["ready"] for name, p in procs.items()}  # type: ignore[union-attr]
    reps: dict[str, list[dict[str, float]]] = {name: [] for name in procs}
    order = list(procs)
    for rep in range(args.reps):
        for name in (order if rep % 2 == 0 else order[::-1]):
            p = procs[name]
            p.stdin.write(f"{rep}\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
            reps[name].append(json.loads(p.stdout.readline()))  # type: ignore[union-attr]
    for p in procs.values():
        p.stdin.close()  # type: ignore[union-attr]
        p.wait()
    load = os.getloadavg()
    med = statistics.median
    for name, got in reps.items():
        if args.per_instrument:
            body: dict[str, Any] = per_instrument_summary(got)
        else:
            ratios = [r["inst_wall"] / r["bare_wall"] for r in got]
            cpu_ratios = [r["inst_cpu"] / r["bare_cpu"] for r in got]
            body = {
                "bare_step_ms_median": round(med(r["bare_wall"] for r in got) * 1e3, 3),
                "ratio_median": round(med(ratios), 4),
                "ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
                "thread_cpu_ratio_median": round(med(cpu_ratios), 4),
                "added_wall_us_median": round(med(r["inst_wall"] - r["bare_wall"] for r in got) * 1e6, 1),
                "added_thread_cpu_us_median": round(med(r["inst_cpu"] - r["bare_cpu"] for r in got) * 1e6, 1),
                "process_cpu_ratio_median": round(med(r["inst_proc"] / r["bare_proc"] for r in got), 4),
                "added_process_cpu_us_median": round(
                    med(r["inst_proc"] - r["bare_proc"] for r in got) * 1e6, 1),
            }
        print(json.dumps({"benchmark": "overhead_per_instrument" if args.per_instrument else "overhead",
                          "build": name, "src": where[name], "reps": args.reps, "steps_per_rep": args.steps,
                          "hidden": args.hidden, "loadavg_1m_end": round(load[0], 2),
                          "uptime_start": uptime_start, "uptime_end": _uptime(), **body}))


def _uptime() -> str:
    """``uptime``'s line (load averages), recorded with every number on a shared machine."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------ --collectives


def _coll_call_us(n: int, timed: bool, async_op: bool, tracer: Tracer) -> tuple[float, float]:
    """(wall, thread-CPU) µs per tiny all_reduce, inside a sampled step (timed) or not.

    Thread CPU time leaves out the time this thread was preempted or blocked waiting for the
    peer, so on a shared machine it isolates what the timing code itself costs.
    """
    import torch.distributed as dist

    t = torch.ones(4)
    ctx = tracer.step() if timed else contextlib.nullcontext()
    with ctx:
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for _ in range(n):
            w = dist.all_reduce(t, async_op=async_op)
            if async_op:
                w.wait()
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    return (w1 - w0) / n / 1e3, (c1 - c0) / n / 1e3


def _coll_host_costs(blocks: int, n: int) -> dict[str, float]:
    """Timed minus untimed µs per call: medians over interleaved blocks of ``n`` calls."""
    import torch.distributed as dist

    from stepscope.recording.sinks import MemorySink

    tracer = Tracer(Config(out_dir="unused", auto=False, flush_every_n_steps=1000), clock=CpuClock(),
                    sink=MemorySink())
    out: dict[str, float] = {}
    for async_op in (False, True):
        got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        _coll_call_us(n, False, async_op, tracer)  # warm-up
        for b in range(blocks):
            dist.barrier()
            for on in ((True, False) if b % 2 else (False, True)):
                got[on].append(_coll_call_us(n, on, async_op, tracer))
        key = "async" if async_op else "sync"
        for i, kind in ((0, "wall"), (1, "cpu")):
            on_med = statistics.median(v[i] for v in got[True])
            off_med = statistics.median(v[i] for v in got[False])
            out[f"{key}_untimed_{kind}_us"] = round(off_med, 2)
            out[f"{key}_added_{kind}_us"] = round(on_med - off_med, 2)
    tracer.finish()
    return out


def _coll_job(kind: str, hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model: torch.nn.Module = torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 1))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def _coll_steps(kind: str, hidden: int, batch: int, steps: int, reps: int, out: str) -> dict[str, Any]:
    import torch.distributed as dist

    model, opt = _coll_job(kind, hidden)
    x = torch.randn(batch, hidden)

    def run(collectives: bool) -> tuple[float, float, int]:
        from stepscope.recording.sinks import MemorySink

        tracer = Tracer(Config(out_dir=out, collectives=collectives, flush_every_n_steps=1000),
                        model=model, optimizer=opt, clock=CpuClock(), sink=MemorySink())
        recs: list[dict[str, Any]] = []
        tracer.add_listener(recs.append)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            with tracer.step():
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        dt, dc = (time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps
        tracer.finish()
        return dt, dc, sum(c["count"] for r in recs for c in r.get("collectives", []))

    run(False)  # warm-up
    ratios, cpu_ratios, on_ms, off_ms = [], [], [], []
    timed_per_step = 0.0
    for rep in range(reps):
        got = {on: run(on) for on in ((True, False) if rep % 2 else (False, True))}
        ratios.append(got[True][0] / got[False][0])
        cpu_ratios.append(got[True][1] / got[False][1])
        on_ms.append(got[True][0] * 1e3)
        off_ms.append(got[False][0] * 1e3)
        timed_per_step = got[True][2] / steps
    return {
        "job": kind, "reps": reps, "steps_per_rep": steps, "hidden": hidden,
        "step_ms_off_median": round(statistics.median(off_ms), 3),
        "step_ms_on_median": round(statistics.median(on_ms), 3),
        "ratio_median": round(statistics.median(ratios), 4),
        "thread_cpu_ratio_median": round(statistics.median(cpu_ratios), 4),
        "timed_collectives_per_step": timed_per_step,
    }


def _coll_worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    host = _coll_host_costs(args.blocks, args.calls)
    with tempfile.TemporaryDirectory() as out:
        jobs = [_coll_steps(k, args.hidden, args.batch, args.steps, args.reps, out) for k in ("ddp", "fsdp2")]
    if rank == 0:
        print(json.dumps({"benchmark": "collective_host_us", "device": "cpu", "backend": "gloo",
                          "ranks": world, "blocks": args.blocks, "calls_per_block": args.calls,
                          **host, "single_rank": args.single}), flush=True)
        for j in jobs:
            print(json.dumps({"benchmark": "collectives_step_ratio", "device": "cpu", "ranks": world, **j}),
                  flush=True)
    dist.destroy_process_group()


def _single_rank_costs(blocks: int, n: int) -> dict[str, float]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _coll_host_costs(blocks, n)
    finally:
        dist.destroy_process_group()


def collectives_main(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    args.single = _single_rank_costs(args.blocks, args.calls)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_coll_worker, args=(2, port, args), nprocs=2, join=True)  # type: ignore[attr-defined]


class _FakeTorchCuda:
    """``torch.cuda``'s allocator calls, answered from a prebuilt dict (CPU-only timing)."""

    def __init__(self) -> None:
        self.nested = {"allocated_bytes": {"all": {"peak": 3 << 30, "current": 2 << 30}},
                       "reserved_bytes": {"all": {"peak": 4 << 30}}}

    def reset_peak_memory_stats(self, device: int) -> None:
        return None

    def memory_stats_as_nested_dict(self, device: int) -> dict[str, object]:
        return self.nested

    def memory_stats(self, device: int) -> dict[str, int]:
        return {"num_alloc_retries": 0, "num_ooms": 0}


def resource_costs(n: int = 20000, reps: int = 11) -> dict[str, float]:
    """Throughput and memory instruments' hot-path costs in µs per step (minimum over ``reps``).

    throughput: ``step(tokens=, samples=)`` + one ``count()`` over a bare ``step()``.
    memory: the monitor's step-start reset + step-end read with a fake allocator (CPU), and
    with the real one when CUDA is available.
    """
    from stepscope.instrument.resource_sampler import ResourceMonitor, TorchCudaMemory
    from stepscope.recording.sinks import MemorySink

    def per_step(fn: object) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            fn()  # type: ignore[operator]
            best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
        return best

    tracer = Tracer(Config(out_dir="unused", flush_every_n_steps=100, max_pending_steps=n + 1),
                    clock=CpuClock(), sink=MemorySink())

    def plain() -> None:
        for _ in range(n):
            with tracer.step():
                pass

    def counted() -> None:
        for _ in range(n):
            with tracer.step(tokens=4096, samples=8):
                tracer.count("tokens", 1)

    base = thr = float("inf")
    for _ in range(reps):  # interleaved: machine drift hits both alike
        base = min(base, per_step(plain))
        thr = min(thr, per_step(counted))
    tracer.finish()
    fake_mem = TorchCudaMemory.__new__(TorchCudaMemory)
    fake_mem.index, fake_mem._cuda = 0, _FakeTorchCuda()
    out = {"throughput_added_us": round(thr - base, 3), "step_enter_exit_us": round(base, 3)}
    cpu_mon = ResourceMonitor(device="cpu")  # host RSS read at step end (/proc/self/statm)

    def cpu_hot(mon: ResourceMonitor = cpu_mon) -> None:
        for i in range(n):
            mon.on_step_start(i)
            mon.on_step_end(i)

    out["memory_cpu_rss_step_start_end_us"] = round(per_step(cpu_hot), 3)
    cpu_mon.close()
    for label, mem in (("memory_fake", fake_mem), ("memory_cuda", None)):
        if mem is None:
            if not torch.cuda.is_available():
                continue
            mem = TorchCudaMemory(torch.cuda.current_device())
        mon = ResourceMonitor(device="cpu", cuda=mem, host=False)

        def hot(mon: ResourceMonitor = mon) -> None:
            for i in range(n):
                mon.on_step_start(i)
                mon.on_step_end(i)

        out[f"{label}_step_start_end_us"] = round(per_step(hot), 3)
        snap = mon.on_step_end(0)
        mon_host = ResourceMonitor(device="cpu", cuda=mem)

        def writer(mon: ResourceMonitor = mon_host, snap: object = snap) -> None:
            for i in range(n):
                mon.step_fields(i, 0, 5.0, {"tokens": 4096}, snap)

        out[f"{label}_step_fields_writer_us"] = round(per_step(writer), 3)
    return out


def main() -> None:
    if any(a == "--record" or a.startswith("--record=") for a in sys.argv[1:]):
        import _results  # benchmarks/_results.py: re-runs this script and writes its record
        sys.exit(_results.record_run(__file__, sys.argv[1:]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--per-instrument", action="store_true", help="cost of each instrument instead")
    ap.add_argument("--collectives", action="store_true", help="collective timing on 2 gloo ranks")
    ap.add_argument("--blocks", type=int, default=21, help="--collectives: interleaved blocks")
    ap.add_argument("--calls", type=int, default=500, help="--collectives: calls per block")
    ap.add_argument("--resources", action="store_true", help="throughput / memory instrument costs")
    ap.add_argument("--baseline-src", help="compare with the stepscope in this src dir, interleaved")
    ap.add_argument("--noise-floor", action="store_true",
                    help="with --baseline-src: a third worker times the bare loop twice (no tracer), "
                         "measured like the others: the ratio two identical loops show")
    ap.add_argument("--record", metavar="DIR", help="also write the JSON lines as a record in DIR "
                    "(benchmarks/results)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.serve:
        _serve(args)
        return
    if args.baseline_src:
        if args.per_instrument and args.steps == 60:
            args.steps = 1500
        compare_builds(args)
        return
    if args.collectives:
        if args.hidden == 768:
            args.hidden = 256
        if args.steps == 60:
            args.steps = 30
        if args.reps == 15:
            args.reps = 7
        collectives_main(args)
        return
    if args.resources:
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print(json.dumps({"benchmark": "overhead_resources", "device": dev, **resource_costs()}))
        return
    if args.per_instrument:
        print(json.dumps({"benchmark": "overhead_per_instrument", "device": "cpu", **per_instrument()}))
        return
    model, opt, data = make_job(args.hidden, args.batch)
    bare(model, opt, data, 20)  # warm-up
    ratios, bare_ms, inst_ms = [], [], []
    with tempfile.TemporaryDirectory() as out:
        for rep in range(args.reps):
            # Alternate the order so drift on a noisy machine hits both sides alike.
            if rep % 2:
                b = bare(model, opt, data, args.steps)
                i = instrumented(model, opt, data, args.steps, out)
            else:
                i = instrumented(model, opt, data, args.steps, out)
                b = bare(model, opt, data, args.steps)
            ratios.append(i / b)
            bare_ms.append(b * 1e3)
            inst_ms.append(i * 1e3)
    costs = primitive_costs()
    b_med, i_med = statistics.median(bare_ms), statistics.median(inst_ms)
    print(json.dumps({
        "benchmark": "overhead",
        "device": "cpu",
        "reps": args.reps,
        "steps_per_rep": args.steps,
        "bare_step_ms_median": round(b_med, 3),
        "instrumented_step_ms_median": round(i_med, 3),
        "ratio_median": round(statistics.median(ratios), 4),
        "per_step_overhead_us": round((i_med - b_med) * 1e3, 1),
        "phases_per_step": 6,
        **{k: round(v, 2) for k, v in costs.items()},
    }))


if __name__ == "__main__":
    main()
