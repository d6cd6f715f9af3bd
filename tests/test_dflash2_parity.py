"""Parity with the authors' reference DFlash2 (PyPI `dflash`, dflash/model.py: DFlash2DraftModel, whose
generation loop is dflash_generate's DFlash2 branch).

A drafter made by the reference class with random weights and saved with save_pretrained loads through our
loader unchanged; then (a) its block outputs equal the reference's, round after round of appended context:
the draft logits, the candidate selector's left-to-right picks and its candidates' probabilities, and (b)
greedy `dflash` generation in our Engine emits the reference loop's tokens with the same accepted length
and the same selector picks each round. fp32; the tiny targets and their tricks are test_dflash_parity's.
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
from ddtree.speculative.dflash2 import DFlash2Config, DFlash2Drafter  # noqa: E402
from ddtree.speculative.drafter import DrafterConfig, DrafterMismatchError, init_drafter, save_drafter  # noqa: E402
from ddtree.speculative.loading import drafter_config, load_drafter  # noqa: E402
from test_dflash_parity import (  # noqa: E402
    ATOL,
    HIDDEN,
    LAYOUTS,
    MASK,
    MAX_NEW,
    ROUNDS,
    RTOL,
    VOCAB,
    drafter_fields,
    hf_target,
    recording,
    whole_block_rounds,
)

DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def reference_drafter(seed: int, folder, scale: float, selector_scale: float, **config):
    """DFlash2DraftModel(config) with random weights (std `scale` matrices and base kernels, `selector_scale`
    for the selector's, norms near one), saved to `folder`."""
    torch.manual_seed(seed)
    fields = drafter_fields(DFLASH2, **config)
    model = reference.DFlash2DraftModel(transformers.Qwen3Config(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, selector_scale if name.startswith("candidate_selector.") else scale)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


# the DFlash layouts, and the convolution's and selector's shapes
BLOCK_LAYOUTS = {
    **{k: LAYOUTS[k] for k in ("full", "sliding", "causal", "scales", "block-size")},
    "kernel-as-wide-as-the-block": dict(dflash_config={"conv_kernel_size": 6}),
    "one-group": dict(dflash_config={"conv_group_size": HIDDEN, "conv_kernel_size": 1}),
    "wide-selector": dict(dflash_config={"selector_rank": 32, "selector_top_k": VOCAB}),
}


def by_candidate(candidates: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates and their values sorted by token id (the reference keeps top-k in no particular order)."""
    order = candidates.argsort(-1)
    return candidates.gather(-1, order), values.gather(-1, order)


@pytest.mark.parametrize("layout", BLOCK_LAYOUTS)
def test_block_outputs_equal_the_reference(layout, tmp_path, monkeypatch):
    """Rounds of [bonus, MASK...] blocks over appended context, as test_dflash_parity's block test: the draft
    logits, the selector's greedy picks, and (the reference sampling its selector at T > 0 with the draw made
    the argmax, so that it follows the greedy path) the probabilities of each position's candidates."""
    hf = hf_target(0, tmp_path / "target")
    target = load_pretrained(tmp_path / "target", torch.float32, "cpu")
    ref = reference_drafter(1, tmp_path / "drafter", scale=0.3, selector_scale=0.3, **BLOCK_LAYOUTS[layout])
    ours = load_drafter(tmp_path / "drafter", target.config, dtype=torch.float32)
    assert isinstance(ours, DFlash2Drafter) and ours.block_size == ref.block_size
    monkeypatch.setattr(reference, "_sample_probs", lambda probs: probs.argmax(-1))
    bs, taps = ref.block_size, len(ref.target_layer_ids)
    g = torch.Generator().manual_seed(2)
    features = torch.randn(1, sum(ROUNDS), taps * HIDDEN, generator=g)
    span = sum(ROUNDS) + bs
    ours.setup_caches(1, span)
    cache = transformers.DynamicCache(config=ref.config)
    cache.activate_past_recording()
    scale = ours.config.input_embedding_scale
    start, reranked = 0, 0
    with torch.no_grad():
        for r, n in enumerate(ROUNDS):
            ctx, ctx_pos = features[:, start : start + n], torch.arange(start, start + n)[None]
            start += n
            block = torch.full((1, bs), MASK)
            block[0, 0] = torch.randint(0, VOCAB, (1,), generator=g)
            blk_pos = torch.arange(start, start + bs)[None]
            hidden = ref(
                target_hidden=ctx,
                noise_embedding=F.embedding(block, hf.get_input_embeddings().weight) * scale,
                position_ids=torch.cat([ctx_pos, blk_pos], dim=1),
                past_key_values=cache,
                use_cache=True,
            )[:, 1:]
            cache.crop(start - cache.get_seq_length())
            want_logits = ref.compute_logits(hidden, hf.lm_head)
            want_tokens, want_candidates, _ = ref.propose(hidden, block[:, 0], hf.lm_head, 0.0)
            mask = (torch.arange(span) < start + bs).expand(1, 1, bs, span)
            if r == 0:
                ours.append_context(ctx, ctx_pos, ctx_pos)
                got_hidden = ours(target.embed(block), blk_pos, blk_pos, mask)[:, 1:]
            else:
                got_hidden = ours(target.embed(block), blk_pos, blk_pos, mask, ctx, ctx_pos, ctx_pos)[:, 1:]
            got_logits = ours.draft_logits(got_hidden, target.logits)
            got = ours.select(got_hidden, got_logits, block[:, 0])
            msg = f"{layout}, round {r}"
            # fp32 rounding grows with the rounds of context in this random model (about 2x a round in
            # one-group with one thread): the bound is relative to the logits' scale (up to about 8)
            magnitude = float(want_logits.abs().max())
            torch.testing.assert_close(
                got_logits,
                want_logits,
                atol=ATOL * magnitude,
                rtol=RTOL,
                msg=lambda detail, msg=msg: f"{msg}: {detail}",
            )
            assert torch.equal(got.tokens, want_tokens), msg
            assert torch.equal(got.candidates.sort(-1).values, want_candidates.sort(-1).values), msg
            for temperature in (1.0, 0.5):
                tokens, candidates, q = ref.propose(hidden, block[:, 0], hf.lm_head, temperature)
                assert torch.equal(tokens, want_tokens), msg  # the argmax draw: the greedy path
                want = by_candidate(candidates, q)
                have = by_candidate(got.candidates, got.probs(temperature))
                torch.testing.assert_close(have, want, atol=ATOL, rtol=RTOL, msg=f"{msg}, T={temperature}")
            reranked += int((got.tokens != got_logits.argmax(-1)).sum())
    assert reranked > 0  # the selector changed some picks: the test sees more than the argmax


def test_bare_codebook_names_load(tmp_path):
    """Checkpoints that store the codebooks as bare tensors (no `.weight`) load, as the reference's
    from_pretrained maps them."""
    from safetensors.torch import load_file, save_file

    reference_drafter(1, tmp_path, scale=0.3, selector_scale=0.3)
    target = load_pretrained(hf_target_folder(tmp_path), torch.float32, "cpu")
    state = load_file(str(tmp_path / "model.safetensors"))
    want = load_drafter(tmp_path, target.config).state_dict()
    renamed = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in state.items()}
    assert sum("codebook" in k and not k.endswith(".weight") for k in renamed) == 2
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = load_drafter(tmp_path, target.config).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def hf_target_folder(tmp_path):
    hf_target(0, tmp_path / "target")
    return tmp_path / "target"


def reference_generate(ref, hf, prompt, max_new_tokens):
    """dflash_generate's tokens, accepted lengths and selector picks of each round (its timer needs CUDA: the
    stats' clock is the host's here)."""
    timer, picks = reference._cuda_time, []
    reference._cuda_time = time.perf_counter
    ref.propose = recording(ref.propose, picks, take=lambda out: out[0])
    try:
        out = reference.dflash_generate(
            ref, hf, torch.tensor([prompt]), max_new_tokens, None, temperature=0.0, return_stats=True
        )
    finally:
        reference._cuda_time = timer
        del ref.propose
    return out.output_ids[0, len(prompt) :].tolist(), out.acceptance_lengths, picks


E2E = {"full": {}, "causal": LAYOUTS["causal"], "sliding": LAYOUTS["sliding"]}


@pytest.mark.parametrize("seed", (1, 2))  # targets whose text has runs a drafter can hit
@pytest.mark.parametrize("layout", E2E)
def test_greedy_generation_equals_the_reference(layout, seed, tmp_path):
    """Greedy dflash_generate against our Engine's `dflash` method with a DFlash2 drafter: the same tokens, and
    the same accepted length and selector picks each round. As for DFlash, the reference drafts a shorter
    block in the last rounds; the convolutions and the selector are causal, so an all-causal drafter drafts
    the same either way and every round must agree."""
    hf = hf_target(10 + seed, tmp_path / "target", mask_boost=3.0)
    ref = reference_drafter(20 + seed, tmp_path / "drafter", scale=0.1, selector_scale=0.1, **E2E[layout])
    target = load_pretrained(tmp_path / "target", torch.float32, "cpu")
    drafter = load_drafter(tmp_path / "drafter", target.config, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB - 1, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        want_tokens, want_accepted, want_picks = reference_generate(ref, hf, prompt, MAX_NEW)
    engine = Engine(target, drafter, "dflash", max_batch_size=1, max_seq_len=64)
    got_picks: list = []
    drafter.select = recording(drafter.select, got_picks, take=lambda out: out.tokens)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW))[0]
    assert got.token_ids == want_tokens
    causal = all(drafter.config.layer_causal(i) for i in range(2))
    compared = len(want_accepted) if causal else whole_block_rounds(len(prompt), ref.block_size, want_accepted)
    assert compared >= 5
    assert got.accepted_per_round[:compared] == want_accepted[:compared]
    assert sum(got.accepted_per_round) == sum(want_accepted) == MAX_NEW - 1  # the prefill gave the first token
    assert max(want_accepted) >= 3  # rounds accept several drafted tokens
    for r in range(compared):
        want = want_picks[r]
        assert torch.equal(got_picks[r][:, : want.shape[1]], want), f"round {r}"


@pytest.mark.parametrize("seed", range(2))
def test_greedy_generation_on_a_moe_target_equals_the_reference(seed, tmp_path):
    """The same on a Qwen3-MoE target (our qwen3_moe family against transformers' Qwen3MoeForCausalLM under
    the reference loop), all-causal drafter: every round must agree."""
    hf = hf_target(30 + seed, tmp_path / "target", mask_boost=3.0, moe=True)
    ref = reference_drafter(40 + seed, tmp_path / "drafter", scale=0.1, selector_scale=0.1, **LAYOUTS["causal"])
    target = load_pretrained(tmp_path / "target", torch.float32, "cpu")
    assert type(target.config).__module__ == "ddtree.models.qwen3_moe"
    drafter = load_drafter(tmp_path / "drafter", target.config, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB - 1, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        want_tokens, want_accepted, _ = reference_generate(ref, hf, prompt, MAX_NEW)
    engine = Engine(target, drafter, "dflash", max_batch_size=1, max_seq_len=64)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW))[0]
    assert got.token_ids == want_tokens
    assert got.accepted_per_round == want_accepted and max(want_accepted) >= 2


def test_batched_generation_equals_the_reference_per_prompt(tmp_path):
    """Three prompts of different lengths in one batch: each row's tokens and accepted lengths are the
    reference's for its prompt alone."""
    hf = hf_target(11, tmp_path / "target", mask_boost=3.0)
    ref = reference_drafter(21, tmp_path / "drafter", scale=0.1, selector_scale=0.1, **LAYOUTS["causal"])
    target = load_pretrained(tmp_path / "target", torch.float32, "cpu")
    drafter = load_drafter(tmp_path / "drafter", target.config, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (7, 3, 12)]
    engine = Engine(target, drafter, "dflash", max_batch_size=3, max_seq_len=64)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for prompt, got in zip(prompts, results):
        with torch.no_grad():
            want_tokens, want_accepted, _ = reference_generate(ref, hf, prompt, MAX_NEW)
        assert got.token_ids == want_tokens and got.accepted_per_round == want_accepted


def test_sampling_runs_the_selector_chain(tmp_path):
    """At T > 0 the chain is the same selector chain (verification samples the target and needs no draft
    probabilities); the run finishes with in-vocabulary tokens and is reproducible under a seed."""
    hf_target(11, tmp_path / "target", mask_boost=3.0)
    reference_drafter(21, tmp_path / "drafter", scale=0.1, selector_scale=0.1)
    target = load_pretrained(tmp_path / "target", torch.float32, "cpu")
    drafter = load_drafter(tmp_path / "drafter", target.config, dtype=torch.float32)
    engine = Engine(target, drafter, "dflash", max_batch_size=2, max_seq_len=64)
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=3)
    first, again = (engine.generate([[1, 2, 3], [4, 5]], params) for _ in range(2))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert all(len(r.token_ids) == 20 and all(0 <= t < VOCAB for t in r.token_ids) for r in first)


def test_ddtree_refuses_a_dflash2_drafter(tmp_path):
    hf_target(0, tmp_path / "target")
    reference_drafter(1, tmp_path / "drafter", scale=0.1, selector_scale=0.1)
    target = load_pretrained(tmp_path / "target", torch.float32, "cpu")
    drafter = load_drafter(tmp_path / "drafter", target.config, dtype=torch.float32)
    with pytest.raises(DrafterMismatchError, match="one draft distribution per depth.*parent token"):
        Engine(target, drafter, "ddtree", budget=8, max_seq_len=64)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"conv_kernel_size": None}, "no conv_kernel_size"),
        ({"selector_rank": 0}, "selector_rank"),
        ({"conv_group_size": 24}, "does not divide"),
        ({"selector_top_k": VOCAB + 1}, "exceeds the vocabulary"),
    ],
)
def test_what_the_drafter_does_not_compute_is_refused(change, message, tmp_path):
    reference_drafter(1, tmp_path, scale=0.02, selector_scale=0.02)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"] = {k: v for k, v in {**cfg["dflash_config"], **change}.items() if v is not None}
    with pytest.raises(DrafterMismatchError, match=message):
        drafter_config(cfg)


def test_the_dflash_config_refuses_dflash2(tmp_path):
    reference_drafter(1, tmp_path, scale=0.02, selector_scale=0.02)
    with pytest.raises(DrafterMismatchError, match="DFlash2DraftModel"):
        DrafterConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))


def test_config_and_weights_round_trip_through_our_layout(tmp_path):
    """Our to_hf writes what the reference reads (its class builds from it and loads our weights) and what
    from_hf reads back."""
    reference_drafter(1, tmp_path / "ref", scale=0.02, selector_scale=0.02, **LAYOUTS["sliding"])
    cfg = load_drafter(tmp_path / "ref").config
    assert isinstance(cfg, DFlash2Config) and drafter_config(cfg.to_hf()) == cfg
    ours = init_drafter(cfg, seed=4)
    save_drafter(ours, tmp_path / "ours")
    back = reference.DFlash2DraftModel.from_pretrained(tmp_path / "ours")
    assert back.state_dict().keys() == ours.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_the_memory_plan_counts_the_dflash2_weights(tmp_path):
    """models/memory.py's drafter layout holds what the loaded DFlash2 drafter holds."""
    from ddtree.models.memory import drafter_layout, weight_bytes

    reference_drafter(1, tmp_path, scale=0.02, selector_scale=0.02)
    drafter = load_drafter(tmp_path, dtype=torch.float32)
    layout, _ = drafter_layout(json.loads((tmp_path / "config.json").read_text()), world=1)
    held = sum(p.nbytes for p in drafter.parameters()) + drafter.rope_inv_freq().nbytes
    assert sum(weight_bytes(w, 4) for w in layout.weights) == held
