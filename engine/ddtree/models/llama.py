"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2/2.5, Qwen3) with a static KV cache.

gpt-fast style: one dataclass config, explicit forwards that take token ids, RoPE positions,
cache slots and a boolean attention mask. Cache slots and RoPE positions are separate inputs
because tree nodes are stored in consecutive slots while siblings share a position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import CausalLM
from .config_fields import attention_window, require_fields
from .layers import (
    MLP,
    AttentionMeta,
    Collectives,
    KVCache,
    RMSNorm,
    StepAttention,
    apply_rope,
    dense_split_sizes,
    rope_inv_freq,
    shard_dense_layers,
)


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    model_type: str = "llama"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    attention_window: int | None = None  # a sliding window the config asks for: the context stops there

    def split_sizes(self, whole_experts: bool = True) -> dict[str, int]:
        """The sizes tensor parallelism splits over the ranks (each must be a multiple of their number;
        whole_experts is for the MoE families)."""
        return dense_split_sizes(self)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        require_fields(
            cfg, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        )
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        if rope.get("rope_type", "default") not in ("default", None):
            scaling = dict(rope)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("default", None):
            scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            attention_window=attention_window(cfg),
        )


class Attention(StepAttention):
    """Grouped-query attention over the static cache, as four steps that fused modules replace in part
    (ddtree.runtime.fused): project, normalise + rotate + write the cache, attend, project out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        # Qwen2 has biases on q/k/v only; Llama/Qwen3 put attention_bias on o_proj too
        o_bias = cfg.attention_bias and cfg.model_type != "qwen2"
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        # Qwen3: RMSNorm over each head of q and k before RoPE
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.kv_cache: KVCache | None = None
        self.tp: Collectives | None = None  # set once sharded: o_proj outputs are partial sums

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        bs, T, _ = x.shape
        q = self.q_proj(x).view(bs, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(bs, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(bs, T, self.n_kv, self.head_dim)
        return q, k, v

    def rotate_and_cache(
        self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, rows: Tensor | None
    ) -> Tensor:
        """Normalise and rotate q and k, write k and v at the cache slots; returns q [bs, heads, T, hd]."""
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)
        self.kv_cache.update(slots, k, v.transpose(1, 2))
        return q

    def attend(self, q: Tensor, mask: Tensor, rows: Tensor | None, meta: AttentionMeta) -> Tensor:
        bs, _, T, _ = q.shape
        k_all, v_all = self.kv_cache.read(bs, mask.shape[-1], rows)  # attend over the mask's span only
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return out.transpose(1, 2).reshape(bs, T, -1)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer; families pass their attention and MLP (default: the dense family's)."""

    def __init__(self, cfg, attention: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = attention if attention is not None else Attention(cfg)
        self.mlp = mlp if mlp is not None else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        h: Tensor,
        next_norm: RMSNorm,
        cos: Tensor,
        sin: Tensor,
        slots: Tensor,
        mask: Tensor,
        rows: Tensor | None,
        meta: AttentionMeta,
    ) -> tuple[Tensor, Tensor]:
        """Takes the residual stream x and its normed h (this layer's input norm), returns the pair for
        the next layer: next_norm is its input norm, or the final norm. Carrying the pair lets the fused
        layer (ddtree.runtime.fused) join each residual add with the norm that follows it."""
        x = x + self.self_attn(h, cos, sin, slots, mask, rows, meta)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, next_norm(x)


class Decoder(nn.Module):
    """Holds the HF `model.*` parameter names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # a ModuleList; declared as a list of its item type, which ModuleList (not generic) can't say
        self.layers: list[DecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(CausalLM):
    """The dense target: grouped-query attention with a per-head KV cache (base.CausalLM has the rest)."""

    config_class = ModelConfig

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )
        self.kv_storage: Tensor | None = None  # [layers, 2 (k, v), kv heads, physical slots + 1, head dim]

    def shard_layers(self, tp: Collectives, whole_experts: bool = True) -> None:
        """Keep this rank's heads and MLP columns of every layer (ddtree.runtime.parallel.shard splits the
        vocabulary and checks split_sizes first); no experts here, whole_experts is for the MoE families."""
        shard_dense_layers(self.model.layers, self.config, tp)

    @property
    def cache_storage(self) -> Tensor | None:
        """The one buffer holding every layer's cache (None before setup_caches)."""
        return self.kv_storage

    def setup_caches(
        self, max_batch: int, max_slots: int, pool_slots: int | None = None, slot_map: Tensor | None = None
    ) -> None:
        p = self.lm_head.weight
        # recomputed here because Module.to(dtype) would have rounded the fp32 frequencies
        self.inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope_theta, self.config.rope_scaling).to(
            p.device
        )
        n_kv, hd = self.model.layers[0].self_attn.n_kv, self.config.head_dim  # this rank's KV heads
        self.kv_storage = None  # free the old cache before allocating the new one
        for layer in self.model.layers:
            layer.self_attn.kv_cache = None
        pool_slots = self.setup_slot_map(max_batch, max_slots, pool_slots, slot_map)
        self.kv_storage = torch.zeros(
            len(self.model.layers), 2, n_kv, pool_slots + 1, hd, dtype=p.dtype, device=p.device
        )
        for i, layer in enumerate(self.model.layers):  # indexing, not unbind: its views can't be written under autograd
            layer.self_attn.kv_cache = KVCache(
                n_kv, pool_slots, hd, p.dtype, p.device, self.slot_map, self.kv_storage[i]
            )

    def compact(self, src: Tensor, dst: Tensor) -> None:
        """Copy logical cache slots src [bs, n] of rows 0..bs-1 to dst [bs, n] in every layer (an accepted
        tree path moves to the committed text): one gather and one scatter over all layers."""
        src, dst = self.physical_slots(src), self.physical_slots(dst)
        moved = self.kv_storage[:, :, :, src]  # a copy first: dst and src overlap
        self.kv_storage[:, :, :, dst] = moved

    def slot_storage(self) -> Tensor:
        """The whole cache as [planes, heads, physical slots, width] (planes: layers x k/v), what compact
        moves slots of (kernels.move_slots)."""
        return self.kv_storage.flatten(0, 1)
