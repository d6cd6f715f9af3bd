"""Qwen3-MoE (models/qwen3_moe.py): the forward equals transformers' Qwen3MoeForCausalLM through the
static cache, with the reference and the fused MoE; speculative decoding stays lossless; TP=2 (experts
split over the ranks) emits the TP=1 tokens; the published config parses with every field accounted for.
And the DFlash drafters published for MoE targets: sliding-window drafter layers (speculative/drafter.py).

Tolerance: fp32 logits and taps within 1e-4 absolute and relative (as tests/test_model.py), and the fused
MoE within 1e-5 of the reference block."""

import copy
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F

from ddtree.models.moe import SoftmaxTopK, SparseMoE, shard_experts
from ddtree.models.qwen3_moe import ModelConfig, Transformer
from ddtree.models.registry import config_from_hf, load_pretrained
from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.runtime.fused import FusedMoE, swap, use_backend
from ddtree.speculative.drafter import (
    DFlashDrafter,
    DrafterConfig,
    DrafterMismatchError,
    init_drafter,
)

CONFIGS = pathlib.Path(__file__).parent / "data" / "model_configs"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
# the real feature flags, small: experts on every layer but mlp_only_layers' (normalised top-k), and on every
# other layer (decoder_sparse_step 2) but mlp_only_layers' (plain softmax weights)
FLAGS = {
    "norm-step1": dict(
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2]
    ),
    "raw-step2": dict(
        num_experts=4, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3]
    ),
}
LAYERS = {"norm-step1": 4, "raw-step2": 6}
SPARSE = {"norm-step1": [0, 1, 3], "raw-step2": [1, 5]}


def hf_checkpoint(kind: str, folder, scale: float = 0.3) -> torch.nn.Module:
    """transformers' own Qwen3MoeForCausalLM of a tiny config, random weights large enough that greedy
    choices and the routing have clear margins, written with save_pretrained (per-expert names)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS[kind],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        **FLAGS[kind],
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, scale)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module", params=list(FLAGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = hf_checkpoint(request.param, folder)
    return request.param, hf, folder


def causal(n):
    j = torch.arange(n)
    return (j[:, None] >= j[None, :])[None, None]


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_prefill_and_decode_match_transformers(pair, backend):
    """Through the registry; a prefill of 12 tokens, then 4 one-token steps through the static cache, and
    the drafter taps, against transformers' forward over the whole text (batch 2, fp32)."""
    kind, hf, folder = pair
    ours = load_pretrained(folder, torch.float32, "cpu")
    assert type(ours) is Transformer and ours.config.model_type == "qwen3_moe"
    sparse = [i for i, layer in enumerate(ours.model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert sparse == SPARSE[kind]
    use_backend(ours, backend)
    assert all(type(ours.model.layers[i].mlp) is (FusedMoE if backend == "torch" else SparseMoE) for i in sparse)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        ours.setup_caches(max_batch=2, max_slots=32)
        j = torch.arange(12).expand(2, -1)
        logits, taps = ours(ids[:, :12], j, j, causal(12).expand(2, 1, 12, 12), tap_layers=(1, 0))
        torch.testing.assert_close(logits, ref.logits[:, :12], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(taps[..., :64], ref.hidden_states[2][:, :12], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(taps[..., 64:], ref.hidden_states[1][:, :12], atol=1e-4, rtol=1e-4)
        for t in range(12, 16):
            pos = torch.full((2, 1), t)
            step, _ = ours(ids[:, t : t + 1], pos, pos, (torch.arange(t + 1) <= t).expand(2, 1, 1, t + 1))
            torch.testing.assert_close(step[:, 0], ref.logits[:, t], atol=1e-4, rtol=1e-4)


def test_fused_moe_equals_the_reference_and_shares_its_weights():
    """Decode-sized and prefill-sized steps (one pair per tile, and several tiles per expert), a router that
    sends every token to the same expert (its tiles full, the others' nearly empty), k = E; the stacked
    weights are views of the experts' parameters, and the state dict does not change."""
    torch.manual_seed(0)
    for experts, k, tokens, skew in [(8, 2, 1, False), (8, 2, 40, False), (4, 3, 33, False)] + [
        (8, 2, 64, True),
        (4, 4, 7, False),
    ]:
        moe = SparseMoE(SoftmaxTopK(16, experts, k, normalize=True), experts, 16, 12)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.5)
            x = torch.randn(2, tokens, 16)
            if skew:  # expert 1 scores far above the others on every token
                x, moe.gate.weight[1] = x + 3.0, 5.0
                assert (moe.route(x.view(-1, 16))[1] == 1).any(dim=-1).all()
            state = {n: v.clone() for n, v in moe.state_dict().items()}
            ref = moe(x)
            swap(moe, FusedMoE)
            assert isinstance(moe, FusedMoE)
            assert moe.experts[1].up_proj.weight.data_ptr() == moe.w_gate_up[1, 12:].data_ptr()
            torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=1e-5)
            assert all(torch.equal(v, moe.state_dict()[n]) for n, v in state.items())
            swap(moe, SparseMoE)
            assert type(moe) is SparseMoE and moe.w_gate_up is None


def test_fused_moe_shapes_follow_from_the_input_shape_alone():
    """The fused block runs on the meta device, where nothing can read the routing (nonzero and item
    raise there): no routing-dependent shape and no host sync, so a CUDA graph can capture it."""
    with torch.device("meta"):
        moe = SparseMoE(SoftmaxTopK(16, 8, 2, normalize=True), 8, 16, 12)
        swap(moe, FusedMoE)
        for tokens in (1, 33, 300):
            assert moe(torch.randn(3, tokens, 16)).shape == (3, tokens, 16)
        with pytest.raises((NotImplementedError, RuntimeError)):
            torch.randn(4).nonzero()


class SummedRanks:
    """The collectives of one of `world` simulated ranks: outputs are kept, not reduced (summed by the test)."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def all_reduce(self, x):
        return x

    def all_gather_last(self, x):
        raise AssertionError("not used by a MoE block")


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_expert_split_sums_to_the_whole_block(fused):
    """shard_experts: each rank's whole experts (and its slice of shared experts) give partial outputs
    whose sum, the all-reduce, is the unsplit block's."""
    torch.manual_seed(2)
    moe = SparseMoE(SoftmaxTopK(16, 8, 3, normalize=False), 8, 16, 12, shared_inter=24)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
        x = torch.randn(3, 5, 16)
        whole = moe(x)
        for world in (2, 4):
            total = torch.zeros_like(whole)
            for rank in range(world):
                part = copy.deepcopy(moe)
                shard_experts(part, SummedRanks(rank, world))
                assert len(part.experts) == 8 // world and part.first_expert == rank * 8 // world
                if fused:
                    swap(part, FusedMoE)
                total += part(x)
            torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)


def tiny_moe_target(seed=3) -> Transformer:
    """A tiny Qwen3-MoE target built directly (no transformers): sparse layers 1 and 3, dense 0 and 2."""
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=2,
    )
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.eval()


def sliding_drafter_config(target_cfg, window=4, layers=2, block_size=8) -> DrafterConfig:
    cfg = DrafterConfig.for_target(target_cfg, num_layers=layers, block_size=block_size)
    cfg.layer_types = ["sliding_attention"] + ["full_attention"] * (layers - 1)
    cfg.sliding_window = window
    return cfg


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """The norm-step1 checkpoint through the registry, and a random-init drafter."""
    folder = tmp_path_factory.mktemp("engine")
    hf_checkpoint("norm-step1", folder)
    target = load_pretrained(folder, torch.float32, "cpu")
    drafter = init_drafter(DrafterConfig.for_target(target.config, num_layers=1, block_size=8), seed=0)
    return target, drafter


@pytest.mark.parametrize(
    "method,budget,sliding",
    [("dflash", None, False), ("ddtree", 1, False), ("ddtree", 4, False), ("ddtree", 32, False)]
    + [("ddtree", 64, False), ("ddtree", 8, True)],
)
def test_greedy_equals_ar(moe_pair, method, budget, sliding):
    """Greedy `dflash` and `ddtree` emit `ar`'s tokens, batch 3 and each prompt alone (the engine runs the
    fused MoE); `sliding`: a drafter whose first layer has a window of 4 positions."""
    target, drafter = moe_pair
    if sliding:
        drafter = init_drafter(sliding_drafter_config(target.config), seed=1)
    sp = SamplingParams(max_new_tokens=20)
    ref = Engine(target, None, "ar", max_batch_size=3, max_seq_len=64).generate(PROMPTS, sp)
    eng = Engine(target, drafter, method, budget, max_batch_size=3, max_seq_len=64)
    assert any(isinstance(layer.mlp, FusedMoE) for layer in target.model.layers)
    assert [r.token_ids for r in eng.generate(PROMPTS, sp)] == [r.token_ids for r in ref]
    assert [eng.generate([p], sp)[0].token_ids for p in PROMPTS] == [r.token_ids for r in ref]


METHODS = [("ar", None), ("dflash", None), ("ddtree", 8)]


def generate_all(target, drafter):
    out = {}
    for method, budget in METHODS:
        eng = Engine(target, drafter, method, budget, max_batch_size=3, max_seq_len=64)
        out[method] = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(max_new_tokens=16))]
    return out


def tp_pair():
    target = tiny_moe_target()
    return target, init_drafter(DrafterConfig.for_target(target.config, num_layers=2, block_size=8), seed=1)


def moe_rank(rank, world):
    from ddtree.runtime.parallel import split

    torch.set_num_threads(1)
    target, drafter = tp_pair()
    assert split(target, drafter, rank, world) == "split"
    moe = target.model.layers[1].mlp
    assert len(moe.experts) == 8 // world and moe.first_expert == rank * 8 // world
    assert target.model.layers[0].mlp.gate_proj.weight.shape[0] == 96 // world
    return generate_all(target, drafter)


def test_tp2_equals_tp1():
    """Gloo, two processes: heads and the dense MLPs split, experts split whole (4 of 8 per rank)."""
    from ddtree.runtime.parallel import launch

    expected = generate_all(*tp_pair())
    assert launch(2, moe_rank) == expected


def test_published_config_parses_with_every_field_accounted_for():
    hf = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    cfg = config_from_hf(hf)
    assert type(cfg) is ModelConfig
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == []
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        48,
        2048,
        32,
        4,
    )
    assert (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.vocab_size) == (128, 1e6, None, 151936)
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.tie_word_embeddings) == ([151645], 151643, False)
    assert all(cfg.is_sparse(i) for i in range(48))
    # all sparse: no dense MLP width to split; KV heads 4 limit tensor parallelism to 4
    assert cfg.split_sizes() == {"attention heads": 32, "KV heads": 4, "experts": 128, "vocabulary": 151936}
    # transformers 5 writes num_local_experts for num_experts
    assert ModelConfig.from_hf({**hf, "num_local_experts": 128}).num_experts == 128
    del hf["num_experts"]
    assert ModelConfig.from_hf({**hf, "num_local_experts": 64}).num_experts == 64


@pytest.mark.parametrize(
    "field,value",
    [
        ("quantization_config", {"quant_method": "fp8"}),
        ("shared_expert_gate", True),
        ("use_sliding_window", True),
        ("hidden_act", "gelu"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
        ("layer_types", ["sliding_attention"] * 48),
        ("shared_expert_intermediate_size", 768),
        ("decoder_sparse_step", 0),
        ("num_experts_per_tok", 129),
    ],
)
def test_a_config_that_changes_the_math_is_refused_by_name(field, value):
    hf = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf({**hf, field: value})


# ---- DFlash drafters for MoE targets: sliding-window layers ------------------------------------------


def test_published_moe_drafter_config_parses_and_fits_its_target():
    """z-lab/Qwen3-Coder-30B-A3B-DFlash (partial copy: no num_target_layers, attention_bias, rope_scaling,
    which default to None, False, None) against Qwen3-30B-A3B's shape."""
    hf = json.loads((CONFIGS / "dflash-qwen3-coder-30b-a3b.json").read_text())
    cfg = DrafterConfig.from_hf(hf)
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.mask_token_id) == (8, 16, 151669)
    assert cfg.target_layer_ids == [1, 12, 23, 34, 45] and cfg.num_target_layers is None
    assert (cfg.layer_types, cfg.sliding_window, cfg.attention_bias, cfg.rope_theta) == (None, None, False, 1e7)
    cfg.check_target(config_from_hf(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())))
    assert "num_target_layers" not in cfg.to_hf()
    # the same drafter with sliding layers, as transformers' Qwen3Config reads them
    sliding = {**hf, "use_sliding_window": True, "sliding_window": 2048, "layer_types": ["sliding_attention"] * 8}
    assert DrafterConfig.from_hf(sliding).layer_window(3) == 2048
    derived = {**hf, "use_sliding_window": True, "sliding_window": 512, "max_window_layers": 6}
    del derived["layer_types"]
    assert [DrafterConfig.from_hf(derived).layer_window(i) for i in range(8)] == [None] * 6 + [512, 512]
    back = DrafterConfig.from_hf(DrafterConfig.from_hf(sliding).to_hf())
    assert back.layer_types == ["sliding_attention"] * 8 and back.sliding_window == 2048


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layer_types": ["sliding_attention"] * 8}, "window is off"),  # no use_sliding_window
        ({"layer_types": ["sliding_attention"] * 8, "use_sliding_window": True}, "window is off"),  # no window
        ({"layer_types": ["chunked_attention"] * 8}, "layer_types"),
        ({"layer_types": ["full_attention"] * 7}, "layer_types"),
        ({"is_causal": "yes"}, "is_causal"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_ambiguous_or_unsupported_drafter_configs_are_refused(change, message):
    hf = json.loads((CONFIGS / "dflash-qwen3-coder-30b-a3b.json").read_text())
    with pytest.raises(DrafterMismatchError, match=message):
        DrafterConfig.from_hf({**hf, **change})


def reference_drafter_forward(d: DFlashDrafter, block, blk_pos, ctx_features, ctx_pos):
    """The drafter without its cache: every layer attends from the block over [context; block] with an
    explicit mask: on its sliding layers (causal by default) key position <= query position and
    query - key < window; everything on its full, bidirectional, ones."""
    ctx = d.hidden_norm(d.fc(ctx_features))
    pos = torch.cat([ctx_pos, blk_pos], dim=1)
    cos_k, sin_k = (t[:, None] for t in ref_rope(d, pos))
    cos_q, sin_q = (t[:, None] for t in ref_rope(d, blk_pos))
    x = block
    for layer in d.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        kv_in = torch.cat([ctx, h], dim=1)
        bs, n, T = h.shape[0], kv_in.shape[1], h.shape[1]
        q = a.q_norm(a.q_proj(h).view(bs, T, -1, a.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(kv_in).view(bs, n, -1, a.head_dim)).transpose(1, 2)
        v = a.v_proj(kv_in).view(bs, n, -1, a.head_dim).transpose(1, 2)
        q, k = rotate(q, cos_q, sin_q), rotate(k, cos_k, sin_k)
        visible = torch.ones(bs, 1, T, n, dtype=torch.bool)
        if layer.sliding_window is not None:
            behind = blk_pos[:, None, :, None] - pos[:, None, None, :]
            assert layer.causal
            visible = (behind >= 0) & (behind < layer.sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        x = x + a.o_proj(out.transpose(1, 2).reshape(bs, T, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return d.norm(x)


def ref_rope(d, positions):
    angles = positions.float()[..., None] * d.inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def test_sliding_window_drafter_layers_equal_an_explicit_mask():
    """A sliding layer (window 5) then a full one, 13 context tokens written in two appends and a block of
    8 through the cache and the engine's mask, against the cache-free forward with explicit masks; the
    window matters (the all-full drafter differs) and a window wider than the text (21 positions) changes
    nothing."""
    target_cfg = tiny_moe_target().config
    g = torch.Generator().manual_seed(0)
    ctx_features = torch.randn(2, 13, 2 * 64, generator=g)
    block = torch.randn(2, 8, 64, generator=g)
    ctx_pos = torch.arange(13).expand(2, -1)
    blk_pos = torch.arange(13, 21).expand(2, -1)
    mask = (torch.arange(32) < 21).expand(2, 1, 8, 32)
    outputs = {}
    for window in (5, None, 21, 64):
        cfg = sliding_drafter_config(target_cfg, window=window or 4, block_size=8)
        cfg.target_layer_ids = [1, 3]
        if window is None:
            cfg.layer_types = cfg.sliding_window = None
        d = init_drafter(cfg, seed=2)
        with torch.no_grad():
            for p in d.parameters():
                if p.dim() > 1:
                    p.mul_(10)  # attention far from uniform, so the masked keys matter
            d.setup_caches(2, 32)
            d.append_context(ctx_features[:, :9], ctx_pos[:, :9], ctx_pos[:, :9])
            got = d(block, blk_pos, blk_pos, mask, ctx_features[:, 9:], ctx_pos[:, 9:], ctx_pos[:, 9:])
            want = reference_drafter_forward(d, block, blk_pos, ctx_features, ctx_pos)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        outputs[window] = got
    assert (outputs[5] - outputs[None]).abs().max() > 1e-2, "the window must change the draft"
    torch.testing.assert_close(outputs[64], outputs[21], atol=1e-5, rtol=1e-5)


@pytest.mark.triton_interpreter
def test_triton_backend_equals_torch():
    """The "triton" backend (its attention, layers and kernels, with the fused MoE) gives the "torch"
    backend's logits for a prefill and a one-token step, and the sliding drafter's Triton attention reads
    the windowed mask as it is."""
    from ddtree.runtime.fused import FusedMoE, TritonMoE, TritonSoftmaxTopK, use_drafter_backend

    target = tiny_moe_target()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for backend in ("torch", "triton"):
        use_backend(target, backend)
        moe = {type(m) for m in target.modules() if isinstance(m, SparseMoE)}
        assert moe == {TritonMoE if backend == "triton" else FusedMoE}  # the grouped GEMM kernels on "triton"
        routers = {type(m.gate) for m in target.modules() if isinstance(m, SparseMoE)}
        assert routers == {TritonSoftmaxTopK if backend == "triton" else SoftmaxTopK}
        target.setup_caches(max_batch=2, max_slots=16)
        j = torch.arange(8).expand(2, -1)
        with torch.no_grad():
            prefill, _ = target(ids[:, :8], j, j, causal(8).expand(2, 1, 8, 8))
            pos = torch.full((2, 1), 8)
            step, _ = target(ids[:, 8:], pos, pos, torch.ones(2, 1, 1, 9, dtype=torch.bool))
        drafter = init_drafter(sliding_drafter_config(target.config, window=3, block_size=4), seed=3)
        use_drafter_backend(drafter, backend)
        drafter.setup_caches(max_batch=2, max_slots=16)
        g = torch.Generator().manual_seed(1)
        ctx = torch.randn(2, 6, drafter.fc.in_features, generator=g)
        pos, blk = torch.arange(6).expand(2, -1), torch.arange(6, 10).expand(2, -1)
        with torch.no_grad():
            draft = drafter(
                torch.randn(2, 4, 64, generator=g), blk, blk, (torch.arange(16) < 10).expand(2, 1, 4, 16), ctx, pos, pos
            )
        results.append((prefill, step, draft))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
