"""`response_format`: JSON mode and JSON schemas, compiled by llguidance into token constraints that the
engine applies after each round's verify (runtime/constrained.py), so constrained output stays what the
target decodes under the grammar, token for token, and keeps speculation."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ..runtime.constrained import ConstraintError
from .protocol import bad_request

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def response_format_grammar(body: dict, ignore_eos: bool = False, keeps_logits: bool = True) -> str | None:
    """The llguidance grammar of a request's `response_format` (None: plain text); 400 for bad forms, with
    `ignore_eos`, or on a server that keeps no logits to choose allowed tokens from (--max-logprobs 0)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise bad_request(
            "'response_format' must be an object whose 'type' is one of " + ", ".join(RESPONSE_FORMATS),
            "response_format",
        )
    if kind == "text":
        return None
    if ignore_eos:
        raise bad_request("'ignore_eos' cannot go with a 'response_format': the grammar ends the text", "ignore_eos")
    if not keeps_logits:
        raise bad_request(
            "this server keeps no logits to constrain decoding with (it was started with --max-logprobs 0)",
            "response_format",
        )
    schema: dict = {"type": "object"}  # JSON mode: one JSON object
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if schema is True:  # the schema that allows any JSON value
            schema = {}
        if not isinstance(schema, dict):
            raise bad_request(
                "'response_format.json_schema' must be an object with a 'schema' object", "response_format"
            )
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(schema)
    except ValueError as exc:
        raise bad_request(f"'response_format' schema: {exc}", "response_format") from None


def llguidance_tokenizer(tokenizer, vocab_size: int, eos: list[int] | None):
    """llguidance's form of a `tokenizers` tokenizer, or of a tiktoken one shipped as code (Kimi K2's keeps
    its tiktoken.Encoding as `model`), over the model's vocabulary (often padded past the tokenizer's);
    400 for other kinds."""
    import tiktoken
    from llguidance import LLTokenizer
    from llguidance.tiktoken import lltokenizer_from_encoding

    n_vocab = max(vocab_size, len(tokenizer))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return LLTokenizer(tokenizer_json(backend.to_str()), n_vocab=n_vocab, eos_token=eos)
    encoding = getattr(tokenizer, "model", None)
    if isinstance(encoding, tiktoken.Encoding):
        return lltokenizer_from_encoding(encoding, n_vocab=n_vocab, eos_token=eos)
    raise bad_request(
        f"'response_format' needs a tokenizers or tiktoken tokenizer; this model has {type(tokenizer).__name__}",
        "response_format",
    )


def tokenizer_json(text: str) -> str:
    """A `tokenizers` JSON as llguidance reads token bytes from it. A byte-level BPE (ByteLevel
    pre-tokenizer) converted from GGUF gets a generic decoder chain (byte fallback, then byte level), which
    llguidance would read as SentencePiece pieces ("Ġ" as itself, not a space): it gets its byte-level
    decoder alone. Padding and truncation are off, as for encoding a grammar's strings."""
    spec = json.loads(text)
    spec["padding"] = spec["truncation"] = None
    decoder = spec.get("decoder") or {}
    chain = [d.get("type") for d in decoder.get("decoders", [])] if decoder.get("type") == "Sequence" else []
    if (spec.get("pre_tokenizer") or {}).get("type") == "ByteLevel" and "ByteLevel" in chain:
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
        spec["model"]["byte_fallback"] = False
    return json.dumps(spec)


class GrammarConstraint:
    """One request's llguidance matcher, as the engine's Constraint."""

    def __init__(self, matcher, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.matcher, self.vocab_size, self.stop_token_ids = matcher, vocab_size, stop_token_ids

    def validate(self, tokens: list[int]) -> int:
        if self.matcher.is_stopped():  # the grammar is complete: an EOS token ends the text
            return int(bool(tokens) and tokens[0] in self.stop_token_ids)
        return self.matcher.validate_tokens(tokens)

    def consume(self, tokens: list[int]) -> None:
        done = self.matcher.try_consume_tokens(tokens) if tokens else 0
        # a complete grammar takes nothing more: the EOS token validate() allowed after it ends the text
        if done < len(tokens) and not self.matcher.is_stopped():
            error = self.matcher.get_error() or f"token {tokens[done]} refused"
            raise ConstraintError(f"the response_format grammar failed: {error}")

    def allowed(self) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.zeros(self.vocab_size, dtype=bool)
        n = min(len(bits), self.vocab_size)  # the model's vocabulary may be padded past the tokenizer's
        allowed[:n] = bits[:n]
        if self.matcher.is_error() or not allowed.any():
            error = self.matcher.get_error() or "no token of this model's vocabulary is allowed next"
            raise ConstraintError(f"the response_format grammar allows nothing here: {error}")
        return torch.from_numpy(allowed)


class Grammars:
    """Builds matchers for one server's tokenizer: its llguidance form is made once, on first use (about a
    second), on the preparation thread. Compiled grammars are kept (the `cached` most recently used), so a
    schema that requests repeat is compiled once and each request gets a copy of its fresh matcher."""

    def __init__(self, tokenizer, engine, stop_token_ids: tuple[int, ...], cached: int = 64):
        self.tokenizer, self.engine, self.stop_token_ids = tokenizer, engine, stop_token_ids
        self._lock = threading.Lock()
        self._ll = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar -> its matcher, never advanced
        self.cached, self.compiles = cached, 0

    @property
    def vocab(self) -> int:
        """The model's vocabulary size (read when a grammar first needs it)."""
        return self.engine.target.config.vocab_size

    def ll_tokenizer(self):
        """llguidance's tokenizer of the model (made once; any thread); 400 for tokenizers it cannot read."""
        with self._lock:
            if self._ll is None:
                self._ll = llguidance_tokenizer(self.tokenizer, self.vocab, list(self.stop_token_ids) or None)
            return self._ll

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh matcher for `grammar` (from response_format_grammar); 400 when it does not compile."""
        from llguidance import LLMatcher

        with self._lock:
            pristine = self._compiled.get(grammar)
            if pristine is not None:
                self._compiled.move_to_end(grammar)
        if pristine is None:
            pristine = LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
            if pristine.is_error():
                raise bad_request(f"'response_format' does not compile: {pristine.get_error()}", "response_format")
            with self._lock:
                self.compiles += 1
                self._compiled[grammar] = pristine
                while len(self._compiled) > self.cached:
                    self._compiled.popitem(last=False)
        with self._lock:  # a copy, made while no other thread copies the same matcher
            matcher = pristine.deep_copy()
        return GrammarConstraint(matcher, self.vocab, self.stop_token_ids)
