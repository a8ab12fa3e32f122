"""stepscope beside its peers, interleaved in one process: what each costs a training step.

Kinds, each run in blocks of steps on the *same* model and optimizer:

- ``bare``: the loop alone;
- ``stepscope_every_1`` / ``stepscope_every_10``: ``tracer.step()`` around each step with every
  automatic instrument and the JSONL writer (a new tracer per block, built and finished outside
  the timing), recording every step / one step in 10;
- ``manual_timer``: the minimal hand-written timer (three coarse phases, forward, backward and
  optimizer, by ``time.perf_counter``; a JSONL line per step written every 10 steps);
- ``traceml``: TraceML (``traceml-ai``), when installed, one process only: ``traceml_ai.init``
  once, against its aggregator started as a subprocess, then its patches (``Module.__call__``,
  ``Tensor.backward``, ``torch.autograd.backward``, ``Tensor.to``, global optimizer hooks) are
  swapped in for its blocks and out for the others, and each step runs in
  ``traceml_ai.trace_step(model)``. Its telemetry threads run through every block.

Per round the kinds run in a shuffled order, each traced block between two bare blocks (the
host drifts by more than these costs over a round; the mean of the bare block before and the
one after cancels a linear drift). The figure is the median over rounds of the training
thread's CPU time per step over its bare blocks, in µs (``added_us``, ± ``pm_us``: the
half-width of the median's ~95% interval over the rounds), and the ratio of the kind's step to
the bare step (``x``). Steps: ``~3 ms`` (a three-layer MLP of width 640 on a batch of 64, one
thread; blocks of 100 steps) and ``~30 ms`` (width 2048; blocks of 10 steps), as measured on a
fast core; a slower host scales both.

``--ranks 1 2`` (the default) runs each size in one process and then on 2 gloo ranks under DDP
(TraceML left out there: its aggregator expects its own launcher); the ranks run the same kinds
in the same order, rank 0 reports. Prints one JSON line per configuration (step size × ranks);
``--record DIR`` also writes them as one results record (benchmarks/results/README.md).

    python benchmarks/peers.py --rounds 9
    python benchmarks/peers.py --ranks 2 --sizes 3ms --steps 100
    python benchmarks/peers.py --record benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
#: MLP width per step size (batch 64, one thread).
SIZES = {"3ms": 640, "30ms": 2048}
#: Steps per block per step size unless ``--steps`` says: blocks of a few hundred ms each.
BLOCK_STEPS = {"3ms": 100, "30ms": 10}


def _job(hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )
    return model, torch.optim.SGD(model.parameters(), lr=1e-4), torch.randn(64, hidden)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x.to(torch.float32)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


class ManualTimer:
    """Three coarse phases by ``perf_counter``, a JSONL line per step, written every 10 steps."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "a")  # noqa: SIM115 (closed by close())
        self.lines: list[str] = []
        self.index = 0

    def step(self, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        clock = time.perf_counter
        t0 = clock()
        loss = model(x.to(torch.float32)).square().mean()
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        opt.zero_grad()
        t3 = clock()
        self.lines.append(json.dumps({"step": self.index, "forward_ms": (t1 - t0) * 1e3,
                                      "backward_ms": (t2 - t1) * 1e3, "optimizer_ms": (t3 - t2) * 1e3}))
        self.index += 1
        if len(self.lines) >= 10:
            self.f.write("\n".join(self.lines) + "\n")
            self.f.flush()
            self.lines.clear()

    def close(self) -> None:
        self.f.close()


# ------------------------------------------------------------------ TraceML, when installed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TraceML:
    """TraceML started once; :meth:`on`/:meth:`off` swap its patches in and out."""

    def __init__(self, out: Path) -> None:
        import traceml_ai

        self.api = traceml_ai
        self.targets = self._targets()
        before = {k: self._get(k) for k in self.targets}
        hooks_before = self._global_hooks()
        port = _free_port()
        env = dict(os.environ, TRACEML_AGGREGATOR_PORT=str(port), TRACEML_AGGREGATOR_HOST="127.0.0.1",
                   TRACEML_AGGREGATOR_BIND_HOST="127.0.0.1", TRACEML_MODE="summary",
                   TRACEML_UI_MODE="summary", TRACEML_LOGS_DIR=str(out), TRACEML_HISTORY_ENABLED="0")
        main = Path(traceml_ai.__file__).parent / "aggregator" / "aggregator_main.py"
        self.proc = subprocess.Popen([sys.executable, str(main)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        traceml_ai.init(mode="auto", ui_mode="summary", logs_dir=str(out), aggregator_host="127.0.0.1",
                        aggregator_port=port, on_missing_aggregator="raise", connect_timeout_sec=30.0)
        # trace_step installs the optimizer hooks on first use: one step so they exist now.
        model, opt, x = _job(8)
        with traceml_ai.trace_step(model):
            _step(model, opt, x)
        self.patched = {k: self._get(k) for k in self.targets}
        self.orig = before
        self.swapped = [k for k in self.targets if self.patched[k] is not before[k]]
        pre, post = self._global_hooks()
        self.hooks = ({k: v for k, v in pre.items() if k not in hooks_before[0]},
                      {k: v for k, v in post.items() if k not in hooks_before[1]})
        self.off()

    @staticmethod
    def _targets() -> list[tuple[Any, str]]:
        return [(torch.nn.Module, "__call__"), (torch.Tensor, "backward"), (torch.autograd, "backward"),
                (torch.Tensor, "to"), (torch.Tensor, "cuda")]

    @staticmethod
    def _get(key: tuple[Any, str]) -> Any:
        owner, name = key
        return owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)

    @staticmethod
    def _global_hooks() -> tuple[dict[Any, Any], dict[Any, Any]]:
        from torch.optim import optimizer as o

        return dict(o._global_optimizer_pre_hooks), dict(o._global_optimizer_post_hooks)

    def _set(self, values: dict[tuple[Any, str], Any], hooks: bool) -> None:
        for key in self.swapped:
            setattr(key[0], key[1], values[key])
        from torch.optim import optimizer as o

        for mine, theirs in ((self.hooks[0], o._global_optimizer_pre_hooks),
                             (self.hooks[1], o._global_optimizer_post_hooks)):
            for k, v in mine.items():
                if hooks:
                    theirs[k] = v
                else:
                    theirs.pop(k, None)

    def on(self) -> None:
        self._set(self.patched, True)

    def off(self) -> None:
        self._set(self.orig, False)

    def close(self) -> None:
        self.off()
        self.proc.terminate()
        with contextlib.suppress(Exception):
            self.proc.wait(10)


def _traceml(out: Path, world: int) -> tuple[TraceML | None, str | None]:
    if world > 1:
        return None, "TraceML left out under DDP: its aggregator expects its own launcher"
    try:
        import traceml_ai  # noqa: F401
    except ImportError:
        return None, "traceml-ai is not installed"
    try:
        return TraceML(out), None
    except Exception as exc:  # a benchmark of peers goes on without the one that fails to start
        return None, f"TraceML did not start: {exc!r}"


# ------------------------------------------------------------------ the runs


def _blocks(kinds: dict[str, Callable[[], tuple[Callable[[], None], Callable[[], None]]]],
            bare: Callable[[], None], steps: int, rounds: int, seed: int) -> dict[str, Any]:
    """Per round, per kind in a shuffled order (the same on every rank: ``seed``), a block of
    ``steps`` steps between two bare blocks, compared with their mean. ``kinds[k]()`` sets the
    kind up and returns (one step, teardown)."""
    rng = random.Random(seed)
    clock = time.thread_time_ns
    added: dict[str, list[float]] = {k: [] for k in kinds}
    ratio: dict[str, list[float]] = {k: [] for k in kinds}
    bares: list[float] = []

    def timed(step: Callable[[], None]) -> float:
        for _ in range(3):
            step()
        t0 = clock()
        for _ in range(steps):
            step()
        return (clock() - t0) / steps / 1e3

    order = list(kinds)
    for _ in range(rounds):
        rng.shuffle(order)
        for kind in order:
            before = timed(bare)
            step, teardown = kinds[kind]()
            try:
                t = timed(step)
            finally:
                teardown()
            b = (before + timed(bare)) / 2
            bares.append(b)
            added[kind].append(t - b)
            ratio[kind].append(t / b)
    med = statistics.median
    return {"bare_step_us": round(med(bares), 1),
            "kinds": {k: {"added_us": round(med(added[k]), 1), "pm_us": _median_pm(added[k]),
                          "x": round(med(ratio[k]), 4)}
                      for k in kinds}}


def _median_pm(xs: list[float]) -> float:
    """Half-width of the ~95% interval of the median of ``xs``: 1.57 × IQR / √n (McGill's
    notch), so a reader sees which differences the rounds resolve."""
    if len(xs) < 2:
        return float("nan")
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return round(1.57 * (q3 - q1) / math.sqrt(len(xs)), 1)


def run_config(hidden: int, steps: int, rounds: int, out: Path, rank: int, world: int,
               traceml: TraceML | None) -> dict[str, Any]:
    from stepscope.recording.clock import CpuClock
    from stepscope.recording.config import Config
    from stepscope.recording.dist import RankInfo
    from stepscope.tracer import Tracer

    out.mkdir(parents=True, exist_ok=True)
    model, opt, x = _job(hidden)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(10):
        _step(model, opt, x)
    n = [0]

    def bare() -> None:
        _step(model, opt, x)

    def stepscope_kind(every: int) -> Callable[[], tuple[Callable[[], None], Callable[[], None]]]:
        def setup() -> tuple[Callable[[], None], Callable[[], None]]:
            n[0] += 1
            cfg = Config(out_dir=str(out / f"stepscope-{n[0]}"), every_n_steps=every, run_id=f"peers-{n[0]}")
            Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            tracer = Tracer(cfg, model=model, optimizer=opt, clock=CpuClock(),
                            rank=RankInfo(rank, rank, world, platform.node()))

            def step() -> None:
                with tracer.step():
                    _step(model, opt, x)

            return step, tracer.finish
        return setup

    def manual() -> tuple[Callable[[], None], Callable[[], None]]:
        n[0] += 1
        timer = ManualTimer(out / f"manual-{n[0]}.jsonl")
        return (lambda: timer.step(model, opt, x)), timer.close

    kinds: dict[str, Any] = {"stepscope_every_1": stepscope_kind(1),
                             "stepscope_every_10": stepscope_kind(10), "manual_timer": manual}
    if traceml is not None:
        def traceml_kind() -> tuple[Callable[[], None], Callable[[], None]]:
            traceml.on()
            api = traceml.api

            def step() -> None:
                with api.trace_step(model):
                    _step(model, opt, x)

            return step, traceml.off
        kinds["traceml"] = traceml_kind
    return _blocks(kinds, bare, steps, rounds, seed=hidden)


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, out: str,
            results: Any) -> None:
    """One rank of the DDP run (a spawned process)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for size in args.sizes:
            got = run_config(SIZES[size], args.steps or BLOCK_STEPS[size], args.rounds,
                             Path(out) / f"{size}-r{rank}", rank, world, None)
            if rank == 0:
                results.put((size, got))
            dist.barrier()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="stepscope-peers-") as tmp:
        yield Path(tmp)


def _one_process(args: argparse.Namespace, out: Path) -> None:
    traceml, note = _traceml(out / "traceml", 1)
    try:
        for size in args.sizes:
            got = run_config(SIZES[size], args.steps or BLOCK_STEPS[size], args.rounds, out / size,
                             0, 1, traceml)
            line = {"benchmark": "peers", "step": size, "ranks": 1, **got, **({"note": note} if note else {})}
            print(json.dumps(line), flush=True)
    finally:
        if traceml is not None:
            traceml.close()


def _ranks(args: argparse.Namespace, world: int, out: Path) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    spawn: Any = mp.spawn  # type: ignore[attr-defined]
    spawn(_worker, args=(world, args, _free_port(), str(out), results), nprocs=world)
    _, note = _traceml(out, world)
    for _ in args.sizes:
        size, got = results.get(timeout=60)
        print(json.dumps({"benchmark": "peers", "step": size, "ranks": world, **got, "note": note}),
              flush=True)


def main() -> None:
    if any(a == "--record" or a.startswith("--record=") for a in sys.argv[1:]):
        import _results  # benchmarks/_results.py: re-runs this script and writes its record
        sys.exit(_results.record_run(__file__, sys.argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="steps per block (default: 100 at 3ms, 10 at 30ms)")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of blocks (medians over them)")
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["3ms", "30ms"])
    ap.add_argument("--ranks", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    ap.add_argument("--record", metavar="DIR", help="also write the JSON lines as a record in DIR "
                    "(benchmarks/results/README.md)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with _scratch() as out:
        for world in args.ranks:
            if world == 1:
                _one_process(args, out / "r1")
            else:
                _ranks(args, world, out / f"r{world}")


if __name__ == "__main__":
    main()
