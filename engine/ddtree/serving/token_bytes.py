"""Each token's own bytes, for log-probabilities.

A byte-level token may hold part of a character (an emoji, a CJK character): decoded alone it reads
"\ufffd", so two such tokens would look alike and their bytes would be U+FFFD's. OpenAI's log-probabilities
carry each token's UTF-8 bytes, so that clients can join characters split across tokens, and name a
token that is not whole UTF-8 by its bytes ("bytes:\\xe6\\x97"). The bytes come from the tokenizer's
vocabulary as llguidance reads it (`tokenizers` and tiktoken tokenizers); special tokens, and tokenizers
of other kinds, fall back to decoding the token alone.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class TokenBytes:
    """`token_bytes(id)`: a token's bytes; `name(id)`: its name and bytes for a log-probability entry.
    Used on the engine thread only."""

    def __init__(self, tokenizer, llguidance: Callable[[], object] | None = None):
        """`llguidance`: makes llguidance's LLTokenizer of `tokenizer` (or raises when it cannot)."""
        self.tokenizer = tokenizer
        self._llguidance = llguidance
        self._ll: object | None = None
        self._ready = False
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._own = getattr(tokenizer, "token_bytes", None)  # tokenizers that know them (random models')

    def _vocabulary(self):
        if not self._ready:
            self._ready = True
            try:
                self._ll = self._llguidance() if self._llguidance is not None else None
            except Exception:  # a tokenizer llguidance cannot read: decode tokens alone
                self._ll = None
        return self._ll

    def __call__(self, token: int) -> bytes:
        if self._own is not None:
            return self._own(token)
        ll = self._vocabulary()
        if ll is not None and token not in self.special:
            return ll.decode_bytes([token])  # type: ignore[attr-defined]
        return self.tokenizer.decode([token]).encode("utf-8", "surrogatepass")

    def name(self, token: int) -> tuple[str, bytes]:
        """The token's text, or "bytes:\\x.." where its bytes are not whole UTF-8; and its bytes."""
        data = self(token)
        try:
            return data.decode("utf-8"), data
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


class TextOffsets:
    """The characters each token of a completion adds to its text, tokens fed in order: a token holding
    the start of a character adds none, the one that completes it adds it."""

    def __init__(self, token_bytes: TokenBytes, skip_special_tokens: bool):
        self.token_bytes, self.skip_special = token_bytes, skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def chars(self, token: int, data: bytes) -> int:
        if token in self.token_bytes.special and self.skip_special:
            return 0  # not in the text
        return len(self._utf8.decode(data))
