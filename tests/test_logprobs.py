"""Log-probabilities of completion tokens: the engine keeps the accepted path's logits each round, and the
server returns them in OpenAI's chat and completions shapes."""

import openai
import pytest
import torch

from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.speculative.drafter import DFlashDrafter
from in_process_server import InProcessServer

PROMPT = [3, 14, 15, 9, 26, 5]


def reference_logprobs(model, text: list[int]) -> torch.Tensor:
    """log_softmax of a plain causal forward over `text`: row i is the distribution of token i + 1."""
    n = len(text)
    j = torch.arange(n)
    model.setup_caches(max_batch=1, max_slots=n + 1)
    with torch.no_grad():
        logits, _ = model(torch.tensor([text]), j[None], j[None], (j[:, None] >= j[None, :])[None, None])
    return logits[0].float().log_softmax(-1)


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
    ref = reference_logprobs(tiny_target, PROMPT + emitted)
    for k, (logprob, top) in enumerate(got):
        row = ref[len(PROMPT) - 1 + k]
        assert logprob == pytest.approx(row[emitted[k]].item(), abs=1e-4)
        values, ids = row.topk(3)
        assert [i for i, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.fixture
def server(tiny_target):
    """The server over a real engine of the tiny model (byte tokenizer), keeping log-probabilities."""
    from ddtree.models.random import ByteTokenizer

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
