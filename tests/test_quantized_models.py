"""Quantized checkpoints end to end, against transformers' own DeepseekV3ForCausalLM as the oracle:

- Kimi's layout: routed experts INT4 (compressed-tensors pack-quantized, symmetric, group 32: weight_packed,
  weight_scale, weight_shape), attention, shared experts and the dense layer unquantized, the published
  quantization_config (Kimi K2.5's), the weights in shards with an index;
- DeepSeek-V3's layout: every linear layer but the LM head FP8 with 128x128 block scales (weight_scale_inv),
  kv_b_proj included (MLA absorbs it, so it is dequantized where it is used).

Each loads through the registry, computes the logits transformers computes from the dequantized weights,
and generates losslessly (ddtree and dflash equal ar); the fused MoE (torch backend) equals the reference
forward; split over 2 ranks (gloo), INT4 experts (whole or by width) and every FP8 layer give the logits
and tokens of one rank, and a split that would cut scale blocks or groups is refused in one line."""

import json
import pathlib
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ddtree.models.memory import plan_memory
from ddtree.models.quant import (
    Fp8BlockLinear,
    Int4Linear,
    dequantize_fp8_block,
    dequantize_int4,
    parse_quantization,
    quantize_fp8_block,
    quantize_int4,
    quantize_modules,
)
from ddtree.models.registry import family_for, load_pretrained
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


def quantized_checkpoint(folder: pathlib.Path, kind: str, **sizes):
    """(transformers' model with the dequantized weights, the folder of the quantized checkpoint); sizes:
    config fields other than hf_model's."""
    hf_model(**sizes).save_pretrained(folder / "plain")
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


# FP8 blocks are 128 x 128: sizes whose split over 2 ranks keeps 128-row shares of q_b_proj (2 heads of 64 + 64),
# kv_b_proj (2 x (64 + 64)), o_proj's inputs (2 x 64), the dense MLP (128) and the shared experts (2 x 128 / 2)
FP8_SPLIT = dict(
    qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, intermediate_size=256, moe_intermediate_size=128
)
# INT4 groups are 32 inputs: routed experts 64 wide split by width keep one group per rank of down_proj
INT4_SPLIT = dict(moe_intermediate_size=64)


def quantized_rank(rank, world, folder, whole_experts=True, backend="torch"):
    """Prefill logits and ar tokens of the quantized checkpoint loaded over `world` ranks (1: unsplit); on
    GPU `rank` (NCCL) with the triton backend."""
    torch.set_num_threads(1)
    cut = (lambda m: shard(m, rank, world, whole_experts)) if world > 1 else None
    device = f"cuda:{rank}" if backend == "triton" else "cpu"
    target = load_pretrained(folder, torch.float32, device, shard=cut)
    if world > 1:
        moe, attn = target.model.layers[1].mlp, target.model.layers[1].self_attn
        experts = 8 // world if whole_experts else 8
        assert len(moe.experts) == experts and moe.first_expert == experts * rank * whole_experts
        assert attn.n_heads == 4 // world
    use_backend(target, backend)
    engine = Engine(target, None, "ar", None, max_batch_size=3, max_seq_len=64)
    tokens = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=12))]
    return prefill_logits(target, torch.tensor([PROMPTS[2]], device=device)).tolist(), tokens


@pytest.mark.parametrize(
    "kind,sizes,whole_experts",
    [
        pytest.param("int4", {}, True, id="int4-experts-whole"),
        pytest.param("int4", INT4_SPLIT, False, id="int4-experts-by-width", marks=pytest.mark.slow),
        pytest.param("int4", {}, False, id="int4-one-group-a-row-by-width", marks=pytest.mark.slow),
        pytest.param("fp8", FP8_SPLIT, True, id="fp8-every-layer"),
    ],
)
def test_quantized_layers_split_over_two_ranks_equal_one_rank(tmp_path, kind, sizes, whole_experts):
    """Loaded straight into two ranks' shares (each reads only its slices of the weights and their scales):
    INT4 routed experts whole (expert parallelism) or by width (packed words and scale groups cut along the
    inputs of down_proj; with one group a row, each rank keeps the row's scale); every FP8 layer of DeepSeek-V3's
    layout, attention and dense MLPs included, with its 128 x 128 scale blocks. The same logits (1e-5) and
    tokens as one rank."""
    _, folder = quantized_checkpoint(tmp_path, kind, **sizes)
    logits, tokens = quantized_rank(0, 1, folder)
    got_logits, got_tokens = launch(2, quantized_rank, folder, whole_experts)
    assert got_tokens == tokens
    torch.testing.assert_close(torch.tensor(got_logits), torch.tensor(logits), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("last", [False, True], ids=["rank-0", "last-rank"])
def test_a_split_that_cuts_fp8_blocks_or_int4_groups_is_refused_on_every_rank(tmp_path, last):
    """kv_b_proj's 160 outputs (4 heads of 16 + 24) in shares of 80 would cut its 128-row scale blocks; 64-wide
    INT4 experts split by width over 4 ranks would cut down_proj's groups of 32 inputs. Both refused before any
    weight is read, on rank 0 too (its share starts on a block). (One group a row splits: each rank keeps it.)"""
    _, fp8 = quantized_checkpoint(tmp_path / "fp8", "fp8")
    with pytest.raises(ValueError) as refused:
        load_pretrained(fp8, torch.float32, "cpu", shard=lambda m: shard(m, 1 if last else 0, 2))
    assert str(refused.value) == (
        "tensor parallel 2 cannot split model.layers.0.self_attn.kv_b_proj: 80 of its 160 outputs per rank cut "
        "its FP8 scale blocks of 128 (each rank's share must be a multiple of 128)"
    )
    assert plan_of(fp8, 2).reason == str(refused.value)  # ddtree plan says so before any process starts
    _, int4 = quantized_checkpoint(tmp_path / "int4", "int4", **INT4_SPLIT)
    with pytest.raises(ValueError) as refused:
        load_pretrained(int4, torch.float32, "cpu", shard=lambda m: shard(m, 3 if last else 0, 4, whole_experts=False))
    assert str(refused.value) == (
        "tensor parallel 4 cannot split model.layers.1.mlp.experts.0.down_proj: 16 of its 64 inputs per rank cut "
        "its INT4 scale groups of 32 (each rank's share must be a multiple of 32)"
    )
    assert plan_of(int4, 4, expert_parallel=1).reason == str(refused.value)


def plan_of(folder, gpus, **options):
    config = json.loads((folder / "config.json").read_text())
    return plan_memory(config, gpus=gpus, gpu_memory=1 << 40, max_context=64, **options)


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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
@pytest.mark.parametrize(
    "kind,sizes,whole_experts", [("int4", INT4_SPLIT, False), ("fp8", FP8_SPLIT, True)], ids=["int4", "fp8"]
)
def test_quantized_layers_split_over_two_gpus_equal_one_gpu(tmp_path, kind, sizes, whole_experts):
    """The split quantized layers through the Triton GEMMs on 2 GPUs (NCCL): the one-GPU logits (1e-3, fp32
    activations) and tokens."""
    _, folder = quantized_checkpoint(tmp_path, kind, **sizes)
    logits, tokens = quantized_rank(0, 1, folder, backend="triton")
    got_logits, got_tokens = launch(2, quantized_rank, folder, whole_experts, "triton", device_type="cuda")
    assert got_tokens == tokens
    torch.testing.assert_close(torch.tensor(got_logits), torch.tensor(logits), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "name,whole_experts",
    [("deepseek-v3", True), ("deepseek-v3", False), ("kimi-k2-instruct", True), ("kimi-k2.6", False)],
    ids=["deepseek-v3", "deepseek-v3-experts-by-width", "kimi-k2-instruct", "kimi-k2.6-experts-by-width"],
)
def test_published_quantized_models_split_over_eight_ranks_along_their_scales(name, whole_experts):
    """The published sizes (the dense layers and one MoE layer of them) on the meta device, quantized as their
    checkpoints are and cut for the last of 8 ranks: nothing refused, and the scale slices that loading will
    read are that rank's blocks (DeepSeek-V3, Kimi K2 Instruct: FP8 128 x 128) or groups (Kimi K2.6's
    experts: INT4, 32 inputs)."""
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    text = raw.get("text_config", raw)
    text["num_hidden_layers"] = text["first_k_dense_replace"] + 1
    family = family_for(raw).load()
    cfg = family.ModelConfig.from_hf(raw)
    with torch.device("meta"):
        model = family.Transformer(cfg)
    scheme = parse_quantization(text["quantization_config"])
    suffix = "weight_scale_inv" if scheme.kind == "fp8_block" else "weight_packed"
    # Kimi K2.6's quantization_config lists no ignored modules: its routed experts are the INT4 ones
    linears = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and scheme.targets(n) and (scheme.kind == "fp8_block" or ".experts." in n)
    ]
    quantize_modules(model, scheme, [f"{n}.{suffix}" for n in linears])
    shard(model, 7, 8, whole_experts)
    layer = model.model.layers[-1]
    expected = {"mlp.experts.0.down_proj": (1, 7 * 2, 2) if scheme.kind == "fp8_block" else (1, 7 * 8, 8)}
    if scheme.kind == "fp8_block":
        # a rank's heads: 16 of DeepSeek-V3's 128, 8 of Kimi K2's 64; blocks of their q rows (192 a head),
        # kv_b rows (256 a head) and o inputs (128 a head)
        heads = {"deepseek-v3": 16, "kimi-k2-instruct": 8}[name]
        q, kv, o = heads * 192 // 128, heads * 256 // 128, heads * 128 // 128
        expected |= {
            "self_attn.q_b_proj": (0, 7 * q, q),
            "self_attn.kv_b_proj": (0, 7 * kv, kv),
            "self_attn.o_proj": (1, 7 * o, o),
            "mlp.shared_experts.down_proj": (1, 7 * 2, 2),
        }
        dense = model.model.layers[0].mlp  # 18432 wide: 2304 a rank
        assert dense.down_proj.weight_scale_inv.checkpoint_slice == (1, 7 * 18, 18)
        assert not hasattr(layer.self_attn.q_a_proj.weight_scale_inv, "checkpoint_slice")  # replicated
    if whole_experts:
        expected.pop("mlp.experts.0.down_proj")
        experts = cfg.n_routed_experts // 8
        assert layer.mlp.first_expert == 7 * experts and len(layer.mlp.experts) == experts
    for module_name, want in expected.items():
        module = layer.get_submodule(module_name)
        scales = module.weight_scale_inv if scheme.kind == "fp8_block" else module.weight_scale
        assert scales.checkpoint_slice == want, module_name
