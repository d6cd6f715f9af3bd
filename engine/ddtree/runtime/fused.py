"""Fused modules for inference, swapped in once at load in place of the reference ones.

The model families (ddtree.models) and the drafter are branch-free reference forwards. Inference runs one
of two backends, chosen once per model by `use_backend`:

- "torch": q/k/v, gate/up and MLA's query and latent projections as one GEMM each (the weights become
  views into one concatenated tensor, so parameter names and state dicts stay Hugging Face's and no
  memory is duplicated); the rest as the reference.
- "triton": the same GEMMs plus the Triton kernels of ddtree.runtime.kernels: q/k norm + RoPE + cache
  write in one kernel, tree attention (MLA's over the latent cache: mla_kernels), each residual add fused
  with the RMSNorm after it, and per shape bucket GEMV (one row), skinny GEMMs (2-64 rows) or a wide
  one (65-192 rows) for some projections. The shape buckets are data on the modules below (class
  attributes), measured on an H200 or an H100 (docs/engine.md, "Fused kernels").

A swapped module keeps its parameters; moving or casting a model (Module.to) re-creates them, so a fused
module then turns back into its reference class, and the next Engine swaps it in again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import deepseek_v3
from ..models.layers import MLP, RMSNorm, concat_views
from ..models.llama import Attention, DecoderLayer, Transformer
from ..models.moe import GroupLimitedSigmoid, SoftmaxTopK, SparseMoE
from ..models.quant import Fp8BlockLinear, Int4Linear, dequantize_fp8_block, dequantize_int4
from ..speculative.drafter import DFlashDrafter, DrafterAttention, DrafterLayer
from ..speculative.tree import Tree, build_ddtree
from ..speculative.verify import Walk, walk
from . import kernels
from .mla_kernels import latent_attention, latent_rope_cache
from .moe_kernels import group_limited_topk, moe_experts, softmax_topk
from .quant_kernels import fp8_block_linear, int4_linear, moe_experts_int4

BACKENDS = ("reference", "torch", "triton")

# a GEMM kernel's configuration: (BLOCK_N, BLOCK_K, K splits, warps, stages)
Config = tuple[int, int, int, int, int]


class _Swapped(nn.Module):
    """A module class swapped in for `reference` (its base class) by `swap`: reverts on moves."""

    reference: type[nn.Module]

    def adopt(self) -> None:
        """Set up what the fused forward needs from the reference module's parameters."""

    def drop(self) -> None:
        """Forget what adopt() set up."""

    def _apply(self, fn, recurse=True):
        self.drop()
        self.__class__ = self.reference
        return self._apply(fn, recurse)  # the reference class's


def swap(module: nn.Module, cls: type[nn.Module]) -> None:
    """Turn `module` into an instance of `cls` (its reference class, or a _Swapped subclass of it),
    keeping its parameters."""
    if isinstance(module, _Swapped):
        module.drop()
        _set_class(module, module.reference)
    if issubclass(cls, _Swapped):
        _set_class(module, cls)
        cast(_Swapped, module).adopt()


def _set_class(module: nn.Module, cls: type[nn.Module]) -> None:
    module.__class__ = cls


# ---- the target ----------------------------------------------------------------------------------


class _FusedQKV(_Swapped):
    """An attention module's q_proj, k_proj and v_proj as views into one weight (and bias), wqkv."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    wqkv: Tensor | None = None
    bqkv: Tensor | None = None

    def adopt(self) -> None:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.wqkv = concat_views([p.weight for p in projs])
        self.bqkv = concat_views([p.bias for p in projs]) if self.q_proj.bias is not None else None

    def drop(self) -> None:
        self.wqkv = self.bqkv = None


def skinny_o(out: Tensor, o_proj: nn.Linear, tp, config: Config | None) -> Tensor | None:
    """o_proj(out) as the skinny GEMM's K-split partial sums [splits, *out.shape[:-1], hidden], for
    add_rms_norm to add up, when the kernel serves this shape; None otherwise."""
    rows, w = out.shape[0] * out.shape[1], o_proj.weight
    if (
        config is None
        or tp is not None  # the all-reduce takes one tensor, not K-split parts
        or o_proj.bias is not None
        or not kernels.skinny_applies(rows, w.shape[0], w.shape[1], config, out.dtype)
    ):
        return None
    return kernels.skinny_linear(out, w, config)


def skinny_qkv(x: Tensor, wqkv: Tensor, bqkv: Tensor | None, config: Config | None) -> Tensor:
    """The fused q/k/v projection of x: the skinny GEMM (whole, not K-split) where it serves the shape and
    there is no bias, else cuBLAS."""
    rows = x.shape[0] * x.shape[1]
    if bqkv is None and kernels.skinny_applies(rows, wqkv.shape[0], wqkv.shape[1], config, x.dtype):
        return kernels.skinny_linear(x, wqkv, config)
    return F.linear(x, wqkv, bqkv)


class FusedAttention(_FusedQKV, Attention):
    """q, k and v from one GEMM."""

    reference = Attention

    def qkv(self, x: Tensor) -> Tensor:
        return F.linear(x, self.wqkv, self.bqkv)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        bs, T, _ = x.shape
        sizes = [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim]
        q, k, v = self.qkv(x).split(sizes, dim=-1)
        return (
            q.view(bs, T, self.n_heads, self.head_dim),
            k.view(bs, T, self.n_kv, self.head_dim),
            v.view(bs, T, self.n_kv, self.head_dim),
        )


class TritonAttention(FusedAttention):
    """The Triton path of attention. Shape buckets (measured on the Qwen3-8B shape on an H200,
    2026-11-29, commits e728955 and 108c21a; docs/engine.md, "Fused kernels"):
    - one row (a batch-1 decode step): q/k/v and o as GEMVs, (BLOCK_N, BLOCK_K, warps, stages) below;
    - 2-64 rows: q/k/v as a skinny GEMM and o as one whose K-split partial sums the next add_rms_norm adds
      up (BLOCK_N, BLOCK_K, K splits, warps, stages), when it divides the weight;
    - the paged tree attention for 1..max_tokens query tokens per sequence (decode steps and every tree up
      to B = 255; an `ar` round at batch 64 took 8.44 ms with it, 33.4 ms through SDPA over keys gathered
      by the slot map, on an H200, 2026-12-03); SDPA over gathered keys for longer prefill chunks."""

    qkv_gemv = (8, 256, 4, 3)
    qkv_skinny: Config | None = (64, 128, 1, 4, 4)
    o_gemv = (16, 1024, 8, 3)
    o_skinny: Config | None = (64, 128, 2, 4, 4)
    max_tokens = 256

    def uses_tree_attention(self, bs: int, T: int) -> bool:
        return T <= self.max_tokens

    def metadata(self, mask: Tensor) -> kernels.MaskMeta | None:
        bs, _, T, _ = mask.shape
        return kernels.mask_meta(mask) if self.uses_tree_attention(bs, T) else None

    def qkv(self, x: Tensor) -> Tensor:
        if x.shape[0] * x.shape[1] == 1:
            return kernels.gemv(x, self.wqkv, self.bqkv, config=self.qkv_gemv)
        return skinny_qkv(x, self.wqkv, self.bqkv, self.qkv_skinny)

    def rotate_and_cache(
        self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, rows: Tensor | None
    ) -> Tensor:
        q_norm, k_norm = self.q_norm, self.k_norm
        norms = (
            (q_norm.weight, k_norm.weight, q_norm.eps)
            if isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm)
            else (None, None, 0.0)
        )
        return kernels.qk_norm_rope_kv(
            q,
            k,
            v,
            cos,
            sin,
            *norms,
            self.kv_cache.k,
            self.kv_cache.v,
            slots,
        )

    def attend(self, q: Tensor, mask: Tensor, rows: Tensor | None, meta: kernels.MaskMeta | None) -> Tensor:
        bs, _, T, _ = q.shape
        if self.uses_tree_attention(bs, T):
            cache, (mask, bounds) = self.kv_cache, kernels.mask_and_bounds(mask, meta)
            return kernels.attention(q, cache.k, cache.v, cache.slot_map, mask, rows, bounds)
        return super().attend(q, mask, rows, meta)

    def output(self, out: Tensor) -> Tensor:
        if out.shape[0] * out.shape[1] == 1:
            out = kernels.gemv(out, self.o_proj.weight, self.o_proj.bias, config=self.o_gemv)
        elif (parts := skinny_o(out, self.o_proj, self.tp, self.o_skinny)) is not None:
            return parts
        else:
            out = self.o_proj(out)
        return self.tp.all_reduce(out) if self.tp else out


class FusedMLP(_Swapped, MLP):
    """gate and up from one GEMM."""

    reference = MLP
    w_gate_up: Tensor | None = None

    def adopt(self) -> None:
        self.w_gate_up = concat_views([self.gate_proj.weight, self.up_proj.weight])

    def drop(self) -> None:
        self.w_gate_up = None

    def activate(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.w_gate_up).chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonMLP(FusedMLP):
    """The Triton path of the MLP (shape buckets as in TritonAttention): one row: down as a GEMV that
    applies silu(gate) * up on the fly; 2-64 rows: gate/up as a skinny GEMM with silu_mul in its epilogue,
    and down as a skinny GEMM; otherwise cuBLAS and the silu_mul kernel, and at 65-192 rows (a verify at
    batch 16 of up to 12 tokens a sequence) down as a wide GEMM. The skinny and wide down projections
    return K-split partial sums for the layer's add_rms_norm to add up, where the layer does (partial_sums:
    TritonDecoderLayer and TritonDrafterLayer set it; a MoE's shared experts and DFlash2's layers add the
    output themselves); elsewhere down runs on cuBLAS. Measured on an H100 (bench.wide_sweep): at 144 rows
    down with its add_rms_norm 0.047 against cuBLAS's 0.049 ms a layer; q/k/v and o slower than cuBLAS,
    and down at 256 rows."""

    down_gemv = (8, 512, 8, 3)
    gate_up_skinny: Config | None = (64, 128, 1, 4, 4)
    down_skinny: Config | None = (64, 128, 2, 4, 4)
    down_wide: Config | None = (64, 128, 2, 4, 4)
    partial_sums = False

    @classmethod
    def config_for(cls, rows: int) -> Config | None:
        """The gate/up skinny GEMM's configuration at `rows` rows."""
        return cls.gate_up_skinny

    def forward(self, x: Tensor) -> Tensor:
        rows, inter = x.numel() // x.shape[-1], self.down_proj.weight.shape[1]
        config, w = self.config_for(rows), self.down_proj.weight
        if rows == 1:
            out = kernels.gemv(F.linear(x, self.w_gate_up), w, silu_mul=True, config=self.down_gemv)
            return self.tp.all_reduce(out) if self.tp else out
        if kernels.skinny_applies(rows, inter, x.shape[-1], config, x.dtype):
            act = kernels.skinny_linear(x, self.w_gate_up, config, gate_up=True)
        else:
            act = kernels.silu_mul(F.linear(x, self.w_gate_up))
        # K-split parts only where the layer's add_rms_norm sums them (no all-reduce, no bias); the skinny
        # and wide GEMMs serve disjoint row counts
        if self.partial_sums and self.tp is None and self.down_proj.bias is None:
            down, wide = self.down_skinny, self.down_wide
            if kernels.skinny_applies(rows, w.shape[0], inter, down, x.dtype):
                return kernels.skinny_linear(act, w, down)
            if kernels.wide_applies(rows, w.shape[0], inter, wide, x.dtype):
                return kernels.wide_linear(act, w, wide)
        out = self.down_proj(act)
        return self.tp.all_reduce(out) if self.tp else out


class TritonDecoderLayer(_Swapped, DecoderLayer):
    """Each residual add fused with the RMSNorm after it (this layer's post-attention norm, then the next
    layer's input norm or the final norm). Attention and MLP outputs arrive already all-reduced under
    tensor parallelism, before the add, as in the reference."""

    reference = DecoderLayer

    def adopt(self) -> None:
        # the add below sums the K-split parts of the MLP's down projection (TritonMLP, swapped in after
        # this layer: its instance keeps the flag)
        vars(self.mlp)["partial_sums"] = True

    def drop(self) -> None:
        vars(self.mlp).pop("partial_sums", None)

    def forward(self, x, h, next_norm, cos, sin, slots, mask, rows, meta):
        post = self.post_attention_layernorm
        h, x = kernels.add_rms_norm(self.self_attn(h, cos, sin, slots, mask, rows, meta), x, post.weight, post.eps)
        h, x = kernels.add_rms_norm(self.mlp(h), x, next_norm.weight, next_norm.eps)
        return x, h


class FusedLatentAttention(_Swapped, deepseek_v3.Attention):
    """MLA's two projections of the layer input, the query's (q_a_proj, or q_proj) and the latent's
    (kv_a_proj_with_mqa), as one GEMM over a weight (and bias) they become views of, w_a: the input is
    read once and one launch goes. Quantized projections, or a bias on only one of them, stay apart."""

    reference = deepseek_v3.Attention
    takes_quantized = True  # what is quantized keeps its own module
    w_a: Tensor | None = None
    b_a: Tensor | None = None

    def _input_projections(self) -> tuple[nn.Module, nn.Module]:
        return self.q_a_proj if self.low_rank_q else self.q_proj, self.kv_a_proj_with_mqa

    def adopt(self) -> None:
        q, kv = self._input_projections()
        if not (type(q) is type(kv) is nn.Linear and (q.bias is None) == (kv.bias is None)):
            return
        self.w_a = concat_views([q.weight, kv.weight])
        self.b_a = concat_views([q.bias, kv.bias]) if q.bias is not None else None

    def drop(self) -> None:
        self.w_a = self.b_a = None

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.w_a is None:
            return super().project(x)
        bs, T, _ = x.shape
        latent = self.kv_a_proj_with_mqa.out_features
        q, kv = F.linear(x, self.w_a, self.b_a).split([self.w_a.shape[0] - latent, latent], dim=-1)
        if self.low_rank_q:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q.view(bs, T, self.n_heads, self.nope + self.rope), kv


class TritonLatentAttention(FusedLatentAttention):
    """MLA (DeepSeek-V3, Kimi K2): FusedLatentAttention's input GEMM, then mla_kernels: the norm, RoPE,
    cache write and query assembly in one launch (latent_rope_cache), and the attention (latent_attention)
    reading the latent cache in place for up to max_tokens query tokens a sequence (decode steps and
    trees); longer prefill chunks attend through the reference's SDPA over gathered latents. The other
    projections stay the reference's (kv_b_proj, quantized or not, is dequantized where it is used)."""

    max_tokens = TritonAttention.max_tokens

    def uses_tree_attention(self, bs: int, T: int) -> bool:
        return T <= self.max_tokens

    def metadata(self, mask: Tensor) -> kernels.MaskMeta | None:
        bs, _, T, _ = mask.shape
        return kernels.mask_meta(mask) if self.uses_tree_attention(bs, T) else None

    def rotate_and_cache(
        self, q: Tensor, kv: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, rows: Tensor | None
    ) -> Tensor:
        assert self.cache is not None
        norm, q_latent = self.kv_a_layernorm, self.absorb(q[..., : self.nope])
        return latent_rope_cache(
            q, kv, q_latent, cos, sin, norm.weight, norm.eps, self.cache.latent, slots, self.interleave
        )

    def attend(self, q: Tensor, mask: Tensor, rows: Tensor | None, meta: kernels.MaskMeta | None) -> Tensor:
        bs, _, T, _ = q.shape
        if not self.uses_tree_attention(bs, T):
            return super().attend(q, mask, rows, meta)
        assert self.cache is not None
        cache, (mask, bounds) = self.cache, kernels.mask_and_bounds(mask, meta)
        return self.values(latent_attention(q, cache.latent, cache.slot_map, mask, rows, self.rank, self.scale, bounds))


SWAPS: dict[str, dict[type[nn.Module], type[nn.Module]]] = {  # backend -> {reference class: its fused class}
    "reference": {},
    "torch": {Attention: FusedAttention, deepseek_v3.Attention: FusedLatentAttention, MLP: FusedMLP},
    "triton": {
        Attention: TritonAttention,
        deepseek_v3.Attention: TritonLatentAttention,
        MLP: TritonMLP,
        DecoderLayer: TritonDecoderLayer,
    },
}


def use_backend(model: Transformer, backend: str) -> None:
    """Swap the target's modules for `backend`'s (see the module docstring), whatever its family: every
    module whose reference class has a fused counterpart; calling it again switches."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")
    if backend == "triton" and not kernels.available(model.lm_head.weight.device):
        raise RuntimeError(
            f"Triton kernels need triton and a CUDA device (model is on "
            f"{model.lm_head.weight.device}; on CPU only under TRITON_INTERPRET=1)"
        )
    table = SWAPS[backend]
    for module in list(model.modules()):
        reference = module.reference if isinstance(module, _Swapped) else type(module)
        fused = table.get(reference, reference)
        if fused is not reference and not getattr(fused, "takes_quantized", False) and _quantized_projections(module):
            fused = reference  # its GEMMs concatenate float weights; quantized ones run in their own modules
        swap(module, fused)
    model.backend = backend


def _quantized_projections(module: nn.Module) -> bool:
    return any(isinstance(child, (Int4Linear, Fp8BlockLinear)) for child in module.children())


# ---- mixture of experts --------------------------------------------------------------------------


class FusedMoE(_Swapped, SparseMoE):
    """The chosen experts only, in static shapes: CUDA-graph capturable (no nonzero, no shape that depends
    on the routing, no host sync). The reference (every expert on every token) stays the oracle.

    The layout: the P = N * k (token, expert) pairs sorted by expert (a stable argsort), each expert's run
    padded to whole tiles of `tile_rows(P, E)` rows, so that a tile holds pairs of one expert. However the
    router chooses, sum_e ceil(count_e / T) <= min(P, (P + min(E, P) * (T - 1)) // T), so the buffers have a
    size fixed by the shape; tiles past the used ones hold zeros. Pairs whose expert another rank holds
    (tensor parallelism) get no row and add zero.

    The compute: per tile, its expert's stacked gate/up and down weights (views of the experts' parameters,
    as concat_views makes them: names and state dict stay the checkpoint's) gathered into two batched GEMMs,
    silu(gate) * up between them; then each pair's row times its routing weight, summed over the token's k
    pairs in a fixed order (deterministic: no atomics).

    The tile (data, as the shape buckets of the Triton modules): the smallest power of two T with
    T * E >= P, so that a decode step (P <= E) runs one pair per tile, a batched GEMV over the chosen experts
    alone, and a step never gathers more than 2 E experts' weights.

    The gather copies the weights of up to 2 E experts per step (for a 33-token verify of Qwen3-30B-A3B,
    162 tiles of 4 rows); TritonMoE reads them in place instead."""

    reference = SparseMoE
    w_gate_up: Tensor | None = None  # [experts held here, 2 * inter, hidden]: gate rows, then up rows
    w_down: Tensor | None = None  # [experts held here, hidden, inter]

    takes_quantized = True  # INT4 or FP8 experts: stacked as published, dequantized per tile
    # quantized experts: their stacked tensors, as `w_gate_up` / `w_down` (the INT4 scales or FP8 scale_inv)
    s_gate_up: Tensor | None = None
    s_down: Tensor | None = None

    def adopt(self) -> None:
        experts = cast(list[MLP], list(self.experts))
        first = experts[0].gate_proj
        weight, scale = "weight", None
        if isinstance(first, Int4Linear):
            weight, scale = "weight_packed", "weight_scale"
        elif isinstance(first, Fp8BlockLinear):
            scale = "weight_scale_inv"

        def stacked(name: str, projections: tuple[str, ...]) -> Tensor:
            parts = [getattr(getattr(e, p), name) for e in experts for p in projections]
            return concat_views(parts).view(len(experts), -1, parts[0].shape[-1])

        self.w_gate_up = stacked(weight, ("gate_proj", "up_proj"))
        self.w_down = stacked(weight, ("down_proj",))
        if scale is not None:
            self.s_gate_up = stacked(scale, ("gate_proj", "up_proj"))
            self.s_down = stacked(scale, ("down_proj",))

    def drop(self) -> None:
        self.w_gate_up = self.w_down = self.s_gate_up = self.s_down = None

    def expert_weights(self, tile_expert: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The gate/up [tiles, 2 I, H] and down [tiles, H, I] weights of the tiles' experts, dequantized
        (only these experts') when the checkpoint's are quantized."""
        assert self.w_gate_up is not None and self.w_down is not None
        gate_up, down = self.w_gate_up[tile_expert], self.w_down[tile_expert]
        if self.s_gate_up is None:
            return gate_up, down
        assert self.s_down is not None
        first = cast(MLP, self.experts[0])
        if isinstance(first.gate_proj, Int4Linear):
            group = first.gate_proj.group_size
            hidden, inter = first.gate_proj.in_features, first.down_proj.in_features
            return (
                dequantize_int4(gate_up, self.s_gate_up[tile_expert], hidden, group, dtype),
                dequantize_int4(
                    down, self.s_down[tile_expert], inter, cast(Int4Linear, first.down_proj).group_size, dtype
                ),
            )
        gate = cast(Fp8BlockLinear, first.gate_proj)
        inter, block, scales = gate.out_features, gate.block, self.s_gate_up[tile_expert]
        split = -(-inter // block[0])  # gate's scale rows, then up's (a partial last block each)
        halves = [(gate_up[:, :inter], scales[:, :split]), (gate_up[:, inter:], scales[:, split:])]
        return (
            torch.cat([dequantize_fp8_block(w, s, block, dtype) for w, s in halves], dim=1),
            dequantize_fp8_block(down, self.s_down[tile_expert], block, dtype),
        )

    @staticmethod
    def tile_rows(pairs: int, experts: int) -> int:
        rows = 1
        while rows * experts < pairs:
            rows *= 2
        return rows

    def layout(self, ids: Tensor) -> tuple[Tensor, Tensor, int, int]:
        """ids [N, k] (global expert ids) -> (the buffer row of each pair [N * k] (tiles * T for a pair held
        elsewhere), the expert of each tile [tiles], T, tiles)."""
        experts, pairs, dev = len(self.experts), ids.numel(), ids.device
        rows = self.tile_rows(pairs, experts)
        tiles = min(pairs, (pairs + min(experts, pairs) * (rows - 1)) // rows)
        local = ids.reshape(-1) - self.first_expert
        expert = torch.where((local >= 0) & (local < experts), local, experts)  # `experts`: another rank's
        counts = torch.zeros(experts + 1, dtype=torch.long, device=dev).scatter_add_(0, expert, torch.ones_like(expert))
        run_tiles = (counts[:experts] + rows - 1) // rows
        tile_end = run_tiles.cumsum(0)
        order = torch.argsort(expert, stable=True)
        sorted_expert = expert[order]
        rank = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[sorted_expert]  # within its run
        first_row = ((tile_end - run_tiles) * rows)[sorted_expert.clamp(max=experts - 1)]
        row_sorted = torch.where(sorted_expert < experts, first_row + rank, tiles * rows)
        row = torch.empty_like(row_sorted).scatter_(0, order, row_sorted)
        tile_expert = torch.searchsorted(tile_end, torch.arange(tiles, device=dev), right=True)
        return row, tile_expert.clamp(max=experts - 1), rows, tiles

    def combine(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        n, k = ids.shape
        row, tile_expert, rows, tiles = self.layout(ids)
        buf = x.new_zeros(tiles * rows + 1, x.shape[-1])  # the last row: pairs held elsewhere write there
        buf[row] = x[:, None].expand(n, k, x.shape[-1]).reshape(n * k, -1)  # pair p is token p // k
        h = buf[: tiles * rows].view(tiles, rows, -1)
        w_gate_up, w_down = self.expert_weights(tile_expert, x.dtype)
        gate, up = torch.bmm(h, w_gate_up.transpose(1, 2)).chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, w_down.transpose(1, 2)).reshape(tiles * rows, -1)
        y = torch.cat([y, y.new_zeros(1, y.shape[-1])])  # pairs held elsewhere read zeros
        return (y[row].view(n, k, -1) * weights[..., None]).sum(dim=1)


class TritonMoE(FusedMoE):
    """The chosen experts through the Triton grouped GEMMs of runtime/moe_kernels.py: each program reads
    its block's expert weights in place from the stacked tensors (no gathered copy), silu(gate) * up in
    the gate/up epilogue."""

    def combine(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        assert self.w_gate_up is not None and self.w_down is not None
        if self.s_gate_up is None:
            return moe_experts(x, weights, ids, self.w_gate_up, self.w_down, self.first_expert)
        first = cast(MLP, self.experts[0]).gate_proj
        if not isinstance(first, Int4Linear):  # FP8 experts: no grouped FP8 kernel yet, the tiles' dequantized
            return super().combine(x, weights, ids)
        assert self.s_down is not None
        return moe_experts_int4(
            x,
            weights,
            ids,
            self.w_gate_up,
            self.s_gate_up,
            self.w_down,
            self.s_down,
            first.group_size,
            self.first_expert,
        )


class TritonGroupLimitedSigmoid(_Swapped, GroupLimitedSigmoid):
    """DeepSeek-V3 / Kimi K2's router in two launches: the fp32 logits from the 16-bit activations and
    weight (their products are exact in fp32, summed in fp32: the reference's x.float() @ weight.float().T
    without converting the weight each call), then the group-limited top k in one kernel."""

    reference = GroupLimitedSigmoid

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if x.is_cuda and torch.version.hip is None and x.dtype in (torch.bfloat16, torch.float16):
            logits = torch.mm(x, self.weight.t(), out_dtype=torch.float32)  # documented for CUDA only
        else:
            logits = F.linear(x.float(), self.weight.float())
        bias = self.e_score_correction_bias.float()  # fp32 already, as the model keeps it
        return group_limited_topk(
            logits, bias, self.top_k, self.n_group, self.topk_group, self.normalize, self.scaling, x.dtype
        )


class TritonSoftmaxTopK(_Swapped, SoftmaxTopK):
    """Qwen3-MoE's router in two launches: the reference's GEMM, then softmax_topk in one kernel."""

    reference = SoftmaxTopK

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return softmax_topk(F.linear(x, self.weight), self.top_k, self.normalize, x.dtype)


class TritonInt4Linear(_Swapped, Int4Linear):
    """W4A16 through the Triton GEMM of runtime/quant_kernels.py (the weight dequantized in registers)."""

    reference = Int4Linear

    def forward(self, x: Tensor) -> Tensor:
        return int4_linear(x, self.weight_packed, self.weight_scale, self.group_size)


class TritonFp8BlockLinear(_Swapped, Fp8BlockLinear):
    """FP8 block weights through the Triton GEMM of runtime/quant_kernels.py."""

    reference = Fp8BlockLinear

    def forward(self, x: Tensor) -> Tensor:
        return fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block)


SWAPS["torch"][SparseMoE] = FusedMoE
SWAPS["triton"][SparseMoE] = TritonMoE
SWAPS["triton"][GroupLimitedSigmoid] = TritonGroupLimitedSigmoid
SWAPS["triton"][SoftmaxTopK] = TritonSoftmaxTopK
SWAPS["triton"][Int4Linear] = TritonInt4Linear
SWAPS["triton"][Fp8BlockLinear] = TritonFp8BlockLinear


# ---- the drafter ---------------------------------------------------------------------------------


class TritonDrafterAttention(_FusedQKV, DrafterAttention):
    """The target's Triton path for the drafter's attention: the block's q, k and v and the new context's
    k and v from one GEMM over both while they are few rows (joint_rows; else one GEMM each, over views
    into one concatenated weight), q/k norms, RoPE and cache writes in one kernel, tree attention over
    the block, and o as the target's skinny GEMM (the drafter's o has the target's shape) whose K-split
    partial sums the fused layer's add_rms_norm adds up."""

    reference = DrafterAttention
    # whether its layer adds up o's K-split partial sums (TritonDrafterLayer does; DFlash2's layer does not)
    partial_sums = False
    # up to this many block + context rows, one GEMM over both reads the q/k/v weight once (the context's q
    # columns are computed and dropped): the GEMMs are weight-bound there; past it the dropped columns cost
    joint_rows = 64

    def _split(self, out: Tensor, heads: tuple[int, ...]) -> list[Tensor]:
        """out [bs, T, sum(heads) * head_dim] -> one [bs, T, n, head_dim] view per entry n of heads."""
        parts = out.split([n * self.head_dim for n in heads], dim=-1)
        return [part.view(*out.shape[:2], n, self.head_dim) for part, n in zip(parts, heads)]

    def metadata(self, mask: Tensor) -> kernels.MaskMeta:
        return kernels.mask_meta(mask)

    def append_context(self, ctx: Tensor, rope_ctx: tuple[Tensor, Tensor], ctx_slots: Tensor) -> None:
        assert self.wqkv is not None
        q_width = self.n_heads * self.head_dim  # k and v: the rows of wqkv after q's
        bkv = self.bqkv[q_width:] if self.bqkv is not None else None
        k, v = self._split(F.linear(ctx, self.wqkv[q_width:], bkv), (self.n_kv, self.n_kv))
        self._cache_context(k, v, rope_ctx, ctx_slots)

    def forward(self, x, ctx, rope_blk, rope_ctx, blk_slots, ctx_slots, mask, meta=None) -> Tensor:
        if ctx is None or x.shape[0] * (x.shape[1] + ctx.shape[1]) > self.joint_rows:
            return super().forward(x, ctx, rope_blk, rope_ctx, blk_slots, ctx_slots, mask, meta)
        T = x.shape[1]
        qkv = skinny_qkv(torch.cat([x, ctx], dim=1), self.wqkv, self.bqkv, TritonAttention.qkv_skinny)
        q, k, v = self._split(qkv, (self.n_heads, self.n_kv, self.n_kv))
        self._cache_context(k[:, T:], v[:, T:], rope_ctx, ctx_slots)
        q = self._rotate_and_cache(q[:, :T], k[:, :T], v[:, :T], rope_blk, blk_slots)
        return self.output(self.attend(q, mask, meta))

    def _cache_context(self, k: Tensor, v: Tensor, rope_ctx: tuple[Tensor, Tensor], ctx_slots: Tensor) -> None:
        w = self.k_norm.weight  # k only: no query heads
        kernels.qk_norm_rope_kv(
            k[:, :, :0], k, v, *rope_ctx, w, w, self.k_norm.eps, self.kv_cache.k, self.kv_cache.v, ctx_slots
        )

    def rotate_and_cache(self, x: Tensor, rope_blk: tuple[Tensor, Tensor], blk_slots: Tensor) -> Tensor:
        qkv = skinny_qkv(x, self.wqkv, self.bqkv, TritonAttention.qkv_skinny)
        q, k, v = self._split(qkv, (self.n_heads, self.n_kv, self.n_kv))
        return self._rotate_and_cache(q, k, v, rope_blk, blk_slots)

    def _rotate_and_cache(
        self, q: Tensor, k: Tensor, v: Tensor, rope_blk: tuple[Tensor, Tensor], blk_slots: Tensor
    ) -> Tensor:
        return kernels.qk_norm_rope_kv(
            q,
            k,
            v,
            *rope_blk,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            self.kv_cache.k,
            self.kv_cache.v,
            blk_slots,
        )

    def attend(self, q: Tensor, mask: Tensor, meta: kernels.MaskMeta | None) -> Tensor:
        cache = self.kv_cache
        mask, bounds = kernels.mask_and_bounds(mask, meta)
        return kernels.attention(q, cache.k, cache.v, cache.slot_map, mask, None, bounds)

    def output(self, out: Tensor) -> Tensor:
        parts = skinny_o(out, self.o_proj, self.tp, TritonAttention.o_skinny) if self.partial_sums else None
        return super().output(out) if parts is None else parts


class TritonDrafterLayer(_Swapped, DrafterLayer):
    """Each residual add fused with the RMSNorm after it, as in TritonDecoderLayer."""

    reference = DrafterLayer

    def forward(self, x, h, next_norm, ctx, rope_blk, rope_ctx, blk_slots, ctx_slots, mask, meta=None):
        post = self.post_attention_layernorm
        attn = self.self_attn(h, ctx, rope_blk, rope_ctx, blk_slots, ctx_slots, mask, meta)
        h, x = kernels.add_rms_norm(attn, x, post.weight, post.eps)
        h, x = kernels.add_rms_norm(self.mlp(h), x, next_norm.weight, next_norm.eps)
        return x, h


def use_drafter_backend(drafter: DFlashDrafter, backend: str) -> None:
    """The drafter's Triton path ("triton": the attention and layer above and the target's MLP, gate/up as
    one skinny GEMM with silu_mul in its epilogue), the torch one (gate/up as one GEMM) or the reference.
    Layers of other drafter kinds (DFlash2's convolutions sit between norm and sublayer) keep their own
    forward: their sublayers still take the fused modules."""
    triton = backend == "triton"
    attention = TritonDrafterAttention if triton else DrafterAttention
    mlp = SWAPS.get(backend, {}).get(MLP, MLP)
    for layer in drafter.layers:
        swap(layer.self_attn, attention)
        swap(layer.mlp, mlp)
        reference = layer.reference if isinstance(layer, _Swapped) else type(layer)
        if reference is DrafterLayer:
            swap(layer, TritonDrafterLayer if triton else DrafterLayer)
        if isinstance(layer.self_attn, TritonDrafterAttention):
            layer.self_attn.partial_sums = isinstance(layer, TritonDrafterLayer)
        if isinstance(layer.mlp, TritonMLP):
            layer.mlp.partial_sums = isinstance(layer, TritonDrafterLayer)


# ---- the tree ------------------------------------------------------------------------------------


def build_ddtree_triton(roots: Tensor, draft_logits: Tensor, budget: int) -> Tree:
    """build_ddtree's set in one Triton launch (kernels.best_first_tree, the paper's heap): about 90
    fewer kernels per round at D = 15. Nodes are in pop order: best first, like build_ddtree. The
    candidates are top_candidates' without its fp32 log_softmax copy: each row's top-k log-probabilities
    from the logits in their own dtype (the same order), in one read (kernels.row_top_logprobs) where
    it serves k, else torch's top-k less each row's logsumexp."""
    k = min(budget, draft_logits.shape[-1])
    if kernels.row_top_applies(k):
        top_lp, top_tok = kernels.row_top_logprobs(draft_logits, k)
    else:
        top_logits, top_tok = draft_logits.topk(k, dim=-1)
        top_lp = top_logits.float() - kernels.row_logsumexp(draft_logits)[..., None]  # top_candidates' values
    return Tree(*kernels.best_first_tree(roots, top_lp, top_tok, budget))


def path_committer(target: Transformer) -> Callable[..., None] | None:
    """Under the Triton backend, the round's bookkeeping of its walk in two launches: kernels.commit_path
    (lengths, bonus, readout, staged count and the path's physical slots), then kernels.move_slots (the
    accepted path's cache slots to the committed positions, in every layer). None for the other backends:
    Engine.commit_path's tensor ops and the target's `compact`."""
    if target.backend != "triton":
        return None

    def commit(
        w: Walk,
        lengths: Tensor,
        active: Tensor,
        bonus: Tensor,
        readout: Tensor,
        ctx_count: Tensor | None,
        moves: bool,
    ) -> None:
        fields = (w.path, w.accepted, w.bonus, w.emitted)
        moved = kernels.commit_path(
            *fields, lengths, active, target.slot_map, target.trash_slot, bonus, readout, ctx_count, moves
        )
        if moved is not None:
            kernels.move_slots(target.slot_storage(), *moved)

    return commit


def greedy_reader(backend: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The verify's one read of its logits [bs, N, V]: the argmax at every node [bs, N] (the greedy
    decisions), with each row's largest root logit written into root_max [bs]. Under the Triton backend one
    pass (kernels.row_argmax); else torch's argmax and a max of the roots."""
    if backend == "triton":
        return kernels.row_argmax

    def read(logits: Tensor, root_max: Tensor) -> Tensor:
        root_max.copy_(logits[:, 0].amax(-1))
        return logits.argmax(-1)

    return read


def tree_walker(backend: str) -> Callable[[Tree, Tensor, int], Walk]:
    """verify.walk, or under the Triton backend its one-launch kernel (kernels.walk)."""
    if backend != "triton":
        return walk

    def walk_triton(tree: Tree, decisions: Tensor, max_depth: int) -> Walk:
        fields = (tree.tokens, tree.parents, tree.depth, tree.valid, tree.visible)
        return Walk(*kernels.walk(*fields, decisions, max_depth))

    return walk_triton


def tree_builder(backend: str):
    """The DDTree builder of a backend."""
    return build_ddtree_triton if backend == "triton" else build_ddtree
