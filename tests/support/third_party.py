"""Run a third-party training script under stepscope on gloo ranks, patched minimally at run time.

The script's own text is executed (from a fetched mirror under ``paths.MIRRORS`` when present,
or from this repository's re-creation of its usage pattern under ``tests/support/third_party_scripts``),
with these run-time changes only:

- its training loop (the first top-level ``for`` or ``if`` statement that calls ``.backward()``
  or a schedule's ``.step(...)``) runs ``steps`` times, each iteration inside
  ``stepscope.step()``; ``stepscope.init`` is called just before the loop with the model and
  optimizer the script built (a pipeline stage's submodule when there is one), and
  ``stepscope.finish`` just after it;
- one rank is slowed by hooks on that model: a sleep in its forward, or an identity on its first
  layer's output whose backward sleeps (slow backward);
- for training functions (``main()`` → ``training_function``), the innermost batch loop that
  calls ``backward`` instead, stopped after ``steps`` batches, ``init`` with the function's
  locals; the script's own command line (``argv``, e.g. ``--cpu``);
- CPU instead of an accelerator (``torch.accelerator.current_accelerator`` answers ``cpu``, GPU
  count checks pass, attention on head-sharded DTensors computed on the local heads where
  DTensor lacks a rule for CPU flash attention, a no-op
  ``torch.cuda.current_stream().synchronize()``), gloo (the default for CPU tensors), and for
  PiPPy-era scripts a ``pippy`` module that maps the old API onto
  ``torch.distributed.pipelining``; for Hugging Face
  examples, offline stand-ins for what they download (model, tokenizer, dataset, metric).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paths  # tests/support: where the repository and its outside data are
import torch
import torch.distributed as dist
from torch import nn

import stepscope
from stepscope.demo import SleepInBackward
from stepscope.recording.dist import become_local_rank, spawn_local

#: Fetched repositories: ``$STEPSCOPE_MIRRORS``, else the nearest ``.mirror`` (see paths.py).
MIRRORS = paths.MIRRORS
HERE = Path(__file__).resolve().parent / "third_party_scripts"


@dataclass(frozen=True)
class Script:
    """A training script: its main file's text, sibling modules, and where it came from."""

    name: str
    text: str
    siblings: tuple[tuple[str, str], ...] = ()
    origin: str = "re-creation"  # or "<owner/repo>@<commit>:<path>"
    argv: tuple[str, ...] = ()  # command-line arguments the script is run with
    init_pg: bool = False  # create the gloo process group before the script runs
    offline_hf: bool = False  # stand-ins for the Hub's model/tokenizer, `datasets`, `evaluate`


def from_mirror(repo: str, path: str, siblings: tuple[str, ...] = (), **kw: Any) -> Script | None:
    """The file ``path`` of the fetched ``repo`` (bare git dir), or None when not fetched."""
    git_dir = MIRRORS / repo.replace("/", "+") / "repo"
    if not git_dir.is_dir():
        return None

    def show(p: str) -> str:
        return subprocess.run(["git", "--git-dir", str(git_dir), "show", f"HEAD:{p}"],
                              check=True, capture_output=True, text=True).stdout

    try:
        commit = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        text = show(path)
        sib = tuple((Path(s).name, show(s)) for s in siblings)
    except (OSError, subprocess.CalledProcessError):
        return None
    return Script(Path(path).stem, text, sib, f"{repo}@{commit[:12]}:{path}", **kw)


def recreation(name: str, siblings: tuple[str, ...] = (), **kw: Any) -> Script:
    """This repository's re-creation ``tests/support/third_party_scripts/<name>.py``."""
    sib = tuple((s, (HERE / s).read_text()) for s in siblings)
    return Script(name, (HERE / f"{name}.py").read_text(), sib, **kw)


#: torchtitan's expert-parallel MoE before its kernels needed a GPU-only build step: the
#: commit whose ``ExpertParallel`` and ``MoE`` are run, and the files they import.
TORCHTITAN_EP = "ea4989e0dfc15d214e69c9569b358da322087f46"
_TT_FILES = ("torchtitan/models/moe.py", "torchtitan/distributed/expert_parallel.py",
             "torchtitan/experiments/kernels/moe/indices.py")
#: Packages whose ``__init__`` pulls torchtitan's trainer (config, tyro, datasets): empty here.
_TT_PACKAGES = ("torchtitan", "torchtitan/models", "torchtitan/distributed", "torchtitan/experiments",
                "torchtitan/experiments/kernels", "torchtitan/experiments/kernels/moe")
# What the script imports as ``moe_impl`` when it runs torchtitan's modules. Triton is absent
# on a CPU-only machine: a stand-in lets the permutation module import, and its permutation
# runs its own CPU implementation (``use_cpu=True``); the router's ``histc`` of integer expert
# ids (CUDA-only for integers) counts them as floats, the result keeping the ids' dtype.
_TT_SHIM = """import sys, types
import torch
_histc = torch.histc
torch.histc = lambda t, bins=100, min=0, max=0: _histc(t.double(), bins, min, max).to(t.dtype)
triton = types.ModuleType("triton")
triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
triton.cdiv = lambda a, b: (a + b - 1) // b
triton.language = types.ModuleType("triton.language")
triton.language.constexpr = int
sys.modules.setdefault("triton", triton)
sys.modules.setdefault("triton.language", triton.language)
from torchtitan.experiments.kernels.moe import indices
_gpi = indices.generate_permute_indices
indices.generate_permute_indices = lambda *a, **k: _gpi(*a, **{**k, "use_cpu": True})
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.moe import MoE, MoEArgs
"""


def ep_moe_recreation(**kw: Any) -> Script:
    """``ep_moe_train.py`` on this repository's re-creation of torchtitan's MoE (``ep_moe.py``)."""
    return Script("ep_moe_train", (HERE / "ep_moe_train.py").read_text(),
                  (("moe_impl.py", (HERE / "ep_moe.py").read_text()),), **kw)


def torchtitan_moe(**kw: Any) -> Script | None:
    """``ep_moe_train.py`` on pytorch/torchtitan's own MoE and ExpertParallel (at
    :data:`TORCHTITAN_EP`), or None when torchtitan is not fetched."""
    git_dir = MIRRORS / "pytorch+torchtitan" / "repo"
    if not git_dir.is_dir():
        return None
    try:
        files = [(f, subprocess.run(["git", "--git-dir", str(git_dir), "show", f"{TORCHTITAN_EP}:{f}"],
                                    check=True, capture_output=True, text=True).stdout)
                 for f in _TT_FILES]
    except (OSError, subprocess.CalledProcessError):
        return None  # a mirror without that commit
    inits = [(f"{p}/__init__.py", "") for p in _TT_PACKAGES]
    return Script("ep_moe_train", (HERE / "ep_moe_train.py").read_text(),
                  (*inits, *files, ("moe_impl.py", _TT_SHIM)),
                  f"ep_moe_train.py on pytorch/torchtitan@{TORCHTITAN_EP[:12]}",
                  **kw)


# ------------------------------------------------------------------ the loop rewrite


def _calls(node: ast.AST, attrs: set[str]) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in attrs
               for n in ast.walk(node))


def _expr(src: str) -> ast.expr:
    return ast.parse(src, mode="eval").body


def _step_body(body: list[ast.stmt]) -> list[ast.stmt]:
    return [ast.With(items=[ast.withitem(_expr("__ss_drv.step()"))], body=body)]


def instrument(text: str) -> ast.Module:
    """``text`` with its training loop repeated under stepscope (see the module doc).

    A module-level script: the first top-level ``for``/``if`` that calls ``.backward()`` or
    ``.step()``. Otherwise the innermost ``for`` loop that calls ``backward`` (a training
    function's batch loop): it stops after ``steps`` iterations in all, ``begin(locals())``
    runs before the function's statement that holds it and ``end()`` after.
    """
    tree = ast.parse(text)
    body = tree.body
    found = [i for i, st in enumerate(body)
             if isinstance(st, (ast.For, ast.If)) and _calls(st, {"backward", "step"})]
    if found:
        i = found[0]
        stmt = body[i]
        drv = ast.parse("__ss_drv.begin(globals())\n__ss_drv.end()").body
        if isinstance(stmt, ast.For):
            stmt.iter = _expr("__ss_drv.steps()")
            stmt.body = _step_body(stmt.body)
            loop: ast.stmt = stmt
        else:
            loop = ast.parse("for __ss_i in __ss_drv.steps():\n    pass").body[0]
            loop.body = _step_body([stmt])  # type: ignore[attr-defined]
        tree.body = [*body[:i], drv[0], loop, drv[1], *body[i + 1:]]
        return ast.fix_missing_locations(tree)
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        loops = [n for n in ast.walk(fn) if isinstance(n, ast.For) and _calls(n, {"backward"})]
        inner = [n for n in loops if not any(m is not n and m in ast.walk(n) for m in loops)]
        if not inner:
            continue
        target = inner[0]
        target.iter = ast.Call(func=_expr("__ss_drv.limit"), args=[target.iter], keywords=[])
        target.body = _step_body(target.body)
        j = next(k for k, st in enumerate(fn.body) if any(n is target for n in ast.walk(st)))
        drv = ast.parse("__ss_drv.begin(locals())\n__ss_drv.end()").body
        fn.body = [*fn.body[:j], drv[0], fn.body[j], drv[1], *fn.body[j + 1:]]
        return ast.fix_missing_locations(tree)
    raise ValueError("no training loop (a for/if calling .backward() or .step()) found")


# ------------------------------------------------------------------ what runs in each rank


class Driver:
    """What the rewritten script calls: ``begin``, ``steps``, ``step``, ``end``."""

    def __init__(self, rank: int, out_dir: str, steps: int, slow: tuple[int, str, float] | None) -> None:
        self.rank, self.out_dir, self.n, self.slow = rank, out_dir, steps, slow
        self.model: nn.Module | None = None
        self.done = 0

    @staticmethod
    def _find(g: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        values = list(g.values())
        stages = [v for v in values if isinstance(v, _PipelineStageBase)]
        if stages:
            model: nn.Module = stages[0].submod
        else:
            modules = [v for v in values if isinstance(v, nn.Module)]
            if not modules:
                raise ValueError("the script built no nn.Module before its training loop")
            model = max(modules, key=lambda m: sum(p.numel() for p in m.parameters()))
        opts = [v for v in values if isinstance(v, torch.optim.Optimizer)]
        return model, (opts[0] if opts else None)

    def begin(self, g: dict[str, Any]) -> None:
        model, opt = self._find(g)
        self.model = model
        auto = {"forward", "backward"} | ({"optimizer"} if opt is not None else set())
        stepscope.init(out_dir=self.out_dir, model=model, optimizer=opt, run_id="third-party",
                       auto=auto)
        if self.slow is None or self.slow[0] != self.rank:
            return
        _, phase, ms = self.slow
        if phase == "forward":
            model.register_forward_pre_hook(lambda m, a: time.sleep(ms / 1000.0))
        elif phase == "backward":
            # On the output of the model's first layer with parameters: inside its backward
            # (the model's own output is where stepscope's backward timing starts).
            first = next(m for m in model.modules()
                         if next(m.children(), None) is None and any(True for _ in m.parameters()))
            first.register_forward_hook(
                lambda m, a, out: (SleepInBackward.apply(out, ms / 1000.0)
                                   if isinstance(out, torch.Tensor) else out))
        elif phase == "optimizer" and opt is not None:
            inner = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps it
            inner.register_step_pre_hook(lambda o, a, k: time.sleep(ms / 1000.0))
        else:
            raise ValueError(f"slow phase must be 'forward', 'backward' or 'optimizer', got {phase!r}")

    def steps(self) -> range:
        return range(self.n)

    def limit(self, it: Any) -> Iterator[Any]:
        """The first items of ``it``, ``steps`` in all across every call (epochs)."""
        for item in it:
            if self.done >= self.n:
                return
            self.done += 1
            yield item

    @contextmanager
    def step(self) -> Iterator[None]:
        with stepscope.step():
            yield

    def end(self) -> None:
        stepscope.finish()


def _pippy_shim() -> types.ModuleType:
    """The PiPPy-era names used by its examples, on top of ``torch.distributed.pipelining``."""
    from torch.distributed import pipelining

    mod = types.ModuleType("pippy")
    mod.SplitPoint = pipelining.SplitPoint  # type: ignore[attr-defined]
    mod.ScheduleGPipe = pipelining.ScheduleGPipe  # type: ignore[attr-defined]

    def pipeline(module: nn.Module, num_chunks: int, example_args: tuple[Any, ...] = (),
                 example_kwargs: dict[str, Any] | None = None, split_spec: Any = None) -> Any:
        # PiPPy took the whole batch and a chunk count; upstream takes one micro-batch.
        mb = tuple(a.chunk(num_chunks)[0] if isinstance(a, torch.Tensor) else a for a in example_args)
        pipe = pipelining.pipeline(module, mb, example_kwargs, split_spec=split_spec)
        # PiPPy named the stages submod_<i>, upstream submod_pp_<i>: both names, one module
        # (in the instance dict, so not registered twice).
        for name, sub in list(pipe.split_gm.named_children()):
            pipe.split_gm.__dict__[name.replace("submod_pp_", "submod_")] = sub
        return pipe

    def stage(pipe: Any, rank: int, device: torch.device, *args: Any, **kwargs: Any) -> Any:
        if isinstance(pipe, pipelining.Pipe):
            return pipe.build_stage(rank, device)
        return pipelining.PipelineStage(pipe, rank, device, *args, **kwargs)

    mod.pipeline = pipeline  # type: ignore[attr-defined]
    mod.PipelineStage = stage  # type: ignore[attr-defined]
    return mod


def _offline_hf(tmp: Path) -> None:
    """Offline stand-ins for what HF example scripts download: a tiny BERT (random weights) for
    ``from_pretrained``, a word-level tokenizer, GLUE-MRPC-shaped random sentence pairs
    (``datasets.load_dataset``) and an accuracy metric (``evaluate.load``)."""
    import random

    import transformers

    words = [f"w{i}" for i in range(200)]
    vocab = tmp / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tok = transformers.BertTokenizerFast(vocab_file=str(vocab))
    config = transformers.BertConfig(vocab_size=len(words) + 5, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, num_labels=2)
    transformers.AutoTokenizer.from_pretrained = lambda *a, **k: tok  # type: ignore[method-assign]
    transformers.AutoModelForSequenceClassification.from_pretrained = (  # type: ignore[method-assign]
        lambda *a, **k: transformers.BertForSequenceClassification(config))

    class Split(torch.utils.data.Dataset[dict[str, Any]]):
        def __init__(self, rows: list[dict[str, Any]]) -> None:
            self.rows = rows

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return self.rows[i]

        def map(self, fn: Any, batched: bool = True, remove_columns: Any = ()) -> Split:
            cols = {k: [r[k] for r in self.rows] for k in self.rows[0]}
            new = dict(fn(cols))
            return Split([{**{k: v for k, v in r.items() if k not in remove_columns},
                           **{k: new[k][i] for k in new}} for i, r in enumerate(self.rows)])

        def rename_column(self, a: str, b: str) -> Split:
            return Split([{(b if k == a else k): v for k, v in r.items()} for r in self.rows])

    class DatasetDict(dict[str, Split]):
        def map(self, *a: Any, **k: Any) -> DatasetDict:
            return DatasetDict({n: d.map(*a, **k) for n, d in self.items()})

        def rename_column(self, a: str, b: str) -> DatasetDict:
            return DatasetDict({n: d.rename_column(a, b) for n, d in self.items()})

    def load_dataset(*args: Any, **kwargs: Any) -> DatasetDict:
        rnd = random.Random(0)

        def rows(n: int) -> list[dict[str, Any]]:
            return [{"sentence1": " ".join(rnd.choices(words, k=rnd.randint(8, 16))),
                     "sentence2": " ".join(rnd.choices(words, k=rnd.randint(8, 16))),
                     "label": rnd.randint(0, 1), "idx": i} for i in range(n)]
        return DatasetDict(train=Split(rows(1024)), validation=Split(rows(64)))

    class Accuracy:
        def __init__(self) -> None:
            self.right, self.n = 0, 0

        def add_batch(self, predictions: torch.Tensor, references: torch.Tensor) -> None:
            self.right += int((predictions == references).sum())
            self.n += len(references)

        def compute(self) -> dict[str, float]:
            return {"accuracy": self.right / max(1, self.n)}

    import importlib.machinery

    class IterableDataset:  # accelerate checks prepared loaders' datasets against it
        pass

    ds = types.ModuleType("datasets")
    ds.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    ds.load_dataset = load_dataset  # type: ignore[attr-defined]
    ds.IterableDataset = IterableDataset  # type: ignore[attr-defined]
    ev = types.ModuleType("evaluate")
    ev.__spec__ = importlib.machinery.ModuleSpec("evaluate", None)
    ev.load = lambda *a, **k: Accuracy()  # type: ignore[attr-defined]
    sys.modules["datasets"], sys.modules["evaluate"] = ds, ev


def _local_head_attention() -> None:
    """Attention on head-sharded DTensors computed on the local heads (what DTensor's rule for
    the GPU flash kernel does): heads are independent, so the result is the same."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate, Shard

    orig = F.scaled_dot_product_attention

    def sdpa(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(q, DTensor) or any(p not in (Shard(1), Replicate()) for p in q.placements):
            return orig(q, k, v, *args, **kwargs)
        out = orig(q.to_local(), k.to_local(), v.to_local(), *args, **kwargs)
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)

    F.scaled_dot_product_attention = sdpa


def _worker(rank: int, world: int, port: int, out_dir: str, script: Script, steps: int,
            slow: tuple[int, str, float] | None) -> None:
    become_local_rank(rank, world, port)
    src = Path(out_dir) / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name, text in script.siblings:
        (src / name).parent.mkdir(parents=True, exist_ok=True)  # a package's module: pkg/mod.py
        (src / name).write_text(text)
    sys.path.insert(0, str(src))
    # CPU in place of an accelerator: the scripts ask torch which accelerator to use.
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cpu")  # type: ignore[assignment]
    sys.modules.setdefault("pippy", _pippy_shim())
    sys.argv = [script.name, *script.argv]
    if script.offline_hf:
        _offline_hf(src)
    if script.init_pg:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    if not torch.cuda.is_available():
        # DTensor has a sharding rule for the GPU flash-attention kernel, none for the CPU one.
        _local_head_attention()
        # torchtitan-era expert parallel syncs the current CUDA stream before reading splits.
        torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(  # type: ignore[assignment]
            synchronize=lambda: None)
    for name, _ in script.siblings:
        if "/" in name:
            continue  # a package's module: the script imports it
        mod = __import__(Path(name).stem)
        if hasattr(mod, "verify_min_gpu_count"):
            mod.verify_min_gpu_count = lambda min_gpus=2: True
    code = compile(instrument(script.text), f"<{script.origin}>", "exec")
    g: dict[str, Any] = {"__name__": "__main__", "__ss_drv": Driver(rank, out_dir, steps, slow)}
    try:
        exec(code, g)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(script: Script, out_dir: str | os.PathLike[str], ranks: int, steps: int = 30,
           slow: tuple[int, str, float] | None = None) -> Path:
    """Run ``script`` on ``ranks`` gloo processes under stepscope; the run directory.

    ``slow=(rank, phase, ms)`` adds ``ms`` per forward call of the model on ``rank``, in
    ``phase`` (``"forward"`` or ``"backward"``).
    """
    return spawn_local(_worker, ranks, out_dir, script, steps, slow)


#: The fetched scripts this module knows: name → (repo, path, siblings, ranks, Script options).
KNOWN: dict[str, tuple[str, str, tuple[str, ...], int, dict[str, Any]]] = {
    "tp": ("pytorch/examples", "distributed/tensor_parallelism/tensor_parallel_example.py",
           ("distributed/tensor_parallelism/log_utils.py",), 2, {}),
    "fsdp_tp": ("pytorch/examples", "distributed/tensor_parallelism/fsdp_tp_example.py",
                ("distributed/tensor_parallelism/log_utils.py",
                 "distributed/tensor_parallelism/llama2_model.py"), 4, {}),
    "pippy": ("pytorch/PiPPy", "examples/basic/example_train.py", (), 3, {}),
    "accelerate": ("huggingface/accelerate", "examples/nlp_example.py", (), 2,
                   {"argv": ("--cpu",), "init_pg": True, "offline_hf": True}),
}


def main(argv: list[str]) -> None:
    """``python tests/support/third_party.py NAME OUT [RANK PHASE MS]``: run a fetched script, print
    what stepscope reports (top verdict, stragglers, pipeline bottleneck, expert imbalance);
    ``torchtitan-ep OUT SKEW RANKS`` runs torchtitan's expert-parallel MoE (``ep_moe_train.py``)."""
    from stepscope.analysis.run import analyze_run

    if argv[0] == "torchtitan-ep":  # ... torchtitan-ep OUT SKEW RANKS: the router's bias on r1
        ep = torchtitan_moe(argv=("--skew", argv[2], "--hot", "1", "--per-token-ms", "0.5"))
        if ep is None:
            raise SystemExit(paths.not_fetched("pytorch/torchtitan"))
        script, ranks, slow = ep, int(argv[3]), None
    else:
        repo, path, sib, ranks, kw = KNOWN[argv[0]]
        found_script = from_mirror(repo, path, sib, **kw)
        if found_script is None:
            raise SystemExit(paths.not_fetched(repo))
        script = found_script
        slow = (int(argv[2]), argv[3], float(argv[4])) if len(argv) > 2 else None
    doc = analyze_run(launch(script, argv[1], ranks, steps=20, slow=slow))
    found = {"script": script.origin, "injected": slow,
             "verdicts": [(v["kind"], v["severity"]) for v in doc["verdicts"]],
             "stragglers": [(s["rank"], s["phase"], s["excess_ms"]) for s in doc["stragglers"]],
             "bottleneck_stage": (doc.get("pipeline") or {}).get("bottleneck_stage"),
             "experts": [(g["max_recv_rank"], g["imbalance"], g["lost_ms_per_step"])
                         for g in (doc.get("experts") or {}).get("groups", [])]}
    print("STEPSCOPE-THIRD-PARTY", found)


if __name__ == "__main__":
    main(sys.argv[1:])
