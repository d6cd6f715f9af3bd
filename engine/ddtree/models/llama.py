"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2/2.5, Qwen3) with a static KV cache.

gpt-fast style: one dataclass config, explicit forwards that take token ids, RoPE positions,
cache slots and a boolean attention mask. Cache slots and RoPE positions are separate inputs
because tree nodes are stored in consecutive slots while siblings share a position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..runtime import kernels
from .layers import MLP, KVCache, RMSNorm, apply_rope, concat_views, rope_cos_sin, rope_inv_freq

if TYPE_CHECKING:
    from ..runtime.parallel import TensorParallel


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

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        model_type = cfg.get("model_type", "llama")
        supported = {"llama", "qwen2", "qwen3", "mistral"}
        if model_type not in supported:
            raise ValueError(f"unsupported model_type '{model_type}' (supported: {', '.join(sorted(supported))})")
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
        )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        # Qwen2 has biases on q/k/v only; Llama/Qwen3 put attention_bias on o_proj too
        o_bias = cfg.attention_bias and cfg.model_type != "qwen2"
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kv_cache: KVCache | None = None
        self.tp: TensorParallel | None = None  # set once sharded: o_proj outputs are partial sums
        self.wqkv: Tensor | None = None  # fused projection, see fuse()
        self.bqkv: Tensor | None = None
        self.kernels = False  # Triton norm + RoPE + KV write (kernels.py), see Transformer.fuse()

    def fuse(self) -> None:
        """One GEMM for q, k and v: the three weights become views into one concatenated tensor, so
        the parameter names (and state dicts) stay Hugging Face's and no memory is duplicated."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.wqkv = concat_views([p.weight for p in projs])
        if self.q_proj.bias is not None:
            self.bqkv = concat_views([p.bias for p in projs])

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        slots: Tensor,
        mask: Tensor,
        rows: Tensor | None,
        extent: Tensor | None = None,
    ) -> Tensor:
        bs, T, _ = x.shape
        one_row = self.kernels and bs * T == 1  # a batch-1 decode step: GEMVs (kernels.gemv)
        if self.wqkv is not None:
            qkv = (
                kernels.gemv(x, self.wqkv, self.bqkv, config=kernels.GEMV_CONFIGS["qkv"])
                if one_row
                else F.linear(x, self.wqkv, self.bqkv)
            )
            q, k, v = qkv.split(
                [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], dim=-1
            )
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(bs, T, self.n_heads, self.head_dim)
        k = k.view(bs, T, self.n_kv, self.head_dim)
        v = v.view(bs, T, self.n_kv, self.head_dim)
        if self.kernels:  # one kernel for what follows in the else branch (KVCache.update's layout)
            norm = self.q_norm is not None
            q = kernels.qk_norm_rope_kv(
                q,
                k,
                v,
                cos,
                sin,
                self.q_norm.weight if norm else None,
                self.k_norm.weight if norm else None,
                self.q_norm.eps if norm else 0.0,
                self.kv_cache.k,
                self.kv_cache.v,
                rows,
                slots,
            )
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rope(q.transpose(1, 2), cos, sin)
            k = apply_rope(k.transpose(1, 2), cos, sin)
            self.kv_cache.update(slots, k, v.transpose(1, 2), rows)
        if self.kernels and kernels.attention_applies(bs, T):
            out = kernels.attention(q, self.kv_cache.k, self.kv_cache.v, mask, rows, extent)
        else:
            k_all, v_all = self.kv_cache.read(bs, mask.shape[-1], rows)  # attend over the mask's span only
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
            out = out.transpose(1, 2).reshape(bs, T, -1)
        o_config = kernels.SKINNY_CONFIGS.get("o")
        if one_row:
            out = kernels.gemv(out, self.o_proj.weight, self.o_proj.bias, config=kernels.GEMV_CONFIGS["o"])
        elif (
            self.kernels
            and self.tp is None
            and self.o_proj.bias is None  # the all-reduce takes one tensor
            and kernels.skinny_applies(
                bs * T, self.o_proj.weight.shape[0], self.o_proj.weight.shape[1], o_config, x.dtype
            )
        ):
            out = kernels.skinny_linear(out, self.o_proj.weight, o_config)  # [splits, bs, T, hidden]: add_rms_norm sums
        else:
            out = self.o_proj(out)
        return self.tp.all_reduce(out) if self.tp else out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: Tensor, rows: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask, rows)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        x: Tensor,
        h: Tensor,
        next_norm: RMSNorm,
        cos: Tensor,
        sin: Tensor,
        slots: Tensor,
        mask: Tensor,
        rows: Tensor | None,
        extent: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """The Triton path: each residual add is fused with the RMSNorm that follows it (this layer's
        post-attention norm, then the next layer's input norm or the final norm), so the layer takes
        the residual x and its normed h and returns the pair for the next one. Attention and MLP outputs
        arrive already all-reduced under tensor parallelism, before the add, as in forward(). extent:
        kernels.mask_extent(mask), shared by the layers."""
        post = self.post_attention_layernorm
        h, x = kernels.add_rms_norm(self.self_attn(h, cos, sin, slots, mask, rows, extent), x, post.weight, post.eps)
        h, x = kernels.add_rms_norm(self.mlp(h), x, next_norm.weight, next_norm.eps)
        return x, h


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


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )
        self.max_batch = self.max_slots = 0
        self.kv_storage: Tensor | None = None  # [layers, 2 (k, v), batch, kv heads, slots + 1, head dim]
        self.tp: TensorParallel | None = None  # set once sharded
        self.kernels = False  # Triton kernels in the forward, see fuse()

    def _apply(self, fn, recurse=True):
        # moving or casting re-creates the parameters: drop the fused views (the next Engine fuses again)
        self.fuse_off()
        return super()._apply(fn, recurse)

    def fuse_off(self) -> None:
        self.kernels = False
        for layer in self.model.layers:
            layer.self_attn.wqkv = layer.self_attn.bqkv = layer.mlp.w_gate_up = None
            layer.self_attn.kernels = layer.mlp.kernels = False

    def fuse(self, kernels: bool = False) -> None:
        """Fused q/k/v and gate/up GEMMs for inference (fewer, larger kernels); weights are shared.
        kernels=True also swaps the element-wise work between the GEMMs for the Triton kernels of
        kernels.py (CUDA, or CPU under TRITON_INTERPRET=1); calling fuse again only toggles that."""
        if kernels:
            from ..runtime.kernels import available

            if not available(self.lm_head.weight.device):
                raise RuntimeError(
                    f"Triton kernels need triton and a CUDA device (model is on "
                    f"{self.lm_head.weight.device}; on CPU only under TRITON_INTERPRET=1)"
                )
        self.kernels = kernels
        for layer in self.model.layers:
            if layer.self_attn.wqkv is None:
                layer.self_attn.fuse()
                layer.mlp.fuse()
            layer.self_attn.kernels = layer.mlp.kernels = kernels

    def setup_caches(self, max_batch: int, max_slots: int) -> None:
        p = self.lm_head.weight
        # recomputed here because Module.to(dtype) would have rounded the fp32 frequencies
        self.inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope_theta, self.config.rope_scaling).to(
            p.device
        )
        n_kv, hd = self.model.layers[0].self_attn.n_kv, self.config.head_dim  # this rank's KV heads
        self.kv_storage = None  # free the old cache before allocating the new one
        for layer in self.model.layers:
            layer.self_attn.kv_cache = None
        self.kv_storage = torch.zeros(
            len(self.model.layers), 2, max_batch, n_kv, max_slots + 1, hd, dtype=p.dtype, device=p.device
        )
        for i, layer in enumerate(self.model.layers):  # indexing, not unbind: its views can't be written under autograd
            layer.self_attn.kv_cache = KVCache(max_batch, n_kv, max_slots, hd, p.dtype, p.device, self.kv_storage[i])
        self.max_batch, self.max_slots = max_batch, max_slots

    @property
    def trash_slot(self) -> int:
        return self.max_slots

    def embed(self, tokens: Tensor) -> Tensor:
        if self.tp is None:
            return self.model.embed_tokens(tokens)
        # vocabulary-parallel: each rank looks up the ids in its slice, the all-reduce fills in the rest
        local = self.model.embed_tokens.weight.shape[0]
        ids = tokens - self.tp.rank * local
        mine = (ids >= 0) & (ids < local)
        x = self.model.embed_tokens(ids.clamp(0, local - 1)) * mine[..., None].to(self.lm_head.weight.dtype)
        return self.tp.all_reduce(x)

    def logits(self, hidden: Tensor) -> Tensor:
        out = self.lm_head(hidden)
        return self.tp.all_gather_last(out) if self.tp else out

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        slots: Tensor,
        mask: Tensor,
        tap_layers: tuple[int, ...] = (),
        logits: bool = True,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """tokens, positions, slots: [bs, T]; mask: [bs, 1, T, span] bool over cache slots;
        rows: the cache rows of the batch entries (default 0..bs-1).

        Returns (logits [bs, T, V] or the final normed hidden states, taps [bs, T, len(taps)*H] or None),
        where tap l is the output of decoder layer l (0-based).
        """
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.lm_head.weight.dtype)
        x = self.embed(tokens)
        taps = {}
        layers = self.model.layers
        if self.kernels and len(layers):
            bs, T = tokens.shape
            extent = (
                kernels.mask_extent(mask.expand(bs, 1, T, mask.shape[-1])) if kernels.attention_applies(bs, T) else None
            )
            h = layers[0].input_layernorm(x)
            for i, layer in enumerate(layers):
                next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
                x, h = layer.forward_fused(x, h, next_norm, cos, sin, slots, mask, rows, extent)
                if i in tap_layers:
                    taps[i] = x
        else:
            for i, layer in enumerate(layers):
                x = layer(x, cos, sin, slots, mask, rows)
                if i in tap_layers:
                    taps[i] = x
            h = self.model.norm(x)
        tapped = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None
        return (self.logits(h) if logits else h), tapped

    @classmethod
    def from_pretrained(cls, folder, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
        """Load an HF-layout folder (config.json + safetensors, sharded or not)."""
        from .checkpoint import load_config, load_state_dict

        cfg = ModelConfig.from_hf(load_config(folder))
        state = load_state_dict(folder, dtype=dtype)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        with torch.device("meta"):
            model = cls(cfg)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {folder} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = torch.empty(0)  # set by setup_caches
        return model.to(device=device, dtype=dtype).eval()

    def compact(self, src: Tensor, dst: Tensor) -> None:
        """Copy cache slots src [bs, n] to dst [bs, n] in every layer (an accepted tree path moves to
        the committed text): one gather and one scatter over all layers."""
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        moved = self.kv_storage[:, :, rows, :, src]  # a copy first: dst and src overlap
        self.kv_storage[:, :, rows, :, dst] = moved
