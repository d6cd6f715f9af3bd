"""Reasoning in chat answers (serving/reasoning.py): <think>...</think> becomes `reasoning_content`, whole and
streamed, beside tool calls, where the answer opens it or the chat template does; and nowhere else."""

from __future__ import annotations

import json
import random

import pytest

from ddtree.config import REASONING_PARSERS, ConfigError, EngineConfig
from ddtree.serving.reasoning import CONTENT, REASONING, ReasoningSplitter, reasoning_parser, split_reasoning
from test_tools import ASK, HERMES_TEMPLATE, WEATHER, accumulate, hermes_call, serve, tokenizer, with_template

__all__ = ["serve", "tokenizer"]  # fixtures

# Qwen3's layout: a thinking model's template writes <think> (in earlier turns' answers, here in a comment)
THINK_TEMPLATE = HERMES_TEMPLATE + "{#- answers may start with <think>...</think> #}"
# DeepSeek-R1's and Kimi K2 Thinking's: the generation prompt opens the reasoning itself
OPENED_TEMPLATE = HERMES_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
)

CASES = [  # (answer, opened by the prompt) -> (reasoning_content, content)
    ("<think>\nLet me see.\n\n</think>\n\nParis.", False, ("Let me see.", "Paris.")),
    ("  <think>a </think>b", False, ("a", "b")),
    ("Let me see.\n</think>\n\nParis.", True, ("Let me see.", "Paris.")),
    ("<think>\n\n</think>\n\nHi", False, (None, "Hi")),  # an empty reasoning is none
    ("Paris. <think>no</think>", False, (None, "Paris. <think>no</think>")),  # only at the start
    ("<think>cut short by max_tokens ", False, ("cut short by max_tokens", "")),
    ("still thinking", True, ("still thinking", "")),
    ("<thin", False, (None, "<thin")),
    ("Paris.", False, (None, "Paris.")),
]


def pieces_of(text: str, opened: bool, cuts: list[int]) -> tuple[list[tuple[str, str]], ReasoningSplitter]:
    splitter, out, last = ReasoningSplitter(opened), [], 0
    for cut in [*cuts, len(text)]:
        out += splitter.feed(text[last:cut])
        last = cut
    return out + splitter.feed("", final=True), splitter


@pytest.mark.parametrize("text,opened,expect", CASES)
def test_whole_and_streamed_answers_split_alike(text, opened, expect):
    reasoning, content = split_reasoning(text, opened)
    assert (reasoning or None, content) == expect
    rng = random.Random(text)
    for cuts in [list(range(1, len(text)))] + [
        sorted(rng.sample(range(len(text)), rng.randint(0, 4))) for _ in range(50)
    ]:
        out, splitter = pieces_of(text, opened, cuts)
        got = "".join(t for kind, t in out if kind == REASONING), "".join(t for kind, t in out if kind == CONTENT)
        assert (got[0] if splitter.reasoned else None, got[1]) == (reasoning, content), cuts
        for kind, piece in out:  # reasoning never ends in a partial </think> or the whitespace before it
            assert kind == CONTENT or not piece.endswith(("<", "</", "</think", " ", "\n")), (cuts, out)


def test_the_parser_flag_and_its_auto_detection(tokenizer):
    assert REASONING_PARSERS == ("auto", "think", "none")
    with pytest.raises(ConfigError, match="reasoning_parser must be one of"):
        EngineConfig.from_dict({"model": {"id": "m"}, "serving": {"reasoning_parser": "r1"}}).validate()
    assert not reasoning_parser("auto", tokenizer), "SmolLM2's template writes no <think>"
    assert reasoning_parser("auto", with_template(tokenizer, THINK_TEMPLATE))
    assert reasoning_parser("think", tokenizer) and not reasoning_parser(
        "none", with_template(tokenizer, THINK_TEMPLATE)
    )


def streamed_reasoning(chunks) -> str:
    return "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)


def test_reasoning_content_whole_and_streamed_beside_tool_calls(tokenizer, serve):
    server = serve(with_template(tokenizer, THINK_TEMPLATE))
    answer = "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny."
    server.script(answer)
    whole = server.client.chat.completions.create(model="scripted", messages=ASK)
    message = whole.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("The user wants Paris.", "It is sunny.")
    server.script(answer)
    chunks = list(server.client.chat.completions.create(model="scripted", messages=ASK, stream=True))
    final, _ = accumulate(chunks)
    assert final.choices[0].message.content == "It is sunny."
    assert streamed_reasoning(chunks) == "The user wants Paris."
    # the tool calls are read from the content only
    calling = "<think>I need the weather.</think>\n" + hermes_call("get_weather", {"city": "Paris"})
    for stream in (False, True):
        server.script(calling)
        reply = server.client.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER], stream=stream)
        chunks = list(reply) if stream else []
        choice = accumulate(chunks)[0].choices[0] if stream else reply.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
        thought = streamed_reasoning(chunks) if stream else choice.message.model_extra["reasoning_content"]
        assert thought == "I need the weather."
    # completions are text as generated
    server.script(answer)
    assert server.client.completions.create(model="scripted", prompt="hi", max_tokens=64).choices[0].text == answer


def test_a_prompt_that_opens_the_reasoning_and_the_parser_turned_off(tokenizer, serve):
    server = serve(with_template(tokenizer, OPENED_TEMPLATE))
    server.script("Sunny, I recall.\n</think>\n\nSunny.")
    message = server.client.chat.completions.create(model="scripted", messages=ASK).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("Sunny, I recall.", "Sunny.")
    off = serve(with_template(tokenizer, OPENED_TEMPLATE), reasoning_parser="none")
    off.script("Sunny, I recall.\n</think>\n\nSunny.")
    message = off.client.chat.completions.create(model="scripted", messages=ASK).choices[0].message
    assert message.content == "Sunny, I recall.\n</think>\n\nSunny." and "reasoning_content" not in message.model_extra
