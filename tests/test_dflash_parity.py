"""Parity with the authors' reference DFlash (PyPI `dflash`, dflash/model.py: DFlashDraftModel, dflash_generate).

A drafter made by the reference class with random weights and saved with save_pretrained loads through our
loader unchanged; then (a) its block logits equal the reference's, round after round of appended context,
for every attention layout and knob the reference reads, and (b) greedy `dflash` generation in our Engine
emits the reference loop's tokens with the same accepted length and draft logits each round (up to the
last rounds, where the reference shortens its block: test_greedy_generation_equals_the_reference).

The reference runs on transformers' Qwen3 target; ours on the same weights loaded by the registry. fp32.
"""

import json
import os
import time

import pytest
import torch
import torch.nn.functional as F
import transformers

try:
    import dflash.model as reference
except ImportError as exc:  # `make setup` installs it; a missing reference must not pass in CI
    if os.environ.get("CI"):
        raise
    pytest.skip(f"the reference `dflash` is not installed ({exc}); run `make setup`", allow_module_level=True)

from ddtree.models.registry import load_pretrained  # noqa: E402
from ddtree.runtime.engine import Engine, SamplingParams  # noqa: E402
from ddtree.speculative.drafter import DrafterConfig, DrafterMismatchError  # noqa: E402
from ddtree.speculative.loading import load_drafter  # noqa: E402

VOCAB = 32  # tiny, so that a random drafter is right often enough to accept several tokens in a round
MASK = VOCAB - 1
HIDDEN, TARGET_LAYERS = 64, 4
ATOL = RTOL = 1e-4


def hf_target(seed: int, folder, mask_boost: float = 1.0, moe: bool = False):
    """A tiny random Qwen3 (tied embeddings, peaked logits so that greedy choices are stable) saved to `folder`;
    mask_boost scales the mask token's embedding row, so that the target emits it in runs that a small random
    drafter (which mostly predicts the mask token back) then drafts right. moe: a Qwen3-MoE (4 experts, top 2,
    every layer sparse)."""
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    if moe:
        cfg = transformers.Qwen3MoeConfig(
            **shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN, decoder_sparse_step=1
        )
        model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
            else:  # norms away from one, so that a misplaced norm cannot hide
                p.copy_(1 + 0.1 * torch.randn_like(p))
        model.model.embed_tokens.weight[MASK] *= mask_boost
    model.save_pretrained(folder)
    return model


def drafter_fields(extra_dflash: dict | None = None, **config) -> dict:
    """The Qwen3Config fields of a 2-layer drafter for the tiny targets, with `config` over them and
    dflash_config = {mask, taps [1, 2]} + extra_dflash + config's dflash_config."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_target_layers=TARGET_LAYERS,
        max_position_embeddings=256,
        block_size=6,
    )
    fields.update(config)
    fields["dflash_config"] = {
        "mask_token_id": MASK,
        "target_layer_ids": [1, 2],
        **(extra_dflash or {}),
        **config.get("dflash_config", {}),
    }
    return fields


def reference_drafter(seed: int, folder, scale: float, **config):
    """DFlashDraftModel(config) with random weights (std `scale` matrices, norms near one), saved to `folder`."""
    torch.manual_seed(seed)
    model = reference.DFlashDraftModel(transformers.Qwen3Config(**drafter_fields(**config))).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, scale)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


# drafter configs: each attention layout and knob the reference reads
LAYOUTS = {
    "full": {},
    # layer 0: sliding, causal (the default for a sliding layer), window 4; layer 1: full, bidirectional
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=4),
    # the window from max_window_layers (layer 1 on), made bidirectional by is_causal false
    "sliding-bidirectional": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1, is_causal=False),
    "causal": dict(is_causal=True),
    "scales": dict(
        dflash_config={"input_embedding_scale": 2.5, "output_multiplier": 0.7, "final_logit_softcapping": 3.0}
    ),
    # dflash_config's block_size wins over the top level's
    "block-size": dict(block_size=4, dflash_config={"block_size": 7}),
    # transformers 5 writes RoPE scaling as rope_parameters; YaRN scales cos and sin by its attention factor
    "yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
        }
    ),
}


@pytest.fixture(scope="module")
def target_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    hf = hf_target(0, folder)
    return hf, load_pretrained(folder, torch.float32, "cpu")


def test_target_taps_equal_transformers_hidden_states(target_pair):
    """Tap l is transformers' hidden_states[l + 1], the reference's context feature of layer l: the last
    layer's after the final norm."""
    hf, ours = target_pair
    ours.setup_caches(1, 32)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    j = torch.arange(12)
    with torch.no_grad():
        _, taps = ours(ids, j[None], j[None], (j[:, None] >= j[None, :])[None, None], tuple(range(TARGET_LAYERS)))
        want = hf(ids, output_hidden_states=True).hidden_states
    for layer in range(TARGET_LAYERS):
        got = taps[..., layer * HIDDEN : (layer + 1) * HIDDEN]
        torch.testing.assert_close(got, want[layer + 1], atol=ATOL, rtol=RTOL, msg=f"tap {layer}")


# context tokens committed before each round: the prompt first, then accepted paths of several lengths
ROUNDS = [9, 3, 1, 6, 2, 5, 4]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_logits_equal_the_reference(layout, target_pair, tmp_path):
    """Rounds of [bonus, MASK...] blocks, the same target features appended as context before each, the
    reference's cache handled as dflash_generate handles it (cropped back to the committed text after each
    draft); our drafter writes the prompt's context alone first, as the Engine's prefill does."""
    hf, target = target_pair
    ref = reference_drafter(1, tmp_path, scale=0.3, **LAYOUTS[layout])
    ours = load_drafter(tmp_path, target.config, dtype=torch.float32)
    assert ours.block_size == ref.block_size and ours.config.target_layer_ids == list(ref.target_layer_ids)
    bs, taps = ref.block_size, len(ref.target_layer_ids)
    g = torch.Generator().manual_seed(2)
    features = torch.randn(1, sum(ROUNDS), taps * HIDDEN, generator=g)
    span = sum(ROUNDS) + bs
    ours.setup_caches(1, span)
    cache = transformers.DynamicCache(config=ref.config)
    cache.activate_past_recording()
    scale = ours.config.input_embedding_scale
    start = 0
    with torch.no_grad():
        for r, n in enumerate(ROUNDS):
            ctx, ctx_pos = features[:, start : start + n], torch.arange(start, start + n)[None]
            start += n
            block = torch.full((1, bs), MASK)
            block[0, 0] = torch.randint(0, VOCAB, (1,), generator=g)
            blk_pos = torch.arange(start, start + bs)[None]
            # the reference
            hidden = ref(
                target_hidden=ctx,
                noise_embedding=F.embedding(block, hf.get_input_embeddings().weight) * scale,
                position_ids=torch.cat([ctx_pos, blk_pos], dim=1),
                past_key_values=cache,
                use_cache=True,
            )
            cache.crop(start - cache.get_seq_length())
            want = ref.compute_logits(hidden[:, 1:], hf.lm_head)
            # ours
            mask = (torch.arange(span) < start + bs).expand(1, 1, bs, span)
            if r == 0:
                ours.append_context(ctx, ctx_pos, ctx_pos)
                hidden = ours(target.embed(block), blk_pos, blk_pos, mask)
            else:
                hidden = ours(target.embed(block), blk_pos, blk_pos, mask, ctx, ctx_pos, ctx_pos)
            got = ours.draft_logits(hidden[:, 1:], target.logits)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=f"{layout}, round {r}")


def recording(fn, calls: list, take=lambda out: out):
    """fn, keeping a copy of take(each result) in `calls`."""

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls.append(take(out).detach().clone())
        return out

    return wrapped


def reference_generate(ref, hf, prompt, max_new_tokens):
    """dflash_generate's tokens, accepted lengths and draft logits of each round (its timer needs CUDA: the
    stats' clock is the host's here)."""
    timer, logits = reference._cuda_time, []
    reference._cuda_time = time.perf_counter
    ref.compute_logits = recording(ref.compute_logits, logits)
    try:
        out = reference.dflash_generate(
            ref, hf, torch.tensor([prompt]), max_new_tokens, None, temperature=0.0, return_stats=True
        )
    finally:
        reference._cuda_time = timer
        del ref.compute_logits
    return out.output_ids[0, len(prompt) :].tolist(), out.acceptance_lengths, logits


def whole_block_rounds(prompt_len: int, block_size: int, accepted: list[int]) -> int:
    """How many first rounds the reference drafted a whole block in (then fewer tokens than a block remain)."""
    start, rounds = prompt_len, 0
    for a in accepted:
        if start + block_size > prompt_len + MAX_NEW:
            break
        start, rounds = start + a, rounds + 1
    return rounds


E2E = {
    "full": {},
    "sliding": LAYOUTS["sliding"],
    "causal": LAYOUTS["causal"],
    # the target's last layer tapped: the reference reads it after the final norm
    "last-layer-tap": dict(dflash_config={"target_layer_ids": [0, TARGET_LAYERS - 1]}),
    "scales": LAYOUTS["scales"],
}
MAX_NEW = 40


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layout", E2E)
def test_greedy_generation_equals_the_reference(layout, seed, tmp_path):
    """Greedy dflash_generate against our Engine's `dflash` method: the same tokens, and the same accepted
    length and draft logits each round. Except in the last rounds, where the reference drafts a shorter block (only what
    max_new_tokens still allows) and ours the whole one: inside a block attention is bidirectional, so the
    drafts there may differ (the tokens cannot: greedy verification is lossless). A drafter whose layers are
    all causal drafts the same either way, and then every round must agree."""
    hf = hf_target(10 + seed, tmp_path / "target", mask_boost=3.0)
    ref = reference_drafter(20 + seed, tmp_path / "drafter", scale=0.1, **E2E[layout])
    target = load_pretrained(tmp_path / "target", torch.float32, "cpu")
    drafter = load_drafter(tmp_path / "drafter", target.config, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB - 1, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        want_tokens, want_accepted, want_logits = reference_generate(ref, hf, prompt, MAX_NEW)
    engine = Engine(target, drafter, "dflash", max_batch_size=1, max_seq_len=64)
    got_logits: list = []
    drafter.draft_logits = recording(drafter.draft_logits, got_logits)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW))[0]
    assert got.token_ids == want_tokens
    causal = all(drafter.config.layer_causal(i) for i in range(2))
    compared = len(want_accepted) if causal else whole_block_rounds(len(prompt), ref.block_size, want_accepted)
    assert compared >= 5
    assert got.accepted_per_round[:compared] == want_accepted[:compared]
    assert sum(got.accepted_per_round) == sum(want_accepted) == MAX_NEW - 1  # the prefill gave the first token
    # and the drafts themselves, which the accepted lengths show only through their argmax (a shorter block's
    # logits are the first of ours)
    for r in range(compared):
        want = want_logits[r]
        torch.testing.assert_close(got_logits[r][:, : want.shape[1]], want, atol=ATOL, rtol=RTOL, msg=f"round {r}")


@pytest.mark.parametrize("seed", range(2))
def test_greedy_generation_on_a_moe_target_equals_the_reference(seed, tmp_path):
    """The same on a Qwen3-MoE target (our qwen3_moe family against transformers' Qwen3MoeForCausalLM under
    the reference loop), with an all-causal drafter so that every round must agree."""
    hf = hf_target(30 + seed, tmp_path / "target", mask_boost=3.0, moe=True)
    ref = reference_drafter(40 + seed, tmp_path / "drafter", scale=0.1, **LAYOUTS["causal"])
    target = load_pretrained(tmp_path / "target", torch.float32, "cpu")
    assert type(target.config).__module__ == "ddtree.models.qwen3_moe"  # the MoE family, not the dense one
    drafter = load_drafter(tmp_path / "drafter", target.config, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB - 1, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        want_tokens, want_accepted, _ = reference_generate(ref, hf, prompt, MAX_NEW)
    engine = Engine(target, drafter, "dflash", max_batch_size=1, max_seq_len=64)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW))[0]
    assert got.token_ids == want_tokens
    assert got.accepted_per_round == want_accepted and max(want_accepted) >= 2


def test_batched_generation_equals_the_reference_per_prompt(tmp_path):
    """Three prompts of different lengths in one batch (rows finish and commit different path lengths each
    round): each row's tokens and accepted lengths are the reference's for its prompt alone."""
    hf = hf_target(11, tmp_path / "target", mask_boost=3.0)
    ref = reference_drafter(21, tmp_path / "drafter", scale=0.1, **LAYOUTS["sliding"])
    target = load_pretrained(tmp_path / "target", torch.float32, "cpu")
    drafter = load_drafter(tmp_path / "drafter", target.config, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (7, 3, 12)]
    engine = Engine(target, drafter, "dflash", max_batch_size=3, max_seq_len=64)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for prompt, got in zip(prompts, results):
        with torch.no_grad():
            want_tokens, want_accepted, _ = reference_generate(ref, hf, prompt, MAX_NEW)
        assert got.token_ids == want_tokens
        whole = whole_block_rounds(len(prompt), ref.block_size, want_accepted)
        assert got.accepted_per_round[:whole] == want_accepted[:whole]


def test_the_e2e_cases_accept_long_paths(tmp_path):
    """The end-to-end cases above are only worth something if rounds accept several drafted tokens."""
    hf = hf_target(12, tmp_path / "target", mask_boost=3.0)
    ref = reference_drafter(22, tmp_path / "drafter", scale=0.1)
    prompt = torch.randint(0, VOCAB - 1, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        _, accepted, _ = reference_generate(ref, hf, prompt, MAX_NEW)
    assert max(accepted) >= 3 and len(set(accepted)) >= 3


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
        ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 2], "use_swa": True}}, "use_swa"),
        ({"attention_sink_bias": True}, "attention_sink_bias"),
        # vLLM's all-layer override, against the reference's layout (a sliding layer is causal)
        (
            {
                **LAYOUTS["sliding"],
                "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 2], "causal": False},
            },
            "causal",
        ),
        ({"is_causal": "yes"}, "is_causal"),
        # sliding layer types with the window off: the reference's cache cannot be built for it
        ({"layer_types": ["full_attention", "sliding_attention"]}, "window is off"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "RoPE"),
        ({"dflash_config": {"target_layer_ids": [1, 2]}}, "mask_token_id"),
    ],
)
def test_what_the_drafter_does_not_compute_is_refused(change, message, tmp_path):
    reference_drafter(1, tmp_path, scale=0.02)
    cfg = {**json.loads((tmp_path / "config.json").read_text()), **change}
    with pytest.raises(DrafterMismatchError, match=message):
        DrafterConfig.from_hf(cfg)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_config_round_trips_through_our_layout(layout, tmp_path):
    """Our to_hf writes what from_hf reads back, every knob included."""
    reference_drafter(1, tmp_path, scale=0.02, **LAYOUTS[layout])
    cfg = load_drafter(tmp_path).config
    assert DrafterConfig.from_hf(cfg.to_hf()) == cfg
