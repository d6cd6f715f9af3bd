"""Qwen3-MoE (`model_type` qwen3_moe: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B / 480B-A35B).

The Qwen3 decoder of llama.py (grouped-query attention with RMSNorm over each head of q and k, the (x, h)
pair-form layers, the same forward), whose MLP is, on the sparse layers, a mixture of experts: a softmax
router picks num_experts_per_tok of num_experts gated MLPs of width moe_intermediate_size per token (their
weights renormalised to sum 1 when norm_topk_prob), and the block returns the weighted sum
(moe.SparseMoE routed by moe.SoftmaxTopK). A layer is sparse unless it is in mlp_only_layers or
(layer + 1) is not a multiple of decoder_sparse_step; the other layers keep llama's dense MLP of width
intermediate_size. Parameter names are the checkpoints' (`mlp.gate.weight`,
`mlp.experts.{e}.{gate,up,down}_proj.weight`), so the layers are llama's DecoderLayer with the MLP
replaced, and the fused modules of runtime/fused.py (attention, the Triton layer, the fused MoE) apply
unchanged.

Tensor parallelism: attention heads and the dense MLPs split as in llama.py; the experts are split over
the ranks, whole (moe.shard_experts): the router is replicated, each rank computes only its experts'
share of every token, and the block's output is all-reduced once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import cast

from torch import nn

from . import llama
from .layers import Collectives, rope_inv_freq, shard_attention, shard_mlp
from .moe import SoftmaxTopK, SparseMoE, shard_experts

# config.json fields, all accounted for: read (they set the math, and we implement it), required to hold a
# value we implement (anything else is refused, naming the field), or ignored (they do not change inference)
READ = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",  # none, or a type rope_inv_freq implements
        "rope_parameters",  # transformers 5's name for rope_theta + rope_scaling
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "num_experts",
        "num_local_experts",  # what transformers 5 writes for num_experts
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "bos_token_id",
        "eos_token_id",
    }
)
REQUIRED = {  # field: the only value we implement (transformers' default when absent)
    "hidden_act": "silu",
    "use_sliding_window": False,  # the window attention is not implemented (sliding_window then is unused)
    "use_qk_norm": True,  # Qwen3 always normalises q and k; some configs say so
    "shared_expert_intermediate_size": 0,  # Qwen2-MoE's shared expert; Qwen3-MoE has none
    "qkv_bias": False,  # attention_bias is the field that sets Qwen3's projection biases
}
IGNORED = frozenset(
    {
        "architectures",
        "torch_dtype",  # the dtype is chosen at load
        "dtype",
        "transformers_version",
        "_name_or_path",
        "initializer_range",  # training only
        "use_cache",
        "router_aux_loss_coef",  # training loss only
        "output_router_logits",
        "attention_dropout",  # no dropout at inference
        "pad_token_id",
        "sliding_window",  # only read with use_sliding_window, which is refused
        "max_window_layers",  # the same (and transformers' qwen3_moe never reads it)
        "layer_types",  # checked: every layer must be full attention
    }
)


@dataclass
class ModelConfig(llama.ModelConfig):
    """llama.py's config plus the experts. Defaults are transformers' Qwen3MoeConfig's where a config.json
    may leave a field out (norm_topk_prob: False)."""

    qk_norm: bool = True
    model_type: str = "qwen3_moe"
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has the mixture of experts (else the dense MLP)."""
        return (
            layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        )

    def split_sizes(self, whole_experts: bool = True) -> dict[str, int]:
        """The sizes tensor parallelism splits over the ranks (each must be a multiple of their number);
        whole_experts: experts split whole (expert parallelism), else each expert's width."""
        sizes = {"attention heads": self.num_attention_heads, "KV heads": self.num_key_value_heads}
        layers = range(self.num_hidden_layers)
        if not all(self.is_sparse(i) for i in layers):
            sizes["MLP width"] = self.intermediate_size
        if any(self.is_sparse(i) for i in layers):
            if whole_experts:
                sizes["experts"] = self.num_experts
            else:
                sizes["expert width"] = self.moe_intermediate_size
        sizes["vocabulary"] = self.vocab_size
        return sizes

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """From a Hugging Face config.json dict (transformers 4.x or 5.x layout). Every field is accounted
        for (READ, REQUIRED, IGNORED); an unknown field, or a known one with a value we do not implement,
        is refused with its name."""
        unknown = sorted(k for k in cfg if k not in READ and k not in REQUIRED and k not in IGNORED)
        if unknown:
            raise ValueError(f"qwen3_moe config: unsupported field(s) {', '.join(unknown)}")
        for key, want in REQUIRED.items():
            if cfg.get(key) is not None and cfg[key] != want:
                raise ValueError(f"qwen3_moe config: {key} = {cfg[key]!r} is not supported (only {want!r})")
        bad_layers = sorted({t for t in cfg.get("layer_types") or [] if t != "full_attention"})
        if bad_layers:
            raise ValueError(f"qwen3_moe config: layer_types {bad_layers} are not supported (only full_attention)")
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
        if cfg.get("num_local_experts", experts) != experts:
            raise ValueError(
                f"qwen3_moe config: num_experts {experts} and num_local_experts {cfg['num_local_experts']} disagree"
            )
        step, top_k = cfg.get("decoder_sparse_step", 1), cfg.get("num_experts_per_tok", 8)
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"qwen3_moe config: decoder_sparse_step {step!r} must be a positive integer")
        if experts and not 1 <= top_k <= experts:
            raise ValueError(f"qwen3_moe config: num_experts_per_tok {top_k} must be in 1..num_experts ({experts})")
        bias = bool(cfg.get("attention_bias") or False)  # on q/k/v and o, as transformers' Qwen3-MoE
        base = llama.ModelConfig.from_hf(
            {**cfg, "intermediate_size": cfg.get("intermediate_size", 6144), "attention_bias": bias}
        )
        try:  # the RoPE scaling must be one we compute: refused here, by name, rather than at build time
            rope_inv_freq(base.head_dim, base.rope_theta, base.rope_scaling)
        except (ValueError, KeyError) as exc:
            name = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
            raise ValueError(f"qwen3_moe config: {name} {base.rope_scaling} is not supported: {exc}") from exc
        return cls(
            **{**asdict(base), "qk_norm": True},
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 768),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=step,
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        )


def decoder_layer(cfg: ModelConfig, index: int) -> llama.DecoderLayer:
    """llama's layer (Qwen3 attention, the norms, the pair-form forward), with the mixture of experts as its
    MLP on a sparse layer."""
    if not cfg.is_sparse(index):
        return llama.DecoderLayer(cfg)
    router = SoftmaxTopK(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    moe = SparseMoE(router, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    return llama.DecoderLayer(cfg, mlp=moe)


class Transformer(llama.Transformer):
    """llama.py's target (embedding, RoPE, the cache, the forward and its taps, compaction) with this
    family's layers."""

    config: ModelConfig
    config_class = ModelConfig

    def __init__(self, cfg: ModelConfig):
        super().__init__(replace(cfg, num_hidden_layers=0))  # llama's skeleton, without its dense layers
        self.config = cfg
        self.model.layers = nn.ModuleList(  # type: ignore[assignment]
            decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers)
        )

    def shard_layers(self, tp: Collectives, whole_experts: bool = True) -> None:
        """Keep this rank's heads, dense MLP columns and experts of every layer (parallel.shard splits the
        vocabulary and checks split_sizes first)."""
        cfg, world = self.config, tp.world
        for i, layer in enumerate(self.model.layers):
            shard_attention(layer.self_attn, tp, cfg.num_attention_heads // world, cfg.num_key_value_heads // world)
            if cfg.is_sparse(i):
                shard_experts(cast(SparseMoE, layer.mlp), tp, whole_experts)
            else:
                shard_mlp(layer.mlp, tp, cfg.intermediate_size // world)
