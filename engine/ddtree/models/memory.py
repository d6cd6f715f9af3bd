"""The memory plan: what each GPU (one tensor-parallel rank) holds to serve a model, from config files alone.

`plan_memory(config.json dict, gpus=N, gpu_memory=bytes, max_context=T, max_batch=B, ...)` counts, per
rank, the bytes the engine allocates and says whether they fit:

- weights by kind (embedding, lm_head, attention, dense_mlp, routed_experts, shared_experts,
  norms_and_routers, drafter_weights), split as the engine splits them over N ranks (runtime/parallel.py,
  the families' `shard_layers`, moe.shard_experts): attention heads, MLP and shared-expert widths and the
  vocabulary divided by N; routed experts whole, num_experts / N per rank (or, with expert_parallel 1,
  every expert's width divided by N); norms, routers (the gate and its fp32 correction bias), RoPE
  frequencies and MLA's q_a / kv_a projections replicated. Multi-token-prediction layers
  (num_nextn_predict_layers) are not loaded, so not counted. A tied LM head is the embedding (0 bytes).
- the KV caches, allocated up front by setup_caches as one pool of pages: kv_cache_tokens in whole pages
  of 16 slots when given (serving.kv_cache_tokens), or the most pages that keep the whole plan within
  gpu_memory_utilization x gpu_memory (serving.gpu_memory_utilization), else max_batch rows of
  max_context tokens plus the room a round needs past the text (the tree or the drafter's block), each in
  whole pages (the engine's default pool; runtime/pages.py), and the trash slot: split by KV heads
  for grouped-query attention (2 x kv_heads / N x head_dim per layer and token), replicated for MLA's
  latent cache (kv_lora_rank + qk_rope_head_dim per layer and token, on every rank).
- a DFlash drafter (its config.json dict): its layers split like the target's when its heads, KV heads,
  MLP width and vocabulary divide N (else every rank holds it whole, as runtime/parallel.split does), its
  KV cache per context token; it shares the target's embedding and LM head, so holds neither.
- workspace: what one round allocates on top, an estimate for the largest batch: the verify logits
  (max_batch x (budget + 1) x vocab, in the engine's dtype; twice over under tensor parallelism, the
  all-gather's buffer and its reordered copy), the sampling path's fp32 / int64 copies of them, the
  drafter's block logits and their fp32 log-probabilities, the staged drafter context, the accepted
  path's logits kept for log-probabilities (max_batch x (depth + 1) x vocab), and one layer's
  attention scores over the cache span (fp32-sized score and probability matrices: the bound of an
  unfused attention; the Triton split-K partials are of the same order).
- reserve: RESERVE_BYTES (3 GiB), an estimate of what no tensor of the engine accounts for: the CUDA
  context, NCCL's buffers, the CUDA graph pool's slack and allocator fragmentation.

Not counted: the prefill's activations (a chunk of C tokens at span S builds a C x S mask and C x S
attention scores per head: long prompts need far more than a round), and load-time transients (the fused modules
concatenate one layer's weights at a time).

Quantized checkpoints (`quantization_config`, parsed by quant_config.parse_quantization) are counted as
stored (quant.Int4Linear, Fp8BlockLinear): int4 (compressed-tensors pack-quantized, group G) at 0.5 byte
per weight plus one scale per G weights (in the model's dtype: bf16 by default); fp8 blocks (128 x 128) at
1 byte per weight plus one fp32 scale per block. Which Linear layers are quantized is the scheme's
`targets(name)` (compressed-tensors' ignore semantics, on the engine's parameter names), but a
compressed-tensors config without an `ignore` list counts the routed experts only as quantized: the
conservative choice, and what Kimi K2 Thinking / K2.5 publish (lm_head, attention, shared experts and dense
MLPs ignored). Everything else is in `dtype`, but for the routers' correction biases and the RoPE
frequencies, which stay fp32.

Torch-free (the operator imports it): the configs are read here as the families' ModelConfig.from_hf reads
them (the same fields, the same defaults), and tests/test_memory.py checks the counts against the bytes of
built models, split and whole. Sizes are parsed by `parse_size` (141GiB, 80GB, 141Gi, plain bytes).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..config import DEFAULT_MAX_SEQ_LEN, DTYPE_NAMES, PAGE_SIZE
from .config_fields import attention_window, context_limit, require_fields
from .quant_config import QuantScheme, parse_quantization, split_problem
from .registry import family_for

GiB = 1 << 30
# the CUDA context, NCCL's buffers, the graph pool's slack and fragmentation: an estimate, not a measurement
RESERVE_BYTES = 3 * GiB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
WEIGHT_KINDS = (
    "embedding",
    "lm_head",
    "attention",
    "dense_mlp",
    "routed_experts",
    "shared_experts",
    "norms_and_routers",
    "drafter_weights",
)
KINDS = (*WEIGHT_KINDS, "kv_cache", "drafter_kv_cache", "workspace", "reserve")
# sampling: fp32 scores, probabilities, the sorted copy and the exponential race, plus the int64 sort order
SAMPLING_BYTES_PER_LOGIT = 4 * 4 + 8
# attention: one layer's fp32-sized score and probability matrices over the span
ATTENTION_BYTES_PER_SCORE = 2 * 4
# size suffixes (lower case): SI powers of ten, and binary with an i (Kubernetes' Gi, or GiB)
_UNITS = {"": 1, "b": 1} | {
    f"{prefix}{suffix}": base**power
    for power, prefix in enumerate("kmgt", 1)
    for suffix, base in (("", 1000), ("b", 1000), ("i", 1024), ("ib", 1024))
}


def parse_size(text: str | int) -> int:
    """Bytes of a size: 141GiB, 80GB, 288 GB, 141Gi (Kubernetes), 1.5TiB or plain bytes. GB, G are powers
    of ten and GiB, Gi powers of two. ValueError (one line) for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"'{text}' is not a size (examples: 141GiB, 80GB, 141Gi, 150000000000)")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a size must be positive, got '{text}'")
    return value


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Weight:
    """One tensor as a rank holds it."""

    kind: str
    name: str  # the module's name under the engine's (Hugging Face) names: what an ignore list matches
    shape: tuple[int, ...]  # this rank's shape
    linear: bool = False  # a Linear layer's weight [out, in]: stored quantized when the scheme targets it
    fp32: bool = False  # float32 whatever the dtype (the routers' correction biases, the RoPE frequencies)
    count: int = 1  # identical copies (a layer's routed experts)
    split: int | None = None  # a Linear's dim that tensor parallelism divides: 0 outputs, 1 inputs


@dataclass
class Layout:
    """What the plan needs of a model, per rank: its weights, its cache and the sizes a split divides."""

    description: str
    weights: list[Weight]
    split_sizes: dict[str, int]  # what tensor parallelism divides (each must be a multiple of the ranks)
    cache_values_per_token: int  # KV cache values per token and sequence on one rank, all layers
    heads: int  # query heads per rank (the attention scores of the workspace)
    vocab_size: int = 0
    hidden_size: int = 0
    max_position_embeddings: int = 0
    quantization: dict | None = None
    whole_experts: bool = True  # routed experts split whole over the ranks (else by width)
    block_size: int = 0  # drafters: the block a round drafts
    taps: int = 0  # drafters: target layers whose hidden states feed it


# ---- the families' shapes (as their ModelConfig.from_hf read config.json) ------------------------


def _mlp(kind: str, prefix: str, hidden: int, inter: int, count: int = 1, split: bool = True) -> list[Weight]:
    """A gated MLP of width `inter` (this rank's): gate and up [inter, hidden], down [hidden, inter]; split:
    its width is divided over the ranks (gate/up by outputs, down by inputs), else it is whole."""
    return [
        Weight(kind, f"{prefix}.gate_proj", (inter, hidden), linear=True, count=count, split=0 if split else None),
        Weight(kind, f"{prefix}.up_proj", (inter, hidden), linear=True, count=count, split=0 if split else None),
        Weight(kind, f"{prefix}.down_proj", (hidden, inter), linear=True, count=count, split=1 if split else None),
    ]


def _gqa_attention(prefix: str, hidden: int, hq: int, hkv: int, hd: int, bias: bool, o_bias: bool, qk_norm: bool):
    """Grouped-query attention of hq query and hkv KV heads (this rank's), as llama.Attention holds it."""
    kind = "attention"
    out = [
        Weight(kind, f"{prefix}.q_proj", (hq * hd, hidden), linear=True, split=0),
        Weight(kind, f"{prefix}.k_proj", (hkv * hd, hidden), linear=True, split=0),
        Weight(kind, f"{prefix}.v_proj", (hkv * hd, hidden), linear=True, split=0),
        Weight(kind, f"{prefix}.o_proj", (hidden, hq * hd), linear=True, split=1),
    ]
    if bias:
        out += [
            Weight(kind, f"{prefix}.{p}.bias", (h * hd,)) for p, h in (("q_proj", hq), ("k_proj", hkv), ("v_proj", hkv))
        ]
    if o_bias:  # replicated: every rank keeps it (rank 0 adds it)
        out.append(Weight(kind, f"{prefix}.o_proj.bias", (hidden,)))
    if qk_norm:
        out += [Weight("norms_and_routers", f"{prefix}.{n}", (hd,)) for n in ("q_norm", "k_norm")]
    return out


def _embedding_and_head(vocab: int, hidden: int, tied: bool, world: int) -> list[Weight]:
    rows = _ceil_div(vocab, world)  # vocabulary-parallel
    out = [Weight("embedding", "model.embed_tokens", (rows, hidden))]
    if not tied:
        out.append(Weight("lm_head", "lm_head", (rows, hidden), linear=True, split=0))
    return out


def _layer_norms(prefix: str, hidden: int) -> list[Weight]:
    return [
        Weight("norms_and_routers", f"{prefix}.{n}", (hidden,)) for n in ("input_layernorm", "post_attention_layernorm")
    ]


def _routed_experts(prefix: str, hidden: int, inter: int, experts: int, world: int, whole: bool) -> list[Weight]:
    """One layer's routed experts on a rank (moe.shard_experts): experts / world whole ones, or every expert
    at inter / world wide; named as expert 0 (a layer's experts share one quantization)."""
    if whole:
        return _mlp("routed_experts", f"{prefix}.0", hidden, inter, _ceil_div(experts, world), split=False)
    return _mlp("routed_experts", f"{prefix}.0", hidden, _ceil_div(inter, world), experts)


def _check_expert_parallel(expert_parallel: int | None, world: int) -> bool:
    """Whether routed experts split whole over the ranks (else each expert's width splits)."""
    if expert_parallel not in (None, 1, world):
        raise ValueError(f"expert parallel must be 1 or the number of GPUs ({world}), got {expert_parallel}")
    return expert_parallel != 1


def _llama_layout(cfg: dict, world: int, expert_parallel: int | None) -> Layout:
    """The llama family (llama, mistral, qwen2, qwen3) and qwen3_moe: grouped-query attention, a per-head
    KV cache, dense MLPs or (qwen3_moe) routed experts under a softmax router."""
    model_type = cfg.get("model_type", "llama")
    moe = model_type == "qwen3_moe"
    require_fields(cfg, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"))
    if not moe:
        require_fields(cfg, ("intermediate_size",))
    hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or hidden // heads
    inter = cfg.get("intermediate_size", 6144) if moe else cfg["intermediate_size"]
    vocab = cfg["vocab_size"]
    if moe:  # qwen3_moe.ModelConfig.from_hf: biases on q/k/v and o when attention_bias
        bias = bool(cfg.get("attention_bias") or False)
        o_bias, qk_norm = bias, True
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
        expert_inter = cfg.get("moe_intermediate_size", 768)
        step, dense_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        sparse = [i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(layers)]
    else:
        bias = cfg.get("attention_bias", model_type == "qwen2")
        o_bias, qk_norm = bias and model_type != "qwen2", model_type == "qwen3"
        experts = expert_inter = 0
        sparse = [False] * layers
    whole_experts = _check_expert_parallel(expert_parallel, world) if any(sparse) else True
    hq, hkv = _ceil_div(heads, world), _ceil_div(kv, world)
    weights = _embedding_and_head(vocab, hidden, cfg.get("tie_word_embeddings", False), world)
    for i in range(layers):
        p = f"model.layers.{i}"
        weights += _gqa_attention(f"{p}.self_attn", hidden, hq, hkv, hd, bias, o_bias, qk_norm)
        if sparse[i]:
            weights.append(Weight("norms_and_routers", f"{p}.mlp.gate", (experts, hidden)))  # never quantized
            weights += _routed_experts(f"{p}.mlp.experts", hidden, expert_inter, experts, world, whole_experts)
        else:
            weights += _mlp("dense_mlp", f"{p}.mlp", hidden, _ceil_div(inter, world))
        weights += _layer_norms(p, hidden)
    weights.append(Weight("norms_and_routers", "model.norm", (hidden,)))
    weights.append(Weight("norms_and_routers", "rotary.inv_freq", (hd // 2,), fp32=True))
    sizes = {"attention heads": heads, "KV heads": kv}
    if not all(sparse):
        sizes["MLP width"] = inter
    if any(sparse):
        sizes.update({"experts": experts} if whole_experts else {"expert width": expert_inter})
    sizes["vocabulary"] = vocab
    kind = f"{model_type} ({family_for(cfg).name} family, {layers} layers"
    kind += f", {experts} experts of {expert_inter})" if any(sparse) else ")"
    return Layout(
        description=kind,
        weights=weights,
        split_sizes=sizes,
        cache_values_per_token=layers * 2 * hkv * hd,
        heads=hq,
        vocab_size=vocab,
        hidden_size=hidden,
        max_position_embeddings=context_limit(cfg.get("max_position_embeddings", 4096), attention_window(cfg))[0],
        whole_experts=whole_experts,
    )


MLA_REQUIRED = (
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
    "first_k_dense_replace",
)


def _mla_layout(outer: dict, world: int, expert_parallel: int | None) -> Layout:
    """DeepSeek-V3 / Kimi K2 (deepseek_v3.ModelConfig.from_hf; kimi_k25 nests it under text_config):
    latent attention over a replicated latent cache, a dense MLP on the first first_k_dense_replace
    layers, routed and shared experts on the others."""
    cfg = outer["text_config"] if outer.get("model_type") == "kimi_k25" else outer
    if not isinstance(cfg, dict):
        raise ValueError("a kimi_k25 config needs its language model under 'text_config'")
    require_fields(cfg, MLA_REQUIRED, nullable=("q_lora_rank",))  # null: a plain q_proj
    hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    experts, shared = cfg["n_routed_experts"], (cfg["n_shared_experts"] or 0) * cfg["moe_intermediate_size"]
    expert_inter, inter, dense = cfg["moe_intermediate_size"], cfg["intermediate_size"], cfg["first_k_dense_replace"]
    vocab, bias = cfg["vocab_size"], cfg.get("attention_bias", False)
    tied = cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))
    has_moe = layers > dense
    whole_experts = _check_expert_parallel(expert_parallel, world) if has_moe else True
    hq = _ceil_div(heads, world)
    weights = _embedding_and_head(vocab, hidden, tied, world)
    a, n = "attention", "norms_and_routers"
    for i in range(layers):
        p = f"model.layers.{i}"
        s = f"{p}.self_attn"
        if q_rank is None:
            weights.append(Weight(a, f"{s}.q_proj", (hq * (nope + rope), hidden), linear=True, split=0))
        else:  # q_a_proj and its norm replicated, q_b_proj split by heads
            weights.append(Weight(a, f"{s}.q_a_proj", (q_rank, hidden), linear=True))
            weights += [Weight(a, f"{s}.q_a_proj.bias", (q_rank,))] if bias else []
            weights.append(Weight(n, f"{s}.q_a_layernorm", (q_rank,)))
            weights.append(Weight(a, f"{s}.q_b_proj", (hq * (nope + rope), q_rank), linear=True, split=0))
        weights.append(Weight(a, f"{s}.kv_a_proj_with_mqa", (kv_rank + rope, hidden), linear=True))
        weights += [Weight(a, f"{s}.kv_a_proj_with_mqa.bias", (kv_rank + rope,))] if bias else []
        weights.append(Weight(n, f"{s}.kv_a_layernorm", (kv_rank,)))
        weights.append(Weight(a, f"{s}.kv_b_proj", (hq * (nope + v_dim), kv_rank), linear=True, split=0))
        weights.append(Weight(a, f"{s}.o_proj", (hidden, hq * v_dim), linear=True, split=1))
        weights += [Weight(a, f"{s}.o_proj.bias", (hidden,))] if bias else []
        if i < dense:
            weights += _mlp("dense_mlp", f"{p}.mlp", hidden, _ceil_div(inter, world))
        else:
            weights.append(Weight(n, f"{p}.mlp.gate", (experts, hidden)))
            weights.append(Weight(n, f"{p}.mlp.gate.e_score_correction_bias", (experts,), fp32=True))
            weights += _routed_experts(f"{p}.mlp.experts", hidden, expert_inter, experts, world, whole_experts)
            if shared:
                weights += _mlp("shared_experts", f"{p}.mlp.shared_experts", hidden, _ceil_div(shared, world))
        weights += _layer_norms(p, hidden)
    weights.append(Weight(n, "model.norm", (hidden,)))
    weights.append(Weight(n, "rotary.inv_freq", (rope // 2,), fp32=True))
    sizes = {"attention heads": heads, "vocabulary": vocab}
    if dense > 0:
        sizes["MLP width"] = inter
    if has_moe:
        sizes.update({"routed experts": experts} if whole_experts else {"expert width": expert_inter})
        if shared:
            sizes["shared experts width"] = shared
    model_type = outer.get("model_type", "deepseek_v3")
    return Layout(
        description=f"{model_type} (deepseek_v3 family, {layers} layers, {experts} experts of {expert_inter})",
        weights=weights,
        split_sizes=sizes,
        cache_values_per_token=layers * (kv_rank + rope),  # the latent cache: replicated
        heads=hq,
        vocab_size=vocab,
        hidden_size=hidden,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        quantization=cfg.get("quantization_config", outer.get("quantization_config")),
        whole_experts=whole_experts,
    )


def indivisible_split(sizes: dict[str, int], world: int, what: str = "the model") -> str | None:
    """Why a split over `world` ranks does not divide `what` (naming every size that is not a multiple of
    the ranks), or None: the refusal of runtime/parallel.check_divisible, the plan and the operator's
    admission checks."""
    bad = [f"{n} {name}" for name, n in sizes.items() if n % world]
    if not bad:
        return None
    return f"tensor parallel {world} does not divide {what}: {', '.join(bad)} (each must be a multiple of {world})"


def target_layout(config: dict, world: int, expert_parallel: int | None = None) -> Layout:
    """The target's layout per rank over `world` ranks (ValueError for an unsupported model_type)."""
    family = family_for(config).name
    if family == "deepseek_v3":
        return _mla_layout(config, world, expert_parallel)
    if family in ("llama", "qwen3_moe"):
        layout = _llama_layout(config, world, expert_parallel)
        layout.quantization = config.get("quantization_config")
        return layout
    raise ValueError(f"no memory plan for the {family} family yet")


def drafter_layout(cfg: dict, world: int, replicate: bool = False) -> tuple[Layout, bool]:
    """A DFlash drafter (drafter.DrafterConfig.from_hf's fields) per rank, and whether it is split: its
    layers split like a dense target's when its sizes divide `world` (runtime/parallel.split), else whole
    on every rank. It has no embedding or LM head (it uses the target's)."""
    require_fields(
        cfg, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"), "drafter config"
    )
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    # transformers' Qwen3Config defaults and the DFlash keys' precedence, as DrafterConfig.from_hf reads them
    kv = cfg.get("num_key_value_heads", 32) or heads
    hd = cfg.get("head_dim", 128) or hidden // heads
    dflash = cfg.get("dflash_config") or {}
    taps = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
    block = int(dflash.get("block_size", cfg.get("block_size", 16)))
    bias = cfg.get("attention_bias", False)
    sizes = {"attention heads": heads, "KV heads": kv, "MLP width": inter, "vocabulary": cfg.get("vocab_size", 0)}
    split = world > 1 and not replicate and all(v % world == 0 for v in sizes.values())
    n = world if split else 1
    hq, hkv = heads // n, kv // n
    d = "drafter_weights"
    weights: list[Weight] = []
    for i in range(layers):
        p = f"layers.{i}"
        layer = _gqa_attention(f"{p}.self_attn", hidden, hq, hkv, hd, bias, bias, True) + _layer_norms(p, hidden)
        weights += [replace(w, kind=d) for w in layer] + _mlp(d, f"{p}.mlp", hidden, inter // n)
    n_taps = len(taps) if taps is not None else layers  # drafter.default_target_layer_ids: one per layer
    weights += [
        Weight(d, "fc", (hidden, n_taps * hidden), linear=True),
        Weight(d, "hidden_norm", (hidden,)),
        Weight(d, "norm", (hidden,)),
        Weight(d, "rotary.inv_freq", (hd // 2,), fp32=True),
    ]
    if (cfg.get("architectures") or [""])[0] == "DFlash2DraftModel":  # dflash2.DFlash2Drafter's additions
        kernel, group, rank = (
            int(dflash.get(k, cfg.get(k)) or 0) for k in ("conv_kernel_size", "conv_group_size", "selector_rank")
        )
        group, vocab = group or hidden, cfg.get("vocab_size", 0)
        for i in range(layers):
            for conv in ("attention_conv", "mlp_conv"):
                weights += [
                    Weight(d, f"layers.{i}.{conv}.base_kernel", (2, kernel, hidden)),
                    Weight(d, f"layers.{i}.{conv}.kernel_projection", (2 * kernel * (hidden // group), hidden), True),
                ]
        weights += [
            Weight(d, "candidate_selector.predecessor_codebook", (vocab, rank)),
            Weight(d, "candidate_selector.successor_codebook", (vocab, rank)),
            Weight(d, "candidate_selector.hidden_projection", (rank, hidden), linear=True),
        ]
    layout = Layout(
        description=f"DFlash drafter ({layers} layers, block {block}, {'split' if split else 'whole on every rank'})",
        weights=weights,
        split_sizes=sizes,
        cache_values_per_token=layers * 2 * hkv * hd,
        heads=hq,
        hidden_size=hidden,
        block_size=block,
        taps=n_taps,
    )
    return layout, split


# ---- bytes ---------------------------------------------------------------------------------------


def weight_bytes(w: Weight, dtype_bytes: int, scheme: QuantScheme | None = None) -> int:
    """Bytes of one weight (all its copies) on its rank, stored as quant.Int4Linear / Fp8BlockLinear hold it
    when `scheme` covers it."""
    numel = math.prod(w.shape)
    if w.fp32:
        each = numel * 4
    elif scheme is not None and w.linear:
        rows, cols = w.shape
        if scheme.kind == "int4":  # 8 values per int32, a scale (the model's dtype) per group, the shape (int64)
            groups = 1 if scheme.group_size is None else _ceil_div(cols, scheme.group_size)
            each = rows * _ceil_div(cols, 8) * 4 + rows * groups * dtype_bytes + 2 * 8
        elif scheme.kind == "fp8_block":  # one byte per value, one fp32 scale per block
            br, bc = scheme.block
            each = rows * cols + _ceil_div(rows, br) * _ceil_div(cols, bc) * 4
        else:
            raise ValueError(f"no memory plan for quantization '{scheme.kind}'")
    else:
        each = numel * dtype_bytes
    return each * w.count


def _names_its_modules(quantization: dict | None) -> bool:
    """Whether a quantization_config says which modules it covers: compressed-tensors by its ignore list
    (a copy may lack it), DeepSeek's fp8 always (every linear layer but lm_head and modules_to_not_convert)."""
    return bool(quantization) and (quantization.get("quant_method") != "compressed-tensors" or "ignore" in quantization)


def stored_as(layout: Layout, quantization: dict | None) -> list[tuple[Weight, QuantScheme | None]]:
    """Each weight and the scheme it is stored in (None: the engine's dtype); ValueError for a scheme the
    engine cannot hold. Without an ignore list only the routed experts count as quantized (the conservative
    reading, and what Kimi K2 Thinking / K2.5 publish)."""
    scheme, listed = parse_quantization(quantization), _names_its_modules(quantization)

    def covered(w: Weight) -> bool:
        return w.linear and (scheme.targets(w.name) if listed else w.kind == "routed_experts")

    return [(w, scheme if scheme is not None and covered(w) else None) for w in layout.weights]


def _cut_scales(layout: Layout, world: int) -> str | None:
    """The first quantized weight whose split over `world` ranks would cut its scale groups or blocks, as
    runtime/parallel.shard refuses it when loading."""
    for w, scheme in stored_as(layout, layout.quantization):
        if scheme is not None and w.split is not None:
            share = w.shape[w.split]
            if problem := split_problem(scheme, share * world, share, w.split):
                return f"tensor parallel {world} cannot split {w.name}: {problem}"
    return None


def weights_by_kind(layout: Layout, dtype_bytes: int, quantization: dict | None = None) -> dict[str, int]:
    out: dict[str, int] = {}
    for w, scheme in stored_as(layout, quantization):
        out[w.kind] = out.get(w.kind, 0) + weight_bytes(w, dtype_bytes, scheme)
    return out


def _describe_quantization(quantization: dict | None, scheme: QuantScheme | None) -> str | None:
    if scheme is None:
        return None
    covered = "as it lists" if _names_its_modules(quantization) else "routed experts only: no ignore list"
    return f"{scheme.describe()} ({covered})"


# ---- the plan ------------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    fits: bool
    reason: str  # one line: why it does not fit, or a summary when it does
    model: str
    gpus: int
    gpu_memory: int  # bytes per GPU
    max_context: int
    max_batch: int
    dtype: str
    per_rank_bytes: dict[str, int]  # by kind (KINDS)
    kv_bytes_per_token: int  # the target's KV cache per token and sequence, on one rank
    drafter_kv_bytes_per_token: int
    cache_slots: int  # KV cache slots per sequence: max_context and a round's tree or block, in whole pages
    pool_slots: int  # the page pool's slots, shared by all rows (default max_batch x cache_slots)
    max_context_that_fits: int  # the largest max_context at max_batch that fits (0: not even the weights)
    max_position_embeddings: int
    quantization: str | None = None
    drafter: str = "none"  # "split", "replicated" (whole on every rank), "whole" (one GPU) or "none"
    workspace: dict[str, int] = field(default_factory=dict)  # what the workspace kind is made of
    notes: list[str] = field(default_factory=list)

    @property
    def total_per_rank(self) -> int:
        return sum(self.per_rank_bytes.values())

    @property
    def weight_bytes(self) -> int:
        return sum(v for k, v in self.per_rank_bytes.items() if k in WEIGHT_KINDS)

    @property
    def free_per_rank(self) -> int:
        """Bytes left on each GPU (negative: over by that much)."""
        return self.gpu_memory - self.total_per_rank

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(total_per_rank=self.total_per_rank, free_per_rank=self.free_per_rank)
        return out

    def render(self) -> str:
        """A per-rank table: weights by kind, caches, workspace and reserve, the total against the GPU."""
        rows = [
            f"memory plan: {self.model}",
            f"  {self.gpus} GPU(s) of {gib(self.gpu_memory)}, context {self.max_context:,} x batch {self.max_batch}, "
            f"{self.dtype}" + (f", {self.quantization}" if self.quantization else "") + f"; drafter: {self.drafter}",
            f"  {'per rank':<22}{'GiB':>10}",
        ]

        def line(name: str, n: int, note: str = "") -> None:
            rows.append(f"  {name:<22}{n / GiB:>10.2f}" + (f"   {note}" if note else ""))

        for kind in WEIGHT_KINDS:
            if self.per_rank_bytes.get(kind):
                line(kind, self.per_rank_bytes[kind])
        line("= weights", self.weight_bytes)
        batch_slots = (
            f"x {self.cache_slots:,} slots x {self.max_batch} rows"
            if self.pool_slots == self.cache_slots * self.max_batch
            else f"x a pool of {self.pool_slots:,} slots"
        )
        line("kv_cache", self.per_rank_bytes["kv_cache"], f"{self.kv_bytes_per_token:,} B/token {batch_slots}")
        if self.drafter != "none":
            line(
                "drafter_kv_cache",
                self.per_rank_bytes["drafter_kv_cache"],
                f"{self.drafter_kv_bytes_per_token:,} B/token {batch_slots}",
            )
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.workspace.items() if v)
        line("workspace", self.per_rank_bytes["workspace"], parts)
        line("reserve", self.per_rank_bytes["reserve"], "estimate: CUDA context, NCCL, graph pool, fragmentation")
        line("= total", self.total_per_rank)
        free = self.free_per_rank
        line("free" if free >= 0 else "OVER", abs(free), f"of {gib(self.gpu_memory)}")
        rows += [f"  note: {note}" for note in self.notes]
        rows.append(("fits: " if self.fits else "does not fit: ") + self.reason)
        return "\n".join(rows)


def pool_tokens_within(room: int, bytes_per_token: int) -> int:
    """The KV page pool, in tokens (whole pages), that `room` bytes hold at bytes_per_token (the target's and
    the drafter's caches together), the trash slot included; 0 when not one page fits."""
    if bytes_per_token <= 0:
        return 0
    return max(0, (room // bytes_per_token - 1) // PAGE_SIZE * PAGE_SIZE)


def _round_sizes(drafter: Layout | None, budget: int | None) -> tuple[bool, int, int, int]:
    """(drafts, tree size, deepest path, block) of the engine's largest round (runtime/plan.round_sizes): a
    drafter with a budget other than 0 runs ddtree (default budget block - 1); otherwise the root alone."""
    if drafter is None or budget == 0:
        return False, 1, 0, 1
    block = drafter.block_size
    budget = block - 1 if budget is None else budget
    return True, budget + 1, min(budget, block - 1), block


def default_max_context(config: dict) -> int:
    """The engine's max_seq_len for `config` (a config.json dict) when none is given: 2048 tokens, or the
    model's context where that is shorter (runtime/build.py)."""
    return min(DEFAULT_MAX_SEQ_LEN, target_layout(config, 1).max_position_embeddings)


def plan_memory(
    config: dict,
    *,
    gpus: int,
    gpu_memory: int,
    max_context: int | None = None,
    max_batch: int = 1,
    kv_cache_tokens: int | None = None,
    gpu_memory_utilization: float | None = None,
    dtype: str = "bfloat16",
    drafter_config: dict | None = None,
    budget: int | None = None,
    expert_parallel: int | None = None,
    replicate_drafter: bool = False,
    reserve: int = RESERVE_BYTES,
) -> MemoryPlan:
    """The per-rank memory of serving `config` (a config.json dict) on `gpus` GPUs of `gpu_memory` bytes
    each, with max_batch rows of max_context tokens (the engine's max_seq_len; default the model's
    max_position_embeddings) and a KV page pool of kv_cache_tokens (default: every row's whole context), or
    with gpu_memory_utilization the largest pool of whole pages that keeps the total within that share of
    gpu_memory (`pool_tokens_within`), in `dtype`, with the DFlash
    drafter of `drafter_config` at `budget` (default: its block size - 1). A split the model does not
    divide, or an unsupported quantization, is a plan that does not fit, with the reason; a config this
    module cannot read raises ValueError (one line)."""
    if budget is not None and budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    dtype = DTYPE_NAMES.get(dtype, dtype)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPE_BYTES)})")
    size = DTYPE_BYTES[dtype]
    if gpus < 1 or max_batch < 1:
        raise ValueError(f"gpus and max_batch must be >= 1, got {gpus} and {max_batch}")
    target = target_layout(config, gpus, expert_parallel)
    max_context = target.max_position_embeddings if max_context is None else max_context
    if max_context < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    drafter, split = drafter_layout(drafter_config, gpus, replicate_drafter) if drafter_config else (None, False)
    problems: list[str] = []
    if indivisible := indivisible_split(target.split_sizes, gpus):
        problems.append(indivisible)
    if drafter is not None and drafter.hidden_size != target.hidden_size:
        problems.append(f"the drafter's hidden size {drafter.hidden_size} is not the target's {target.hidden_size}")
    scheme = None
    try:
        scheme = parse_quantization(target.quantization)
        weights = weights_by_kind(target, size, target.quantization)
    except ValueError as exc:  # a scheme the engine cannot hold
        problems.append(str(exc).splitlines()[0])
        weights = weights_by_kind(target, size)
    if scheme is not None and gpus > 1 and (cut := _cut_scales(target, gpus)):
        problems.append(cut)
    quant_note = _describe_quantization(target.quantization, scheme)
    if drafter is not None:
        weights["drafter_weights"] = weights_by_kind(drafter, size)["drafter_weights"]
    drafts, tree, depth, block = _round_sizes(drafter, budget)
    taps = drafter.taps if drafter is not None and drafts else 0
    kv_token = target.cache_values_per_token * size
    drafter_kv_token = drafter.cache_values_per_token * size if drafter is not None and drafts else 0

    def per_rank_at(context: int) -> tuple[dict[str, int], dict[str, int], int, int]:
        # a row's slots (Engine.max_slots) in whole pages (runtime/pages.py), and the pool's
        slots = -(-(context + max(tree, block)) // PAGE_SIZE) * PAGE_SIZE
        pool = max_batch * slots if kv_cache_tokens is None else -(-kv_cache_tokens // PAGE_SIZE) * PAGE_SIZE
        b, vocab = max_batch, target.vocab_size
        gathered = 1 if gpus == 1 else 2 + 1 / gpus  # all_gather_last: its buffer and the reordered copy
        work = {
            "verify logits": int(b * tree * vocab * size * gathered),
            "sampling": b * tree * vocab * SAMPLING_BYTES_PER_LOGIT,
            "draft logits": int(b * depth * vocab * (size * gathered + 4)),  # + fp32 log-probabilities
            "drafter context": b * (depth + 1) * taps * target.hidden_size * size,  # Engine.ctx_features
            "logprob rows": b * (depth + 1) * vocab * size,  # Engine.path_logits (serving.max_logprobs > 0)
            "attention": b * target.heads * tree * slots * ATTENTION_BYTES_PER_SCORE,
        }
        if drafts:
            work["attention"] = max(work["attention"], b * drafter.heads * block * slots * ATTENTION_BYTES_PER_SCORE)
        kinds = dict.fromkeys(KINDS, 0)
        kinds.update(weights)
        kinds["kv_cache"] = kv_token * (pool + 1)  # and the trash slot
        kinds["drafter_kv_cache"] = drafter_kv_token * (pool + 1)
        kinds["workspace"] = sum(work.values())
        kinds["reserve"] = reserve
        return kinds, work, slots, pool

    if gpu_memory_utilization is not None:
        if kv_cache_tokens is not None:
            raise ValueError("give kv_cache_tokens or gpu_memory_utilization, not both")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        kinds = per_rank_at(max_context)[0]
        rest = sum(kinds.values()) - kinds["kv_cache"] - kinds["drafter_kv_cache"]
        kv_cache_tokens = pool_tokens_within(
            int(gpu_memory * gpu_memory_utilization) - rest, kv_token + drafter_kv_token
        )
        if kv_cache_tokens < PAGE_SIZE:
            room = f"{gib(int(gpu_memory_utilization * gpu_memory))} ({gpu_memory_utilization:g} of {gib(gpu_memory)})"
            problems.append(f"no KV cache page fits: everything else needs {gib(rest)} per GPU, the share is {room}")
            kv_cache_tokens = PAGE_SIZE
    per_rank, work, slots, pool = per_rank_at(max_context)
    total = sum(per_rank.values())
    largest = _largest_context(lambda t: sum(per_rank_at(t)[0].values()) <= gpu_memory)
    largest = min(largest, target.max_position_embeddings)  # nor more than the model's context
    if kv_cache_tokens is not None:  # one request holds at most the whole pool
        largest = min(largest, kv_cache_tokens)
        if max_context > kv_cache_tokens:
            problems.append(f"max_context {max_context:,} is more than the KV cache pool of {kv_cache_tokens:,} tokens")
    runs = not problems  # a split that does not divide, or a scheme the engine cannot hold, runs at no context
    if total > gpu_memory:
        caches = per_rank["kv_cache"] + per_rank["drafter_kv_cache"]
        room = f"the largest context that fits at batch {max_batch} is {largest:,}" if largest else "no context fits"
        problems.append(
            f"needs {gib(total)} per GPU, {gib(total - gpu_memory)} over the {gib(gpu_memory)} of each of "
            f"{gpus} GPU(s) (weights {gib(sum(weights.values()))}, KV caches {gib(caches)}; {room})"
        )
    if max_context > target.max_position_embeddings:  # the engine refuses it (runtime/build.py)
        problems.append(
            f"max_context {max_context:,} is more than the model's context of {target.max_position_embeddings:,} "
            "tokens (max_position_embeddings, or a sliding window short of it)"
        )
    notes = []
    if gpu_memory_utilization is not None:
        notes.append(
            f"the KV cache pool is what {gpu_memory_utilization:g} of each GPU's memory leaves: {pool:,} tokens"
        )
    if drafter is not None and not drafts:
        notes.append("budget 0: the drafter is loaded but never runs (no drafter cache)")
    fits = not problems
    reason = (
        problems[0]
        if problems
        else f"{gib(total)} of {gib(gpu_memory)} per GPU ({gib(gpu_memory - total)} free); "
        f"the largest context that fits at batch {max_batch} is {largest:,}"
    )
    return MemoryPlan(
        fits=fits,
        reason=reason,
        model=target.description,
        gpus=gpus,
        gpu_memory=gpu_memory,
        max_context=max_context,
        max_batch=max_batch,
        dtype=dtype,
        per_rank_bytes=per_rank,
        kv_bytes_per_token=kv_token,
        drafter_kv_bytes_per_token=drafter_kv_token,
        cache_slots=slots,
        pool_slots=pool,
        max_context_that_fits=largest if runs else 0,
        max_position_embeddings=target.max_position_embeddings,
        quantization=quant_note,
        drafter="none" if drafter is None else "split" if split else "whole" if gpus == 1 else "replicated",
        workspace=work,
        notes=notes,
    )


def _largest_context(fits) -> int:
    """The largest context t >= 1 with fits(t) (0 when none): memory grows with t, so a doubling search
    then a bisection."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
        if high > 1 << 40:  # no GPU holds a cache that long: unbounded for any practical purpose
            return low
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
