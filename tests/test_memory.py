"""The memory plan (models/memory.py, `ddtree plan`): its counts equal what the engine allocates, byte for byte,
for tiny models of every family (dense GQA, Qwen3-MoE, DeepSeek-V3 / Kimi MLA, int4 and fp8 weights), whole
and split over 2 ranks, with and without a DFlash drafter; the published Kimi K2.6 configs plan as a
deployment needs; the command line's exit codes and one-line refusals; and the module imports no torch.

Margin: none. Weights, the target's KV cache and the drafter's are compared exactly (per kind for the
weights), since the plan mirrors the engine's shapes rather than approximating them. Only the workspace and
the reserve are estimates, and the tests check their parts, not a measurement."""

import copy
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

from ddtree.cli import main
from ddtree.config import ConfigError, EngineConfig
from ddtree.models.memory import KINDS, RESERVE_BYTES, WEIGHT_KINDS, GiB, parse_size, plan_memory
from ddtree.models.quant import quantize_modules
from ddtree.models.quant_config import parse_quantization
from ddtree.models.random import random_hf_config, random_model
from ddtree.models.registry import config_from_hf, family_for
from ddtree.runtime.build import pool_within_memory
from ddtree.runtime.engine import Engine
from ddtree.runtime.pages import PAGE_SIZE
from ddtree.runtime.parallel import shard, split_drafter
from ddtree.speculative.drafter import random_drafter

CONFIGS = pathlib.Path(__file__).parent / "data" / "model_configs"
H200, B300 = parse_size("141GiB"), parse_size("288GB")
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
TINY = {
    "llama-tied": ("tiny", dict(SMALL, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "qwen2-bias": ("tiny", dict(SMALL, model_type="qwen2", num_key_value_heads=2, head_dim=16)),
    "qwen3": ("qwen3-8b", dict(SMALL, num_key_value_heads=2, head_dim=16)),
    "qwen3-moe": (
        "qwen3-30b-a3b",
        dict(
            SMALL,
            num_key_value_heads=2,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            attention_bias=True,
        ),
    ),
    "kimi": (
        "kimi-k2.6-3layers",
        dict(
            SMALL,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
        ),
    ),
}
TINY["deepseek-no-q-lora-bias"] = ("kimi-k2.6-3layers", dict(TINY["kimi"][1], q_lora_rank=None, attention_bias=True))


def kind_of(name: str) -> str:
    """The plan's kind of an engine parameter or buffer name."""
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if "norm." in name or ".mlp.gate." in name or name == "inv_freq":
        return "norms_and_routers"
    return "attention" if ".self_attn." in name else "dense_mlp"


def held_bytes(model: nn.Module, drafter: bool = False) -> dict[str, int]:
    """Bytes of the parameters and buffers a model holds, by kind, caches left out (a tied weight once)."""
    seen, out = set(), {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in tensors:
        if name.endswith(("kv_cache.k", "kv_cache.v", "cache.latent")) or t.data_ptr() in seen or not t.numel():
            continue
        seen.add(t.data_ptr())
        kind = "drafter_weights" if drafter else kind_of(name)
        out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
    return out


def drafter_cache_bytes(drafter) -> int:
    return sum(layer.self_attn.kv_cache.k.nbytes + layer.self_attn.kv_cache.v.nbytes for layer in drafter.layers)


def tiny(name: str, dtype=torch.bfloat16):
    """(config.json dict, model) of a tiny random model, cast as loading casts (fp32 router biases)."""
    shape, overrides = TINY[name]
    return random_hf_config(shape, **overrides), random_model(shape, "cpu", torch.float32, **overrides).to(dtype)


def planned_weights(plan) -> dict[str, int]:
    return {k: v for k, v in plan.per_rank_bytes.items() if k in WEIGHT_KINDS and v}


def engine_and_plan(hf, target, drafter, context: int, batch: int, budget: int, pool: int | None = None):
    """An Engine of these models (ddtree with a drafter, else ar) and the plan of the same settings."""
    budget_or_none = budget if drafter else None
    engine = Engine(
        target, drafter, "ddtree" if drafter else "ar", budget_or_none, batch, context, kv_cache_tokens=pool
    )
    plan = plan_memory(
        hf,
        gpus=1,
        gpu_memory=B300,
        max_context=context,
        max_batch=batch,
        kv_cache_tokens=pool,
        drafter_config=drafter.config.to_hf() if drafter else None,
        budget=budget_or_none,
    )
    return engine, plan


@pytest.mark.parametrize("with_drafter", [False, True], ids=["alone", "drafter"])
@pytest.mark.parametrize("name", list(TINY))
def test_the_plan_is_what_the_engine_allocates(name, with_drafter):
    hf, target = tiny(name)
    drafter = random_drafter(target, layers=2, block_size=8) if with_drafter else None
    context, batch, budget = 100, 3, 5
    engine, plan = engine_and_plan(hf, target, drafter, context, batch, budget)
    held = held_bytes(target) | (held_bytes(drafter, drafter=True) if drafter else {})
    assert planned_weights(plan) == held
    assert plan.per_rank_bytes["kv_cache"] == target.cache_storage.nbytes
    assert plan.pool_slots == plan.cache_slots * batch == engine.page_pool.pages * PAGE_SIZE >= engine.max_slots
    assert plan.per_rank_bytes["drafter_kv_cache"] == (drafter_cache_bytes(drafter) if drafter else 0)
    assert plan.workspace["drafter context"] == engine.ctx_features.nbytes
    assert plan.per_rank_bytes["reserve"] == RESERVE_BYTES and plan.fits
    verify_logits = batch * (budget + 1 if drafter else 1) * hf["vocab_size"] * 2  # bf16
    assert plan.workspace["verify logits"] == verify_logits and set(plan.per_rank_bytes) == set(KINDS)


def test_a_smaller_page_pool_is_what_the_engine_allocates():
    """serving.kv_cache_tokens sizes the pool of both caches, in whole pages, whatever the rows and context."""
    hf, target = tiny("qwen3")
    drafter = random_drafter(target, layers=2, block_size=8)
    context, batch, pool = 100, 3, 150  # 10 pages, less than 3 rows of 100 tokens
    engine, plan = engine_and_plan(hf, target, drafter, context, batch, 5, pool)
    assert plan.pool_slots == engine.page_pool.pages * PAGE_SIZE == 160 < plan.cache_slots * batch
    assert plan.per_rank_bytes["kv_cache"] == target.cache_storage.nbytes
    assert plan.per_rank_bytes["drafter_kv_cache"] == drafter_cache_bytes(drafter)
    assert "x a pool of 160 slots" in plan.render()


def test_a_share_of_gpu_memory_is_the_largest_pool_within_it():
    """gpu_memory_utilization: the pool is the most whole pages that keep the plan's total within that share
    of the GPU, and one more page would pass it; the engine allocates that pool as kv_cache_tokens."""
    hf, target = tiny("qwen3")
    drafter = random_drafter(target, layers=2, block_size=8)
    args = dict(
        gpus=1, gpu_memory=4 * GiB, max_context=100, max_batch=3, drafter_config=drafter.config.to_hf(), budget=5
    )
    plan = plan_memory(hf, gpu_memory_utilization=0.9, **args)
    assert plan.fits and plan.pool_slots % PAGE_SIZE == 0 and plan.pool_slots > 3 * plan.cache_slots
    assert (
        plan.total_per_rank
        <= 0.9 * 4 * GiB
        < plan_memory(hf, kv_cache_tokens=plan.pool_slots + 16, **args).total_per_rank
    )
    assert f"what 0.9 of each GPU's memory leaves: {plan.pool_slots:,} tokens" in plan.render()
    assert plan.max_context_that_fits <= plan.pool_slots
    engine = Engine(target, drafter, "ddtree", 5, 3, 100, kv_cache_tokens=plan.pool_slots)
    assert plan.per_rank_bytes["kv_cache"] == target.cache_storage.nbytes
    assert plan.per_rank_bytes["drafter_kv_cache"] == drafter_cache_bytes(drafter) and engine.page_pool.pages > 0
    # a share that leaves no page, or less than one request, does not fit; both ways of sizing are refused
    small = plan_memory(hf, gpu_memory_utilization=plan.total_per_rank / (4 * GiB) / 40, **args)
    assert not small.fits and small.reason.startswith("no KV cache page fits: everything else needs ")
    rest = plan.total_per_rank - plan.per_rank_bytes["kv_cache"] - plan.per_rank_bytes["drafter_kv_cache"]
    per_token = plan.kv_bytes_per_token + plan.drafter_kv_bytes_per_token
    short = plan_memory(hf, gpu_memory_utilization=(rest + 60 * per_token) / (4 * GiB), **args)
    assert not short.fits and "max_context 100 is more than the KV cache pool of 48 tokens" in short.reason
    with pytest.raises(ValueError, match="not both"):
        plan_memory(hf, gpu_memory_utilization=0.9, kv_cache_tokens=4096, **args)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        plan_memory(hf, gpu_memory_utilization=1.5, **args)


def test_budget_zero_loads_the_drafter_but_gives_it_no_cache():
    hf, target = tiny("qwen3")
    drafter = random_drafter(target, layers=1, block_size=4)
    engine = Engine(target, drafter, "ddtree", 0, max_batch_size=2, max_seq_len=32)
    plan = plan_memory(
        hf, gpus=1, gpu_memory=B300, max_context=32, max_batch=2, drafter_config=drafter.config.to_hf(), budget=0
    )
    assert engine.drafter is None and drafter.layers[0].self_attn.kv_cache is None
    assert plan.per_rank_bytes["drafter_kv_cache"] == 0 and plan.per_rank_bytes["drafter_weights"] > 0
    assert plan.per_rank_bytes["kv_cache"] == target.cache_storage.nbytes and "budget 0" in plan.notes[0]


@pytest.mark.parametrize(
    "name,expert_parallel", [("qwen3", None), ("qwen3-moe", None), ("kimi", None), ("qwen3-moe", 1), ("kimi", 1)]
)
def test_two_ranks_hold_what_the_plan_says(name, expert_parallel):
    hf, whole = tiny(name)
    drafter = random_drafter(whole, layers=1, block_size=4)
    plan = plan_memory(
        hf,
        gpus=2,
        gpu_memory=B300,
        max_context=40,
        max_batch=2,
        drafter_config=drafter.config.to_hf(),
        budget=3,
        expert_parallel=expert_parallel,
    )
    # the tiny MLA's drafter has 1 KV head (DrafterConfig.for_target): it cannot split over 2 ranks
    assert plan.drafter == ("replicated" if name == "kimi" else "split")
    for rank in range(2):
        target, rank_drafter = shard(copy.deepcopy(whole), rank, 2, expert_parallel != 1), copy.deepcopy(drafter)
        assert split_drafter(target, rank_drafter) == plan.drafter
        Engine(target, rank_drafter, "ddtree", 3, max_batch_size=2, max_seq_len=40)
        assert planned_weights(plan) == held_bytes(target) | held_bytes(rank_drafter, drafter=True)
        assert plan.per_rank_bytes["kv_cache"] == target.cache_storage.nbytes
        assert plan.per_rank_bytes["drafter_kv_cache"] == drafter_cache_bytes(rank_drafter)


def quantized(name: str, quantization: dict, dtype=torch.bfloat16):
    """A tiny model whose linear layers the scheme targets hold quantized tensors (quant.Int4Linear /
    Fp8BlockLinear, as loading builds them), and its config.json dict with the quantization_config."""
    shape, overrides = TINY[name]
    hf = random_hf_config(shape, **overrides, quantization_config=quantization)
    scheme = parse_quantization(quantization)
    marker = {"int4": "weight_packed", "fp8_block": "weight_scale_inv"}[scheme.kind]
    with torch.device("meta"):
        model = family_for(hf).load().Transformer(config_from_hf(hf))
    # a compressed-tensors config without an ignore list: Kimi's checkpoints quantize the routed experts alone
    covered = scheme.targets if "ignore" in quantization or scheme.kind != "int4" else lambda n: ".experts." in n
    keys = [f"{n}.{marker}" for n, m in model.named_modules() if isinstance(m, nn.Linear) and covered(n)]
    quantize_modules(model, scheme, keys)
    model = model.to_empty(device="cpu").to(dtype)
    model.setup_caches(1, 8)  # the RoPE frequencies in fp32, as the engine holds them
    return hf, model


INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 8}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    "quantization", [INT4, {k: v for k, v in INT4.items() if k != "ignore"}, FP8], ids=["int4", "int4-no-ignore", "fp8"]
)
def test_quantized_weights_are_counted_as_stored(quantization):
    hf, model = quantized("kimi", quantization)
    plan = plan_memory(hf, gpus=1, gpu_memory=B300, max_context=8)
    assert planned_weights(plan) == held_bytes(model)
    packed = sum(b.nbytes for n, b in model.named_buffers() if n.endswith(("weight_packed", "weight")))
    assert packed  # some layers are quantized
    if quantization is not FP8:  # Kimi's ignore list quantizes the routed experts only, as no list does
        assert "int4 group 8" in plan.quantization
        experts = sum(b.nbytes for n, b in model.named_buffers() if ".experts." in n)
        assert plan.per_rank_bytes["routed_experts"] == experts
        rank = shard(copy.deepcopy(model), 1, 2)  # whole quantized experts split over the ranks
        assert planned_weights(plan_memory(hf, gpus=2, gpu_memory=B300, max_context=8)) == held_bytes(rank)


def test_unsupported_quantization_does_not_fit_and_names_it():
    hf = random_hf_config("kimi-k2.6-3layers", quantization_config={"quant_method": "gptq", "bits": 4})
    plan = plan_memory(hf, gpus=8, gpu_memory=B300, max_context=1024)
    assert not plan.fits and plan.reason.startswith("unsupported quantization: gptq 4-bit")
    assert plan.max_context_that_fits == 0


def kimi_k26() -> tuple[dict, dict]:
    """Kimi K2.6 and the z-lab Kimi-K2.5 DFlash drafter (6 layers, 64 / 8 heads of 128). The drafter's
    published config is copied only in part: its MLP width is not confirmed (tests/data/model_configs/
    SOURCES.md), so it takes the target's dense MLP width, 18432, as nvidia/Kimi-K2.7-Code-DFlash does."""
    target = json.loads((CONFIGS / "kimi-k2.6.json").read_text())
    drafter = json.loads((CONFIGS / "dflash-kimi-k2.5.json").read_text())
    return target, {**drafter, "intermediate_size": 18432}


@pytest.mark.parametrize("gpu_memory", [H200, B300], ids=["8xH200", "8xB300"])
def test_kimi_k26_with_its_drafter_fits_eight_gpus_at_its_whole_context(gpu_memory):
    target, drafter = kimi_k26()
    context = target["text_config"]["max_position_embeddings"]  # 262144: what a deployment offers
    plan = plan_memory(target, gpus=8, gpu_memory=gpu_memory, max_context=context, drafter_config=drafter)
    assert plan.fits, plan.reason
    assert plan.drafter == "split" and plan.quantization.startswith("int4 group 32")
    assert plan.kv_bytes_per_token == 61 * (512 + 64) * 2  # the latent cache, on every rank
    assert plan.drafter_kv_bytes_per_token == 6 * 2 * 1 * 128 * 2  # 8 KV heads over 8 ranks
    assert 60 * GiB < plan.per_rank_bytes["routed_experts"] < 70 * GiB  # 384 / 8 int4 experts a layer
    assert plan.max_context_that_fits == context  # memory holds more; the model's context is the limit
    assert "kv_cache" in plan.render() and "fits: " in plan.render()


def test_kimi_k26_ignore_list_and_the_conservative_default_agree():
    """K2.6's copy has no ignore list (routed experts counted as quantized); K2.5 publishes one that leaves
    everything else unquantized: the same weights."""
    k26, _ = kimi_k26()
    k25 = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
    plans = [plan_memory(c, gpus=8, gpu_memory=H200, max_context=4096) for c in (k25, k26)]
    assert planned_weights(plans[0]) == planned_weights(plans[1])


def test_kimi_k26_does_not_fit_one_gpu_nor_a_split_its_heads_refuse():
    target, drafter = kimi_k26()
    one = plan_memory(target, gpus=1, gpu_memory=H200, max_context=262144, drafter_config=drafter)
    assert not one.fits and one.max_context_that_fits == 0
    assert one.reason.startswith("needs ") and "over the 141.00 GiB" in one.reason and "no context fits" in one.reason
    three = plan_memory(target, gpus=3, gpu_memory=B300, max_context=4096)
    assert not three.fits and three.max_context_that_fits == 0
    assert three.reason.startswith("tensor parallel 3 does not divide the model: 64 attention heads")
    published = {k: v for k, v in drafter.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="drafter config lacks 'intermediate_size'"):
        plan_memory(target, gpus=8, gpu_memory=H200, max_context=4096, drafter_config=published)


def test_the_largest_context_is_the_edge_of_fitting():
    """In memory (16 rows of the 8B shape on 80 GB), or at the model's context (4 rows): one token more
    does not fit, and the reason says which bound it passed."""
    hf = random_hf_config("qwen3-8b")
    for max_batch, bound in ((16, "over the"), (4, "more than the model's context of 40,960 tokens")):
        plan = plan_memory(hf, gpus=1, gpu_memory=parse_size("80GB"), max_context=4096, max_batch=max_batch)
        edge = plan.max_context_that_fits
        at = [
            plan_memory(hf, gpus=1, gpu_memory=parse_size("80GB"), max_context=t, max_batch=max_batch)
            for t in (edge, edge + 1)
        ]
        assert at[0].fits and not at[1].fits and bound in at[1].reason, at[1].reason
    assert edge == hf["max_position_embeddings"]


def test_expert_parallel_one_splits_widths_and_checks_them():
    hf = random_hf_config("qwen3-30b-a3b")
    whole = plan_memory(hf, gpus=4, gpu_memory=B300, max_context=1024)
    width = plan_memory(hf, gpus=4, gpu_memory=B300, max_context=1024, expert_parallel=1)
    assert whole.per_rank_bytes == width.per_rank_bytes
    odd = plan_memory({**hf, "moe_intermediate_size": 770}, gpus=4, gpu_memory=B300, max_context=8, expert_parallel=1)
    assert "770 expert width" in odd.reason
    with pytest.raises(ValueError, match="expert parallel must be 1 or"):
        plan_memory(hf, gpus=4, gpu_memory=B300, max_context=8, expert_parallel=2)


@pytest.mark.parametrize(
    "name,gpus,expert_parallel,cut",
    [
        ("deepseek-v3", 8, None, None),
        ("deepseek-v3", 16, 1, None),
        ("deepseek-v3", 32, None, "model.layers.0.mlp.gate_proj: 576 of its 18432 outputs per rank cut its FP8 scale"),
        ("kimi-k2.6", 64, 1, None),  # 32 of an expert's 2048 inputs a rank: one INT4 group of 32
    ],
)
def test_a_split_that_cuts_quantized_scales_does_not_fit(name, gpus, expert_parallel, cut):
    """The plan refuses, as loading does (tests/test_quantized_models.py), a split whose shares would cut FP8
    blocks or INT4 groups: DeepSeek-V3's dense MLP (18432 wide) over 32 ranks; over 8 and 16 it splits."""
    hf = json.loads((CONFIGS / f"{name}.json").read_text())
    plan = plan_memory(hf, gpus=gpus, gpu_memory=H200, max_context=4096, expert_parallel=expert_parallel)
    assert plan.fits == (cut is None), plan.reason
    if cut:
        assert plan.reason.startswith(f"tensor parallel {gpus} cannot split {cut}"), plan.reason


@pytest.mark.parametrize(
    "text,size",
    [("141GiB", 141 * GiB), ("80GB", 80 * 10**9), ("288 GB", 288 * 10**9), ("141Gi", 141 * GiB), ("1024", 1024)],
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "12XB", "-3GB", "0"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_size(text)


# ---- the command line ----------------------------------------------------------------------------


def plan_cli(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_command_prints_the_table_and_exits_0_when_it_fits(capsys):
    code, out, err = plan_cli(
        capsys, "--model", str(CONFIGS / "kimi-k2.6.json"), "--gpus", "8", "--gpu-memory", "141GiB"
    )
    assert code == 0 and err == ""
    assert "routed_experts" in out and "kv_cache" in out and "fits: " in out and "262,144" in out


def test_plan_command_takes_the_page_pool(capsys):
    args = ["--model", str(CONFIGS / "kimi-k2.6.json"), "--gpus", "8", "--gpu-memory", "141GiB", "--json"]
    whole = json.loads(plan_cli(capsys, *args, "--max-context", "65536", "--max-batch", "8")[1])
    code, out, _ = plan_cli(capsys, *args, "--max-context", "65536", "--max-batch", "8", "--kv-cache-tokens", "131072")
    pooled = json.loads(out)
    assert code == 0 and pooled["pool_slots"] == 131072 and whole["pool_slots"] == 8 * whole["cache_slots"]
    assert pooled["max_context_that_fits"] == 131072  # one request holds the whole pool at most
    code, out, err = plan_cli(capsys, *args, "--max-context", "65536", "--kv-cache-tokens", "32768")
    assert code == 2 and "max_context 65,536 is more than the KV cache pool of 32,768 tokens" in err
    ratio = pooled["per_rank_bytes"]["kv_cache"] / whole["per_rank_bytes"]["kv_cache"]
    assert abs(ratio - 131072 / whole["pool_slots"]) < 1e-4
    code, out, _ = plan_cli(
        capsys, *args, "--max-context", "65536", "--max-batch", "8", "--gpu-memory-utilization", "0.9"
    )
    shared = json.loads(out)
    assert code == 0 and shared["total_per_rank"] <= 0.9 * 141 * 2**30 and shared["pool_slots"] > whole["pool_slots"]


def test_plan_command_refuses_in_one_line_and_exits_2(capsys, tmp_path):
    folder = tmp_path / "kimi"
    folder.mkdir()
    (folder / "config.json").write_text((CONFIGS / "kimi-k2.6.json").read_text())
    code, out, err = plan_cli(capsys, "--model", str(folder), "--gpus", "1", "--gpu-memory", "141GiB")
    assert code == 2 and "OVER" in out
    assert err.count("\n") == 1 and err.startswith("ddtree: does not fit: needs ")


def test_plan_command_json(capsys, tmp_path):
    drafter = tmp_path / "drafter.json"
    drafter.write_text(json.dumps(kimi_k26()[1]))
    args = ["--model", str(CONFIGS / "kimi-k2.6.json"), "--drafter", str(drafter), "--gpu-memory", "288GB", "--json"]
    code, out, err = plan_cli(capsys, *args, "--gpus", "8", "--max-batch", "4", "--budget", "1:32,4:8")
    plan = json.loads(out)
    assert code == 0 and plan["fits"] and plan["drafter"] == "split" and plan["max_batch"] == 4
    assert set(plan["per_rank_bytes"]) == set(KINDS) and plan["total_per_rank"] == sum(plan["per_rank_bytes"].values())
    code, out, err = plan_cli(capsys, *args, "--gpus", "3")
    assert code == 2 and not json.loads(out)["fits"] and err.count("\n") == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "random:tiny", "--gpus", "1", "--gpu-memory", "lots"], "--gpu-memory: 'lots' is not a size"),
        (["--model", "/no/such/model", "--gpus", "1", "--gpu-memory", "80GB"], "model not found"),
        (["--model", "random:nope", "--gpus", "1", "--gpu-memory", "80GB"], "unknown random shape"),
        (["--model", "random:tiny", "--gpus", "0", "--gpu-memory", "80GB"], "--gpus must be >= 1"),
        (
            ["--model", "random:tiny", "--gpus", "1", "--gpu-memory", "80GB", "--kv-cache-tokens", "0"],
            "--kv-cache-tokens must be >= 1",
        ),
        (
            ["--model", "random:tiny", "--gpus", "1", "--gpu-memory", "80GB", "--gpu-memory-utilization", "0"],
            "--gpu-memory-utilization must be more than 0 and at most 1, got 0.0",
        ),
        (
            ["--model", "random:tiny", "--gpus", "1", "--gpu-memory", "80GB", "--kv-cache-tokens", "4096"]
            + ["--gpu-memory-utilization", "0.5"],
            "give --kv-cache-tokens or --gpu-memory-utilization, not both",
        ),
    ],
)
def test_plan_command_bad_input_is_one_line_exit_2(capsys, args, needle):
    code, out, err = plan_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and needle in err


def test_plan_command_through_python_m_ddtree():
    r = subprocess.run(
        [sys.executable, "-m", "ddtree", "plan", "--model", "random:qwen3-8b", "--drafter", "random:1"]
        + ["--gpus", "2", "--gpu-memory", "80GB", "--max-batch", "16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "drafter: split" in r.stdout and "fits: " in r.stdout


def test_the_memory_module_imports_no_torch():
    code = "import sys, ddtree.models.memory; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def share_config(share: float, device: str, max_seq_len: int = 512) -> EngineConfig:
    serving = {"max_batch_size": 4, "max_seq_len": max_seq_len, "gpu_memory_utilization": share}
    data = {"model": {"id": "random:tiny", "device": device}, "speculation": {"method": "ar"}, "serving": serving}
    return EngineConfig.from_dict(data).resolve(default_drafter=False)


def test_a_share_of_gpu_memory_needs_a_cuda_device():
    with pytest.raises(ConfigError, match="serving.gpu_memory_utilization sizes the KV cache from GPU memory"):
        pool_within_memory(share_config(0.9, "cpu"), "cpu", 1, 4, 512)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_share_of_the_gpu_is_the_pool_the_engine_allocates():
    """On the GPU, the engine's pool is the plan's for that share (the GPU being free enough), its memory
    stays within the share, and a share that cannot hold one request is refused at start-up."""
    from ddtree.runtime.build import build_engine

    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    engine, _ = build_engine(share_config(0.3, "cuda"))
    plan = plan_memory(
        random_hf_config("tiny"), gpus=1, gpu_memory=total, max_context=512, max_batch=4, gpu_memory_utilization=0.3
    )
    assert engine.page_pool.pages * PAGE_SIZE == plan.pool_slots > 4 * 512
    assert torch.cuda.memory_allocated() <= 0.3 * total
    del engine
    torch.cuda.empty_cache()
    kv = plan.per_rank_bytes["kv_cache"] + plan.per_rank_bytes["drafter_kv_cache"]
    room = plan.total_per_rank - kv + 300 * plan.kv_bytes_per_token  # 300 tokens of cache past the rest
    with pytest.raises(ConfigError, match="max_context 512 is more than the KV cache pool of 288 tokens"):
        build_engine(share_config(room / total, "cuda"))


def test_the_readmes_kimi_plan_is_what_the_command_prints(capsys):
    """README.md shows `ddtree plan` for Kimi K2.6 on 8 H200s, command and output: they must not drift."""
    import pathlib
    import re
    import shlex

    from ddtree.cli import main

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"```\n\$ (ddtree plan .*?)\n(memory plan:.*?)\n```", readme, re.S)
    assert block, "README.md shows a `$ ddtree plan` block"
    command, shown = block.group(1).replace("\\\n", " "), block.group(2)
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out.rstrip("\n") == shown
