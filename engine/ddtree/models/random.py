"""Random weights of known shapes: the cost side of benchmarks, and models for tests."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .quant import Fp8BlockLinear, Int4Linear, parse_quantization, quantize_modules
from .registry import config_from_hf, family_for

RANDOM_PREFIX = "random:"
# config.json dicts (Hugging Face names) of the shapes `random:SHAPE` builds, through the model registry
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-8B: 36 layers, hidden 4096, 32 q / 8 kv heads of 128, MLP 12288, vocab 151936
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 1e6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    # Qwen3-30B-A3B (tests/data/model_configs/qwen3-30b-a3b.json): 48 layers of 128 experts of 768, top 8
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    # Kimi K2.6's language model (tests/data/model_configs/kimi-k2.6.json) cut to 3 layers: one dense, two
    # of 384 experts (about 34 GB each in bf16), so that it fits one GPU; per-layer costs scale to 61 layers
    "kimi-k2.6-3layers": {
        "model_type": "kimi_k2",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    # a small shape for quick checks
    "tiny": {
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
}
# Kimi K2.6 as published: its routed experts INT4 (compressed-tensors pack-quantized, group 32; Kimi K2.5's
# quantization_config, as tests/data/model_configs/kimi-k2.5.json), the rest bf16: about 9.5 GB per MoE layer
KIMI_INT4 = {
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
RANDOM_SHAPES["kimi-k2.6-int4-3layers"] = {**RANDOM_SHAPES["kimi-k2.6-3layers"], "quantization_config": KIMI_INT4}


def random_hf_config(ref: str, **overrides) -> dict[str, Any]:
    """The config.json dict of `random:SHAPE` (or SHAPE) with `overrides` (ValueError naming the known
    shapes for an unknown one)."""
    shape = ref.removeprefix(RANDOM_PREFIX)
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape '{shape}' (known: {', '.join(RANDOM_SHAPES)})")
    return {**RANDOM_SHAPES[shape], **overrides}


def random_config(ref: str, **overrides):
    """The model config of `random:SHAPE`, in its family's class."""
    return config_from_hf(random_hf_config(ref, **overrides))


@torch.no_grad()
def random_model(shape: str, device, dtype, seed: int = 0, **overrides):
    """A target of a known shape with random weights, generated on `device` in `dtype` (no fp32 copy
    first: a shape may fill most of the device); the same seed gives the same weights on every device,
    so tensor-parallel ranks agree.

    Cost is all that is real here, but the greedy choice must be stable: bf16 runs that batch
    differently (graphs against eager in the smoke test) flip near-ties, and plain std-0.02 weights
    give a near-tie at most steps. So the embedding (std 1) dominates the residual stream (the output
    projections are scaled by 1/sqrt(2 x layers), as in GPT-2) and the LM head is a copy of the
    embedding: the next token repeats the last one with a wide margin."""
    hf = random_hf_config(shape, **overrides)
    family = family_for(hf).load()
    cfg = family.ModelConfig.from_hf(hf)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):  # built on meta, then allocated once, quantized layers included
            model = family.Transformer(cfg)
    finally:
        torch.set_default_dtype(default)
    scheme = parse_quantization(hf.get("quantization_config"))
    if scheme is not None:
        marker = "weight_packed" if scheme.kind == "int4" else "weight_scale_inv"
        targets = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and scheme.targets(n)]
        quantize_modules(model, scheme, [f"{n}.{marker}" for n in targets])
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty allocates each module's tensors anew, a tied one too
        model.lm_head.weight = model.model.embed_tokens.weight
    residual_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p.normal_(0, residual_std)
        elif name == "model.embed_tokens.weight":
            p.normal_(0, 1.0)
        else:
            p.normal_(0, 0.02)
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):  # uniform values in -8..7 (std 4.6), scales for the std above
            module.weight_packed.random_(-(2**31), 2**31 - 1)
            std = residual_std if name.endswith("down_proj") else 0.02
            module.weight_scale.fill_(std / 4.6)
            module.weight_shape.copy_(torch.tensor([module.out_features, module.in_features]))
        elif isinstance(module, Fp8BlockLinear):
            module.weight.copy_(torch.randn(module.weight.shape, device=device).to(module.weight.dtype))
            module.weight_scale_inv.fill_(0.02)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.zero_()
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight.copy_(model.model.embed_tokens.weight / math.sqrt(cfg.hidden_size))
    return model.eval()


class ByteTokenizer:
    """A stand-in tokenizer for targets that ship none (random test models): UTF-8 bytes folded into
    [0, vocab_size - 2), so the last id (the drafter's default MASK) never occurs in a prompt."""

    chat_template = None
    eos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b % (self.vocab_size - 2) for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([int(token) % 256])


def write_random_checkpoint(shape: str, folder, device, dtype, shard_bytes: int = 4 << 30) -> int:
    """`random:SHAPE`'s weights written as a Hugging Face folder (config.json, safetensors shards of about
    `shard_bytes` and their index): a checkpoint of real size for load benchmarks. Returns its bytes."""
    import json
    import pathlib

    from safetensors.torch import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = random_model(shape, device, dtype)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, t in state.items():
        if size and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
        total += t.nbytes
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: t.cpu() for n, t in part.items()}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (folder / "config.json").write_text(json.dumps(random_hf_config(shape), indent=1))
    return total
