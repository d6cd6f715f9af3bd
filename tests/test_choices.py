"""`n` choices per request: one scheduler request per choice, the prompt counted once in `usage`, each
choice's text, finish reason and log-probabilities its own, whole and streamed."""

import openai
import pytest

from ddtree.models.random import ByteTokenizer
from ddtree.runtime.engine import Engine
from in_process_server import InProcessServer


@pytest.fixture(scope="module")
def server(tiny_target, tiny_drafter):
    """ddtree rounds over the tiny model with 2 rows, so a third choice waits for a free row."""
    engine = Engine(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=2, max_seq_len=64, logprobs=True)
    served = InProcessServer(engine, ByteTokenizer(tiny_target.config.vocab_size), {"max_seq_len": 64})
    yield served
    served.close()


def by_index(chunks) -> dict[int, dict]:
    """Each streamed choice's text, finish reasons and log-probability tokens."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = out.setdefault(c.index, {"text": "", "finish": [], "tokens": []})
            got["text"] += c.text
            got["finish"] += [c.finish_reason] if c.finish_reason else []
            got["tokens"] += c.logprobs.tokens if c.logprobs else []
    return out


def test_greedy_choices_are_the_single_answer_whole_and_streamed(server):
    server = server.client()
    request = {"model": "tiny", "prompt": "hello", "max_tokens": 10, "temperature": 0}
    one = server.completions.create(**request)
    three = server.completions.create(**request, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert [c.finish_reason for c in three.choices] == ["length"] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens, "the prompt counts once"
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens == 30

    chunks = list(server.completions.create(**request, n=3, stream=True, stream_options={"include_usage": True}))
    streamed = by_index(chunks)
    assert sorted(streamed) == [0, 1, 2]
    assert all(s["text"] == one.choices[0].text and s["finish"] == ["length"] for s in streamed.values())
    assert not chunks[-1].choices and chunks[-1].usage.model_dump() == three.usage.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])


def test_sampled_choices_differ_and_carry_their_own_log_probabilities(server):
    server = server.client()
    whole = server.completions.create(
        model="tiny", prompt="hello", max_tokens=12, temperature=1.0, seed=7, n=4, logprobs=1
    )
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) > 1, "four sampled 12-token answers over a 256-token vocabulary"
    for c in whole.choices:
        assert "".join(c.logprobs.tokens) == c.text and len(c.logprobs.token_logprobs) == 12
    assert whole.usage.completion_tokens == 48
    streamed = by_index(
        server.completions.create(model="tiny", prompt="hello", max_tokens=12, n=2, logprobs=1, stream=True)
    )
    assert all("".join(s["tokens"]) == s["text"] and s["finish"] == ["length"] for s in streamed.values())


def test_n_out_of_range_is_refused_and_the_server_keeps_serving(server):
    server = server.client()
    for n, message in [
        (0, "'n' must be in 1..128, got 0"),
        (129, "'n' must be in 1..128, got 129"),
        (40, "'n' is 40; this server holds at most 34 requests at once (2 running, 32 waiting)"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
            server.completions.create(model="tiny", prompt="hi", max_tokens=2, n=n)
    assert len(server.completions.create(model="tiny", prompt="hi", max_tokens=2, n=34).choices) == 34


def test_later_choices_map_the_first_ones_prompt_pages(server):
    """The first choice's prefill puts the prompt's full pages in the prefix cache; the others wait for it
    and map them instead of prefilling the prompt again."""
    prompt = "a prompt of forty bytes over three pages"  # pages 0 and 1 full, the last token in page 2
    hits = server.server.metrics.prefix_cache_hit_tokens
    before = hits._value.get()
    reply = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, n=3)
    assert len({c.text for c in reply.choices}) == 1
    assert hits._value.get() - before == 2 * 32, "choices 1 and 2 each map the two full pages"
