"""Log-probabilities of completion tokens: the engine keeps the accepted path's logits each round, and the
server returns them in OpenAI's chat and completions shapes."""

import openai
import pytest
import torch

from ddtree.models.random import ByteTokenizer
from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.speculative.drafter import DFlashDrafter
from in_process_server import InProcessServer
from tiny_models import reference_log_probs

PROMPT = [3, 14, 15, 9, 26, 5]


class OracleEngine(Engine):
    """Drafts that put the true continuation on top, so rounds accept long paths."""

    continuation: list[int] = []

    def propose(self, n, span):
        real = super().propose(n, span)
        logits = torch.zeros_like(real)
        L = self.host_lengths[0]
        for d in range(real.shape[1]):
            if L + 1 + d < len(self.continuation):
                logits[0, d, self.continuation[L + 1 + d]] = 10.0
        return logits


@pytest.mark.parametrize("method,budget", [("ar", None), ("ddtree", 16)])
def test_token_logprobs_are_the_targets_distribution_at_each_emitted_token(tiny_target, tiny_drafter, method, budget):
    sp = SamplingParams(max_new_tokens=30)
    ar = Engine(tiny_target, None, "ar", max_batch_size=1, max_seq_len=64).generate([PROMPT], sp)[0].token_ids
    drafter: DFlashDrafter | None = tiny_drafter if method != "ar" else None
    eng = OracleEngine(tiny_target, drafter, method, budget, max_batch_size=1, max_seq_len=64, logprobs=True)
    eng.continuation = PROMPT + ar
    emitted = [eng.add(0, PROMPT, sp)]
    got = eng.token_logprobs(0, emitted, top=3)
    longest = 1
    while len(emitted) < 30:
        toks = eng.step(1)[0]
        longest = max(longest, len(toks))
        got += eng.token_logprobs(0, toks, top=3)
        emitted += toks
    assert emitted[:30] == ar
    if method == "ddtree":
        assert longest > 3, "the oracle drafts must make rounds accept several tokens"
    ref = reference_log_probs(tiny_target, PROMPT + emitted)
    for k, (logprob, top) in enumerate(got):
        row = ref[len(PROMPT) - 1 + k]
        assert logprob == pytest.approx(row[emitted[k]].item(), abs=1e-4)
        values, ids = row.topk(3)
        assert [i for i, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.fixture
def server(tiny_target):
    """The server over a real engine of the tiny model (byte tokenizer), keeping log-probabilities."""

    engine = Engine(tiny_target, None, "ar", max_batch_size=2, max_seq_len=64, logprobs=True)
    served = InProcessServer(engine, ByteTokenizer(tiny_target.config.vocab_size), {"max_seq_len": 64})
    yield served.client()
    served.close()


def test_completions_logprobs_whole_and_streamed(server, tiny_target):
    request = {"model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    whole = server.completions.create(**request)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens == 12
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen token is the most likely
        assert len(top) == 2 and logprob <= 0 and logprob == pytest.approx(max(top.values()), abs=1e-5)
    streamed = list(server.completions.create(**request, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    logprobs = [
        v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
    ]
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    # the streamed request reuses the first one's cached prompt (keys from other GEMM shapes): last bits differ
    assert tokens == lp.tokens and logprobs == pytest.approx(lp.token_logprobs, abs=1e-5) and offsets == lp.text_offset
    # and without logprobs, none come back
    assert server.completions.create(**{**request, "logprobs": None}).choices[0].logprobs is None


def test_logprob_requests_the_server_cannot_honour_are_refused(server):
    with pytest.raises(openai.BadRequestError, match="'logprobs' must be in 0..20, got 21"):
        server.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs': true"):
        server.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, top_logprobs=2
        )


def test_token_bytes_rebuild_characters_split_across_tokens():
    """SmolLM2's byte-level BPE splits emoji and CJK characters over tokens: each token's bytes (from the
    vocabulary, not its text decoded alone) join to the text the tokenizer encoded."""
    from transformers import AutoTokenizer

    from ddtree.models.checkpoint import resolve_model
    from ddtree.serving.grammar import llguidance_tokenizer
    from ddtree.serving.token_bytes import TextOffsets, TokenBytes

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    token_bytes = TokenBytes(tokenizer, lambda: llguidance_tokenizer(tokenizer, len(tokenizer), None))
    text = "日本の首都は東京です 😀👏 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    names = [token_bytes.name(t) for t in ids]
    assert b"".join(data for _, data in names) == text.encode()
    partial = [name for name, data in names if name.startswith("bytes:")]
    assert partial, "some tokens hold part of a character"
    assert all(name == "bytes:" + "".join(f"\\x{b:02x}" for b in data) for name, data in names if name in partial)
    assert len({name for name, _ in names}) > len({tokenizer.decode([t]) for t in ids}), "decoded alone they collide"
    offsets = TextOffsets(token_bytes, skip_special_tokens=True)
    assert sum(offsets.chars(t, data) for t, (_, data) in zip(ids, names)) == len(text)
    eos = tokenizer.eos_token_id
    assert token_bytes.name(eos)[0] == tokenizer.eos_token and offsets.chars(eos, token_bytes(eos)) == 0


def test_logprobs_bytes_and_offsets_follow_the_text_over_partial_characters():
    """A tiny model whose 256 tokens are single bytes: what it writes is full of partial characters."""
    from tiny_models import random_target

    target = random_target(vocab=256, seed=3)
    engine = Engine(target, None, "ar", max_batch_size=1, max_seq_len=64, logprobs=True)
    served = InProcessServer(engine, ByteTokenizer(256), {"max_seq_len": 64})
    request = {"model": "tiny", "prompt": "héllo 😀", "max_tokens": 24, "temperature": 0}
    try:
        whole = served.client().completions.create(**request, logprobs=3)
    finally:
        served.close()
    lp, text = whole.choices[0].logprobs, whole.choices[0].text
    assert any(t.startswith("bytes:") for t in lp.tokens), "the greedy answer holds partial characters"
    raw = b"".join(bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in lp.tokens)
    assert raw.decode("utf-8", "replace") == text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    assert all(len(top) == 3 for top in lp.top_logprobs), "distinct bytes, distinct keys"
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen token is the most likely
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)
