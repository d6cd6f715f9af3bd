"""response_format's grammars (serving/grammar.py) on small tokenizers built here: a byte-level BPE in the
shape transformers converts GGUF tokenizers to, and a tiktoken tokenizer shipped as code (as Kimi K2's is)."""

import base64
import json
import pathlib
import shutil
from types import SimpleNamespace

import pytest

from ddtree.serving.grammar import Grammars, response_format_grammar, tokenizer_json
from ddtree.serving.protocol import APIError
from tiny_models import byte_level_chars

JSON_TEXT = '{"a": 1}'
EOS = 257


def engine_of(vocab: int):
    """What Grammars reads of the engine: the model's vocabulary size."""
    return SimpleNamespace(target=SimpleNamespace(config=SimpleNamespace(vocab_size=vocab)))


@pytest.fixture(scope="module")
def gguf_style_tokenizer():
    """A byte-level BPE whose decoder chain is the one transformers gives tokenizers converted from GGUF
    (byte fallback, fuse, "▁" to space, byte level), and its EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = byte_level_chars()
    vocab = {chars[b]: b for b in range(256)}
    merges = [("Ġ", "1")]
    vocab["Ġ1"] = 256
    vocab["<eos>"] = EOS
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " "), decoders.ByteLevel()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_json_mode_on_a_gguf_converted_byte_level_tokenizer(gguf_style_tokenizer):
    tokens = gguf_style_tokenizer.encode(JSON_TEXT, add_special_tokens=False)
    assert gguf_style_tokenizer.decode(tokens) == JSON_TEXT and 256 in tokens, "the space is inside 'Ġ1'"
    grammars = Grammars(gguf_style_tokenizer, engine_of(320), (EOS,))
    constraint = grammars.constraint(response_format_grammar({"response_format": {"type": "json_object"}}))
    assert constraint.validate(tokens + [EOS]) == len(tokens) + 1
    allowed = constraint.allowed()
    assert allowed.shape == (320,) and allowed[ord("{")] and not allowed[ord("x")] and not allowed[EOS]
    constraint.consume(tokens)
    assert constraint.allowed().nonzero().flatten().tolist() == [EOS], "a complete object ends the text"
    assert constraint.validate([EOS, 5]) == 1 and constraint.validate([5]) == 0


def test_a_repeated_grammar_is_compiled_once_and_each_request_gets_its_own_matcher(gguf_style_tokenizer):
    grammars = Grammars(gguf_style_tokenizer, engine_of(320), (EOS,), cached=1)
    json_mode = response_format_grammar({"response_format": {"type": "json_object"}})
    first, second = grammars.constraint(json_mode), grammars.constraint(json_mode)
    assert grammars.compiles == 1
    tokens = gguf_style_tokenizer.encode(JSON_TEXT, add_special_tokens=False)
    first.consume(tokens)
    assert first.allowed().nonzero().flatten().tolist() == [EOS]
    assert second.allowed()[ord("{")] and not second.allowed()[EOS], "the second matcher is still at the start"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    other = response_format_grammar({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    grammars.constraint(other)  # the cache holds one grammar: json mode goes
    grammars.constraint(json_mode)
    assert grammars.compiles == 3


def test_the_gguf_decoder_chain_is_read_as_byte_level(gguf_style_tokenizer):
    """As converted, llguidance would read "Ġ" as the two bytes of its UTF-8, not as a space."""
    from llguidance import LLMatcher, LLTokenizer

    raw = gguf_style_tokenizer.backend_tokenizer.to_str()
    grammar = response_format_grammar({"response_format": {"type": "json_object"}})
    tokens = gguf_style_tokenizer.encode(JSON_TEXT, add_special_tokens=False)
    as_converted = LLMatcher(LLTokenizer(raw, eos_token=EOS), grammar, log_level=0)
    assert as_converted.validate_tokens(tokens) < len(tokens)
    fixed = json.loads(tokenizer_json(raw))
    assert fixed["decoder"]["type"] == "ByteLevel" and fixed["model"]["byte_fallback"] is False
    assert LLMatcher(LLTokenizer(tokenizer_json(raw), eos_token=EOS), grammar, log_level=0).validate_tokens(
        tokens
    ) == len(tokens)


def test_json_schema_on_a_tiktoken_tokenizer_shipped_as_code(tmp_path):
    from transformers import AutoTokenizer

    shutil.copy(pathlib.Path(__file__).parent / "data" / "remote_tokenizer" / "tokenization_tiny.py", tmp_path)
    ranks = [bytes([b]) for b in range(256)] + [b'{"', b'":']
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks))
    )
    auto_map = {"AutoTokenizer": ["tokenization_tiny.TinyTikToken", None]}
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TinyTikToken", "auto_map": auto_map})
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)
    eos = tokenizer.eos_token_id
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    constraint = Grammars(tokenizer, engine_of(eos + 1), (eos,)).constraint(response_format_grammar(body))
    good = tokenizer.encode('{"a": 12}')
    assert good[0] == 256, "'{\"' is one token"
    assert constraint.validate(good + [eos]) == len(good) + 1
    assert constraint.validate(tokenizer.encode('{"b": 12}')) == 1, "only the schema's key"


@pytest.mark.parametrize(
    "response_format,needle",
    [
        ("json", "'type' is one of"),
        ({"type": "xml"}, "'type' is one of"),
        ({"type": "json_schema"}, "'schema' object"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "'schema' object"),
    ],
)
def test_malformed_response_formats_are_400s(response_format, needle):
    with pytest.raises(APIError, match=needle) as caught:
        response_format_grammar({"response_format": response_format})
    assert caught.value.status == 400 and caught.value.param == "response_format"


def test_text_and_absent_response_formats_need_no_grammar():
    assert response_format_grammar({}) is None
    assert response_format_grammar({"response_format": {"type": "text"}}) is None


def test_a_schema_that_does_not_compile_is_a_400(gguf_style_tokenizer):
    grammars = Grammars(gguf_style_tokenizer, engine_of(320), (EOS,))
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}
    with pytest.raises(APIError, match="does not compile"):
        grammars.constraint(response_format_grammar(body))


def test_a_grammar_needs_the_eos_and_the_kept_logits():
    body = {"response_format": {"type": "json_object"}}
    with pytest.raises(APIError, match="ignore_eos"):
        response_format_grammar(body, ignore_eos=True)
    with pytest.raises(APIError, match="--max-logprobs 0"):
        response_format_grammar(body, keeps_logits=False)
    assert response_format_grammar({"response_format": {"type": "text"}}, ignore_eos=True, keeps_logits=False) is None
