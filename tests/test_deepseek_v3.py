"""The DeepSeek-V3 / Kimi K2 family (models/deepseek_v3.py): MLA over the latent cache and DeepSeek MoE equal
transformers' own DeepseekV3ForCausalLM (prefill and decode, fp32), tree verify and compaction on the latent
cache, greedy speculative decoding equals plain decoding, tensor parallelism equals one rank, YaRN equals
transformers', and the published configs parse with every field accounted for."""

import json
import pathlib

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ddtree.models.deepseek_v3 import LatentCache, ModelConfig, Transformer
from ddtree.models.layers import rope_attention_factor, rope_inv_freq
from ddtree.models.registry import config_from_hf, family_for, load_pretrained
from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.runtime.pages import PAGE_SIZE
from ddtree.runtime.parallel import check_divisible, launch, split
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from ddtree.speculative.tree import build_ddtree
from ddtree.speculative.verify import tree_mask

CONFIGS = pathlib.Path(__file__).parent / "data" / "model_configs"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
ATOL = RTOL = 1e-4  # fp32 logits against transformers (|logits| up to about 6; seen: at most 2e-5)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}


def causal(n):
    j = torch.arange(n)
    return (j[:, None] >= j[None, :])[None, None]


# ---- against transformers ------------------------------------------------------------------------


def hf_model(q_lora_rank=24, rope=None, interleave=True, tie=False, bias=False, layers=3, seed=0, **sizes):
    """A tiny DeepseekV3ForCausalLM with the real feature flags on: 8 routed experts in 4 groups (2 chosen),
    2 shared experts, a dense first layer, YaRN with mscale_all_dim; weights std 0.2 (transformers' 0.02
    would leave every logit near 0) and a random routing correction bias. sizes: other config fields."""
    torch.manual_seed(seed)
    rope = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8} if rope is None else rope
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=24,
        max_position_embeddings=256,  # = factor x original: no implicit-factor warning
        rope_interleave=interleave,
        tie_word_embeddings=tie,
        attention_bias=bias,
        rope_parameters={**rope, "rope_theta": 10000.0},
    )
    cfg = transformers.DeepseekV3Config(**{**fields, **sizes})
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.2)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    return model


def as_kimi_k25(folder: pathlib.Path) -> None:
    """Rewrite a saved DeepseekV3ForCausalLM as Kimi K2.5 publishes it: the text config (4.x layout, model_type
    kimi_k2) nested under text_config, weights under language_model., plus vision tensors to be skipped."""
    text = json.loads((folder / "config.json").read_text())
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    for key in ("head_dim", "qk_head_dim", "rope_interleave", "dtype"):
        text.pop(key)
    text.update(
        model_type="kimi_k2",
        rope_scaling=rope,
        num_nextn_predict_layers=0,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
        aux_loss_alpha=0.001,
        seq_aux=True,
        ep_size=1,
        do_sample=False,
        top_k=50,
        torch_dtype="float32",
    )
    outer = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": 127,
        "media_placeholder_token_id": 100,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"patch_size": 14, "vt_hidden_size": 8},
    }
    (folder / "config.json").write_text(json.dumps(outer))
    state = load_file(folder / "model.safetensors")
    state = {"language_model." + k: v for k, v in state.items()}
    state["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(24, 8)
    state["mm_projector.proj.0.weight"] = torch.zeros(8, 8)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def add_mtp_layer(folder: pathlib.Path, layers: int) -> None:
    """A multi-token-prediction layer after the last one (as published DeepSeek-V3 has): skipped on load."""
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    state = load_file(folder / "model.safetensors")
    state[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
    state[f"model.layers.{layers}.self_attn.kv_b_proj.weight"] = torch.zeros(160, 32)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


VARIANTS = {
    "deepseek_v3": dict(),  # q low-rank, YaRN with mscale 1 / mscale_all_dim 0.8 (cos/sin factor 1.0244)
    "q_proj-tied-bias": dict(q_lora_rank=None, tie=True, bias=True),
    "plain-rope-not-interleaved": dict(rope={"rope_type": "default"}, interleave=False),
    "yarn-mscale-equal": dict(rope={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}),  # as DeepSeek-V3 / Kimi
    "kimi_k25": dict(rope={**YARN, "beta_fast": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    """Written by transformers' save_pretrained, loaded through the registry: logits within 1e-4 (fp32) for
    a 16-token prefill of two sequences and 4 decode steps, and the tapped layer outputs likewise."""
    hf = hf_model(**VARIANTS[variant])
    hf.save_pretrained(tmp_path)
    if variant == "kimi_k25":
        as_kimi_k25(tmp_path)
    else:
        add_mtp_layer(tmp_path, hf.config.num_hidden_layers)
    ours = load_pretrained(tmp_path, torch.float32, "cpu")
    assert type(ours) is Transformer and ours.config.model_type == (
        "kimi_k25" if variant == "kimi_k25" else "deepseek_v3"
    )
    ours.setup_caches(max_batch=2, max_slots=32)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    j = torch.arange(20)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, taps = ours(ids[:, :16], j[:16].expand(2, -1), j[:16].expand(2, -1), causal(16), tap_layers=(1, 0))
        torch.testing.assert_close(logits, ref.logits[:, :16], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(taps[..., :64], ref.hidden_states[2][:, :16], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(taps[..., 64:], ref.hidden_states[1][:, :16], atol=ATOL, rtol=RTOL)
        for t in range(16, 20):
            step, _ = ours(
                ids[:, t : t + 1], j[t : t + 1].expand(2, -1), j[t : t + 1].expand(2, -1), causal(t + 1)[..., -1:, :]
            )
            torch.testing.assert_close(step[:, 0], ref.logits[:, t], atol=ATOL, rtol=RTOL)


def test_yarn_equals_transformers():
    """Inverse frequencies bit for bit and the cos/sin attention factor of transformers' YaRN, for the
    published DeepSeek-V3 / Kimi dicts and for mscale != mscale_all_dim and truncate off; a family whose
    attention does not apply that factor is refused rather than silently wrong."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    published = {name: config_from_hf(json.loads((CONFIGS / f"{name}.json").read_text())) for name in PUBLISHED}
    cases = [(c.rope_scaling, c.rope_theta, c.max_position_embeddings) for c in published.values() if c.rope_scaling]
    cases += [
        ({**YARN, "mscale": 0.9, "mscale_all_dim": 0.707}, 10000.0, 256),
        ({**YARN, "truncate": False}, 10000.0, 256),
    ]
    assert len(cases) == 6
    for scaling, theta, max_positions in cases:
        cfg = transformers.DeepseekV3Config(
            qk_rope_head_dim=64, max_position_embeddings=max_positions, rope_parameters={**scaling, "rope_theta": theta}
        )
        inv_freq, factor = _compute_yarn_parameters(cfg)
        assert torch.equal(rope_inv_freq(64, theta, scaling, applies_attention_factor=True), inv_freq), scaling
        assert rope_attention_factor(scaling) == factor, scaling
    with pytest.raises(ValueError, match="attention factor 1.13863"):
        rope_inv_freq(64, 10000.0, YARN)  # no mscale: factor mscale(4) = 1.1386
    equal = {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}  # factor 1: no cos/sin scale to apply, so accepted
    assert torch.equal(rope_inv_freq(64, 1e4, equal), rope_inv_freq(64, 1e4, equal, applies_attention_factor=True))


def test_router_correction_bias_stays_fp32_and_unsupported_quantization_is_refused(tmp_path):
    hf = hf_model(layers=2)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, torch.bfloat16, "cpu")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    model.to(torch.float16)
    assert gate.e_score_correction_bias.dtype == torch.float32
    # a supported quantization_config loads (here over bf16 tensors: nothing to dequantize); others are refused
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert config_from_hf(config).quantization["quant_method"] == "fp8"
    load_pretrained(tmp_path, torch.float32, "cpu")
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = r"unsupported quantization: compressed-tensors nvfp4-pack-quantized \(supported: "
    with pytest.raises(ValueError, match=message):
        load_pretrained(tmp_path, torch.float32, "cpu")
    # quantized tensors without a quantization_config are refused too, not cast
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match="o_proj.weight_scale_inv' is quantized but the config has no quantization_config"
    ):
        load_pretrained(tmp_path, torch.float32, "cpu")


# ---- the latent cache under the engine ----------------------------------------------------------


def tiny_mla(seed=0, scale=0.3, **overrides) -> Transformer:
    """A tiny random MLA target (YaRN as DeepSeek-V3 sets it: mscale = mscale_all_dim = 1), with peaked
    enough logits that greedy choices are stable."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        rope_scaling={**YARN, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0},
        max_position_embeddings=128,
    )
    model = Transformer(ModelConfig(**{**fields, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.normal_(0, scale)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def mla():
    return tiny_mla()


@pytest.fixture(scope="module")
def mla_drafter(mla):
    return init_drafter(DrafterConfig.for_target(mla.config, num_layers=1, block_size=8), seed=0)


def test_tree_nodes_equal_their_ancestor_paths(mla):
    """Tree verify on the latent cache (slots L.., positions L + depth, ancestor mask): every node's logits
    equal those of its ancestor path run as a plain causal sequence."""
    m, vocab = mla, mla.config.vocab_size
    prefix = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(2))
    tree = build_ddtree(torch.tensor([4]), 2 * torch.randn(1, 5, vocab, generator=torch.Generator().manual_seed(0)), 24)
    L, n = prefix.shape[1], tree.size
    m.setup_caches(max_batch=1, max_slots=64)
    j = torch.arange(L)
    with torch.no_grad():
        m(prefix, j[None], j[None], causal(L))
        logits, _ = m(
            tree.tokens, L + tree.depth, L + torch.arange(n)[None], tree_mask(torch.tensor([L]), tree.visible, L + n)
        )
        assert n == 25 and int(tree.depth.max()) == 3 and int((tree.depth == 1).sum()) > 1  # branches and depth
        for i in range(n):
            path, k = [], i
            while k >= 0:
                path.append(tree.tokens[0, k].item())
                k = tree.parents[0, k].item()
            seq = torch.cat([prefix, torch.tensor([path[::-1]])], dim=1)
            t = seq.shape[1]
            m.setup_caches(max_batch=1, max_slots=64)
            ref, _ = m(seq, torch.arange(t)[None], torch.arange(t)[None], causal(t))
            torch.testing.assert_close(logits[0, i], ref[0, -1], atol=1e-4, rtol=1e-4)


def test_latent_cache_layout_and_compaction_over_many_rounds_equals_fresh_prefill(mla, mla_drafter):
    """One buffer [layers, physical slots + 1, kv_lora_rank + qk_rope_head_dim]; after 12 rounds that accept
    long paths (an oracle drafter), each row's cache equals a fresh prefill of its committed text."""
    from test_engine import OracleEngine

    ref = Engine(mla, None, "ar", max_batch_size=3, max_seq_len=128).generate(
        PROMPTS, SamplingParams(max_new_tokens=80)
    )
    full = [p + r.token_ids for p, r in zip(PROMPTS, ref)]
    eng = OracleEngine(mla, mla_drafter, "ddtree", 16, max_batch_size=3, max_seq_len=128, continuations=full)
    assert tuple(mla.latent_storage.shape) == (3, eng.page_pool.pages * PAGE_SIZE + 1, 32 + 16)
    assert all(isinstance(layer.self_attn.cache, LatentCache) for layer in mla.model.layers)
    emitted = [[eng.add(i, p, SamplingParams(max_new_tokens=80))] for i, p in enumerate(PROMPTS)]
    for _ in range(12):
        for i, toks in enumerate(eng.step(3)):
            emitted[i] += toks
    assert min(len(e) for e in emitted) > 12 + 12, "rounds must have accepted several tokens"
    assert [p + e for p, e in zip(PROMPTS, emitted)] == [
        f[: len(p) + len(e)] for f, p, e in zip(full, PROMPTS, emitted)
    ]
    cache = [[layer.self_attn.cache.row(i, eng.host_lengths[i]) for layer in mla.model.layers] for i in range(3)]
    for i, p in enumerate(PROMPTS):
        text = p + emitted[i][:-1]  # the last emitted token is the pending bonus, not yet in the cache
        assert eng.host_lengths[i] == len(text)
        fresh = Engine(mla, None, "ar", max_batch_size=1, max_seq_len=128)
        fresh.add(0, text, SamplingParams(max_new_tokens=1))
        fresh_cache = [layer.self_attn.cache.row(0, len(text)) for layer in mla.model.layers]
        torch.testing.assert_close(cache[i], fresh_cache, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "method,budget", [("dflash", None), ("ddtree", 1), ("ddtree", 4), ("ddtree", 32), ("ddtree", 64)]
)
def test_greedy_equals_ar_random_drafter(mla, mla_drafter, method, budget):
    """Greedy dflash / ddtree with a random-init drafter emit exactly plain decoding's tokens, batch 3 and 1."""
    sp = SamplingParams(max_new_tokens=24)
    ref = [r.token_ids for r in Engine(mla, None, "ar", max_batch_size=3, max_seq_len=64).generate(PROMPTS, sp)]
    eng = Engine(mla, mla_drafter, method, budget, max_batch_size=3, max_seq_len=64)
    assert [r.token_ids for r in eng.generate(PROMPTS, sp)] == ref
    assert [eng.generate([p], sp)[0].token_ids for p in PROMPTS] == ref


@pytest.mark.parametrize(
    "overrides, fused",
    [
        (dict(), True),  # q_a_proj and kv_a_proj_with_mqa
        (dict(attention_bias=True), True),  # with their biases
        (dict(q_lora_rank=None), True),  # q_proj and kv_a_proj_with_mqa
        (dict(q_lora_rank=None, attention_bias=True), False),  # q_proj has no bias, kv_a has one: apart
    ],
)
def test_torch_backend_projects_q_and_the_latent_in_one_gemm(overrides, fused):
    """On the torch backend MLA's two input projections become views of one weight (and bias): the
    logits and the state dict are the reference's, and moving the model turns the module back."""
    from ddtree.runtime.fused import FusedLatentAttention, use_backend

    target = tiny_mla(seed=5, **overrides)
    ids = torch.tensor([PROMPTS[2]])
    n = ids.shape[1]
    j = torch.arange(n)[None]

    def run() -> torch.Tensor:
        target.setup_caches(1, n)
        with torch.no_grad():
            return target(ids, j, j, causal(n))[0]

    expect, state = run(), {k: v.clone() for k, v in target.state_dict().items()}
    use_backend(target, "torch")
    attn = target.model.layers[1].self_attn
    assert isinstance(attn, FusedLatentAttention) and (attn.w_a is not None) == fused
    if fused:
        q = attn.q_a_proj if attn.low_rank_q else attn.q_proj
        assert q.weight.data_ptr() == attn.w_a.data_ptr()
        assert attn.kv_a_proj_with_mqa.weight.data_ptr() == attn.w_a[q.out_features :].data_ptr()
    torch.testing.assert_close(run(), expect, atol=1e-5, rtol=1e-5)
    assert target.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in target.state_dict().items())
    target.to(torch.float64)
    assert type(target.model.layers[1].self_attn) is not FusedLatentAttention and attn.w_a is None


def check_triton_backend(device: str, through_sdpa: bool, monkeypatch) -> None:
    """On the Triton backend MLA attends through mla_kernels.latent_attention (or, past
    TritonLatentAttention.max_tokens query tokens, SDPA over gathered latents): a prefill and a tree verify
    over rows in reverse order give the reference's logits (fp32), and greedy ddtree and dflash emit plain
    decoding's tokens; on a GPU also from CUDA graphs, which the smoke test then passes."""
    from ddtree.runtime.fused import TritonGroupLimitedSigmoid, TritonLatentAttention, TritonMoE, use_backend
    from ddtree.runtime.smoke import run_smoke

    if through_sdpa:
        monkeypatch.setattr(TritonLatentAttention, "max_tokens", 0)
    target = tiny_mla(seed=4).to(device)
    prefix = torch.randint(0, target.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    tree = build_ddtree(torch.tensor([4, 6]), 2 * torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(6)), 16)
    L, n = prefix.shape[1], tree.size
    rows = torch.tensor([1, 0], device=device)

    def logits(backend: str) -> torch.Tensor:
        use_backend(target, backend)
        target.setup_caches(max_batch=2, max_slots=32)
        j = torch.arange(L, device=device).expand(2, -1)
        verify_mask = tree_mask(torch.tensor([L, L]), tree.visible, L + n).to(device)
        with torch.no_grad():
            first, _ = target(prefix.flip(0).to(device), j, j, causal(L).expand(2, 1, L, L).to(device), rows=rows)
            slots = (L + torch.arange(n)).expand(2, -1).to(device)
            second, _ = target(tree.tokens.to(device), (L + tree.depth).to(device), slots, verify_mask, rows=rows)
        return torch.cat([first, second], dim=1)

    expect = logits("reference")
    got = logits("triton")
    assert isinstance(target.model.layers[0].self_attn, TritonLatentAttention)
    moe = [m for m in target.modules() if isinstance(m, TritonMoE)]
    assert moe and all(isinstance(m.gate, TritonGroupLimitedSigmoid) for m in moe)
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    if through_sdpa:
        return  # the rounds below attend through the kernel (up to 33 tokens)
    sp = SamplingParams(max_new_tokens=12)
    plain = Engine(target, None, "ar", max_batch_size=3, max_seq_len=64).generate(PROMPTS, sp)
    drafter = init_drafter(DrafterConfig.for_target(target.config, num_layers=1, block_size=8), seed=1).to(device)
    use_backend(target, "reference")
    ref = Engine(target, None, "ar", max_batch_size=3, max_seq_len=64).generate(PROMPTS, sp)
    assert [r.token_ids for r in plain] == [r.token_ids for r in ref]
    use_backend(target, "triton")
    for method, budget in (("ddtree", 12), ("dflash", None)):
        eng = Engine(target, drafter, method, budget, max_batch_size=3, max_seq_len=64)
        assert [r.token_ids for r in eng.generate(PROMPTS, sp)] == [r.token_ids for r in ref], method
        if device == "cuda":
            eng.capture_graphs([1, 2, 3], [128])
            rounds = eng.eager_rounds
            assert [r.token_ids for r in eng.generate(PROMPTS, sp)] == [r.token_ids for r in ref], method
            assert eng.eager_rounds == rounds, "every round replays a graph"
            report = run_smoke(eng, [1, 2, 3], PROMPTS, max_new_tokens=6)
            assert report.passed and report.mode == "cuda-graphs", report.reason


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("through_sdpa", [False, True])
def test_triton_backend_equals_the_reference_and_stays_lossless(monkeypatch, through_sdpa):
    check_triton_backend("cpu", through_sdpa, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)")
@pytest.mark.parametrize("through_sdpa", [False, True])
def test_compiled_triton_backend_equals_the_reference_and_replays_losslessly(monkeypatch, through_sdpa):
    check_triton_backend("cuda", through_sdpa, monkeypatch)


# ---- tensor parallelism --------------------------------------------------------------------------

TP_METHODS = [("ar", None), ("dflash", None), ("ddtree", 8)]


def tp_outputs(rank, world):
    """Prefill logits of two targets (q low-rank with biases; plain q_proj) and the tokens of ar / dflash /
    ddtree with a random drafter, split over `world` ranks (world 1: unsplit)."""
    torch.set_num_threads(1)
    out = {}
    for name, overrides in (("q_lora", dict(attention_bias=True)), ("q_proj", dict(q_lora_rank=None))):
        target = tiny_mla(seed=3, **overrides)
        drafter = init_drafter(DrafterConfig.for_target(target.config, num_layers=2, block_size=8), seed=1)
        if world > 1:
            # the drafter's 1 KV head does not split over 2: it runs whole on every rank
            assert split(target, drafter, rank, world) == "replicated"
            attn, moe = target.model.layers[1].self_attn, target.model.layers[1].mlp
            assert (attn.n_heads, len(moe.experts), moe.shared_experts.gate_proj.weight.shape[0]) == (2, 4, 16)
            assert attn.kv_a_proj_with_mqa.weight.shape[0] == 48, "the latent projections stay whole"
        ids = torch.tensor([PROMPTS[2] * 2])
        j = torch.arange(ids.shape[1])
        target.setup_caches(1, ids.shape[1])
        with torch.no_grad():
            out[name] = target(ids, j[None], j[None], causal(ids.shape[1]))[0].tolist()  # no tensors across processes
        if name == "q_lora":
            for method, budget in TP_METHODS:
                eng = Engine(target, drafter, method, budget, max_batch_size=3, max_seq_len=96)
                out[method] = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(max_new_tokens=16))]
    return out


def test_tp2_equals_tp1_over_gloo():
    """Heads, experts, shared experts and dense MLPs split over 2 ranks (one all-reduce per block), the
    latent cache replicated: the same logits (1e-5) and exactly the same tokens as one rank."""
    expected = tp_outputs(0, 1)
    got = launch(2, tp_outputs)
    for name in ("q_lora", "q_proj"):
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(expected[name]), atol=1e-5, rtol=1e-5)
    for method, _ in TP_METHODS:
        assert got[method] == expected[method], method


def tp8_tokens(rank, world):
    """Greedy ar and ddtree tokens of a Kimi-like target (8 heads, 8 experts in one group, 1 of each a rank
    over 8) with its drafter split too, over `world` ranks."""
    torch.set_num_threads(1)
    target = tiny_mla(seed=5, num_attention_heads=8, n_group=1, topk_group=1)
    drafter = init_drafter(DrafterConfig.for_target(target.config, num_layers=1, block_size=8), seed=1)
    if world > 1:
        split(target, drafter, rank, world, replicate_drafter=True)
        attn, moe = target.model.layers[1].self_attn, target.model.layers[1].mlp
        assert (attn.n_heads, len(moe.experts), moe.first_expert) == (8 // world, 8 // world, rank * 8 // world)
    out = {}
    for method, budget in (("ar", None), ("ddtree", 8)):
        eng = Engine(target, drafter, method, budget, max_batch_size=3, max_seq_len=64)
        out[method] = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(max_new_tokens=12))]
    return out


@pytest.mark.slow
def test_tp8_equals_tp1_over_gloo():
    """Kimi K2's split over 8 ranks, as on one 8-GPU node: one head and one routed expert a rank, every
    all-reduce and the logits all-gather over 8 (gloo). Exactly the one-rank tokens, and ddtree's are ar's."""
    expected = tp8_tokens(0, 1)
    assert expected["ddtree"] == expected["ar"]
    assert launch(8, tp8_tokens) == expected


# ---- configs -------------------------------------------------------------------------------------

PUBLISHED = ["deepseek-v3", "kimi-k2-instruct", "kimi-k2.5", "kimi-k2.6"]


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_parse_with_every_field_accounted_for(name):
    """The published config.json files (tests/data/model_configs, SOURCES.md) parse: from_hf refuses any
    field it neither uses, checks nor lists as harmless, so parsing is the accounting. The derived sizes:
    the 576-value latent, the YaRN softmax scale, tensor parallelism over 8 ranks, and a drafter shaped like
    the published Kimi-K2.5 DFlash drafter (64 heads of 128, 8 KV heads)."""
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    assert family_for(raw).name == "deepseek_v3"
    cfg = config_from_hf(raw)
    text = raw.get("text_config", raw)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (7168, 61, text["vocab_size"])
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192 and cfg.q_lora_rank == 1536
    assert cfg.rope_scaling["factor"] == text["rope_scaling"]["factor"] and cfg.rope_interleave
    mscale = 0.1 * torch.log(torch.tensor(float(cfg.rope_scaling["factor"]))).item() + 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert rope_attention_factor(cfg.rope_scaling) == 1.0
    assert cfg.quantization["quant_method"] in ("fp8", "compressed-tensors")
    assert cfg.eos_token_ids == [text["eos_token_id"]] and cfg.bos_token_id == text["bos_token_id"]
    check_divisible(cfg, 8)
    drafter = DrafterConfig.for_target(cfg, num_layers=6)
    kimi = name != "deepseek-v3"
    assert (drafter.num_attention_heads, drafter.num_key_value_heads, drafter.head_dim) == (
        (64, 8, 128) if kimi else (128, 16, 128)
    )
    assert drafter.rope_scaling == cfg.rope_scaling and drafter.rope_theta == cfg.rope_theta
    if kimi:  # the published drafter for Kimi K2.5 has the same attention shape and RoPE
        published = json.loads((CONFIGS / "dflash-kimi-k2.5.json").read_text())
        assert (published["num_attention_heads"], published["num_key_value_heads"], published["head_dim"]) == (
            64,
            8,
            128,
        )
        assert published["rope_theta"] == cfg.rope_theta
        assert (cfg.n_routed_experts, cfg.n_group, cfg.first_k_dense_replace) == (384, 1, 1)


def test_partial_kimi_k2_thinking_config_parses_its_sizes():
    """kimi-k2-thinking.json is partial (SOURCES.md): its sizes parse, but it lacks the YaRN dict, so its RoPE
    here is plain, not the published model's."""
    cfg = config_from_hf(json.loads((CONFIGS / "kimi-k2-thinking.json").read_text()))
    assert (cfg.num_attention_heads, cfg.n_routed_experts, cfg.rms_norm_eps, cfg.routed_scaling_factor) == (
        64,
        384,
        1e-5,
        2.827,
    )
    assert cfg.rope_scaling is None and cfg.eos_token_ids == []


@pytest.mark.parametrize(
    "where,change,message",
    [
        ("deepseek-v3", {"routed_scaling_exponent": 2.0}, r"config field 'routed_scaling_exponent' is not known"),
        ("deepseek-v3", {"topk_method": "greedy"}, r"config field 'topk_method' is 'greedy': only 'noaux_tc'"),
        ("deepseek-v3", {"scoring_func": "softmax"}, r"config field 'scoring_func' is 'softmax'"),
        ("deepseek-v3", {"hidden_act": "gelu"}, r"config field 'hidden_act' is 'gelu'"),
        ("deepseek-v3", {"moe_layer_freq": 2}, r"config field 'moe_layer_freq' is 2"),
        ("deepseek-v3", {"num_key_value_heads": 8}, r"config field 'num_key_value_heads' is 8"),
        ("deepseek-v3", {"rope_scaling": {**YARN, "rope_type": "longrope"}}, r"'rope_scaling.rope_type' is 'longrope'"),
        ("deepseek-v3", {"rope_scaling": {**YARN, "short_factor": [1]}}, r"'rope_scaling.short_factor' is not known"),
        ("kimi-k2.5 text", {"use_qk_norm": True}, r"text_config config field 'use_qk_norm' is not known"),
        ("kimi-k2.5", {"image_size_scale": 2}, r"kimi_k25 outer config field 'image_size_scale' is not known"),
    ],
    ids=[
        "unknown",
        "topk_method",
        "scoring_func",
        "hidden_act",
        "moe_layer_freq",
        "kv_heads",
        "rope_type",
        "rope_key",
        "kimi-text-unknown",
        "kimi-outer-unknown",
    ],
)
def test_unknown_or_unimplemented_fields_are_refused_by_name(where, change, message):
    raw = json.loads((CONFIGS / f"{where.split()[0]}.json").read_text())
    (raw["text_config"] if where.endswith("text") else raw).update(change)
    with pytest.raises(ValueError, match=message):
        config_from_hf(raw)


def test_registry_and_tensor_parallel_sizes():
    from ddtree.models import deepseek_v3

    assert all(family_for({"model_type": t}).load() is deepseek_v3 for t in ("deepseek_v3", "kimi_k2", "kimi_k25"))
    cfg = config_from_hf(json.loads((CONFIGS / "kimi-k2-instruct.json").read_text()))
    assert cfg.split_sizes() == {
        "attention heads": 64,
        "vocabulary": 163840,
        "MLP width": 18432,
        "routed experts": 384,
        "shared experts width": 2048,
    }
    with pytest.raises(
        ValueError, match=r"does not divide the model: 64 attention heads, 163840 vocabulary, 2048 shared"
    ):
        check_divisible(cfg, 3)


def test_drafter_training_reads_the_target_features_of_an_mla_target(mla):
    """training.recipe.target_features on the latent cache: the taps of one causal forward, whatever
    the inference-mode cache an Engine left behind."""
    from ddtree.training.recipe import target_features

    tokens = torch.randint(0, mla.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        mla.setup_caches(1, 4)  # an inference cache, too small: training makes its own
    features = target_features(mla, tokens, [0, 2])
    j = torch.arange(12)
    mla.setup_caches(2, 12)
    with torch.no_grad():
        _, taps = mla(tokens, j.expand(2, -1), j.expand(2, -1), causal(12).expand(2, 1, 12, 12), (0, 2))
    torch.testing.assert_close(features, taps)


@pytest.mark.slow
def test_ddtree_sampling_matches_ar_on_mla_and_experts():
    """T > 0 is lossless on the latent cache and routed experts too: the tokens `ddtree` samples at
    verify rounds are distributed as `ar`'s (the chi-square test and its sample size of test_sampling.py,
    whose control shows the statistic rejects T=0.8 against T=1)."""
    from test_sampling import ROUNDS, chi_square_p_value, emitted_pairs

    target = tiny_mla(seed=1, scale=0.25, vocab_size=8, hidden_size=32)
    drafter = init_drafter(DrafterConfig.for_target(target.config, num_layers=1, block_size=4), seed=2)
    # one engine at a time: an engine sets up its target's caches (and slot map) for itself
    a = emitted_pairs(Engine(target, None, "ar", max_batch_size=64, max_seq_len=16), ROUNDS, 1000, {"temperature": 1.0})
    tree = Engine(target, drafter, "ddtree", 12, max_batch_size=64, max_seq_len=32)
    b = emitted_pairs(tree, ROUNDS, 5000, {"temperature": 1.0})
    assert len(a) > 10, "the test needs a spread-out distribution"
    assert chi_square_p_value(a, b) > 1e-3
    # with 8 tokens and budget 12 the tree holds every depth-1 token: drafts are accepted
    accepted = tree.generate([[1, 2, 3]] * 64, SamplingParams(max_new_tokens=3, seed=7, temperature=1.0))
    assert sum(r.acceptance_length for r in accepted) / 64 > 1.5
