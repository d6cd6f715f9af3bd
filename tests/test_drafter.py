"""DFlash drafter: z-lab checkpoint layout, round trip, refusal of a drafter that does not fit."""

import json

import pytest
import torch

from ddtree.models.llama import ModelConfig
from ddtree.speculative.drafter import (
    DrafterConfig,
    DrafterMismatchError,
    default_target_layer_ids,
    init_drafter,
    save_drafter,
)
from ddtree.speculative.loading import load_drafter

ZLAB_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.0.{k}.weight"
    for k in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )
}


def test_default_layer_ids_match_published_configs():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B drafter
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Qwen3.5-4B drafter
    assert default_target_layer_ids(30, 1) == [15]


def test_round_trip_in_zlab_layout(tiny_target, tmp_path):
    cfg = DrafterConfig.for_target(tiny_target.config, num_layers=1, block_size=8, target_layer_ids=[1, 3])
    drafter = init_drafter(cfg, seed=3)
    save_drafter(drafter, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"]
    assert saved["block_size"] == 8 and saved["num_target_layers"] == 4
    assert saved["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [1, 3]}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == ZLAB_KEYS
        assert f.get_tensor("fc.weight").shape == (64, 128)  # 2 taps x hidden -> hidden
    loaded = load_drafter(tmp_path, tiny_target.config)
    assert loaded.config == cfg
    for (name, a), (_, b) in zip(sorted(drafter.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    # the loaded drafter computes the same thing
    for d in (drafter, loaded):
        d.setup_caches(1, 32)
    args = (
        torch.randn(1, 8, 64),
        torch.arange(3, 11)[None],
        torch.arange(3, 11)[None],
        (torch.arange(16) < 11).expand(1, 1, 8, 16),
        torch.randn(1, 3, 128),
        torch.arange(3)[None],
        torch.arange(3)[None],
    )
    with torch.no_grad():
        torch.testing.assert_close(drafter(*args), loaded(*args))


def test_mismatched_drafter_is_refused(tiny_target, tmp_path):
    other = ModelConfig(
        vocab_size=500,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    save_drafter(init_drafter(DrafterConfig.for_target(other, target_layer_ids=[1])), tmp_path)
    with pytest.raises(DrafterMismatchError) as err:
        load_drafter(tmp_path, tiny_target.config)
    msg = str(err.value)
    assert "vocabulary 500 != target's 64" in msg and "hidden size 32 != target's 64" in msg


def test_block_context_injection_shapes_and_isolation(tiny_target, tiny_drafter):
    """The block sees context only through the drafter cache: changing a context feature changes
    the draft, changing a cache slot beyond the visible span does not."""
    d = tiny_drafter
    d.setup_caches(1, 64)
    ctx = torch.randn(1, 5, 64)
    pos = torch.arange(5)[None]
    blk_pos = torch.arange(5, 13)[None]
    mask = (torch.arange(32) < 13).expand(1, 1, 8, 32)
    emb = torch.randn(1, 8, 64)
    with torch.no_grad():
        a = d(emb, blk_pos, blk_pos, mask, ctx, pos, pos)
        ctx2 = ctx.clone()
        ctx2[0, 2] += 1.0
        d.setup_caches(1, 64)
        b = d(emb, blk_pos, blk_pos, mask, ctx2, pos, pos)
        assert not torch.allclose(a, b)
        for layer in d.layers:  # garbage past the span must be invisible
            layer.self_attn.kv_cache.k[:, d.slot_map[0, 20:]] = 1e4
        c = d(emb, blk_pos, blk_pos, mask)
        torch.testing.assert_close(b, c)
