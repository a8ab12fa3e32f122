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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

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

    from stepscope.sinks import MemorySink

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
        from stepscope.sinks import MemorySink

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--per-instrument", action="store_true", help="cost of each instrument instead")
    ap.add_argument("--collectives", action="store_true", help="collective timing on 2 gloo ranks")
    ap.add_argument("--blocks", type=int, default=21, help="--collectives: interleaved blocks")
    ap.add_argument("--calls", type=int, default=500, help="--collectives: calls per block")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.collectives:
        if args.hidden == 768:
            args.hidden = 256
        if args.steps == 60:
            args.steps = 30
        if args.reps == 15:
            args.reps = 7
        collectives_main(args)
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
