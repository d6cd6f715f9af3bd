"""The native model equals Hugging Face transformers on the architectures we claim."""

import pytest
import torch
import transformers

from ddtree.models.llama import Transformer
from ddtree.models.registry import load_pretrained


def hf_model(kind: str):
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "llama-tied":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=True, **common))
    if kind == "llama3-rope":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(rope_scaling=scaling, rope_theta=500000.0, tie_word_embeddings=False, **common)
        )
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **common))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["llama-tied", "llama3-rope", "qwen2", "qwen3"])
def test_forward_matches_transformers(kind, tmp_path):
    torch.manual_seed(0)
    hf = hf_model(kind).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)  # HF initialises biases to zero, which would hide a missing bias
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded: exercises the index file
    ours = load_pretrained(tmp_path, torch.float32, "cpu")  # through the registry
    assert type(ours) is Transformer and ours.config.model_type == hf.config.model_type
    ours.setup_caches(max_batch=2, max_slots=64)
    ids = torch.randint(0, 300, (2, 40))
    j = torch.arange(40)
    mask = (j[:, None] >= j[None, :]).expand(2, 1, 40, 40)
    with torch.no_grad():
        logits, taps = ours(ids, j.expand(2, -1), j.expand(2, -1), mask, tap_layers=(1, 0))
        ref = hf(ids, output_hidden_states=True)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=1e-4)
    # tap l is the output of decoder layer l (HF hidden_states[l + 1]), concatenated in the order asked
    # (the last HF entry is after the final norm, so only inner layers are compared)
    torch.testing.assert_close(taps[..., :64], ref.hidden_states[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(taps[..., 64:], ref.hidden_states[1], atol=1e-4, rtol=1e-4)


def test_incremental_decode_matches_full_forward(tiny_target):
    """Cache slots and positions: prefill then one token at a time equals one causal pass."""
    m = tiny_target
    m.setup_caches(max_batch=1, max_slots=32)
    ids = torch.randint(0, m.config.vocab_size, (1, 12))
    j = torch.arange(12)
    with torch.no_grad():
        full, _ = m(ids, j[None], j[None], (j[:, None] >= j[None, :])[None, None])
        m.setup_caches(max_batch=1, max_slots=32)
        m(ids[:, :8], j[None, :8], j[None, :8], (j[:8, None] >= j[None, :8])[None, None])
        for t in range(8, 12):
            mask = (torch.arange(t + 1) <= t)[None, None, None]
            step, _ = m(ids[:, t : t + 1], j[None, t : t + 1], j[None, t : t + 1], mask)
            torch.testing.assert_close(step[0, 0], full[0, t], atol=1e-5, rtol=1e-5)


def test_the_registry_maps_model_types_to_families_and_refuses_others():
    from ddtree.models import llama
    from ddtree.models.registry import config_from_hf, family_for

    supported = "deepseek_v3, kimi_k2, kimi_k25, llama, mistral, qwen2, qwen3, qwen3_moe"
    with pytest.raises(ValueError, match=rf"unsupported model_type 'gpt2' \(supported: {supported}\)"):
        config_from_hf({"model_type": "gpt2", "num_attention_heads": 2})
    assert all(family_for({"model_type": t}).load() is llama for t in ("llama", "mistral", "qwen2", "qwen3"))


def test_fused_projections_equal_separate_ones():
    """The fused GEMMs share storage with the HF-named parameters and compute the same logits."""
    from ddtree.runtime.fused import use_backend
    from tiny_models import random_target

    m = random_target(seed=4)
    m.setup_caches(max_batch=1, max_slots=16)
    ids = torch.randint(0, m.config.vocab_size, (1, 10))
    j = torch.arange(10)
    mask = (j[:, None] >= j[None, :])[None, None]
    with torch.no_grad():
        before, _ = m(ids, j[None], j[None], mask)
        state = {k: v.clone() for k, v in m.state_dict().items()}
        use_backend(m, "torch")
        after, _ = m(ids, j[None], j[None], mask)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    attn = m.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.wqkv.data_ptr(), "views, not copies"
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())


def test_moving_a_fused_model_drops_the_stale_fused_weights():
    from ddtree.models.layers import MLP
    from ddtree.models.llama import Attention
    from ddtree.runtime.fused import use_backend
    from tiny_models import random_target

    m = random_target(seed=5)
    use_backend(m, "torch")
    m.to(torch.float64)
    layer = m.model.layers[0]
    assert (type(layer.self_attn), type(layer.mlp), m.backend) == (Attention, MLP, "reference")
    assert not hasattr(layer.self_attn, "wqkv") or layer.self_attn.wqkv is None
    m.setup_caches(max_batch=1, max_slots=8)
    j = torch.arange(4)
    with torch.no_grad():  # the KV cache is one inference buffer for all layers
        logits, _ = m(torch.arange(4)[None], j[None], j[None], (j[:, None] >= j[None, :])[None, None])
    assert logits.dtype == torch.float64
