"""Layers shared by the model families and the drafter: RoPE, RMSNorm, the slot-mapped KV cache, the gated MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# what an attention layer's metadata() gives the layers of one forward (none for the reference; the fused
# kernels' mask bounds and aligned mask)
AttentionMeta = Any


class Collectives(Protocol):
    """What a sharded layer needs from its tensor-parallel group (ddtree.runtime.parallel.TensorParallel)."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def all_reduce(self, x: Tensor) -> Tensor: ...

    def all_gather_last(self, x: Tensor) -> Tensor: ...


def rope_kind(scaling: dict | None) -> str | None:
    """The scaling's type (`rope_type`, or the older `type`); None without scaling."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type"))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1): transformers' get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What transformers multiplies RoPE's cos and sin by: YaRN's attention factor (as given; else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set and nonzero; else
    mscale(factor)), and 1 for every other kind. DeepSeek-V3 and Kimi K2 set mscale = mscale_all_dim, so
    theirs is 1 (their softmax scale carries mscale_all_dim instead: models/deepseek_v3.py)."""
    if rope_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> Tensor:
    """YaRN's inverse frequencies, step for step as transformers' _compute_yarn_parameters (in fp32, so the
    result is bit-identical): extrapolated (plain) frequencies above the `beta_fast` correction dim,
    interpolated ones (divided by `factor`) below `beta_slow`'s, a linear ramp between (the range floored
    and ceiled unless `truncate` is false). `factor` and `original_max_position_embeddings` are required
    (transformers derives a missing factor from max_position_embeddings; the family's config does that)."""
    missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
    if missing:
        raise ValueError(f"yarn rope scaling needs {' and '.join(missing)}")
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers': no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, applies_attention_factor: bool = False) -> Tensor:
    """Inverse frequencies, with long-context scaling when configured: Llama-3, linear or YaRN.

    YaRN also scales cos and sin (rope_attention_factor). A caller passes applies_attention_factor=True
    when its forward hands that factor to rope_cos_sin; otherwise a YaRN whose factor is not 1 is refused
    rather than computed without it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = rope_kind(scaling)
    if kind == "yarn":
        factor = rope_attention_factor(scaling)
        if factor != 1.0 and not applies_attention_factor:
            raise ValueError(
                f"yarn rope scaling with attention factor {factor:.6g} (from its factor, mscale and "
                "mscale_all_dim) is not supported by this model, whose attention does not scale cos/sin"
            )
        return yarn_inv_freq(head_dim, theta, scaling)
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
        raise ValueError(f"unsupported rope scaling '{kind}' (supported: llama3, linear, yarn)")
    return inv_freq.float()


def rope_cos_sin(
    inv_freq: Tensor, positions: Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos/sin of shape [*positions.shape, head_dim] in the rotate-half layout, times attention_factor
    (YaRN's, rope_attention_factor; applied in fp32 before the cast, where transformers applies it)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


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


def identity_slot_map(max_batch: int, max_slots: int, device=None) -> Tensor:
    """The slot map of a cache that gives every row its own `max_slots` slots: row r's slot s is physical
    slot r * max_slots + s, and every row's logical trash slot (max_slots) the shared physical trash slot,
    max_batch * max_slots (the last one)."""
    table = torch.arange(max_batch * (max_slots + 1), dtype=torch.int32, device=device).view(max_batch, -1)
    table = table - torch.arange(max_batch, dtype=torch.int32, device=device)[:, None]  # r * max_slots + s
    table[:, max_slots] = max_batch * max_slots
    return table


def slot_map_for(
    max_batch: int, max_slots: int, pool_slots: int | None, slot_map: Tensor | None, device
) -> tuple[Tensor, int]:
    """(the slot map, the physical slots to allocate, the trash slot on top) of a cache of max_batch rows of
    max_slots logical slots. Without a pool size every row gets max_slots slots of its own
    (identity_slot_map); with one, the map starts with every slot at the trash slot, for the caller to fill
    (runtime.pages). A given `slot_map` (another model's: the drafter shares the target's) is used as is."""
    if pool_slots is None:
        pool_slots = max_batch * max_slots
        table = identity_slot_map(max_batch, max_slots, device)
    else:
        table = torch.full((max_batch, max_slots + 1), pool_slots, dtype=torch.int32, device=device)
    if slot_map is not None:
        assert slot_map.shape == table.shape, f"slot map {tuple(slot_map.shape)} is not {tuple(table.shape)}"
        table = slot_map
    return table, pool_slots


def physical_slots(slot_map: Tensor, slots: Tensor, rows: Tensor | None = None) -> Tensor:
    """The physical cache slots [bs, T] (int32) of logical slots [bs, T] of rows `rows` (default 0..bs-1)."""
    table = slot_map[: slots.shape[0]] if rows is None else slot_map[rows]
    return table.gather(1, slots.long())


class KVCache(nn.Module):
    """One layer's keys and values [kv_heads, pool_slots + 1, head_dim] in physical slots, shared by the rows.

    `slot_map` [max_batch, max_slots + 1] int32 (the model's, shared by its layers) says which physical slot
    each row's logical slot is: the model turns a forward's logical slots into physical ones once
    (CausalLM.physical_slots) and writes there; reads go through the map (the Triton attention reads it
    itself). The last physical slot is the trash slot: padded tokens write there and no mask ever shows it.
    `storage` [2, kv_heads, pool_slots + 1, head_dim], when given, is where k and v live (the target keeps
    all layers in one buffer so that compaction is one launch, not one per layer).
    """

    k: Tensor  # buffers, declared for the type checker (register_buffer does not declare them)
    v: Tensor

    def __init__(
        self,
        kv_heads: int,
        pool_slots: int,
        head_dim: int,
        dtype,
        device,
        slot_map: Tensor,
        storage: Tensor | None = None,
    ):
        super().__init__()
        shape = (kv_heads, pool_slots + 1, head_dim)
        if storage is None:
            storage = torch.zeros((2, *shape), dtype=dtype, device=device)
        assert storage.shape == (2, *shape), f"cache storage {tuple(storage.shape)} is not {(2, *shape)}"
        self.register_buffer("k", storage[0], persistent=False)
        self.register_buffer("v", storage[1], persistent=False)
        self.slot_map = slot_map

    def update(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k, v [bs, kv_heads, T, hd] at physical slots [bs, T]."""
        # advanced indexing on dim 1 keeps the heads first: [heads, bs, T, hd]
        self.k[:, slots] = k.transpose(0, 1)
        self.v[:, slots] = v.transpose(0, 1)

    def read(self, bs: int, span: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys/values [bs, kv_heads, span, hd] of logical slots 0..span-1 of rows `rows` (default 0..bs-1),
        gathered through the slot map."""
        table = (self.slot_map[:bs] if rows is None else self.slot_map[rows])[:, :span]
        return self.k[:, table].transpose(0, 1), self.v[:, table].transpose(0, 1)

    def row(self, row: int, n: int) -> tuple[Tensor, Tensor]:
        """Keys/values [kv_heads, n, hd] of row `row`'s logical slots 0..n-1 (a copy)."""
        table = self.slot_map[row, :n]
        return self.k[:, table], self.v[:, table]


def concat_views(params: list[Tensor]) -> Tensor:
    """Concatenate parameters along dim 0 and re-point each at its slice of the result."""
    fused = torch.cat([p.detach() for p in params], dim=0)
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[start : start + n]
        start += n
    return fused


class StepAttention(nn.Module):
    """Attention over a static cache as four steps, which each family defines and fused modules replace in
    part (ddtree.runtime.fused): project, normalise + rotate + write the cache, attend, project out."""

    o_proj: nn.Linear
    tp: Collectives | None

    # the steps each family defines (their arguments differ: MLA projects to a latent, not to k and v)
    project: Callable[..., tuple[Tensor, ...]]  # x [bs, T, H] -> what rotate_and_cache takes first
    rotate_and_cache: Callable[..., Tensor]  # (*project(x), cos, sin, slots, rows) -> queries
    attend: Callable[..., Tensor]  # (q, mask, rows, meta) -> [bs, T, heads * head dim]

    def metadata(self, mask: Tensor) -> AttentionMeta:
        """What the layers of one forward share about its mask (none here; see the Triton attention)."""
        return None

    def output(self, out: Tensor) -> Tensor:
        out = self.o_proj(out)
        return self.tp.all_reduce(out) if self.tp else out

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        slots: Tensor,
        mask: Tensor,
        rows: Tensor | None,
        meta: AttentionMeta = None,
    ) -> Tensor:
        q = self.rotate_and_cache(*self.project(x), cos, sin, slots, rows)
        return self.output(self.attend(q, mask, rows, meta))


def dense_split_sizes(cfg) -> dict[str, int]:
    """The sizes tensor parallelism splits in a grouped-query model (each must be a multiple of the ranks)."""
    return {
        "attention heads": cfg.num_attention_heads,
        "KV heads": cfg.num_key_value_heads,
        "MLP width": cfg.intermediate_size,
        "vocabulary": cfg.vocab_size,
    }


def shard_dense_layers(layers, cfg, tp: Collectives) -> None:
    """Megatron split of grouped-query attention + MLP layers (the dense target's, the drafter's)."""
    world = tp.world
    for layer in layers:
        shard_attention_mlp(
            layer.self_attn,
            layer.mlp,
            tp,
            cfg.num_attention_heads // world,
            cfg.num_key_value_heads // world,
            cfg.intermediate_size // world,
        )


class MLP(nn.Module):
    """The gated (SwiGLU) MLP. Inference swaps in a fused gate/up GEMM (ddtree.runtime.fused)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.tp: Collectives | None = None  # set once sharded: down_proj outputs are partial sums

    def activate(self, x: Tensor) -> Tensor:
        return F.silu(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x: Tensor) -> Tensor:
        out = self.down_proj(self.activate(x))
        return self.tp.all_reduce(out) if self.tp else out


# ---- tensor parallel splits (ddtree.runtime.parallel calls the families' shard_layers) ----------------


def keep_slice(p: Tensor, dim: int, start: int, n: int) -> None:
    """Keep [start, start + n) of a parameter along dim 0 or 1, in place. On a model still on the meta device
    (sharded before its weights are read) this records the slice, so that loading reads only it."""
    p.data = p.data.narrow(dim, start, n).clone()
    p.checkpoint_slice = (dim, start, n)  # type: ignore[attr-defined]


def keep_rows(p: Tensor, rank: int, n: int) -> None:
    """Keep rows [rank * n, (rank + 1) * n) of a parameter (keep_slice)."""
    keep_slice(p, 0, rank * n, n)


def keep_cols(p: Tensor, rank: int, n: int) -> None:
    keep_slice(p, 1, rank * n, n)


class QuantizedSplitError(ValueError):
    """A split that would cut a quantized layer's scale groups or blocks (parallel.shard names the layer)."""

    def __init__(self, module: nn.Module, message: str):
        super().__init__(message)
        self.module = module


def keep_outputs(linear: nn.Module, rank: int, n: int) -> None:
    """Keep output features [rank * n, (rank + 1) * n) of a linear layer, plain or quantized (its scales with
    them; a bias is the caller's). Column-parallel."""
    _keep_features(linear, 0, rank, n)


def keep_inputs(linear: nn.Module, rank: int, n: int) -> None:
    """Keep input features [rank * n, (rank + 1) * n) of a linear layer, plain or quantized. Row-parallel."""
    _keep_features(linear, 1, rank, n)


def _keep_features(linear: nn.Module, dim: int, rank: int, n: int) -> None:
    from .quant import Fp8BlockLinear, Int4Linear
    from .quant_config import QuantScheme, split_problem

    start, total = rank * n, (linear.out_features, linear.in_features)[dim]
    if isinstance(linear, Int4Linear):
        scheme = QuantScheme("int4", group_size=linear.group_size)
    elif isinstance(linear, Fp8BlockLinear):
        scheme = QuantScheme("fp8_block", block=linear.block)
    else:
        scheme = None
    if scheme is not None and (problem := split_problem(scheme, cast(int, total), n, dim)):
        raise QuantizedSplitError(linear, problem)
    if isinstance(linear, Int4Linear):
        if dim == 0:
            keep_rows(linear.weight_packed, rank, n)
            keep_rows(linear.weight_scale, rank, n)
        else:
            keep_slice(linear.weight_packed, 1, start // 8, n // 8)
            if linear.group_size == linear.in_features:  # one group a row: every rank keeps the row's scale
                linear.group_size = n
            else:
                keep_slice(linear.weight_scale, 1, start // linear.group_size, n // linear.group_size)
    elif isinstance(linear, Fp8BlockLinear):
        block = linear.block[dim]
        first, last = start // block, (start + n - 1) // block
        keep_slice(linear.weight, dim, start, n)
        keep_slice(linear.weight_scale_inv, dim, first, last - first + 1)
    else:
        keep_slice(cast(nn.Linear, linear).weight, dim, start, n)
    setattr(linear, ("out_features", "in_features")[dim], n)
    if isinstance(linear, Int4Linear):
        # the stored (out, in) is the whole layer's: this rank's shape replaces it, and loading leaves it alone
        device = linear.weight_packed.device
        linear.weight_shape = torch.tensor(
            [linear.out_features, linear.in_features], device="cpu" if device.type == "meta" else device
        )


def zero_unless_first(p: Tensor, rank: int) -> None:
    """A bias added after an all-reduce is kept by rank 0 only (the sum adds it once); recorded like
    keep_rows, for loading."""
    if rank > 0:
        p.data.zero_()
        p.zeroed = True  # type: ignore[attr-defined]


def shard_mlp(mlp: MLP, tp: Collectives, inter: int) -> None:
    """Megatron split of a gated MLP, its outputs summed over the ranks."""
    shard_mlp_weights(mlp, tp.rank, inter)
    mlp.tp = tp


def shard_mlp_weights(mlp: MLP, rank: int, inter: int) -> None:
    """Keep a rank's inter columns of a gated MLP: gate/up by output rows, down by input columns (its outputs
    are then partial sums, which the caller's all-reduce adds)."""
    keep_outputs(mlp.gate_proj, rank, inter)
    keep_outputs(mlp.up_proj, rank, inter)
    keep_inputs(mlp.down_proj, rank, inter)


def shard_attention_mlp(attn, mlp: MLP, tp: Collectives, hq: int, hkv: int, inter: int) -> None:
    """Megatron split of a grouped-query attention and its MLP, for a rank keeping hq query heads, hkv KV
    heads and an MLP width of inter."""
    shard_attention(attn, tp, hq, hkv)
    shard_mlp(mlp, tp, inter)


def shard_attention(attn, tp: Collectives, hq: int, hkv: int) -> None:
    """Megatron split of a grouped-query attention: q/k/v by heads, o by input columns, its bias added once."""
    hd, rank = attn.head_dim, tp.rank
    for proj, heads in ((attn.q_proj, hq), (attn.k_proj, hkv), (attn.v_proj, hkv)):
        keep_outputs(proj, rank, heads * hd)
        if proj.bias is not None:
            keep_rows(proj.bias, rank, heads * hd)
    keep_inputs(attn.o_proj, rank, hq * hd)
    if attn.o_proj.bias is not None:
        zero_unless_first(attn.o_proj.bias, rank)
    attn.n_heads, attn.n_kv = hq, hkv
    attn.tp = tp
