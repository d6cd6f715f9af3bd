"""Token ids in, text out, one token at a time, never splitting a UTF-8 character across deltas."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """The text each new token adds, held back while it ends in an incomplete multi-byte character.

    A fast (Rust) tokenizer streams through its own decoder (tokenizers' DecodeStream: on the SmolLM2
    tokenizer a fifth of the fallback's time per token, on one CPU core). Any other tokenizer takes
    the fallback: decode a small window of recent tokens with and without the new one and return the
    difference, holding back text while it ends in U+FFFD. A few prompt tokens seed the window (and the
    stream) so that tokenizers whose pieces depend on the previous token (SentencePiece leading spaces)
    decode the first generated token correctly."""

    def __init__(self, tokenizer, context: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        ctx = list(context[-4:])
        if ctx and self._decode(ctx).endswith("\ufffd"):
            ctx = []
        self.ids = ctx
        self.prefix = 0  # window start
        self.read = len(ctx)  # tokens up to here are already in the output
        backend = getattr(tokenizer, "_tokenizer", None)
        self.backend = backend if isinstance(backend, Tokenizer) else None
        self.stream = None
        if self.backend is not None:
            try:
                self.stream = DecodeStream(ctx, skip_special_tokens)
            except TypeError:  # a tokenizers release whose DecodeStream takes no prompt ids: the fallback
                self.backend = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self.stream is not None:
            piece = self.stream.step(self.backend, token)
            if piece is None:  # an incomplete character: held back
                return ""
            self.prefix, self.read = self.read, len(self.ids)  # flush's window follows the stream
            return piece
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of the request, incomplete characters included)."""
        if self.read >= len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
