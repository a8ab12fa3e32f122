"""GPU kernel taxonomy: a versioned, token-based classifier of Kineto device-event names."""

from __future__ import annotations

import re
from functools import lru_cache

# Bump when a rule changes what a name maps to: reports carry it so numbers stay comparable.
TAXONOMY_VERSION = "2"

GEMM = "gemm"
ATTENTION = "attention"
COMMUNICATION = "communication"
MEMORY = "memory"
NORM = "norm"
OPTIMIZER = "optimizer"
REDUCTION = "reduction"
ELEMENTWISE = "elementwise"
OTHER = "other"

CATEGORIES: tuple[str, ...] = (
    GEMM, ATTENTION, COMMUNICATION, MEMORY, NORM, OPTIMIZER, REDUCTION, ELEMENTWISE, OTHER,
)

# The three classes the time breakdown unions over. "other" (unclassified) kernels still
# occupy the SMs, so they count as compute, as HTA does.
COMPUTE = "compute"
COMM = "comm"
MEM = "memory"
CLASS_OF: dict[str, str] = {c: COMPUTE for c in CATEGORIES}
CLASS_OF[COMMUNICATION] = COMM
CLASS_OF[MEMORY] = MEM

# Names are split on anything that is not a letter or digit; rules look at whole tokens so
# that `mm` matches `triton_tem_fused_mm_0` but not `record_param_comms`.
_SPLIT = re.compile(r"[^a-z0-9]+")

# Each rule: (category, exact tokens, token prefixes, token substrings). Substrings are only
# used for stems long and distinctive enough not to collide (`gemm`, `norm`, `attention`).
# Order matters: the first rule that matches wins (attention before gemm, because flash and
# cutlass-fmha kernels are also cutlass kernels).
_Rule = tuple[str, frozenset[str], tuple[str, ...], tuple[str, ...]]
_RULES: tuple[_Rule, ...] = (
    (MEMORY, frozenset({"memcpy", "memset", "memcpyasync", "dma"}), ("hipmemcpy", "hipmemset"), ()),
    (
        COMMUNICATION,
        frozenset({"allreduce", "allgather", "reducescatter", "alltoall", "sendrecv"}),
        ("nccl", "rccl", "nvshmem", "hccl", "msccl"),
        (),
    ),
    (
        ATTENTION,
        frozenset({"sdpa", "attn", "mha", "fmha", "flash", "flashattn", "flashinfer"}),
        ("flash", "fmha", "sdpa"),
        ("attention", "fmha", "flashattn"),
    ),
    (
        GEMM,
        frozenset({"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "gemv", "conv",
                   "convolve", "fprop", "dgrad", "wgrad", "nvjet", "xmma", "cijk", "scudnn",
                   "hcudnn"}),
        ("cublas", "cutlass", "splitkreduce", "fft", "implicit", "nvjet", "hipblaslt",
         "rocblas", "cijk", "wgmma", "hgmma", "gemm", "sgemm", "hgemm", "dgemm", "igemm", "conv"),
        ("gemm", "gemv", "matmul", "xmma", "convolution", "winograd"),
    ),
    (
        NORM,
        frozenset({"bn", "ln", "rmsnorm", "layernorm", "groupnorm", "batchnorm"}),
        ("rms", "layernorm", "batchnorm", "groupnorm", "instancenorm", "rowwisemoments",
         "gammabeta"),
        ("norm",),
    ),
    (
        OPTIMIZER,
        frozenset({"adam", "adamw", "sgd", "lamb", "adagrad", "rmsprop", "lion", "optimizer"}),
        ("adam",),
        ("multitensor", "adam"),
    ),
    (
        REDUCTION,
        frozenset({"reduce", "sum", "mean", "argmax", "argmin", "softmax", "logsoftmax",
                   "scan", "cumsum", "topk", "sort", "cub", "histogram", "nll", "loss",
                   "crossentropy"}),
        ("reduce", "softmax", "devicescan", "devicereduce", "deviceradixsort", "radixsort",
         "segmented", "cunn", "crossentropy"),
        ("reduce", "softmax"),
    ),
    (
        ELEMENTWISE,
        frozenset({"elementwise", "poi", "fill", "copy", "cat", "index", "gather", "scatter",
                   "add", "mul", "div", "sub", "relu", "gelu", "silu", "sigmoid", "tanh",
                   "dropout", "pointwise", "embedding", "where", "clamp", "cast", "transpose",
                   "permute", "pad", "im2col", "col2im", "upsample", "maxpool", "avgpool",
                   "pool", "unary", "binary", "functor", "fused"}),
        ("elementwise", "vectorized", "unrolled", "catarray", "indexselect", "index",
         "scatter", "gather", "embedding", "fill", "copy", "dropout", "maxpool", "avgpool",
         "im2col", "pointwise", "triton", "nchwtonhwc", "nhwctonchw"),
        ("elementwise", "functor", "pooling"),
    ),
)

# The exact-token rules for memcpy kinds come from Kineto's names ("Memcpy HtoD (Pageable ->
# Device)") or the event's args.kind on ROCm.
_COPY_KINDS = ("htod", "dtoh", "dtod", "ptop", "htoh")


# Library and namespace names that say nothing about the kernel's kind (FBGEMM's permute
# kernels are not GEMMs).
_IGNORED = frozenset({"fbgemm", "void", "anonymous", "namespace"})


def tokens(name: str) -> list[str]:
    """Lower-case alphanumeric tokens of a kernel name (``a::b<c>_d`` → a, b, c, d)."""
    return [t for t in _SPLIT.split(name.lower()) if t and t not in _IGNORED]


def _matches(toks: list[str], exact: frozenset[str], prefixes: tuple[str, ...],
             subs: tuple[str, ...]) -> bool:
    for t in toks:
        if t in exact or t.startswith(prefixes):
            return True
        if subs and any(s in t for s in subs):
            return True
    return False


@lru_cache(maxsize=65536)
def classify(name: str, cat: str = "kernel") -> str:
    """The taxonomy category of a device event, from its name and Kineto ``cat``.

    Example::

        >>> classify("ampere_sgemm_128x64_nn")
        'gemm'
        >>> classify("record_param_comms")
        'other'
    """
    c = cat.lower()
    if c in ("gpu_memcpy", "gpu_memset", "memcpy", "memset"):
        return MEMORY
    toks = tokens(name)
    # Triton names carry their kind in the second token (poi=pointwise, red/per=reduction,
    # tem=template, usually a matmul); look there before generic words like "fused".
    if len(toks) >= 2 and toks[0] == "triton":
        kind = toks[1]
        if kind == "tem" or "mm" in toks or "bmm" in toks:
            return GEMM
        if kind in ("red", "per"):
            return REDUCTION
        if kind == "poi":
            return ELEMENTWISE
    # Kinds that are unambiguous anywhere in the name (an attention kernel is often a cutlass
    # template instance, so its "head" says cutlass while its arguments say attention).
    for category, exact, prefixes, subs in _RULES[:3]:
        if _matches(toks, exact, prefixes, subs):
            return category
    # multi_tensor_apply is split into generic tokens; recognise the phrase.
    if "multi_tensor" in name.lower() or "multitensor" in name.lower():
        return OPTIMIZER
    # Template and call arguments are full of words like `sum` or `copy`; the function's own
    # name (before the first `<` or `(`) is the better witness, the rest only a fallback.
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    head = tokens(name[:cut])
    for toks_ in (head, toks):
        for category, exact, prefixes, subs in _RULES[3:]:
            if _matches(toks_, exact, prefixes, subs):
                return category
    return OTHER


def copy_kind(name: str, kind_arg: str | None = None) -> str:
    """``HtoD``/``DtoH``/``DtoD``/``PtoP``/``HtoH``/``Memset`` for a memory event, else ``other``."""
    if kind_arg:
        k = kind_arg.replace(" ", "").lower()
        for known in _COPY_KINDS:
            if known in k:
                return _pretty_kind(known)
    toks = tokens(name)
    for t in toks:
        if t in _COPY_KINDS:
            return _pretty_kind(t)
    if any(t.startswith(("memset", "hipmemset")) for t in toks):
        return "Memset"
    return "other"


def _pretty_kind(k: str) -> str:
    return {"htod": "HtoD", "dtoh": "DtoH", "dtod": "DtoD", "ptop": "PtoP", "htoh": "HtoH"}[k]


def kernel_class(category: str) -> str:
    """The breakdown class (compute, comm, memory) a category counts towards."""
    return CLASS_OF.get(category, COMPUTE)
