"""Overhead of stepscope on a CPU training loop: bare vs instrumented, interleaved.

Prints one JSON line: median step-time ratio (instrumented / bare) over interleaved
repetitions, and the host cost of the tracer's primitives in µs (a phase open+close, a
step enter+exit, a forward/backward/optimizer hook set) measured in isolation.

    python benchmarks/overhead.py [--reps 15] [--steps 60] [--hidden 768]
    python benchmarks/overhead.py --per-instrument   # µs/step each automatic instrument adds
    python benchmarks/overhead.py --resources        # issue 13: throughput and memory read costs
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from stepscope.clock import CpuClock
from stepscope.config import Config
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
    t0 = time.perf_counter()
    for i in range(steps):
        x = data[i % len(data)].to(torch.float32)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return (time.perf_counter() - t0) / steps


def instrumented(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor], steps: int, out: str
) -> float:
    tracer = Tracer(Config(out_dir=out), model=model, optimizer=opt)
    source = (data[i % len(data)] for i in range(steps))
    t0 = time.perf_counter()
    for x in tracer.wrap_loader(source):
        with tracer.step():
            x = x.to(torch.float32)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with tracer.phase("metrics"):
                loss.item()
    dt = (time.perf_counter() - t0) / steps
    tracer.finish()
    return dt


def primitive_costs(n: int = 20000) -> dict[str, float]:
    """µs per call of the tracer's hot-path primitives, CPU clock, memory-free sink."""
    from stepscope.sinks import MemorySink

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


def per_instrument(reps: int = 7, steps: int = 1500) -> dict[str, float]:
    """µs per step each automatic instrument adds on a tiny model (minimum over reps).

    The tiny model makes the step ~0.25 ms so that tracer costs stand out of the noise;
    the minimum over repetitions is the least noisy estimate of a fixed added cost.
    """
    from stepscope.sinks import MemorySink

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 8)

    def loop(tracer: Tracer | None) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(steps):
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
        return (time.perf_counter_ns() - t0) / steps / 1e3

    variants: dict[str, set[str]] = {
        "step_only": set(), "forward": {"forward"}, "forward_backward": {"forward", "backward"},
        "optimizer": {"optimizer"}, "h2d": {"h2d"}, "all": {"forward", "backward", "optimizer", "h2d"},
    }
    best = {k: float("inf") for k in ["bare", *variants]}
    for _ in range(reps):
        best["bare"] = min(best["bare"], loop(None))
        for name, auto in variants.items():
            tracer = Tracer(Config(out_dir="unused", auto=auto), model=model, optimizer=opt,
                            clock=CpuClock(), sink=MemorySink())
            best[name] = min(best[name], loop(tracer))
            tracer.finish()
    return {f"{k}_added_us": round(v - best["bare"], 1) for k, v in best.items() if k != "bare"} | {
        "bare_step_us": round(best["bare"], 1)
    }


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
    """Issue 13 hot-path costs in µs per step (minimum over ``reps``).

    throughput: ``step(tokens=, samples=)`` + one ``count()`` over a bare ``step()``.
    memory: the monitor's step-start reset + step-end read with a fake allocator (CPU), and
    with the real one when CUDA is available.
    """
    from stepscope.instrument.resources import ResourceMonitor, TorchCudaMemory
    from stepscope.sinks import MemorySink

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
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--per-instrument", action="store_true", help="cost of each instrument instead")
    ap.add_argument("--resources", action="store_true", help="throughput / memory instrument costs")
    args = ap.parse_args()
    torch.set_num_threads(1)
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
