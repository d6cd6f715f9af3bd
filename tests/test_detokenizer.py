"""The scheduler's incremental detokenizer: streamed pieces add up to the text, with no broken characters,
through tokenizers' DecodeStream (fast tokenizers) and through the window fallback (any other)."""

from __future__ import annotations

import pytest

from ddtree.serving.detokenizer import IncrementalDetokenizer

TEXT = (
    "Héllo wörld 😀 — 世界! The END is near, but not yet. 🤖🤖 ñandú\n"
    "def f(x):\n\treturn x ** 2  # ±∞\n"
    "  leading spaces,   runs of them, and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 outside the BMP.\n"
)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids] + [detok.flush()]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from ddtree.models.checkpoint import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A Llama-style tokenizer: SentencePiece's '▁' for spaces (a leading one decoded away at the start, so
    a piece depends on the token before it) and bytes for every character outside its small vocabulary."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for piece in [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + list(string.ascii_letters + string.digits + ".,!?"):
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "n"), ("▁n", "e"), ("e", "a"), ("▁ne", "a")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_fast_byte_level_tokenizer_streams_the_whole_text(smollm2_tokenizer, skip_special_tokens):
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT + "<|im_end|>" + TEXT)  # a special token in the middle
    want = tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    fast = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens)
    assert fast.stream is not None, "SmolLM2's tokenizer is a fast one: it streams through DecodeStream"
    window = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens)
    window.stream = None  # the fallback, on the same tokenizer
    for detok in (fast, window):
        pieces = stream(detok, ids)
        assert "".join(pieces) == want
        assert all("\ufffd" not in p for p in pieces), "a multi-byte character split across pieces"
        assert sum(1 for p in pieces if p) > len(ids) // 2, "text streams as it comes, not at the end"


def test_a_sentencepiece_tokenizer_keeps_the_leading_space_after_the_prompt(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    prompt, reply = tok.encode("The END is"), tok.encode(" near, 😀 but not yet. Über 世界", add_special_tokens=False)
    ids = prompt + reply
    # the reply as it reads after the prompt: its first space stays (decoding it alone would strip it)
    whole, before = (tok.decode(t, clean_up_tokenization_spaces=False) for t in (ids, prompt))
    want = whole[len(before) :]
    assert want.startswith(" near") and any(f"<0x{b:02X}>" in tok.convert_ids_to_tokens(reply) for b in range(128, 256))
    for use_stream in (True, False):
        detok = IncrementalDetokenizer(tok, prompt)
        assert detok.stream is not None
        if not use_stream:
            detok.stream = None
        pieces = stream(detok, reply)
        assert "".join(pieces) == want, use_stream
        assert all("\ufffd" not in p for p in pieces)


def test_a_tokenizer_without_a_rust_backend_takes_the_window_fallback():
    from ddtree.models.random import ByteTokenizer

    tok = ByteTokenizer(1000)
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt: "))
    assert detok.stream is None
    pieces = stream(detok, ids)
    assert "".join(pieces) == TEXT and all("\ufffd" not in p for p in pieces)


def test_flush_gives_an_incomplete_character_at_the_end(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ok 😀")[:-1]  # the emoji's last byte never comes
    for use_stream in (True, False):
        detok = IncrementalDetokenizer(tok)
        if not use_stream:
            detok.stream = None
        pieces = [detok.push(t) for t in ids]
        assert "".join(pieces).startswith("ok") and all("\ufffd" not in p for p in pieces), use_stream
        held = detok.flush()
        assert held.endswith("\ufffd") and "".join(pieces) + held == tok.decode(ids)
        assert detok.flush() == ""
