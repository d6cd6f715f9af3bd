"""DFlash block-diffusion drafter, compatible with the z-lab `DFlashDraftModel` checkpoint layout.

One forward maps the block [bonus, MASK, ..., MASK] plus fused target hidden states of the committed
context to block_size - 1 independent next-token distributions. Context features go through
`fc` + `hidden_norm` once and are injected as extra keys/values in every layer (cached per layer);
block queries attend to the whole context, and inside the block bidirectionally (full-attention layers)
or causally (sliding-window layers, or every layer when the config sets `is_causal`). The drafter has no
embedding or LM head of its own: it uses the target's.

The config is read as the authors' reference (PyPI `dflash` 0.1.0, dflash/model.py, on transformers'
Qwen3Config) reads it; tests/test_dflash_parity.py checks the two against each other. DFlash2 drafters
(convolutions and a candidate selector on top of this) are dflash2.py's; load_drafter reads both.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.config_fields import require_fields
from ..models.deepseek_v3 import ModelConfig as MLAConfig
from ..models.layers import (
    MLP,
    AttentionMeta,
    Collectives,
    KVCache,
    RMSNorm,
    apply_rope,
    dense_split_sizes,
    physical_slots,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    rope_kind,
    slot_map_for,
)
from ..models.llama import ModelConfig
from .compat import DrafterMismatchError, check_fits, default_target_layer_ids, dflash_value, mask_token_id
from .compat import target_layer_ids as tapped_layers


def sliding_layers(cfg: dict) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) of a drafter config.json dict, read as transformers' Qwen3Config reads
    them (the reference DFlashDraftModel is built on it): the window is `sliding_window` when
    `use_sliding_window` is true and None otherwise; `layer_types` is given, or, with a window,
    "sliding_attention" from layer `max_window_layers` (default 28) on. (None, None) when every layer is full
    attention.

    A sliding layer is causal unless the config's `is_causal` says otherwise (DrafterConfig.layer_causal), as in
    the reference (dflash 0.1.0; SGLang and vLLM keep the same default). A config whose layer_types name
    sliding layers while the window is off (no `use_sliding_window`, or no `sliding_window`) is refused:
    transformers would run those layers as full attention, the reference's attention as causal ones over the
    whole context, and the reference's own cache (transformers' DynamicCache) cannot be built for it."""
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    types = list(types)
    if len(types) != layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise DrafterMismatchError(
            f"drafter layer_types {types} must give full_attention or sliding_attention for each of {layers} layers"
        )
    if "sliding_attention" not in types:
        return None, None
    if window is None:
        raise DrafterMismatchError(
            "drafter layer_types name sliding_attention layers but the window is off "
            f"(use_sliding_window {cfg.get('use_sliding_window')}, sliding_window {cfg.get('sliding_window')})"
        )
    if not isinstance(window, int) or window < 1:
        raise DrafterMismatchError(f"drafter sliding_window {window!r} must be a positive integer")
    return types, window


# config keys (top level or dflash_config) other runtimes read that change the drafter's math (vLLM and
# ModelOpt: a sliding window over every layer, a learned attention sink); the reference reads neither
FOREIGN_KEYS = ("use_swa", "attention_sink_bias")


@dataclass
class DrafterConfig:
    architecture: ClassVar[str] = "DFlashDraftModel"  # config.json's `architectures` entry

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    num_target_layers: int | None  # None when a published config leaves it out (its target_layer_ids say enough)
    mask_token_id: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    # each layer's attention, "full_attention" or "sliding_attention" (None: all full), and the window of the
    # sliding ones: a block query at position p sees the keys at positions q with
    # p - q < sliding_window, and, in a bidirectional layer, q - p < sliding_window as well
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # every layer causal (True) or bidirectional inside the block (False); None: sliding layers causal, full
    # ones bidirectional
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0  # the block's embeddings are the target's embedding rows times this
    output_multiplier: float = 1.0  # draft logits: the target's LM head times this, then soft-capped
    final_logit_softcapping: float | None = None  # cap * tanh(logits / cap) when > 0

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of drafter layer `layer`, None for a full-attention layer."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_causal(self, layer: int) -> bool:
        """Whether drafter layer `layer` is causal inside the block (each block query sees the block keys up
        to its own position)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def drafter_class(self) -> type[DFlashDrafter]:
        """The module this config builds."""
        return DFlashDrafter

    def split_sizes(self) -> dict[str, int]:
        """The sizes tensor parallelism splits over the ranks (each must be a multiple of their number)."""
        return dense_split_sizes(self)

    @classmethod
    def for_target(
        cls,
        target: ModelConfig | MLAConfig,
        num_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """A drafter shaped like the target's attention and MLP. An MLA target (DeepSeek-V3, Kimi K2) has no
        dense head_dim or KV heads: the drafter takes its drafter_attention() (the published Kimi-K2.5
        drafter's shape: the target's heads, head dim v_head_dim, a divisor of the heads near heads / 8 as KV
        heads). The target's RoPE scaling is copied; training's block forward applies no cos/sin factor, so a
        YaRN whose attention factor is not 1 is copied with attention_factor 1 (a random drafter's RoPE only
        needs to be consistent with itself; a trained drafter brings its own config)."""
        if isinstance(target, MLAConfig):
            heads, kv_heads, head_dim = target.drafter_attention()
        else:
            heads, kv_heads, head_dim = target.num_attention_heads, target.num_key_value_heads, target.head_dim
        rope_scaling = target.rope_scaling
        if rope_attention_factor(rope_scaling) != 1.0:
            rope_scaling = {**rope_scaling, "attention_factor": 1.0}
        return cls(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            num_target_layers=target.num_hidden_layers,
            # the last vocabulary row: an embedding the drafter learns to read as "unknown yet"
            mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
            target_layer_ids=target_layer_ids or default_target_layer_ids(target.num_hidden_layers, num_layers),
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
        )

    @classmethod
    def from_hf(cls, cfg: dict) -> DrafterConfig:
        """Read a drafter config.json as the reference does: transformers' Qwen3Config fields with its
        defaults (head_dim 128, 32 KV heads, RoPE from `rope_parameters` or the older `rope_scaling`), and the
        DFlash keys from `dflash_config` first, then from the top level. What the reference computes and this
        drafter does not is refused, never ignored."""
        arch = cfg.get("architectures") or ["DFlashDraftModel"]
        if arch[0] != cls.architecture:
            raise DrafterMismatchError(f"unsupported drafter architecture {arch[0]} (expected {cls.architecture})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise DrafterMismatchError(f"drafter hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        dflash = cfg.get("dflash_config") or {}

        def value(name: str, default=None):
            return dflash_value(cfg, name, default)

        foreign = [k for k in FOREIGN_KEYS if dflash.get(k) or cfg.get(k)]
        if foreign:
            raise DrafterMismatchError(f"drafter config sets {', '.join(foreign)}, which this drafter does not compute")
        try:
            require_fields(
                cfg,
                ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
                "drafter config",
            )
        except ValueError as e:
            raise DrafterMismatchError(str(e)) from None
        is_causal = cfg.get("is_causal")
        if is_causal is not None and not isinstance(is_causal, bool):
            raise DrafterMismatchError(f"drafter is_causal {is_causal!r} must be true, false or null")
        layer_types, window = sliding_layers(cfg)
        layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        layer_ids, mask_token = tapped_layers(cfg), mask_token_id(cfg)
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        if rope_kind(rope) not in ("default", None):
            scaling = dict(rope)
        if rope_kind(scaling) in ("default", None):
            scaling = None
        softcap = value("final_logit_softcapping")
        kv_heads = cfg.get("num_key_value_heads", 32)
        out = cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
            head_dim=cfg.get("head_dim", 128) or cfg["hidden_size"] // heads,
            block_size=int(value("block_size", 16)),
            num_target_layers=cfg.get("num_target_layers"),
            mask_token_id=mask_token,
            target_layer_ids=layer_ids,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            attention_bias=cfg.get("attention_bias", False),
            layer_types=layer_types,
            sliding_window=window,
            is_causal=is_causal,
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            **cls.architecture_fields(cfg, value),
        )
        # vLLM's all-layer override: accepted only where it says what the layers compute anyway
        if "causal" in dflash and any(out.layer_causal(i) != bool(dflash["causal"]) for i in range(layers)):
            raise DrafterMismatchError(
                f"drafter dflash_config causal {dflash['causal']} disagrees with its layers' attention "
                f"(is_causal {is_causal}, layer_types {layer_types})"
            )
        try:  # an unsupported RoPE fails here rather than at setup_caches
            rope_inv_freq(out.head_dim, out.rope_theta, out.rope_scaling, applies_attention_factor=True)
        except ValueError as e:
            raise DrafterMismatchError(f"drafter RoPE: {e}") from e
        return out

    @classmethod
    def architecture_fields(cls, cfg: dict, value: Callable[..., Any]) -> dict:
        """The fields a subclass's architecture adds, read from config.json `cfg` (`value(name, default)`
        looks in dflash_config first, then at the top level)."""
        return {}

    def to_hf(self) -> dict:
        """The published z-lab layout: a Qwen3 config plus the DFlash keys."""
        cfg = asdict(self)
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        for key in ("block_size", "mask_token_id", "target_layer_ids"):
            cfg.pop(key)
        for key in ("num_target_layers", "layer_types", "sliding_window", "is_causal"):
            if cfg[key] is None:
                cfg.pop(key)
        for key, default in (
            ("input_embedding_scale", 1.0),
            ("output_multiplier", 1.0),
            ("final_logit_softcapping", None),
        ):
            if cfg.pop(key) != default:
                dflash[key] = getattr(self, key)
        if self.sliding_window is not None:
            cfg["use_sliding_window"] = True  # transformers' Qwen3Config drops the window without it
        cfg.update(
            architectures=[self.architecture],
            auto_map={"AutoModel": f"dflash.{self.architecture}"},
            model_type="qwen3",
            hidden_act="silu",
            tie_word_embeddings=False,
            block_size=self.block_size,
            dflash_config=dflash,
        )
        return cfg

    def check_target(self, target: ModelConfig | MLAConfig) -> None:
        check_fits(self, target)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.kv_cache: KVCache | None = None
        self.tp: Collectives | None = None  # set when split (parallel.shard_drafter): o_proj outputs are partial sums

    def _heads(self, proj: nn.Linear, x: Tensor, heads: int) -> Tensor:
        return proj(x).view(*x.shape[:2], heads, self.head_dim)

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        k = self.k_norm(self._heads(self.k_proj, x, self.n_kv)).transpose(1, 2)
        return apply_rope(k, cos, sin), self._heads(self.v_proj, x, self.n_kv).transpose(1, 2)

    def metadata(self, mask: Tensor) -> AttentionMeta:
        """What the layers of one forward share about its mask (none here; see the Triton attention)."""
        return None

    def append_context(self, ctx: Tensor, rope_ctx: tuple[Tensor, Tensor], ctx_slots: Tensor) -> None:
        """Write the context's keys and values at physical slots ctx_slots [bs, P]."""
        self.kv_cache.update(ctx_slots, *self._kv(ctx, *rope_ctx))

    def rotate_and_cache(self, x: Tensor, rope_blk: tuple[Tensor, Tensor], blk_slots: Tensor) -> Tensor:
        """Write the block's keys and values at its cache slots; returns its queries [bs, heads, T, hd]."""
        self.kv_cache.update(blk_slots, *self._kv(x, *rope_blk))
        return apply_rope(self.q_norm(self._heads(self.q_proj, x, self.n_heads)).transpose(1, 2), *rope_blk)

    def attend(self, q: Tensor, mask: Tensor, meta: AttentionMeta) -> Tensor:
        bs, _, T, _ = q.shape
        k_all, v_all = self.kv_cache.read(bs, mask.shape[-1])
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return out.transpose(1, 2).reshape(bs, T, -1)

    def forward(
        self,
        x: Tensor,
        ctx: Tensor | None,
        rope_blk: tuple[Tensor, Tensor],
        rope_ctx: tuple[Tensor, Tensor] | None,
        blk_slots,
        ctx_slots,
        mask,
        meta: AttentionMeta = None,
    ) -> Tensor:
        if ctx is not None:  # append the new context keys/values first
            self.append_context(ctx, rope_ctx, ctx_slots)
        return self.output(self.attend(self.rotate_and_cache(x, rope_blk, blk_slots), mask, meta))

    def output(self, out: Tensor) -> Tensor:
        """o_proj of the attention's output, summed over the ranks when split."""
        out = self.o_proj(out)
        return self.tp.all_reduce(out) if self.tp else out


class DrafterLayer(nn.Module):
    sliding_window: int | None = None  # set by DFlashDrafter for a sliding-window layer
    causal: bool = False  # set by DFlashDrafter for a layer causal inside the block

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x, h, next_norm: RMSNorm, ctx, rope_blk, rope_ctx, blk_slots, ctx_slots, mask, meta=None
    ) -> tuple[Tensor, Tensor]:
        """Takes the residual stream x and its normed h (this layer's input norm), returns the pair for the
        next layer (next_norm: its input norm, or the final norm), as the target's DecoderLayer does, so
        that the fused layer (ddtree.runtime.fused) joins each residual add with the norm after it."""
        x = x + self.self_attn(h, ctx, rope_blk, rope_ctx, blk_slots, ctx_slots, mask, meta)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, next_norm(x)


class DFlashDrafter(nn.Module):
    layer_class: ClassVar[type[DrafterLayer]] = DrafterLayer

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        # a ModuleList; declared as a list of its item type, which ModuleList (not generic) can't say
        self.layers: list[DrafterLayer] = nn.ModuleList(  # type: ignore[assignment]
            self.layer_class(cfg) for _ in range(cfg.num_hidden_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.sliding_window = cfg.layer_window(i)
            layer.causal = cfg.layer_causal(i)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", self.rope_inv_freq(), persistent=False)
        # YaRN's factor on cos and sin, as transformers' rotary embedding applies it
        self.rope_factor = rope_attention_factor(cfg.rope_scaling)
        self.max_batch = self.max_slots = self.pool_slots = 0
        self.slot_map = torch.zeros(0, 0, dtype=torch.int32)  # setup_caches
        self.rope_table: Tensor | None = None  # setup_caches: cos and sin [2, positions, head_dim]

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def rope_inv_freq(self) -> Tensor:
        cfg = self.config
        return rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, applies_attention_factor=True)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(self.inv_freq, positions, dtype, self.rope_factor)

    def rope_rows(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """rope() at positions below max_slots (a round's block and staged context): rows of the table
        setup_caches made (one gather, where computing them takes seven kernels); computed where there is
        no table in `dtype`. A prefill chunk's padding may pass max_slots, so append_context computes."""
        table = self.rope_table
        if table is None or table.dtype != dtype or table.device != positions.device:
            return self.rope(positions, dtype)
        cos_sin = table[:, positions]
        return cos_sin[0], cos_sin[1]

    def setup_caches(
        self, max_batch: int, max_slots: int, pool_slots: int | None = None, slot_map: Tensor | None = None
    ) -> None:
        """Caches of max_batch rows of max_slots logical slots (layers.slot_map_for); the Engine passes the
        target's pool size and slot map, so that a row's drafter context sits at the physical slots of its
        target text."""
        p = self.fc.weight
        # recomputed here because Module.to(dtype) would have rounded the fp32 frequencies
        self.inv_freq = self.rope_inv_freq().to(p.device)
        # rope_rows' table: the cos/sin of every position a row holds, computed as rope() computes them
        self.rope_table = torch.stack(self.rope(torch.arange(max_slots, device=p.device), p.dtype))
        for layer in self.layers:
            layer.self_attn.kv_cache = None  # free the old cache before allocating the new one
        self.slot_map, pool_slots = slot_map_for(max_batch, max_slots, pool_slots, slot_map, p.device)
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(  # this rank's KV heads when split
                layer.self_attn.n_kv, pool_slots, self.config.head_dim, p.dtype, p.device, self.slot_map
            )
        self.max_batch, self.max_slots, self.pool_slots = max_batch, max_slots, pool_slots

    def forward(
        self,
        block_embeds: Tensor,
        block_positions: Tensor,
        block_slots: Tensor,
        mask: Tensor,
        ctx_features: Tensor | None = None,
        ctx_positions: Tensor | None = None,
        ctx_slots: Tensor | None = None,
    ) -> Tensor:
        """block_embeds [bs, BS, H]: target embeddings of [bonus, MASK...] (the drafter applies its
        input_embedding_scale); ctx_features [bs, P, taps*H]: tapped target hidden states of newly committed
        tokens (cached here); mask [bs, 1, BS, span] over drafter cache slots: the context and the whole
        block (the causal and windowed layers narrow it, layer_mask). Returns normed hidden states [bs, BS, H]."""
        dtype = block_embeds.dtype
        rope_blk = self.rope_rows(block_positions, dtype)
        block_slots = physical_slots(self.slot_map, block_slots)  # the layers write at physical slots
        ctx = rope_ctx = None
        if ctx_features is not None:
            ctx_slots = physical_slots(self.slot_map, ctx_slots)
            ctx = self.hidden_norm(self.fc(ctx_features))
            rope_ctx = self.rope_rows(ctx_positions, dtype)
        scale = self.config.input_embedding_scale
        x = block_embeds if scale == 1.0 else block_embeds * scale
        bs, T, _ = x.shape
        # one mask per kind of layer in this drafter, with what its layers share about it (metadata)
        masks: dict[tuple[int | None, bool], tuple[Tensor, Tensor | None]] = {}
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        h = self.layers[0].input_layernorm(x) if self.layers else self.norm(x)
        for layer, next_norm in zip(self.layers, norms):
            kind = (layer.sliding_window, layer.causal)
            if kind not in masks:
                layer_mask = self.layer_mask(mask, block_positions, *kind).expand(bs, 1, T, mask.shape[-1])
                masks[kind] = layer_mask, layer.self_attn.metadata(layer_mask)
            x, h = layer(x, h, next_norm, ctx, rope_blk, rope_ctx, block_slots, ctx_slots, *masks[kind])
        return h

    @staticmethod
    def layer_mask(mask: Tensor, block_positions: Tensor, window: int | None, causal: bool) -> Tensor:
        """`mask` [bs, 1, BS, span] narrowed for a layer: a causal layer's query sees no key past its own slot;
        a windowed one sees the keys within window - 1 slots before it (and, bidirectional, after it). The
        drafter cache keeps each token at the slot of its position (the Engine writes it so; an inactive row's
        block goes to the trash slot), so this is over positions, the context's and the block's alike."""
        if window is None and not causal:
            return mask
        keys = torch.arange(mask.shape[-1], device=mask.device)
        queries = block_positions[:, None, :, None]
        if causal:
            mask = mask & (keys <= queries)
        if window is not None:
            mask = mask & ((queries - keys) < window)
            if not causal:
                mask = mask & ((keys - queries) < window)
        return mask

    def draft_logits(self, hidden: Tensor, lm_head: Callable[[Tensor], Tensor]) -> Tensor:
        """Draft logits of forward()'s hidden states through the target's LM head, with the drafter's
        output_multiplier and final_logit_softcapping."""
        logits = lm_head(hidden)
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits

    @staticmethod
    def checkpoint_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A checkpoint's tensors under this module's names (the DFlash layout needs no renaming)."""
        return state

    def append_context(
        self, ctx_features: Tensor, positions: Tensor, slots: Tensor, rows: Tensor | None = None
    ) -> None:
        """Cache the context keys/values of committed tokens without running a block (the prompt:
        context K/V depend only on the fused features, never on the block)."""
        ctx = self.hidden_norm(self.fc(ctx_features))
        rope_ctx = self.rope(positions, ctx.dtype)
        slots = physical_slots(self.slot_map, slots, rows)
        for layer in self.layers:
            layer.self_attn.append_context(ctx, rope_ctx, slots)


def init_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """Random weights (std 0.02 linears, unit norms) so everything runs before a drafter is trained."""
    gen = torch.Generator().manual_seed(seed)
    drafter = cfg.drafter_class()(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return drafter


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config.to_hf()
    cfg["torch_dtype"] = str(drafter.fc.weight.dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def random_drafter(target, layers: int, block_size: int = 16, seed: int = 0):
    """A random-init DFlash drafter of `layers` layers for `target` (cost only: it accepts little)."""
    p = target.lm_head.weight
    cfg = DrafterConfig.for_target(target.config, num_layers=layers, block_size=block_size)
    return init_drafter(cfg, seed).to(device=p.device, dtype=p.dtype)
