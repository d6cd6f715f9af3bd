"""Sampling at T > 0 is lossless: DDTree emits the same distribution as plain sampling."""

import collections
import math

import pytest
import torch

from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from tiny_models import random_target, reference_log_probs


def chi_square_p_value(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test of homogeneity; cells with few counts are pooled."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    rows, pooled = [], [0, 0]
    for k in keys:
        if a[k] + b[k] < 10:
            pooled[0] += a[k]
            pooled[1] += b[k]
        else:
            rows.append((a[k], b[k]))
    if sum(pooled):
        rows.append(tuple(pooled))
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    dof = len(rows) - 1
    half_dof, half_stat = (torch.tensor(v / 2, dtype=torch.float64) for v in (dof, stat))
    return torch.special.gammaincc(half_dof, half_stat).item()  # the chi-square survival function


# Rounds of 64 samples per side (1920): test_the_test_detects_a_biased_sampler shows that at this size the
# statistic rejects T=0.8 against T=1 (p ~ 1e-5; twice the samples only add margin, T=0.9 needs far more).
ROUNDS = 30


def emitted_pairs(engine, rounds, seed0, params_kw):
    counts = collections.Counter()
    for r in range(rounds):
        res = engine.generate([[1, 2, 3]] * 64, SamplingParams(max_new_tokens=3, seed=seed0 + r, **params_kw))
        counts.update(tuple(x.token_ids[1:3]) for x in res)  # tokens 2 and 3: produced by verify rounds
    return counts


@pytest.mark.slow
@pytest.mark.parametrize(
    "params_kw",
    [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.8}, {"temperature": 1.0, "top_k": 4, "min_p": 0.05}],
)
def test_ddtree_sampling_matches_ar(params_kw):
    target = random_target(vocab=8, hidden=32, layers=2, seed=1, scale=0.25)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=4), seed=2)
    ar = Engine(target, None, "ar", max_batch_size=64, max_seq_len=16)
    tree = Engine(target, drafter, "ddtree", 12, max_batch_size=64, max_seq_len=32)
    a = emitted_pairs(ar, ROUNDS, 1000, params_kw)
    b = emitted_pairs(tree, ROUNDS, 5000, params_kw)
    assert len(a) > 10, "the test needs a spread-out distribution"
    assert chi_square_p_value(a, b) > 1e-3
    # with 8 tokens and budget 12 the tree always holds every depth-1 token: drafts are accepted
    accepted = tree.generate([[1, 2, 3]] * 64, SamplingParams(max_new_tokens=3, seed=7, **params_kw))
    assert sum(r.acceptance_length for r in accepted) / 64 > 1.5


@pytest.mark.slow
def test_the_test_detects_a_biased_sampler():
    """Guard: with the samples test_ddtree_sampling_matches_ar takes, the statistic rejects a distribution
    that differs (T=0.8 vs T=1)."""
    target = random_target(vocab=8, hidden=32, layers=2, seed=1, scale=0.25)
    ar = Engine(target, None, "ar", max_batch_size=64, max_seq_len=16)
    a = emitted_pairs(ar, ROUNDS, 1000, {"temperature": 1.0})
    b = emitted_pairs(ar, ROUNDS, 5000, {"temperature": 0.8})
    assert chi_square_p_value(a, b) < 1e-3


def test_same_seed_same_output():
    target = random_target(vocab=8, hidden=32, layers=2, seed=1, scale=0.25)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=4), seed=2)
    eng = Engine(target, drafter, "ddtree", 12, max_batch_size=4, max_seq_len=32)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=42)
    first = [r.token_ids for r in eng.generate([[1, 2]] * 4, sp)]
    assert [r.token_ids for r in eng.generate([[1, 2]] * 4, sp)] == first


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_top_k_and_min_p_bound_every_sampled_token(method):
    target = random_target(vocab=32, hidden=32, layers=2, seed=1, scale=0.25)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=4), seed=2) if method != "ar" else None
    eng = Engine(target, drafter, method, 12 if drafter else None, max_batch_size=4, max_seq_len=48)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    greedy = [r.token_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=16))]
    # one candidate left: any temperature is greedy
    for only_one in ({"top_k": 1}, {"min_p": 1.0}):
        hot = SamplingParams(max_new_tokens=16, temperature=2.0, seed=3, **only_one)
        assert [r.token_ids for r in eng.generate(prompts, hot)] == greedy, only_one
    # at T = 1.5: every token among the 3 most probable, or with at least 0.2 of the top one's probability
    # (after temperature), under the target's own distribution at its position; unfiltered, some are not
    misses = {}
    for name, extra in (("free", {}), ("top_k", {"top_k": 3}), ("min_p", {"min_p": 0.2})):
        params = SamplingParams(max_new_tokens=16, temperature=1.5, seed=4, **extra)
        outside_k = below_p = 0
        for prompt, result in zip(prompts, eng.generate(prompts, params)):
            ref = reference_log_probs(target, prompt + result.token_ids)
            for k, token in enumerate(result.token_ids):
                row = ref[len(prompt) - 1 + k]
                outside_k += token not in row.topk(3).indices.tolist()
                below_p += bool((row[token] - row.max()) / 1.5 < math.log(0.2) - 1e-4)
        misses[name] = (outside_k, below_p)
    assert misses["top_k"][0] == 0 and misses["min_p"][1] == 0, misses
    assert misses["free"][0] > 0 and misses["free"][1] > 0, f"the filters must bind here: {misses}"


def test_min_tokens_and_allowed_token_ids_hold_tokens_back_losslessly_through_the_server(tiny_target):
    """min_tokens (vLLM's): no stop token among the first min_tokens; allowed_token_ids: no token outside
    the set. Held as constraints after the verify: ddtree's completion is greedy decoding with the refused
    tokens' logits masked (the reference: full forwards of the target). Fields they cannot go with are 400s."""
    import openai

    from ddtree.models.random import ByteTokenizer
    from in_process_server import InProcessServer

    tokenizer = ByteTokenizer(tiny_target.config.vocab_size)
    prompt = tokenizer.encode("hello")
    plain = (
        Engine(tiny_target, None, "ar", max_batch_size=1, max_seq_len=64)
        .generate([prompt], SamplingParams(max_new_tokens=24))[0]
        .token_ids
    )
    stop = plain[4]  # the server's stop token: greedy decoding emits it fifth

    def masked_greedy(min_tokens: int, allowed: list[int] | None = None) -> list[int]:
        out: list[int] = []
        while len(out) < 24 and stop not in out:
            log_probs = reference_log_probs(tiny_target, prompt + out)[-1]
            if allowed is not None:
                log_probs[[t for t in range(len(log_probs)) if t not in allowed]] = -math.inf
            if len(out) < min_tokens:
                log_probs[stop] = -math.inf
            out.append(int(log_probs.argmax()))
        return out

    drafter = init_drafter(DrafterConfig.for_target(tiny_target.config, num_layers=1, block_size=8), seed=0)
    engine = Engine(tiny_target, drafter, "ddtree", 8, max_batch_size=2, max_seq_len=64, logprobs=True)
    served = InProcessServer(engine, tokenizer, {"max_seq_len": 64}, stop_token_ids=(stop,))
    client = served.client()
    try:
        request = {"model": "tiny", "prompt": "hello", "max_tokens": 24, "temperature": 0}
        for min_tokens, length in ((0, 5), (5, 6), (6, 9), (24, 24)):  # it comes again once allowed
            expected = masked_greedy(min_tokens)
            assert len(expected) == length
            got = client.completions.create(**request, extra_body={"min_tokens": min_tokens})
            assert got.usage.completion_tokens == len(expected), min_tokens
            assert got.choices[0].finish_reason == ("stop" if expected[-1] == stop else "length")
            assert got.choices[0].text == tokenizer.decode([t for t in expected if t != stop]), min_tokens
        allowed = sorted(set(plain[5:12]) | {stop})  # 7 tokens greedy decoding takes later, and the stop token
        for min_tokens in (0, 6):
            expected = masked_greedy(min_tokens, allowed)
            assert expected != masked_greedy(min_tokens)[: len(expected)], "the set must bind here"
            body = {"min_tokens": min_tokens, "allowed_token_ids": allowed}
            got = client.completions.create(**request, extra_body=body)
            assert got.usage.completion_tokens == len(expected) and set(expected) <= set(allowed)
            assert got.choices[0].text == tokenizer.decode([t for t in expected if t != stop]), min_tokens
        for bad, message in [
            ({"min_tokens": -1}, "'min_tokens' must be >= 0"),
            ({"min_tokens": 25}, r"'min_tokens' \(25\) is more than max_tokens \(24\)"),
            ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "'min_tokens' cannot go with a grammar"),
            ({"allowed_token_ids": [1], "response_format": {"type": "json_object"}}, "'allowed_token_ids' cannot go"),
            ({"allowed_token_ids": [stop], "min_tokens": 1}, "'allowed_token_ids' holds only stop tokens"),
            ({"allowed_token_ids": [64]}, "'allowed_token_ids': 64 is outside the vocabulary of 64"),
            ({"allowed_token_ids": "1"}, "'allowed_token_ids' must be a list of token ids"),
        ]:
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(**request, extra_body=bad)
    finally:
        served.close()


def test_sampling_fields_through_the_server(tiny_target):
    """top_k and min_p (vLLM's extensions) reach the engine; fields the server cannot honour are refused."""
    import openai

    from ddtree.models.random import ByteTokenizer
    from in_process_server import InProcessServer

    engine = Engine(tiny_target, None, "ar", max_batch_size=2, max_seq_len=64)
    served = InProcessServer(engine, ByteTokenizer(tiny_target.config.vocab_size), {"max_seq_len": 64})
    client = served.client()
    try:
        request = {"model": "tiny", "prompt": "hello", "max_tokens": 12}
        greedy = client.completions.create(**request, temperature=0).choices[0].text
        for one in ({"top_k": 1}, {"min_p": 1.0}):
            assert client.completions.create(**request, temperature=2, seed=1, extra_body=one).choices[0].text == greedy
        for bad, message in [
            ({"top_k": -2}, "'top_k' must be -1, 0"),
            ({"top_k": 1.5}, "'top_k' must be an integer"),
            ({"min_p": 1.5}, "'min_p' must be in"),
            ({"repetition_penalty": 1.2}, "'repetition_penalty' is not supported"),
            ({"stop_token_ids": 3}, "'stop_token_ids' must be a list of up to 64 token ids"),
            ({"stop_token_ids": [True]}, "'stop_token_ids' must be a list of up to 64 token ids"),
            ({"stop_token_ids": [10**6]}, "'stop_token_ids': 1000000 is outside the vocabulary"),
            ({"include_stop_str_in_output": 1}, "'include_stop_str_in_output' must be a boolean"),
            ({"guided_json": {"type": "object"}}, "send 'response_format'"),
        ]:
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(**request, extra_body=bad)
        with pytest.raises(openai.BadRequestError, match="outside the vocabulary") as info:
            client.completions.create(model="tiny", prompt=[1, 2, 10**6], max_tokens=2)
        assert info.value.body["param"] == "prompt"
        neutral = {"top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "stop_token_ids": [], "min_tokens": 0}
        assert client.completions.create(**request, temperature=0, extra_body=neutral).choices[0].text == greedy
        # stop_token_ids (vLLM's): the completion ends at the first of them, its text kept (not a special token)
        ids = (
            Engine(tiny_target, None, "ar", max_batch_size=1, max_seq_len=64)
            .generate(
                [ByteTokenizer(tiny_target.config.vocab_size).encode("hello")], SamplingParams(max_new_tokens=12)
            )[0]
            .token_ids
        )
        k = ids.index(ids[5])
        stopped = client.completions.create(**request, temperature=0, extra_body={"stop_token_ids": [ids[5]]})
        cut = client.completions.create(**{**request, "max_tokens": k + 1}, temperature=0)
        assert (stopped.choices[0].finish_reason, cut.choices[0].finish_reason) == ("stop", "length")
        assert stopped.usage.completion_tokens == k + 1 and stopped.choices[0].text == cut.choices[0].text
        # include_stop_str_in_output: the stop string stays in the text
        stop = greedy[2:4]
        at = greedy.index(stop)
        for include, upto in ((False, at), (True, at + 2)):
            body = {"include_stop_str_in_output": include}
            kept = client.completions.create(**request, temperature=0, stop=stop, extra_body=body).choices[0]
            assert (kept.text, kept.finish_reason) == (greedy[:upto], "stop"), include
    finally:
        served.close()
