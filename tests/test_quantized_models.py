"""Quantized checkpoints end to end, against transformers' own DeepseekV3ForCausalLM as the oracle:

- Kimi's layout: routed experts INT4 (compressed-tensors pack-quantized, symmetric, group 32: weight_packed,
  weight_scale, weight_shape), attention, shared experts and the dense layer unquantized, the published
  quantization_config (Kimi K2.5's), the weights in shards with an index;
- DeepSeek-V3's layout: every linear layer but the LM head FP8 with 128x128 block scales (weight_scale_inv),
  kv_b_proj included (MLA absorbs it, so it is dequantized where it is used).

Each loads through the registry, computes the logits transformers computes from the dequantized weights,
and generates losslessly (ddtree and dflash equal ar); the fused MoE (torch backend) equals the reference
forward; INT4 experts split whole over 2 ranks (gloo) give the tokens of one rank, and a split that would
slice FP8 attention weights is refused in one line."""

import json
import pathlib
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ddtree.models.quant import (
    Fp8BlockLinear,
    Int4Linear,
    dequantize_fp8_block,
    dequantize_int4,
    quantize_fp8_block,
    quantize_int4,
)
from ddtree.models.registry import load_pretrained
from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.runtime.fused import use_backend
from ddtree.runtime.parallel import launch, shard
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from test_deepseek_v3 import PROMPTS, hf_model

CONFIGS = pathlib.Path(__file__).parent / "data" / "model_configs"
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
LINEAR = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def write_shards(folder: pathlib.Path, state: dict, shards: int = 3) -> None:
    """The tensors in `shards` files named by model.safetensors.index.json, as the hub publishes them."""
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n].contiguous() for n in names[i::shards]}
        save_file(part, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def quantized_checkpoint(folder: pathlib.Path, kind: str):
    """(transformers' model with the dequantized weights, the folder of the quantized checkpoint)."""
    hf_model().save_pretrained(folder / "plain")
    state = load_file(folder / "plain" / "model.safetensors")
    plain = dict(state)
    for name in list(state):
        if kind == "int4" and EXPERT.search(name):
            w = state.pop(name)
            packed, scale = quantize_int4(w, 32)
            base = name.removesuffix(".weight")
            state[base + ".weight_packed"], state[base + ".weight_scale"] = packed, scale
            state[base + ".weight_shape"] = torch.tensor(w.shape)
            plain[name] = dequantize_int4(packed, scale, w.shape[1], 32, w.dtype)
        elif kind == "fp8" and LINEAR.search(name) and ".mlp.gate." not in name:
            fp8, scale_inv = quantize_fp8_block(state[name])
            state[name], state[name.removesuffix("weight") + "weight_scale_inv"] = fp8, scale_inv
            plain[name] = dequantize_fp8_block(fp8, scale_inv)
    save_file(plain, folder / "plain" / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(folder / "plain", dtype=torch.float32).eval()
    quantized = folder / kind
    quantized.mkdir()
    write_shards(quantized, state)
    config = json.loads((folder / "plain" / "config.json").read_text())
    published = json.loads((CONFIGS / ("kimi-k2.5.json" if kind == "int4" else "deepseek-v3.json")).read_text())
    config["quantization_config"] = published.get("text_config", published)["quantization_config"]
    (quantized / "config.json").write_text(json.dumps(config))
    return hf, quantized


@pytest.fixture(scope="module", params=["int4", "fp8"])
def quantized(request, tmp_path_factory):
    kind = request.param
    hf, folder = quantized_checkpoint(tmp_path_factory.mktemp(kind), kind)
    return kind, hf, folder


def causal(n):
    j = torch.arange(n)
    return (j[:, None] >= j[None, :])[None, None]


def prefill_logits(target, ids):
    j = torch.arange(ids.shape[1], device=ids.device)
    target.setup_caches(1, ids.shape[1])
    with torch.no_grad():
        return target(ids, j[None], j[None], causal(ids.shape[1]).to(ids.device))[0]


def test_loads_as_published_and_equals_transformers_on_the_dequantized_weights(quantized):
    kind, hf, folder = quantized
    target = load_pretrained(folder, torch.float32, "cpu")
    quantized_layers = [m for m in target.modules() if isinstance(m, (Int4Linear, Fp8BlockLinear))]
    expected_kind = Int4Linear if kind == "int4" else Fp8BlockLinear
    assert quantized_layers and all(isinstance(m, expected_kind) for m in quantized_layers)
    if kind == "int4":  # only the routed experts, as Kimi's ignore list says
        assert isinstance(target.model.layers[1].mlp.experts[0].down_proj, Int4Linear)
        assert isinstance(target.model.layers[1].self_attn.o_proj, torch.nn.Linear)
        assert isinstance(target.model.layers[1].mlp.shared_experts.up_proj, torch.nn.Linear)
    else:
        assert isinstance(target.model.layers[1].self_attn.kv_b_proj, Fp8BlockLinear)
    ids = torch.tensor([PROMPTS[2] * 2])
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(prefill_logits(target, ids), expected, atol=1e-4, rtol=1e-4)
    use_backend(target, "torch")  # the fused MoE: the chosen experts' tiles dequantized
    torch.testing.assert_close(prefill_logits(target, ids), expected, atol=1e-4, rtol=1e-4)


def test_speculative_decoding_is_lossless(quantized):
    _, _, folder = quantized
    target = load_pretrained(folder, torch.float32, "cpu")
    use_backend(target, "torch")
    drafter = init_drafter(DrafterConfig.for_target(target.config, num_layers=1, block_size=8), seed=0)
    out = {}
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 8)):
        engine = Engine(target, drafter, method, budget, max_batch_size=3, max_seq_len=96)
        out[method] = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=16))]
    assert out["ddtree"] == out["ar"] and out["dflash"] == out["ar"]


def int4_rank(rank, world, folder):
    torch.set_num_threads(1)
    target = load_pretrained(
        folder, torch.float32, "cpu", shard=(lambda m: shard(m, rank, world)) if world > 1 else None
    )
    moe = target.model.layers[1].mlp
    assert len(moe.experts) == 8 // world and moe.first_expert == 4 * rank * (world > 1)
    use_backend(target, "torch")
    engine = Engine(target, None, "ar", None, max_batch_size=3, max_seq_len=64)
    tokens = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=12))]
    return prefill_logits(target, torch.tensor([PROMPTS[2]])).tolist(), tokens


def test_int4_experts_split_whole_over_two_ranks_equal_one_rank(tmp_path):
    _, folder = quantized_checkpoint(tmp_path, "int4")
    logits, tokens = int4_rank(0, 1, folder)
    got_logits, got_tokens = launch(2, int4_rank, folder)
    assert got_tokens == tokens
    torch.testing.assert_close(torch.tensor(got_logits), torch.tensor(logits), atol=1e-5, rtol=1e-5)


def test_splitting_fp8_attention_weights_is_refused_in_one_line(tmp_path):
    _, folder = quantized_checkpoint(tmp_path, "fp8")
    with pytest.raises(
        ValueError, match=r"not supported yet \(model\.layers\.0\.self_attn\.q_a_proj would be sliced\)"
    ):
        load_pretrained(folder, torch.float32, "cpu", shard=lambda m: shard(m, 0, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)")
def test_triton_backend_on_the_gpu_equals_transformers_and_stays_lossless(quantized):
    """On the GPU the Triton backend runs the quantized layers: INT4 experts through the grouped W4A16 GEMM,
    FP8 layers through the FP8 block GEMM (fp32 activations: the reference's numbers within 1e-3)."""
    _, hf, folder = quantized
    target = load_pretrained(folder, torch.float32, "cuda")
    use_backend(target, "triton")
    ids = torch.tensor([PROMPTS[2] * 2])
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(prefill_logits(target, ids.cuda()).cpu(), expected, atol=1e-3, rtol=1e-3)
    drafter = init_drafter(DrafterConfig.for_target(target.config, num_layers=1, block_size=8), seed=0).cuda()
    out = {}
    for method, budget in (("ar", None), ("ddtree", 8)):
        engine = Engine(target, drafter, method, budget, max_batch_size=3, max_seq_len=96)
        out[method] = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=16))]
    assert out["ddtree"] == out["ar"]
