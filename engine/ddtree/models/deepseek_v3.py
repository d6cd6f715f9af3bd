"""DeepSeek-V3 / Kimi K2 family (model_type `deepseek_v3`, `kimi_k2`, `kimi_k25`): multi-head latent attention
(MLA) over a latent KV cache, and DeepSeek's MoE (sigmoid group-limited routing, shared experts).

Parameter names are the published checkpoints' (`self_attn.q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, ...,
`mlp.experts.{e}.*`, `mlp.gate.e_score_correction_bias`). Kimi K2.5 / K2.6 (`kimi_k25`) nest the language
model's config under `text_config` and its weights under `language_model.`; this family loads the text model
only (the vision tower and projector are skipped: text in, text out).

MLA, per layer and token: the query is `q_b_proj(q_a_layernorm(q_a_proj(x)))` (or `q_proj(x)` when
q_lora_rank is null), per head a no-RoPE part (qk_nope_head_dim) and a RoPE part (qk_rope_head_dim).
`kv_a_proj_with_mqa(x)` gives the compressed kv (kv_lora_rank) and one RoPE key shared by all heads;
`kv_a_layernorm` normalises the compressed kv, and `kv_b_proj` would expand it into every head's no-RoPE key
and value. RoPE uses DeepSeek's interleaved pairs (rope_interleave, as transformers: pairs (0,1), (2,3), ...
are rotated, i.e. the dims are de-interleaved, evens then odds, before a rotate-half RoPE; q and k alike).

The latent KV cache keeps, per layer and token, only [normed compressed kv | rotated RoPE key]
(kv_lora_rank + qk_rope_head_dim values: 576 for DeepSeek-V3 and Kimi K2, against 2 x 64 heads x 128 for
expanded keys and values), every layer in one buffer [layers, physical slots + 1, 576], so that compaction is
one gather and one scatter. Attention is computed in the absorbed form for every forward (prefill, decode,
tree verify): kv_b_proj's key part is folded into the query (q_nope @ W_uk per head gives a kv_lora_rank
query), so each head attends straight over the cached latents (one shared "KV head" of 576 dims whose values
are its first kv_lora_rank dims), and kv_b_proj's value part maps each head's attended latent to its value
after attention. Softmax scale: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's
mscale(factor, mscale_all_dim)^2 when the config sets mscale_all_dim (as transformers does).

The config is read strictly: every field is used, checked against the one value implemented, or on the
list of fields known not to change the math (IGNORED, each with its reason); any other field is refused
with its name. A `quantization_config` (FP8 blocks, compressed-tensors INT4) is read by
quant_config.parse_quantization when the checkpoint loads (base.CausalLM.from_pretrained).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import llama
from .base import CausalLM
from .layers import (
    MLP,
    AttentionMeta,
    Collectives,
    RMSNorm,
    StepAttention,
    apply_rope,
    keep_inputs,
    keep_outputs,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    rope_kind,
    shard_mlp,
    yarn_mscale,
    zero_unless_first,
)
from .moe import GroupLimitedSigmoid, SparseMoE, shard_experts
from .quant import linear_weight

MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")

# the sizes every config must give (no guessed defaults for the shape of the model)
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
)
# fields read with a default when absent (transformers' DeepseekV3Config defaults)
OPTIONAL = (
    "model_type",
    "num_key_value_heads",  # must equal num_attention_heads (MLA has no grouped KV heads)
    "norm_topk_prob",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rope_interleave",
    "max_position_embeddings",
    "attention_bias",
    "tie_word_embeddings",
    "eos_token_id",
    "bos_token_id",
    "num_nextn_predict_layers",  # multi-token-prediction layers: not run; their weights are skipped on load
    "quantization_config",  # read by from_pretrained (models/quant_config.py)
)
# math-changing fields implemented for these values only (the first is the default when absent)
ONLY = {
    "hidden_act": ("silu",),
    "topk_method": ("noaux_tc",),
    "scoring_func": ("sigmoid",),
    "moe_layer_freq": (1,),
}
# fields that do not change inference, and why they are ignored
IGNORED = {
    **dict.fromkeys(("architectures", "auto_map", "transformers_version", "_name_or_path"), "bookkeeping"),
    **dict.fromkeys(("torch_dtype", "dtype"), "the caller picks the dtype"),
    "head_dim": "transformers sets it to qk_rope_head_dim; recomputed here",
    "qk_head_dim": "qk_nope_head_dim + qk_rope_head_dim; recomputed here",
    "initializer_range": "training: weight init",
    "attention_dropout": "training: no dropout at inference",
    "aux_loss_alpha": "training: the auxiliary balance loss",
    "seq_aux": "training: the auxiliary balance loss",
    "ep_size": "deployment: expert-parallel size of the original code",
    "pretraining_tp": "transformers' DeepSeek-V3 ignores it (same math)",
    "pad_token_id": "padding id: the engine pads with its own masks",
    "use_cache": "the engine always caches",
    # transformers 4.x PretrainedConfig defaults written into nested configs (Kimi K2.5's text_config):
    # generation settings and bookkeeping, none read by the forward
    **dict.fromkeys(
        (
            "add_cross_attention",
            "bad_words_ids",
            "begin_suppress_tokens",
            "chunk_size_feed_forward",
            "cross_attention_hidden_size",
            "decoder_start_token_id",
            "diversity_penalty",
            "do_sample",
            "early_stopping",
            "encoder_no_repeat_ngram_size",
            "exponential_decay_length_penalty",
            "finetuning_task",
            "forced_bos_token_id",
            "forced_eos_token_id",
            "id2label",
            "is_decoder",
            "is_encoder_decoder",
            "label2id",
            "length_penalty",
            "max_length",
            "min_length",
            "no_repeat_ngram_size",
            "num_beam_groups",
            "num_beams",
            "num_return_sequences",
            "output_attentions",
            "output_hidden_states",
            "output_scores",
            "prefix",
            "problem_type",
            "pruned_heads",  # checked empty below
            "remove_invalid_values",
            "repetition_penalty",
            "return_dict",
            "return_dict_in_generate",
            "sep_token_id",
            "suppress_tokens",
            "task_specific_params",
            "temperature",
            "tf_legacy_loss",
            "tie_encoder_decoder",
            "tokenizer_class",
            "top_k",
            "top_p",
            "torchscript",
            "typical_p",
            "use_bfloat16",
        ),
        "transformers 4.x generation default / bookkeeping",
    ),
}
# Kimi K2.5 / K2.6's outer config: the language model is text_config; the rest is the vision tower, the
# projector and multimodal token ids (text only here: ignored)
KIMI_K25_VISION = (
    "vision_config",
    "media_placeholder_token_id",
    "use_unified_vision_chunk",
    "video_placeholder",
    "ignore_index",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "projection_hidden_size",
    "projection_layer_norm_eps",
)
# keys of the RoPE dict (rope_scaling or rope_parameters)
ROPE_KEYS = (
    "type",
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "partial_rotary_factor",  # must be 1
)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' and DeepSeek's default, not rms_norm_eps


def _check_fields(cfg: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(
            f"{where}config field '{unknown[0]}' is not known to the deepseek_v3 family and may change the "
            f"model's math: refused rather than ignored"
            + (f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else "")
        )


def _rope(cfg: dict, max_positions: int) -> tuple[float, dict | None]:
    """(theta, scaling) of a config: the RoPE dict is rope_parameters (transformers 5) or rope_scaling
    (the published 4.x files), normalised to rope_type; only plain RoPE and YaRN are implemented."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    name = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    unknown = sorted(set(params) - set(ROPE_KEYS))
    if unknown:
        raise ValueError(f"config field '{name}.{unknown[0]}' is not known to the deepseek_v3 family: refused")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config field '{name}.partial_rotary_factor' must be 1 (RoPE covers qk_rope_head_dim)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope_kind(params) or "default"
    if kind == "default":
        return theta, None
    if kind != "yarn":
        key = "rope_type" if "rope_type" in params else "type"
        raise ValueError(f"config field '{name}.{key}' is '{kind}': only yarn (or no scaling) is implemented")
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = "yarn"
    # as transformers: the pre-YaRN context defaults to max_position_embeddings, the factor to their ratio
    if scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = max_positions
    if scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return theta, scaling


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP of the first first_k_dense_replace layers
    moe_intermediate_size: int  # each routed expert; shared experts are n_shared_experts times it
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # normalised: rope_type "yarn" with factor and the pre-YaRN context
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "deepseek_v3"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    num_nextn_predict_layers: int = 0
    quantization: dict | None = None  # the checkpoint's quantization_config, if any

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per layer and token in the latent cache: the compressed kv and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling and self.rope_scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(self.rope_scaling["factor"], self.rope_scaling["mscale_all_dim"])
            scale = scale * mscale * mscale
        return scale

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def split_sizes(self, whole_experts: bool = True) -> dict[str, int]:
        """The sizes tensor parallelism splits over the ranks (each must be a multiple of their number);
        whole_experts: routed experts split whole (expert parallelism), else each expert's width."""
        sizes = {"attention heads": self.num_attention_heads, "vocabulary": self.vocab_size}
        if self.first_k_dense_replace > 0:
            sizes["MLP width"] = self.intermediate_size
        if self.num_hidden_layers > self.first_k_dense_replace:
            if whole_experts:
                sizes["routed experts"] = self.n_routed_experts
            else:
                sizes["expert width"] = self.moe_intermediate_size
            if self.n_shared_experts:
                sizes["shared experts width"] = self.n_shared_experts * self.moe_intermediate_size
        return sizes

    def drafter_attention(self) -> tuple[int, int, int]:
        """(heads, KV heads, head dim) of a DFlash drafter made for this target (DrafterConfig.for_target).
        MLA has no dense head_dim or KV heads to copy, so the drafter takes the shape of the published z-lab
        Kimi-K2.5 drafter (64 heads of 128, 8 KV heads, for a 64-head Kimi): the target's query heads,
        head dim v_head_dim (128 for DeepSeek-V3 and Kimi K2), and KV heads the largest divisor of the
        heads that is at most heads / 8 (at least 1)."""
        heads = self.num_attention_heads
        kv = max(d for d in range(1, max(1, heads // 8) + 1) if heads % d == 0)
        return heads, kv, self.v_head_dim

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dict: deepseek_v3 / kimi_k2, or kimi_k25 with the language
        model under text_config (its vision parts are ignored: text only). Refuses, naming the field, any
        field it does not know and any value of a math-changing field it does not implement."""
        model_type = cfg.get("model_type", "deepseek_v3")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type '{model_type}' is not one of {', '.join(MODEL_TYPES)}")
        outer: dict[str, Any] = {}
        if model_type == "kimi_k25":
            if not isinstance(cfg.get("text_config"), dict):
                raise ValueError("a kimi_k25 config needs its language model under 'text_config'")
            outer, cfg = cfg, cfg["text_config"]
            _check_fields(
                outer, {"text_config", *KIMI_K25_VISION, *REQUIRED, *OPTIONAL, *ONLY, *IGNORED}, "kimi_k25 outer "
            )
            inner_type = cfg.get("model_type", "deepseek_v3")
            if inner_type not in ("deepseek_v3", "kimi_k2"):
                raise ValueError(f"config field 'text_config.model_type' is '{inner_type}' (deepseek_v3 or kimi_k2)")
            for key in ("tie_word_embeddings", "quantization_config"):
                if key in outer and key in cfg and outer[key] != cfg[key]:
                    raise ValueError(f"config field '{key}' differs between the top level and text_config")
        _check_fields(cfg, {*REQUIRED, *OPTIONAL, *ONLY, *IGNORED}, "text_config " if outer else "")
        missing = [k for k in REQUIRED if k not in cfg]
        if missing:
            also = f" (and {', '.join(missing[1:])})" if missing[1:] else ""
            raise ValueError(f"config lacks '{missing[0]}'{also}")
        for key, allowed in ONLY.items():
            if cfg.get(key, allowed[0]) not in allowed:
                raise ValueError(
                    f"config field '{key}' is {cfg[key]!r}: only {', '.join(map(repr, allowed))} is implemented"
                )
        if cfg.get("pruned_heads"):
            raise ValueError("config field 'pruned_heads' is not empty: pruned heads are not implemented")
        heads = cfg["num_attention_heads"]
        if cfg.get("num_key_value_heads") not in (None, heads):
            raise ValueError(
                f"config field 'num_key_value_heads' is {cfg['num_key_value_heads']}: MLA expands the latent into "
                f"all {heads} heads (it must equal num_attention_heads)"
            )
        max_positions = cfg.get("max_position_embeddings", 4096)
        theta, scaling = _rope(cfg, max_positions)
        n_group, topk_group = cfg["n_group"] or 1, cfg["topk_group"] or 1
        experts = cfg["n_routed_experts"]
        if experts % n_group or topk_group > n_group:
            raise ValueError(f"n_group {n_group} / topk_group {topk_group} do not fit {experts} routed experts")

        def token_ids(key: str) -> list[int]:
            value = cfg.get(key, outer.get(key))
            return [] if value is None else ([value] if isinstance(value, int) else list(value))

        bos = token_ids("bos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            q_lora_rank=cfg["q_lora_rank"],
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            n_routed_experts=experts,
            n_shared_experts=cfg["n_shared_experts"] or 0,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            first_k_dense_replace=cfg["first_k_dense_replace"],
            routed_scaling_factor=cfg["routed_scaling_factor"],
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_interleave=cfg.get("rope_interleave", True),
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", False)),
            attention_bias=cfg.get("attention_bias", False),
            model_type=model_type,
            eos_token_ids=token_ids("eos_token_id"),
            bos_token_id=bos[0] if bos else None,
            num_nextn_predict_layers=cfg.get("num_nextn_predict_layers") or 0,
            quantization=cfg.get("quantization_config", outer.get("quantization_config")),
        )


class LatentCache(nn.Module):
    """One layer's latent KV cache [pool_slots + 1, kv_lora_rank + qk_rope_head_dim] in physical slots: per
    token the normed compressed kv, then the rotated RoPE key. Rows reach their slots through the model's
    `slot_map` (as layers.KVCache). The last slot is the trash slot (padding writes there; no mask shows
    it). `storage` is this layer's view of the target's all-layer buffer."""

    latent: Tensor  # a buffer, declared for the type checker

    def __init__(self, storage: Tensor, slot_map: Tensor):
        super().__init__()
        self.register_buffer("latent", storage, persistent=False)
        self.slot_map = slot_map

    def update(self, slots: Tensor, latent: Tensor) -> None:
        """Write latent [bs, T, dim] at physical slots [bs, T]."""
        self.latent[slots] = latent

    def read(self, bs: int, span: int, rows: Tensor | None = None) -> Tensor:
        """Latents [bs, span, dim] of logical slots 0..span-1 of rows `rows` (default 0..bs-1), gathered."""
        table = (self.slot_map[:bs] if rows is None else self.slot_map[rows])[:, :span]
        return self.latent[table]

    def row(self, row: int, n: int) -> Tensor:
        """Latents [n, dim] of row `row`'s logical slots 0..n-1 (a copy)."""
        return self.latent[self.slot_map[row, :n]]


class Attention(StepAttention):
    """Multi-head latent attention in the absorbed form, over the latent cache, as four steps like llama's
    (project, rotate + cache, attend, project out)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads  # this rank's heads once sharded
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.interleave = cfg.rope_interleave
        self.scale = cfg.softmax_scale
        hidden, bias, q_out = cfg.hidden_size, cfg.attention_bias, cfg.num_attention_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, cfg.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.num_attention_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * self.v_dim, hidden, bias=bias)
        self.low_rank_q = cfg.q_lora_rank is not None
        self.cache: LatentCache | None = None
        self.tp: Collectives | None = None  # set once sharded: o_proj outputs are partial sums

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [bs, T, hidden] -> (q [bs, T, heads, nope + rope], kv_a output [bs, T, kv_lora_rank + rope])."""
        bs, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        return q.view(bs, T, self.n_heads, self.nope + self.rope), self.kv_a_proj_with_mqa(x)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE on x [bs, heads, T, rope]: DeepSeek's interleaved pairs are de-interleaved first (evens, then
        odds), then rotated in the rotate-half layout, which is transformers' apply_rotary_pos_emb_interleave."""
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, cos, sin)

    def _kv_b(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj's weight per head: W_uk [heads, nope, kv_lora_rank] and W_uv [heads, v, kv_lora_rank] (views)."""
        w = linear_weight(self.kv_b_proj, self.kv_a_layernorm.weight.dtype)
        w = w.view(self.n_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def rotate_and_cache(
        self, q: Tensor, kv: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, rows: Tensor | None
    ) -> Tensor:
        """Rotate the RoPE parts, write [normed compressed kv | RoPE key] at the cache slots, and return the
        absorbed query [bs, heads, T, kv_lora_rank + rope]: [q_nope @ W_uk | rotated q_rope]."""
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = kv.split([self.rank, self.rope], dim=-1)
        k_rope = self._rotate(k_rope[:, None], cos, sin)[:, 0]  # one key shared by the heads
        self.cache.update(slots, torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1))
        return torch.cat([self.absorb(q_nope), self._rotate(q_rope.transpose(1, 2), cos, sin)], dim=-1)

    def absorb(self, q_nope: Tensor) -> Tensor:
        """W_uk per head: q_nope [bs, T, heads, qk_nope_head_dim] -> [bs, heads, T, kv_lora_rank]."""
        w_uk, _ = self._kv_b()
        return torch.einsum("bthn,hnr->bhtr", q_nope, w_uk)

    def attend(self, q: Tensor, mask: Tensor, rows: Tensor | None, meta: AttentionMeta) -> Tensor:
        """Every head over the cached latents (keys: all of them; values: the compressed kv), then W_uv:
        [bs, T, heads * v_head_dim]."""
        bs, _, T, _ = q.shape
        latent = self.cache.read(bs, mask.shape[-1], rows)[:, None]  # [bs, 1, span, dim]: one shared KV head
        out = F.scaled_dot_product_attention(
            q, latent, latent[..., : self.rank], attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return self.values(out.transpose(1, 2))

    def values(self, out: Tensor) -> Tensor:
        """W_uv per head: attention over the compressed kv [bs, T, heads, kv_lora_rank] -> [bs, T, heads *
        v_head_dim]."""
        bs, T, _, _ = out.shape
        _, w_uv = self._kv_b()
        return torch.einsum("bthr,hvr->bthv", out, w_uv).reshape(bs, T, self.n_heads * self.v_dim)


def decoder_layer(cfg: ModelConfig, index: int) -> llama.DecoderLayer:
    """llama's pre-norm pair-form layer with MLA attention, and DeepSeek's MoE (routed experts under
    group-limited sigmoid routing, plus shared experts) past the first `first_k_dense_replace` layers."""
    if not cfg.is_moe(index):
        return llama.DecoderLayer(cfg, Attention(cfg), MLP(cfg.hidden_size, cfg.intermediate_size))
    gate = GroupLimitedSigmoid(
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.n_group,
        cfg.topk_group,
        cfg.norm_topk_prob,
        cfg.routed_scaling_factor,
    )
    shared = cfg.n_shared_experts * cfg.moe_intermediate_size
    moe = SparseMoE(gate, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, shared)
    return llama.DecoderLayer(cfg, Attention(cfg), moe)


class Decoder(nn.Module):
    """Holds the HF `model.*` parameter names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers: list[llama.DecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# checkpoint keys of Kimi K2.5 / K2.6 (published: language_model.model.*, transformers 5: model.language_model.*)
_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_VISION = re.compile(r"^(model\.)?(vision_tower|mm_projector|multi_modal_projector)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_name(name: str, cfg: ModelConfig) -> str | None:
    """A published checkpoint tensor's name here: Kimi K2.5's language-model prefix stripped; None for its
    vision tower and projector and for the multi-token-prediction layers (num_hidden_layers ..
    + num_nextn_predict_layers), which are not run here."""
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    if _VISION.match(name):
        return None
    layer = _LAYER.match(name)
    if layer and cfg.num_hidden_layers <= int(layer.group(1)) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
        return None
    return name


class Transformer(CausalLM):
    """The target over MLA layers and DeepSeek MoE blocks (base.CausalLM has the forward, embedding, LM
    head and loading), with a latent cache and YaRN's attention factor on cos/sin."""

    config_class = ModelConfig

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_factor = rope_attention_factor(cfg.rope_scaling)  # YaRN's cos/sin scale
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.latent_storage: Tensor | None = None  # [layers, physical slots + 1, kv_lora_rank + qk_rope_head_dim]

    def _inv_freq(self) -> Tensor:
        cfg = self.config
        return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, applies_attention_factor=True)

    def _apply(self, fn, recurse=True):
        # the routers' correction biases stay fp32 through casts (as transformers keeps them): they decide
        # near-ties; super()._apply resets the backend
        gates = [m for m in self.modules() if isinstance(m, GroupLimitedSigmoid)]
        kept = [g.e_score_correction_bias for g in gates]
        out = super()._apply(fn, recurse)
        for gate, bias in zip(gates, kept):
            if bias.device.type != "meta":
                gate.e_score_correction_bias = bias.to(gate.e_score_correction_bias.device, torch.float32)
        return out

    def shard_layers(self, tp: Collectives, whole_experts: bool = True) -> None:
        """Keep this rank's attention heads (q_b_proj / q_proj and kv_b_proj rows, o_proj columns), its
        routed experts and its share of the shared experts and dense MLPs. q_a / kv_a projections, their
        norms, the routers and the latent cache stay replicated (every rank computes the same latents)."""
        cfg, world, rank = self.config, tp.world, tp.rank
        heads = cfg.num_attention_heads // world
        for layer in self.model.layers:
            attn = layer.self_attn
            q = attn.q_b_proj if attn.low_rank_q else attn.q_proj
            keep_outputs(q, rank, heads * cfg.qk_head_dim)
            keep_outputs(attn.kv_b_proj, rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
            keep_inputs(attn.o_proj, rank, heads * cfg.v_head_dim)
            if attn.o_proj.bias is not None:
                zero_unless_first(attn.o_proj.bias, rank)
            attn.n_heads, attn.tp = heads, tp
            if isinstance(layer.mlp, SparseMoE):
                shard_experts(layer.mlp, tp, whole_experts)  # router replicated, shared experts split
            elif isinstance(layer.mlp, MLP):
                shard_mlp(layer.mlp, tp, cfg.intermediate_size // world)
            else:
                raise TypeError(f"no tensor-parallel split for {type(layer.mlp).__name__}")

    @property
    def cache_storage(self) -> Tensor | None:
        """The one buffer holding every layer's cache (None before setup_caches)."""
        return self.latent_storage

    def setup_caches(
        self, max_batch: int, max_slots: int, pool_slots: int | None = None, slot_map: Tensor | None = None
    ) -> None:
        p = self.lm_head.weight
        self.inv_freq = self._inv_freq().to(p.device)  # recomputed: Module.to(dtype) would have rounded it
        self.latent_storage = None  # free the old cache before allocating the new one
        for layer in self.model.layers:
            layer.self_attn.cache = None
        pool_slots = self.setup_slot_map(max_batch, max_slots, pool_slots, slot_map)
        self.latent_storage = torch.zeros(
            len(self.model.layers), pool_slots + 1, self.config.latent_dim, dtype=p.dtype, device=p.device
        )
        for i, layer in enumerate(self.model.layers):  # indexing, not unbind: its views can't be written under autograd
            layer.self_attn.cache = LatentCache(self.latent_storage[i], self.slot_map)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(self.inv_freq, positions, self.lm_head.weight.dtype, self.rope_factor)

    # the routers' correction biases stay fp32 (they decide near-ties), as do FP8 block scales
    keep_dtype = ("e_score_correction_bias", "weight_scale_inv")

    @classmethod
    def checkpoint_names(cls, keys, cfg) -> dict[str, str]:
        """Kimi K2.5's language model renamed; vision and multi-token prediction left unread."""
        names = {}
        for key in keys:
            name = checkpoint_name(key, cfg)
            if name is not None:
                names[name] = key
        return names

    def compact(self, src: Tensor, dst: Tensor) -> None:
        """Copy logical cache slots src [bs, n] of rows 0..bs-1 to dst [bs, n] in every layer (an accepted
        tree path moves to the committed text): one gather and one scatter over all layers' latents."""
        src, dst = self.physical_slots(src), self.physical_slots(dst)
        moved = self.latent_storage[:, src]  # a copy first: dst and src overlap
        self.latent_storage[:, dst] = moved

    def slot_storage(self) -> Tensor:
        """The whole cache as [layers, 1, physical slots, latent_dim], what compact moves slots of
        (kernels.move_slots)."""
        return self.latent_storage.unsqueeze(1)
