"""Layers shared by the model families and the drafter: RoPE, RMSNorm, the static KV cache, the gated MLP."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..runtime import kernels

if TYPE_CHECKING:
    from ..runtime.parallel import TensorParallel


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Inverse frequencies, with Llama-3 style long-context scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(mid, scaled, inv_freq)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind is not None:
        raise ValueError(f"unsupported rope scaling '{kind}' (supported: llama3, linear)")
    return inv_freq.float()


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin of shape [*positions.shape, head_dim] in the rotate-half layout."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [bs, heads, T, hd]; cos/sin: [bs, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # one fused kernel on CUDA; it needs the weight in the input's dtype (fp32 weights under autocast)
        return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)


class KVCache(nn.Module):
    """Static per-layer cache [max_batch, kv_heads, max_slots + 1, head_dim].

    The extra last slot is a trash slot: padded tokens write there and no mask ever shows it.
    `storage` [2, max_batch, kv_heads, max_slots + 1, head_dim], when given, is where k and v live
    (the target keeps all layers in one buffer so that compaction is one gather, not one per layer).
    """

    k: Tensor  # buffers, declared for the type checker (register_buffer does not declare them)
    v: Tensor

    def __init__(
        self, max_batch: int, kv_heads: int, max_slots: int, head_dim: int, dtype, device, storage: Tensor | None = None
    ):
        super().__init__()
        shape = (max_batch, kv_heads, max_slots + 1, head_dim)
        if storage is None:
            storage = torch.zeros((2, *shape), dtype=dtype, device=device)
        assert storage.shape == (2, *shape), f"cache storage {tuple(storage.shape)} is not {(2, *shape)}"
        self.register_buffer("k", storage[0], persistent=False)
        self.register_buffer("v", storage[1], persistent=False)

    @property
    def trash_slot(self) -> int:
        return self.k.shape[2] - 1

    def update(self, slots: Tensor, k: Tensor, v: Tensor, rows: Tensor | None = None) -> None:
        """Write k, v [bs, kv_heads, T, hd] at per-sequence slots [bs, T] of cache rows `rows`
        (default 0..bs-1, the decode batch)."""
        bs = slots.shape[0]
        index = torch.arange(bs, device=slots.device) if rows is None else rows
        # advanced indexing on dims 0 and 2 puts the index dims first: [bs, T, heads, hd]
        self.k[index[:, None], :, slots] = k.transpose(1, 2)
        self.v[index[:, None], :, slots] = v.transpose(1, 2)

    def read(self, bs: int, span: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys/values of the first `span` slots: a view for rows 0..bs-1, a gathered copy otherwise."""
        if rows is None:
            return self.k[:bs, :, :span], self.v[:bs, :, :span]
        return self.k[rows, :, :span], self.v[rows, :, :span]


def concat_views(params: list[Tensor]) -> Tensor:
    """Concatenate parameters along dim 0 and re-point each at its slice of the result."""
    fused = torch.cat([p.detach() for p in params], dim=0)
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[start : start + n]
        start += n
    return fused


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.w_gate_up: Tensor | None = None
        self.kernels = False  # Triton silu_mul on the fused gate/up output, see Transformer.fuse()
        self.tp: TensorParallel | None = None  # set once sharded: down_proj outputs are partial sums

    def fuse(self) -> None:
        self.w_gate_up = concat_views([self.gate_proj.weight, self.up_proj.weight])

    def forward(self, x: Tensor) -> Tensor:
        if self.w_gate_up is not None and self.kernels and x.numel() == x.shape[-1]:  # a batch-1 decode step
            out = kernels.gemv(
                F.linear(x, self.w_gate_up), self.down_proj.weight, silu_mul=True, config=kernels.GEMV_CONFIGS["down"]
            )
        elif self.w_gate_up is not None and self.kernels:
            config, inter = kernels.SKINNY_CONFIGS.get("gate_up"), self.down_proj.weight.shape[1]
            if kernels.skinny_applies(x.numel() // x.shape[-1], inter, x.shape[-1], config, x.dtype):
                out = self.down_proj(kernels.skinny_linear(x, self.w_gate_up, config, gate_up=True))
            else:
                out = self.down_proj(kernels.silu_mul(F.linear(x, self.w_gate_up)))
        else:
            if self.w_gate_up is not None:
                gate, up = F.linear(x, self.w_gate_up).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            out = self.down_proj(F.silu(gate) * up)
        return self.tp.all_reduce(out) if self.tp else out
