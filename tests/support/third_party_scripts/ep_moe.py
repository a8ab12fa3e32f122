"""Re-creation (own code) of the expert-parallel MoE pattern of pytorch/torchtitan
(``torchtitan/models/moe.py`` and ``torchtitan/distributed/expert_parallel.py`` as of
2025-09): a token-choice top-k router with a per-expert routing bias, a reorderer that sorts
tokens by expert, grouped experts (SwiGLU weights stacked on an expert dimension), and an
``ExpertParallel`` style that shards the experts over the mesh and wraps their forward in a
dispatch (exchange of per-expert counts with ``dist.all_to_all_single``, then the tokens with
the functional ``all_to_all_single_autograd``, uneven splits) and a combine (the reverse
all-to-all). As there, the functional collective is imported by name at module import.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


@dataclass
class MoEArgs:
    num_experts: int = 8
    num_shared_experts: int = 1
    top_k: int = 1
    use_grouped_mm: bool = False
    load_balance_coeff: float | None = 1e-3


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ws = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)]
        local = ws[0].shape[0]
        # counts is rank-major ([from rank 0: e0, e1, ..., from rank 1: e0, ...]): regroup
        # the received rows expert by expert, run each expert, and put rows back in place.
        per_block = counts.long().tolist()
        blocks = list(torch.split(x, per_block))
        outs: list[torch.Tensor | None] = [None] * len(blocks)
        for e in range(local):
            ids = list(range(e, len(blocks), local))
            rows = torch.cat([blocks[i] for i in ids]) if ids else x[:0]
            h = F.silu(rows @ ws[0][e].T) * (rows @ ws[2][e].T)
            y = h @ ws[1][e].T
            for i, part in zip(ids, torch.split(y, [per_block[i] for i in ids]), strict=True):
                outs[i] = part
        return torch.cat([o for o in outs if o is not None]) if x.shape[0] else x * 0

    def init_weights(self, std: float) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=std)


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.gate(x).float())
        # The bias steers the choice only; the gating value is the unbiased score.
        _, chosen = torch.topk(scores if bias is None else scores + bias, self.top_k, dim=1)
        top = scores.gather(1, chosen)
        counts = torch.histc(chosen.view(-1).float(), bins=self.num_experts, min=0,
                             max=self.num_experts)
        return top, chosen, counts


class MoE(nn.Module):
    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.top_k = moe_args.top_k
        self.experts = GroupedExperts(dim, hidden_dim, moe_args.num_experts)
        self.router = Router(dim, moe_args.num_experts, moe_args.top_k)
        self.register_buffer("expert_bias", torch.zeros(moe_args.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top, chosen, counts = self.router(x, self.expert_bias)
        order = torch.argsort(chosen.view(-1), stable=True)
        scores = top.view(-1)[order]
        index = (order // self.top_k).reshape(-1, 1).expand(-1, x.shape[-1])
        routed = torch.gather(x, 0, index) * scores.reshape(-1, 1)
        out = torch.zeros_like(x).scatter_add(0, index, self.experts(routed, counts))
        return out.reshape(shape)

    def init_weights(self, std: float, buffer_device: torch.device) -> None:
        self.experts.init_weights(std)
        nn.init.trunc_normal_(self.router.gate.weight, mean=0.0, std=std)


class ExpertParallel(ParallelStyle):
    """Experts sharded on their first dimension; tokens moved to their expert's rank and back."""

    def __init__(self) -> None:
        super().__init__()
        self.input_splits: list[int] = []
        self.output_splits: list[int] = []

    def _dispatch(self, mod: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor],
                  mesh: object) -> tuple[torch.Tensor, torch.Tensor]:
        routed, counts = inputs
        group = mesh.get_group()  # type: ignore[attr-defined]
        ep = mesh.shape[0]  # type: ignore[attr-defined]
        with torch.no_grad():
            received = counts.new_empty(counts.shape[0])
            dist.all_to_all_single(received, counts, group=group)
            self.input_splits = [int(v) for v in counts.view(ep, -1).sum(1).tolist()]
            self.output_splits = [int(v) for v in received.view(ep, -1).sum(1).tolist()]
        routed = all_to_all_single_autograd(routed, self.output_splits, self.input_splits, group)
        return routed, received

    def _combine(self, mod: nn.Module, out: torch.Tensor, mesh: object) -> torch.Tensor:
        return all_to_all_single_autograd(out, self.input_splits, self.output_splits,
                                          mesh.get_group())  # type: ignore[attr-defined]

    @staticmethod
    def _partition(name: str, mod: nn.Module, mesh: object) -> None:
        for pname, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))  # type: ignore[arg-type]

    def _apply(self, module: nn.Module, device_mesh: object) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._partition,  # type: ignore[arg-type]
                                 input_fn=self._dispatch, output_fn=self._combine)
