"""Mixture of experts, shared by the MoE families: the experts, two routers, the sparse block.

Parameter names are the published checkpoints' (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_experts.*`), so a checkpoint loads as it is.

The reference forward is static and branch-free: every expert runs on every token and the routing
weights, zero for experts not chosen, combine them. That is exact and CUDA-graph safe but costs E
experts per token; it is the oracle and the CPU path for tiny models. Inference swaps in grouped expert
GEMMs over the chosen experts only (ddtree.runtime.fused).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from .layers import MLP, Collectives, shard_mlp_weights


class Expert(MLP):
    """One routed expert: the gated MLP, as its own class so that the fused modules, which look classes up
    exactly, never swap an expert on its own (the fused MoE block owns the experts' weights)."""


class SoftmaxTopK(nn.Module):
    """Qwen3-MoE: softmax over the experts, the top k, renormalised to sum 1 when `normalize`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        probs = torch.softmax(nn.functional.linear(x, self.weight).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class GroupLimitedSigmoid(nn.Module):
    """DeepSeek-V3 / Kimi K2 (`noaux_tc`): sigmoid scores; the choice adds a per-expert correction bias;
    experts come from the `topk_group` best of `n_group` groups (a group scores its two best experts);
    the chosen experts' plain sigmoid scores are the weights, renormalised when `normalize`, times
    `scaling`. Scores are computed in fp32."""

    e_score_correction_bias: Tensor  # a buffer, declared for the type checker

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        normalize: bool,
        scaling: float,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.normalize, self.scaling = normalize, scaling

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        n, experts = x.shape[0], self.weight.shape[0]
        scores = nn.functional.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(n, self.n_group, experts // self.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(self.topk_group, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(n, experts), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(x.dtype), ids


class SparseMoE(nn.Module):
    """Routed experts (and, for DeepSeek, always-on shared experts summed in)."""

    def __init__(self, gate: nn.Module, num_experts: int, hidden: int, inter: int, shared_inter: int = 0):
        super().__init__()
        # one of the routers above (a module with top_k, called as x -> (weights, ids))
        self.gate = cast(SoftmaxTopK | GroupLimitedSigmoid, gate)
        self.experts = nn.ModuleList(Expert(hidden, inter) for _ in range(num_experts))
        self.shared_experts = MLP(hidden, shared_inter) if shared_inter else None
        self.tp: Collectives | None = None  # set once sharded: each rank holds some experts, outputs are partial
        # the router's expert ids are global; this module holds experts [first_expert, first_expert + len(experts))
        # (all of them unless sharded by shard_experts)
        self.num_experts, self.first_expert = num_experts, 0

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (weights [N, k], expert ids [N, k])."""
        return self.gate(x)

    def combine(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """The weighted sum of the chosen experts held here, [N, H]. Reference: every expert on every token."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)
        dense = dense[:, self.first_expert : self.first_expert + len(self.experts)]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + dense[:, e : e + 1] * expert(x)
        return out

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        out = self.combine(flat, *self.route(flat))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        out = out.view(shape)
        return self.tp.all_reduce(out) if self.tp else out


def shard_experts(moe: SparseMoE, tp: Collectives, whole: bool = True) -> None:
    """Split a MoE block over tp.world ranks; the router stays replicated (every rank routes every token
    the same way) and each rank computes its share of each token, summed by the block's one all-reduce.

    whole (expert parallelism): each rank keeps num_experts / world whole experts (rank r: [r * n,
    (r + 1) * n)). Otherwise every rank keeps every expert, each split like a dense MLP (gate/up rows,
    down columns): more, smaller GEMMs, but no rank waits on a popular expert. Shared experts are always
    split like a dense MLP."""
    if whole:
        n = moe.num_experts // tp.world
        moe.first_expert = tp.rank * n
        moe.experts = nn.ModuleList(list(moe.experts)[moe.first_expert : moe.first_expert + n])
    else:
        for expert in cast(list[Expert], list(moe.experts)):
            shard_mlp_weights(expert, tp.rank, expert.gate_proj.out_features // tp.world)
    if moe.shared_experts is not None:
        shard_mlp_weights(moe.shared_experts, tp.rank, moe.shared_experts.gate_proj.out_features // tp.world)
    moe.tp = tp
